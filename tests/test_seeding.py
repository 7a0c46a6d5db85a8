"""fasttrain/data/seeding.py: the reused generator's state and draws against np.random.default_rng's own."""

import numpy as np
import pytest

from fasttrain.data.seeding import SampleGenerator, pcg64_state

KEYS = [
    (0, 0, 0),
    (1, 2, 3),
    (0x2A, 7, 1_281_166),  # a seed, an epoch, a position in ImageNet's train set
    (2**32 - 1, 0, 2**32),  # a word's top value; a position needing two words
    (12345678901234567890, 3, 99),  # three words
    (5,),
    (1, 2, 3, 4, 5, 6),  # more entropy words than the pool's 4
]


@pytest.mark.parametrize("key", KEYS)
def test_state_is_default_rngs(key):
    assert pcg64_state(key) == np.random.default_rng(list(key)).bit_generator.state


def test_reused_generator_draws_as_a_fresh_one():
    generator = SampleGenerator()
    rng = np.random.default_rng(0)
    for _ in range(200):
        key = tuple(int(v) for v in rng.integers(0, 2**40, size=3))
        ours, fresh = generator.seeded(key), np.random.default_rng(list(key))
        # The mix the samplers use: 32-bit bounded integers (which cache half a 64-bit draw), doubles.
        for draw in (lambda g: g.integers(0, 7), lambda g: g.random(), lambda g: g.integers(0, 2**40)):
            assert draw(ours) == draw(fresh)
        ours.integers(0, 3)  # leave half a 64-bit draw cached: the next seeding must drop it
        fresh.integers(0, 3)
        assert ours.uniform(0.5, 1.5) == fresh.uniform(0.5, 1.5)


def test_negative_entropy_is_refused_like_seedsequence():
    with pytest.raises(ValueError):
        np.random.default_rng([-1])
    with pytest.raises(ValueError):
        pcg64_state((-1,))


def test_colour_draws_are_generator_uniforms():
    # sample_color draws its four parameters with one rng.random(4); the reference is the seed's
    # four rng.uniform calls, as the sampler made them before (numpy's own arithmetic).
    from fasttrain.data.color import sample_color

    for seed in range(300):
        ref = np.random.default_rng(seed)
        ordering = int(ref.integers(0, 2))
        ranges = [(-32 / 255, 32 / 255), (0.5, 1.5), (-0.2, 0.2), (0.5, 1.5)]
        expected = [ordering] + [float(np.float32(ref.uniform(lo, hi))) for lo, hi in ranges]
        got = sample_color(np.random.default_rng(seed))
        assert [got.ordering, got.brightness, got.saturation, got.hue, got.contrast] == expected
