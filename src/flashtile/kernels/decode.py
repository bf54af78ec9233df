"""Decode against a KV cache: split-KV (Flash-Decoding) on the forward's online-softmax loop.

One program per (split, batch, KV head). The query heads that share the KV head, times the Sq query
rows, are packed into the rows of one tile, so each K/V tile is read once for the whole group. The
keys a sequence sees are cut into ``num_splits`` chunks; each program writes its chunk's normalized
output and LSE, and ``combine`` merges the chunks by log-sum-exp (with one split the program writes
the output directly). Merging inside the split kernel (the last program to finish reads every
partial) was slower on the H200: its loop over the splits is serial, the combine kernel is not.
Sequence lengths are read on the device (``cache_seqlens``), never on the host, so a decode step can
be captured in a CUDA graph and replayed as the lengths grow.

Stream-K (``STREAM_PLANS``, opt-in): the splits above cut every sequence alike, so with lengths that
differ the programs of the longest sequences set the step's time. Stream-K lays the key tiles of all
(sequence, KV head) pairs end to end and gives each program an equal share, found on the device
from the lengths; a share that cuts a pair writes partials, which ``_combine_stream`` merges.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import key_blocks, visible
from .forward import LOG2E, _arch, _attn_fwd_inner, head_dim_padded, interpreting, small_shared_memory
from .launch import launch


def gluon_supported(q, k_cache, v_cache, **kwargs) -> bool:
    """Whether the Gluon (TMA) decode kernel takes the call (gluon_decode.supported)."""
    from . import gluon_decode
    return gluon_decode.supported(q, k_cache, v_cache, **kwargs)


@triton.jit
def _stream_layout(CacheSeqlens, CacheLeftpad, batch_size, heads_k, seqlen_q, seqlen_k_max,
                   window_left, window_right, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, LEFTPAD: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    """Stream-K decode: the key tiles of every (sequence, KV head) pair laid end to end, pair
    (b, h) at [ends[b] - n[b] * (heads_k - h), ...). Returns (n, ends, total): n[b] the key tiles
    sequence b's rows see (as _decode_part counts them), ends[b] the running total of n * heads_k
    through sequence b, total the sum (lanes past the batch hold n = 0)."""
    b = tl.arange(0, BLOCK_B)
    live = b < batch_size
    seqlen_k = tl.minimum(tl.maximum(tl.load(CacheSeqlens + b, mask=live, other=0), 0), seqlen_k_max)
    if LEFTPAD:
        seqlen_k -= tl.minimum(tl.maximum(tl.load(CacheLeftpad + b, mask=live, other=0), 0), seqlen_k)
    blk_lo, _, _, blk_hi = key_blocks(0, seqlen_q, seqlen_k, seqlen_k - seqlen_q, window_left,
                                      window_right, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    n = tl.where(live, blk_hi - blk_lo, 0)
    ends = tl.cumsum(n * heads_k, 0)
    return n, ends, tl.sum(n * heads_k, 0)


@triton.jit
def _attn_decode(Q, K, V, OutPart, LsePart, Out, Lse, CacheSeqlens, CacheBatchIdx,
                 CacheLeftpad, BlockTable, Alibi, KDescale, VDescale, QDescale, Sinks, stride_dsb, stride_dss,
                 stride_dsh, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_os, stride_ob, stride_oq, stride_oh,
                 stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb,
                 stride_lrh, stride_btb, stride_ab,
                 seqlen_q, seqlen_k_max, group_size, window_left, window_right, qk_scale, softcap_in,
                 page_size, num_pages, block_table_width, batch_size, heads_k,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr,
                 LEFTPAD: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
                 EMPTY_LSE: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr = 0,
                 WRITE_LSE: tl.constexpr = True, Q_FP16: tl.constexpr = False,
                 PAGE_SHIFT: tl.constexpr = -1, ROW_BLOCKS: tl.constexpr = False,
                 Q_DESCALE: tl.constexpr = False, SEQ_DS: tl.constexpr = False,
                 STREAM: tl.constexpr = False, BLOCK_B: tl.constexpr = 1, WARPS: tl.constexpr = 0,
                 SINKS: tl.constexpr = False):
    """Grid (splits, B, Hk x row blocks): program (split, b, h) takes its split of the key tiles
    sequence b's rows see in KV head h. STREAM (stream-K): grid (programs,), every program an
    equal share of all pairs' key tiles laid end to end (``_stream_layout``), as segments of at
    most one pair each; a segment holding a whole pair writes its output, the others partials at
    index program + pair, which ``_combine_stream`` merges. Sequences of any lengths then keep
    every program equally busy (one program per pair waits for the longest sequence)."""
    if PDL:  # launched before the previous kernel ends: touch no memory until it has
        gdc_wait()
        gdc_launch_dependents()  # the merge may launch now and wait for this grid in its turn
    if STREAM:
        n, ends, total = _stream_layout(CacheSeqlens, CacheLeftpad, batch_size, heads_k, seqlen_q,
                                        seqlen_k_max, window_left, window_right, ROWS, BLOCK_N,
                                        HAS_LEFT, HAS_RIGHT, LEFTPAD, BLOCK_B)
        program = tl.program_id(0)
        share = tl.maximum(tl.cdiv(total, tl.num_programs(0)), 1)
        pos = program * share
        stop = tl.minimum(pos + share, total)
        lanes = tl.arange(0, BLOCK_B)
        while pos < stop:
            batch = tl.sum((ends <= pos).to(tl.int32), 0)  # the first sequence ending past pos
            tiles = tl.sum(tl.where(lanes == batch, n, 0), 0)
            into = pos - (tl.sum(tl.where(lanes == batch, ends, 0), 0) - tiles * heads_k)
            kv_head = into // tiles
            first = into - kv_head * tiles
            count = tl.minimum(tiles - first, stop - pos)
            _decode_part(Q, K, V, OutPart, LsePart, Out, Lse, CacheSeqlens, CacheBatchIdx,
                         CacheLeftpad, BlockTable, Alibi, KDescale, VDescale, QDescale, Sinks, stride_dsb,
                         stride_dss, stride_dsh, stride_qb, stride_qs, stride_qh, stride_kb,
                         stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_os,
                         stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lh,
                         stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh, stride_btb,
                         stride_ab, seqlen_q, seqlen_k_max, group_size, window_left, window_right,
                         qk_scale, softcap_in, page_size, num_pages, block_table_width, heads_k,
                         program + batch * heads_k + kv_head, 1, batch, kv_head, 0, first, count,
                         ROWS, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
                         PAGED, BATCH_IDX, LEFTPAD, UPCAST, True, EMPTY_LSE, FP8, WRITE_LSE,
                         Q_FP16, PAGE_SHIFT, False, Q_DESCALE, SEQ_DS, True, 0, SINKS)
            pos += count
    else:
        # ROW_BLOCKS: a KV head's group x Sq query rows in blocks of ROWS (chunked prefill has
        # thousands of them), one program each; decode and speculative steps fit one block.
        if ROW_BLOCKS:
            row_blocks = tl.cdiv(group_size * seqlen_q, ROWS)
            kv_head = tl.program_id(2) // row_blocks
            row_block = tl.program_id(2) % row_blocks
        else:
            kv_head = tl.program_id(2)
            row_block = 0
        _decode_part(Q, K, V, OutPart, LsePart, Out, Lse, CacheSeqlens, CacheBatchIdx,
                     CacheLeftpad, BlockTable, Alibi, KDescale, VDescale, QDescale, Sinks, stride_dsb,
                     stride_dss, stride_dsh, stride_qb, stride_qs, stride_qh, stride_kb,
                     stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_os,
                     stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lh,
                     stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh, stride_btb,
                     stride_ab, seqlen_q, seqlen_k_max, group_size, window_left, window_right,
                     qk_scale, softcap_in, page_size, num_pages, block_table_width, heads_k,
                     tl.program_id(0), tl.num_programs(0), tl.program_id(1), kv_head, row_block,
                     0, 0, ROWS, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                     ALIBI, PAGED, BATCH_IDX, LEFTPAD, UPCAST, SPLIT, EMPTY_LSE, FP8, WRITE_LSE,
                     Q_FP16, PAGE_SHIFT, ROW_BLOCKS, Q_DESCALE, SEQ_DS, False, WARPS, SINKS)


@triton.jit
def _warp_split_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, keys, rows_pos, blk_lo,
                      blk_hi, seqlen_k, window_right, qk_scale, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr, HAS_RIGHT: tl.constexpr, UPCAST: tl.constexpr):
    """Key tiles [blk_lo, blk_hi) with the tile's keys split among the warps (``keys`` [WARPS, SUB]:
    warp w's offsets in a tile), every warp its own running max, sum and output ([WARPS, ...]
    states): the row reductions stay inside a warp (the 3-D dots put one warp on each slice)."""
    k_ptrs += (blk_lo * BLOCK_N).to(tl.int64) * stride_ks
    v_ptrs += (blk_lo * BLOCK_N).to(tl.int64) * stride_vs
    for blk in range(blk_lo, blk_hi):
        if MASKED:
            cols = blk * BLOCK_N + keys
            ok = cols < seqlen_k
            k = tl.load(k_ptrs, mask=ok[:, :, None], other=0.0)
            v = tl.load(v_ptrs, mask=ok[:, :, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k, (0, 2, 1)))
        if MASKED:
            keep = visible(rows_pos[None, :, None], cols[:, None, :], seqlen_k, 0, window_right,
                           False, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, :, None])
        m_i = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i


@triton.jit
def _warp_split_loop(q, k_base, v_base, stride_ks, stride_vs, rows_pos, s_lo, full_lo, full_hi, s_hi,
                     seqlen_k, window_right, qk_scale, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, WARPS: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     UPCAST: tl.constexpr):
    """The key tiles [s_lo, s_hi) of plain calls (contiguous 16-bit cache, head dim a power of two,
    no left window, softcap or ALiBi, one row block) with each tile's keys split among WARPS warps,
    their states merged once at the end: (acc, l_i, m_i) as the 2-D loop leaves them. On sm_90 the
    2-D loop runs ~350 instructions and 10 barriers per warp and 64-key tile (cross-warp row max and
    sum, P's layout change), one warp per SM sub-partition: near the tile's memory time, so its
    rounds slowed by up to 40% when the GPU lowered its clock at the power cap; this one ~300 and 2."""
    SUB: tl.constexpr = BLOCK_N // WARPS
    w = tl.arange(0, WARPS)
    keys = w[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [WARPS, SUB]
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    k_ptrs = k_base + keys[:, :, None] * stride_ks + d
    v_ptrs = v_base + keys[:, :, None] * stride_vs + d
    q3 = tl.broadcast_to(q[None, :, :], (WARPS, ROWS, HEAD_DIM))
    m_i = tl.full([WARPS, ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([WARPS, ROWS], dtype=tl.float32)
    acc = tl.zeros([WARPS, ROWS, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _warp_split_tiles(acc, l_i, m_i, q3, k_ptrs, v_ptrs, stride_ks, stride_vs, keys,
                                      rows_pos, s_lo, full_lo, seqlen_k, window_right, qk_scale,
                                      BLOCK_N, True, HAS_RIGHT, UPCAST)
    acc, l_i, m_i = _warp_split_tiles(acc, l_i, m_i, q3, k_ptrs, v_ptrs, stride_ks, stride_vs, keys,
                                      rows_pos, full_lo, full_hi, seqlen_k, window_right, qk_scale,
                                      BLOCK_N, False, HAS_RIGHT, UPCAST)
    acc, l_i, m_i = _warp_split_tiles(acc, l_i, m_i, q3, k_ptrs, v_ptrs, stride_ks, stride_vs, keys,
                                      rows_pos, full_hi, s_hi, seqlen_k, window_right, qk_scale,
                                      BLOCK_N, True, HAS_RIGHT, UPCAST)
    m_all = tl.max(m_i, 0)
    share = tl.exp2(m_i - m_all[None, :])
    return tl.sum(acc * share[:, :, None], 0), tl.sum(l_i * share, 0), m_all


@triton.jit
def _decode_part(Q, K, V, OutPart, LsePart, Out, Lse, CacheSeqlens, CacheBatchIdx,
                 CacheLeftpad, BlockTable, Alibi, KDescale, VDescale, QDescale, Sinks, stride_dsb, stride_dss,
                 stride_dsh, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_os, stride_ob, stride_oq, stride_oh,
                 stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb,
                 stride_lrh, stride_btb, stride_ab,
                 seqlen_q, seqlen_k_max, group_size, window_left, window_right, qk_scale, softcap_in,
                 page_size, num_pages, block_table_width, heads_k,
                 split, num_splits, batch, kv_head, row_block, first, count,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr,
                 LEFTPAD: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
                 EMPTY_LSE: tl.constexpr, FP8: tl.constexpr, WRITE_LSE: tl.constexpr,
                 Q_FP16: tl.constexpr, PAGE_SHIFT: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                 Q_DESCALE: tl.constexpr, SEQ_DS: tl.constexpr, STREAM: tl.constexpr,
                 WARPS: tl.constexpr = 0, SINKS: tl.constexpr = False):
    """Rows ``row_block`` of (sequence ``batch``, KV head ``kv_head``) against split ``split`` of
    ``num_splits`` of the key tiles they see, or (STREAM) against tiles [first, first + count) of
    them, writing partials at index ``split`` or, when that is all of them, the output. SINKS (an
    unsplit or stream-K plan: a split one's merge takes them, and stream-K's merge those of the pairs
    it merges): attention sinks, sinks[head] one more logit of each row's softmax with no value,
    folded in before the output's one rounding."""
    seqlen_k = tl.minimum(tl.maximum(tl.load(CacheSeqlens + batch), 0), seqlen_k_max)
    key_start = seqlen_k * 0
    if LEFTPAD:  # the sequence occupies cache slots [leftpad, cache_seqlens)
        key_start = tl.minimum(tl.maximum(tl.load(CacheLeftpad + batch), 0), seqlen_k)
        seqlen_k -= key_start
    diag_offset = seqlen_k - seqlen_q

    r = tl.arange(0, ROWS)  # row r = (query head g of the group, query position i)
    if ROW_BLOCKS:
        r += row_block * ROWS
    g = r // seqlen_q
    qi = r % seqlen_q
    row_ok = g < group_size
    head = kv_head * group_size + g
    rows_pos = qi + diag_offset
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + qi[:, None].to(tl.int64) * stride_qs
                + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :], mask=q_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_lo = q  # FP8 >= 4: the query's second e4m3 term
    if Q_FP16:
        # An e4m3 cache with a bf16 (or e4m3) query. A power of two brings max|q| into a range where
        # the query's bits survive, and the score scale takes it back: FP8 < 4, the math runs in
        # fp16 (which e4m3 widens to in one instruction per pair), max|q| in [64, 128), where fp16
        # holds every bf16 mantissa exactly (entries over 2^20 times smaller than the largest may
        # round, far below bf16's own rounding of the product); FP8 >= 4, e4m3 dots on the cache's
        # K: two e4m3 terms, max|q| in [128, 256), the first keeping each entry's leading 4
        # significant bits (truncated: exact in e4m3, no rounding to carry), the second the rest,
        # which a bf16 or e4m3 query holds in 4 more bits.
        q32 = q.to(tl.float32)
        amax_bits = tl.max(tl.max(tl.abs(q32), 1), 0).to(tl.int32, bitcast=True)
        top: tl.constexpr = 7 if FP8 >= 4 else 6
        shift = tl.minimum(tl.maximum(top - ((amax_bits >> 23) - 127), -120), 120)
        q_scale = ((127 + shift) << 23).to(tl.float32, bitcast=True)
        q32 = q32 * q_scale
        if FP8 >= 4:
            q_hi = (q32.to(tl.uint32, bitcast=True) & 0xFFF00000).to(tl.float32, bitcast=True)
            q = q_hi.to(tl.float8e4nv)
            q_lo = (q32 - q_hi).to(tl.float8e4nv)
        else:
            q = q32.to(tl.float16)
        if Q_DESCALE:  # an e4m3 query's descale, (B, Hk) contiguous: this program's factor
            q_scale = q_scale / tl.load(QDescale + batch.to(tl.int64) * heads_k + kv_head)
        if SOFTCAP:
            softcap_in = softcap_in / q_scale
        else:
            qk_scale = qk_scale / q_scale

    cache_row = batch
    if BATCH_IDX:
        cache_row = tl.load(CacheBatchIdx + batch)
    block_table_row = BlockTable
    if PAGED:
        k_src = K + kv_head.to(tl.int64) * stride_kh + offs_d[None, :]
        v_src = V + kv_head.to(tl.int64) * stride_vh + offs_d[None, :]
        block_table_row = BlockTable + batch.to(tl.int64) * stride_btb
    else:  # (k_base, v_base: key 0 of the sequence's rows in this KV head)
        k_base = (K + cache_row.to(tl.int64) * stride_kb + key_start.to(tl.int64) * stride_ks
                  + kv_head.to(tl.int64) * stride_kh)
        v_base = (V + cache_row.to(tl.int64) * stride_vb + key_start.to(tl.int64) * stride_vs
                  + kv_head.to(tl.int64) * stride_vh)
        k_src = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_src = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]

    # An e4m3 cache (FP8 >= 2): descales (B_cache or pages, S_max or page_size, Hk), one per key
    # and KV head, walked like the cache itself; SEQ_DS: FlashAttention-3's (B, Hk), the sequence's
    # for every key (key and page strides 0).
    k_descale = KDescale
    v_descale = VDescale
    stride_scale_n = stride_dss
    stride_scale_page = stride_dsb
    if FP8 >= 2:
        if SEQ_DS:
            at = batch.to(tl.int64) * stride_dsb + kv_head.to(tl.int64) * stride_dsh
            stride_scale_n = 0
            stride_scale_page = 0
        elif PAGED:
            at = kv_head.to(tl.int64) * stride_dsh
        else:
            at = (cache_row.to(tl.int64) * stride_dsb + key_start.to(tl.int64) * stride_dss
                  + kv_head.to(tl.int64) * stride_dsh)
        k_descale = KDescale + at
        v_descale = VDescale + at

    alibi_slope = tl.zeros([ROWS], dtype=tl.float32)
    if ALIBI:
        alibi_slope = tl.load(Alibi + batch * stride_ab + head, mask=row_ok, other=0.0) * 1.4426950408889634

    # The visible key blocks of all rows, then this split's share of them.
    if ROW_BLOCKS:
        # The block's query positions: consecutive within one query head; a block holding the end
        # of one head's rows and the start of the next one's takes all of them (a bound, not exact).
        block_first = row_block * ROWS
        block_last = tl.minimum(block_first + ROWS, group_size * seqlen_q) - 1
        one_head = block_first // seqlen_q == block_last // seqlen_q
        qi_first = tl.where(one_head, block_first % seqlen_q, 0)
        qi_last = tl.where(one_head, block_last % seqlen_q, seqlen_q - 1)
        # (BLOCK_M = 2^30: rows [qi_first, qi_last] whatever their span)
        blk_lo, full_lo, full_hi, blk_hi = key_blocks(qi_first, qi_last + 1, seqlen_k, diag_offset,
                                                      window_left, window_right, 1 << 30, BLOCK_N,
                                                      HAS_LEFT, HAS_RIGHT)
    else:
        blk_lo, full_lo, full_hi, blk_hi = key_blocks(0, seqlen_q, seqlen_k, diag_offset, window_left,
                                                      window_right, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if STREAM:
        s_lo = tl.minimum(blk_lo + first, blk_hi)
        s_hi = tl.minimum(s_lo + count, blk_hi)
    else:
        chunk = tl.cdiv(blk_hi - blk_lo, num_splits)
        s_lo = tl.minimum(blk_lo + split * chunk, blk_hi)
        s_hi = tl.minimum(s_lo + chunk, blk_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), s_hi)

    if WARPS > 0:
        acc, l_i, m_i = _warp_split_loop(q, k_base, v_base, stride_ks, stride_vs, rows_pos, s_lo,
                                         full_lo, full_hi, s_hi, seqlen_k, window_right, qk_scale,
                                         ROWS, BLOCK_N, HEAD_DIM, WARPS, HAS_RIGHT, UPCAST)
    else:
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, q_lo, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d, s_lo,
            full_lo, seqlen_k, window_left, window_right, qk_scale, softcap_in, alibi_slope[:, None],
            0, rows_pos, 0.0, block_table_row, page_size, num_pages, stride_kb, stride_vb, k_descale,
            v_descale, stride_scale_n, stride_scale_page, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT,
            SOFTCAP, ALIBI, UPCAST, False, False, PAGED, FP8, 1, PAGE_SHIFT)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, q_lo, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d, full_lo,
            full_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in, alibi_slope[:, None],
            0, rows_pos, 0.0, block_table_row, page_size, num_pages, stride_kb, stride_vb, k_descale,
            v_descale, stride_scale_n, stride_scale_page, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, HAS_LEFT, HAS_RIGHT,
            SOFTCAP, ALIBI, UPCAST, False, False, PAGED, FP8, 1, PAGE_SHIFT)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, q_lo, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d, full_hi,
            s_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in, alibi_slope[:, None],
            0, rows_pos, 0.0, block_table_row, page_size, num_pages, stride_kb, stride_vb, k_descale,
            v_descale, stride_scale_n, stride_scale_page, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT,
            SOFTCAP, ALIBI, UPCAST, False, False, PAGED, FP8, 1, PAGE_SHIFT)

    seen = l_i > 0.0
    if SINKS:  # (rows that saw no key keep output 0 and EMPTY_LSE, as apply_sinks_ leaves them)
        take = seen
        if STREAM:  # only a segment that is its whole pair writes the output; _combine_stream the rest
            take = take & (s_hi - s_lo == blk_hi - blk_lo)
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.where(take, tl.maximum(m_i, sink), m_i)
        alpha = tl.exp2(m_i - m_new)
        l_i = tl.where(take, l_i * alpha + tl.exp2(tl.minimum(sink - m_new, 0.0)), l_i)
        acc = acc * alpha[:, None]
        m_i = m_new
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    result = Out + batch.to(tl.int64) * stride_rb
    result_lse = Lse + batch.to(tl.int64) * stride_lrb
    if not SPLIT:  # the whole row in one program: no partials, no merge
        _store_rows(result, result_lse, out, lse, seen, qi, head, q_ok, row_ok, stride_rq, stride_rh,
                    stride_lrh, offs_d, EMPTY_LSE, WRITE_LSE)
    elif STREAM:  # a segment of the whole pair writes the output (_combine_stream leaves it)
        if s_hi - s_lo == blk_hi - blk_lo:
            _store_rows(result, result_lse, out, lse, seen, qi, head, q_ok, row_ok, stride_rq,
                        stride_rh, stride_lrh, offs_d, EMPTY_LSE, WRITE_LSE)
        else:
            _store_rows(OutPart + split.to(tl.int64) * stride_os, LsePart + split.to(tl.int64) * stride_ls,
                        out, lse, seen, qi, head, q_ok, row_ok, stride_oq, stride_oh, stride_lh, offs_d,
                        float("-inf"), True)
    else:
        # A split that saw nothing: output 0 and LSE -inf, so the merge gives it no weight.
        _store_rows(OutPart + split.to(tl.int64) * stride_os + batch.to(tl.int64) * stride_ob,
                    LsePart + split.to(tl.int64) * stride_ls + batch.to(tl.int64) * stride_lb,
                    out, lse, seen, qi, head, q_ok, row_ok, stride_oq, stride_oh, stride_lh, offs_d,
                    float("-inf"), True)


@triton.jit
def _store_rows(Out, Lse, out, lse, seen, qi, head, q_ok, row_ok, stride_q, stride_h, stride_lse_h,
                offs_d, EMPTY_LSE: tl.constexpr, WRITE_LSE: tl.constexpr):
    """The rows' output (in Out's dtype) and LSE (EMPTY_LSE where a row saw nothing) from the
    sequence's (or partial's) base pointers."""
    tl.store(Out + qi[:, None].to(tl.int64) * stride_q + head[:, None].to(tl.int64) * stride_h
             + offs_d[None, :], out.to(Out.dtype.element_ty), mask=q_ok)
    if WRITE_LSE:
        tl.store(Lse + head.to(tl.int64) * stride_lse_h + qi, tl.where(seen, lse, EMPTY_LSE),
                 mask=row_ok)


@triton.jit
def _combine(OutPart, LsePart, Out, Lse, Sinks, num_splits,
             stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lh,
             stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
             SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             EMPTY_LSE: tl.constexpr, PDL: tl.constexpr = False,
             LAUNCH_DEPENDENTS: tl.constexpr = False, SINKS: tl.constexpr = False):
    if PDL:  # resident while the splits finish; reads their partials only after they all have
        gdc_wait()
        if LAUNCH_DEPENDENTS:
            # The next kernel may launch now and wait for this grid in its turn. Only after the
            # 16-bit Gluon plans of one CTA per SM (_gluon_plan): B1 32/8 gained (12.5 -> 11.9 us
            # at 4k) but B16 12/2 lost 9-25% (24.6 -> 28.9 us at 4k, 131 -> 143 at 32k;
            # decode-probe-trigger-h200-20261130.json), and B1 12/2 at 32k read 11% slower with it
            # (bench decode) than without it earlier the same day.
            gdc_launch_dependents()
    qi = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = s < num_splits
    # The partial outputs first: they do not depend on the LSEs, and loaded after the LSE math (where
    # the compiler put them) the merge is two memory round trips instead of one.
    o = tl.load(OutPart + s[:, None].to(tl.int64) * stride_os + batch.to(tl.int64) * stride_ob
                + qi.to(tl.int64) * stride_oq + head.to(tl.int64) * stride_oh + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    lse = tl.load(LsePart + s.to(tl.int64) * stride_ls + batch.to(tl.int64) * stride_lb
                  + head.to(tl.int64) * stride_lh + qi, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    seen = m > float("-inf")
    if SINKS:
        # One more logit, sinks[head], with no value (kernels/sinks.py): its share of the mass joins
        # the splits' here, so the output is rounded once and no launch follows. A row no split saw
        # keeps output 0 and EMPTY_LSE, as apply_sinks_ leaves it.
        sink = tl.load(Sinks + head).to(tl.float32)
        m = tl.where(seen, tl.maximum(m, sink), m)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # each split's share of the softmax mass, unnormalized
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.where(seen, tl.exp(sink - m_safe), 0.0)
    w = w / tl.where(total > 0, total, 1.0)
    out = tl.sum(w[:, None] * o, 0)
    tl.store(Out + batch.to(tl.int64) * stride_rb + qi.to(tl.int64) * stride_rq
             + head.to(tl.int64) * stride_rh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)
    merged = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), EMPTY_LSE)
    tl.store(Lse + batch.to(tl.int64) * stride_lrb + head.to(tl.int64) * stride_lrh + qi, merged)


@triton.jit
def _combine_stream(OutPart, LsePart, Out, Lse, CacheSeqlens, CacheLeftpad, Sinks, batch_size, heads_k,
                    seqlen_q, seqlen_k_max, window_left, window_right, group_size, programs,
                    stride_os, stride_oq, stride_oh, stride_ls, stride_lh,
                    stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, LEFTPAD: tl.constexpr, BLOCK_B: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    EMPTY_LSE: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False,
                    SINKS: tl.constexpr = False):
    """The merge of a stream-K decode (_attn_decode's STREAM): row (qi, head) of sequence batch
    from the partials of the programs whose shares cut its pair, at index program + pair; a pair
    inside one program's share has its output written already, one without keys gets 0. SINKS:
    Sinks[head] joins the merged rows' softmax as one more logit with no value (as in _combine)."""
    if PDL:
        gdc_wait()
    qi = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    n, ends, total = _stream_layout(CacheSeqlens, CacheLeftpad, batch_size, heads_k, seqlen_q,
                                    seqlen_k_max, window_left, window_right, ROWS, BLOCK_N,
                                    HAS_LEFT, HAS_RIGHT, LEFTPAD, BLOCK_B)
    share = tl.maximum(tl.cdiv(total, programs), 1)
    lanes = tl.arange(0, BLOCK_B)
    tiles = tl.sum(tl.where(lanes == batch, n, 0), 0)
    kv_head = head // group_size
    start = tl.sum(tl.where(lanes == batch, ends, 0), 0) - tiles * (heads_k - kv_head)
    first = start // share
    last = (start + tiles - 1) // share
    d = tl.arange(0, HEAD_DIM_PAD)
    out_ptrs = (Out + batch.to(tl.int64) * stride_rb + qi.to(tl.int64) * stride_rq
                + head.to(tl.int64) * stride_rh + d)
    lse_ptr = Lse + batch.to(tl.int64) * stride_lrb + head.to(tl.int64) * stride_lrh + qi
    if tiles == 0:
        tl.store(out_ptrs, tl.zeros([HEAD_DIM_PAD], tl.float32).to(Out.dtype.element_ty),
                 mask=d < HEAD_DIM)
        if WRITE_LSE:
            tl.store(lse_ptr, EMPTY_LSE)
    elif last > first:
        pair = batch * heads_k + kv_head
        m = float("-inf")
        l_sum = 0.0
        acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
        for c0 in range(first, last + 1, SPLITS_PAD):
            c = c0 + tl.arange(0, SPLITS_PAD)
            ok = c <= last
            slot = (c + pair).to(tl.int64)
            o = tl.load(OutPart + slot[:, None] * stride_os + qi.to(tl.int64) * stride_oq
                        + head.to(tl.int64) * stride_oh + d[None, :],
                        mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
            lse = tl.load(LsePart + slot * stride_ls + head.to(tl.int64) * stride_lh + qi, mask=ok,
                          other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp(m - m_safe)
            w = tl.exp(lse - m_safe)
            l_sum = l_sum * rescale + tl.sum(w, 0)
            acc = acc * rescale + tl.sum(w[:, None] * o, 0)
            m = m_new
        seen = l_sum > 0
        if SINKS:
            sink = tl.load(Sinks + head).to(tl.float32)
            m_new = tl.where(seen, tl.maximum(m, sink), m)
            rescale = tl.where(seen, tl.exp(m - m_new), 1.0)
            l_sum = tl.where(seen, l_sum * rescale + tl.exp(sink - m_new), l_sum)
            acc = acc * rescale
            m = m_new
        out = acc / tl.where(seen, l_sum, 1.0)
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)
        if WRITE_LSE:
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            tl.store(lse_ptr, tl.where(seen, m_safe + tl.log(tl.where(seen, l_sum, 1.0)), EMPTY_LSE))


def combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, empty_lse: float = -math.inf, pdl: bool = False) -> None:
    """Merge (splits, B, Sq, H, D) partial outputs by their LSEs (splits, B, H, Sq) into ``out``
    (B, Sq, H, D) and ``lse`` (B, H, Sq); rows no split saw get 0 and ``empty_lse``."""
    splits, batch, seqlen_q, heads, head_dim = out_partial.shape
    if out.numel() == 0:
        return
    _launch_combine(out_partial, lse_partial, out, lse, _combine_options(splits, head_dim, empty_lse, pdl))


def _next_power_of_2(n: int) -> int:
    # Plain int math: triton.next_power_of_2 is a constexpr function that costs microseconds per
    # host call.
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=1024)
def _combine_options(splits: int, head_dim: int, empty_lse: float, pdl: bool,
                     launch_dependents: bool = False, sinks: bool = False) -> dict:
    """The combine kernel's constexprs and launch options (one dict per value: ``launch`` keys
    options by identity; never mutated). ``launch_dependents`` (with ``pdl``): the next kernel may
    launch as soon as the merge starts (see _combine); ``sinks``: the merge takes attention sinks."""
    splits_pad, head_dim_pad = max(2, _next_power_of_2(splits)), head_dim_padded(head_dim)
    # As few warps as hold the partials in 128 floats a thread: the reductions over the splits then
    # stay within a warp (shuffles) or cross few, and every load is issued before the first use
    # (decode-probe-combine-warps-h200-20261130.json: 1 warp -10% per layer at B16 12/2 1k with 8
    # splits, -4% at B1 32/8 4k with 32; 2 warps best with 64 splits, 4 with 128; 1 warp at 64
    # splits spilled, +2%).
    warps = max(1, min(4, splits_pad * head_dim_pad // 4096))
    return dict(SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                EMPTY_LSE=empty_lse, PDL=pdl, LAUNCH_DEPENDENTS=pdl and launch_dependents, SINKS=sinks,
                num_warps=warps, **({"launch_pdl": True} if pdl else {}))


@functools.lru_cache(maxsize=1024)
def _stream_combine_options_cached(items: tuple, head_dim: int, pdl: bool) -> dict:
    kernel = dict(items)
    return dict(ROWS=kernel["ROWS"], BLOCK_N=kernel["BLOCK_N"], HAS_LEFT=kernel["HAS_LEFT"],
                HAS_RIGHT=kernel["HAS_RIGHT"], LEFTPAD=kernel["LEFTPAD"], BLOCK_B=kernel["BLOCK_B"],
                SPLITS_PAD=16, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim),
                EMPTY_LSE=math.inf, WRITE_LSE=True, PDL=pdl, SINKS=kernel["SINKS"], num_warps=1,
                **({"launch_pdl": True} if pdl else {}))


def _stream_combine_options(kernel: dict, head_dim: int, pdl: bool) -> dict:
    """_combine_stream's constexprs and launch options for a stream-K decode kernel's (one dict
    per value, as ``launch`` wants)."""
    return _stream_combine_options_cached(tuple(sorted(kernel.items())), head_dim, pdl)


def _launch_combine_stream(out_partial, lse_partial, out, lse, cache_seqlens, cache_leftpad,
                           scalars: tuple, options: dict, sinks=None) -> None:
    """``scalars``: (batch, heads_k, seqlen_q, capacity, window_left, window_right, group,
    programs); ``sinks``: the (H,) logits of a merge whose options have SINKS."""
    batch, seqlen_q, heads, _ = out.shape
    launch(_combine_stream, (seqlen_q, heads, batch),
           (out_partial, lse_partial, out, lse, cache_seqlens, cache_leftpad, sinks),
           (*scalars, out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
            lse_partial.stride(0), lse_partial.stride(1), *out.stride()[:3], *lse.stride()[:2]),
           options)


def _launch_combine(out_partial, lse_partial, out, lse, options: dict, sinks=None) -> None:
    """``sinks``: the (H,) logits of a merge whose options have SINKS."""
    splits, batch, seqlen_q, heads, _ = out_partial.shape
    launch(_combine, (seqlen_q, heads, batch), (out_partial, lse_partial, out, lse, sinks),
           (splits, *out_partial.stride()[:4], *lse_partial.stride()[:3], *out.stride()[:3],
            *lse.stride()[:2]), options)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per step
    num_warps: int
    num_stages: int
    waves: int = 2  # the split heuristic aims at this many waves of programs over the SMs
    min_split_keys: int = 256  # ... and never splits below this many keys of the largest context
    # Programmatic dependent launch (sm_90+): the kernel may start while the previous one in the
    # stream finishes, and waits (griddepcontrol.wait) before touching memory.
    pdl: bool = False
    page_prefetch: bool = True  # paged caches: load the next tile's page numbers one step ahead
    max_splits: int = 128
    programs_per_sm: int = 1  # programs an SM runs at once: a wave is this many per SM
    # > 0: with (sequence, KV head) pairs filling half the SMs or more, split to at least ``waves``
    # programs per SM but to no more than this many, all resident at once, without wave balancing.
    resident_per_sm: int = 0
    # e4m3 caches: the query as two e4m3 terms and S by e4m3 dots on K as loaded (FP8 4/5 of the
    # inner loop) instead of K widened to fp16
    fp8_split_q: bool = False
    # Stream-K (_attn_decode's STREAM, merged by _combine_stream): every program an equal share of
    # all pairs' key tiles laid end to end. 1: as many programs as the split heuristic makes (pairs
    # x splits: with equal lengths the very same shares); 2: programs_per_sm programs per SM;
    # either way num_splits > 0 gives the program count.
    stream: int = 0


def decode_config(paged: bool, device: torch.device, programs: int = 1,
                  fp8_cache: bool = False, capacity: int = 0, head_dim: int = 128,
                  rows: int = 1) -> DecodeConfig:
    """From the H200 sweeps (benchmarks/results/tune-decode-*.json): short key steps and a deep
    pipeline on contiguous caches. On pages, with fewer (sequence, KV head) pairs than SMs: 128-key
    steps and 2 stages since pages of a power of two take shifts (+1-7% over 64-key steps and 3
    stages at batch 1, 16 and 64, page 16: tune-paged-shift-h200-20261130.json; e4m3 caches keep 3
    stages); with more, 32-key steps and 4 stages (+5% over 128-key steps at batch 64 with 32/8 heads,
    16k, page 16: tune-paged-configs-h200-20261130.json). ``programs``: sequences x KV heads;
    ``capacity``: the most keys a sequence can have (0: unknown). The 2-warp plans are for head dims
    up to 128 (measured at 128; at 192 and 256 their accumulators spill) and at most
    TWO_WARP_MAX_ROWS query rows a KV head (``rows``: group x Sq)."""
    if interpreting() or device.type != "cuda":
        return DecodeConfig(32, 4, 1)
    sms = _sm_count(device)
    arch = _arch(device.index if device.index is not None else torch.cuda.current_device())
    hopper = arch == 90
    if small_shared_memory(arch) and ((fp8_cache and head_dim > 64) or head_dim > 128):
        # GPUs with 99 KB a CTA (L4, L40S, A10, RTX), where the plans below need up to 288 KB:
        # e4m3 caches 64-key steps, 3 stages at head dim 128 (80 KB at 128 rows), 2 past it
        # (84 KB at 32 rows, the most tile_rows_for gives there); 16-bit caches past head dim 128
        # 32-key steps, 3 stages (82 KB at 32 rows). Compiled for sm_89 (variants --decode-plans),
        # not timed: no such GPU here. (e4m3 pools keep off 32-key steps: see WIDE_E4M3_PAGED_BLOCK_N.)
        if fp8_cache:
            return DecodeConfig(64, 4, 3 if head_dim <= 128 else 2, waves=2,
                                min_split_keys=256 if paged else 128)
        return DecodeConfig(32, 4, 3, waves=2, min_split_keys=256 if paged else 128)
    if hopper and rows > EIGHT_WARP_MIN_ROWS:
        return _wide_rows_config(paged, head_dim, fp8_cache)
    if hopper and head_dim > 128 and not fp8_cache and rows > TWO_WARP_MAX_ROWS:
        # 16-bit, head dims over 128, 17-64 query rows (64-row tiles, tile_rows_for): of the plans
        # below only 32-key steps with 4 stages fit in shared memory (160 KB at head dim 256;
        # 128-key steps with 2 stages need 289 KB, 64-key steps with 4 stages 288 KB, over the
        # 227 KB an sm_90 CTA may have: found by benchmarks/fuzz_gpu.py, fuzz-gpu-h200-20261202-
        # seed5.json). Not timed against anything else.
        return DecodeConfig(32, 4, 4, waves=2, min_split_keys=256 if paged else 128, pdl=not paged)
    if not hopper and head_dim > 128 and not fp8_cache and rows > 32:
        # The same off sm_90 (tiles of 64 or 128 rows; an A100 CTA may have 163 KB): 32-key steps,
        # 3 stages, 136 KB at 128 rows and head dim 256, where the plans below need 168-224 KB
        # (compiled for sm_80 by `python -m flashtile.kernels.variants --decode-plans`; not timed).
        return DecodeConfig(32, 4, 3, waves=2, min_split_keys=256 if paged else 128)
    if paged:  # PDL measured 6% slower here
        if programs < sms:
            # e4m3 pages of 33-64 query rows a KV head on sm_90: one stage, as the contiguous plan
            # below (spec-decode-ab-h200-20261201-stages-paged-sq8, page 16, against 3 stages: B1
            # 12/2 32k 22.6 -> 18.6 us, B2 12/2 32k 32.3 -> 29.3, B4 12/2 16k 31.9 -> 28.9, B1 12/2
            # 128k and B1 64/8 32k 3% faster, B16 12/2 16k the same, B16 64/8 8k 2% slower; more
            # rows: _wide_rows_config)
            stages = (1 if hopper and 32 < rows <= 64 else 3) if fp8_cache else 2
            return DecodeConfig(128, 4, stages, waves=2, min_split_keys=256,
                                fp8_split_q=fp8_cache and hopper and 32 < rows <= 64 and FP8_SPLIT_Q_ROWS64)
        if fp8_cache:  # (32-key steps not measured with e4m3 pages)
            return DecodeConfig(128, 4, 2, waves=2, min_split_keys=256)
        # Three of these programs fit on an SM at once: 2 splits for 132-198 pairs, where one had
        # run at 57-70% of the read ceiling (B24 32/8 16k 2954 -> 4148 GB/s, B20 32/8 4k 2407 ->
        # 3590: tune-paged-mid-h200-20261130.json); 1 from 199 pairs (unmeasured above 192).
        return DecodeConfig(32, 4, 4, waves=2, min_split_keys=256, resident_per_sm=3)
    two_warps = hopper and head_dim <= 128 and rows <= TWO_WARP_MAX_ROWS
    if fp8_cache:
        if two_warps:
            # Two warps per program, 64-key steps, 3 stages (255 registers, 55 KB: four programs per
            # SM), one wave of them: +7-8% over 4-warp 128-key programs at B16 32/8 4k/32k and B64
            # 12/2 16k, +4% at B1 32/8 32k (decode-probe-fp8-warps/-plan-h200-20261130.json). Fewer
            # warps share each tile's row max and sum, so fewer of the barriers that bound this
            # kernel. Splits down to one step each: with 256 keys at least, short batch-1 caches ran
            # on too few programs (B1 32/8 1k 0.63x of the 4-warp plan, decode-fp8-...-c.json).
            return DecodeConfig(64, 2, 3, waves=1, min_split_keys=64, pdl=True, programs_per_sm=4)
        # 128-key steps, 3 stages (decode-probe-fp8-h200-20261130.json: B16 32/8 32k 2941 GB/s of
        # e4m3 against 2473 with 64 keys and 4 stages, 1474-1974 with 8 warps). On sm_90 with more
        # than 32 query rows a KV head (tiles of 64 rows or more, the step compute-bound) one
        # stage: the tiles load straight into registers to be widened, without the software
        # pipeline's trip through shared memory. Speculative steps of 8 positions (48-64 rows), against 3
        # stages in one run (spec-decode-ab-h200-20261201-stages-sq8): B1 12/2 32k 27.5 -> 20.0
        # us, 128k 53.2 -> 48.6, B2 12/2 32k 36.9 -> 29.8, B4 12/2 16k 35.6 -> 29.4, B1 64/8 32k
        # 53.7 -> 48.9, B4 64/8 16k, B16 12/2 16k, B64 12/2 4k 1-2% faster, B16 64/8 8k 2.3% slower
        # (151.6 -> 155.2); 2 stages were slower than 3 at 6 of 9 points. The same in a second run
        # with outputs checked (-stages-b-sq8: 1.10-1.40x at 1-8 pairs, B16 64/8 8k 0.977x). (The
        # 2-warp plan above, one query position, lost 4-31% with 1 or 2 stages: -stages-sq1; so
        # did 24-32 rows in 32-row tiles, 1.16-1.25x slower than 3 stages at 8-128 pairs in one run,
        # -stages-rows32-b-sq4/-sq8, where sm_90 runs the Gluon kernel unless it refuses the call.)
        # 96-128 rows (Sq 16, -stages-sq16): 1.34-1.46x (B1 12/2 32k 84.2 -> 57.5 us, B16 12/2
        # 16k 313.0 -> 234.2, B1 64/8 32k 186.2 -> 135.7).
        # With one stage (sm_90, 33-64 rows) the query as two e4m3 terms and S by e4m3 dots on K
        # as loaded: FP8_SPLIT_Q_ROWS64.
        return DecodeConfig(128, 4, 1 if hopper and rows > 32 else 3, waves=2,
                            min_split_keys=128, pdl=True,
                            fp8_split_q=hopper and rows > 32 and FP8_SPLIT_Q_ROWS64)
    if hopper and 4 * programs >= 3 * sms and programs <= sms:
        # Pairs that alone fill 3/4 of the SMs or more, but not all: one unsplit program each (no
        # merge) with 64-key steps, 4 stages, one CTA per SM, rather than two splits: 128 pairs
        # (B16 32/8, B64 12/2) +10/+3/+1% at 1k/4k/16k (tune-decode-unsplit-h200-20261130.json).
        # Measured on the H200 only (its 128 KB of K/V stages would not fit some other GPUs).
        return DecodeConfig(64, 4, 4, waves=1, min_split_keys=128, pdl=True, max_splits=1)
    one_wave = sms // max(programs, 1)
    if hopper and one_wave >= 2 and capacity >= 2048 * one_wave:
        # Long caches: one wave of the same 64-key, 4-stage programs, as many splits per pair as
        # fill the SMs once, each at least 2048 keys long: B1 32/8 (16 splits) +2.2/+2.6% at 32k/64k
        # over 33 splits of 32-key steps (tune-decode-merged-h200-20261130.json).
        return DecodeConfig(64, 4, 4, waves=1, min_split_keys=128, pdl=True, max_splits=one_wave)
    if two_warps:
        # The rest: 2-warp programs of 32-key steps, 3 stages, as many as the 4-warp plan below
        # splits into: -5..-13% per layer at B1 32/8 4k, B2 32/8 8k, B4 32/8 4k, B8 12/2 2k, B16 12/2
        # 1k/4k, B1 12/2 32k, -1/-2% at B64 32/8 4k and B1 32/8 16k, +3% at B1 32/8 1k
        # (decode-probe-bf16-w2-ab2-h200-20261130.log): fewer warps share each tile's row max and sum.
        # With pairs filling half the SMs or more, at least 2 and at most 4 programs per SM (four fit
        # at once): one split per pair had left 160-192 pairs at 73-86% of the read ceiling, two
        # reach 100-103% (decode-probe-mid-pairs-h200-20261130.log); against the split counts before,
        # -7% per layer at 96 pairs, 16k, -15/-16% at 80 pairs, 4k, -16/-25% at 192/160 pairs
        # (decode-probe-mid-plan-h200-20261130.log).
        return DecodeConfig(32, 2, 3, waves=2, min_split_keys=128, pdl=True, resident_per_sm=4)
    return DecodeConfig(32, 4, 4, waves=2, min_split_keys=128, pdl=True)


def _wide_rows_config(paged: bool, head_dim: int, fp8_cache: bool = False) -> DecodeConfig:
    """sm_90, more than 64 query rows a KV head (speculative steps of 16 positions, chunked prefill
    against the cache), bf16 or e4m3 caches: tiles of 128 rows on 8 warps (two warpgroups of 64
    rows), 64-key steps, 3 stages, one wave of programs with splits of at least 256 keys. Same run
    (spec-decode-ab-h200-20261201-wide-c-sq16, Sq 16, 96-128 rows, 12/2 and 64/8 heads), us per
    layer against the 4-warp plans before (128-row tiles of 32-128 keys on 128 threads):
    bf16 B1 12/2 32k 26.6 -> 20.3, B4 12/2 16k 36.3 -> 29.6, B1 64/8 32k 138.8 -> 49.5, B16 12/2
    16k 256.1 -> 87.7, B64 12/2 4k 306.0 -> 98.2; pages of 16 (PDL off, as other paged plans)
    63.1/89.9/144.5/241.8/246.2 -> 22.2/32.8/54.6/100.6/111.3;
    e4m3 57.3/80.5/135.9/233.1/238.5 -> 29.6/47.5/86.7/156.6/168.0, pages 72.5/100.0/160.9/268.2/
    274.9 -> 37.7/62.9/114.4/215.4/229.3.
    With two waves, 1024-key splits, 2 or 4 stages or 128-key steps it was slower at one point or
    more (-wide-b). Head dims over 128 (not measured): 32-key steps and 2 stages, so that Q and the
    K/V stages fit in shared memory; e4m3 page pools 64-key steps (WIDE_E4M3_PAGED_BLOCK_N)."""
    split_q = fp8_cache and FP8_SPLIT_Q_WIDE
    if head_dim <= 128:
        return DecodeConfig(64, 8, 3, waves=1, min_split_keys=256, pdl=not paged, fp8_split_q=split_q)
    block_n = WIDE_E4M3_PAGED_BLOCK_N if fp8_cache and paged else 32
    return DecodeConfig(block_n, 8, 2, waves=1, min_split_keys=256, pdl=not paged, fp8_split_q=split_q)


# e4m3 page pools, head dims over 128, more than 64 query rows a KV head: 64-key steps. With 32-key
# steps the H200 gave wrong outputs (29-54x the error budget on every row): found by
# benchmarks/fuzz_gpu.py (fuzz-gpu-h200-20261201-seed4-fp8.json), isolated in
# fuzz-e4m3-wide-h200-20261201.log and wide-rows-check-h200-20261202.log. Any e4m3 page pool read in
# 32-key steps by tiles of 64 rows or more goes wrong on the H200 (head dim 128 too, pages of 1/16/
# 64, 1 or 2 stages, page numbers loaded ahead or not, V widened by PTX or by Triton, S by e4m3 dots
# or on widened K), and reads the pool's pages outside the block table (their NaN descales give NaN
# outputs); 16-row tiles, 64-key steps, contiguous caches, 16-bit pools and the interpreter are
# right, memcheck is clean. No shipped plan takes 32-key steps on e4m3 pools (the GPU plans above
# take 64 or 128; the interpreter's 32 are right); not understood.
WIDE_E4M3_PAGED_BLOCK_N = 64


# e4m3 caches past 64 query rows a KV head (_wide_rows_config): the query as two e4m3 terms and S by
# e4m3 dots on K as loaded, instead of K widened to fp16 in registers and stored back for the wgmma.
# Same run, Sq 16 (spec-decode-ab-h200-20261201-splitq-sq16, us per layer): B1 12/2 32k 29.5 -> 28.4,
# B4 12/2 16k 47.4 -> 45.1, B1 64/8 32k 86.8 -> 84.8, B16 12/2 16k 156.5 -> 146.0, B64 12/2 4k 167.8
# -> 159.8; pages of 16 4-9% faster. (Promoting the e4m3 sums to fp32 every 32 products,
# max_num_imprecise_acc, spilled 504 bytes of stack in the paged kernel; the checks read 0.325 of
# the accuracy budget without it, as with K widened.)
FP8_SPLIT_Q_WIDE = True
# ... and 33-64 query rows a KV head (the one-stage 4-warp plans, contiguous and on pages), same run
# against the same plans with K widened, Sq 8 (spec-decode-ab-h200-20261201-splitq-sq8, us per
# layer): B1 12/2 32k 20.0 -> 19.6, B4 12/2 16k 29.3 -> 27.9, B1 64/8 32k 48.9 -> 46.5, B16 12/2 16k
# 81.4 -> 75.9, B64 12/2 4k 85.0 -> 80.5, B16 64/8 8k 155.2 -> 144.9; pages of 16 18.7/29.0/49.0/
# 83.4/86.1/159.1 -> 17.7/26.8/44.1/74.1/76.9/143.0; 0.307 of the accuracy budget at most. (With 3
# stages, or 64-key steps, 0.64-0.99x the one-stage plan with K widened.)
FP8_SPLIT_Q_ROWS64 = True


# The 2-warp plans were measured with 4-6 query rows a KV head (one query position); a speculative
# step's 32-64 rows (8 positions) on 2 warps ran 3x slower than the paged 4-warp plan on the same
# e4m3 cache (fp8-decode-ab-paged-h200-20261201-sq8: B16 12/2 16k, 48 rows, 268.5 against 83.6 us).
# 4 warps from 17 rows, same run (spec-decode-ab-h200-20261201-sq8): e4m3 48 rows B16 12/2 16k
# 265.3 -> 83.2 us, B64 12/2 4k 276.3 -> 85.4, 32 rows B1 32/8 32k 59.5 -> 40.2 (Triton forced);
# bf16 caches unchanged at those points (their plans there were 4-warp ones already); at 24 rows
# with 2 pairs (B1 12/2 32k Sq 4) the 2-warp plan had been 2% faster (-sq4-b: 17.6 against 17.9 us).
TWO_WARP_MAX_ROWS = 16
# Past 16 query rows a KV head the Triton kernel's tile takes at least this many rows on sm_90
# (a wgmma's M is 64) with 16-bit caches: 24-32 rows 1.12-1.19x faster than in 32-row tiles
# (spec-decode-ab-h200-20261201-sq4-b/-sq8-b: B16 12/2 16k Sq 4 80.1 -> 70.1 us, B64 12/2 4k 79.6
# -> 68.4, B16 32/8 16k Sq 8 296.7 -> 248.9, B4 32/8 8k 44.5 -> 39.9; B1 12/2 32k Sq 4 18.9 ->
# 17.9). e4m3 caches keep the rows' own tile: 64 rows were 1.17-1.37x slower there (B16 12/2 16k
# Sq 4 67.1 -> 82.5 us, B16 32/8 16k Sq 8 233.7 -> 272.6).
WIDE_TILE_ROWS = 64
# Past this many query rows a KV head, sm_90 plans take 128-row tiles on 8 warps (_wide_rows_config).
EIGHT_WARP_MIN_ROWS = 64
# The most query rows one program of the Triton kernel holds; a KV head with more (chunked prefill
# against the cache: Sq x group rows) gets a program per block of them.
MAX_TILE_ROWS = 128
# ... and at head dims over 128 on GPUs with 99 KB of shared memory a CTA (forward.small_shared_memory)
SMALL_SHARED_MEMORY_TILE_ROWS = 32
MAX_GRID_Z = 65535  # (and grid y)


def split_heuristic(batch: int, heads_k: int, max_context: int, device: torch.device,
                    config: DecodeConfig | None = None) -> int:
    """Splits from what the host knows without reading the lengths: enough programs to cover the SMs
    ``waves`` times, none shorter than ``min_split_keys`` keys of the largest possible context."""
    cfg = config or DecodeConfig(64, 4, 2)
    slots = _sm_count(device) * cfg.programs_per_sm
    programs = max(1, batch * heads_k)
    longest = -(-max_context // cfg.min_split_keys)
    if cfg.resident_per_sm and 2 * programs >= slots:
        # Enough programs for the memory system (per-program rate is bound by its own pipeline), all
        # resident at once: 576 2-warp programs (4.4 per SM, a second round) ran 20-25% slower than 384.
        fill = -(-cfg.waves * slots // programs)
        most = max(1, cfg.resident_per_sm * slots // programs)
        return max(1, min(fill, most, longest, cfg.max_splits))
    # Once (batch, KV head) pairs alone fill half the SMs, one wave of splits was best on the H200.
    waves = cfg.waves if 2 * programs < slots else 1
    wanted = -(-waves * slots // programs)
    wanted = max(1, min(wanted, longest, cfg.max_splits))

    # Balance: the step lasts as long as the busiest SM. 9 splits x 32 pairs = 288 programs put 3 on
    # 24 SMs and 2 on the rest; 8 splits (256 programs) ran 11% faster at batch 16, 12/2 heads, 32k
    # (tune-decode-h200-20261129-e.json). So take the split count at or a little below the target
    # whose programs fill their last wave best.
    def balance(splits: int) -> float:
        per_sm = splits * programs / slots
        return per_sm / math.ceil(per_sm)

    # With one wave as the target, down to half of it: 256 pairs on four e4m3 programs per SM want 3
    # splits (768 programs, 1.45 waves) where 2 fill one (B32 32/8 16k: 57% -> 76% of the read ceiling;
    # 192-263 pairs +33-41% per layer: decode-probe-b64/-fp8-mid-h200-20261130.log). Only e4m3 plans
    # change (checked over 1-1100 pairs and 256-128k keys).
    lowest = max(1, math.ceil(0.7 * wanted) if waves > 1 else (wanted + 1) // 2)
    return max(range(lowest, wanted + 1), key=lambda s: (round(balance(s), 3), s))


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:  # get_device_properties costs microseconds on every decode step
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# What decode_attention derives on the host from a call's shapes, dtype, device and options (tile
# config, split count, constexprs, launch options), by that signature: worked out once, not on every
# call of every layer. transformers' growing cache changes the capacity at each step, hence the bound.
_PLANS: dict = {}
_MAX_PLANS = 1024
# 16-bit caches: the Triton kernel's calls as stream-K, opted into with FLASHTILE_DECODE_STREAM=1:
# four 32-key 2-warp programs per SM (STREAM_CONFIG). Against the plans as shipped, us per layer,
# ragged lengths drawn from [1, capacity] (stream-decode-h200-20261201-d): B16 32/8 4k/16k/64k
# 60.7 -> 50.5 / 187.7 -> 132.5 / 812.3 -> 546.2, B64 12/2 4k 60.0 -> 45.4, B64 32/8 16k 607.7 ->
# 539.4, B16 12/2 32k 119.9 -> 82.0, B64 12/2 32k 456.8 -> 259.6, B4 32/8 32k 81.9 -> 77.2
# (1.06-1.76x). The plan's own program count (pairs x splits, the opt-in before: -b, -c) lost at
# two of them (B16 32/8 4k 0.79x, B4 32/8 32k 0.93x: its shares cut nearly every short pair). With
# equal lengths STREAM_CONFIG is 4-11% slower than the shipped plans (-d; the plan's count 1-5%).
# Off by default: bench decode times equal lengths, where its points against cuDNN sit within 1%
# of parity.
STREAM_CONFIG = DecodeConfig(32, 2, 3, waves=1, pdl=True, stream=2, programs_per_sm=4)
STREAM_PLANS = os.environ.get("FLASHTILE_DECODE_STREAM", "0") not in ("", "0")
# ... and the 16-bit calls the Gluon kernel takes (page pools up to a few hundred pairs on sm_90),
# which have no stream-K form: at least this many splits, so that a long sequence's keys are cut
# over several programs. Page 16, ragged lengths, against the plans' own 1 split
# (stream-decode-paged16-h200-20261201-b): B16 32/8 4k/16k 1.02/1.14x, B64 32/8 16k 1.13x, B64
# 12/2 32k 1.15x (8 splits 0.87/1.14/1.13/1.18x); B16 12/2 and B4 32/8 32k plan 4 already. With
# it (-c): ragged 1.00-1.15x, equal lengths 0.89-1.00x (B16 32/8 4k 0.89x).
STREAM_GLUON_SPLITS = 4
STREAM_MAX_BATCH = 1024
# Eager calls with at most this many K+V bytes per (sequence, KV head) run unsplit, in one launch.
EAGER_ONE_LAUNCH_BYTES = 512 * 1024


def check_grid(batch: int, seqlen_q: int, heads: int, heads_k: int, tile_rows: int | None = None) -> int:
    """Blocks of query rows a KV head gets with tiles of ``tile_rows`` (by default the most rows a
    tile holds: MAX_TILE_ROWS); a ValueError where they or the batch pass CUDA's limit on the grid
    axes that hold them (the Gluon kernel's tiles take at most 64 rows in one)."""
    row_blocks = -(-(heads // heads_k * seqlen_q) // (tile_rows or MAX_TILE_ROWS))
    if heads_k * row_blocks > MAX_GRID_Z or batch > MAX_GRID_Z:
        raise ValueError(f"flash_attn_with_kvcache: seqlen_q={seqlen_q} with {heads} query heads or "
                         f"batch={batch} is too many programs for one call ({heads_k} KV heads x "
                         f"{row_blocks} blocks of query rows, batch at most {MAX_GRID_Z}); split the call")
    return row_blocks


def tile_rows_for(rows: int, fp8_cache: bool, device: torch.device, head_dim: int = 128) -> int:
    """Query rows in one tile of the Triton decode kernel, for ``rows`` query rows a KV head (more
    rows take more programs)."""
    tile_rows = max(16, _next_power_of_2(rows))
    arch = _arch(device.index if device.index is not None else torch.cuda.current_device()) if (
        device.type == "cuda" and not interpreting()) else 0
    if rows > 16 and not fp8_cache and arch >= 90:
        tile_rows = max(tile_rows, WIDE_TILE_ROWS)
    if small_shared_memory(arch) and head_dim > 128:  # see decode_config
        return min(tile_rows, SMALL_SHARED_MEMORY_TILE_ROWS)
    return min(tile_rows, MAX_TILE_ROWS)


def out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The output dtype of a decode with this query dtype: bf16 for an e4m3 query (FlashAttention-3's
    FP8 calls), else the query's."""
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


# Unsplit Triton plans with at most one program per SM (128 pairs: B16 32/8, B64 12/2) on contiguous
# 16-bit caches of at least WARP_SPLIT_MIN_KEYS keys split each key tile among the warps
# (_warp_split_loop). benchmarks/warp_split_probe.py, balanced rounds beside SDPA flash and cuDNN,
# x cuDNN at B16 32/8 16k / 32k / 128k and B64 12/2 32k: on GPUs whose streaming read gave 4,604-4,605
# GB/s, where the 2-D loop's rounds slowed by up to 8% (40% in bench decode -d), warp split 1.004-1.007
# / 1.001 / 0.991 / 1.001x against the 2-D loop's 1.003-1.006 / 0.974-0.981 / 0.965-0.973 / 0.975-0.981x
# (warp-split-probe-h200-20261203, -c); on GPUs at 4,680 GB/s, where the 2-D loop's rounds held, 0.996-
# 1.001 / 0.995-0.998 / 0.990 / 0.996x (B64 12/2 128k 1.001x) against 1.007-1.009 / 1.004-1.006 /
# 1.002-1.004 / 1.005x (1.002x) (-b, -layouts). The warp split's rounds stay within 1%: the smaller
# worst case, taken.
WARP_SPLIT = True
WARP_SPLIT_MIN_KEYS = 16384


def _plan(batch, seqlen_q, heads, heads_k, head_dim, dtype, device, paged, capacity, num_splits,
          config, has_left, has_right, has_softcap, has_alibi, has_batch_idx, has_leftpad, fp8_cache,
          one_launch, write_lse, page_size, gluon_ok=False, causal=False, q_descale=False,
          seq_descales=False, sinks=False):
    """(splits, upcast, the decode kernel's constexprs and launch options, the combine's or None,
    the Gluon kernel's variant or None). ``sinks``: attention sinks, taken by the merge of a split
    plan and by the kernels' unsplit epilogues (run_decode applies them after stream-K plans)."""
    if gluon_ok and config is None:
        return _gluon_plan(batch, heads_k, head_dim, dtype, device, capacity, num_splits,
                           page_size if paged else 0, causal, has_batch_idx, one_launch, fp8_cache,
                           heads // heads_k * seqlen_q, q_descale, seq_descales, sinks)
    rows = heads // heads_k * seqlen_q  # query rows a KV head
    tile_rows = tile_rows_for(rows, fp8_cache, device, head_dim)
    # programs per sequence: KV heads x blocks of rows (see _attn_decode)
    heads_k_blocks = heads_k * -(-rows // tile_rows)
    cfg = config or decode_config(paged, device, batch * heads_k_blocks, fp8_cache, capacity, head_dim,
                                  rows)
    # (every stream-K program holds a vector of all the lengths: up to STREAM_MAX_BATCH of them)
    stream_ok = not one_launch and rows <= tile_rows and batch <= STREAM_MAX_BATCH
    if config is None and STREAM_PLANS and not fp8_cache and num_splits == 0 and stream_ok:
        cfg = dataclasses.replace(STREAM_CONFIG, page_prefetch=cfg.page_prefetch)
    stream = bool(cfg.stream) and stream_ok
    if stream:  # splits: the programs, each a share of every pair's tiles
        if num_splits > 0:
            splits = num_splits
        elif cfg.stream == 2:
            splits = _sm_count(device) * cfg.programs_per_sm
        else:
            splits = batch * heads_k * split_heuristic(batch, heads_k_blocks, capacity, device, cfg)
    elif one_launch:
        splits = 1
    else:
        splits = num_splits if num_splits > 0 else split_heuristic(batch, heads_k_blocks, capacity,
                                                                   device, cfg)
    # The interpreter truncates fp32 -> bf16 stores: write fp32 there and let torch round.
    upcast = interpreting() and out_dtype(dtype) == torch.bfloat16
    pdl = cfg.pdl and not interpreting() and device.type == "cuda" and _arch(
        device.index if device.index is not None else torch.cuda.current_device()) >= 90
    launch = {"launch_pdl": True} if pdl else {}
    block_n, num_stages = cfg.block_n, cfg.num_stages
    paged_mode, page_shift = 0, -1
    if paged:
        paged_mode = 2 if cfg.page_prefetch else 1
        if page_size & (page_size - 1) == 0:  # a power of two: shifts, and one entry per tile when
            page_shift = page_size.bit_length() - 1  # a tile fits in a page
            if cfg.page_prefetch and page_size >= block_n:
                paged_mode = 3
    # Unsplit plans of at most one CTA per SM on long contiguous 16-bit caches (sm_90, where it was
    # measured, and the interpreter): the tile's keys split among the warps (_warp_split_loop)
    hopper = device.type == "cuda" and _arch(
        device.index if device.index is not None else torch.cuda.current_device()) >= 90
    warps = cfg.num_warps if (
        WARP_SPLIT and (hopper or interpreting()) and config is None and not paged and not fp8_cache
        and not stream and splits == 1 and not (has_left or has_softcap or has_alibi)
        and rows <= tile_rows <= 16 and head_dim == 128 and dtype in (torch.float16, torch.bfloat16)
        and capacity >= WARP_SPLIT_MIN_KEYS
        and batch * heads_k_blocks <= _sm_count(device) and block_n // cfg.num_warps >= 16) else 0
    kernel = dict(
        ROWS=tile_rows, ROW_BLOCKS=rows > tile_rows, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), HAS_LEFT=has_left,
        HAS_RIGHT=has_right, SOFTCAP=has_softcap, ALIBI=has_alibi,
        PAGED=paged_mode, PAGE_SHIFT=page_shift, BATCH_IDX=has_batch_idx,
        LEFTPAD=has_leftpad, UPCAST=upcast, SPLIT=splits > 1, EMPTY_LSE=math.inf, PDL=pdl,
        FP8=_fp8_cache_mode(device, cfg.fp8_split_q) if fp8_cache else 0,
        WRITE_LSE=write_lse or splits > 1 or stream,
        Q_FP16=fp8_cache and dtype in (torch.bfloat16, torch.float8_e4m3fn),
        Q_DESCALE=q_descale, SEQ_DS=fp8_cache and seq_descales,
        STREAM=stream, BLOCK_B=_next_power_of_2(batch) if stream else 1, WARPS=warps,
        SINKS=sinks and (splits == 1 or stream), num_warps=cfg.num_warps, num_stages=num_stages, **launch)
    # One dict object per distinct content: ``launch`` keys options by identity, and plans of
    # different capacities (a growing cache) with equal options must share its compiled kernels.
    kernel = _OPTIONS.setdefault(tuple(sorted(kernel.items())), kernel)
    if stream:
        merge = _stream_combine_options(kernel, head_dim, pdl)
    else:
        merge = _combine_options(splits, head_dim, math.inf, pdl, sinks=sinks) if splits > 1 else None
    return splits, upcast, kernel, merge, None


# The Gluon kernel (gluon_decode.py: TMA boxes of whole pages or tiles from a producer warp) on
# sm_90. Same run against the Triton kernel's paged plan, page 16, us per layer
# (gluon-decode-check-h200-20261130-c.json): B1 32/8 16k 26.1 -> 22.8, 32k 42.3 -> 38.9, B1 12/2 32k
# 17.4 -> 16.3, B16 32/8 16k 261.3 -> 258.2, B16 12/2 16k 73.5 -> 72.9, B64 12/2 16k 264.5 -> 265.3,
# B64 32/8 16k 996.4 -> 979.5. Its plans: 64-key tiles, 4 stages (one CTA per SM) and one wave of
# programs (at most SMs // pairs splits, none shorter than 128 keys of the capacity) while the
# (sequence, KV head) pairs are fewer than the SMs; from there 3 stages, two CTAs per SM, which ran
# B64 32/8 1k 75.8 -> 69.6 us, 4k 258.1 -> 254.0 (gluon-decode-tune-h200-20261130.json).
GLUON_ONE_PER_SM = DecodeConfig(64, 4, 4, waves=1, min_split_keys=128, pdl=True)
GLUON_TWO_PER_SM = DecodeConfig(64, 4, 3, waves=1, min_split_keys=128, pdl=True, programs_per_sm=2)
# e4m3 caches (contiguous), the transposed consumer (gluon_decode.DecodeVariant.rows_n): 64-key
# tiles, 2 stages, three CTAs per SM (70 KB of shared memory, 80 registers): 1.18-1.21x the Triton
# kernel at B16 32/8 32k, B64 12/2 16k, B1 32/8 32k (fp8-decode-ab-h200-20261130). With more (sequence, KV
# head) pairs than such a wave holds, splits that fill the last wave (_e4m3_wave_splits), else
# GLUON_E4M3_WIDE (4 stages, two per SM, unsplit). At 512 pairs 3 splits (3.9 waves) read
# 92.9/89.3/87.6% of the ceiling at 16k/32k/128k, one split of three per SM (1.3 waves) 69/72/74%,
# GLUON_E4M3_WIDE (1.9 waves) 86/87/85% (fp8-decode-ab-splits-h200-20261201.json); against
# GLUON_E4M3_WIDE in one run (fp8-decode-ab-short-h200-20261201.json): B64 32/8 4k +3%, B128 32/8
# 4k/16k +4/+7%, B50 32/8 16k (8 splits, 400 pairs) +6%, but B64 32/8 2k -6% (2 splits: 2.6 waves
# of three per SM against 1.9 of two); at 1k, 3 splits of 341 keys took 53.7 us
# (decode-fp8-nvidia-h200-20261201-a.json), GLUON_E4M3_WIDE 48.2 us.
GLUON_E4M3 = DecodeConfig(64, 4, 2, waves=1, min_split_keys=128, pdl=True, programs_per_sm=3)
# With at most 16 query rows a KV head, V^T is widened in registers as the A operand of P V
# (gluon_decode.DecodeVariant.v_regs) instead of in two shared fp16 tiles (no stores, no 32 KB):
# same-run A/B against the shared tiles (fp8-decode-ab-vregs-h200-20261201-a/-b), three per SM,
# 2 stages both: B1 32/8 32k 63.8 -> 68.0% of the ceiling, 128k 86.2 -> 90.6%, B1 12/2 32k 35.5
# -> 38.6%, B16 12/2 16k/32k 76.8/85.8 -> 80.9/90.1%, B16 32/8 4k/32k 76.3/90.9 -> 80.9/98.0%,
# B64 12/2 16k 89.5 -> 95.1%, B64 32/8 4k/16k/128k 84.2/92.7/89.4 -> 89.9/99.5/95.6%. Deeper
# rings, which the freed shared memory allows, were slower: 3 stages 0-9%, 4 stages 0.5-12%.
E4M3_V_REGS = True
# ... and with at most 8 rows the consumer fits 64 registers: four CTAs per SM, which from
# E4M3_FOUR_MIN_PAIRS (sequence, KV head) pairs read more (-b: B64 32/8 4k/16k/128k 95.8/104.0/98.2%,
# B16 32/8 4k/32k 82.0/99.2%, B64 12/2 16k 95.5%), the same at 32 pairs (B16 12/2) and less at 8
# and 2 (B1 32/8 32k/128k 64.9/88.7%, B1 12/2 32k 38.1%: 66 splits against 49).
GLUON_E4M3_FOUR = DecodeConfig(64, 4, 2, waves=1, min_split_keys=128, pdl=True, programs_per_sm=4)
E4M3_FOUR_MIN_PAIRS = 64
# ... and splits of at most E4M3_DS_RING_SPLIT keys of the capacity have the producer load each
# tile's descales into a shared ring (gluon_decode.DecodeVariant.ds_ring) instead of the consumer
# a tile ahead, whose loop waited for those loads (a third of its stall samples at B16 12/2 16k,
# ncu-decode-source-fp8-12-2-h200-20261201.log): same-run A/B (fp8-decode-ab-vregs-h200-20261201-f)
# B1 12/2 32k 38.2 -> 39.5%, B16 12/2 16k 80.9 -> 82.4%, B1 32/8 32k/128k 67.7/90.4 -> 69.0/91.9%,
# B64 12/2 4k 80.5 -> 81.8%, B16 32/8 4k 81.9 -> 82.1%; but with long splits, where the memory is
# saturated, 2-4% less (B64 32/8 16k/32k 104.9/105.4 -> 101.7/102.7%, B16 32/8 128k 105.6 -> 102.1%)
E4M3_DS_RING_SPLIT = 3072  # between 2675 (ring faster) and 4096 (B16 32/8 16k: 95 against 97% in bench decode-fp8 -e / -d)
# Paged e4m3 caches (pages of 8-256 keys, a power of two) through the Gluon kernel too, the
# producer fetching each key's descales by its page: the plans of contiguous caches, with the ring.
# Against the Triton kernel's paged e4m3 path in one run (fp8-decode-ab-paged-h200-20261201-a/-b,
# us per layer, page 16/64/256): B1 32/8 32k 33.4/33.6/34.5 -> 24.4/23.8/23.7, B16 12/2 16k
# 54.2/54.2/54.0 -> 42.0/40.3/40.3, B64 32/8 16k 862/860/842 -> 527/521/518; the contiguous caches
# 23.9, 40.0, 508-510.
GLUON_E4M3_PAGED = True
GLUON_E4M3_WIDE = DecodeConfig(64, 4, 4, waves=1, min_split_keys=128, pdl=True, programs_per_sm=2)
E4M3_MAX_WAVE_SPLITS = 8
E4M3_MIN_WAVE_SPLIT = 1024  # keys of the capacity a wave-filling split reads at least


def _e4m3_wave_plan(pairs: int, sms: int, capacity: int, configs: tuple,
                    wide: DecodeConfig | None) -> tuple[int, DecodeConfig]:
    """(splits, config) for more pairs than one wave of the first of ``configs`` (four or three
    programs per SM) holds: the fewest splits whose waves are 95% full on average (waves /
    ceil(waves)) or more, with the first config that gets there, else the fullest, none shorter
    than E4M3_MIN_WAVE_SPLIT keys of the capacity (at most E4M3_MAX_WAVE_SPLITS); (1, ``wide``)
    where its unsplit waves are fuller still."""
    most = max(1, min(E4M3_MAX_WAVE_SPLITS, capacity // E4M3_MIN_WAVE_SPLIT))

    def fill(programs: int, per_sm: int) -> float:
        waves = programs / (per_sm * sms)
        return round(waves / math.ceil(waves), 3)
    options = [(s, c) for s in range(1, most + 1) for c in configs]
    good = [o for o in options if fill(o[0] * pairs, o[1].programs_per_sm) >= 0.95]
    best = good[0] if good else max(options, key=lambda o: (fill(o[0] * pairs, o[1].programs_per_sm),
                                                            -o[0]))
    if wide is not None and fill(pairs, wide.programs_per_sm) > fill(best[0] * pairs,
                                                                      best[1].programs_per_sm):
        return 1, wide
    return best
# 17-32 query rows a KV head (speculative steps): 2 stages, two per SM (82 KB; 85 KB paged, whose
# descales the producer loads into the ring); more rows take the Triton kernel (the transposed
# consumer spilled at 64)
GLUON_E4M3_ROWS32 = DecodeConfig(64, 4, 2, waves=1, min_split_keys=128, pdl=True, programs_per_sm=2)
# ... with the descales loaded by the producer into the ring at every split length: speculative
# steps of 8 positions (32 rows), e4m3 pages (which always take the ring) read 1.2-1.3x faster than
# the same contiguous cache without it (fp8-decode-ab-paged-h200-20261201-sq8: B1 32/8 32k 36.2-37.3
# against 46.2 us, B16 32/8 16k 222-226 against 289); the contiguous cache with it against without,
# one run (spec-decode-ab-h200-20261201-sq8/-sq4): 32 rows B1 32/8 32k 46.6 -> 35.0 us, B4 32/8 8k
# 45.6 -> 34.4, B16 32/8 16k 289.9 -> 214.3; 24 rows B16 12/2 16k 78.1 -> 58.7.
E4M3_ROWS32_DS_RING = True
# 16-bit caches with at most 32 query rows a KV head and fewer (sequence, KV head) pairs than SMs:
# the transposed consumer (gluon_decode._decode_consumer_t), 4 stages and one CTA per SM where that
# plan's splits stream at least T16_LONG_SPLIT keys, else 3 stages and two per SM
# (paged-gap-t16-h200-20261130.log, page 16 against the shipped contiguous plan: B1 12/2 32k
# 0.902x -> 1.023x with two per SM (0.960x with one), B16 12/2 32k 0.950x -> 0.982x, B64 12/2 16k
# 0.961x -> 0.982x, B1 32/8 32k 0.987x -> 1.020x, B16 32/8 16k 0.980x -> 0.990x with one per SM;
# contiguous caches through it 1.001-1.045x the Triton plans at those points but B1 12/2 32k
# (0.98-0.99x), hence only for long splits of few pairs there: _t16_wanted). GLUON_T16 False: the
# 64-row consumer as before.
# Refined on 2026-12-01 (paged-gap-t16-b1(-wide)-h200-20261201.log, against the shipped contiguous
# plan, page 16 / contiguous): with 1-2 pairs two per SM also for long splits (B1 12/2 128k
# 0.995/1.030x, one per SM 4 stages 0.975/1.000x), and below 256 keys a split of two per SM one
# per SM with 3 stages (B1 12/2 16k 1.062x in two runs, two per SM 0.971/0.974x, one per SM with 4
# stages 0.928x; at 32k two per SM stays ahead: 1.022 against 0.996x). With at most
# T16_FEW_PAIRS pairs "long" counts the keys of the splits the one-per-SM plan makes: B1
# 32/8 16k has 16 of 1024 keys (short by 16384 x 8 < 1024 x 132); paged, one per SM ran 1.047x,
# two per SM 0.977x (0.967x in bench paged, paged-nvidia-h200-20261201-c.json); contiguous, the
# transposed consumer then took 20.7 us against the Triton plan's 22.6 (decode-...-20261201-b).
GLUON_T16 = True
GLUON_T16_LONG = GLUON_ONE_PER_SM
GLUON_T16_SHORT = DecodeConfig(64, 4, 3, waves=1, min_split_keys=128, pdl=True, programs_per_sm=2)
GLUON_T16_FEW = DecodeConfig(64, 4, 3, waves=1, min_split_keys=128, pdl=True)  # one per SM
T16_LONG_SPLIT = 1024
T16_FEW_PAIRS = 8
# Contiguous caches take the transposed consumer up to this many pairs (long splits only): with 16
# and 32 pairs it read 1.003-1.022x the Triton split plans from 16k
# (decode-long-ab-h200-20261203-b: B16 12/2 16k/32k/64k 1.022/1.010/1.003x, B4 32/8 32k 1.009x,
# B2 32/8 64k 1.015x; B16 12/2 128k 1.015x in -20261203); at 128 pairs (B16 32/8, B64 12/2) it
# was 0.98-0.99x the Triton plan's fast rounds (-b), steadier where those slowed (-20261203).
T16_CONTIGUOUS_PAIRS = 32
T16_TWO_PER_SM_PAIRS = 2  # up to this many pairs two per SM at every length
T16_TWO_PER_SM_SPLIT = 256  # ... where their splits read this many keys or more


def _t16_long(pairs: int, sms: int, capacity: int) -> bool:
    """Whether one CTA per SM, one wave of splits, gives each split T16_LONG_SPLIT keys or more (by
    the plan's own split count for few pairs, by the SMs' share of the keys for more)."""
    if pairs <= T16_FEW_PAIRS:
        return capacity >= T16_LONG_SPLIT * max(1, min(128, sms // pairs))
    return capacity * pairs >= T16_LONG_SPLIT * sms


def _t16_plan(pairs: int, sms: int, capacity: int) -> DecodeConfig:
    """The transposed 16-bit consumer's plan (see GLUON_T16)."""
    if pairs <= T16_TWO_PER_SM_PAIRS:
        two_per_sm_splits = max(1, min(128, 2 * sms // pairs))
        return (GLUON_T16_SHORT if capacity >= T16_TWO_PER_SM_SPLIT * two_per_sm_splits
                else GLUON_T16_FEW)
    return GLUON_T16_LONG if _t16_long(pairs, sms, capacity) else GLUON_T16_SHORT


def _t16_wanted(paged: bool, pairs: int, sms: int, capacity: int, rows: int) -> bool:
    """Whether a 16-bit call the Gluon kernel takes runs its transposed consumer: paged caches with
    fewer pairs than SMs; contiguous ones only with long splits and at most T16_CONTIGUOUS_PAIRS
    pairs (bench decode with it at every long contiguous point under the SMs,
    decode-nvidia-h200-20261130-j.json: B1 32/8 32k 1.08x cuDNN (was 1.02x), but B16 32/8 64k/128k
    0.99x, where the Triton plan had 1.007/1.005x)."""
    if not GLUON_T16 or rows > 32 or pairs >= sms:
        return False
    long = _t16_long(pairs, sms, capacity)
    if paged:
        # short pages with the SMs half full of pairs or more: the 64-row consumer unsplit (the
        # transposed one's two per SM split them: B16 32/8 and B64 12/2 at 1k 0.88/0.89x contiguous,
        # decode-nvidia-h200-20261130-k's paged twin, against 0.96/0.95x)
        return long or 2 * pairs < sms
    return pairs <= T16_CONTIGUOUS_PAIRS and long


def gluon_wanted(paged: bool, pairs: int, sms: int, capacity: int, fp8: bool = False,
                 rows: int = 64) -> bool:
    """Whether a call of this shape goes to the Gluon kernel (if it supports the call).

    Paged: all but 1-3x the SM count of (sequence, KV head) pairs, where its plans ran 10-18%
    slower than the Triton kernel's tuned mid-range splits (B20 32/8 4k 85.5 / 104.9 us contiguous /
    Gluon paged, B24 32/8 16k 374 / 417: gluon-decode-tune2-h200-20261130.json).
    Contiguous: where it measured faster than the Triton plans, short caches at batch 1-ish and 1k
    caches with the SMs nearly filled by pairs. bench decode with it at every pair count under the
    SMs up to 4k keys (decode-nvidia-h200-20261130-g.json) against the Triton plans (-f): B1 32/8 1k
    +14%, 4k +3%, B1 12/2 1k +21%, 4k +14%, B16 32/8 1k +4%, but B16 32/8 4k -1.3%, B16 12/2 1k
    -4%, 4k -0.7%; from 16k it was at parity or 1-2.5% slower (gluon-decode-check-h200-20261130-b).
    """
    if fp8:
        # e4m3 caches: contiguous ones, by the transposed consumer (S^T = K Q^T, the query rows as
        # the wgmmas' N), 1.08-1.21x the Triton kernel's e4m3 path in fp8-decode-ab-h200-20261130;
        # the first form (64 rows as M, 4-6 of them real) had been 0.5-0.8x. Paged: with V^T in
        # registers up to 16 rows, in shared tiles up to 32) and the descales by the producer (see
        # GLUON_E4M3_PAGED).
        return not paged or (GLUON_E4M3_PAGED and rows <= 32)
    if paged:
        return pairs < sms or pairs >= 3 * sms
    if _t16_wanted(False, pairs, sms, capacity, rows):
        return True  # long splits of few pairs through the transposed consumer (see GLUON_T16)
    return (pairs <= 8 and capacity <= 4096) or (96 <= pairs < sms and capacity <= 1024)


def _gluon_plan(batch, heads_k, head_dim, dtype, device, capacity, num_splits, page_size, causal,
                has_batch_idx, one_launch, fp8=False, rows=64, q_descale=False, seq_descales=False,
                sinks=False):
    from . import gluon_decode

    pairs = batch * heads_k
    sms = _sm_count(device)
    base = GLUON_TWO_PER_SM if pairs >= sms else GLUON_ONE_PER_SM
    transposed = fp8 or _t16_wanted(page_size > 0, pairs, sms, capacity, rows)
    if transposed and not fp8:
        base = _t16_plan(pairs, sms, capacity)
    wave_splits = 0  # e4m3 past one wave of three (four) CTAs per SM: the splits that fill the waves
    if fp8:
        many = (GLUON_E4M3_FOUR if E4M3_V_REGS and rows <= 8 and pairs >= E4M3_FOUR_MIN_PAIRS
                else GLUON_E4M3)
        if rows > 16:
            base = GLUON_E4M3_ROWS32
        elif pairs <= many.programs_per_sm * sms:
            base = many
        else:
            # V^T in registers: four or three per SM, split to fill the waves (two per SM, 4
            # stages, unsplit: 63% at B80 32/8 1k where three per SM unsplit read 80%,
            # fp8-decode-ab-vregs-h200-20261201-wide.log, whose baseline rows failed to run: a bug of
            # the tool, fixed since); the shared-tile kernel: three per SM or two
            wave_splits, base = _e4m3_wave_plan(
                pairs, sms, capacity, (many, GLUON_E4M3) if many is not GLUON_E4M3 else (many,),
                None if E4M3_V_REGS else GLUON_E4M3_WIDE)
    if one_launch:
        splits = 1
    elif num_splits > 0:
        splits = num_splits
    elif wave_splits:
        splits = wave_splits
    else:
        most = max(1, min(128, base.programs_per_sm * sms // pairs))
        splits = split_heuristic(batch, heads_k, capacity, device,
                                 dataclasses.replace(base, max_splits=most))
        if STREAM_PLANS and not fp8:  # the opt-in for lengths that differ (see STREAM_GLUON_SPLITS)
            splits = max(splits, STREAM_GLUON_SPLITS)
    # V^T in registers: three CTAs per SM at 80 registers, four at 64 (rows <= 8 only: 16 spill)
    v_regs = fp8 and E4M3_V_REGS and rows <= (8 if base.programs_per_sm == 4 else 16) \
        and base.programs_per_sm >= 3
    # (paged: always, with V in registers or not, the producer holding the page numbers the
    # descales' addresses need; 17-32 rows at every split length, see E4M3_ROWS32_DS_RING)
    # (per-sequence descales: one a program, nothing to load per tile)
    ds_ring = fp8 and not seq_descales and (page_size > 0 or (rows > 16 and E4M3_ROWS32_DS_RING) or (
        v_regs and -(-capacity // max(splits, 1)) <= E4M3_DS_RING_SPLIT))
    variant = gluon_decode.DecodeVariant(
        head_dim, gluon_decode.dtype_name(out_dtype(dtype)), base.block_n, base.num_stages, page_size > 0,
        min(page_size, base.block_n) if page_size else 0, causal, has_batch_idx, pdl=True,
        heads_first=True, fp8=fp8,
        # the query rows a KV head as the N of transposed tiles (8, 16 or 32)
        rows_n=next(n for n in (8, 16, 32) if rows <= n) if transposed else 0,
        v_regs=v_regs, regs=64 if v_regs and base.programs_per_sm == 4 else 0, ds_ring=ds_ring,
        q_fp8=dtype == torch.float8_e4m3fn, q_descale=q_descale, seq_ds=fp8 and seq_descales)
    # The merge of a 16-bit plan of one CTA per SM lets the next kernel launch as it starts: 0.4-0.6
    # us less a layer at B1 32/8 from 4k, contiguous and on 16-key pages; two CTAs per SM lost 0.9
    # us at B1 12/2 128k, e4m3 plans gained or lost up to 7 us (merge-share-h200-20261203-b/-c)
    trigger = not fp8 and base.programs_per_sm == 1
    merge = _combine_options(splits, head_dim, math.inf, True, trigger, sinks) if splits > 1 else None
    return splits, False, None, merge, variant


_OPTIONS: dict = {}


def _fp8_cache_mode(device: torch.device, split_q: bool = False) -> int:
    """The FP8 constexpr of an e4m3 cache: 3 (V widened by ``cvt.rn.f16x2.e4m3x2`` where it is
    loaded, then moved to its operand layout as fp16) on GPUs with e4m3 conversions, else 2 (Triton's
    conversion, which it applies after gathering the 8-bit operand: one shared-memory load per byte).
    ``split_q``: the query as two e4m3 terms and e4m3 dots on K, V widened as in 3 (4; GPUs with
    e4m3 tensor cores) or by Triton (5: the interpreter)."""
    if interpreting() or device.type != "cuda":
        return 5 if split_q else 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    if split_q and _arch(index) >= 89:
        return 4
    return 3 if _arch(index) >= 89 else 2


def describe_plan(q, k_cache, v_cache, block_table=None, causal: bool = True,
                  in_graph: bool = True) -> dict:
    """The kernel and split count a default flash_attn_with_kvcache call on these tensors gets (for
    reports; ``in_graph``: as captured in a CUDA graph, where short caches keep their splits):
    {"kernel": "gluon-prefill", "gluon-tma" or "triton", "num_splits": n, "gathered": whether the
    prefill forward reads a contiguous copy of the page pools}."""
    p = prepare_decode(q, k_cache, v_cache, softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                       window_right=0 if causal else -1, block_table=block_table, in_graph=in_graph)
    kernel = "gluon-prefill" if p.prefill is not None else "gluon-tma" if p.gluon is not None else "triton"
    return {"kernel": kernel, "num_splits": p.splits, "gathered": p.prefill is not None and p.prefill[2]}


# Query positions from which a call on a contiguous 16-bit cache may run the Gluon prefill forward
# (one CTA per 128 query positions of a head, keys per sequence from cache_seqlens on the device)
# instead of the decode kernel, whose tiles pack a KV head's query rows for reading the cache once.
# The forward does not split the keys, so it also needs work tiles (batch x heads x 128-position
# blocks) for at least half the SMs. H200, 8k keys, 32/8 heads (chunked-prefill-h200-20261201-d):
# 128 positions (32 tiles) 99.0 us against the decode kernel's 62.3, 256 (64 tiles) 100.1 / 103.4,
# 512 (128 tiles) 106.7 / 172.6; 12/2 heads 128 positions (12 tiles) 97.2 / 48.7.
PREFILL_MIN_QUERIES = 128
PREFILL_BLOCK = 128
PREFILL_MIN_TILES_PER_SM = 0.5


def prefill_wanted(q, k_cache, v_cache, *, causal: bool, window_left: int, window_right: int,
                   softcap: float, alibi_slopes, block_table, cache_batch_idx, cache_leftpad,
                   num_splits: int, config) -> bool:
    """Whether a flash_attn_with_kvcache call is chunked prefill the Gluon forward takes: at least
    PREFILL_MIN_QUERIES query positions, a contiguous cache of one row per sequence, rows picked by
    ``cache_batch_idx`` (read as one-page tables: ``prefill_table``) or page pools, with rows or
    pages of a multiple of 16 keys (``gluon_forward.paged_supported``) or of other sizes gathered
    into a contiguous cache first (``prefill_gathers``), in q's 16-bit dtype, causal or full
    attention without softcap or ALiBi, no forced split count or plan, on an sm_90 GPU (the answer
    cached by the tensors' geometry, as the plain forward's plan), and work tiles for at least half
    the SMs."""
    if (q.shape[1] < PREFILL_MIN_QUERIES or config is not None or num_splits > 1
            or cache_leftpad is not None
            or alibi_slopes is not None or softcap > 0 or window_left >= 0
            or (window_right >= 0 and not causal) or interpreting()):
        return False
    batch, seqlen_q, heads, _ = q.shape
    if batch * heads * -(-seqlen_q // PREFILL_BLOCK) < PREFILL_MIN_TILES_PER_SM * _sm_count(q.device):
        return False
    from . import gluon_forward
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16:
        return False
    if block_table is not None and k_cache.shape[1] % min(gluon_forward.PAGED_BOX_ROWS):
        return prefill_gathers(q, k_cache, v_cache, block_table)
    return gluon_forward.plain_plan(q, k_cache, v_cache, causal, True,
                                    prefill_table(block_table, cache_batch_idx)) is not None


def prefill_gathers(q, k_cache, v_cache, block_table) -> bool:
    """Whether a chunked-prefill call on page pools whose pages no TMA box fits (16-bit, pages of
    no multiple of 16 keys, e.g. SGLang's 1) runs the prefill forward on a contiguous copy of its
    sequences (``forward.gathered_cache``, the table's whole capacity a sequence): from
    forward.GATHER_MIN_ROWS query rows a KV head (positions x GQA group; the copy's share of the time
    goes as their inverse), with K and V copies within forward.GATHER_BYTES."""
    from . import forward, gluon_forward
    if (block_table is None or k_cache.shape[1] % min(gluon_forward.PAGED_BOX_ROWS) == 0
            or not gluon_forward.paged_supported(q, k_cache, v_cache, block_table, any_page_size=True)):
        return False
    batch, seqlen_q, heads, _ = q.shape
    return (seqlen_q * (heads // k_cache.shape[2]) >= forward.GATHER_MIN_ROWS
            and forward.gather_fits(k_cache, batch * block_table.shape[1] * k_cache.shape[1]))


def prefill_table(block_table, cache_batch_idx):
    """The block table the prefill forward reads: the call's own, or with ``cache_batch_idx`` the
    cache seen as a pool of one page (row) per cache row, sequence b's table holding its row."""
    if cache_batch_idx is not None and block_table is None:
        return cache_batch_idx.view(-1, 1)
    return block_table


def planned_splits(batch: int, heads_k: int, capacity: int, device: torch.device,
                   paged: bool = False) -> int:
    """The split count the default plan gives a decode call of this shape (for reports)."""
    return split_heuristic(batch, heads_k, capacity, device,
                           decode_config(paged, device, batch * heads_k, capacity=capacity))


class PreparedDecode(NamedTuple):  # a NamedTuple: built on every decode_attention call, cheaply
    """What a decode call works out on the host from its signature (shapes, strides, dtypes, device,
    options): valid for every call with the same signature, so a caller that knows its calls repeat
    (a model's layers at each step) prepares once and runs many times."""
    splits: int
    upcast: bool
    kernel_options: dict | None  # None: the Gluon kernel runs (``gluon``)
    combine_options: dict | None
    scalars: tuple  # the decode kernel's scalar arguments
    out_shape: tuple
    lse_shape: tuple | None  # None: the LSE is not written
    grid: tuple
    dtype: torch.dtype
    device: torch.device
    gluon: tuple | None = None  # (variant, softmax_scale, causal) of the Gluon kernel, or None
    # (softmax_scale, causal, gather) of the Gluon prefill forward (gather: on prefill_gathers's
    # contiguous copy of the pools), or None
    prefill: tuple | None = None
    # stream-K (_attn_decode's STREAM): _combine_stream's scalars (its tensors are the call's),
    # else None; ``splits`` counts the programs then, partials (programs + B x Hk, Sq, H, D)
    stream: tuple | None = None
    # attention sinks that the plan's kernels do not take (the prefill forward unless
    # gluon_forward.SINKS_IN_EPILOGUE): run_decode applies them to the finished output and LSE
    sinks_after: bool = False


# A causal call with one query row runs as full attention (see prepare_decode); False: as causal, as
# until 2026-12-03 (for A/B runs)
ONE_ROW_AS_FULL = True


def prepare_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                   softmax_scale: float, window_left: int, window_right: int, softcap: float = 0.0,
                   alibi_slopes=None, block_table=None, cache_batch_idx=None, cache_leftpad=None,
                   num_splits: int = 0, config: DecodeConfig | None = None, k_descale=None,
                   need_lse: bool = True, in_graph: bool = False, q_descale=None,
                   seq_descales: bool = False, sinks: bool = False) -> PreparedDecode:
    """decode_attention's host work for one signature; see ``run_decode``. ``in_graph``: plan as
    for a call captured in a CUDA graph (as a call made while capturing is planned); ``sinks``: the
    call has attention sinks (the LSE is then always written)."""
    need_lse = need_lse or sinks
    batch, seqlen_q, heads, head_dim = q.shape
    if ONE_ROW_AS_FULL and seqlen_q == 1 and window_left < 0 and window_right == 0 \
            and alibi_slopes is None:
        # One query row, aligned with the last key, sees every key either way: plan and run it as
        # full attention, as flash-attn does (one kernel variant fewer to compile; the causal e4m3
        # Gluon variants' wgmmas had been serialized by ptxas where the full ones were not)
        window_right = -1
    heads_k = k_cache.shape[2]
    paged = block_table is not None
    if paged:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    device = q.device
    # Outside CUDA graphs every launch costs the host ~20 us (more than the GPU time of the whole
    # decode at this size): when one program per (sequence, KV head) reads so little, skip the split
    # and its merge.
    one_launch = (num_splits == 0 and device.type == "cuda"
                  and capacity * head_dim * k_cache.element_size() <= EAGER_ONE_LAUNCH_BYTES // 2
                  and not in_graph and not torch.cuda.is_current_stream_capturing())
    causal = window_right == 0 and window_left < 0
    if seqlen_q >= PREFILL_MIN_QUERIES and prefill_wanted(
            q, k_cache, v_cache, causal=causal, window_left=window_left, window_right=window_right,
            softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, num_splits=num_splits,
            config=config):
        from . import gluon_forward
        return PreparedDecode(1, False, None, None, (), (batch, seqlen_q, heads, head_dim),
                              (batch, heads, seqlen_q), (1,), q.dtype, device, None,
                              (softmax_scale, causal, prefill_gathers(q, k_cache, v_cache, block_table)),
                              sinks_after=sinks and not gluon_forward.SINKS_IN_EPILOGUE)
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    gluon_ok = (config is None and not interpreting() and device.type == "cuda"
                and gluon_wanted(paged, batch * heads_k, _sm_count(device), capacity, fp8_cache,
                                 heads // heads_k * seqlen_q)
                and gluon_supported(q, k_cache, v_cache, paged=paged,
                                    window=window_left >= 0 or window_right > 0, softcap=softcap > 0,
                                    alibi=alibi_slopes is not None, leftpad=cache_leftpad is not None,
                                    k_descale=k_descale, v_descale=k_descale))
    key = (batch, seqlen_q, heads, heads_k, head_dim, q.dtype, device, paged, capacity, num_splits,
           config, window_left >= 0, window_right >= 0, softcap > 0, alibi_slopes is not None,
           cache_batch_idx is not None, cache_leftpad is not None, k_cache.dtype == torch.float8_e4m3fn,
           one_launch, need_lse, k_cache.shape[1] if paged else 0, gluon_ok, causal,
           q_descale is not None, seq_descales, sinks)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(*key)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    splits, upcast, kernel_options, combine_options, gluon_variant = plan
    if gluon_variant is not None:
        return PreparedDecode(splits, False, None, combine_options, (), (batch, seqlen_q, heads, head_dim),
                              (batch, heads, seqlen_q) if need_lse or splits > 1 else None,
                              (splits, batch, heads_k), out_dtype(q.dtype), device,
                              (gluon_variant, softmax_scale, causal))
    # the blocks the kernel computes from its tile rows (fewer than MAX_TILE_ROWS past head dim
    # 128 on GPUs with 99 KB of shared memory)
    row_blocks = check_grid(batch, seqlen_q, heads, heads_k, kernel_options["ROWS"])
    if softcap > 0:
        qk_scale, softcap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        qk_scale, softcap_in = softmax_scale * LOG2E, 1.0
    write_lse = need_lse or splits > 1
    stream = kernel_options["STREAM"]
    # Strides of the contiguous tensors run_decode allocates: out (B, Sq, H, D), lse (B, H, Sq),
    # partials (splits, B, Sq, H, D) and (splits, B, H, Sq); stream-K's (slots, Sq, H, D) and
    # (slots, H, Sq), read with a batch stride of 0 (the slot says the pair).
    row = seqlen_q * heads * head_dim
    out_strides = (row, heads * head_dim, head_dim)
    lse_strides = (heads * seqlen_q, seqlen_q) if write_lse else (0, 0)
    if stream:
        part_strides = (row, 0, heads * head_dim, head_dim)
        lse_part_strides = (heads * seqlen_q, 0, seqlen_q)
    elif splits > 1:
        part_strides = (batch * row, row, heads * head_dim, head_dim)
        lse_part_strides = (batch * heads * seqlen_q, heads * seqlen_q, seqlen_q)
    else:
        part_strides, lse_part_strides = (0, 0, 0, 0), (0, 0, 0)
    scalars = (
        *(k_descale.stride() if k_descale is not None else (0, 0, 0)), *q.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *part_strides, *lse_part_strides, *out_strides,
        *lse_strides, block_table.stride(0) if paged else 0,
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        seqlen_q, capacity, heads // heads_k, max(window_left, 0), max(window_right, 0), qk_scale,
        softcap_in, k_cache.shape[1] if paged else 1, k_cache.shape[0] if paged else 1,
        block_table.shape[1] if paged else 0, batch, heads_k)
    if stream:
        merge_scalars = (batch, heads_k, seqlen_q, capacity, max(window_left, 0),
                         max(window_right, 0), heads // heads_k, splits)
        return PreparedDecode(splits, upcast, kernel_options, combine_options, scalars,
                              (batch, seqlen_q, heads, head_dim), (batch, heads, seqlen_q),
                              (splits, 1, 1), out_dtype(q.dtype), device, stream=merge_scalars)
    return PreparedDecode(splits, upcast, kernel_options, combine_options, scalars,
                          (batch, seqlen_q, heads, head_dim),
                          (batch, heads, seqlen_q) if write_lse else None,
                          (splits, batch, heads_k * row_blocks), out_dtype(q.dtype), device)


def descale_rows(q_descale: torch.Tensor) -> torch.Tensor:
    """q_descale (B, Hk) as the kernels read it: rows of Hk contiguous values (a broadcast or
    transposed view is copied; the kernels take no strides for it)."""
    batch, heads_k = q_descale.shape
    if (batch > 1 and q_descale.stride(0) != heads_k) or (heads_k > 1 and q_descale.stride(1) != 1):
        return q_descale.contiguous()
    return q_descale


def run_decode(p: PreparedDecode, q, k_cache, v_cache, cache_seqlens, cache_batch_idx=None,
               cache_leftpad=None, block_table=None, alibi_slopes=None, k_descale=None, v_descale=None,
               q_descale=None, sinks=None):
    """The launches of a prepared decode, for tensors with the signature it was prepared for
    (the caller's guarantee; ``sinks`` (H,) given exactly when it was prepared with them). Returns
    (out, lse or None)."""
    out, lse = _run_decode(p, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                           block_table, alibi_slopes, k_descale, v_descale, q_descale, sinks)
    if p.sinks_after:
        from .sinks import apply_sinks_
        apply_sinks_(out, lse, sinks)
    return out, lse


def _run_decode(p: PreparedDecode, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes, k_descale, v_descale, q_descale, sinks):
    if p.prefill is not None:
        from .gluon_forward import gluon_attention_forward, plain_forward
        softmax_scale, causal, gather = p.prefill
        if cache_seqlens.dtype != torch.int32:
            cache_seqlens = cache_seqlens.to(torch.int32)
        table = prefill_table(block_table, cache_batch_idx)
        if gather:
            from .forward import gathered_cache
            k_cache = gathered_cache(k_cache, block_table, cache_seqlens)
            v_cache = gathered_cache(v_cache, block_table, cache_seqlens)
            table = None
        inside = None if p.sinks_after else sinks  # (the sinks variant's epilogue)
        result = plain_forward(q, k_cache, v_cache, softmax_scale, causal, seqused_k=cache_seqlens,
                               block_table=table, sinks=inside)
        if result is None:  # inputs on another than the current device: the general path
            # (the sinks in its epilogue too, where SINKS_IN_EPILOGUE: the same variant's code; the
            # pass after it, apply_sinks_, only without: run_decode's sinks_after)
            result = gluon_attention_forward(q, k_cache, v_cache, softmax_scale=softmax_scale,
                                             causal=causal, seqused_k=cache_seqlens, block_table=table,
                                             sinks=inside)
        return result
    if q_descale is not None:
        q_descale = descale_rows(q_descale)
    if p.gluon is not None:
        from .gluon_decode import gluon_decode
        variant, softmax_scale, causal = p.gluon
        return gluon_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale,
                            causal=causal, splits=p.splits, block_table=block_table,
                            cache_batch_idx=cache_batch_idx, need_lse=p.lse_shape is not None,
                            variant=variant, k_descale=k_descale, v_descale=v_descale,
                            q_descale=q_descale, combine_options=p.combine_options, sinks=sinks)
    out = torch.empty(p.out_shape, dtype=torch.float32 if p.upcast else p.dtype, device=p.device)
    lse = None if p.lse_shape is None else torch.empty(p.lse_shape, dtype=torch.float32,
                                                        device=p.device)
    if out.numel() == 0:
        return out.to(p.dtype), lse
    if p.stream is not None:  # a slot per program and pair: program + pair (see _attn_decode)
        batch, seqlen_q, heads, head_dim = p.out_shape
        slots = p.splits + batch * p.stream[1]
        out_partial = torch.empty(slots, seqlen_q, heads, head_dim, dtype=torch.float32,
                                  device=p.device)
        lse_partial = torch.empty(slots, heads, seqlen_q, dtype=torch.float32, device=p.device)
    elif p.splits > 1:
        out_partial = torch.empty(p.splits, *p.out_shape, dtype=torch.float32, device=p.device)
        lse_partial = torch.empty(p.splits, *p.lse_shape, dtype=torch.float32, device=p.device)
    else:
        out_partial, lse_partial = out, lse  # unused: the kernel writes out directly
    tensors = (q, k_cache, v_cache, out_partial, lse_partial, out, out if lse is None else lse,
               cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, k_descale,
               v_descale, q_descale, sinks if p.kernel_options["SINKS"] else None)
    launch(_attn_decode, p.grid, tensors, p.scalars, p.kernel_options)
    if p.stream is not None:
        _launch_combine_stream(out_partial, lse_partial, out, lse, cache_seqlens, cache_leftpad,
                               p.stream, p.combine_options, sinks if p.combine_options["SINKS"] else None)
    elif p.splits > 1:
        _launch_combine(out_partial, lse_partial, out, lse, p.combine_options,
                        sinks if p.combine_options["SINKS"] else None)
    return (out.to(p.dtype) if p.upcast else out), lse


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, softmax_scale: float, window_left: int,
                     window_right: int, softcap: float = 0.0, alibi_slopes=None, block_table=None,
                     cache_batch_idx=None, cache_leftpad=None, num_splits: int = 0,
                     config: DecodeConfig | None = None, k_descale=None, v_descale=None,
                     need_lse: bool = True, q_descale=None, seq_descales: bool = False, sinks=None):
    """Attention of q (B, Sq, H, D) against the first cache_seqlens[b] keys of each cache row.

    k_cache/v_cache: (B_cache, S_max, Hk, D), or page pools (num_pages, page_size, Hk, D) with
    ``block_table`` (B, max_pages). Query i of sequence b sits at key position
    i + cache_seqlens[b] - Sq (bottom-right); with ``cache_leftpad`` sequence b's keys are slots
    [cache_leftpad[b], cache_seqlens[b]) of a contiguous cache. Returns out (B, Sq, H, D) and lse (B, H, Sq) (+inf for
    rows that see no key, as the forward).

    An e4m3 cache takes ``k_descale``/``v_descale`` float32, shaped like the cache without its head
    dim (one per key and KV head, any strides, one layout for both), or with ``seq_descales`` one
    per sequence and KV head (FlashAttention-3's (B, Hk), given as a (B, 1, Hk) view: indexed by the
    sequence, whatever the cache's rows are). With an e4m3 cache, q may be e4m3 too,
    with ``q_descale`` (B, Hk) float32 or None (1.0); the output is then bf16. With
    ``need_lse=False`` the LSE may be left unwritten and None is returned in its place. ``sinks``
    (H,): attention sinks (one more logit a row, with no value), the LSE counting them.
    """
    prepared = prepare_decode(q, k_cache, v_cache, softmax_scale=softmax_scale,
                              window_left=window_left, window_right=window_right, softcap=softcap,
                              alibi_slopes=alibi_slopes, block_table=block_table,
                              cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                              num_splits=num_splits, config=config, k_descale=k_descale,
                              need_lse=need_lse, q_descale=q_descale, seq_descales=seq_descales,
                              sinks=sinks is not None)
    return run_decode(prepared, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                      block_table, alibi_slopes, k_descale, v_descale, q_descale, sinks)


# Packed rows <-> a (B, Sq, H, D) block, for decode steps given as packed sequences
# (flash_attn_varlen_func on page pools): sequence b's queries take the block's last rows, so each
# keeps its bottom-right position. One launch each way where torch's indexing took about eight.
@triton.jit
def _move_packed_rows(Packed, Blocked, LsePacked, LseBlocked, CuSeqlens, total, heads, head_dim,
                      stride_pr, stride_ph, stride_pd, stride_bb, stride_bs, stride_bh, stride_bd,
                      stride_lph, stride_lpr, stride_lbb, stride_lbh, stride_lbs,
                      SEQLEN: tl.constexpr, TO_BLOCK: tl.constexpr, WITH_LSE: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // SEQLEN
    j = pid % SEQLEN
    start = tl.load(CuSeqlens + b)
    end = tl.load(CuSeqlens + b + 1)
    row = end - SEQLEN + j  # the packed row of (b, j)
    # Sequences of more than SEQLEN rows are not moved (a mixed batch's long chunks: the prefill
    # kernels own them). Offsets are checked on the host except under capture or compile: clamped
    # so none reads out of bounds then.
    valid = (row >= start) & (end - start <= SEQLEN) & (row >= 0) & (row < total)
    row = tl.minimum(tl.maximum(row, 0), total - 1).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    inside = (h[:, None] < heads) & (d[None, :] < head_dim)
    packed = Packed + row * stride_pr + h[:, None] * stride_ph + d[None, :] * stride_pd
    blocked = (Blocked + b.to(tl.int64) * stride_bb + j * stride_bs + h[:, None] * stride_bh
               + d[None, :] * stride_bd)
    if TO_BLOCK:  # rows before a sequence's queries are zeros (their outputs are dropped)
        tl.store(blocked, tl.load(packed, mask=inside & valid, other=0), mask=inside)
    else:
        tl.store(packed, tl.load(blocked, mask=inside & valid), mask=inside & valid)
        if WITH_LSE:
            live = (h < heads) & valid
            lse = tl.load(LseBlocked + b.to(tl.int64) * stride_lbb + h * stride_lbh + j * stride_lbs, mask=live)
            tl.store(LsePacked + h * stride_lph + row * stride_lpr, lse, mask=live)


@functools.lru_cache(maxsize=256)
def _move_options(seqlen: int, heads: int, head_dim: int, to_block: bool, with_lse: bool) -> dict:
    block_d = _next_power_of_2(head_dim)
    return dict(SEQLEN=seqlen, TO_BLOCK=to_block, WITH_LSE=with_lse, BLOCK_D=block_d,
                BLOCK_H=min(_next_power_of_2(heads), max(1, 2048 // block_d)), num_warps=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # moved as integers of the same width: the interpreter's numpy has no bfloat16 or e4m3
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _launch_move(packed, blocked, lse_packed, lse_blocked, cu_seqlens, options: dict) -> None:
    batch, seqlen, heads, head_dim = blocked.shape
    dummy = lse_packed is None
    lse_packed = cu_seqlens if dummy else lse_packed  # unread pointers without WITH_LSE
    lse_blocked = cu_seqlens if dummy else lse_blocked
    launch(_move_packed_rows, (batch * seqlen, triton.cdiv(heads, options["BLOCK_H"])),
           (_bits(packed), _bits(blocked), lse_packed, lse_blocked, cu_seqlens),
           (packed.shape[0], heads, head_dim, *packed.stride(), *blocked.stride(),
            *((0, 0, 0, 0, 0) if dummy else (*lse_packed.stride(), *lse_blocked.stride()))), options)


def block_packed_rows(packed: torch.Tensor, cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Packed rows (total, H, D) of B = len(cu_seqlens) - 1 sequences as a (B, seqlen, H, D) block
    with sequence b's rows last and zeros before them (all zeros for a sequence of more rows)."""
    total, heads, head_dim = packed.shape
    blocked = torch.empty(cu_seqlens.shape[0] - 1, seqlen, heads, head_dim, dtype=packed.dtype,
                          device=packed.device)
    if blocked.numel():
        _launch_move(packed, blocked, None, None, cu_seqlens,
                     _move_options(seqlen, heads, head_dim, True, False))
    return blocked


def unblock_rows(blocked: torch.Tensor, lse_blocked: torch.Tensor | None, cu_seqlens: torch.Tensor,
                 total: int, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """block_packed_rows' inverse for the outputs: blocked (B, Sq, H, D) and its LSE (B, H, Sq) (or
    None) back to packed rows (total, H, D) and (H, total), fresh or ``out``/``lse``. Rows no
    sequence of at most Sq rows owns are left as they were (unwritten in fresh tensors)."""
    batch, seqlen, heads, head_dim = blocked.shape
    if out is None:
        out = torch.empty(total, heads, head_dim, dtype=blocked.dtype, device=blocked.device)
    if lse is None and lse_blocked is not None:
        lse = torch.empty(heads, total, dtype=torch.float32, device=blocked.device)
    if blocked.numel() and total:
        _launch_move(out, blocked, lse, lse_blocked, cu_seqlens,
                     _move_options(seqlen, heads, head_dim, False, lse is not None))
    return out, lse

