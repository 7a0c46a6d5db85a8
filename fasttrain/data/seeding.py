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
(mod 2^128). The result is checked against default_rng itself (tests/test_seeding.py). The kernel
keeps the GIL: releasing it for a microsecond costs a loader thread more than the call.
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_S16 = np.uint64(16)
_INIT_A, _MULT_A = np.uint64(0x43B0D7E5), np.uint64(0x931E8875)
_INIT_B, _MULT_B = np.uint64(0x8B51F9DD), np.uint64(0x58F38DED)
_MIX_L, _MIX_R = np.uint64(0xCA01F9DD), np.uint64(0x4973F715)
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_M128 = (1 << 128) - 1


@numba.njit(cache=True)
def _hashmix(value, h):
    value = (value ^ h) & _M32
    h = (h * _MULT_A) & _M32
    value = (value * h) & _M32
    return value ^ (value >> _S16), h


@numba.njit(cache=True)
def _mix(x, y):
    r = (_MIX_L * x - _MIX_R * y) & _M32  # uint64 wraps mod 2^64, a multiple of 2^32
    return r ^ (r >> _S16)


@numba.njit(cache=True)
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


# --- PCG64 stepped in place by numba kernels -------------------------------------------------------
#
# NumPy's PCG64 keeps its state in C (numpy/random/src/pcg64/pcg64.h): struct pcg64_state
# {pcg64_random_t *pcg_state; int has_uint32; uint32_t uinteger;} and pcg64_random_t {state, inc},
# each a 128-bit integer (low word first with the compiler's __uint128_t). `pcg_views` maps those
# words as NumPy arrays, so a kernel can draw exactly what the Generator would (its calls below) and
# leave the Generator in the state those draws leave it: next64 steps state = state * MULT + inc and
# outputs rotr64(hi ^ lo, hi >> 58) (XSL-RR); next_double = (next64 >> 11) / 2^53; next32 returns the
# buffered high half when there is one, else the low half of a next64 (buffering the high half).
# The layout is checked when the views are made (a Generator that fails the check keeps the Python path).

_MULT_HI, _MULT_LO = np.uint64(_PCG_MULT >> 64), np.uint64(_PCG_MULT & (2**64 - 1))


@numba.njit(cache=True)
def _mul_high(a, b):
    """The high 64 bits of the 128-bit product of uint64 a and b."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> np.uint64(32), b & _M32, b >> np.uint64(32)
    cross = ((a_lo * b_lo) >> np.uint64(32)) + (a_hi * b_lo & _M32) + (a_lo * b_hi & _M32)
    return (
        a_hi * b_hi
        + (a_hi * b_lo >> np.uint64(32))
        + (a_lo * b_hi >> np.uint64(32))
        + (cross >> np.uint64(32))
    )


@numba.njit(cache=True)
def _step(words):
    """state = state * MULT + inc (mod 2^128); words = state low, high, inc low, high."""
    low = words[0] * _MULT_LO
    high = _mul_high(words[0], _MULT_LO) + words[1] * _MULT_LO + words[0] * _MULT_HI
    new_low = low + words[2]
    words[0] = new_low
    words[1] = high + words[3] + (np.uint64(1) if new_low < low else np.uint64(0))


@numba.njit(cache=True)
def next64(words):
    _step(words)
    value, rotation = words[1] ^ words[0], words[1] >> np.uint64(58)
    return (value >> rotation) | (value << ((np.uint64(64) - rotation) & np.uint64(63)))


@numba.njit(cache=True)
def next_double(words):
    """Generator.random()."""
    return np.float64(next64(words) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True)
def _next32(words, buffer):
    if buffer[0]:
        buffer[0] = 0
        return np.uint64(buffer[1])
    value = next64(words)
    buffer[0], buffer[1] = 1, np.uint32(value >> np.uint64(32))
    return value & _M32


@numba.njit(cache=True)
def integers(words, buffer, high):
    """Generator.integers(0, high) (int64) for 1 <= high < 2^32: NumPy's random_bounded_uint64_fill,
    which draws nothing for high = 1 and otherwise Lemire's multiply-and-reject on 32-bit draws."""
    bound = np.uint64(high - 1)
    if bound == 0:
        return 0
    excl = bound + np.uint64(1)
    m = _next32(words, buffer) * excl
    if m & _M32 < excl:
        threshold = (_M32 - bound) % excl
        while m & _M32 < threshold:
            m = _next32(words, buffer) * excl
    return np.int64(m >> np.uint64(32))


@numba.njit(cache=True)
def _seed_into(a, b, c, words, buffer):
    """The state default_rng([a, b, c]) starts in (non-negative int64s), written into the views."""
    entropy = np.zeros(6, np.uint64)
    n = 0
    for value in (np.uint64(a), np.uint64(b), np.uint64(c)):
        entropy[n] = value & _M32
        n += 1
        if value >> np.uint64(32):
            entropy[n] = value >> np.uint64(32)
            n += 1
    s = _seed_state(entropy[:n])
    # inc = (u64[2] << 64 | u64[3]) << 1 | 1; state = ((0 * MULT + inc) + seed) * MULT + inc.
    words[2], words[3] = (
        (s[3] << np.uint64(1)) | np.uint64(1),
        (s[2] << np.uint64(1)) | (s[3] >> np.uint64(63)),
    )
    low = words[2] + s[1]  # + seed (u64[0] << 64 | u64[1]), with the carry
    words[0], words[1] = low, words[3] + s[0] + (np.uint64(1) if low < s[1] else np.uint64(0))
    _step(words)
    buffer[0], buffer[1] = 0, 0


def pcg_views(bit_generator: np.random.PCG64):
    """(words, buffer): uint64[4] (state low, high, inc low, high) and uint32[2] (has_uint32, uinteger)
    views of the PCG64's C state, or None if its layout is not the one described above (checked by
    setting a state through NumPy and reading it back). The views live as long as bit_generator."""
    address = bit_generator.ctypes.state_address
    pointer = ctypes.c_void_p.from_address(address).value
    words = np.ctypeslib.as_array((ctypes.c_uint64 * 4).from_address(pointer))
    buffer = np.ctypeslib.as_array(
        (ctypes.c_uint32 * 2).from_address(address + ctypes.sizeof(ctypes.c_void_p))
    )
    saved = bit_generator.state
    state, inc = (3 << 64) | 5, (7 << 64) | 9
    bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": 1,
        "uinteger": 11,
    }
    ok = words.tolist() == [5, 3, 9, 7] and buffer.tolist() == [1, 11]
    bit_generator.state = saved
    return (words, buffer) if ok else None


class PCGGenerator(np.random.Generator):
    """A Generator whose `pcg` holds pcg_views of its PCG64: kernels may draw from it in place."""

    pcg = None


class SampleGenerator:
    """One worker's reusable Generator: `seeded(values)` is it in default_rng(values)'s state."""

    def __init__(self):
        self._bit_generator = np.random.PCG64()
        self._generator = PCGGenerator(self._bit_generator)
        self._generator.pcg = pcg_views(self._bit_generator)

    def seeded(self, values) -> np.random.Generator:
        pcg = self._generator.pcg
        if pcg is not None and len(values) == 3:
            a, b, c = values
            if 0 <= a < _2_63 and 0 <= b < _2_63 and 0 <= c < _2_63:  # int64 arguments to the kernel
                _seed_into(a, b, c, *pcg)
                return self._generator
        self._bit_generator.state = pcg64_state(values)
        return self._generator


_2_63 = 2**63
