"""fasttrain/data/seeding.py: the reused generator's state and draws against np.random.default_rng's own."""

import numpy as np
import pytest

from fasttrain.data.seeding import SampleGenerator, integers, next_double, pcg64_state, pcg_views

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
        # A loader's generator draws them in one kernel from its PCG64 state (the GIL kept): the
        # same four numbers and coin, and the state left where the uniforms leave it.
        ours = SampleGenerator().seeded((seed, 1, 2))
        ref = np.random.default_rng([seed, 1, 2])
        ordering = int(ref.integers(0, 2))
        expected = [ordering] + [float(np.float32(ref.uniform(lo, hi))) for lo, hi in ranges]
        got = sample_color(ours)
        assert [got.ordering, got.brightness, got.saturation, got.hue, got.contrast] == expected
        assert ours.random() == ref.random() and ours.integers(0, 5) == ref.integers(0, 5)


def test_the_kernels_draw_from_the_generators_state_as_it_does():
    """next_double / integers step the PCG64 through its C state as Generator.random / .integers do:
    the same values, and the Generator left where its own draws leave it (has_uint32 included)."""
    generator = SampleGenerator()
    rng = np.random.default_rng(1)
    for _ in range(100):
        key = tuple(int(v) for v in rng.integers(0, 2**62, size=3))
        ours, fresh = generator.seeded(key), np.random.default_rng(list(key))
        assert ours.pcg is not None and ours.bit_generator.state == fresh.bit_generator.state
        words, buffer = ours.pcg
        for high in (1, 2, 3, 1, 7, 1000, 2**31 - 1, 2**32 - 1, 5):  # 1 draws nothing
            assert integers(words, buffer, high) == fresh.integers(0, high)
            assert next_double(words) == fresh.random()
        integers(words, buffer, 9)  # half a 64-bit draw left in the buffer
        fresh.integers(0, 9)
        assert ours.bit_generator.state == fresh.bit_generator.state
        assert ours.uniform(0.5, 1.5) == fresh.uniform(0.5, 1.5)  # the Generator goes on from there


def test_pcg_views_see_the_state_numpy_sets():
    bit_generator = np.random.PCG64(3)
    words, buffer = pcg_views(bit_generator)
    state = {"state": (11 << 64) | 12, "inc": (13 << 64) | 15}
    bit_generator.state = {"bit_generator": "PCG64", "state": state, "has_uint32": 1, "uinteger": 99}
    assert words.tolist() == [12, 11, 15, 13] and buffer.tolist() == [1, 99]


@pytest.mark.parametrize("key", KEYS)
def test_seeded_is_default_rng_on_either_path(key):
    """Three values below 2^63 go to the kernel (_seed_into), the rest to pcg64_state."""
    assert (
        SampleGenerator().seeded(key).bit_generator.state
        == np.random.default_rng(list(key)).bit_generator.state
    )
