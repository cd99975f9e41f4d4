"""Triton kernels for :mod:`gpumigrate.transfer.device.devhash` (imported only on CUDA hosts with Triton).

One program lane per BLAKE3 node; all arithmetic on uint32, which wraps as BLAKE3 wants. The round
function takes the 16 state and 16 message words as separate values per lane so they stay in
registers; ``compress`` unrolls the seven rounds, permuting the message words between them.
"""

from __future__ import annotations

import triton.language as tl

from gpumigrate.transfer.device.triton_types import device_function, kernel


@device_function
def _rotr(x: tl.tensor, n: tl.constexpr) -> tl.tensor:
    return (x >> n) | (x << (32 - n))


@device_function
def _g(a: tl.tensor, b: tl.tensor, c: tl.tensor, d: tl.tensor, x: tl.tensor, y: tl.tensor) -> tuple[tl.tensor, ...]:
    a = a + b + x
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 12)
    a = a + b + y
    d = _rotr(d ^ a, 8)
    c = c + d
    b = _rotr(b ^ c, 7)
    return a, b, c, d


@device_function
def _compress(
    c0: tl.tensor,
    c1: tl.tensor,
    c2: tl.tensor,
    c3: tl.tensor,
    c4: tl.tensor,
    c5: tl.tensor,
    c6: tl.tensor,
    c7: tl.tensor,
    m0: tl.tensor,
    m1: tl.tensor,
    m2: tl.tensor,
    m3: tl.tensor,
    m4: tl.tensor,
    m5: tl.tensor,
    m6: tl.tensor,
    m7: tl.tensor,
    m8: tl.tensor,
    m9: tl.tensor,
    m10: tl.tensor,
    m11: tl.tensor,
    m12: tl.tensor,
    m13: tl.tensor,
    m14: tl.tensor,
    m15: tl.tensor,
    counter: tl.tensor,
    flags: tl.tensor,
) -> tuple[tl.tensor, ...]:
    s0, s1, s2, s3, s4, s5, s6, s7 = c0, c1, c2, c3, c4, c5, c6, c7
    s8 = tl.full(c0.shape, 0x6A09E667, tl.uint32)
    s9 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
    s10 = tl.full(c0.shape, 0x3C6EF372, tl.uint32)
    s11 = tl.full(c0.shape, 0xA54FF53A, tl.uint32)
    s12 = counter
    s13 = tl.zeros(c0.shape, tl.uint32)
    s14 = tl.full(c0.shape, 64, tl.uint32)
    s15 = flags
    for _ in tl.static_range(7):  # a round: columns, then diagonals; the same PERMUTATION after each (the last unused)
        s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
        s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
        s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
        s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
        s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
        s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
        s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
        s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
            m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8,
        )  # fmt: skip
    return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15


@device_function
def _w(ptr: tl.tensor, mask: tl.tensor) -> tl.tensor:
    return tl.load(ptr, mask=mask, other=0).to(tl.uint32, bitcast=True)


@device_function
def _w8(p: tl.tensor, mask: tl.tensor) -> tuple[tl.tensor, ...]:
    """The eight words at ``p``, loaded under ``mask`` (0 where it does not hold)."""
    return (
        _w(p + 0, mask),
        _w(p + 1, mask),
        _w(p + 2, mask),
        _w(p + 3, mask),
        _w(p + 4, mask),
        _w(p + 5, mask),
        _w(p + 6, mask),
        _w(p + 7, mask),
    )


@device_function
def _compress_at(
    c0: tl.tensor,
    c1: tl.tensor,
    c2: tl.tensor,
    c3: tl.tensor,
    c4: tl.tensor,
    c5: tl.tensor,
    c6: tl.tensor,
    c7: tl.tensor,
    p: tl.tensor,
    first_mask: tl.tensor,
    second_mask: tl.tensor,
    counter: tl.tensor,
    flags: tl.tensor,
) -> tuple[tl.tensor, ...]:
    """_compress over the 16 words at ``p``: words 0-7 loaded under ``first_mask``, 8-15 under ``second_mask``."""
    m0, m1, m2, m3, m4, m5, m6, m7 = _w8(p, first_mask)
    m8, m9, m10, m11, m12, m13, m14, m15 = _w8(p + 8, second_mask)
    return _compress(
        c0, c1, c2, c3, c4, c5, c6, c7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15, counter,
        flags,
    )  # fmt: skip


@device_function
def _iv(shape: tl.constexpr) -> tuple[tl.tensor, ...]:
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


@device_function
def _store8(
    o: tl.tensor,
    mask: tl.tensor,
    c0: tl.tensor,
    c1: tl.tensor,
    c2: tl.tensor,
    c3: tl.tensor,
    c4: tl.tensor,
    c5: tl.tensor,
    c6: tl.tensor,
    c7: tl.tensor,
) -> None:
    tl.store(o + 0, c0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 1, c1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 2, c2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 3, c3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 4, c4.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 5, c5.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 6, c6.to(tl.int32, bitcast=True), mask=mask)
    tl.store(o + 7, c7.to(tl.int32, bitcast=True), mask=mask)


@device_function
def _leaf_flags(b: tl.tensor, last_flags: tl.tensor, BLOCK: tl.constexpr) -> tl.tensor:
    """The flags of block ``b`` (0-15) of a leaf, for every lane: CHUNK_START on the first, CHUNK_END and
    ``last_flags`` (ROOT for an input of one leaf, else 0) on the last."""
    return tl.zeros([BLOCK], tl.uint32) + (tl.where(b == 0, 1, 0) | tl.where(b == 15, 2 | last_flags, 0)).to(tl.uint32)


@kernel(do_not_specialize=["total_out", "count_in", "count_out", "flags_value"])
def parent_kernel(
    in_ptr: tl.tensor,
    out_ptr: tl.tensor,
    total_out: tl.tensor,
    count_in: tl.tensor,
    count_out: tl.tensor,
    flags_value: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
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


@device_function
def _pick8(
    which: tl.tensor,
    a0: tl.tensor,
    a1: tl.tensor,
    a2: tl.tensor,
    a3: tl.tensor,
    a4: tl.tensor,
    a5: tl.tensor,
    a6: tl.tensor,
    a7: tl.tensor,
    b0: tl.tensor,
    b1: tl.tensor,
    b2: tl.tensor,
    b3: tl.tensor,
    b4: tl.tensor,
    b5: tl.tensor,
    b6: tl.tensor,
    b7: tl.tensor,
) -> tuple[tl.tensor, ...]:
    """Eight words, each ``a`` where ``which`` holds and ``b`` where it does not (a chaining value chosen per lane)."""
    return (
        tl.where(which, a0, b0),
        tl.where(which, a1, b1),
        tl.where(which, a2, b2),
        tl.where(which, a3, b3),
        tl.where(which, a4, b4),
        tl.where(which, a5, b5),
        tl.where(which, a6, b6),
        tl.where(which, a7, b7),
    )


@kernel(do_not_specialize=["total_out", "count_in", "count_out", "top_flags"])
def parent2_kernel(
    in_ptr: tl.tensor,
    out_ptr: tl.tensor,
    total_out: tl.tensor,
    count_in: tl.tensor,
    count_out: tl.tensor,
    top_flags: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    """Two tree levels in one launch: node j of an input = the subtree over its nodes 4j..4j+3, by
    :func:`parent_kernel`'s rule at each level (a node without a pair goes up unchanged); ``top_flags`` (ROOT or
    0) marks the upper level's parents. Halves the launches of a chunk's tree (15 levels at 32 MiB): the Python
    side of a launch costs more than the GPU's work on the upper levels.

    The three compressions (nodes 0+1, nodes 2+3, then the two results) run as one loop with one compression in
    it: three copies of it made Triton's compile of this kernel many times slower."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < total_out
    which = j // count_out
    k = j - which * count_out
    first = in_ptr + (which * count_in + 4 * k).to(tl.int64) * 8
    has1 = mask & (4 * k + 1 < count_in)
    has2 = mask & (4 * k + 2 < count_in)
    has3 = mask & (4 * k + 3 < count_in)
    zero = tl.zeros([BLOCK], tl.uint32)
    i0, i1, i2, i3, i4, i5, i6, i7 = _iv([BLOCK])
    A0, A1, A2, A3, A4, A5, A6, A7 = zero, zero, zero, zero, zero, zero, zero, zero
    B0, B1, B2, B3, B4, B5, B6, B7 = zero, zero, zero, zero, zero, zero, zero, zero
    T0, T1, T2, T3, T4, T5, T6, T7 = zero, zero, zero, zero, zero, zero, zero, zero
    for step in range(3):
        p = first + step * 16
        lo = (step < 2) & tl.where(step == 0, mask, has2)  # step 0 reads nodes 0 and 1, step 1 nodes 2 and 3
        hi = (step < 2) & tl.where(step == 0, has1, has3)
        late = step == 2  # step 2 compresses the two results
        m0, m1, m2, m3, m4, m5, m6, m7 = _pick8(
            late, A0, A1, A2, A3, A4, A5, A6, A7, _w(p + 0, lo), _w(p + 1, lo), _w(p + 2, lo), _w(p + 3, lo),
            _w(p + 4, lo), _w(p + 5, lo), _w(p + 6, lo), _w(p + 7, lo),
        )  # fmt: skip
        m8, m9, m10, m11, m12, m13, m14, m15 = _pick8(
            late, B0, B1, B2, B3, B4, B5, B6, B7, _w(p + 8, hi), _w(p + 9, hi), _w(p + 10, hi), _w(p + 11, hi),
            _w(p + 12, hi), _w(p + 13, hi), _w(p + 14, hi), _w(p + 15, hi),
        )  # fmt: skip
        flags = zero + (4 | tl.where(late, top_flags, 0)).to(tl.uint32)
        r0, r1, r2, r3, r4, r5, r6, r7 = _compress(
            i0, i1, i2, i3, i4, i5, i6, i7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            zero, flags,
        )  # fmt: skip
        # a node without its pair goes up as it is (the first node read in that step)
        paired = tl.where(step == 0, has1, tl.where(step == 1, has3, has2))
        r0, r1, r2, r3, r4, r5, r6, r7 = _pick8(paired, r0, r1, r2, r3, r4, r5, r6, r7, m0, m1, m2, m3, m4, m5, m6, m7)
        A0, A1, A2, A3, A4, A5, A6, A7 = _pick8(
            step == 0, r0, r1, r2, r3, r4, r5, r6, r7, A0, A1, A2, A3, A4, A5, A6, A7
        )
        B0, B1, B2, B3, B4, B5, B6, B7 = _pick8(
            step == 1, r0, r1, r2, r3, r4, r5, r6, r7, B0, B1, B2, B3, B4, B5, B6, B7
        )
        T0, T1, T2, T3 = r0, r1, r2, r3
        T4, T5, T6, T7 = r4, r5, r6, r7
    _store8(out_ptr + j.to(tl.int64) * 8, mask, T0, T1, T2, T3, T4, T5, T6, T7)


@device_function
def _split16(tile: tl.tensor, BLOCK: tl.constexpr) -> tuple[tl.tensor, ...]:
    """A [BLOCK, 16] tile's 16 columns, one [BLOCK] vector each (the compiler moves them through shared memory)."""
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


@device_function
def _ld4(addr: tl.tensor) -> tl.tensor:
    """Four consecutive 32-bit words at the 16-byte-aligned byte address ``addr``, in one 16-byte load."""
    return tl.inline_asm_elementwise(
        "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        [addr],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@kernel(do_not_specialize=["total_leaves", "leaves_per_input", "last_flags"])
def leaf_kernel(
    base_addr: tl.tensor,
    offsets_ptr: tl.tensor,
    out_ptr: tl.tensor,
    total_leaves: tl.tensor,
    leaves_per_input: tl.tensor,
    last_flags: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    """Chaining value of every 1 KiB leaf; input i starts ``offsets[i]`` 32-bit words after the base, whose device
    address is ``base_addr`` (an integer; base and inputs on 16-byte boundaries). Each lane reads its leaf's 64-byte
    blocks with four 16-byte loads; lanes past the end read the first leaf again (always mapped) and store nothing.
    """
    leaf = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = leaf < total_leaves
    which = leaf // leaves_per_input
    index = leaf - which * leaves_per_input
    start = tl.load(offsets_ptr + which, mask=mask, other=0)
    addr = tl.where(mask, base_addr + start * 4 + index.to(tl.int64) * 1024, base_addr)
    counter = index.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    for b in range(16):
        flags = _leaf_flags(b, last_flags, BLOCK)
        q = addr + b * 64
        m0, m1, m2, m3 = _ld4(q)
        m4, m5, m6, m7 = _ld4(q + 16)
        m8, m9, m10, m11 = _ld4(q + 32)
        m12, m13, m14, m15 = _ld4(q + 48)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0, c1, c2, c3, c4, c5, c6, c7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            counter, flags,
        )  # fmt: skip
    _store8(out_ptr + leaf.to(tl.int64) * 8, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@kernel(do_not_specialize=["total_leaves", "leaves_per_input"])
def leaf_copy_gather_kernel(
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    src_offsets_ptr: tl.tensor,
    dst_offsets_ptr: tl.tensor,
    out_ptr: tl.tensor,
    total_leaves: tl.tensor,
    leaves_per_input: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    """Copy input ``i`` from word ``src_offsets[i]`` of ``src`` to word ``dst_offsets[i]`` of ``dst`` (both
    multiples of 4: 16-byte aligned) and return the chaining value of every 1 KiB leaf copied, hashing the very
    words it stores. ``leaves_per_input`` is a multiple of ``BLOCK``, so a program's leaves all sit in one input:
    the chunks of a model's hundreds of tensors go in a few launches, not a launch chain each.

    Each program walks its ``BLOCK`` leaves one 64-byte block at a time. A block of all its leaves is loaded as
    one [BLOCK, 16] tile (neighbouring threads read neighbouring 16-byte pieces: whole 32-byte sectors), stored
    as that tile (whole sectors again), and handed to the lanes, one leaf's row each, through shared memory
    (:func:`_split16`) to be compressed. The next block's tile is loaded before this one is compressed, so
    memory works while the lanes hash. Memory sees one read of the source and one write of the destination.

    Why this shape (bench/results/kernel-h100-s11.json holds the sweep): copying a block and then reading it back
    through L2 to hash it made copy and hash take turns; lanes storing their own rows with 16-byte stores half-filled
    every sector they wrote; without the early load of the next tile, memory idled while the lanes hashed."""
    first = tl.program_id(0) * BLOCK
    which = first // leaves_per_input
    index0 = first - which * leaves_per_input
    src_at = tl.multiple_of(tl.load(src_offsets_ptr + which), 4)
    dst_at = tl.multiple_of(tl.load(dst_offsets_ptr + which), 4)
    lane = tl.arange(0, BLOCK)
    leaf = index0 + lane
    cols = tl.arange(0, 16)
    ps = src_ptr + src_at + leaf.to(tl.int64)[:, None] * 256 + cols[None, :]
    pd = dst_ptr + dst_at + leaf.to(tl.int64)[:, None] * 256 + cols[None, :]
    counter = leaf.to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _iv([BLOCK])
    tile = tl.load(ps)
    for b in range(16):
        flags = _leaf_flags(b, 0, BLOCK)
        ahead = tl.load(ps + (b + 1) * 16, mask=b < 15)
        tl.store(pd + b * 16, tile)
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _split16(
            tile.to(tl.uint32, bitcast=True), BLOCK
        )
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0, c1, c2, c3, c4, c5, c6, c7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            counter, flags,
        )  # fmt: skip
        tile = ahead
    _store8(out_ptr + (first + lane).to(tl.int64) * 8, lane < BLOCK, c0, c1, c2, c3, c4, c5, c6, c7)
