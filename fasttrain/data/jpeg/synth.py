"""Synthetic entropy-coded MCUs and bit-exact splicing, for fasttrain.data.jpeg.doctor's doctored streams.

A synthetic run (`run`) is m MCUs whose blocks are each a DC diff and EOB, with (a) DC diffs that sum
to a given change of each component's predictor and (b) optionally a length that leaves a given
number of bits (mod 8) pending, adjusted with up to 7 extra AC coefficients; `splice` appends the
original's bits [begin, end) by copying whole bytes (stuffing and all). The bit writer (`put`) stuffs
a 0x00 after every 0xFF byte it writes; `write_header` copies the kept header segments with SOF's
size and DRI's interval set. fasttrain.data.jpeg.doctor's docstring gives the equations.

Inlining: the small leaves (`put`, `bitpos`, `category`, `copy_bytes`) are inlined into their callers
by numba (inline="always"); `run`, `_extras` and `splice` are not. Numba inlines by copying its IR at
every call site, and these three, each called from several sites of the doctor and holding the
leaves' copies, made the loaders' cold warm-up 100 s on one core of the 2-core VM (a doctored stream
9.5 us), 55 s without (12.0 us; bench/results/2026-11-27-cpu-numba-warm-up/).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, inline="always")
def category(v):
    a, s = abs(v), 0
    while a:
        s += 1
        a >>= 1
    return s


@numba.njit(nogil=True, cache=True)
def _codable(elen, t, v):
    s = category(v)
    return s <= 11 and elen[t, s] > 0


@numba.njit(nogil=True, cache=True)
def _split2(elen, t, pred, diffs, i):
    """diffs[i, :2] = two DC diffs with codes in table t summing to pred (rare: the predictor's own
    category has no code), by search over the first."""
    for v in range(-2047, 2048):
        if _codable(elen, t, v) and _codable(elen, t, pred - v):
            diffs[i, 0], diffs[i, 1] = v, pred - v
            return True
    return False


@numba.njit(nogil=True, cache=True)
def _split(elen, t, pred, k, diffs, i):
    """diffs[i, :k] = k DC diffs, each with a code in table t, summing to pred (k <= 3)."""
    if k == 1:
        diffs[i, 0] = pred
        return _codable(elen, t, pred)
    if k == 2:
        return _split2(elen, t, pred, diffs, i)
    for s in range(12):
        if elen[t, s]:
            for v in ((1 << s) - 1, -((1 << s) - 1), (1 << s) >> 1):  # values of category s
                diffs[i, 2] = v
                if _split2(elen, t, pred - v, diffs, i):
                    return True
    return False


@numba.njit(nogil=True, cache=True)
def _dc_plan(elen, t, n, pred, diffs, i):
    """(k, m): the row's first k blocks carry diffs[i, :k], summing to pred, the other n - k blocks
    +m, -m, +m, ... (m = 0 when category 0 has a code, else n - k is even); k = -1 if impossible."""
    m = 0
    if elen[t, 0] == 0:
        for s in range(1, 12):
            if elen[t, s]:
                m = 1 << (s - 1)
                break
        if m == 0:
            return -1, 0
    for k in range(1, 4):
        if k <= n and (m == 0 or (n - k) % 2 == 0) and _split(elen, t, pred, k, diffs, i):
            return k, m
    return -1, 0


@numba.njit(nogil=True, cache=True, inline="always")
def copy_bytes(out, o, data, a, n):
    # An explicit loop: numba's slice assignment guards against overlap with a temporary copy, which
    # made a 60 kB copy take 31 us instead of 4.
    dst, src = out[o : o + n], data[a : a + n]
    for i in range(n):  # i >= 0: no negative-index wrap check, so LLVM vectorises the loop
        dst[i] = src[i]


@numba.njit(nogil=True, cache=True, inline="always")
def put(out, o, acc, nacc, code, length):
    """Append `length` bits; complete bytes go to out[o:], each 0xFF followed by a stuffed 0x00."""
    acc = (acc << length) | code
    nacc += length
    while nacc >= 8:
        nacc -= 8
        b = (acc >> nacc) & 0xFF
        out[o] = b
        o += 1
        if b == 0xFF:
            out[o] = 0
            o += 1
    return o, acc, nacc


@numba.njit(nogil=True, cache=True, inline="always")
def bitpos(cp, i):
    return (np.int64(cp[i, 0]) & 0xFFFF) | ((np.int64(cp[i, 1]) & 0xFFFF) << 16)


@numba.njit(nogil=True, cache=True)
def splice(out, o, acc, nacc, data, begin, end):
    """Append the original's entropy-coded bits [begin, end) (bit positions as in the checkpoints; the
    writer's pending bits nacc == begin mod 8): whole bytes are copied as they are, stuffing and all;
    only the first, shared with the pending bits, is rebuilt. end = 8 * size copies to the file's end."""
    first, bit = begin >> 3, begin & 7
    last, last_bit = end >> 3, end & 7
    if first == last:
        n = last_bit - bit
        return put(out, o, acc, nacc, (np.int64(data[first]) >> (8 - last_bit)) & ((1 << n) - 1), n)
    if bit:
        o, acc, nacc = put(out, o, acc, nacc, np.int64(data[first]) & (0xFF >> bit), 8 - bit)
        first += 2 if data[first] == 0xFF else 1
    copy_bytes(out, o, data, first, last - first)
    o += last - first
    if last_bit:
        return o, np.int64(data[last]) >> (8 - last_bit), np.int64(last_bit)
    return o, np.int64(0), np.int64(0)


@numba.njit(nogil=True, cache=True)
def run(out, o, acc, nacc, hdr, ecode, elen, per, m, dpred, target_bit, exact, ws):
    """Append m synthetic MCUs (each block: DC diff, EOB) whose DC diffs sum to dpred[j] per component
    and, when exact, end with target_bit bits pending (module docstring's (a) and (b)); (o, acc, nacc),
    o = -1 when the image's tables cannot encode such a run. ws: scratch's arrays."""
    ns = hdr[3]
    diffs, ks, ms, ex_comp, ex_sym, ex_block, count, used, opt_comp, opt_sym, prev = ws
    total = nacc
    for j in range(ns):
        dc, ac = hdr[10 + 4 * j], hdr[11 + 4 * j]
        n = m * per[j]
        c = category(dpred[j])
        if n >= 1 and c <= 11 and elen[dc, c] and elen[dc, 0]:  # the usual case: one diff, zeros
            ks[j], ms[j], diffs[j, 0] = 1, 0, dpred[j]
        else:
            ks[j], ms[j] = _dc_plan(elen, dc, n, dpred[j], diffs, j)
        if ks[j] < 0 or elen[ac, 0] == 0:
            return -1, acc, nacc
        for b in range(ks[j]):
            total += elen[dc, category(diffs[j, b])] + category(diffs[j, b])
        cm = category(ms[j])
        total += (n - ks[j]) * (elen[dc, cm] + cm) + n * elen[ac, 0]
    nex = 0
    if exact:
        nex = _extras(per, m, (target_bit - total) % 8, ws)
        if nex < 0:
            return -1, acc, nacc
    # Past the MCUs holding the predictor's blocks and the extras every MCU is the same all-zero one:
    # its codes put at once (a 4:2:0 MCU is about 30 bits) when category 0 has a code.
    zero, zero_len, plain = np.int64(0), np.int64(0), True
    for j in range(ns):
        dc, ac = hdr[10 + 4 * j], hdr[11 + 4 * j]
        plain &= ms[j] == 0
        for _ in range(per[j]):
            zero = (zero << (elen[dc, 0] + elen[ac, 0])) | (ecode[dc, 0] << elen[ac, 0]) | ecode[ac, 0]
            zero_len += elen[dc, 0] + elen[ac, 0]
    plain &= zero_len <= 48
    special = 0
    for j in range(ns):
        last = ks[j] - 1
        for e in range(nex):
            if ex_comp[e] == j:
                last = max(last, ex_block[e])
        special = max(special, last // per[j] + 1)
    count[:] = 0
    for mi in range(m):
        if plain and mi >= special:
            o, acc, nacc = put(out, o, acc, nacc, zero, zero_len)
            continue
        for j in range(ns):
            dc, ac = hdr[10 + 4 * j], hdr[11 + 4 * j]
            for _ in range(per[j]):
                blk = count[j]
                count[j] += 1
                if blk < ks[j]:
                    d = diffs[j, blk]
                else:
                    d = ms[j] if (blk - ks[j]) % 2 == 0 else -ms[j]
                s = category(d)
                o, acc, nacc = put(out, o, acc, nacc, ecode[dc, s], elen[dc, s])
                if s:
                    o, acc, nacc = put(out, o, acc, nacc, d if d > 0 else d + (1 << s) - 1, s)
                for e in range(nex):
                    if ex_comp[e] == j and ex_block[e] == blk:
                        sym = ex_sym[e]
                        o, acc, nacc = put(out, o, acc, nacc, ecode[ac, sym], elen[ac, sym])
                        o, acc, nacc = put(out, o, acc, nacc, (1 << (sym & 15)) - 1, sym & 15)
                o, acc, nacc = put(out, o, acc, nacc, ecode[ac, 0], elen[ac, 0])
    if exact and nacc != target_bit:
        return -1, acc, nacc
    return o, acc, nacc


@numba.njit(nogil=True, cache=True)
def scratch(hdr, elen):
    """Work arrays for _run, made once per stream: (diffs, ks, ms, ex_comp, ex_sym, ex_block, count,
    used, opt_comp, opt_sym, prev) with the extra-coefficient table: opt_* the AC symbol (fewest
    positions) adding each residue of bits mod 8, prev the residues' shortest paths from 0 (<= 7 steps)."""
    opt_comp = np.full(8, -1, np.int64)
    opt_sym = np.zeros(8, np.int64)
    for j in range(hdr[3]):
        ac = hdr[11 + 4 * j]
        for sym in range(1, 256):
            if sym & 15 and elen[ac, sym]:
                res = (elen[ac, sym] + (sym & 15)) % 8
                if opt_comp[res] < 0 or (sym >> 4) < (opt_sym[res] >> 4):
                    opt_comp[res], opt_sym[res] = j, sym
    prev = np.full(8, -1, np.int64)
    prev[0] = 0
    frontier = np.zeros(8, np.int64)
    frontier[0] = 1
    for _ in range(7):
        grown = frontier.copy()
        for a in range(8):
            if frontier[a]:
                for res in range(1, 8):
                    if opt_comp[res] >= 0 and prev[(a + res) % 8] < 0:
                        prev[(a + res) % 8] = res
                        grown[(a + res) % 8] = 1
        frontier = grown
    z3 = np.zeros(3, np.int64)
    return (
        np.zeros((3, 3), np.int64),
        z3.copy(),
        z3.copy(),
        np.zeros(8, np.int64),
        np.zeros(8, np.int64),
        np.zeros(8, np.int64),
        z3.copy(),
        np.zeros((3, 8), np.int64),
        opt_comp,
        opt_sym,
        prev,
    )


@numba.njit(nogil=True, cache=True)
def _extras(per, m, want, ws):
    """Up to 7 extra AC coefficients (ex_comp, ex_sym, ex_block in ws) adding want bits (mod 8), along
    the table's shortest path; their count, or -1."""
    _, _, _, ex_comp, ex_sym, ex_block, count, used, opt_comp, opt_sym, prev = ws
    if prev[want] < 0:
        return -1
    used[:] = 0  # coefficient positions taken per (component, block)
    count[:] = 0
    a, nex = want, 0
    while a != 0:
        res = prev[a]
        j, sym = opt_comp[res], opt_sym[res]
        if m * per[j] == 0:
            return -1
        ex_comp[nex], ex_sym[nex] = j, sym
        b = 0  # the first block with room (positions 1..62: the block still ends with EOB)
        while b < min(m * per[j], 8) and used[j, b] + (sym >> 4) + 1 > 62:
            b += 1
        if b == min(m * per[j], 8):
            return -1
        ex_block[nex] = b
        used[j, b] += (sym >> 4) + 1
        nex += 1
        a = (a - res) % 8
    return nex


@numba.njit(nogil=True, cache=True)
def write_header(data, out, hdr, keep, new_height, new_width, new_interval):
    """Write SOI and the kept segments with SOF's height and width and DRI's interval set; the bytes
    written."""
    out[0], out[1] = 0xFF, 0xD8
    o = 2
    for s in range(hdr[7]):
        a, b = keep[s, 0], keep[s, 1]
        copy_bytes(out, o, data, a, b - a)
        if a < hdr[2] < b:
            out[o + hdr[2] - a], out[o + hdr[2] - a + 1] = new_height >> 8, new_height & 0xFF
            out[o + hdr[2] - a + 2], out[o + hdr[2] - a + 3] = new_width >> 8, new_width & 0xFF
        if hdr[20] and a < hdr[21] < b:
            out[o + hdr[21] - a], out[o + hdr[21] - a + 1] = new_interval >> 8, new_interval & 0xFF
        o += b - a
    return o
