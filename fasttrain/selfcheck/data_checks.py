"""The input's fast path that depends on the machine: the loader threads' fused decode."""

from __future__ import annotations

import numpy as np

from fasttrain.selfcheck.common import Context, Skip


def check_fused_decode(ctx: Context) -> str:
    """The three seeds' train transforms through the fused decode (fasttrain/data/jpeg/fused.py, which
    calls TurboJPEG by address and passes its cropping region as this machine's ABI is assumed to)
    against the separate calls, on a generated JPEG with and without row checkpoints: bit for bit."""
    from fasttrain.data import transforms  # noqa: PLC0415 (numba kernels: loaded when the row runs)
    from fasttrain.data.jpeg import fused  # noqa: PLC0415

    if not fused._supported():
        raise Skip(
            "off on this platform (no TurboJPEG library, or an ABI it does not assume): the loaders "
            "use the separate decode and transform calls"
        )
    was, execute, taken, images = fused.FUSED, fused._execute, [], {}

    def counted(*args):
        taken.append(execute(*args))
        return taken[-1]

    fused.FUSED = True
    problem = fused.check()  # the loaders' own check; it turns FUSED off where it fails
    try:
        assert not problem, problem
        jpeg, checkpoints = fused.warm_up_inputs()
        boxes = np.zeros((0, 4), np.float32)
        fused._execute = counted
        for on in (True, False):  # the fused calls, then the separate ones
            fused.FUSED = on
            for preprocess in ("resnet", "vgg", "inception"):
                for k, cp in enumerate(checkpoints):
                    for seed in range(4):
                        rng = np.random.default_rng(seed)
                        colour = preprocess == "inception"
                        image = transforms.train_transform(
                            jpeg, boxes, rng, 24, preprocess, colour, checkpoints=cp
                        )
                        images.setdefault((preprocess, k, seed), []).append(image)
    finally:
        fused._execute = execute
        fused.FUSED = was and not problem
    declined = taken.count(False)
    assert taken and not declined, f"the fused decode declined {declined} of {len(taken)} test images"
    for (preprocess, _, seed), (ours, theirs) in images.items():
        assert np.array_equal(ours, theirs), (
            f"{preprocess} train image (seed {seed}) differs from the separate calls'"
        )
    return (
        f"ResNet v1.5, vgg and Inception (colour) train images of a test JPEG, {len(images)} in all, with "
        "and without row checkpoints: equal to the separate calls' bit for bit"
    )
