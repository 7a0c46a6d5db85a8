"""What every loader is: the `Loader` protocol the trainer and the evaluator use, and `EpochPosition`,
the epoch and batch position each backend keeps (fasttrain.data re-exports both)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch


class Loader(Protocol):
    """What the trainer and the evaluator use of a loader, whichever the backend."""

    normalized: bool
    """True: images are already float, normalised, NHWC (DALI); False: uint8 NHWC."""
    num_records: int
    """Records in the split, all ranks together."""
    epoch: int
    """The epoch __iter__ yields (set_epoch moves it)."""
    skipped: int
    """Corrupt records skipped so far with skip_corrupt (0 for backends that cannot skip)."""
    description: str
    """The pipeline in words, for the trainer's start-up line: backend, then loader or decoder."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of this rank's (images (N, H, W, C), labels (N,)) batches.

        Built by build_loader as it is by default, each batch is the caller's own: kept (a list of an
        epoch's batches), it stays what it was. Built with reuse_buffers=True, a batch of the torch
        thread loader is a view of a reused buffer, valid only until `hold` more batches have been
        requested (fasttrain.data.thread_loader). The synthetic loader hands out the same two tensors
        every time: keep them, but do not write into them.
        """
        ...

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (shard order, shuffle buffer, augmentation seeds)."""
        ...

    def state_dict(self) -> dict:
        """{'epoch': e, 'batch': b}: where a resume continues, exactly."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


class EpochPosition:
    """The epoch and batch position every loader keeps: what state_dict saves and a resume restores.

    A loader calls `_begin_epoch()` at the start of __iter__ (the batch to start from) and advances
    `_position` as it yields batches.
    """

    epoch = 0
    skipped = 0  # the torch backend counts skip_corrupt's skipped records; the others never skip
    _position = 0  # batches of this epoch handed out so far
    _resume = 0  # where the next __iter__ starts (set by load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume = self._position = 0  # a loaded position belongs to the loaded epoch only
        self.epoch = epoch

    def state_dict(self) -> dict:
        # skipped: the run's count so far (metrics.jsonl's skipped_records), which a resume goes on from:
        # the batches before its position are not read again, so their skips would not be counted again.
        return {"epoch": self.epoch, "batch": self._position, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._resume = int(state["epoch"]), int(state["batch"])
        self._position = self._resume
        self.skipped = int(state.get("skipped", 0))  # 0: a checkpoint from before it was kept

    def _begin_epoch(self) -> int:
        start, self._resume = self._resume, 0
        self._position = start
        return start


def batch_stream(loader, accum: int):
    """Endless lists of `accum` (images, labels) batches, moving to the next epoch as needed. A step's
    micro-batches come from one epoch: an epoch's last len(loader) % accum batches are not trained on,
    as an epoch's last partial batch is not (a resume's data position counts them the same way)."""
    while True:
        group = []
        for images, labels in loader:
            group.append((images, labels))
            if len(group) == accum:
                yield group
                group = []
        loader.set_epoch(loader.epoch + 1)
