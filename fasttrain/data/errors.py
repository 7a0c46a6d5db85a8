"""The errors of input data: what every part of fasttrain.data raises for a bad data directory, shard or
record (fasttrain.data re-exports them: `from fasttrain.data import DataError` is the public spelling)."""

from __future__ import annotations

from fasttrain.errors import FasttrainError, SettingError


class DataError(FasttrainError, RuntimeError):
    """Bad input data (missing directory, no shards, corrupt record): printed in one line."""


class LabelRangeError(DataError, SettingError):
    """A stored label outside [0, num_classes) after label_offset: the settings do not fit the data.

    A DataError, so every place that turns data errors into one line handles it, and a SettingError,
    so the CLI exits 2 for it; never skipped by skip_corrupt (a wrong num_classes or label_offset would
    otherwise drop whole classes from training and evaluation without a word).
    """


class ShardReadError(DataError):
    """A shard that cannot be opened or read any more (deleted or moved while training, permissions, an
    I/O error): never skipped by skip_corrupt, which is for bad records, not for a missing file (every
    record of it would be skipped, one line each)."""


def error_reason(error: Exception) -> str:
    """A data error's reason without its advice (the part before the first ';'): for a record skipped
    by skip_corrupt (the advice would say to train with skip_corrupt, already on), or one another
    backend reports (the torch reader's advice is not DALI's)."""
    return str(error).split(";")[0]
