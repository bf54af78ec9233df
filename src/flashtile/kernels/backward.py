"""Attention backward: recompute the scores from Q, K and the saved LSE, FlashAttention-2 style.

Three launches, none with atomics, so every gradient is bitwise reproducible:
1. preprocess: Delta = rowsum(dO * O) (minus dLSE when the LSE itself has a gradient);
2. dK/dV: one program per key block and KV head, looping over the query heads of its group (GQA
   gradients are summed in registers) and over the query blocks that can see the key block
   (FLASHTILE_GLUON_BWD=1 on sm_90: the Gluon kernel of gluon_backward, full or causal, d64/d128);
3. dQ: one program per query block and head, looping over the key blocks it sees (as the forward).
With deterministic=False on sm_90 (gluon_backward.FUSED_HEAD_DIMS; windows, softcap), steps 2 and 3
are one Gluon kernel instead that adds dQ by TMA reductions into a zeroed float32 buffer
(gluon_backward's ``fused_dq``), and a cast copies it into dQ; packed sequences (varlen) too, with
the preprocess writing the LSE and Delta rows that kernel reads (``ALIGNED``).
With P = exp(S - LSE) and dS = P * (dO V^T - Delta): dV = P^T dO, dK = scale * dS^T Q,
dQ = scale * dS K; a softcap multiplies dS by 1 - tanh^2, ALiBi adds nothing.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (dropout_keep, head_terms, key_blocks, load_tile, query_blocks,
                     sequence_descriptor, sequence_span, softcap_tanh, visible)
from . import forward as _forward
from .forward import (LOG2E, _arch, _descriptor_scratch, _tma_eligible, _triton_allocator,
                      head_dim_padded, interpreting)


@dataclass(frozen=True)
class BackwardConfig:
    dkdv_block_m: int  # query rows per step of the dK/dV loop
    dkdv_block_n: int  # keys owned by one dK/dV program
    dq_block_m: int  # query rows owned by one dQ program
    dq_block_n: int  # keys per step of the dQ loop
    num_warps: int
    num_stages: int
    dq_num_warps: int = 0  # 0: as the dK/dV kernel
    dq_num_stages: int = 0
    # With deterministic=False, add dQ atomically from the dK/dV pass instead of running the dQ
    # pass. Fewer FLOPs, but on the H200 at head dim 128 the atomics cost more than they save.
    atomic_dq: bool = True
    use_tma: bool = False  # the streamed tiles (Q, dO in dK/dV; K, V in dQ) through tensor descriptors


def backward_config_for_arch(head_dim: int, arch: int) -> BackwardConfig:
    """Tile configs measured on the H200 (benchmarks/results/tune-backward-*.json)."""
    d = head_dim_padded(head_dim)
    if 90 <= arch < 120:
        # Tensor descriptors: +10-13% fwd+bwd at head dim 128 (tune-backward-h200-*-c.json)
        if d <= 64:
            return BackwardConfig(64, 64, 64, 64, 4, 3, atomic_dq=False, use_tma=True)
        if d <= 128:
            return BackwardConfig(64, 64, 64, 64, 4, 2, atomic_dq=False, use_tma=True)
        return BackwardConfig(32, 32, 64, 32, 4, 2, atomic_dq=False, use_tma=True)
    if d <= 128:  # not measured: shapes after Triton's fused-attention tutorial
        return BackwardConfig(32, 64, 64, 32, 4, 2)
    return BackwardConfig(16, 64, 64, 16, 8, 1)


def pick_backward_config(head_dim: int, device: torch.device) -> BackwardConfig:
    if device.type != "cuda":
        return BackwardConfig(32, 32, 32, 32, 4, 1)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return backward_config_for_arch(head_dim, _arch(index))


@triton.jit
def _attn_bwd_preprocess(Out, dOut, dLse, Delta, CuSeqlensQ, Lse, AlignedLse, AlignedDelta,
                         stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                         stride_lb, stride_lh, stride_ah, seqlen_q,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Delta = rowsum(dO * O) (- dLSE). ``ALIGNED`` (packed sequences for the Gluon kernel): Delta
    and the LSE go to (H, width) rows of zeros instead, sequence b's from row ceil4(its first
    row) + 4 b (gluon_backward.packed_row_starts)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_span(CuSeqlensQ, batch, seqlen_q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    ok = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    o = tl.load(Out + batch.to(tl.int64) * stride_ob + head * stride_oh
                + rows * stride_os + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(dOut + batch.to(tl.int64) * stride_db + head * stride_dh
                 + rows * stride_ds + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = batch.to(tl.int64) * stride_lb + head * stride_lh + q_start + offs_m
    if HAS_DLSE:  # d lse_i / d s_ij = p_ij: folds into Delta
        delta -= tl.load(dLse + row, mask=offs_m < seqlen_q, other=0.0)
    if ALIGNED:
        aligned = head.to(tl.int64) * stride_ah + (q_start + 3) // 4 * 4 + 4 * batch + offs_m
        tl.store(AlignedDelta + aligned, delta, mask=offs_m < seqlen_q)
        tl.store(AlignedLse + aligned, tl.load(Lse + row, mask=offs_m < seqlen_q), mask=offs_m < seqlen_q)
    else:
        tl.store(Delta + row, delta, mask=offs_m < seqlen_q)


@triton.jit
def _scores_log2(qk, rows_pos, cols, seqlen_k, window_left, window_right, qk_scale, softcap_in,
                 alibi_slope, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Scores in log2 units as the forward saw them, and tanh's value (for the softcap gradient)."""
    if SOFTCAP:
        t = softcap_tanh(qk * softcap_in, SOFTCAP == 2)
        s = t * qk_scale
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        s -= alibi_slope * tl.abs(rows_pos - cols).to(tl.float32)
    if MASKED:
        keep = visible(rows_pos, cols, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
    return s, t


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs,
                         stride_ds, stride_dqs, offs_m, offs_d, cols, blk_lo, blk_hi, seqlen_q,
                         seqlen_k, diag_offset, window_left, window_right, qk_scale, softcap_in,
                         alibi_slope, softmax_scale, rng_seed, dropout_p,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
                         DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dK, dV (key block x head dim) over query blocks [blk_lo, blk_hi) of one head;
    with ATOMIC_DQ also add this key block's share of dQ into the float32 dQ buffer.

    Tiles are transposed (keys x queries) so P^T and dS^T come out ready for the two products.
    """
    D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    for blk in range(blk_lo, blk_hi):
        rows = blk * BLOCK_M + offs_m
        rows_ok = rows < seqlen_q
        tile_ok = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        if USE_TMA:  # q_base, do_base are descriptors: rows past the sequence come back as zeros
            q = load_tile(q_base, blk, tile_ok, MASKED, BLOCK_M, D_MASK, UPCAST, True)
            do = load_tile(do_base, blk, tile_ok, MASKED, BLOCK_M, D_MASK, UPCAST, True)
        else:
            q = load_tile(q_base + rows[:, None].to(tl.int64) * stride_qs + offs_d[None, :], blk,
                          tile_ok, MASKED, BLOCK_M, D_MASK, UPCAST, False)
            do = load_tile(do_base + rows[:, None].to(tl.int64) * stride_ds + offs_d[None, :], blk,
                           tile_ok, MASKED, BLOCK_M, D_MASK, UPCAST, False)
        if MASKED:  # rows past the end: LSE +inf makes their P exactly 0
            lse = tl.load(lse_base + rows, mask=rows_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(delta_base + rows, mask=rows_ok, other=0.0)
        else:
            lse = tl.load(lse_base + rows) * 1.4426950408889634
            delta = tl.load(delta_base + rows)
        qk_t = tl.dot(k, tl.trans(q))
        s_t, t_t = _scores_log2(qk_t, rows[None, :] + diag_offset, cols[:, None], seqlen_k,
                                window_left, window_right, qk_scale, softcap_in, alibi_slope,
                                MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI)
        p_t = tl.exp2(s_t - lse[None, :])
        dp_t = tl.dot(v, tl.trans(do))
        if DROPOUT:  # the forward's draw: dropped entries reach neither dV nor dP
            keep_t = dropout_keep(rng_seed, rows[None, :] * seqlen_k, cols[:, None], dropout_p)
            scale_keep = 1.0 / (1.0 - dropout_p)
            dv = tl.dot((tl.where(keep_t, p_t, 0.0) * scale_keep).to(do.dtype), do, dv)
            dp_t = tl.where(keep_t, dp_t, 0.0) * scale_keep
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        if ATOMIC_DQ:  # the order of the adds varies: dQ is not bitwise reproducible on this path
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * softmax_scale
            tl.atomic_add(dq_base + rows[:, None].to(tl.int64) * stride_dqs + offs_d[None, :], dq,
                          mask=tile_ok, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, dOut, Lse, Delta, dK, dV, dQ, Alibi, CuSeqlensQ, CuSeqlensK, DropoutSeed,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                   stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                   stride_dqb, stride_dqs, stride_dqh,
                   stride_lb, stride_lh, stride_ab,
                   seqlen_q, seqlen_k, group_size, diag_offset, window_left, window_right,
                   qk_scale, softcap_in, softmax_scale, dropout_p,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, UPCAST: tl.constexpr, VARLEN: tl.constexpr,
                   DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_span(CuSeqlensQ, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_span(CuSeqlensK, batch, seqlen_k, VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kv_ok = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    key_rows = (k_start + cols)[:, None].to(tl.int64)
    k = tl.load(K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
                + key_rows * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
                + key_rows * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    blk_lo, full_blk_lo, full_blk_hi, blk_hi = query_blocks(
        n0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT)

    for g in range(group_size):  # the query heads that share this KV head
        head = kv_head * group_size + g
        q_base = (Q + batch.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs
                  + head.to(tl.int64) * stride_qh)
        do_base = (dOut + batch.to(tl.int64) * stride_db + q_start.to(tl.int64) * stride_ds
                   + head.to(tl.int64) * stride_dh)
        lse_base = Lse + batch.to(tl.int64) * stride_lb + head * stride_lh + q_start
        delta_base = Delta + batch.to(tl.int64) * stride_lb + head * stride_lh + q_start
        dq_base = (dQ + batch.to(tl.int64) * stride_dqb + q_start.to(tl.int64) * stride_dqs
                   + head.to(tl.int64) * stride_dqh)
        if USE_TMA:
            q_base = sequence_descriptor(q_base, Q, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
            do_base = sequence_descriptor(do_base, dOut, seqlen_q, stride_ds, HEAD_DIM, BLOCK_M,
                                          HEAD_DIM_PAD)
        alibi_slope, rng_seed = head_terms(Alibi, stride_ab, DropoutSeed, batch, head,
                                           tl.num_programs(1) * group_size, ALIBI, DROPOUT)
        if HAS_RIGHT:  # rows at the causal diagonal / right window edge
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_ds,
                stride_dqs, offs_m, offs_d, cols, blk_lo, full_blk_lo, seqlen_q, seqlen_k,
                diag_offset, window_left, window_right, qk_scale, softcap_in, alibi_slope,
                softmax_scale, rng_seed, dropout_p, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, DROPOUT, ATOMIC_DQ, USE_TMA)
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_ds,
            stride_dqs, offs_m, offs_d, cols, full_blk_lo, full_blk_hi, seqlen_q, seqlen_k, diag_offset,
            window_left, window_right, qk_scale, softcap_in, alibi_slope, softmax_scale, rng_seed,
            dropout_p, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
            UPCAST, DROPOUT, ATOMIC_DQ, USE_TMA)
        # Left window edge, the ragged end of the queries, ragged key blocks.
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_ds,
            stride_dqs, offs_m, offs_d, cols, full_blk_hi, blk_hi, seqlen_q, seqlen_k, diag_offset,
            window_left, window_right, qk_scale, softcap_in, alibi_slope, softmax_scale, rng_seed,
            dropout_p, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
            UPCAST, DROPOUT, ATOMIC_DQ, USE_TMA)

    dk = dk * softmax_scale
    tl.store(dK + batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
             + key_rows * stride_dks + offs_d[None, :],
             dk.to(dK.dtype.element_ty), mask=kv_ok)
    tl.store(dV + batch.to(tl.int64) * stride_dvb + kv_head.to(tl.int64) * stride_dvh
             + key_rows * stride_dvs + offs_d[None, :],
             dv.to(dV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, rows_pos,
                       offs_n, offs_d, blk_lo, blk_hi, seqlen_k, window_left, window_right,
                       qk_scale, softcap_in, alibi_slope, rng_seed, rng_rows, dropout_p,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                       MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
                       DROPOUT: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dQ (query block x head dim) over key blocks [blk_lo, blk_hi)."""
    if not USE_TMA:
        start = blk_lo * BLOCK_N
        k_ptrs += start.to(tl.int64) * stride_ks
        v_ptrs += start.to(tl.int64) * stride_vs
    D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        kv_ok = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        k = load_tile(k_ptrs, blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, USE_TMA)
        v = load_tile(v_ptrs, blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, USE_TMA)
        qk = tl.dot(q, tl.trans(k))
        s, t = _scores_log2(qk, rows_pos[:, None], cols[None, :], seqlen_k, window_left,
                            window_right, qk_scale, softcap_in, alibi_slope, MASKED, HAS_LEFT,
                            HAS_RIGHT, SOFTCAP, ALIBI)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        if DROPOUT:
            keep = dropout_keep(rng_seed, rng_rows[:, None], cols[None, :], dropout_p)
            dp = tl.where(keep, dp, 0.0) * (1.0 / (1.0 - dropout_p))
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)
        if not USE_TMA:
            k_ptrs += BLOCK_N * stride_ks
            v_ptrs += BLOCK_N * stride_vs
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, dOut, Lse, Delta, dQ, Alibi, CuSeqlensQ, CuSeqlensK, DropoutSeed,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                 stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
                 seqlen_q, seqlen_k, group_size, diag_offset, window_left, window_right,
                 qk_scale, softcap_in, softmax_scale, dropout_p,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, LONGEST_FIRST: tl.constexpr, UPCAST: tl.constexpr,
                 VARLEN: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if LONGEST_FIRST:
        pid_m = tl.num_programs(0) - 1 - pid_m
    q_start, seqlen_q = sequence_span(CuSeqlensQ, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_span(CuSeqlensK, batch, seqlen_k, VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
    kv_head = head // group_size
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows_ok = offs_m < seqlen_q
    tile_ok = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)

    rows = (q_start + offs_m)[:, None].to(tl.int64)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                + rows * stride_qs + offs_d[None, :], mask=tile_ok, other=0.0)
    do = tl.load(dOut + batch.to(tl.int64) * stride_db + head.to(tl.int64) * stride_dh
                 + rows * stride_ds + offs_d[None, :], mask=tile_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = batch.to(tl.int64) * stride_lb + head * stride_lh + q_start + offs_m
    lse = tl.load(Lse + row, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + row, mask=rows_ok, other=0.0)
    alibi_slope, rng_seed = head_terms(Alibi, stride_ab, DropoutSeed, batch, head,
                                       tl.num_programs(1), ALIBI, DROPOUT)
    rng_rows = offs_m * seqlen_k

    k_base = (K + batch.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks
              + kv_head.to(tl.int64) * stride_kh)
    v_base = (V + batch.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs
              + kv_head.to(tl.int64) * stride_vh)
    if USE_TMA:
        k_ptrs = sequence_descriptor(k_base, K, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        v_ptrs = sequence_descriptor(v_base, V, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
    else:
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
    rows_pos = offs_m + diag_offset
    blk_lo, full_blk_lo, full_blk_hi, blk_hi = key_blocks(
        m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if HAS_LEFT:
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
            blk_lo, full_blk_lo, seqlen_k, window_left, window_right, qk_scale, softcap_in,
            alibi_slope, rng_seed, rng_rows, dropout_p, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, DROPOUT, USE_TMA)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
        full_blk_lo, full_blk_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in,
        alibi_slope, rng_seed, rng_rows, dropout_p, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False,
        HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, DROPOUT, USE_TMA)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
        full_blk_hi, blk_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in,
        alibi_slope, rng_seed, rng_rows, dropout_p, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True,
        HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, DROPOUT, USE_TMA)
    dq = dq * softmax_scale
    tl.store(dQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
             + rows * stride_dqs + offs_d[None, :],
             dq.to(dQ.dtype.element_ty), mask=tile_ok)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: float,
                       window_left: int, window_right: int, diag_offset: int, softcap: float = 0.0,
                       alibi_slopes: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
                       config: BackwardConfig | None = None,
                       cu_seqlens_q: torch.Tensor | None = None,
                       cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0, dropout_p: float = 0.0,
                       dropout_seed: torch.Tensor | None = None, deterministic: bool = True,
                       softcap_approx: bool = False):
    """Gradients (dq, dk, dv) of attention_forward's output (and LSE, if ``dlse``); same arguments
    and layouts as the forward, packed sequences included. Returns contiguous tensors in the inputs'
    dtypes.

    ``deterministic``: dQ from its own pass over the key blocks (bitwise reproducible); otherwise the
    dK/dV pass adds each key block's share of dQ atomically into a float32 buffer, which saves
    recomputing the scores and dP a second time (flash_attn's default). dK and dV are always
    deterministic.

    ``softcap_approx``: the forward took the softcap's tanh by tanh.approx (attention_forward's
    ``softcap_approx``), so P is recomputed with it too, by whichever kernel runs.
    """
    varlen = cu_seqlens_q is not None
    if dout.stride(-1) != 1:  # autograd can hand over expanded (stride 0) gradients
        dout = dout.contiguous()
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    if varlen:  # one packed "batch" of stride 0; cu_seqlens finds the sequences
        q, k, v, out, dout, lse = (t.unsqueeze(0) for t in (q, k, v, out, dout, lse))
        dlse = None if dlse is None else dlse.unsqueeze(0)
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    upcast = interpreting() and q.dtype == torch.bfloat16
    grad_dtype = torch.float32 if upcast else q.dtype
    if interpreting():  # NaN-poisoned, so a gradient element the kernels never write fails tests
        alloc = functools.partial(torch.full, fill_value=math.nan, dtype=grad_dtype, device=q.device)
    else:
        alloc = functools.partial(torch.empty, dtype=grad_dtype, device=q.device)
    cfg = config or pick_backward_config(q.shape[-1], q.device)
    atomic = not deterministic and cfg.atomic_dq
    dk, dv = alloc(k.shape), alloc(v.shape)
    if not atomic:
        dq = alloc(q.shape)
    else:  # the atomic adds accumulate into it: zeros, float32
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rows_q, rows_k = (max_seqlen_q, max_seqlen_k) if varlen else (seqlen_q, seqlen_k)
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or heads == 0 or rows_q == 0 or rows_k == 0:
        grads = (dq.zero_().to(grad_dtype), dk.zero_(), dv.zero_())
    else:
        _launch_backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, batch, rows_q, rows_k,
                         softmax_scale, window_left, window_right, diag_offset, softcap, alibi_slopes,
                         cfg, upcast, cu_seqlens_q, cu_seqlens_k,
                         dropout_p if dropout_seed is not None else 0.0, dropout_seed, atomic,
                         config is not None, deterministic, softcap_approx and softcap > 0)
        grads = (dq.to(grad_dtype), dk, dv)
    if varlen:
        grads = tuple(g[0] for g in grads)
    return tuple(g.to(q.dtype) for g in grads) if upcast else grads


def _launch_backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, batch, rows_q, rows_k,
                     softmax_scale, window_left, window_right, diag_offset, softcap, alibi_slopes,
                     cfg, upcast, cu_seqlens_q, cu_seqlens_k, dropout_p, dropout_seed, atomic,
                     config_given=False, deterministic=True, softcap_approx=False):
    _, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    varlen = cu_seqlens_q is not None
    d_pad = head_dim_padded(head_dim)
    if softcap > 0:
        qk_scale, softcap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        qk_scale, softcap_in = softmax_scale * LOG2E, 1.0
    alibi_stride_b = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    delta = torch.empty_like(lse)
    sq, sk, sv, sd, so, sl, sdq, sdk, sdv = (
        (0, *t.stride()[1:]) if varlen else t.stride() for t in (q, k, v, dout, out, lse, dq, dk, dv))
    use_tma = cfg.use_tma and _tma_eligible((q, k, v, dout), (sq, sk, sv, sd))
    flags = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, HAS_LEFT=window_left >= 0,
                 HAS_RIGHT=window_right >= 0, SOFTCAP=(2 if softcap_approx else True) if softcap > 0 else False,
                 ALIBI=alibi_slopes is not None, UPCAST=upcast, VARLEN=varlen, DROPOUT=dropout_p > 0, USE_TMA=use_tma)
    gluon = gluon_backward_mode(q, k, v, dout, flags, diag_offset, window_right, config_given,
                                deterministic, window_left, max_seqlen_k=rows_k if varlen else 0)
    # Our allocator only for these launches: the caller's own Triton allocator stays as it was.
    token = _triton_allocator.set(_descriptor_scratch) if use_tma and not interpreting() else None
    try:
        _launch_kernels(dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, batch, rows_q, rows_k,
                        heads, heads_k, cfg, atomic, flags, (sq, sk, sv, sd, so, sl, sdq, sdk, sdv),
                        (seqlen_q, seqlen_k, heads // heads_k, diag_offset, max(window_left, 0),
                         max(window_right, 0), qk_scale, softcap_in, softmax_scale, dropout_p),
                        alibi_slopes, alibi_stride_b, cu_seqlens_q, cu_seqlens_k, dropout_seed,
                        gluon, softcap, softcap_approx)
    finally:
        if token is not None:
            _triton_allocator.reset(token)


# The Gluon dK/dV kernel without dQ (kernels.gluon_backward) only when asked for with
# FLASHTILE_GLUON_BWD=1 (the deterministic calls' alternative): in fwd+bwd time 2-5% faster than the
# portable dK/dV kernel non-causal and d128 causal, 1-5% slower d64 causal
# (gluon-bwd-check-h200-20261130-g.json).
# Benchmarks set it directly.
GLUON_DKDV = os.environ.get("FLASHTILE_GLUON_BWD", "0") not in ("", "0")
# The Gluon kernel with dQ added by TMA reductions, for deterministic=False at the head dims of
# gluon_backward.FUSED_HEAD_DIMS (FLASHTILE_GLUON_FUSED_DQ=0 turns it off).
GLUON_FUSED_DQ = os.environ.get("FLASHTILE_GLUON_FUSED_DQ", "1") not in ("", "0")
# Packed sequences (flash_attn_varlen_func) through the same fused kernel (gluon_backward's varlen
# variants); FLASHTILE_GLUON_VARLEN_BWD=0 keeps them on the portable kernels.
GLUON_VARLEN = os.environ.get("FLASHTILE_GLUON_VARLEN_BWD", "1") not in ("", "0")
# The logit softcap (Gemma 2) through the fused kernel's softcap variants, 1.18-1.21x the portable
# backward in a training step on an H100 (softcap-train-h100-20261205);
# FLASHTILE_GLUON_SOFTCAP_BWD=0 keeps softcapped backwards on the portable kernels.
GLUON_SOFTCAP = os.environ.get("FLASHTILE_GLUON_SOFTCAP_BWD", "1") not in ("", "0")

# Packed sequences under the programs >= SMs rule still take the fused kernel from this share of the
# SMs when the longest sequence has this many keys; the portable kernels they would run otherwise (no
# dK/dV-only pass for packed calls) are slower there. Forced-fused / portable packed training steps on
# the H200 (varlen-threshold-h200-20261204-b/-c.json, varlen-host-h200-20261204-before.json; 12/2,
# 8/1 and 4/1 heads, d128): 1.04-1.28x at all 8 points with 104-128 programs and 3584-16384 keys,
# causal and full; 0.73-1.00x at 64-131 programs with 768-3200 keys, or 96 programs (4096 and 12288
# keys: 0.98x, 1.00x; 6144: 1.09x) and 64 (8192: 0.85x). d64 at 128 programs: 0.86x, 0.92x.
PACKED_FUSED_MIN_SM_SHARE = 0.78
PACKED_FUSED_MIN_KEYS = 3584


def gluon_backward_mode(q, k, v, dout, flags: dict, diag_offset: int, window_right: int,
                        config_given: bool, deterministic: bool = True, window_left: int = -1,
                        max_seqlen_k: int = 0) -> str | None:
    """Which Gluon kernel (kernels.gluon_backward, sm_90) replaces portable ones: "fused" (dK, dV
    and dQ in one kernel; deterministic=False, FUSED_HEAD_DIMS, GLUON_FUSED_DQ), "dkdv" (the dK/dV
    pass only, GLUON_DKDV) or None. Only for full or bottom-right causal attention, or a
    bottom-right sliding window ("fused" only, at gluon_backward.WINDOW_HEAD_DIMS, where the forward
    takes the window too: forward.GLUON_WINDOW_MIN_KEYS), with a softcap ("fused" only,
    GLUON_SOFTCAP), without ALiBi or dropout, on
    tensors it supports, unless a tile config was asked for or FLASHTILE_GLUON=0. Packed sequences
    (flags["VARLEN"]: q, k, v, dout as one packed batch entry, each sequence bottom-right on its own
    lengths) take "fused" only (GLUON_VARLEN), and under the programs rule where ``max_seqlen_k``
    and the programs reach PACKED_FUSED_MIN_KEYS and PACKED_FUSED_MIN_SM_SHARE at head dim 128
    without a window (measured so)."""
    fused = GLUON_FUSED_DQ and not deterministic
    if not ((GLUON_DKDV or fused) and _forward.GLUON_ENABLED) or config_given or interpreting() \
            or not q.is_cuda:
        return None
    if any(flags[name] for name in ("ALIBI", "DROPOUT", "UPCAST")):
        return None
    if flags["SOFTCAP"] and not (fused and GLUON_SOFTCAP):
        return None
    varlen = flags["VARLEN"]
    if varlen and not (fused and GLUON_VARLEN):
        return None
    if (flags["HAS_LEFT"] or flags["HAS_RIGHT"]) and not varlen and diag_offset != k.shape[1] - q.shape[1]:
        return None
    from . import gluon_backward
    from .gluon_forward import _sm_count
    left = window_left if flags["HAS_LEFT"] else -1
    right = window_right if flags["HAS_RIGHT"] else -1
    windowed = left >= 0 or right > 0
    if windowed and not (_forward.GLUON_WINDOW and q.shape[-1] in gluon_backward.WINDOW_HEAD_DIMS
                         and _forward.window_span(left, right)
                         >= _forward.GLUON_WINDOW_MIN_KEYS.get(q.shape[-1], math.inf)):
        return None
    if not gluon_backward.supported(q, k, v, dout):
        return None
    fused = fused and q.shape[-1] in gluon_backward.FUSED_HEAD_DIMS
    programs, sm_count = (gluon_backward.programs(q, k), _sm_count(q.device)) if fused else (0, 0)
    if fused and programs < sm_count and not (
            varlen and not windowed and q.shape[-1] == 128 and max_seqlen_k >= PACKED_FUSED_MIN_KEYS
            and programs >= PACKED_FUSED_MIN_SM_SHARE * sm_count):
        # Fewer programs than SMs (few KV heads, short keys): the longest causal program (the
        # whole group of query heads over every query block) sets the time, and the portable
        # kernels, which split dQ off into programs of their own, were faster (12/2 heads at 8k
        # causal: 2.33 vs 2.23 ms of kernels, train-profile-h200-20261130.json). (Packed: the
        # programs that have keys, about total keys / 128 per KV head.)
        fused = False
    if fused:
        return "fused"
    return "dkdv" if GLUON_DKDV and not windowed and not varlen and not flags["SOFTCAP"] else None


def backward_kernel_name(q, k, v, *, causal: bool, deterministic: bool = False) -> str:
    """Which backward kernels a plain flash_attn_func call's backward runs: "gluon-dq" (one Gluon
    kernel, dQ by TMA reductions), "gluon-dkdv" (the Gluon dK/dV kernel and the portable dQ pass)
    or "triton" (the portable kernels)."""
    flags = dict(HAS_LEFT=False, HAS_RIGHT=causal, SOFTCAP=False, ALIBI=False, DROPOUT=False,
                 VARLEN=False, UPCAST=interpreting() and q.dtype == torch.bfloat16)
    mode = gluon_backward_mode(q, k, v, q, flags, k.shape[1] - q.shape[1], 0 if causal else -1,
                               False, deterministic)
    return {"fused": "gluon-dq", "dkdv": "gluon-dkdv"}.get(mode, "triton")


def _launch_kernels(dout, q, k, v, out, lse, dlse, dq, dk, dv, delta, batch, rows_q, rows_k, heads,
                    heads_k, cfg, atomic, flags, strides, common, alibi_slopes, alibi_stride_b,
                    cu_seqlens_q, cu_seqlens_k, dropout_seed, gluon_dkdv=None, softcap: float = 0.0,
                    softcap_approx: bool = False):
    """The backward's three launches; ``common`` is the scalar arguments every kernel shares
    (``softcap`` itself for the Gluon kernel, which derives the same scalars from it, and
    ``softcap_approx``: its tanh by tanh.approx)."""
    sq, sk, sv, sd, so, sl, sdq, sdk, sdv = strides
    seqlen_q, head_dim, d_pad = common[0], flags["HEAD_DIM"], flags["HEAD_DIM_PAD"]
    varlen = flags["VARLEN"]
    pre_block = 64
    aligned_rows = None
    if gluon_dkdv and varlen:  # the Gluon kernel's LSE and Delta rows: see packed_row_starts
        from .gluon_backward import packed_row_width
        width = packed_row_width(q.shape[1], batch)
        aligned_rows = torch.zeros(2, 1, heads, width, dtype=torch.float32, device=q.device)
    _attn_bwd_preprocess[(-(-rows_q // pre_block), heads, batch)](
        out, dout, dlse, delta, cu_seqlens_q, lse,
        *((aligned_rows[0], aligned_rows[1]) if aligned_rows is not None else (None, None)),
        so[0], so[1], so[2], sd[0], sd[1], sd[2], sl[0], sl[1],
        aligned_rows.stride(2) if aligned_rows is not None else 0, seqlen_q, BLOCK_M=pre_block,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, HAS_DLSE=dlse is not None, VARLEN=varlen,
        ALIGNED=aligned_rows is not None)
    if gluon_dkdv:
        from .gluon_backward import gluon_dkdv as run_gluon_dkdv
        fused = gluon_dkdv == "fused"
        if aligned_rows is not None:
            lse, delta = aligned_rows[0], aligned_rows[1]
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused else None
        # (common: ..., diag_offset, window_left, window_right clamped at 0, ...)
        window = (common[4] if flags["HAS_LEFT"] else -1, common[5] if flags["HAS_RIGHT"] else -1)
        packed = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=rows_k) if varlen else {}
        run_gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, softmax_scale=common[8],
                       causal=window[1] == 0, dq_accum=dq_accum, window_size=window, softcap=softcap,
                       softcap_approx=softcap_approx, **packed)
        if fused:
            dq.copy_(dq_accum)
            return
        atomic = False  # dQ from its own pass
    else:
        _launch_dkdv(dout, q, k, v, lse, delta, dk, dv, dq, batch, rows_k, heads_k, cfg, atomic, flags,
                     strides, common, alibi_slopes, alibi_stride_b, cu_seqlens_q, cu_seqlens_k,
                     dropout_seed)
    if atomic:
        return
    _attn_bwd_dq[(-(-rows_q // cfg.dq_block_m), heads, batch)](
        q, k, v, dout, lse, delta, dq, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sd[0], sd[1], sd[2],
        *sdq[:3], sl[0], sl[1], alibi_stride_b, *common,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, LONGEST_FIRST=flags["HAS_RIGHT"],
        num_warps=cfg.dq_num_warps or cfg.num_warps, num_stages=cfg.dq_num_stages or cfg.num_stages,
        **flags)


def _launch_dkdv(dout, q, k, v, lse, delta, dk, dv, dq, batch, rows_k, heads_k, cfg, atomic, flags,
                 strides, common, alibi_slopes, alibi_stride_b, cu_seqlens_q, cu_seqlens_k,
                 dropout_seed):
    sq, sk, sv, sd, so, sl, sdq, sdk, sdv = strides
    _attn_bwd_dkdv[(-(-rows_k // cfg.dkdv_block_n), heads_k, batch)](
        q, k, v, dout, lse, delta, dk, dv, dq, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
        dropout_seed, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sd[0], sd[1],
        sd[2], *sdk[:3], *sdv[:3], *sdq[:3], sl[0], sl[1], alibi_stride_b, *common,
        BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, ATOMIC_DQ=atomic,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
