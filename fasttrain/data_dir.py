"""The data directory a run reads: --data_dir as given, or, for the demo recipe without one, a synthetic
ImageNet-layout set built once in the cache (on each node: caches need not be shared)."""

from __future__ import annotations

from pathlib import Path

import torch

from fasttrain.config import Config, default_cache_dir
from fasttrain.errors import SettingError

# The demo's synthetic set: 2,560 training images of 10 classes (80 steps of 32 per epoch, so the
# demo's 300 steps see each image a few times) and 1,280 validation images; a fixed seed, so every
# machine builds the same files (change them together with the cache name, demo-imagenet-v1).
DEMO_DATA = dict(train_shards=4, val_shards=2, per_shard=640, classes=10, seed=1234)


def prepare_data_dir(cfg: Config, info, log) -> Path | None:
    """cfg.data_dir checked; for the demo with no --data_dir, a synthetic set built once in the cache;
    None for --data_backend=synthetic without --data_dir (random device batches read no files)."""
    if cfg.data_backend == "synthetic" and not cfg.data_dir:
        return None
    if cfg.data_dir:
        path = Path(cfg.data_dir)
        if not path.is_dir():
            raise SettingError(
                f"data_dir {path} does not exist or is not a directory", settings=("data_dir",)
            )
        return path
    if cfg.recipe != "demo":
        raise SettingError(
            f"data_dir is required for recipe {cfg.recipe or 'none (the base Config)'} "
            "(the TFRecord shards directory)",
            settings=("data_dir",),
        )
    from fasttrain.data.synthetic import ensure_synthetic

    cache = Path(cfg.data_cache_dir) if cfg.data_cache_dir else default_cache_dir()
    target = cache / "demo-imagenet-v1"
    if info.local_rank == 0 and not (target / "DONE").exists():  # each node's: caches need not be shared
        log(f"building the demo data set (synthetic ImageNet-layout TFRecords) in {target} ...")
        try:  # another first run may be building it: ensure_synthetic waits for it and uses its set
            ensure_synthetic(target, **DEMO_DATA)
        except OSError as e:
            # mkdir's "File exists" for a file where the directory goes said nothing of the file.
            why = f"{e.filename} is a file" if e.filename and Path(e.filename).is_file() else e.strerror
            raise SettingError(
                f"cannot build the demo data set in {cache} ({why}); set data_cache_dir "
                "to a writable directory",
                settings=("data_cache_dir",),
            ) from None
    if info.world_size > 1:
        torch.distributed.barrier()
    return target
