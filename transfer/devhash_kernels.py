"""Triton kernels for :mod:`gpumigrate.transfer.devhash` (imported only on CUDA hosts with Triton).

One program lane per BLAKE3 node; all arithmetic on uint32, which wraps as BLAKE3 wants. The round
function takes the 16 state and 16 message words as separate values per lane so they stay in
registers; ``compress`` unrolls the seven rounds, permuting the message words between them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (32 - n))


@triton.jit
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 12)
    a = a + b + y
    d = _rotr(d ^ a, 8)
    c = c + d
    b = _rotr(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _round(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    s8,
    s9,
    s10,
    s11,
    s12,
    s13,
    s14,
    s15,
    m0,
    m1,
    m2,
    m3,
    m4,
    m5,
    m6,
    m7,
    m8,
    m9,
    m10,
    m11,
    m12,
    m13,
    m14,
    m15,
):
    s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
    s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
    s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
    s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
    s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
    s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
    s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
    s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
    return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15


@triton.jit
def _compress(
    c0, c1, c2, c3, c4, c5, c6, c7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15, counter, flags
):
    s0, s1, s2, s3, s4, s5, s6, s7 = c0, c1, c2, c3, c4, c5, c6, c7
    s8 = tl.full(c0.shape, 0x6A09E667, tl.uint32)
    s9 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
    s10 = tl.full(c0.shape, 0x3C6EF372, tl.uint32)
    s11 = tl.full(c0.shape, 0xA54FF53A, tl.uint32)
    s12 = counter
    s13 = tl.zeros(c0.shape, tl.uint32)
    s14 = tl.full(c0.shape, 64, tl.uint32)
    s15 = flags
    for _ in tl.static_range(7):  # the same PERMUTATION after every round (the last one unused)
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
            s0,
            s1,
            s2,
            s3,
            s4,
            s5,
            s6,
            s7,
            s8,
            s9,
            s10,
            s11,
            s12,
            s13,
            s14,
            s15,
            m0,
            m1,
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
            m8,
            m9,
            m10,
            m11,
            m12,
            m13,
            m14,
            m15,
        )
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
            m2,
            m6,
            m3,
            m10,
            m7,
            m0,
            m4,
            m13,
            m1,
            m11,
            m12,
            m5,
            m9,
            m14,
            m15,
            m8,
        )
    return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15


@triton.jit
def _w(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _compress_at(c0, c1, c2, c3, c4, c5, c6, c7, p, first_mask, second_mask, counter, flags):
    """_compress over the 16 words at ``p``: words 0-7 loaded under ``first_mask``, 8-15 under ``second_mask``."""
    return _compress(
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        _w(p + 0, first_mask),
        _w(p + 1, first_mask),
        _w(p + 2, first_mask),
        _w(p + 3, first_mask),
        _w(p + 4, first_mask),
        _w(p + 5, first_mask),
        _w(p + 6, first_mask),
        _w(p + 7, first_mask),
        _w(p + 8, second_mask),
        _w(p + 9, second_mask),
        _w(p + 10, second_mask),
        _w(p + 11, second_mask),
        _w(p + 12, second_mask),
        _w(p + 13, second_mask),
        _w(p + 14, second_mask),
        _w(p + 15, second_mask),
        counter,
        flags,
    )


@triton.jit
def _iv(shape: tl.constexpr):
    return (
        tl.full(shape, 0x6A09E667, tl.uint32),
        tl.full(shape, 0xBB67AE85, tl.uint32),
        tl.full(shape, 0x3C6EF372, tl.uint32),
        tl.full(shape, 0xA54FF53A, tl.uint32),
        tl.full(shape, 0x510E527F, tl.uint32),
        tl.full(shape, 0x9B05688C, tl.uint32),
        tl.full(shape, 0x1F83D9AB, tl.uint32),
        tl.full(shape, 0x5BE0CD19, tl.uint32),
    )


@triton.jit
def _store8(o, mask, c0, c1, c2, c3, c4, c5, c6, c7):
    tl.store(o + 0, c0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 1, c1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 2, c2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 3, c3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 4, c4.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 5, c5.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 6, c6.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 7, c7.to(tl.int32, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_kernel(base_ptr, offsets_ptr, out_ptr, total_leaves, leaves_per_input, last_flags, BLOCK: tl.constexpr):
    """Chaining value of every 1 KiB leaf; input i starts ``offsets[i]`` 32-bit words after base."""
    leaf = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = leaf < total_leaves
    which = leaf // leaves_per_input
    index = leaf - which * leaves_per_input
    p = base_ptr + tl.load(offsets_ptr + which, mask=mask, other=0) + index.to(tl.int64) * 256
    counter = index.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        q = p + b * 16
        flags = tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(
            tl.uint32
        )
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress_at(c0, c1, c2, c3, c4, c5, c6, c7, q, mask, mask, counter, flags)
    _store8(out_ptr + leaf.to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit(do_not_specialize=["total_out", "count_in", "count_out", "flags_value"])
def parent_kernel(in_ptr, out_ptr, total_out, count_in, count_out, flags_value, BLOCK: tl.constexpr):
    """One tree level: node j of an input = parent(2j, 2j+1), or node 2j itself when it has no pair."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < total_out
    which = j // count_out
    k = j - which * count_out
    left = in_ptr + (which * count_in + 2 * k).to(tl.int64) * 8
    paired = mask & (2 * k + 1 < count_in)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    p0, p1, p2, p3, p4, p5, p6, p7 = _compress_at(
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        left,
        mask,
        paired,
        tl.zeros([BLOCK], tl.uint32),
        tl.zeros([BLOCK], tl.uint32) + flags_value,
    )
    o = out_ptr + j.to(tl.int64) * 8
    _store8(
        o,
        mask,
        tl.where(paired, p0, _w(left + 0, mask)),
        tl.where(paired, p1, _w(left + 1, mask)),
        tl.where(paired, p2, _w(left + 2, mask)),
        tl.where(paired, p3, _w(left + 3, mask)),
        tl.where(paired, p4, _w(left + 4, mask)),
        tl.where(paired, p5, _w(left + 5, mask)),
        tl.where(paired, p6, _w(left + 6, mask)),
        tl.where(paired, p7, _w(left + 7, mask)),
    )


@triton.jit
def _words16(p, mask, BLOCK: tl.constexpr):
    """The 16 message words at ``p`` (one 64-byte block per lane), read as one [BLOCK, 16] tile.

    The tile load is coalesced (neighbouring lanes read neighbouring 16-byte pieces of a row) and the
    compiler hands each lane its own row through shared memory; loading word by word instead made every
    load instruction touch 32 different cache lines, and the kernel waited on its loads."""
    cols = tl.arange(0, 16)
    tile = tl.load(p[:, None] + cols[None, :], mask=mask[:, None], other=0).to(tl.uint32, bitcast=True)
    t = tl.reshape(tile, [BLOCK, 2, 2, 2, 2])  # word w = 8i + 4j + 2k + l at [lane, i, j, k, l]
    l0, l1 = tl.split(t)
    l0k0, l0k1 = tl.split(l0)
    l1k0, l1k1 = tl.split(l1)
    a, b = tl.split(l0k0)  # l=0 k=0: j=0 | j=1, each [BLOCK, 2] over i
    w0, w8 = tl.split(a)
    w4, w12 = tl.split(b)
    a, b = tl.split(l0k1)
    w2, w10 = tl.split(a)
    w6, w14 = tl.split(b)
    a, b = tl.split(l1k0)
    w1, w9 = tl.split(a)
    w5, w13 = tl.split(b)
    a, b = tl.split(l1k1)
    w3, w11 = tl.split(a)
    w7, w15 = tl.split(b)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_kernel_tile(base_ptr, offsets_ptr, out_ptr, total_leaves, leaves_per_input, last_flags, BLOCK: tl.constexpr):
    """:func:`leaf_kernel` with each 64-byte block read as one coalesced tile (:func:`_words16`).

    Inputs start on 16-byte boundaries (``offsets`` multiples of 4 words), which lets the loads be
    16 bytes wide."""
    leaf = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = leaf < total_leaves
    which = leaf // leaves_per_input
    index = leaf - which * leaves_per_input
    start = tl.multiple_of(tl.load(offsets_ptr + which, mask=mask, other=0), 4)
    p = base_ptr + start + index.to(tl.int64) * 256
    counter = index.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        flags = tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(
            tl.uint32
        )
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _words16(p + b * 16, mask, BLOCK)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0,
            c1,
            c2,
            c3,
            c4,
            c5,
            c6,
            c7,
            m0,
            m1,
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
            m8,
            m9,
            m10,
            m11,
            m12,
            m13,
            m14,
            m15,
            counter,
            flags,
        )
    _store8(out_ptr + leaf.to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _ld4(addr):
    """Four consecutive 32-bit words at the 16-byte-aligned byte address ``addr``, in one 16-byte load."""
    return tl.inline_asm_elementwise(
        "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        [addr],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_kernel_v4(base_addr, offsets_ptr, out_ptr, total_leaves, leaves_per_input, last_flags, BLOCK: tl.constexpr):
    """:func:`leaf_kernel` with 16-byte loads (four per 64-byte block instead of sixteen 4-byte ones).

    ``base_addr`` is the base's device address as an integer; lanes past the end read the first leaf
    again (always mapped) and store nothing."""
    leaf = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = leaf < total_leaves
    which = leaf // leaves_per_input
    index = leaf - which * leaves_per_input
    start = tl.load(offsets_ptr + which, mask=mask, other=0)
    addr = tl.where(mask, base_addr + start * 4 + index.to(tl.int64) * 1024, base_addr)
    counter = index.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        flags = tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(
            tl.uint32
        )
        q = addr + b * 64
        m0, m1, m2, m3 = _ld4(q)
        m4, m5, m6, m7 = _ld4(q + 16)
        m8, m9, m10, m11 = _ld4(q + 32)
        m12, m13, m14, m15 = _ld4(q + 48)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0,
            c1,
            c2,
            c3,
            c4,
            c5,
            c6,
            c7,
            m0,
            m1,
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
            m8,
            m9,
            m10,
            m11,
            m12,
            m13,
            m14,
            m15,
            counter,
            flags,
        )
    _store8(out_ptr + leaf.to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _ld4_landed(addr):
    """:func:`_ld4` through L2 (``.cg``), not the read-only path: this kernel stored these bytes itself."""
    return tl.inline_asm_elementwise(
        "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        [addr],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_copy_kernel(
    src_ptr, dst_ptr, dst_addr, out_ptr, total_leaves, leaves_per_input, last_flags, BLOCK: tl.constexpr
):
    """Copy ``BLOCK`` leaves from ``src`` to ``dst`` (contiguous inputs), then hash them where they landed.

    Each program first copies its ``BLOCK`` KiB with coalesced 16-byte loads and stores, waits for its
    threads (a CTA barrier makes their global stores visible to each other), then runs
    :func:`leaf_kernel_v4`'s hashing over ``dst``, reading through L2 where the copy just put the bytes.
    Memory sees one read of the source and one write of the destination; a separate copy and check read
    the destination a second time."""
    first = tl.program_id(0) * BLOCK
    words = tl.arange(0, BLOCK * 16)
    base = first.to(tl.int64) * 256
    limit = total_leaves.to(tl.int64) * 256
    for t in range(16):
        offs = base + t * (BLOCK * 16) + words
        keep = offs < limit
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=keep), mask=keep)
    tl.debug_barrier()
    leaf = first + tl.arange(0, BLOCK)
    mask = leaf < total_leaves
    which = leaf // leaves_per_input
    index = leaf - which * leaves_per_input
    addr = tl.where(mask, dst_addr + leaf.to(tl.int64) * 1024, dst_addr)
    counter = index.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        flags = tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(
            tl.uint32
        )
        q = addr + b * 64
        m0, m1, m2, m3 = _ld4_landed(q)
        m4, m5, m6, m7 = _ld4_landed(q + 16)
        m8, m9, m10, m11 = _ld4_landed(q + 32)
        m12, m13, m14, m15 = _ld4_landed(q + 48)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0,
            c1,
            c2,
            c3,
            c4,
            c5,
            c6,
            c7,
            m0,
            m1,
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
            m8,
            m9,
            m10,
            m11,
            m12,
            m13,
            m14,
            m15,
            counter,
            flags,
        )
    _store8(out_ptr + leaf.to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_copy_gather_kernel(
    src_ptr,
    dst_ptr,
    dst_addr,
    src_offsets_ptr,
    dst_offsets_ptr,
    out_ptr,
    total_leaves,
    leaves_per_input,
    last_flags,
    BLOCK: tl.constexpr,
):
    """:func:`leaf_copy_kernel` over inputs anywhere in memory: input ``i`` is copied from word
    ``src_offsets[i]`` of ``src`` to word ``dst_offsets[i]`` of ``dst`` (both multiples of 4: 16-byte aligned),
    then hashed where it landed. ``leaves_per_input`` is a multiple of ``BLOCK``, so a program's leaves all
    sit in one input: the chunks of a model's hundreds of tensors go in a few launches, not a launch chain each."""
    first = tl.program_id(0) * BLOCK
    which = first // leaves_per_input
    index0 = first - which * leaves_per_input
    src_at = tl.multiple_of(tl.load(src_offsets_ptr + which), 4)
    dst_at = tl.multiple_of(tl.load(dst_offsets_ptr + which), 4)
    words = tl.arange(0, BLOCK * 16)
    base = index0.to(tl.int64) * 256
    for t in range(16):
        at = tl.multiple_of(base + t * (BLOCK * 16), 16)
        tl.store(dst_ptr + dst_at + at + words, tl.load(src_ptr + src_at + at + words))
    tl.debug_barrier()
    lane = tl.arange(0, BLOCK)
    leaf = index0 + lane
    mask = first + lane < total_leaves
    addr = dst_addr + dst_at * 4 + leaf.to(tl.int64) * 1024
    counter = leaf.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        flags = tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(
            tl.uint32
        )
        q = addr + b * 64
        m0, m1, m2, m3 = _ld4_landed(q)
        m4, m5, m6, m7 = _ld4_landed(q + 16)
        m8, m9, m10, m11 = _ld4_landed(q + 32)
        m12, m13, m14, m15 = _ld4_landed(q + 48)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0,
            c1,
            c2,
            c3,
            c4,
            c5,
            c6,
            c7,
            m0,
            m1,
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
            m8,
            m9,
            m10,
            m11,
            m12,
            m13,
            m14,
            m15,
            counter,
            flags,
        )
    _store8(out_ptr + (first + lane).to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)
