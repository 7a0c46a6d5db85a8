"""A sample's generator, `np.random.default_rng([a, b, c])`, without its 25 us of construction.

default_rng([a, b, c]) is Generator(PCG64(SeedSequence([a, b, c]))). Building the SeedSequence and
the PCG64 costs about 22 us of GIL-held Python per sample; `SampleGenerator` keeps one Generator per
worker and sets its bit generator's state to what that construction would give, computed here:

SeedSequence (numpy/random/bit_generator.pyx), all arithmetic mod 2^32, XSHIFT = 16, pool of 4 words:

    hashmix(v):  v ^= h; h *= MULT_A; v *= h; v ^= v >> 16          (h starts at INIT_A)
    mix(x, y):   r = MIX_L * x - MIX_R * y; r ^ (r >> 16)
    pool[i] = hashmix(entropy[i] or 0), i < 4; then for src != dst: pool[dst] = mix(pool[dst],
    hashmix(pool[src])); then each further entropy word w: pool[dst] = mix(pool[dst], hashmix(w))
    generate_state(4 x uint64): 8 words, word i from pool[i % 4]: v ^= g; g *= MULT_B; v *= g;
    v ^= v >> 16 (g starts at INIT_B); uint64 k = word 2k | word 2k+1 << 32

The entropy words are each integer's little-endian 32-bit chunks (0 gives one word 0).

PCG64 (numpy/random/src/pcg64): seed = u64[0] << 64 | u64[1], inc = u64[2] << 64 | u64[3];
srandom: state = 0, inc = inc << 1 | 1, step, state += seed, step; step: state = state * MULT + inc
(mod 2^128). The result is checked against default_rng itself (tests/test_seeding.py).
"""

from __future__ import annotations

import numba
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_S16 = np.uint64(16)
_INIT_A, _MULT_A = np.uint64(0x43B0D7E5), np.uint64(0x931E8875)
_INIT_B, _MULT_B = np.uint64(0x8B51F9DD), np.uint64(0x58F38DED)
_MIX_L, _MIX_R = np.uint64(0xCA01F9DD), np.uint64(0x4973F715)
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_M128 = (1 << 128) - 1


@numba.njit(nogil=True, cache=True)
def _hashmix(value, h):
    value = (value ^ h) & _M32
    h = (h * _MULT_A) & _M32
    value = (value * h) & _M32
    return value ^ (value >> _S16), h


@numba.njit(nogil=True, cache=True)
def _mix(x, y):
    r = (_MIX_L * x - _MIX_R * y) & _M32  # uint64 wraps mod 2^64, a multiple of 2^32
    return r ^ (r >> _S16)


@numba.njit(nogil=True, cache=True)
def _seed_state(entropy):
    """SeedSequence(entropy words).generate_state(4, uint64), as 4 uint64."""
    n = entropy.size
    pool = np.zeros(4, np.uint64)
    h = _INIT_A
    for i in range(4):
        pool[i], h = _hashmix(entropy[i] if i < n else np.uint64(0), h)
    for src in range(4):
        for dst in range(4):
            if src != dst:
                v, h = _hashmix(pool[src], h)
                pool[dst] = _mix(pool[dst], v)
    for src in range(4, n):
        for dst in range(4):
            v, h = _hashmix(entropy[src], h)
            pool[dst] = _mix(pool[dst], v)
    out = np.zeros(4, np.uint64)
    g = _INIT_B
    for i in range(8):
        v = (pool[i % 4] ^ g) & _M32
        g = (g * _MULT_B) & _M32
        v = (v * g) & _M32
        v ^= v >> _S16
        out[i // 2] |= v << np.uint64(32 * (i % 2))
    return out


def _words(values) -> np.ndarray:
    words = []
    for n in values:
        n = int(n)
        if n < 0:
            raise ValueError("SeedSequence entropy must be non-negative")
        words.append(n & 0xFFFFFFFF)
        n >>= 32
        while n:
            words.append(n & 0xFFFFFFFF)
            n >>= 32
    return np.array(words, np.uint64)


def pcg64_state(values) -> dict:
    """The bit_generator.state of np.random.default_rng(list of non-negative ints `values`)."""
    s = _seed_state(_words(values))
    seed, inc = int(s[0]) << 64 | int(s[1]), int(s[2]) << 64 | int(s[3])
    inc = (inc << 1 | 1) & _M128
    state = inc  # step from state 0
    state = ((state + seed) * _PCG_MULT + inc) & _M128
    return {"bit_generator": "PCG64", "state": {"state": state, "inc": inc}, "has_uint32": 0, "uinteger": 0}


class SampleGenerator:
    """One worker's reusable Generator: `seeded(values)` is it in default_rng(values)'s state."""

    def __init__(self):
        self._bit_generator = np.random.PCG64()
        self._generator = np.random.Generator(self._bit_generator)

    def seeded(self, values) -> np.random.Generator:
        self._bit_generator.state = pcg64_state(values)
        return self._generator
