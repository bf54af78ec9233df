"""Hopper (sm_90) dK/dV kernel of the backward in Gluon, FlashAttention-3's layout.

One CTA owns 2 x 64 keys of one (batch, KV head): each of two consumer warpgroups keeps its 64 K and
V rows in shared memory and its dK, dV accumulators (64 x head dim, fp32) in registers. A 1-warp
producer streams the (Q, dO) tiles of every query head of the group and every query block that sees
the keys through a ring of shared-memory slots by TMA; both consumers read each slot, then free it.
Per query tile, in each consumer:

    S^T  = K Q^T        (wgmma, both operands in shared memory)
    dP^T = V dO^T       (wgmma, in flight with the first)
    P^T  = exp2(S^T * scale * log2(e) - LSE * log2(e))      (causal mask on the diagonal tiles)
    dS^T = P^T * (dP^T - Delta)
    dV  += P^T dO,  dK += dS^T Q     (wgmma with P^T / dS^T as register A operands)

With flash_attn's logit softcap (``softcap`` variants) S^T becomes t = tanh(S^T * scale / softcap) as the
forward took it (exp2's formula, or tanh.approx: ``softcap_approx``), P^T = exp2(t * softcap * log2(e) - LSE
* log2(e)), and dS^T takes a factor 1 - t^2 (the chain rule through the cap; dK, dQ keep their scale).

dQ either stays with the portable kernel's separate pass (no atomics: the backward stays
deterministic), or (``fused_dq``, FlashAttention-3's way) comes from the same tile: each consumer
stores dS^T (bf16) to shared memory, the two meet at an mbarrier, and consumer w computes
dQ[:, 64w:64w+64] = dS K[:, 64w:64w+64] over both consumers' 128 keys (head dim 128; at head dim
64 consumer w computes the whole dQ of every other tile) with two wgmmas with operands in shared
memory, scales it and adds it to a float32 dQ buffer by TMA bulk reductions
(``cp.reduce.async.bulk.tensor``): 5 matmuls a tile pair instead of 7.
Rows past the query sequence come in as zeros (TMA: Q, dO, LSE and Delta alike), so their S, dP and
dS are zero and they add nothing to dK and dV; keys past the key sequence give rows of dK/dV that
the TMA store clips. The causal diagonal is bottom-right, as
in the forward.

Packed sequences (flash_attn_varlen_func, ``varlen`` variants): the grid's last axis is the sequence;
each CTA reads its sequence's offsets, and its tiles that reach past the sequence's queries or keys
(the next sequence's rows, not zeros) take a mask; a key block reaching past the keys stores dK/dV by
masked stores; the LSE and Delta rows come from copies in which every sequence starts at a 4-row
boundary (packed_row_starts).

This module imports on machines without a GPU; ``compile_for_sm90`` builds the cubin there.
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses
from dataclasses import dataclass

import torch

from .forward import _arch
from .gluon_forward import (_GLUON, _Descriptor, _smem_layout, _tma_ok, qkv_shapes_ok, score_scalars,
                            window_arguments)
from .launch import launch

if _GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
FUSED_HEAD_DIMS = (64, 128)  # where the backward dispatches the fused_dq kernel


@dataclass(frozen=True)
class GluonBackwardVariant:
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    block_m: int = 64  # query rows per streamed tile
    stages: int = 2  # (Q, dO) slots in the ring
    consumer_regs: int = 240
    producer_regs: int = 24
    overlap: bool = False  # a tile's dV/dK wgmmas run on under the next tile's S and dP issue
    max_stack: int = 0  # stack bytes (register spills) the compile check accepts
    fused_dq: bool = False  # dQ added from this kernel by TMA reductions (block_m 64)
    # Sliding window (flash_attn's window_size): each key block runs only the query blocks whose
    # window reaches it, masked where some row's window does not cover all of its keys.
    window: bool = False
    # Packed sequences (flash_attn_varlen_func): q, dO (1, total_q, H, D), k, v (1, total_k, Hk, D),
    # sequence b's rows from cu_seqlens_q[b] / cu_seqlens_k[b]; grid (key blocks of the longest, Hk, B).
    varlen: bool = False
    # flash_attn's logit softcap (Gemma 2): P from softcap * tanh(scale s / softcap), dS times 1 - tanh^2
    softcap: bool = False
    softcap_approx: bool = False  # that tanh by tanh.approx.f32, as the forward took it (else exp2's formula)

    def __post_init__(self):
        if self.fused_dq and (self.head_dim not in (64, 128) or self.block_m != 64 or self.overlap):
            raise ValueError("fused_dq: head dim 64 or 128, block_m 64 and no overlap only (a "
                             "consumer computes 64 of dQ's columns with a 64-row wgmma)")

    @property
    def block_n(self) -> int:
        return 128  # 2 consumer warpgroups x 64 keys

    @property
    def name(self) -> str:
        return (f"gluon-bwd-d{self.head_dim}-{self.dtype}-{'causal' if self.causal else 'full'}"
                f"-m{self.block_m}-s{self.stages}{'-overlap' if self.overlap else ''}"
                f"{'-dq' if self.fused_dq else ''}{'-win' if self.window else ''}"
                f"{'-varlen' if self.varlen else ''}{'-softcap' if self.softcap else ''}"
                f"{'-approx' if self.softcap_approx else ''}")


@functools.lru_cache(maxsize=None)
def default_variant(head_dim: int, dtype: str, causal: bool,
                    fused_dq: bool = False) -> GluonBackwardVariant:
    # d128: dK, dV (64 registers each), S and dP (32 each) per thread, at 240 registers: with LSE
    # and Delta loaded from global memory into registers (16 each) ptxas spilled 48-104 stack bytes
    # (112-192 with dQ); read from the ring's shared memory when needed, 0-24. 32-row tiles ran
    # 6-10% slower (gluon-bwd-check-h200-20261130-a.json).
    if fused_dq:
        return GluonBackwardVariant(head_dim, dtype, causal, stages=2 if head_dim > 64 else 3,
                                    max_stack=32, fused_dq=True)
    if head_dim <= 64:
        return GluonBackwardVariant(head_dim, dtype, causal, stages=3)
    return GluonBackwardVariant(head_dim, dtype, causal, stages=2, max_stack=32)


# Benchmarks may set a variant here for the calls that name none (attention_backward's).
_VARIANT_OVERRIDE: GluonBackwardVariant | None = None

GLUON_BACKWARD_VARIANTS = [default_variant(d, dt, c) for d in HEAD_DIMS for dt in ("bf16", "fp16")
                           for c in (False, True)]
GLUON_BACKWARD_VARIANTS += [default_variant(d, dt, c, True) for d in HEAD_DIMS
                            for dt in ("bf16", "fp16") for c in (False, True)]
# Sliding windows: the fused (dQ by TMA reductions) kernel at the head dims WINDOW_HEAD_DIMS lists
WINDOW_HEAD_DIMS = (128,)
GLUON_BACKWARD_VARIANTS += [dataclasses.replace(default_variant(d, dt, c, True), window=True)
                            for d in WINDOW_HEAD_DIMS for dt in ("bf16", "fp16") for c in (False, True)]
# Packed sequences (flash_attn_varlen_func's backward): the fused kernel, with and without a window
GLUON_BACKWARD_VARIANTS += [dataclasses.replace(default_variant(d, dt, c, True), varlen=True)
                            for d in FUSED_HEAD_DIMS for dt in ("bf16", "fp16") for c in (False, True)]
GLUON_BACKWARD_VARIANTS += [dataclasses.replace(default_variant(d, dt, c, True), window=True, varlen=True)
                            for d in WINDOW_HEAD_DIMS for dt in ("bf16", "fp16") for c in (False, True)]


def with_softcap(variant: GluonBackwardVariant, approx: bool = False) -> GluonBackwardVariant:
    """``variant`` with the logit softcap, its tanh by tanh.approx with ``approx`` (windowed: 64 stack bytes)."""
    return dataclasses.replace(variant, softcap=True, softcap_approx=approx,
                               max_stack=max(variant.max_stack, 64 if variant.window else 32))


# The logit softcap (Gemma 2) on every fused variant: plain, windowed, packed; by the formula, then tanh.approx
GLUON_BACKWARD_VARIANTS += [with_softcap(v, a) for a in (False, True) for v in GLUON_BACKWARD_VARIANTS if v.fused_dq]


if _GLUON:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into the tensor at ``coord`` with one TMA bulk
        reduction (in the bulk async group that ``tma.store_wait`` waits for). Gluon 3.6 has no
        wrapper for the op that Triton's own ``desc.atomic_add`` lowers to; this is that op."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                                  coord, src.handle)

    @gluon.constexpr_function
    def _ds_layout(block_m):
        # dS^T tiles (64 keys x block_m queries, 16-bit): the layout TMA would give them.
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * block_m), element_bitwidth=16, rank=2)

    @gluon.constexpr_function
    def _acc_layout(instr_n):
        # Accumulator of an M = 64 wgmma over one warpgroup (4 warps), instruction n = instr_n.
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, instr_n, 16])

    @gluon.jit
    def _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, window_left=0, window_right=0, WINDOW: gl.constexpr = False):
        """Query blocks that see keys [n0, n0 + BLOCK_N): (m_lo, m_full, m_full_end, m_end): blocks
        [m_lo, m_end), of which every row of those in [m_full, m_full_end) sees every one of the keys;
        the others take the mask (causal: the diagonal; WINDOW: row at key position p sees keys
        [p - window_left, p + window_right], a side without a bound passed as a number past any
        sequence)."""
        num_m = (seqlen_q + BLOCK_M - 1) // BLOCK_M
        if WINDOW:
            diag = seqlen_k - seqlen_q
            m_lo = gl.minimum(gl.maximum(n0 - window_right - diag, 0) // BLOCK_M, num_m)
            m_end = gl.minimum(gl.maximum(n0 + BLOCK_N - 1 + window_left - diag + 1, 0), seqlen_q)
            m_end = gl.maximum((m_end + BLOCK_M - 1) // BLOCK_M, m_lo)
            m_full = gl.minimum((gl.maximum(n0 + BLOCK_N - 1 - window_right - diag, 0) + BLOCK_M - 1)
                                // BLOCK_M, m_end)
            m_full_end = gl.maximum(gl.minimum(gl.maximum(n0 + window_left - diag + 1, 0) // BLOCK_M,
                                               m_end), m_full)
            return m_lo, m_full, m_full_end, m_end
        if CAUSAL:
            diag = seqlen_k - seqlen_q
            m_lo = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, num_m)
            m_full = gl.minimum((gl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M, num_m)
        else:
            m_lo = num_m * 0
            m_full = m_lo
        return m_lo, m_full, num_m, num_m

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                      ready, empty, batch, kv_head, group_size, m_lo, num_m, q_start, row_start,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The 1-warp load partition: (Q, dO, LSE, Delta) of query block m of query head g, for g over
        the group and m over [m_lo, num_m), in the consumers' order, at most STAGES tiles ahead of
        them. Rows past the sequence land as zeros: with Q and dO zero there, S, dP, dS and their
        shares of dV and dK are zero too whatever P is. Packed sequences: ``batch`` is the
        descriptors' batch coordinate (0), the rows start at ``q_start`` and the LSE/Delta rows at
        ``row_start`` (packed_row_starts: TMA takes innermost coordinates at 16-byte multiples only);
        rows past the sequence are the next one's (or zeros), which the consumers mask."""
        n_m = num_m - m_lo
        for it in range(group_size * n_m):
            head = kv_head * group_size + it // n_m
            row0 = q_start + (m_lo + it % n_m) * BLOCK_M
            slot = it % STAGES
            # Empty barriers start in phase 0: parity 1 passes at once on the first lap.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch, row0, head, 0], ready.index(slot),
                                            q_bufs.index(slot))
            tma.async_copy_global_to_shared(do_desc, [batch, row0, head, 0], ready.index(slot),
                                            do_bufs.index(slot))
            rows0 = row0 - q_start + row_start  # (packed: rows of a 4-row aligned copy)
            tma.async_copy_global_to_shared(lse_desc, [batch, head, rows0], ready.index(slot),
                                            lse_bufs.index(slot))
            tma.async_copy_global_to_shared(delta_desc, [batch, head, rows0], ready.index(slot),
                                            delta_bufs.index(slot))

    @gluon.jit
    def _dq_tile(dv, dk, p_op, ds_op, do_t, q_t, ds_smem, ds_first, k_all, dq_smem, dq_desc, dq_at,
                 col0, empty_slot, softmax_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Columns [col0, col0 + 64) of a tile's dQ = dS K over both consumers' keys (dS^T halves in
        ``ds_smem`` slots ds_first and ds_first + 1), added into dQ by TMA reductions staged in
        ``dq_smem``; waits for the tile's dV and dK wgmmas too and frees its ring slot."""
        KEYS: gl.constexpr = 64
        dq_layout: gl.constexpr = _acc_layout(64)
        dq = warpgroup_mma(ds_smem.index(ds_first).permute((1, 0)),
                           k_all.index(0).reshape([KEYS, HEAD_DIM]).slice(col0, 64, dim=1),
                           gl.zeros([BLOCK_M, 64], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds_smem.index(ds_first + 1).permute((1, 0)),
                           k_all.index(1).reshape([KEYS, HEAD_DIM]).slice(col0, 64, dim=1),
                           dq, is_async=True)
        dv_done, dk_done, dq_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
            0, deps=(dv, dk, dq, p_op, ds_op, do_t, q_t))
        mbarrier.arrive(empty_slot)
        dq_tile = dq_smem.reshape([BLOCK_M, 64])
        tma.store_wait(0)  # the tile before's reduction has read the slot
        dq_tile.store(dq_done * softmax_scale)
        fence_async_shared()
        # The reduction takes at most 128 bytes of a row per op (the swizzle's span): two ops,
        # each over one 32-column half of the slot (TMA's column chunks).
        batch, row0, head = dq_at
        for half in gl.static_range(2):
            _tma_reduce_add(dq_desc, [batch, row0, head, col0 + half * 32],
                            dq_smem.slice(half * 32, 32, dim=3))
        return dv_done, dk_done, p_op, ds_op

    @gluon.jit
    def _bwd_consumer(k_smem, v_smem, kv_bar, dq_smem, shared, BLOCK_M: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                      OVERLAP: gl.constexpr, FUSED_DQ: gl.constexpr, WINDOW: gl.constexpr = False,
                      VARLEN: gl.constexpr = False, SOFTCAP: gl.constexpr = False):
        """Keys [n0 + 64 WG, n0 + 64 WG + 64): load K and V once, accumulate dK and dV over every
        streamed tile, write them (dK times the softmax scale) through K's and V's slots.

        ``OVERLAP``: tile i's dV and dK wgmmas stay in flight while the consumer waits for tile
        i + 1 and issues its S and dP; the wait for S_{i+1} retires them (wgmma groups complete in
        order), and only then is tile i's ring slot freed. Otherwise every tile waits for its own.

        ``FUSED_DQ``: dS^T goes to ``ds_smem`` (two slots, one per tile parity: the other consumer may
        still read the previous tile's); after ``ds_bar`` says both halves are there, this consumer
        computes columns [64 WG, 64 WG + 64) of the tile's dQ over both consumers' keys and adds them
        to dQ by a TMA reduction staged in its own ``dq_smem`` slot. ``ds_bar`` completes once per
        tile, only after each consumer's dQ wgmmas of the tile before have retired, so neither runs
        more than one tile ahead of the other; a last round before the epilogue keeps either from
        overwriting its K slot while the other's final dQ wgmma reads it.

        ``VARLEN``: ``batch`` is the descriptors' batch coordinate (0), the sequence's rows start at
        ``q_start`` and ``k_start``. Tiles reaching past its queries or keys read the next
        sequence's rows, so they take a mask too (P and dS zero there: the dQ a reduction adds to
        the next sequence's rows is zero), and a key block reaching past the keys writes dK and dV
        by masked stores (``DK``, ``DV``) instead of TMA's whole box."""
        (k_desc, v_desc, dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty,
         seqlen_q, seqlen_k, group_size, batch, kv_head, n0, qk_scale, softmax_scale,
         dq_desc, ds_smem, ds_bar, k_all, window_left, window_right, q_start, k_start, DK, DV,
         softcap_in) = shared
        KEYS: gl.constexpr = 64
        dtype: gl.constexpr = k_desc.dtype
        key0 = n0 + WG * KEYS
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, k_start + key0, kv_head, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [batch, k_start + key0, kv_head, 0], kv_bar, v_smem)

        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        d_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
        keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        qcols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        dk = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, d_layout))
        dv = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, d_layout))
        p_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        ds_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        diag = seqlen_k - seqlen_q
        m_lo, m_full, m_full_end, num_m = _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M, 2 * KEYS, CAUSAL,
                                                        window_left, window_right, WINDOW)
        if VARLEN:  # a key block past the sequence's keys: no query tiles (as the producer)
            num_m = gl.where(n0 < seqlen_k, num_m, m_lo)
        n_m = num_m - m_lo
        total = group_size * n_m
        mbarrier.wait(kv_bar, 0)
        k_tile = k_smem.reshape([KEYS, HEAD_DIM])
        v_tile = v_smem.reshape([KEYS, HEAD_DIM])
        # One loop over (query head of the group, query block), the causal mask a runtime branch
        # (blocks before m_full): with a second copy of the loop for the masked blocks, as the
        # forward has, ptxas spilled.
        for it in range(total):
            head = kv_head * group_size + it // n_m
            m = m_lo + it % n_m
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            q_t = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do_t = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            # Zeros made here, not hoisted out of the loop: they become S's and dP's registers
            # instead of holding 32 more per thread through the whole loop.
            s_tok = warpgroup_mma(k_tile, q_t.permute((1, 0)), gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v_tile, do_t.permute((1, 0)),
                                   gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
            s, dk_done, dv_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
                1, deps=(s_tok, dk, dv, p_op, ds_op, k_tile, q_t))
            if OVERLAP:  # the tile before is read no more
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > 0)
            if SOFTCAP:  # s becomes t = tanh(scale s / softcap), by the forward's formula; dP
                # first, so that t lives only through dS's elementwise chain (held across the wait
                # it spilled)
                dp, _, _ = warpgroup_mma_wait(0, deps=(dp_tok, v_tile, do_t))
                s = _softcap_tanh(s, softcap_in, SOFTCAP)
            if VARLEN:  # the sequence's own bounds, then its mask as below
                masked = (m * BLOCK_M + BLOCK_M > seqlen_q) | (key0 + KEYS > seqlen_k)
                if WINDOW:
                    masked = masked | (m < m_full) | (m >= m_full_end)
                elif CAUSAL:
                    masked = masked | (m < m_full)
                if masked:
                    keep = gl.expand_dims(keys < seqlen_k, 1) & gl.expand_dims(m * BLOCK_M + qcols < seqlen_q, 0)
                    if WINDOW:
                        rel = gl.expand_dims(keys - diag - m * BLOCK_M, 1) - gl.expand_dims(qcols, 0)
                        keep = keep & (rel <= window_right) & (rel >= -window_left)
                    elif CAUSAL:
                        keep = keep & (gl.expand_dims(keys - diag - m * BLOCK_M, 1) <= gl.expand_dims(qcols, 0))
                    s = gl.where(keep, s, float("-inf"))
            elif WINDOW:
                if (m < m_full) | (m >= m_full_end):  # key j seen by query i at p = i + Sk - Sq
                    rel = gl.expand_dims(keys - diag - m * BLOCK_M, 1) - gl.expand_dims(qcols, 0)  # j - p
                    keep = (rel <= window_right) & (rel >= -window_left)
                    s = gl.where(keep, s, float("-inf"))
            elif CAUSAL:
                if m < m_full:  # bottom-right causal: key j is seen by query i when j <= i + Sk - Sq
                    keep = gl.expand_dims(keys - diag - m * BLOCK_M, 1) <= gl.expand_dims(qcols, 0)
                    s = gl.where(keep, s, float("-inf"))
            # LSE and Delta from shared memory when needed: in registers through the loop they
            # spilled (16 values each per thread).
            lse = lse_bufs.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse * 1.4426950408889634, 0))
            if not SOFTCAP:
                dp, _, _ = warpgroup_mma_wait(0, deps=(dp_tok, v_tile, do_t))
            delta = delta_bufs.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
            ds = p * (dp - gl.expand_dims(delta, 0))
            if SOFTCAP:  # times 1 - t^2 (masked: t = -inf, p = 0; the max keeps 0 * inf out)
                ds = ds * gl.maximum(1.0 - s * s, 0.0)
            p_op = gl.convert_layout(p.to(dtype), a_layout)
            ds_lo = ds.to(dtype)
            ds_op = gl.convert_layout(ds_lo, a_layout)
            dv = warpgroup_mma(p_op, do_t, dv_done, is_async=True)
            dk = warpgroup_mma(ds_op, q_t, dk_done, is_async=True)
            if FUSED_DQ:
                ds_first = (it % 2) * 2  # slots 2 (it % 2) + consumer
                ds_smem.index(ds_first + WG).store(ds_lo)
                fence_async_shared()
                mbarrier.arrive(ds_bar)
                mbarrier.wait(ds_bar, it & 1)
                dq_at = (batch, q_start + m * BLOCK_M, head)
                if HEAD_DIM == 128:  # consumer w: columns [64 w, 64 w + 64) of every tile
                    dv_done, dk_done, p_op, ds_op = _dq_tile(
                        dv, dk, p_op, ds_op, do_t, q_t, ds_smem, ds_first, k_all, dq_smem, dq_desc,
                        dq_at, WG * 64, empty.index(slot), softmax_scale, BLOCK_M, HEAD_DIM)
                elif it % 2 == WG:  # head dim 64: the whole of every other tile's dQ
                    dv_done, dk_done, p_op, ds_op = _dq_tile(
                        dv, dk, p_op, ds_op, do_t, q_t, ds_smem, ds_first, k_all, dq_smem, dq_desc,
                        dq_at, 0, empty.index(slot), softmax_scale, BLOCK_M, HEAD_DIM)
                else:  # the tile's own wait, as without FUSED_DQ (a merged branch compiled the
                    # dQ code for the stand-in buffers of non-fused variants)
                    dv_done, dk_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
                        0, deps=(dv, dk, p_op, ds_op, do_t, q_t))
                    mbarrier.arrive(empty.index(slot))
                dv = warpgroup_mma_init(dv_done)
                dk = warpgroup_mma_init(dk_done)
            elif not OVERLAP:
                dv_done, dk_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
                    0, deps=(dv, dk, p_op, ds_op, do_t, q_t))
                dv = warpgroup_mma_init(dv_done)
                dk = warpgroup_mma_init(dk_done)
                mbarrier.arrive(empty.index(slot))
        dk_done, dv_done, _, _ = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
        if FUSED_DQ:  # the other consumer's last dQ wgmma has read this K slot
            mbarrier.arrive(ds_bar)
            mbarrier.wait(ds_bar, total & 1)
        dk_out = (dk_done * softmax_scale).to(dtype)
        dv_out = dv_done.to(dtype)
        if VARLEN:
            if key0 + KEYS > seqlen_k:  # a box would overwrite the next sequence's rows
                rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, d_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
                offsets = (gl.expand_dims((k_start + rows).to(gl.int64) * (k_desc.shape[2] * HEAD_DIM), 1)
                           + kv_head.to(gl.int64) * HEAD_DIM + gl.expand_dims(cols, 0))
                keep = gl.expand_dims((rows < seqlen_k) & (k_start + rows < k_desc.shape[1]), 1)
                gl.store(DK + offsets, dk_out, mask=keep)
                gl.store(DV + offsets, dv_out, mask=keep)
            else:
                _store_dkdv(dk_out, dv_out, k_tile, v_tile, k_smem, v_smem, dk_desc, dv_desc,
                            [batch, k_start + key0, kv_head, 0])
        else:
            _store_dkdv(dk_out, dv_out, k_tile, v_tile, k_smem, v_smem, dk_desc, dv_desc,
                        [batch, key0, kv_head, 0])

    @gluon.jit
    def _store_dkdv(dk_out, dv_out, k_tile, v_tile, k_smem, v_smem, dk_desc, dv_desc, coords):
        """dK and dV rows by TMA through K's and V's slots, which are read no more (every wgmma
        has retired)."""
        k_tile.store(dk_out)
        v_tile.store(dv_out)
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, coords, k_smem)
        tma.async_copy_shared_to_global(dv_desc, coords, v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _bwd_sequence(CuSeqlensQ, CuSeqlensK, batch, total_q, total_k):
        """(first query row, queries, first key row, keys) of packed sequence ``batch``, its
        offsets clamped into the packed rows (offsets nobody checked, as under CUDA-graph capture,
        may hold anything; a TMA box at a negative row is an illegal instruction)."""
        q_start = gl.minimum(gl.maximum(gl.load(CuSeqlensQ + batch), 0), total_q)
        q_end = gl.minimum(gl.maximum(gl.load(CuSeqlensQ + batch + 1), q_start), total_q)
        k_start = gl.minimum(gl.maximum(gl.load(CuSeqlensK + batch), 0), total_k)
        k_end = gl.minimum(gl.maximum(gl.load(CuSeqlensK + batch + 1), k_start), total_k)
        return q_start, q_end - q_start, k_start, k_end - k_start

    @gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group_size", "window_left", "window_right"])
    def _attn_bwd_dkdv_gluon(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc,
                             delta_desc, CuSeqlensQ, CuSeqlensK, DK, DV, seqlen_q, seqlen_k, group_size,
                             qk_scale, softmax_scale, window_left, window_right, softcap_in,
                             BLOCK_M: gl.constexpr,
                             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             OVERLAP: gl.constexpr, FUSED_DQ: gl.constexpr,
                             WINDOW: gl.constexpr = False, VARLEN: gl.constexpr = False,
                             SOFTCAP: gl.constexpr = False):
        """Grid (key blocks of 128, KV heads, batch). ``lse_desc`` (natural log) and ``delta_desc``:
        (B, H, Sq) float32, blocks of (1, 1, BLOCK_M). ``dq_desc``: float32 (B, Sq, H, D) blocks of
        (1, BLOCK_M, 1, 32) with FUSED_DQ (the caller zeroes it), any descriptor otherwise. WINDOW:
        the sliding window's sides (see _query_blocks). VARLEN: packed sequences, the descriptors over
        (1, total, heads, D) and (1, H, total_q) rows; sequence b by CuSeqlensQ/CuSeqlensK (int32,
        B + 1); ``DK``/``DV`` the contiguous dK and dV (masked stores of a sequence's last key block).
        Without VARLEN those four are not read. SOFTCAP: the score is softcap * tanh(scale * s /
        softcap), ``softcap_in`` = scale / softcap and ``qk_scale`` = softcap * log2(e)."""
        n0 = gl.program_id(0) * 128
        kv_head = gl.program_id(1)
        batch = gl.program_id(2)
        if VARLEN:
            q_start, seqlen_q, k_start, seqlen_k = _bwd_sequence(CuSeqlensQ, CuSeqlensK, batch,
                                                                 q_desc.shape[1], k_desc.shape[1])
            row_start = (q_start + 3) // 4 * 4 + 4 * batch  # packed_row_starts
            batch = batch * 0  # the descriptors' batch coordinate: one packed batch entry
        else:
            q_start = 0
            k_start = 0
            row_start = 0
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape,
                                             lse_desc.layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape,
                                               delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(kv_bars.index(i), count=1)
        if FUSED_DQ:
            ds_smem = gl.allocate_shared_memory(dtype, [4, 64, BLOCK_M], _ds_layout(BLOCK_M))
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, 1, 64], dq_desc.layout)
            ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(ds_bar, count=2)
            dq_first = dq_smem.index(0)
            dq_second = dq_smem.index(1)
        else:  # stand-ins, never touched
            ds_smem = k_smem
            dq_first = k_smem.index(0)
            dq_second = k_smem.index(1)
            ds_bar = kv_bars.index(0)
        m_lo, _, _, num_m = _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M, 128, CAUSAL, window_left,
                                          window_right, WINDOW)
        if VARLEN:  # a key block past the sequence's keys: no query tiles
            num_m = gl.where(n0 < seqlen_k, num_m, m_lo)
        shared = (k_desc, v_desc, dk_desc, dv_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
                  empty, seqlen_q, seqlen_k, group_size, batch, kv_head, n0, qk_scale, softmax_scale,
                  dq_desc, ds_smem, ds_bar, k_smem, window_left, window_right, q_start, k_start, DK, DV,
                  softcap_in)
        FIRST: gl.constexpr = 0
        SECOND: gl.constexpr = 1
        gl.warp_specialize([
            (_bwd_consumer, (k_smem.index(0), v_smem.index(0), kv_bars.index(0), dq_first, shared,
                             BLOCK_M, HEAD_DIM, STAGES, CAUSAL, FIRST, OVERLAP, FUSED_DQ, WINDOW, VARLEN,
                             SOFTCAP)),
            (_bwd_consumer, (k_smem.index(1), v_smem.index(1), kv_bars.index(1), dq_second, shared,
                             BLOCK_M, HEAD_DIM, STAGES, CAUSAL, SECOND, OVERLAP, FUSED_DQ, WINDOW, VARLEN,
                             SOFTCAP)),
            (_bwd_producer, (q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                             delta_bufs, ready, empty, batch, kv_head, group_size, m_lo, num_m,
                             q_start, row_start, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

if _GLUON:
    @gluon.jit
    def _softcap_tanh(s, softcap_in, SOFTCAP: gl.constexpr):
        # tanh(scale s / softcap) as the forward took it (gluon_forward's softmax tile): SOFTCAP 2
        # by tanh.approx.f32, else by exp2's formula on the same scalar product
        if SOFTCAP == 2:
            t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * softcap_in],
                                          dtype=gl.float32, is_pure=True, pack=1)
        else:
            t = 1.0 - 2.0 / (gl.exp2(s * (softcap_in * 2.8853900817779268)) + 1.0)
        return t


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def packed_row_width(total_q: int, batch: int) -> int:
    """Rows of the LSE and Delta copies a packed call's kernel reads (see packed_row_starts)."""
    return -(-total_q // 4) * 4 + 4 * batch


def packed_row_starts(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """Where packed sequence b's LSE and Delta rows start in the copies the kernel reads:
    ceil4(cu_seqlens_q[b]) + 4 b. TMA takes a box's innermost coordinate at 16-byte multiples only
    (an illegal instruction otherwise), and a sequence's rows start anywhere in (H, total_q); from
    these starts every box is aligned, and sequence b's rows end before b + 1's start (at least one
    row of zeros between them)."""
    starts = cu_seqlens_q[:-1].long()
    return (starts + 3) // 4 * 4 + 4 * torch.arange(starts.shape[0], device=starts.device)


def packed_row_copy(rows: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """(H, total_q) float32 rows (an LSE or Delta) as the (1, H, packed_row_width) copy of zeros
    the kernel reads (packed_row_starts), by torch ops, no host sync. The backward's preprocess
    kernel writes this layout itself (backward._attn_bwd_preprocess's ALIGNED)."""
    heads, total_q = rows.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.zeros(1, heads, packed_row_width(total_q, batch), dtype=torch.float32, device=rows.device)
    index = torch.arange(total_q, device=rows.device)
    seq = (torch.searchsorted(cu_seqlens_q.long(), index, right=True) - 1).clamp(0, max(batch - 1, 0))
    target = packed_row_starts(cu_seqlens_q)[seq] + index - cu_seqlens_q.long()[seq]
    inside = index < cu_seqlens_q[-1].long()
    out[0].index_copy_(1, torch.where(inside, target, out.shape[-1] - 1), torch.where(inside, rows.float(), 0.0))
    return out


def programs(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many CTAs ``gluon_dkdv`` launches for (B, S, H, D) ``q`` and ``k``."""
    return -(-k.shape[1] // 128) * k.shape[2] * q.shape[0]


def supported(q, k, v, dout, *, head_dims: tuple = HEAD_DIMS) -> bool:
    """Whether ``gluon_dkdv`` takes these (B, S, H, D) tensors: CUDA on compute capability 9.0, one
    16-bit dtype, head dim in HEAD_DIMS, H a multiple of Hk, TMA-addressable rows. The caller
    checks the options (full, causal or a sliding window, a softcap; no ALiBi or dropout; packed
    sequences as one packed batch entry)."""
    tensors = (q, k, v, dout)
    if not _GLUON or not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in tensors):
        return False
    if _arch(q.device.index) != 90:
        return False
    return dout.shape == q.shape and qkv_shapes_ok(q, k, v, head_dims) and all(_tma_ok(t) for t in tensors)


@functools.lru_cache(maxsize=None)
def _layouts(block_m: int, head_dim: int, torch_dtype):
    return (_smem_layout([1, block_m, 1, head_dim], torch_dtype),
            _smem_layout([1, 64, 1, head_dim], torch_dtype))


@functools.lru_cache(maxsize=None)
def _row_layout():
    # LSE / Delta rows (1, 1, block_m) float32: unswizzled, read back as vectors.
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, Sq) float32 with a contiguous last dim, or a copy whose rows start 16-byte
    aligned (TMA's rule) when Sq is not a multiple of 4."""
    if _tma_ok(t):
        return t
    batch, heads, seqlen = t.shape
    padded = torch.empty(batch, heads, -(-seqlen // 4) * 4, dtype=t.dtype, device=t.device)[..., :seqlen]
    return padded.copy_(t)


@functools.lru_cache(maxsize=None)
def _dq_layout():
    # 128-byte swizzle, the one get_default_for gives the 64-column float32 staging slot, of
    # which each 32-column half is one reduction's box.
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)


@functools.lru_cache(maxsize=None)
def _launch_options(variant: GluonBackwardVariant) -> dict:
    # 4 (consumer 0) + 4 (consumer 1) + 1 (producer) warps; maxnreg 168 over 3 warpgroups is the
    # register file the partitions' budgets (240 + 240 + 24) redistribute, as in the forward.
    return {"BLOCK_M": variant.block_m, "HEAD_DIM": variant.head_dim, "STAGES": variant.stages,
            "CAUSAL": variant.causal, "CONSUMER_REGS": variant.consumer_regs,
            "PRODUCER_REGS": variant.producer_regs, "OVERLAP": variant.overlap,
            "FUSED_DQ": variant.fused_dq, "WINDOW": variant.window, "VARLEN": variant.varlen,
            "SOFTCAP": (2 if variant.softcap_approx else True) if variant.softcap else False,
            "num_warps": 4, "maxnreg": 168}


# with_softcap looked up, not rebuilt, on every softcapped call's host path
_softcap_twin = functools.lru_cache(maxsize=None)(with_softcap)


def gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, *, softmax_scale: float, causal: bool,
               variant: GluonBackwardVariant | None = None,
               dq_accum: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
               cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
               max_seqlen_k: int = 0, softcap: float = 0.0, softcap_approx: bool = False) -> None:
    """dK, dV of attention into ``dk``/``dv`` (B, Sk, Hk, D, TMA-addressable) for inputs
    ``supported`` takes; ``lse`` (natural log) and ``delta`` = rowsum(dO * O): (B, H, Sq) float32
    with one layout and a contiguous last dim. A ``fused_dq`` variant also adds dQ (scaled) into
    ``dq_accum``: float32, q's shape, zeroed by the caller, TMA-addressable. ``window_size`` (left,
    right), -1 for an unbounded side: flash_attn's sliding window, aligned bottom-right (causal: right
    0 whatever is given), on a window variant (the default one is picked).

    Packed sequences (flash_attn_varlen_func): ``cu_seqlens_q``/``cu_seqlens_k`` (B + 1) int32 on
    q's device; q, k, v, dout, dk, dv (and dq_accum) are then (1, total, heads, D), dk and dv
    contiguous, and lse, delta (1, H, packed_row_width) in packed_row_starts' layout
    (packed_row_copy); ``max_seqlen_k`` must bound every sequence's keys (it sizes the grid); each
    sequence is aligned bottom-right on its own lengths.

    ``softcap`` > 0: flash_attn's logit softcap, on a softcap variant (the default one is picked);
    ``lse`` must then be that of the capped scores by the exp2 formula, or with ``softcap_approx`` by
    tanh.approx (the forward's ``softcap_approx``)."""
    _, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    varlen = cu_seqlens_q is not None
    if varlen:
        if (cu_seqlens_k is None or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32
                or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1):
            raise ValueError("gluon_dkdv: packed sequences take int32 cu_seqlens_q/cu_seqlens_k of one shape")
        if q.shape[0] != 1:
            raise ValueError("gluon_dkdv: packed sequences come as one packed batch entry (1, total, ...)")
        if not (dk.is_contiguous() and dv.is_contiguous()):
            raise ValueError("gluon_dkdv: packed sequences take contiguous dk and dv (masked stores)")
        batch, grid_keys = cu_seqlens_q.shape[0] - 1, max_seqlen_k
        if lse.shape[-1] != packed_row_width(seqlen_q, batch):
            raise ValueError("gluon_dkdv: packed sequences take lse and delta in packed_row_copy's layout")
    else:
        batch, grid_keys = q.shape[0], seqlen_k
    if batch <= 0 or seqlen_k == 0 or heads_k == 0:
        return
    if seqlen_q == 0 or grid_keys <= 0:  # (packed: no sequence has keys, or no queries at all)
        dk.zero_()
        dv.zero_()
        return
    dtype = _DTYPES[q.dtype]
    fused = dq_accum is not None
    if variant is None:
        override = _VARIANT_OVERRIDE
        variant = (override if override is not None and override.fused_dq == fused
                   else default_variant(head_dim, dtype, causal, fused))
    windowed = window_size[0] >= 0 or (not causal and window_size[1] >= 0)
    if windowed and not variant.window:
        variant = dataclasses.replace(variant, window=True)
    if varlen and not variant.varlen:
        variant = dataclasses.replace(variant, varlen=True)
    if softcap > 0 and (not variant.softcap or variant.softcap_approx != softcap_approx):
        variant = _softcap_twin(variant, softcap_approx)
    if variant.softcap != (softcap > 0):
        raise ValueError(f"variant {variant.name} {'needs' if variant.softcap else 'takes no'} softcap > 0")
    if variant.varlen != varlen:
        raise ValueError(f"variant {variant.name} {'needs' if variant.varlen else 'takes no'} cu_seqlens")
    if (variant.head_dim, variant.dtype, variant.causal) != (head_dim, dtype, causal):
        raise ValueError(f"variant {variant.name} does not match d{head_dim} {dtype} causal={causal}")
    if lse.shape != delta.shape or lse.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError("gluon_dkdv: lse and delta must be (B, H, Sq) with a contiguous last dim")
    if variant.fused_dq != (dq_accum is not None):
        raise ValueError(f"variant {variant.name} {'needs' if variant.fused_dq else 'takes no'} dq_accum")
    if dq_accum is not None and (dq_accum.dtype != torch.float32 or dq_accum.shape != q.shape
                                 or not _tma_ok(dq_accum)):
        raise ValueError("gluon_dkdv: dq_accum must be a TMA-addressable float32 tensor of q's shape")
    q_layout, kv_layout = _layouts(variant.block_m, head_dim, q.dtype)
    q_block, kv_block = (1, variant.block_m, 1, head_dim), (1, 64, 1, head_dim)
    dq_target = ((dq_accum, (1, variant.block_m, 1, 32), _dq_layout())
                 if dq_accum is not None else (dk, kv_block, kv_layout))
    descriptors = tuple(_Descriptor(t, t.shape, t.stride(), block, layout) for t, block, layout in (
        (q, q_block, q_layout), (k, kv_block, kv_layout), (v, kv_block, kv_layout),
        (dout, q_block, q_layout), (dk, kv_block, kv_layout), (dv, kv_block, kv_layout), dq_target,
        (_tma_rows(lse), (1, 1, variant.block_m), _row_layout()),
        (_tma_rows(delta), (1, 1, variant.block_m), _row_layout())))
    # Causal: one (batch, KV head) row of key blocks after another, longest first within a row.
    # Launching the longest blocks of all rows first was 15-17% slower at 2k and -9..+7% from 4k
    # (the CTAs at work then add dQ into every head's rows at once, far beyond L2), in groups of
    # rows no faster (gluon-bwd-check-h200-20261130-e/-f).
    grid = (-(-grid_keys // 128), heads_k, batch)  # programs(q, k) in all without packing
    window_left, window_right = window_arguments(causal, tuple(window_size))
    qk_scale, softcap_in = score_scalars(softmax_scale, softcap)  # the forward's very scalars
    scalars = (seqlen_q, seqlen_k, heads // heads_k, qk_scale, softmax_scale, window_left, window_right,
               softcap_in)
    on_other_device = q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if on_other_device else contextlib.nullcontext():
        launch(_attn_bwd_dkdv_gluon, grid, (cu_seqlens_q, cu_seqlens_k, dk, dv), scalars,
               _launch_options(variant), descriptors)


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------------------------

def compile_for_sm90(variant: GluonBackwardVariant):
    """Compile a variant to a cubin for sm_90 the way a launch would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[variant.dtype]
    q_layout, kv_layout = _layouts(variant.block_m, variant.head_dim, torch_dtype)
    d, dt = variant.head_dim, variant.dtype

    def desc(block, layout):
        return f"tensordesc<{dt}[{', '.join(map(str, block))}],{layout!r}>"

    q_sig, kv_sig = desc((1, variant.block_m, 1, d), q_layout), desc((1, 64, 1, d), kv_layout)
    dq_sig = (f"tensordesc<fp32[1, {variant.block_m}, 1, 32],{_dq_layout()!r}>"
              if variant.fused_dq else kv_sig)
    fn = _attn_bwd_dkdv_gluon
    row_sig = f"tensordesc<fp32[1, 1, {variant.block_m}],{_row_layout()!r}>"
    signature = {"q_desc": q_sig, "k_desc": kv_sig, "v_desc": kv_sig, "do_desc": q_sig,
                 "dk_desc": kv_sig, "dv_desc": kv_sig, "dq_desc": dq_sig, "lse_desc": row_sig,
                 "delta_desc": row_sig, "DK": f"*{dt}", "DV": f"*{dt}",
                 "qk_scale": "fp32", "softmax_scale": "fp32", "softcap_in": "fp32"}
    options = _launch_options(variant)
    constexprs = {name: value for name, value in options.items() if name not in ("num_warps", "maxnreg")}
    if variant.varlen:
        signature.update(CuSeqlensQ="*i32", CuSeqlensK="*i32")
    else:  # launches pass None
        constexprs.update(CuSeqlensQ=None, CuSeqlensK=None)
    attrs = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": options["num_warps"], "maxnreg": options["maxnreg"]})


def main(argv=None) -> int:
    """Compile every variant for sm_90 and print registers and spills (no GPU needed); a variant
    that spills or has its wgmmas serialized by ptxas fails."""
    from .gluon_forward import resource_usage, wgmma_serialized
    failed = 0
    for variant in GLUON_BACKWARD_VARIANTS:
        try:
            compiled = compile_for_sm90(variant)
        except Exception as exc:  # report every variant, then fail
            print(f"{variant.name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
            failed += 1
            continue
        usage = resource_usage(compiled)
        spills = usage.get("local", 0) > 0 or usage.get("stack", 0) > variant.max_stack
        serialized = bool(wgmma_serialized(compiled))
        failed += spills or serialized
        state = "SPILLS" if spills else "WGMMA SERIALIZED" if serialized else "ok"
        print(f"{variant.name}: {state}, smem {compiled.metadata.shared} B, "
              f"registers {usage.get('reg', '?')}, local {usage.get('local', '?')} B, "
              f"stack {usage.get('stack', '?')} B")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
