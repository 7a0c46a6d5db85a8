"""The errors fasttrain raises for things a user can fix, and how the command line words them.

Library code (models, data, distributed, checkpoints) raises these with plain messages that name the
settings involved by their `Config` field names ("sync_bn needs CUDA devices"), and lists those names
in `settings`. The commands (python -m fasttrain, fasttrain.evaluate, fasttrain.tf.convert) print one
line on stderr with each of them shown as the flag a user types (`print_error`, `flag_text`: "--sync_bn
needs CUDA devices") and exit with `exit_code`.
"""

from __future__ import annotations

import re
import sys


class FasttrainError(Exception):
    """A problem the user can act on; the command line prints it in one line, without a traceback.

    settings: the Config fields the message names (as plain words), for the command line to show as
    flags.
    """

    def __init__(self, message: str, *, settings: tuple[str, ...] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


class SettingError(FasttrainError, ValueError):
    """A setting's value cannot work here (the command line exits 2 for it, as for a bad flag)."""


def flag_text(err: BaseException, spelled: dict[str, str] | None = None) -> str:
    """The message with each of err.settings written as a flag: `sync_bn` -> `--sync_bn`, or as
    `spelled` names it for a command whose flags differ (the data tools' `--cache-dir`).

    Only whole words are replaced, and not inside a path or a longer name (`runs/sync_bn` and
    `--sync_bn` stay as they are), nor a package after "install " (`pip install tensorboard`).
    """
    text = str(err)
    for name in getattr(err, "settings", ()):
        flag = (spelled or {}).get(name, f"--{name}")
        text = re.sub(rf"(?<![\w/.-])(?<!install ){re.escape(name)}(?![\w/])", flag, text)
    return text


def print_error(err: BaseException) -> None:
    """One line on stderr, the settings the error names written as flags."""
    # One write, newline included: print() writes the text and the newline separately, and under
    # torchrun two ranks' lines on one pipe then ran together ("...firstfasttrain: error: ...").
    sys.stderr.write(f"fasttrain: error: {flag_text(err)}\n")
    sys.stderr.flush()


def exit_code(err: BaseException) -> int | None:
    """2 for a bad flag or setting, 1 for the other errors a user can fix (data, checkpoints, a run that
    cannot continue), None for anything else (a bug: let its traceback through)."""
    if isinstance(err, SettingError):  # config.ConfigError, the flag layer's, is one too
        return 2
    return 1 if isinstance(err, FasttrainError) else None
