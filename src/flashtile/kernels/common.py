"""Pieces every attention kernel shares, so the forward and backward agree on what is visible.

A query row i sits at key position i + diag_offset (Sk - Sq for flash_attn's bottom-right alignment);
it sees key j when j < Sk, j <= pos + window_right (if bounded) and j >= pos - window_left (if bounded).
Causal is window_right = 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible(rows_pos, cols, seqlen_k, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which (row, key) pairs are visible; ``rows_pos`` and ``cols`` broadcast to the tile's shape."""
    keep = cols < seqlen_k
    if HAS_RIGHT:
        keep &= cols <= rows_pos + window_right
    if HAS_LEFT:
        keep &= cols >= rows_pos - window_left
    return keep


@triton.jit
def tile_pages(block_table_row, start, offs_n, seqlen_k, page_size, ONE_PAGE: tl.constexpr,
               PAGE_SHIFT: tl.constexpr):
    """Block table entries of the tile of keys start + offs_n: one per key, or with ONE_PAGE (pages of
    a power of two >= the tile's keys) the single entry of its first key; 0 past the sequence.
    PAGE_SHIFT >= 0: pages hold 2**PAGE_SHIFT keys, a shift where a division by the runtime page size
    costs ~20 instructions per key."""
    keys = start if ONE_PAGE else start + offs_n
    if PAGE_SHIFT >= 0:
        entry = keys >> PAGE_SHIFT
    else:
        entry = keys // page_size
    return tl.load(block_table_row + entry, mask=keys < seqlen_k, other=0)


@triton.jit
def tile_rows(page, start, offs_n, page_size, num_pages, stride_page, stride_key,
              ONE_PAGE: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """Offsets in a page pool of the rows of keys start + offs_n, from ``tile_pages``' entries:
    the page, clamped into the pool, times the page stride, plus the slot in it."""
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)  # never out of the pool
    keys = start if ONE_PAGE else start + offs_n
    if PAGE_SHIFT >= 0:
        slot = keys & ((1 << PAGE_SHIFT) - 1)
    else:
        slot = keys % page_size
    rows = page * stride_page + slot * stride_key
    if ONE_PAGE:
        rows = rows + offs_n * stride_key
    return rows


@triton.jit
def widen_e4m3(x):
    """e4m3 -> fp16 by ``cvt.rn.f16x2.e4m3x2`` in the tile's own register layout (GPU only).

    Not marked pure on purpose: Triton moves a pure conversion past the layout change into a dot
    operand, and an 8-bit B operand whose reduction dim is strided in memory (V, keys x head dim) is
    then gathered from shared memory one byte per load (128 loads per thread per 128 x 128 tile, then
    packed by integer multiply-adds). Widened where it was loaded, V reaches its operand layout as
    fp16 through ldmatrix.trans."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def tanh(x):
    # Through exp2 rather than libdevice, which the interpreter lacks.
    e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def key_blocks(m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key blocks of BLOCK_N that query rows [m0, m0 + BLOCK_M) see, as three stretches.

    Returns (lo, full_lo, full_hi, hi): blocks [full_lo, full_hi) are visible to every row (no mask
    needed, all keys in range); [lo, full_lo) and [full_hi, hi) need the mask; the rest are unseen.
    """
    last_row = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    full_lo = 0
    hi = seqlen_k
    full_hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(m0 + diag_offset - window_left, 0)
        full_lo = tl.maximum(last_row + diag_offset - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(last_row + diag_offset + window_right + 1, seqlen_k)
        full_hi = tl.minimum(m0 + diag_offset + window_right + 1, seqlen_k)
    blk_lo = lo // BLOCK_N
    blk_hi = tl.maximum(tl.cdiv(hi, BLOCK_N), blk_lo)
    full_blk_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), blk_lo), blk_hi)
    full_blk_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, full_blk_lo), blk_hi)
    return blk_lo, full_blk_lo, full_blk_hi, blk_hi


@triton.jit
def query_blocks(n0, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query blocks of BLOCK_M that see keys [n0, n0 + BLOCK_N), as three stretches (see key_blocks).

    The full stretch also needs every key of the block in range and whole query blocks, so its loads
    need no mask.
    """
    last_key = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    full_lo = 0
    hi = seqlen_q
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:  # row i sees key j only if i >= j - diag - right
        lo = tl.maximum(n0 - diag_offset - window_right, 0)
        full_lo = tl.maximum(last_key - diag_offset - window_right, 0)
    if HAS_LEFT:  # ... and i <= j - diag + left
        hi = tl.minimum(last_key - diag_offset + window_left + 1, seqlen_q)
        full_hi = tl.minimum(n0 - diag_offset + window_left + 1, full_hi)
    if n0 + BLOCK_N > seqlen_k:  # a ragged key block needs the mask on every row
        full_hi = 0
    blk_lo = lo // BLOCK_M
    blk_hi = tl.maximum(tl.cdiv(hi, BLOCK_M), blk_lo)
    full_blk_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M), blk_lo), blk_hi)
    full_blk_hi = tl.minimum(tl.maximum(full_hi // BLOCK_M, full_blk_lo), blk_hi)
    return blk_lo, full_blk_lo, full_blk_hi, blk_hi


@triton.jit
def load_tile(src, blk, ptrs_ok, MASKED: tl.constexpr, BLOCK: tl.constexpr,
              D_MASK: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    """A (BLOCK, head_dim) tile from pointers or a tensor descriptor; fp32 under the interpreter's
    UPCAST (its bf16 arithmetic is wrong)."""
    if USE_TMA:
        t = src.load([blk * BLOCK, 0])
    elif MASKED or D_MASK:
        t = tl.load(src, mask=ptrs_ok, other=0.0)
    else:
        t = tl.load(src)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def sequence_span(Cu, batch, total, VARLEN: tl.constexpr):
    """(start, length) of one sequence: from cu_seqlens when VARLEN (clamped into [0, total], so even
    malformed offsets never move a load out of the tensor), else the whole dimension."""
    if VARLEN:
        start = tl.load(Cu + batch)
        end = tl.load(Cu + batch + 1)
        start = tl.minimum(tl.maximum(start, 0), total)
        end = tl.minimum(tl.maximum(end, start), total)
        return start, end - start
    else:
        return total * 0, total  # a tensor zero, so callers can widen it like the varlen start


@triton.jit
def dropout_keep(seed, row_offsets, cols, dropout_p):
    """Which probabilities dropout keeps: Philox from (seed, row * seqlen_k + key), so the forward,
    the backward and ``dropout_mask`` regenerate the same draw for the same (seed, row, key)."""
    return tl.rand(seed, row_offsets + cols) >= dropout_p


@triton.jit
def dropout_seed(Seed, batch, head, num_heads):
    """One Philox key per (batch, head), from the seed drawn with torch's generator for this call."""
    return tl.load(Seed) + (batch * num_heads + head)


@triton.jit
def sequence_descriptor(base, tensor, seqlen, stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr):
    """A tensor descriptor over one (sequence, head): ``seqlen`` rows of HEAD_DIM from ``base``, tiles
    of (BLOCK, HEAD_DIM_PAD) zero-filled past both. A TMA box needs every global dim >= 1: an empty
    sequence gets a one-row view of ``tensor``'s first row (inside the allocation), never used."""
    return tl.make_tensor_descriptor(tl.where(seqlen > 0, base, tensor), [tl.maximum(seqlen, 1), HEAD_DIM],
                                     [stride, 1], [BLOCK, HEAD_DIM_PAD])


@triton.jit
def head_terms(Alibi, stride_ab, DropoutSeed, batch, head, heads, ALIBI: tl.constexpr,
               DROPOUT: tl.constexpr):
    """What one (batch, query head) adds to its scores: the ALiBi slope in log2 units (0 without),
    and the Philox seed of its dropout stream (0 without); ``heads`` query heads in all."""
    alibi_slope = 0.0
    if ALIBI:
        alibi_slope = tl.load(Alibi + batch * stride_ab + head) * 1.4426950408889634
    rng_seed = 0
    if DROPOUT:
        rng_seed = dropout_seed(DropoutSeed, batch, head, heads)
    return alibi_slope, rng_seed


@triton.jit
def softcap_tanh(x, APPROX: tl.constexpr):
    """tanh for the logit softcap: the exp2 formula, or with APPROX tanh.approx.f32 (one MUFU op,
    relative error ~2^-11), which a training step takes in its forward and backward alike (sm_90; the
    interpreter runs no inline PTX, so CPU calls never ask for it)."""
    if APPROX:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        y = tanh(x)
    return y
