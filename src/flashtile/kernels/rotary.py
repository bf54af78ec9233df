"""Rotary embedding of q and the new keys, and the append of new keys/values to a KV cache, in one launch.

``flash_attn_with_kvcache`` calls this before the decode kernel. One program owns one token row of
one sequence and a block of heads: either query heads (rotated into a new tensor) or KV heads (the key
rotated and the value copied into the cache slots that follow ``cache_seqlens[b]``). Every position
is computed on the device from ``cache_seqlens``, ``cache_leftpad`` and ``block_table``; the host
never reads them, so a decode step stays capturable in a CUDA graph.

Rotary math follows the torch formulation it replaces: x1 * cos - x2 * sin and x1 * sin + x2 * cos in
float32, each product rounded on its own (the launch turns off FMA contraction), then one rounding to
the tensor's dtype. Dimensions past the rotary dim are copied unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .forward import interpreting


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _to_store_dtype(y, OUT_TY: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    if ROUND_BF16_BY_HAND:
        # The interpreter truncates float32 -> bfloat16. Round to nearest even on the bits first, so
        # the (exact) truncation that follows gives what the GPU's cvt.rn would. NaN keeps its bits.
        bits = y.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    return y.to(OUT_TY)


@triton.jit
def _rotate_heads(src, dst, stride_src_h, stride_dst_h, heads_ok, Cos, Sin, stride_cos, stride_sin,
                  position, seqlen_ro, write_ok,
                  BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                  HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                  ROUND_BF16_BY_HAND: tl.constexpr):
    """Copy BLOCK_H head rows from ``src`` to ``dst``, rotating their first ROTARY_DIM dims by the
    angles of row ``position`` of the cos/sin tables."""
    offs_h = tl.arange(0, BLOCK_H)
    src_rows = src + offs_h[:, None].to(tl.int64) * stride_src_h
    dst_rows = dst + offs_h[:, None].to(tl.int64) * stride_dst_h
    if ROTARY_DIM > 0:
        HALF: tl.constexpr = ROTARY_DIM // 2
        pair = tl.arange(0, HALF_PAD)
        pair_ok = pair < HALF
        # Lengths are checked on the host, but a replayed CUDA graph is not: stay inside the table.
        in_table = (position >= 0) & (position < seqlen_ro)
        row = tl.where(in_table, position, 0).to(tl.int64)
        cos = tl.load(Cos + row * stride_cos + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(Sin + row * stride_sin + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        if INTERLEAVED:  # GPT-J: pairs (2i, 2i + 1)
            first = 2 * pair
            second = 2 * pair + 1
        else:  # GPT-NeoX: pairs (i, i + ROTARY_DIM / 2)
            first = pair
            second = pair + HALF
        ok = heads_ok[:, None] & pair_ok[None, :]
        x1 = tl.load(src_rows + first[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src_rows + second[None, :], mask=ok, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        out_ty = dst.dtype.element_ty
        tl.store(dst_rows + first[None, :], _to_store_dtype(y1, out_ty, ROUND_BF16_BY_HAND),
                 mask=ok & write_ok)
        tl.store(dst_rows + second[None, :], _to_store_dtype(y2, out_ty, ROUND_BF16_BY_HAND),
                 mask=ok & write_ok)
    if ROTARY_DIM < HEAD_DIM:
        rest = ROTARY_DIM + tl.arange(0, REST_PAD)
        ok = heads_ok[:, None] & (rest < HEAD_DIM)[None, :]
        tl.store(dst_rows + rest[None, :], tl.load(src_rows + rest[None, :], mask=ok), mask=ok & write_ok)


@triton.jit
def _append_heads(KNew, VNew, KCache, VCache, Cos, Sin, CacheBatchIdx, BlockTable,
                  stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                  stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                  stride_cos, stride_sin, stride_btb, row, head, batch, length, start, heads_k,
                  seqlen_ro, cache_len, cache_rows, block_table_width,
                  BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  ROTARY_DIM: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                  INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr,
                  ROUND_BF16_BY_HAND: tl.constexpr, KEYS_ONLY: tl.constexpr = False):
    """Write new token ``row`` of sequence ``batch`` into its cache slot: key heads
    [head, head + BLOCK_H) rotated, value heads copied. KEYS_ONLY: the rotated keys alone, to row
    ``row`` of a (B, Sn, Hk, D) "cache" (an e4m3 cache quantizes them before they are appended)."""
    offs_h = tl.arange(0, BLOCK_H)
    heads_ok = head + offs_h < heads_k
    slot = length + row  # the cache slot of this new token (leftpad or not)
    if KEYS_ONLY:
        slot = row
    # A slot outside the cache writes nothing (host checks make this unreachable in eager calls).
    if PAGED:
        page_idx = tl.where(slot >= 0, slot, 0) // cache_len
        write_ok = (slot >= 0) & (page_idx < block_table_width)
        page = tl.load(BlockTable + batch.to(tl.int64) * stride_btb + page_idx, mask=write_ok, other=0)
        write_ok &= (page >= 0) & (page < cache_rows)
        in_page = (slot - page_idx * cache_len).to(tl.int64)
        k_dst = KCache + page.to(tl.int64) * stride_kcb + in_page * stride_kcs
        v_dst = VCache + page.to(tl.int64) * stride_vcb + in_page * stride_vcs
    else:
        cache_row = batch
        if BATCH_IDX:
            cache_row = tl.load(CacheBatchIdx + batch)
        write_ok = (slot >= 0) & (slot < cache_len) & (cache_row >= 0) & (cache_row < cache_rows)
        k_dst = KCache + cache_row.to(tl.int64) * stride_kcb + slot.to(tl.int64) * stride_kcs
        v_dst = VCache + cache_row.to(tl.int64) * stride_vcb + slot.to(tl.int64) * stride_vcs
    k_dst += head.to(tl.int64) * stride_kch
    v_dst += head.to(tl.int64) * stride_vch
    k_src = (KNew + batch.to(tl.int64) * stride_knb + row.to(tl.int64) * stride_kns
             + head.to(tl.int64) * stride_knh)
    v_src = (VNew + batch.to(tl.int64) * stride_vnb + row.to(tl.int64) * stride_vns
             + head.to(tl.int64) * stride_vnh)
    _rotate_heads(k_src, k_dst, stride_knh, stride_kch, heads_ok, Cos, Sin, stride_cos,
                  stride_sin, start + row, seqlen_ro, write_ok, BLOCK_H, HEAD_DIM, ROTARY_DIM,
                  HALF_PAD, REST_PAD, INTERLEAVED, ROUND_BF16_BY_HAND)
    if not KEYS_ONLY:
        dims = tl.arange(0, HEAD_DIM_PAD)
        ok = heads_ok[:, None] & (dims < HEAD_DIM)[None, :]
        values = tl.load(v_src + offs_h[:, None].to(tl.int64) * stride_vnh + dims[None, :], mask=ok)
        tl.store(v_dst + offs_h[:, None].to(tl.int64) * stride_vch + dims[None, :], values,
                 mask=ok & write_ok)


@triton.jit
def _rotate_and_append(Q, QOut, KNew, VNew, KCache, VCache, Cos, Sin, CacheSeqlens, CacheBatchIdx,
                       CacheLeftpad, BlockTable,
                       stride_qb, stride_qs, stride_qh, stride_qob, stride_qos, stride_qoh,
                       stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                       stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                       stride_cos, stride_sin, stride_btb,
                       seqlen_q, seqlen_new, heads, heads_k, q_head_blocks, seqlen_ro,
                       cache_len, cache_rows, block_table_width,
                       BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                       ROTARY_DIM: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                       INTERLEAVED: tl.constexpr, Q_CONSECUTIVE: tl.constexpr, ROTATE_Q: tl.constexpr,
                       APPEND: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr,
                       LEFTPAD: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
                       KEYS_ONLY: tl.constexpr = False):
    """Grid (rows, query head blocks + KV head blocks, batch): the first q_head_blocks programs of
    axis 1 rotate query heads into QOut, the rest append key/value heads to the cache (KEYS_ONLY:
    write the rotated keys to KCache, a (B, Sn, Hk, D) buffer)."""
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    batch = tl.program_id(2)
    length = tl.load(CacheSeqlens + batch)
    # Rotary positions count from the sequence's first slot, after any left padding.
    start = length
    if LEFTPAD:
        start = length - tl.load(CacheLeftpad + batch)
    offs_h = tl.arange(0, BLOCK_H)
    if ROTATE_Q:
        if (head_block < q_head_blocks) & (row < seqlen_q):
            head = head_block * BLOCK_H
            # flash_attn's rule: causal or local attention puts query i at start + i; otherwise
            # every query sits at the position of the first new token.
            position = start
            if Q_CONSECUTIVE:
                position = start + row
            src = (Q + batch.to(tl.int64) * stride_qb + row.to(tl.int64) * stride_qs
                   + head.to(tl.int64) * stride_qh)
            dst = (QOut + batch.to(tl.int64) * stride_qob + row.to(tl.int64) * stride_qos
                   + head.to(tl.int64) * stride_qoh)
            _rotate_heads(src, dst, stride_qh, stride_qoh, head + offs_h < heads, Cos, Sin,
                          stride_cos, stride_sin, position, seqlen_ro, row >= 0, BLOCK_H, HEAD_DIM,
                          ROTARY_DIM, HALF_PAD, REST_PAD, INTERLEAVED, ROUND_BF16_BY_HAND)
    if APPEND:
        if (head_block >= q_head_blocks) & (row < seqlen_new):
            _append_heads(KNew, VNew, KCache, VCache, Cos, Sin, CacheBatchIdx, BlockTable,
                          stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                          stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                          stride_cos, stride_sin, stride_btb, row, (head_block - q_head_blocks) * BLOCK_H,
                          batch, length, start, heads_k, seqlen_ro, cache_len, cache_rows,
                          block_table_width, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD, ROTARY_DIM, HALF_PAD,
                          REST_PAD, INTERLEAVED, PAGED, BATCH_IDX, ROUND_BF16_BY_HAND, KEYS_ONLY)


def heads_per_program(heads: int, head_dim: int) -> int:
    """Heads of one program: all of them up to about 4K elements per tile."""
    return max(1, min(_next_power_of_2(heads), 4096 // _next_power_of_2(head_dim)))


def tile_extents(head_dim: int, rotary_dim: int) -> dict:
    """The power-of-two tile widths the kernel needs (the launch and the AOT variants share them)."""
    return {"HEAD_DIM_PAD": _next_power_of_2(head_dim),
            "HALF_PAD": _next_power_of_2(max(rotary_dim // 2, 1)),
            "REST_PAD": _next_power_of_2(max(head_dim - rotary_dim, 1))}


def _launch(q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, interleaved: bool, q_consecutive: bool,
            keys_only: bool = False) -> None:
    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    rotary_dim = 2 * cos.shape[1] if cos is not None else 0
    rows_q = seqlen_q if q_out is not None else 0
    seqlen_new = k_new.shape[1] if k_new is not None else 0
    rows = max(rows_q, seqlen_new)
    if batch == 0 or rows == 0 or head_dim == 0:
        return
    block_h = heads_per_program(max(heads if rows_q else 1, heads_k if seqlen_new else 1), head_dim)
    q_head_blocks = -(-heads // block_h) if rows_q else 0
    kv_head_blocks = -(-heads_k // block_h) if seqlen_new else 0
    if cos is not None:
        # The kernel reads a table row as contiguous pairs; a strided table (rare) is copied once.
        cos = cos if cos.stride(1) == 1 else cos.contiguous()
        sin = sin if sin.stride(1) == 1 else sin.contiguous()
    paged = block_table is not None
    unused = (0, 0, 0)
    _rotate_and_append[(rows, q_head_blocks + kv_head_blocks, batch)](
        q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table,
        *q.stride()[:3], *(q_out.stride()[:3] if q_out is not None else unused),
        *(k_new.stride()[:3] if seqlen_new else unused), *(v_new.stride()[:3] if seqlen_new else unused),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        cos.stride(0) if cos is not None else 0, sin.stride(0) if sin is not None else 0,
        block_table.stride(0) if paged else 0,
        seqlen_q, seqlen_new, heads, heads_k, q_head_blocks, cos.shape[0] if cos is not None else 0,
        k_cache.shape[1], k_cache.shape[0], block_table.shape[1] if paged else 0,
        BLOCK_H=block_h, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, **tile_extents(head_dim, rotary_dim),
        INTERLEAVED=interleaved,
        Q_CONSECUTIVE=q_consecutive, ROTATE_Q=rows_q > 0, APPEND=seqlen_new > 0, PAGED=paged,
        BATCH_IDX=cache_batch_idx is not None, LEFTPAD=cache_leftpad is not None,
        ROUND_BF16_BY_HAND=interpreting() and q.dtype == torch.bfloat16, KEYS_ONLY=keys_only,
        num_warps=4, enable_fp_fusion=False)


@torch.library.custom_op("flashtile::rotate_and_append_", mutates_args=("q_out", "k_cache", "v_cache"),
                         device_types=("cuda", "cpu"))
def _rotate_and_append_op(q: torch.Tensor, q_out: Optional[torch.Tensor], k_new: Optional[torch.Tensor],
                          v_new: Optional[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                          cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
                          cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                          interleaved: bool, q_consecutive: bool, keys_only: bool = False) -> None:
    """What torch.compile sees of the launch: it writes q_out and the two caches in place."""
    _launch(q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, interleaved, q_consecutive, keys_only)


@_rotate_and_append_op.register_fake
def _(q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, interleaved, q_consecutive, keys_only=False):
    return None


def rotate_and_append(q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cos: Optional[torch.Tensor],
                      sin: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                      cache_batch_idx: Optional[torch.Tensor] = None,
                      cache_leftpad: Optional[torch.Tensor] = None,
                      block_table: Optional[torch.Tensor] = None, interleaved: bool = False,
                      q_consecutive: bool = True) -> torch.Tensor:
    """Rotate q and the new keys, and write the new keys and values into the cache, in one launch.

    q (B, Sq, H, D); k_new/v_new (B, Sn, Hk, D) or None (nothing appended); k_cache/v_cache
    (B_cache, S_max, Hk, D), or page pools (num_pages, page_size, Hk, D) with ``block_table``
    (B, max_pages) int32. cos/sin (seqlen_ro, rotary_dim / 2), or None (no rotary): the first
    rotary_dim dims turn, in pairs (2i, 2i + 1) if ``interleaved`` (GPT-J) else
    (i, i + rotary_dim / 2) (GPT-NeoX). ``cache_seqlens`` (B,) int32 on the device.

    New token j of sequence b goes to slot cache_seqlens[b] + j of cache row cache_batch_idx[b]
    (default b), or of the pages block_table[b] lists, and turns by the angle at position
    start[b] + j, where start = cache_seqlens - cache_leftpad (cache_leftpad defaults to 0). Query i
    turns at start[b] + i with ``q_consecutive`` (causal or local attention), else at start[b].

    Returns the rotated q as a new tensor, or q itself when there is no rotary; q is never modified.
    With neither rotary nor new keys there is nothing to do and nothing is launched.
    Positions are read on the device only. Values are assumed checked by the caller: slots outside
    the cache are skipped rather than written.
    """
    q_out = None
    if cos is not None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if torch.compiler.is_compiling():
        _rotate_and_append_op(q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens,
                              cache_batch_idx, cache_leftpad, block_table, interleaved, q_consecutive)
    else:  # eager calls skip the custom-op dispatcher, which costs more than this small kernel
        _launch(q, q_out, k_new, v_new, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, interleaved, q_consecutive)
    return q if q_out is None else q_out


def rotate_new_keys(q: torch.Tensor, k_new: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache_seqlens: torch.Tensor, cache_leftpad: Optional[torch.Tensor] = None,
                    interleaved: bool = False, q_consecutive: bool = True):
    """q and the new keys rotated as ``rotate_and_append`` would rotate them (the same positions),
    returned as new tensors (rotated q, rotated keys (B, Sn, Hk, D)) instead of appended: for a
    cache that stores something else (an e4m3 cache quantizes them first). One launch."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k_new.shape, dtype=k_new.dtype, device=k_new.device)
    # (the new keys and a one-element tensor stand in for the values and their cache: never read)
    args = (q, q_out, k_new, k_new, k_out, k_out.new_empty(1, 1, 1, 1), cos, sin, cache_seqlens, None,
            cache_leftpad, None, interleaved, q_consecutive, True)
    if torch.compiler.is_compiling():
        _rotate_and_append_op(*args)
    else:
        _launch(*args)
    return q_out, k_out
