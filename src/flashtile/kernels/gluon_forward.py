"""Hopper (sm_90) prefill forward in Gluon: FlashAttention-3's schedule written out by hand.

One CTA owns 128 query rows of one (batch, head) and streams that head's K/V tiles through shared
memory. What the portable Triton kernel leaves to the compiler is explicit here:

- K and V tiles arrive by TMA in a ring of ``STAGES`` shared-memory slots. Each slot has a "ready"
  mbarrier (the TMA's transaction count completes it) and an "empty" one (every consumer arrives
  once it no longer reads the slot). K and V have separate barriers, so Q K^T of a tile can start
  before its V has landed, and a K slot is refilled while the P V product of the tile before still
  reads V.
- Consumers are warpgroups of 4 warps owning 64 query rows each. Both products are async wgmma:
  S = Q K^T with Q and K from shared memory, O += P V with P in registers (the fp32 score
  accumulator's layout maps onto the A-operand layout of the second wgmma without data movement)
  and O accumulated in fp32 registers.
- Intra-warpgroup overlap (FA3 algorithm 2): iteration j issues S_j = Q K_j^T and then
  O += P_{j-1} V_{j-1}, waits for S_j only, and runs the softmax of tile j while the P V wgmma of
  tile j-1 is still on the tensor cores. O is rescaled by exp2(m_{j-1} - m_j) once that wgmma
  has retired; the running sum is divided out once at the end.
- ``warp_specialize``: a 1-warp producer partition issues every TMA load, two consumer
  partitions each own half the CTA's rows (FA3's 2 x 64-row ping-pong layout). With ``pingpong``
  the consumers take turns issuing their wgmmas (an mbarrier pair passes the turn), so one
  warpgroup's softmax runs while the other's GEMMs occupy the tensor cores. Register budgets move
  to the consumers (24 for the producer, 240 for each consumer warpgroup).
- Without ``warp_specialize`` one 8-warp consumer (two warpgroups in lockstep) issues its own TMA
  loads: the simplest correct schedule, kept as a fallback.
- ``persistent``: one CTA per SM loops over work tiles (query block, head, batch), causal ones
  longest first; every partition keeps counting ring slots and barrier phases across work tiles,
  so the producer loads the next tile's first K/V while the consumers finish the current one.
  Otherwise the same code runs one work tile per CTA.

Softmax is kept in base 2 with the scale folded into one FMA: p = exp2(s * scale * log2(e) - m).
Causal masks are aligned bottom-right (query row i sees keys j <= i + Sk - Sq); tiles past the
diagonal are never loaded, and only the tiles on the diagonal or the ragged end of the keys pay for
the mask. Rows that see no key give output 0 and LSE +inf, as the portable kernel does.

Tensors are read through host-side TMA descriptors over the (B, S, H, D) tensors themselves (rank
4, box [1, rows, 1, D]): the descriptor clips at each batch's sequence end, so loads past it fill
zeros and the output store writes nothing past it, for any Sq and Sk. With ``seqused_k`` (chunked
prefill against a KV cache) k and v are caches and sequence b's key count is read on the device;
its last key tile's V rows past that count are zeroed in shared memory before P V reads them.

This module imports on machines without a GPU; ``compile_for_sm90`` builds a variant's cubin there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .forward import _arch
from .launch import launch

try:  # Gluon ships with triton >= 3.5; keep the module importable without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON = True
    _LN2 = gl.constexpr(0.6931471805599453)  # natural log of the base-2 LSE, inside the kernel
    # Lazy rescale: P may reach 2^8 against a stale reference max (FlashAttention-4's value); bf16
    # and fp16 hold that, and the fp32 sums lose nothing.
    RESCALE_THRESHOLD = gl.constexpr(8.0)
except ImportError:  # pragma: no cover - depends on the installed triton
    _GLUON = False

LOG2E = 1.4426950408889634

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8"}


# 2^x = 2^n * 2^f with n = round(x) and f in [-1/2, 1/2]: 2^f by a cubic fitted for relative
# error on that interval (7.5e-5 at most), n added to the exponent field. round() is the fp32
# addition of 1.5 * 2^23, which leaves n in the low mantissa bits, so n << 23 is that sum's bits
# shifted. x is clamped at -125 first, so the result stays a normal number (<= 2^-124.5 there
# rather than 0: callers use it only where x is finite).
_EXP2_POLY = ("0f3D61FB53", "0f3E786EE6", "0f3F31798D", "0f3F7FFB4A")  # f^3, f^2, f, 1


def exp2_ptx(pack: int, poly: int) -> str:
    """PTX for an inline-asm element group of ``pack`` fp32 values ($0.. out, $pack.. in): the
    first pack - poly by ex2.approx (MUFU), the last ``poly`` by the polynomial (FMA and integer
    pipes), FlashAttention-4's split of the exponentials between the two."""
    lines = ["{", ".reg .f32 t, r, n, f, p;", ".reg .b32 e, b;"]
    for i in range(pack - poly):
        lines.append(f"ex2.approx.ftz.f32 ${i}, ${pack + i};")
    c3, c2, c1, c0 = _EXP2_POLY
    for i in range(pack - poly, pack):
        lines += [f"max.ftz.f32 t, ${pack + i}, 0fC2FA0000;",
                  "add.rn.ftz.f32 r, t, 0f4B400000;",
                  "sub.rn.ftz.f32 n, r, 0f4B400000;",
                  "sub.rn.ftz.f32 f, t, n;",
                  f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
                  f"fma.rn.ftz.f32 p, p, f, {c1};",
                  f"fma.rn.ftz.f32 p, p, f, {c0};",
                  "mov.b32 e, r;", "shl.b32 e, e, 23;", "mov.b32 b, p;", "add.s32 b, b, e;",
                  f"mov.b32 ${i}, b;"]
    lines.append("}")
    return "\n".join(lines)


@dataclass(frozen=True)
class GluonVariant:
    """One compiled specialization of the kernel.

    ``block_n`` keys per tile; ``stages`` K/V slots in the shared-memory ring; ``warp_specialize``
    picks the producer + 2 consumer partitions (else one 8-warp consumer loading its own tiles);
    ``pingpong`` makes the two consumer warpgroups alternate their wgmma issues; ``persistent``
    launches one CTA per SM looping over the work tiles (else one CTA per tile); ``consumer_regs``
    is each consumer warpgroup's register budget under warp specialization.
    """
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    block_n: int = 128
    stages: int = 2
    warp_specialize: bool = True
    pingpong: bool = True
    persistent: bool = False
    consumer_regs: int = 240
    p_in_registers: bool = False  # e4m3 only: P as a register operand instead of through shared memory
    p_slots: int = 2  # e4m3 through shared memory: P slots per consumer (1: P_j waits for P_{j-1} V)
    max_stack: int = 0  # stack bytes (register spills) the compile check accepts for this variant
    joint_release: bool = False  # free a ring slot's K and V together, after its P V (one arrive a tile)
    prefetch_q: bool = False  # two Q buffers per consumer: the next work tile's Q loads during this one
    # Consumer warpgroups of 64 rows under warp specialization: 2, or 3 (FA3's layout at head dim 64,
    # where the softmax dominates; no ping-pong then, and 160 registers each instead of 240).
    consumers: int = 2
    # Persistent CTAs deal the longest-first work tiles out in rows of one tile per CTA, every other
    # row in reverse ("snake"), instead of CTA p taking tiles p, p + grid, ...: the sorted order
    # hands the first CTAs the longest tile of every row (a model of causal work tiles puts the
    # busiest CTA ~6% over the mean at 4k-32k tokens, the snake within 0.2%).
    snake: bool = False
    # Causal: each consumer warpgroup stops at the last key tile its own 64 rows see (and only
    # releases the block's later tiles), instead of every consumer running the whole block's range.
    own_range: bool = False
    # With own_range: a consumer whose 64 rows all lie past the query length (the ragged last block:
    # 4096 rows make 21 blocks of 192 and one of 64) runs key tile 0 only and releases the rest,
    # instead of the whole range for rows nobody stores (~6% of the work at 2k and 4k).
    skip_empty_rows: bool = True
    # FlashAttention-4's lazy rescale: the reference max of a consumer's rows moves
    # only when some row's running max grew by more than RESCALE_THRESHOLD (log2 units) over it, so
    # most key tiles skip the O *= alpha pass; exact, because the final division by the running
    # sum (kept against the same reference) cancels it, and P stays below 2^RESCALE_THRESHOLD.
    lazy_rescale: bool = False
    # FlashAttention-4's exponential on the FMA pipe: of every 8 exponentials a thread computes on
    # an unmasked key tile, this many come from a cubic polynomial (2^n * p(f), n = round(x)) instead
    # of MUFU.EX2, whose 16 results per clock per SM bound the softmax when the tensor cores are
    # fast relative to it (head dim 64, e4m3). Relative error 7.5e-5, far under bf16's rounding.
    exp2_poly: int = 0
    # 16-bit P packed by one cvt.rn.{bf16,f16}x2 per pair in inline PTX, in the register order the
    # P V operand takes; Triton's own conversion packs each pair the other way round and swaps the
    # halves back with a PRMT (32 per thread per 128-key tile).
    p_pack_asm: bool = True
    # Query columns [0, q_regs) held in registers as the A operand of S = Q K^T (the rest stays in
    # shared memory): at d256 with 64-key tiles an all-shared-memory S wgmma reads 4 KB of operands
    # per 32 clocks, the 128 bytes per clock shared memory serves, so taking half of Q off it leaves
    # room for the TMA writes and the P V operand.
    q_regs: int = 0
    # Keys per sequence from a device tensor (``seqused_k``, a KV cache's lengths) instead of K's
    # length: k and v are caches (B, S_max, Hk, D) whose slots past a sequence's length hold
    # anything, so the last key tile's V rows past it are zeroed in shared memory before P V reads
    # them (0 x NaN would poison the rows' output). Chunked prefill against a contiguous cache.
    seqused_k: bool = False
    # With seqused_k, page pools of pages smaller than a key tile: each tile arrives as boxes of
    # this many keys, each at its own page (any page size that is a multiple of it); 0: a tile
    # is one box (contiguous caches, pages of whole tiles).
    page_rows: int = 0
    # Packed sequences (flash_attn_varlen_func): q (total_q, H, D), k and v (total_k, Hk, D) read
    # at each sequence's offsets (cu_seqlens); work tiles past a sequence's rows are skipped, and
    # the last query block of a sequence stores its rows by pointer, since a TMA box would write
    # the next sequence's rows too. Keys past a sequence's end (the next sequence's) are masked in
    # S, so P is exactly 0 there. With seqused_k (and page_rows): k and v are page pools read through
    # the block table (flash_attn_varlen_func's block_table), sequence b's keys the first
    # cu_seqlens_k[b + 1] - cu_seqlens_k[b] slots of its pages (clamped to the table's capacity).
    varlen: bool = False
    # Sliding window (flash_attn's window_size, either side bounded): each query block runs the key
    # tiles from its window's left edge to its right edge (or the diagonal) only, masked at both
    # ends; the window's sides are runtime arguments. 16-bit, plain (B, S, H, D) calls or packed
    # sequences (varlen, each sequence's window bottom-right on its own lengths), not caches.
    window: bool = False
    # Packed sequences of different lengths: the persistent CTAs deal out only the work tiles that
    # hold query rows, listed on the device before the launch (packed_work_list), instead of every
    # (query block, head, sequence) up to the longest sequence's blocks with the empty ones skipped
    # one by one in the loop (~3 us a CTA each on the H200: a decode step among prefill chunks
    # makes as many empty tiles as the chunk has query blocks). Tiles of sequences without keys
    # store their zeros and +inf LSEs without loading anything.
    work_list: bool = False
    # Attention sinks (gpt-oss's s_aux): one more logit a query head, Sinks[head], with no value,
    # taken into each row's sum in the epilogue, so the output is rounded once and no pass follows.
    sinks: bool = False
    # Gemma 2's logit softcap (flash_attn's ``softcap``): scores capped as softcap * tanh(scale * s /
    # softcap) before the softmax, the cap and scale runtime arguments. 16-bit inputs.
    softcap: bool = False
    # (A/B alternate, not shipped) the softcap's tanh by tanh.approx.f32 (one MUFU op, ~2^-11
    # relative error) instead of the portable kernel's exp2 formula, which the backward recomputes.
    softcap_approx: bool = False

    def __post_init__(self):
        if self.snake and not self.persistent:
            raise ValueError("snake order needs persistent CTAs")
        if self.own_range and (self.pingpong or not self.causal or not self.warp_specialize):
            raise ValueError("own key ranges need causal consumers without ping-pong")
        if self.lazy_rescale and self.fp8:
            # e4m3 would hold P <= 2^8, but the e4m3 kernels ran 4-15% slower with it at d128 causal
            # and d256 (gluon-ab-lazy-fp8-h200-20261130.json), so they keep the plain rescale.
            raise ValueError("the lazy rescale is for 16-bit inputs")
        if not 0 <= self.exp2_poly <= 8:
            raise ValueError("exp2_poly counts exponentials out of every 8")
        if self.seqused_k and self.fp8:
            raise ValueError("seqused_k: 16-bit caches only")
        if self.page_rows and (not self.seqused_k or self.page_rows % 8 or self.block_n % self.page_rows):
            raise ValueError("page_rows: with seqused_k, a multiple of 8 dividing the key tile")
        if self.varlen and (not self.warp_specialize or self.prefetch_q):
            # (the Q prefetch would load a skipped work tile's Q; not written)
            raise ValueError("varlen: warp specialized, without the Q prefetch")
        if self.work_list and not (self.varlen and self.persistent):
            raise ValueError("work_list: packed sequences on persistent CTAs")
        if self.window and (self.fp8 or not self.warp_specialize or self.own_range or self.seqused_k):
            raise ValueError("window: 16-bit plain or packed calls, warp specialized, without own key "
                             "ranges or caches")
        if self.softcap and self.fp8:
            raise ValueError("softcap: 16-bit inputs")
        if self.q_regs and (self.fp8 or 2 * self.q_regs != self.head_dim):
            # Gluon's tile extents are powers of two: the two halves of the head dim
            raise ValueError("q_regs: half the head dim, 16-bit inputs")

    @property
    def block_m(self) -> int:
        return 64 * self.consumers if self.warp_specialize else 128

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def name(self) -> str:
        sched = ("ws-pingpong" if self.pingpong else "ws") if self.warp_specialize else "sync"
        if self.persistent:
            sched += "-persistent"
        if self.snake:
            sched += "-snake"
        if self.own_range:
            sched += "-own" if self.skip_empty_rows else "-own-allrows"
        if self.fp8 and self.p_in_registers:
            sched += "-preg"
        elif self.fp8 and self.p_slots == 1:
            sched += "-p1"
        if self.joint_release:
            sched += "-joint"
        if self.prefetch_q:
            sched += "-pq"
        if self.warp_specialize and self.consumers != 2:
            sched += f"-c{self.consumers}"
        if self.lazy_rescale:
            sched += "-lazy"
        if self.exp2_poly:
            sched += f"-poly{self.exp2_poly}"
        if not self.p_pack_asm and not self.fp8:
            sched += "-prmt"
        if self.q_regs:
            sched += f"-qr{self.q_regs}"
        if self.seqused_k:
            sched += "-seqk"
        if self.page_rows:
            sched += f"-pr{self.page_rows}"
        if self.varlen:
            sched += "-varlen"
        if self.window:
            sched += "-win"
        if self.work_list:
            sched += "-wl"
        if self.sinks:
            sched += "-sinks"
        if self.softcap:
            sched += "-softcap-approx" if self.softcap_approx else "-softcap"
        return (f"gluon-d{self.head_dim}-{self.dtype}-{'causal' if self.causal else 'full'}"
                f"-n{self.block_n}-s{self.stages}-{sched}")


def _tile_config(head_dim: int, causal: bool, dtype: str = "bf16") -> dict:
    # Shared memory per CTA: Q 128 x D plus stages x (K + V) tiles of block_n x D, all 2-byte.
    # d128: 32 KB + 2 x 64 KB = 160 KB; d64: 16 KB + 3 x 32 KB = 112 KB (227 KB available).
    # (Tile extents must be powers of two in Gluon, so FA3's 176-key tiles at d128 are out.)
    # Causal work tiles differ in length: persistent CTAs take them longest first and prefetch the
    # next tile's keys while finishing the current one.
    # d256: 64-key tiles, Q 64 KB + 2 x (K + V) 128 KB = 192 KB (three stages would not fit).
    # d64 non-causal: persistent measured 1-5% faster from 2k to 8k tokens on the H200
    # (gluon-check-h200-20261129-a.json); at d128 only causal gains from it.
    # d128 non-causal: persistent CTAs that load the next work tile's Q during the current one
    # (the Q buffers take 64 of 192 KB), +1-9% over one CTA per tile at 2k-16k as medians of five
    # shuffled rounds (gluon-ab-h200-20261130.json), where the persistent grid alone gave +1-4%.
    # Causal (either dtype) and d64: within run-to-run noise, not used; d256: no room.
    # d256 non-causal: persistent +1-5% at 2k/4k, within 1% at 8k/16k as shuffled medians in two runs
    # (gluon-ab-d256-h200-20261130-a/-b.json).
    config = {"block_n": 64 if head_dim > 128 else 128, "stages": 3 if head_dim <= 64 else 2,
              "persistent": True,
              "prefetch_q": head_dim == 128 and not causal and dtype != "fp8", "snake": causal}
    if head_dim >= 128 and dtype != "fp8":
        # FlashAttention-4's lazy rescale, as medians of five shuffled rounds against the same
        # schedule without it (gluon-ab-lazy-h200-20261130.json, 2k/4k/8k/16k): d128 non-causal
        # +2.1/+0.0/+0.4/+2.0%, causal +1.9/+0.6/+2.9/+0.5%; d256 non-causal -1.6/+1.3/-0.7/+2.7%,
        # causal +0.2/+3.2/+3.0/+3.4%. (d256 keeps one register in 8 bytes of stack, stored once
        # and loaded once per call, outside the key loop.) At d64 the three 160-register
        # consumers spill in the loop with it: -9 to -11%, not used.
        config.update(lazy_rescale=True, max_stack=8 if head_dim > 128 else 0)
    if head_dim <= 64 and dtype != "fp8":
        # d64: three consumer warpgroups (192-row blocks, FA3's layout where the softmax dominates),
        # 160 registers each, no ping-pong: +8-10% non-causal at 2k-16k, causal -1% at 2k, +0-7%
        # from 4k, as medians of five shuffled rounds (gluon-ab-d64-h200-20261130.json).
        # (Causal spilled 24 bytes of stack at 160 registers, the most three consumers can have;
        # 8 with the Q prefetch, 0 once P was packed without Triton's half swaps.)
        # Causal: the next work tile's Q loads during this one (the causal work tiles are short):
        # -1.2/+0.9/+2.3/+2.7% at 2k/4k/8k/16k, 32 heads, medians of five shuffled rounds
        # (gluon-ab-pq-d64-h200-20261130.json).
        config.update(consumers=3, pingpong=False, consumer_regs=160, max_stack=32 if causal else 0,
                      own_range=causal, prefetch_q=causal)
    if dtype == "fp8":
        # e4m3 at d128, causal: 128-key tiles, Q 2 x 8 KB, bf16 output staging 2 x 16 KB, P in two
        # slots per consumer 4 x 8 KB, K/V 3 x 32 KB (176 KB). Non-causal: 256-key tiles (half the
        # barrier rounds per key), two stages, one P slot per consumer (2 x 16 KB): 208 KB, with a
        # few registers spilled (max_stack), 5-13% faster than 128-key tiles in
        # gluon-check-h200-20261130-fp8-c.json (whose 256-key rows failed their check only for
        # lack of 256-key scale blocks; -fp8-d checks them with such blocks). Ping-pong: within
        # run-to-run noise either way at e4m3 (-fp8-a, -fp8-b).
        # Causal: K and V slots freed together after P V (one barrier round per tile fewer): +3-16%
        # over freeing K early at 2k-16k in gluon-check-h200-20261130-fp8-e.json; with the 256-key
        # tiles' two stages it starves the producer (-16%), so non-causal frees K early.
        if causal:
            config.update(block_n=128, stages=3, pingpong=False, joint_release=True)
        else:
            config.update(block_n=256, stages=2, pingpong=False, p_slots=1, max_stack=128,
                          persistent=False)
        if head_dim == 128:
            # 2 (non-causal) or 1 (causal) of every 8 exponentials on the FMA pipe (exp2_poly):
            # medians of five shuffled rounds over the same schedule with MUFU only, 2k/4k/8k/16k,
            # in two runs (gluon-ab-poly-h200-20261130.json, -poly-b): non-causal +8/+18/+2/+6% and
            # +7/+9/+6/+6% with 2 of 8 (1 of 8: +6/+3/-5/+2%, 3 of 8: 0/+7/-3/-8%); causal with 2 of
            # 8 +0.5/+5.5/+2.7/+0.9% and +0.8/+9.4/+1.1/+0.7%, with 1 of 8 +2.6/+12/+4.5/+3.7% (one
            # run). The 16-bit kernels lost 3-14% with it (d64 three consumers, d128 ping-pong).
            config.update(exp2_poly=1 if causal else 2)
        if head_dim > 128:  # d256: 64-key tiles, two stages (the d128 tiles need 330-390 KB); causal
            # frees K early (its joint-release form never finished a check: see FP8_DISPATCH)
            config.update(block_n=64, stages=2, joint_release=False)
    return config


@functools.lru_cache(maxsize=None)
def default_variant(head_dim: int, dtype: str, causal: bool) -> GluonVariant:
    return GluonVariant(head_dim, dtype, causal, **_tile_config(head_dim, causal, dtype))


# d256 non-causal with at most this many keys: Q's first half as the register operand of S = Q K^T
# (q_regs). Against the same schedule without it, medians of 5, 15 and 25 shuffled rounds in three
# runs (gluon-ab-qr-h200-20261130-a/-b/-c.json, 8 heads, 16k tokens): 2k +3.4/+4.1/+2.8%, 4k
# +4.2/+1.4/+0.2%, 8k -3.0/-1.0/+0.7%, 16k -0.4/-0.6/-1.6%. Causal: +1.3% on average over both
# runs, with 24 bytes of stack: not used.
Q_REGS_MAX_KEYS = 4096


def dispatch_variant(head_dim: int, dtype: str, causal: bool, seqlen_k: int) -> GluonVariant:
    """The variant a call of this head dim, dtype, mask and key length runs."""
    return _dispatch_variant(head_dim, dtype, causal, seqlen_k <= Q_REGS_MAX_KEYS)


@functools.lru_cache(maxsize=None)
def _dispatch_variant(head_dim: int, dtype: str, causal: bool, short: bool) -> GluonVariant:
    base = default_variant(head_dim, dtype, causal)
    if head_dim == 256 and dtype != "fp8" and not causal and short:
        return dataclasses.replace(base, q_regs=128)
    return base


@functools.lru_cache(maxsize=None)
def with_seqused_k(variant: GluonVariant) -> GluonVariant:
    """The schedule a ``seqused_k`` call of this variant's shape runs. The V tail's zeroing keeps
    a few registers more live around the last P V: sm_90 compiles (CPU machine) put d128 causal at
    24 stack bytes (with the page table's arguments; every spill load and store outside the key
    loops), d256 at 24-48 (one register reloaded in each loop iteration); d64's three 160-register
    consumers spilled 56-80 bytes, so d64 takes the two-consumer schedule (no stack)."""
    if variant.consumers != 2:
        variant = _two_consumers(variant)
    stack = {128: 24, 256: 48}.get(variant.head_dim, 0)
    return dataclasses.replace(variant, seqused_k=True, max_stack=max(variant.max_stack, stack))


# Keys a box may carry on page pools whose pages do not hold whole key tiles: a tile arrives as
# boxes of the largest of these that divides the page size (and is under the key tile), each at its
# own page. A box costs the same whatever its size (a TMA message per 128 bytes of row, so two per
# box at d128, 16-bit): with 16-key boxes the forward ran 0.82-0.86x the contiguous cache, with
# 32-key boxes 0.89-0.93x and 64-key boxes 0.94-0.98x, pages in order or shuffled alike
# (paged-boxes-h200-20261201: B1 32/8 32k keys 512 positions, B8 32/8 2k 128, B4 12/2 4k 512).
PAGED_BOX_ROWS = (64, 32, 16)


def page_box_rows(page_size: int, block_n: int) -> int:
    """Keys per box on pools of ``page_size``-key pages under ``block_n``-key tiles: block_n where
    pages hold whole tiles, else the largest PAGED_BOX_ROWS entry dividing page_size; 0: none."""
    if page_size % block_n == 0:
        return block_n
    return next((rows for rows in PAGED_BOX_ROWS if rows < block_n and page_size % rows == 0), 0)


@functools.lru_cache(maxsize=None)
def with_page_boxes(variant: GluonVariant, rows: int) -> GluonVariant:
    """The seqused_k variant reading page pools in ``rows``-key boxes. d128 takes three K/V ring
    slots (the second Q buffer of the non-causal schedule's Q prefetch makes room): the boxes of a
    tile arrive later than one box would, and with two slots the consumers waited for them
    (paged-boxes-h200-20261201-c). Its sm_90 compiles (CPU machine) keep 8-56 stack bytes: the
    consumers' as with_seqused_k's (d128 non-causal with three slots: 56), and the 24-register
    producer's (a few spill loads a key tile)."""
    seqk = with_seqused_k(variant)
    slots = {"stages": 3, "prefetch_q": False} if seqk.head_dim == 128 else {}
    return dataclasses.replace(seqk, page_rows=rows, max_stack=max(seqk.max_stack, 56), **slots)


def paged_variant(variant: GluonVariant, page_size: int) -> GluonVariant:
    """The schedule of ``variant`` on a page pool: one box a key tile where pages hold whole
    tiles, else boxes of page_box_rows keys (page_size a multiple of the smallest box)."""
    rows = page_box_rows(page_size, variant.block_n)
    return with_seqused_k(variant) if rows == variant.block_n else with_page_boxes(variant, rows)


@functools.lru_cache(maxsize=None)
def with_varlen(variant: GluonVariant) -> GluonVariant:
    """The schedule of ``variant`` on packed sequences (flash_attn_varlen_func), without the Q
    prefetch (d128 16-bit non-causal's), which would load the Q of work tiles varlen skips. The
    offsets, the output pointer and a count of the work tiles run keep a few more registers live:
    sm_90 compiles (CPU machine) keep up to 48 stack bytes, mostly values the partitions take at
    their start and the 24-register producer's; d128/d256 16-bit also reload one loop-carried value a
    key tile in the first consumer (an LDL and a predicated STL)."""
    return dataclasses.replace(variant, varlen=True, prefetch_q=False, max_stack=max(variant.max_stack, 48))


@functools.lru_cache(maxsize=None)
def with_work_list(variant: GluonVariant) -> GluonVariant:
    """``variant`` (packed sequences, persistent) dealing out only listed work tiles (work_list)."""
    return dataclasses.replace(variant, work_list=True)


# The listed deal costs one more launch (~2-3 us in a CUDA graph) and takes the place of the empty
# work tiles, ~3 us a CTA each in the persistent loop (the mixed batches of
# varlen-decode-h200-20261204-mixed-b): taken where they would be at least this many a CTA.
WORK_LIST_MIN_EMPTY = 1


def work_list_wanted(variant: GluonVariant, batch: int, total_q: int, max_seqlen_q: int, heads: int,
                     sm_count: int) -> bool:
    """Whether a packed call of ``variant`` should list its work tiles: the grid's query blocks
    (batch x the longest sequence's) exceed those the sequences can fill (at most one partial
    block a sequence beyond total_q's whole ones; the host knows no single length) by at least
    WORK_LIST_MIN_EMPTY empty tiles a CTA."""
    if not (variant.varlen and variant.persistent):
        return False
    blocks = -(-max_seqlen_q // variant.block_m) * batch
    filled = min(blocks, total_q // variant.block_m + batch)
    return (blocks - filled) * heads >= WORK_LIST_MIN_EMPTY * sm_count


@triton.jit
def _packed_work_list(CuSeqlensQ, CuSeqlensK, WorkList, batch, num_m_blocks, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    """Program ``level`` lists the sequences that have a query block ``level`` (of at most
    num_m_blocks) as entries level * batch + b at WorkList[1 + position], positions in the order
    the kernel deals them: the blocks of sequences with keys first, then those without (which only
    store zeros: the longest work first), each part causal from the last blocks down (level
    descending, then sequence), else sequence by sequence with blocks ascending. Program 0 writes
    the entries' count to WorkList[0]."""
    level = tl.program_id(0)
    keyed_total = tl.zeros([], tl.int32)  # blocks of sequences with keys: where the others start
    above = tl.zeros([], tl.int32)  # causal: keyed entries of the levels above this one
    above_keyless = tl.zeros([], tl.int32)
    for c in range(0, batch, CHUNK):
        n, keyed = _query_blocks(CuSeqlensQ, CuSeqlensK, c + tl.arange(0, CHUNK), batch, num_m_blocks, BLOCK_M)
        keyed_total += tl.sum(tl.where(keyed, n, 0), 0)
        if CAUSAL:  # max(n - level - 1, 0) entries a sequence of n blocks above this level
            beyond = tl.maximum(n - level - 1, 0)
            above += tl.sum(tl.where(keyed, beyond, 0), 0)
            above_keyless += tl.sum(tl.where(keyed, 0, beyond), 0)
    before = tl.zeros([], tl.int32)
    before_keyless = tl.zeros([], tl.int32)
    for c in range(0, batch, CHUNK):
        b = c + tl.arange(0, CHUNK)
        n, keyed = _query_blocks(CuSeqlensQ, CuSeqlensK, b, batch, num_m_blocks, BLOCK_M)
        if CAUSAL:
            live = (n > level).to(tl.int32)
            mine, others = tl.where(keyed, live, 0), tl.where(keyed, 0, live)
            position = tl.where(keyed, above + before + tl.cumsum(mine, 0) - mine,
                                keyed_total + above_keyless + before_keyless + tl.cumsum(others, 0) - others)
            before += tl.sum(mine, 0)
            before_keyless += tl.sum(others, 0)
        else:
            mine, others = tl.where(keyed, n, 0), tl.where(keyed, 0, n)
            position = tl.where(keyed, before + tl.cumsum(mine, 0) - mine,
                                keyed_total + before_keyless + tl.cumsum(others, 0) - others) + level
            before += tl.sum(mine, 0)
            before_keyless += tl.sum(others, 0)
        tl.store(WorkList + 1 + position, level * batch + b, mask=n > level)
    if level == 0:  # causal: level 0's own entries after the levels above, every block once
        if CAUSAL:
            keyless_total = above_keyless + before_keyless
        else:
            keyless_total = before_keyless
        tl.store(WorkList, keyed_total + keyless_total)


@triton.jit
def _query_blocks(CuSeqlensQ, CuSeqlensK, b, batch, num_m_blocks, BLOCK_M: tl.constexpr):
    """(query blocks, whether there are keys) of sequences b (no blocks past the batch): at most
    num_m_blocks blocks, as the kernel covers them."""
    inside = b < batch
    start = tl.load(CuSeqlensQ + b, mask=inside, other=0)
    queries = tl.maximum(tl.load(CuSeqlensQ + b + 1, mask=inside, other=0) - start, 0)
    keys = tl.load(CuSeqlensK + b + 1, mask=inside, other=0) - tl.load(CuSeqlensK + b, mask=inside, other=0)
    return tl.minimum((queries + BLOCK_M - 1) // BLOCK_M, num_m_blocks), keys > 0


_WORK_LIST_OPTIONS: dict = {}


def packed_work_list(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_m_blocks: int, block_m: int,
                     causal: bool) -> torch.Tensor:
    """The work list of packed sequences with offsets ``cu_seqlens_q`` and ``cu_seqlens_k`` (B + 1
    int32 on the device; on page pools, the key counts' running sum):
    int32 (1 + B x num_m_blocks), its count of entries first (_packed_work_list). On the device,
    without a host sync (CUDA-graph capture)."""
    batch = cu_seqlens_q.shape[0] - 1
    work = torch.empty(1 + batch * num_m_blocks, dtype=torch.int32, device=cu_seqlens_q.device)
    options = _WORK_LIST_OPTIONS.get((block_m, causal))
    if options is None:  # one dict a key: launch keys its cache on the options' identity
        options = _WORK_LIST_OPTIONS.setdefault((block_m, causal), {"BLOCK_M": block_m, "CHUNK": 512,
                                                                    "CAUSAL": causal, "num_warps": 4})
    launch(_packed_work_list, (num_m_blocks,), (cu_seqlens_q, cu_seqlens_k, work), (batch, num_m_blocks), options)
    return work


def varlen_paged_variant(head_dim: int, dtype: str, causal: bool, page_size: int) -> GluonVariant:
    """The schedule of packed sequences on page pools of ``page_size`` keys: the default one of
    this shape (d256 without Q's register half: with the page table's and the packed offsets'
    registers its sm_90 compile kept 88-96 stack bytes), read as ``paged_variant`` reads pools."""
    return with_varlen(paged_variant(default_variant(head_dim, dtype, causal), page_size))


@functools.lru_cache(maxsize=None)
def with_window(variant: GluonVariant) -> GluonVariant:
    """The schedule of ``variant`` under a sliding window: every consumer over its block's key span
    (d64 causal's per-consumer ranges start at key 0). The window's arguments and the loop over the
    left edge's masked tiles keep a few more registers live: sm_90 compiles (CPU machine) keep 32
    stack bytes at d128 (one value reloaded a key tile in the first consumer), 48-64 at d256; d64
    non-causal's three 160-register consumers spilled 152 bytes (41 spill instructions in a masked
    tile), so it would take the two-consumer schedule (8 bytes); d64 causal keeps three (none).
    Packed sequences (``variant.varlen``) keep 24-40 bytes at d128 and 80-112 at d256, where Q's
    register half (d256 non-causal up to Q_REGS_MAX_KEYS) would take 288: it reads all of Q from shared
    memory there. Dispatch takes d128 and d256 only (WINDOW_HEAD_DIMS)."""
    if variant.consumers != 2 and not variant.causal:
        variant = _two_consumers(variant)
    if variant.varlen:
        variant = dataclasses.replace(variant, q_regs=0)
    stack = {128: 32, 256: 112 if variant.varlen else 64}.get(variant.head_dim,
                                                               8 if variant.consumers == 2 else 0)
    return dataclasses.replace(variant, window=True, own_range=False,
                               max_stack=max(variant.max_stack, stack))


def with_softcap(variant: GluonVariant, approx: bool = False) -> GluonVariant:
    """``variant`` with the logit softcap (16-bit), its tanh by tanh.approx with ``approx`` (SOFTCAP_APPROX). sm_90
    keeps up to 16 more stack bytes than without (d256 packed windows: 128), 48 where that kept fewer."""
    return dataclasses.replace(variant, softcap=True, softcap_approx=approx,
                               max_stack=max(variant.max_stack + 16, 48))


# A window side without a bound, as the kernel takes it: past any key position (rows' positions
# plus or minus it stay within int32 for sequences under 2^30 keys).
UNBOUNDED_WINDOW = 1 << 30


def window_arguments(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """The kernel's (window_left, window_right) of flash_attn's ``window_size`` (-1: unbounded);
    causal calls bound the right side at the diagonal."""
    left, right = window_size
    return (left if left >= 0 else UNBOUNDED_WINDOW,
            0 if causal else right if right >= 0 else UNBOUNDED_WINDOW)


def _two_consumers(variant: GluonVariant) -> GluonVariant:
    return dataclasses.replace(variant, consumers=2, pingpong=True, consumer_regs=240, max_stack=0,
                               own_range=False, prefetch_q=False)


def _alternates(head_dim: int, causal: bool) -> list[GluonVariant]:
    """Other schedules at bf16, kept compiling so that a GPU run can compare them with the default:
    the other persistence mode, no ping-pong, and (d128) the non-specialized fallback."""
    base = default_variant(head_dim, "bf16", causal)
    if base.consumers != 2:  # d64: the two-consumer ping-pong schedule, persistent or not
        two = _two_consumers(base)
        return [two, dataclasses.replace(two, persistent=False, snake=False)]
    out = [dataclasses.replace(base, persistent=not base.persistent, prefetch_q=False,
                               snake=causal and not base.persistent)]
    if base.prefetch_q:  # and the persistent grid without the Q prefetch
        out.append(dataclasses.replace(base, prefetch_q=False))
    if head_dim == 128:
        out += [dataclasses.replace(base, pingpong=False),
                dataclasses.replace(base, warp_specialize=False, pingpong=False, prefetch_q=False)]
    return out


# The head dims ``supported`` hands to the Gluon kernel; gluon_check.py checks every shipped
# variant on an H200 (head dim 256 too, whether dispatched or not).
HEAD_DIMS = (64, 128, 256)
# e4m3 (FP8 forward through fp8_supported): the (head dim, causal) pairs the Gluon kernel runs,
# each checked on an H200 and faster there than the portable e4m3 kernel. d256 non-causal: 853-925
# vs 743-878 TFLOP/s at 2k-16k (gluon-check-h200-20261130-f.json); d64: within +-1% of the portable
# kernel, not dispatched; d256 causal (K freed early: a check with joint release ran out of its
# phase's time, undecided whether it hangs; the shipped form did the same in a 100 s phase and then
# passed 12/12 in 280 s, each new specialization compiling for 25-29 s:
# gluon-check-h200-20261130-fp8-d256c.json): 1.04-1.23x the portable kernel at 2k-16k as shuffled
# medians in two runs (gluon-ab-d256-h200-20261130-a/-b.json; a single pass, -fp8-g, had it -3-5%
# from 8k).
FP8_DISPATCH = frozenset({(128, False), (128, True), (256, False), (256, True)})
# Sliding windows: the head dims forward.gluon_applies hands to the kernel (forward.GLUON_WINDOW_MIN_KEYS;
# d64's 192-row blocks ran 0.51-0.90x the portable kernel at windows of 128-2048 keys).
WINDOW_HEAD_DIMS = (128, 256)
FP8_HEAD_DIMS = tuple(sorted({d for d, _ in FP8_DISPATCH}))
# Attention sinks in the plain and packed launches' epilogue (plain_forward, packed_forward,
# gluon_varlen_forward, gluon_attention_forward, and fp8_forward for e4m3), instead of a pass over the output
# (kernels/sinks.py). H200, gpt-oss's 64/8 heads d64 (sinks-cost-h200-20261205-e4m3-chunked): within
# 0.1-2.7% of the call without sinks where the pass cost 3-33% (prefill 1.001x against 1.063x, packed
# 1.004x / 1.117x, e4m3 prefill 0.997x / 1.110x, the KV-cache call's chunked prefill 1.006x / 1.326x;
# 16-key pools 1.18x / 1.22x); float64 checks, compute-sanitizer and the GPU fuzzer clean.
# FLASHTILE_GLUON_SINKS=0 turns it off.
SINKS_IN_EPILOGUE = os.environ.get("FLASHTILE_GLUON_SINKS", "1") not in ("", "0")
# flash_attn's ``softcap`` (Gemma 2) in the kernel's softmax, for 16-bit plain calls and packed
# sequences, contiguous (sliding windows included) or on page pools (plain_forward, packed_forward,
# gluon_attention_forward, gluon_varlen_forward); other softcapped calls (e4m3, the KV-cache call's
# chunked prefill) run the portable kernel. H200, Gemma 2's shapes (softcap-check-h200-20261205):
# 1.17-1.40x the portable kernel, 0.63-0.86x the same call without a softcap; 17 float64 checks,
# compute-sanitizer and the GPU fuzzer clean. FLASHTILE_GLUON_SOFTCAP=0 turns it off.
SOFTCAP_IN_KERNEL = os.environ.get("FLASHTILE_GLUON_SOFTCAP", "1") not in ("", "0")

# What ships: the default schedule at every head dim, dtype and mask (what gluon_attention_forward
# runs), then the alternates. The compile test covers all of them.
GLUON_VARIANTS = ([default_variant(d, dt, c) for d in (64, 128, 256) for dt in ("bf16", "fp16")
                   for c in (False, True)]
                  + [alt for d in (128, 64, 256) for c in (False, True) for alt in _alternates(d, c)]
                  + [default_variant(d, "fp8", c) for d in (128, 256, 64) for c in (False, True)]
                  + [dataclasses.replace(default_variant(128, "fp8", False), exp2_poly=0, **change)
                     for change in (
                      {"block_n": 128, "stages": 2, "p_slots": 2},
                      {"block_n": 128, "stages": 3, "p_slots": 2, "pingpong": True},
                      {"block_n": 128, "stages": 3, "p_in_registers": True})]
                  + [dataclasses.replace(default_variant(128, "fp8", True), joint_release=False, exp2_poly=0,
                                         **change)
                     for change in ({}, {"stages": 2}, {"pingpong": True}, {"p_in_registers": True})]
                  # persistent CTAs loading the next work tile's Q during the current one (the causal
                  # ones, within noise in gluon-ab-h200-20261130.json, were dropped with the snake order)
                  + [dataclasses.replace(default_variant(128, "fp8", False), persistent=True,
                                         prefetch_q=True, exp2_poly=0)]
                  + [dataclasses.replace(_two_consumers(default_variant(64, "bf16", c)), persistent=True,
                                         prefetch_q=True) for c in (False, True)]
                  # causal work tiles dealt in sorted order (the order before the snake)
                  + [dataclasses.replace(default_variant(d, "bf16", True), snake=False, prefetch_q=False)
                     for d in (128, 64, 256)]
                  # every consumer over the whole block's key range
                  + [dataclasses.replace(default_variant(64, "bf16", True), own_range=False,
                                         prefetch_q=False)]
                  # the d128 and d256 defaults without the lazy rescale (before 2026-11-30's A/B)
                  + [dataclasses.replace(default_variant(d, "bf16", c), lazy_rescale=False, max_stack=8)
                     for d in (128, 256) for c in (False, True)]
                  # the d128 e4m3 defaults with MUFU alone and with the other measured share on the FMA
                  # pipe (exp2_poly 1 / 2)
                  + [dataclasses.replace(default_variant(128, "fp8", c), exp2_poly=k)
                     for c in (False, True) for k in (0, 3 - default_variant(128, "fp8", c).exp2_poly)]
                  # 16-bit P converted by Triton (a PRMT per pair), the defaults before 2026-11-30
                  + [dataclasses.replace(default_variant(d, "bf16", c), p_pack_asm=False)
                     for d in (64, 128, 256) for c in (False, True)]
                  # d64 causal, consumers of rows past the query length running the whole range
                  + [dataclasses.replace(default_variant(64, "bf16", True), skip_empty_rows=False)]
                  # d64, three consumers: the other Q mode (non-causal: the next work tile's Q
                  # during this one, within 1% at 2k-16k; causal: without it, the default before)
                  + [dataclasses.replace(default_variant(64, "bf16", c), prefetch_q=not c)
                     for c in (False, True)]
                  # d256 with Q's first half as the register operand of S = Q K^T: dispatched
                  # non-causal up to Q_REGS_MAX_KEYS keys; causal, not dispatched
                  + [dispatch_variant(256, dt, False, 1) for dt in ("bf16", "fp16")]
                  + [dataclasses.replace(default_variant(256, "bf16", True), q_regs=128,
                                         max_stack=24)]
                  # keys per sequence from the device (chunked prefill against a KV cache): every
                  # 16-bit schedule a call may dispatch
                  + [with_seqused_k(dispatch_variant(d, dt, c, n)) for d in HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True)
                     for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))]
                  # ... on pools of pages that do not hold whole key tiles, each box size
                  + [with_page_boxes(dispatch_variant(d, dt, c, n), rows) for d in HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True)
                     for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))
                     for rows in PAGED_BOX_ROWS if rows < default_variant(d, dt, c).block_n]
                  # packed sequences (flash_attn_varlen_func): every schedule a call may dispatch
                  + [with_varlen(dispatch_variant(d, dt, c, n)) for d in HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True)
                     for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))]
                  + [with_varlen(default_variant(d, "fp8", c)) for d, c in sorted(FP8_DISPATCH)]
                  # ... on page pools (block_table): bf16 at every box size, fp16 (the same code but
                  # for the element type) where pages hold whole key tiles
                  + [varlen_paged_variant(d, dt, c, page) for d in HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True) for page in (256, *PAGED_BOX_ROWS)
                     if (page == 256 or (dt == "bf16" and page < default_variant(d, dt, c).block_n))]
                  # sliding windows: every schedule a windowed call may dispatch, plain or packed
                  + [with_window(dispatch_variant(d, dt, c, n)) for d in WINDOW_HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True)
                     for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))]
                  + [with_window(with_varlen(dispatch_variant(d, dt, c, 1))) for d in WINDOW_HEAD_DIMS
                     for dt in ("bf16", "fp16") for c in (False, True)]
                  # ... dealing out listed work tiles (packed sequences of different lengths): the
                  # persistent schedules above, bf16 (fp16 is the same code but for the element type)
                  + [with_work_list(v) for v in (
                      [with_varlen(dispatch_variant(d, "bf16", c, n)) for d in HEAD_DIMS for c in (False, True)
                       for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))]
                      + [with_varlen(default_variant(d, "fp8", c)) for d, c in sorted(FP8_DISPATCH)]
                      + [varlen_paged_variant(d, "bf16", c, page) for d in HEAD_DIMS for c in (False, True)
                         for page in (256, *PAGED_BOX_ROWS) if page == 256 or page < default_variant(d, "bf16", c).block_n]
                      + [with_window(with_varlen(dispatch_variant(d, "bf16", c, 1))) for d in WINDOW_HEAD_DIMS
                         for c in (False, True)])
                     if v.persistent]
                  # attention sinks in the epilogue (SINKS_IN_EPILOGUE): the plain and packed
                  # schedules a call may dispatch, bf16 (fp16 is the same code but for the element
                  # type) and e4m3
                  + [dataclasses.replace(v, sinks=True) for v in (
                      [dispatch_variant(d, "bf16", c, n) for d in HEAD_DIMS for c in (False, True)
                       for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))]
                      + [default_variant(d, "fp8", c) for d, c in sorted(FP8_DISPATCH)]
                      # ... chunked prefill against a KV cache (seqused_k), on page pools: whole key
                      # tiles and the smallest box
                      + [paged for d in HEAD_DIMS for c in (False, True)
                         for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))
                         for paged in (with_seqused_k(dispatch_variant(d, "bf16", c, n)),
                                       with_page_boxes(dispatch_variant(d, "bf16", c, n), min(PAGED_BOX_ROWS)))]
                      + [listed for d, c in sorted(FP8_DISPATCH)
                         for packed in [with_varlen(default_variant(d, "fp8", c))]
                         for listed in ((packed, with_work_list(packed)) if packed.persistent else (packed,))]
                      + [packed for d in HEAD_DIMS for c in (False, True)
                         for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))
                         for packed in (with_varlen(dispatch_variant(d, "bf16", c, n)),
                                        with_work_list(with_varlen(dispatch_variant(d, "bf16", c, n))))
                         if not packed.work_list or packed.persistent]
                      # ... on page pools (gluon_varlen_forward: vLLM's prefill; whole key tiles and
                      # the smallest box: the epilogue is the same code at every box size) and windowed
                      + [listed for d in HEAD_DIMS for c in (False, True) for page in (256, min(PAGED_BOX_ROWS))
                         for listed in (varlen_paged_variant(d, "bf16", c, page),
                                        with_work_list(varlen_paged_variant(d, "bf16", c, page)))
                         if not listed.work_list or listed.persistent]
                      + [listed for d in WINDOW_HEAD_DIMS for c in (False, True)  # (plain: gluon_attention_forward)
                         for listed in (with_window(with_varlen(dispatch_variant(d, "bf16", c, 1))),
                                        with_work_list(with_window(with_varlen(dispatch_variant(d, "bf16", c, 1)))),
                                        *{with_window(dispatch_variant(d, "bf16", c, n)): 0 for n in (1, 1 << 20)})
                         if not listed.work_list or listed.persistent])]
                  # the logit softcap (SOFTCAP_IN_KERNEL; the exp2 formula and tanh.approx): the plain and
                  # packed schedules a call may dispatch, bf16 (fp16 is the same code but for the element
                  # type), windowed (Gemma 2's local layers: a 4096-key window with the softcap), and
                  # packed on page pools (vLLM's prefill: whole key tiles and the smallest box)
                  + [with_softcap(v, approx) for approx in (False, True) for d in HEAD_DIMS for c in (False, True)
                     for n in ((1, 1 << 20) if (d, c) == (256, False) else (1,))
                     for plain in (dispatch_variant(d, "bf16", c, n),)
                     for v in (plain, with_varlen(plain), with_work_list(with_varlen(plain)),
                               *((with_window(plain), with_window(with_varlen(plain)),
                                  with_work_list(with_window(with_varlen(plain))))
                                 if d in WINDOW_HEAD_DIMS and n == 1 else ()),
                               *(paged for page in (256, min(PAGED_BOX_ROWS)) if n == 1
                                 for paged in (varlen_paged_variant(d, "bf16", c, page),
                                               with_work_list(varlen_paged_variant(d, "bf16", c, page)))))
                     if not v.work_list or v.persistent])


def variants_named(parts: list[str]) -> list[GluonVariant]:
    """The shipped variants whose name contains one of ``parts`` ("A$": ends in A, so that a
    default's name does not also pick its suffixed alternates); for the device scripts' --only.
    Variants taking ``seqused_k`` (which plain calls cannot run) only where a part names them."""
    return [v for v in GLUON_VARIANTS
            if any((v.name.endswith(part[:-1]) if part.endswith("$") else part in v.name)
                   and (not v.seqused_k or "seqk" in part) for part in parts)]


# Everything dispatch can run (gluon_check gives these its full case list).
DISPATCHED = frozenset([dispatch_variant(d, dt, c, n) for d in HEAD_DIMS for dt in ("bf16", "fp16")
                        for c in (False, True) for n in (1, 1 << 20)]
                       + [with_window(dispatch_variant(d, dt, c, n)) for d in WINDOW_HEAD_DIMS
                          for dt in ("bf16", "fp16") for c in (False, True) for n in (1, 1 << 20)]
                       + [default_variant(d, "fp8", c) for d, c in FP8_DISPATCH])


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------

if _GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(num_warps, instr_n, instr_k=16):
        # Accumulator of an M = 16 * num_warps wgmma: warps stacked along the rows (each warpgroup
        # owns 64 of them), instruction n = instr_n columns, k = 32 bytes (bf16/fp16: 16, e4m3: 32).
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, instr_n, instr_k])

    @gluon.jit
    def _tile_coords(tile_id, num_heads, num_m_blocks, num_bh, head_group, CAUSAL: gl.constexpr):
        """(query block, head, batch) of a linear work-tile id.

        Causal: (batch, head) pairs in groups of ``head_group``, one group after another; in a
        group the query blocks from the last (most keys) down, and the group's heads fastest.
        head_group >= num_bh: the query block is the slowest index, so the longest tiles start
        first and the short ones fill the end; head_group == 1: (batch, head)-major, so CTAs
        running at the same time share a few heads' K/V in L2. Not causal: the query block is
        the fastest index (same-head K/V in L2).
        """
        if CAUSAL:
            group_tiles = head_group * num_m_blocks
            group = tile_id // group_tiles
            within = tile_id - group * group_tiles
            size = gl.minimum(head_group, num_bh - group * head_group)
            pid_m = num_m_blocks - 1 - within // size
            rest = group * head_group + within % size
        else:
            pid_m = tile_id % num_m_blocks
            rest = tile_id // num_m_blocks
        return pid_m, rest % num_heads, rest // num_heads

    @gluon.jit
    def _work_tile_count(total, SNAKE: gl.constexpr):
        """How many work tiles this CTA takes: tiles are dealt in rows of one per CTA (grid =
        num_programs), every row in order or, with ``SNAKE``, every odd row in reverse; only the
        last row can be short."""
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        rows = total // grid
        position = pid
        if SNAKE:
            position = pid + (rows & 1) * (grid - 1 - 2 * pid)
        return rows + (position < total % grid).to(gl.int32)

    @gluon.jit
    def _work_tile(k, SNAKE: gl.constexpr):
        """The id of this CTA's k-th work tile (see _work_tile_count)."""
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        if SNAKE:
            return k * grid + pid + (k & 1) * (grid - 1 - 2 * pid)
        else:
            return k * grid + pid

    @gluon.jit
    def _work_total(WorkList, num_m_blocks, num_bh, num_heads, WORK_LIST: gl.constexpr):
        """(work tiles, listed entries): every (query block, head, sequence), or WORK_LIST's
        entries (packed_work_list: their count first) times the heads."""
        if WORK_LIST:
            entries = gl.load(WorkList)
            return entries * num_heads, entries
        else:
            return num_m_blocks * num_bh, 0

    @gluon.jit
    def _listed_entry(tile_id, entries, num_heads, CAUSAL: gl.constexpr):
        """(entry, head) of a listed work tile: the heads fastest (causal: the list runs from the
        last query blocks down, as _tile_coords' one group does) or slowest (not causal: a head's
        blocks one after another, sharing its K/V in L2)."""
        if CAUSAL:
            entry = tile_id // num_heads
            return entry, tile_id - entry * num_heads
        else:
            head = tile_id // entries
            return tile_id - head * entries, head

    @gluon.jit
    def _listed_code(tile_id, WorkList, entries, num_heads, CAUSAL: gl.constexpr):
        """The list's entry of work tile ``tile_id`` (query block x batch + sequence), loaded a tile
        ahead of its use so that its latency hides under the tile before; ids past the deal read
        an entry inside the list."""
        entry, _ = _listed_entry(tile_id, entries, num_heads, CAUSAL)
        return gl.load(WorkList + 1 + gl.maximum(gl.minimum(entry, entries - 1), 0))

    @gluon.jit
    def _listed_coords(tile_id, code, entries, num_heads, batch_size, CAUSAL: gl.constexpr):
        """(query block, head, batch) of listed work tile ``tile_id`` whose entry is ``code``."""
        _, head = _listed_entry(tile_id, entries, num_heads, CAUSAL)
        pid_m = code // batch_size
        return pid_m, head, code - pid_m * batch_size

    @gluon.jit
    def _dealt(k, code, WorkList, entries, num_heads, num_m_blocks, num_bh, batch_size, head_group,
               CAUSAL: gl.constexpr, SNAKE: gl.constexpr, WORK_LIST: gl.constexpr):
        """(query block, head, batch, next code) of this CTA's k-th work tile: with WORK_LIST from
        ``code``, its list entry loaded the tile before, and the next tile's entry loaded now (the
        partitions start from _listed_code(_work_tile(0)); else by _tile_coords, ``code`` passed on."""
        tile_id = _work_tile(k, SNAKE)
        if WORK_LIST:
            pid_m, head, batch = _listed_coords(tile_id, code, entries, num_heads, batch_size, CAUSAL)
            code = _listed_code(_work_tile(k + 1, SNAKE), WorkList, entries, num_heads, CAUSAL)
        else:
            pid_m, head, batch = _tile_coords(tile_id, num_heads, num_m_blocks, num_bh, head_group, CAUSAL)
        return pid_m, head, batch, code

    @gluon.jit
    def _first_code(WorkList, entries, num_heads, CAUSAL: gl.constexpr, SNAKE: gl.constexpr,
                    WORK_LIST: gl.constexpr):
        """_dealt's ``code`` for the first work tile (0 without a list)."""
        if WORK_LIST:
            return _listed_code(_work_tile(0, SNAKE), WorkList, entries, num_heads, CAUSAL)
        else:
            return gl.program_id(0) * 0

    @gluon.jit
    def _store_keyless(Out, Lse, stride_lb, stride_lh, batch, head, q_start, row0, seqlen_q, total_q,
                       num_heads, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Rows [row0, row0 + ROWS) of a packed sequence without keys: output 0 and LSE +inf (what
        _attend_block's one fully masked tile gives), stored without loading anything."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        keep = (rows < seqlen_q) & (q_start + rows >= 0) & (q_start + rows < total_q)
        o_ptrs = (Out + head.to(gl.int64) * HEAD_DIM
                  + gl.expand_dims((q_start + rows).to(gl.int64) * (num_heads * HEAD_DIM), 1)
                  + gl.expand_dims(cols, 0))
        gl.store(o_ptrs, gl.zeros([ROWS, HEAD_DIM], Out.dtype.element_ty, layout),
                 mask=gl.expand_dims(keep, 1))
        lse_ptrs = Lse + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + q_start + rows
        gl.store(lse_ptrs, gl.full([ROWS], float("inf"), gl.float32, gl.SliceLayout(1, layout)), mask=keep)

    @gluon.jit
    def _key_range(m0, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr):
        """Key tiles the rows [m0, m0 + BLOCK_M) see: (num_tiles, num_full); the first num_full need
        no mask (every row sees every key of them). At least one tile, so that rows seeing no key
        still go through one (fully masked) softmax step."""
        diag = seqlen_k - seqlen_q
        if CAUSAL:
            key_end = gl.minimum(seqlen_k, m0 + BLOCK_M + diag)
            num_full = gl.minimum(seqlen_k // BLOCK_N, gl.maximum(m0 + diag + 1, 0) // BLOCK_N)
        else:
            key_end = seqlen_k
            num_full = seqlen_k // BLOCK_N
        num_tiles = gl.maximum((key_end + BLOCK_N - 1) // BLOCK_N, 1)
        return num_tiles, gl.minimum(num_full, num_tiles)

    @gluon.jit
    def _tile_span(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
        """Key tiles the rows [m0, m0 + BLOCK_M) see: (first, num_tiles, num_left, num_full), tiles
        first + j for j in [0, num_tiles), of which j in [num_left, num_full) need no mask; j = 0,
        j in [1, num_left) (the window's left edge) and j in [num_full, num_tiles) (its right edge or
        the diagonal, the keys' end) do. Without WINDOW: _key_range's tiles from 0 (num_left 1).
        WINDOW: row i sees keys [i + diag - window_left, i + diag + window_right] (a side without a
        bound passes a number past any sequence); at least one tile, inside the keys."""
        if WINDOW:
            diag = seqlen_k - seqlen_q
            first_key = gl.minimum(gl.maximum(m0 + diag - window_left, 0), gl.maximum(seqlen_k - 1, 0))
            key_end = gl.minimum(seqlen_k, gl.maximum(m0 + BLOCK_M + diag + window_right, 0))
            first = first_key // BLOCK_N
            num_tiles = gl.maximum((key_end + BLOCK_N - 1) // BLOCK_N - first, 1)
            # keys every row of the block sees: from the last row's left edge to the first row's right
            full_start = gl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
            full_end = gl.minimum(seqlen_k, gl.maximum(m0 + diag + window_right + 1, 0))
            num_left = gl.minimum(gl.maximum((full_start + BLOCK_N - 1) // BLOCK_N - first, 1), num_tiles)
            num_full = gl.minimum(gl.maximum(full_end // BLOCK_N - first, num_left), num_tiles)
            return first, num_tiles, num_left, num_full
        else:
            num_tiles, num_full = _key_range(m0, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
            return 0, num_tiles, 1, num_full

    @gluon.jit
    def _keys_of(SeqlensK, batch, seqlen_k, SEQUSED_K: gl.constexpr):
        """Keys sequence ``batch`` attends to: seqused_k[batch] clamped to [0, seqlen_k] (the
        cache's capacity), or seqlen_k itself."""
        if SEQUSED_K:
            return gl.minimum(gl.maximum(gl.load(SeqlensK + batch), 0), seqlen_k)
        else:
            return seqlen_k

    @gluon.jit
    def _packed_keys(CuSeqlensK, batch, seqlen_k):
        """Keys of packed sequence ``batch`` on a page pool: its cu_seqlens_k length clamped to
        [0, seqlen_k] (the capacity its table row gives)."""
        keys = gl.load(CuSeqlensK + batch + 1) - gl.load(CuSeqlensK + batch)
        return gl.minimum(gl.maximum(keys, 0), seqlen_k)

    @gluon.jit
    def _sequence(CuSeqlensQ, SeqlensK, batch, seqlen_q, seqlen_k, total_k, SEQUSED_K: gl.constexpr,
                  VARLEN: gl.constexpr):
        """(first query row, queries, first key row, keys) of sequence ``batch``: packed sequences
        (VARLEN) by their offsets, CuSeqlensQ and SeqlensK (cu_seqlens_k then), else the rows of
        batch entry ``batch`` (_keys_of). The key span is clamped into the ``total_k`` packed keys,
        so that offsets nobody checked (CUDA-graph capture, torch.compile) cannot make a key loop
        run past them; queries only bound rows the work tiles cover already."""
        if VARLEN:
            q_start = gl.load(CuSeqlensQ + batch)
            queries = gl.load(CuSeqlensQ + batch + 1) - q_start
            if SEQUSED_K:  # page pools: the sequence's keys from slot 0 of its first page
                return q_start, queries, 0, _packed_keys(SeqlensK, batch, seqlen_k)
            k_start = gl.minimum(gl.maximum(gl.load(SeqlensK + batch), 0), total_k)
            k_end = gl.minimum(gl.maximum(gl.load(SeqlensK + batch + 1), k_start), total_k)
            return q_start, queries, k_start, k_end - k_start
        else:
            return 0, seqlen_q, 0, _keys_of(SeqlensK, batch, seqlen_k, SEQUSED_K)

    @gluon.jit
    def _sequence_start(CuSeqlensQ, batch, total_q, VARLEN: gl.constexpr):
        """The first query row of packed sequence ``batch`` (0 without VARLEN), clamped into the
        ``total_q`` packed rows: a TMA box at a negative row is an illegal instruction (H200,
        varlen-bounds-h200-20261202-before.log), and offsets nobody checked may hold anything."""
        if VARLEN:
            return gl.minimum(gl.maximum(gl.load(CuSeqlensQ + batch), 0), total_q)
        else:
            return 0

    @gluon.jit
    def _batch_coord(batch, VARLEN: gl.constexpr):
        """The descriptors' batch coordinate: packed sequences are one batch entry."""
        if VARLEN:
            return 0
        else:
            return batch

    @gluon.jit
    def _zero_v_tail(v_buf, tile, seqlen_k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Key tile ``tile`` reaching past the sequence's keys (a cache's slots hold anything
        there, NaN included): zero those V rows where the P V wgmma reads them, a few rows at a
        time (a whole tile in registers would spill beside O). Every consumer of the slot writes
        the same values, so concurrent rewrites change nothing another reads."""
        if tile * BLOCK_N + BLOCK_N > seqlen_k:
            # One 16-byte vector a thread per chunk: the fewest registers.
            NUM_WARPS: gl.constexpr = gl.num_warps()
            COL_THREADS: gl.constexpr = HEAD_DIM // 8 if HEAD_DIM < 256 else 32
            ROW_THREADS: gl.constexpr = 32 // COL_THREADS
            # (slices of the swizzled tile start at multiples of its 8-row period)
            CHUNK: gl.constexpr = 8 if ROW_THREADS * NUM_WARPS < 8 else ROW_THREADS * NUM_WARPS
            io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [ROW_THREADS, COL_THREADS],
                                                       [NUM_WARPS, 1], [1, 0])
            v_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, io_layout))
            v_tile = v_buf.reshape([BLOCK_N, HEAD_DIM])
            for c in gl.static_range(BLOCK_N // CHUNK):
                first = tile * BLOCK_N + c * CHUNK
                if first + CHUNK > seqlen_k:
                    part = v_tile.slice(c * CHUNK, CHUNK, dim=0)
                    v = part.load(io_layout)
                    keep = gl.expand_dims(first + v_rows < seqlen_k, 1)
                    part.store(gl.where(keep, v, gl.zeros_like(v)))
            fence_async_shared()
            gl.thread_barrier()

    @gluon.jit
    def _issue_box_load(desc, bufs, ready, empty, coords, ring, STAGES: gl.constexpr, pred=True,
                        WAIT: gl.constexpr = True):
        """Wait until ring slot ``ring % STAGES`` is free, then TMA the box at ``coords`` into it.

        ``ring`` counts every tile that went through the ring (across work tiles when persistent).
        Empty barriers start in phase 0: waiting for parity 1 passes at once, so the first lap
        over the ring needs no consumer arrival. Rows past the tensor's end fill zeros.
        ``WAIT=False``: the caller has waited for the slot already (K and V slots freed together).
        """
        slot = ring % STAGES
        phase = (ring // STAGES) & 1
        if WAIT:
            mbarrier.wait(empty.index(slot), phase ^ 1, pred=pred)
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, coords, ready.index(slot), bufs.index(slot), pred=pred)

    @gluon.jit
    def _issue_tile_load(desc, bufs, ready, empty, batch, kv_head, tile, ring,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred,
                         TRANSPOSED: gl.constexpr = False, WAIT: gl.constexpr = True, key0=0):
        """_issue_box_load of key tile ``tile`` of (batch, kv_head), whose keys start at row
        ``key0`` (a packed sequence's offset). ``TRANSPOSED``: the descriptor is over (B, Hk, D, Sk)
        (e4m3 V^T, keys contiguous)."""
        if TRANSPOSED:
            _issue_box_load(desc, bufs, ready, empty, [batch, kv_head, 0, key0 + tile * BLOCK_N], ring,
                            STAGES, pred, WAIT)
        else:
            _issue_box_load(desc, bufs, ready, empty, [batch, key0 + tile * BLOCK_N, kv_head, 0], ring,
                            STAGES, pred, WAIT)

    @gluon.jit
    def _tile_pages(BlockTable, batch, stride_bt, page_size, seqlen_k, tile, BLOCK_N: gl.constexpr,
                    PAGE_ROWS: gl.constexpr):
        """Pages of key tile ``tile``'s BLOCK_N / PAGE_ROWS boxes, box i's in lane i of the (one
        warp) producer: one load a tile, one register a lane, for both K and V. Boxes past the
        sequence's last table entry take that entry's page (rows past the sequence are masked,
        V's zeroed, by the consumers)."""
        BOXES: gl.constexpr = BLOCK_N // PAGE_ROWS
        box = gl.arange(0, BOXES, layout=gl.BlockedLayout([1], [32], [1], [0]))
        table = BlockTable + batch.to(gl.int64) * stride_bt
        last = seqlen_k // page_size - 1
        return gl.load(table + gl.minimum((tile * BLOCK_N + box * PAGE_ROWS) // page_size, last))

    @gluon.jit
    def _issue_page_boxes(desc, bufs, ready, empty, pages, page_size, kv_head, tile, ring,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_ROWS: gl.constexpr):
        """Key tile ``tile`` of a sequence on a page pool, as BLOCK_N / PAGE_ROWS boxes each at its
        page (``pages``, from _tile_pages; page_size a multiple of PAGE_ROWS) into their rows of
        the ring slot."""
        slot = ring % STAGES
        mbarrier.wait(empty.index(slot), ((ring // STAGES) & 1) ^ 1)
        BOXES: gl.constexpr = BLOCK_N // PAGE_ROWS
        mbarrier.expect(ready.index(slot), BOXES * desc.block_type.nbytes)
        box = gl.arange(0, BOXES, layout=pages.type.layout)
        for i in gl.static_range(BOXES):
            key = tile * BLOCK_N + i * PAGE_ROWS
            page = gl.sum(gl.where(box == i, pages, 0), 0)  # lane i's entry, by three shuffles
            tma.async_copy_global_to_shared(desc, [page, key % page_size, kv_head, 0], ready.index(slot),
                                            bufs.index(slot).slice(i * PAGE_ROWS, PAGE_ROWS, dim=1))

    @gluon.jit
    def _producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                  seqlen_q, seqlen_k, group_size, num_heads, num_m_blocks, batch_size, head_group,
                  SeqlensK, BlockTable, page_size, stride_bt, CuSeqlensQ,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, FP8: gl.constexpr, JOINT: gl.constexpr, SNAKE: gl.constexpr,
                  SEQUSED_K: gl.constexpr = False, PAGE_ROWS: gl.constexpr = 0,
                  VARLEN: gl.constexpr = False, window_left=0, window_right=0,
                  WINDOW: gl.constexpr = False, WorkList=None, WORK_LIST: gl.constexpr = False):
        """The 1-warp load partition: K_j then V_j for every key tile of every work tile, at most
        STAGES tiles ahead of the consumers (so the next work tile's first tiles load while the
        consumers finish the current one). ``JOINT``: consumers free a slot's K and V together
        (on v_empty, once P V of the tile has retired), one barrier round per tile instead of two.
        ``SEQUSED_K`` with ``page_size`` > 0: k/v descriptors are over page pools (num_pages,
        page_size, Hk, D), page_size a multiple of BLOCK_N, and a tile's page is the sequence's
        BlockTable entry (row stride ``stride_bt``); with PAGE_ROWS, page_size a multiple of it
        and a tile one box of PAGE_ROWS keys per page piece (_issue_page_boxes). ``VARLEN``: packed
        sequences (see _sequence); work tiles past a sequence's queries load nothing, nor (WORK_LIST)
        those of a sequence without keys."""
        num_bh = num_heads * batch_size
        ring = 0
        total, entries = _work_total(WorkList, num_m_blocks, num_bh, num_heads, WORK_LIST)
        code = _first_code(WorkList, entries, num_heads, CAUSAL, SNAKE, WORK_LIST)
        for k in range(_work_tile_count(total, SNAKE)):
            pid_m, head, batch, code = _dealt(k, code, WorkList, entries, num_heads, num_m_blocks, num_bh,
                                              batch_size, head_group, CAUSAL, SNAKE, WORK_LIST)
            kv_head = head // group_size
            _, queries, key0, keys = _sequence(CuSeqlensQ, SeqlensK, batch, seqlen_q, seqlen_k,
                                               k_desc.shape[1], SEQUSED_K, VARLEN)
            first, num_tiles, _, _ = _tile_span(pid_m * BLOCK_M, queries, keys, window_left, window_right,
                                                BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
            if VARLEN:
                num_tiles = num_tiles * (pid_m * BLOCK_M < queries).to(gl.int32)
                if WORK_LIST:
                    num_tiles = num_tiles * (keys > 0).to(gl.int32)
            coord = _batch_coord(batch, VARLEN)
            v_key0 = key0
            if VARLEN:
                if FP8:  # packed V^T: sequence b from column 16 * ceil(start / 16) + 16 * b, since
                    # TMA takes innermost coordinates at 16-byte multiples only (illegal instruction)
                    v_key0 = (key0 + 15) // 16 * 16 + 16 * batch
            if PAGE_ROWS > 0:
                pages = _tile_pages(BlockTable, batch, stride_bt, page_size, seqlen_k, 0, BLOCK_N,
                                    PAGE_ROWS)
            for j in range(num_tiles):
                if PAGE_ROWS > 0:
                    # the next tile's pages load while this one's slots are waited for
                    pages_next = _tile_pages(BlockTable, batch, stride_bt, page_size, seqlen_k, j + 1,
                                             BLOCK_N, PAGE_ROWS)
                    _issue_page_boxes(k_desc, k_bufs, k_ready, v_empty if JOINT else k_empty, pages,
                                      page_size, kv_head, j, ring + j, BLOCK_N, STAGES, PAGE_ROWS)
                    _issue_page_boxes(v_desc, v_bufs, v_ready, v_empty, pages, page_size, kv_head, j,
                                      ring + j, BLOCK_N, STAGES, PAGE_ROWS)
                    pages = pages_next
                elif SEQUSED_K:  # 16-bit only
                    first = batch
                    row = j * BLOCK_N
                    if page_size > 0:
                        first = gl.load(BlockTable + batch.to(gl.int64) * stride_bt + row // page_size)
                        row = row % page_size
                    _issue_box_load(k_desc, k_bufs, k_ready, v_empty if JOINT else k_empty,
                                    [first, row, kv_head, 0], ring + j, STAGES)
                    _issue_box_load(v_desc, v_bufs, v_ready, v_empty, [first, row, kv_head, 0], ring + j,
                                    STAGES)
                elif JOINT:
                    _issue_tile_load(k_desc, k_bufs, k_ready, v_empty, coord, kv_head, first + j, ring + j,
                                     BLOCK_N, STAGES, True, False, True, key0)
                    _issue_tile_load(v_desc, v_bufs, v_ready, v_empty, coord, kv_head, first + j, ring + j,
                                     BLOCK_N, STAGES, True, FP8, False, v_key0)
                else:
                    _issue_tile_load(k_desc, k_bufs, k_ready, k_empty, coord, kv_head, first + j, ring + j,
                                     BLOCK_N, STAGES, True, False, True, key0)
                    _issue_tile_load(v_desc, v_bufs, v_ready, v_empty, coord, kv_head, first + j, ring + j,
                                     BLOCK_N, STAGES, True, FP8, True, v_key0)
            ring += num_tiles

    @gluon.jit
    def _take_turn(turn_bars, event, WG: gl.constexpr, PINGPONG: gl.constexpr):
        # Ping-pong: warpgroup 0 issues the wgmmas of its event e after warpgroup 1 issued those of
        # event e - 1, warpgroup 1 after warpgroup 0 issued event e. Warpgroup 0's first wait (parity
        # 1 on a fresh barrier) passes at once. Both count events alike (one per key tile and one
        # for the last P V of each work tile), so the turns never drift apart.
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn_bars.index(0), (event & 1) ^ 1)
            else:
                mbarrier.wait(turn_bars.index(1), event & 1)

    @gluon.jit
    def _pass_turn(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - WG))

    @gluon.jit
    def _tile_scales(k_scales, v_scales, j, scale_shift_k, qk_scale,
                     BLOCK_N: gl.constexpr, FP8: gl.constexpr):
        """(score scale, V's relative descale) of key tile j: e4m3 tiles carry K's descale into the
        score scale (the query block's is in qk_scale already) and V's relative one into P."""
        if FP8:
            blk = (j * BLOCK_N) >> scale_shift_k
            return qk_scale * gl.load(k_scales + blk), gl.load(v_scales + blk)
        else:
            return qk_scale, 1.0

    _EXP2_ASM = tuple(exp2_ptx(8, poly) for poly in range(9))

    @gluon.constexpr_function
    def _exp2_asm(poly):
        return _EXP2_ASM[poly]

    @gluon.jit
    def _exp2(x, POLY: gl.constexpr):
        """2^x; POLY of every 8 per thread by the FMA-pipe polynomial (see exp2_ptx), only where x
        is finite (unmasked tiles: a masked score's -inf needs MUFU's exact 0)."""
        if POLY == 0:
            return gl.exp2(x)
        else:
            return gl.inline_asm_elementwise(_exp2_asm(POLY), "=f," * 8 + "f," * 7 + "f", [x],
                                             dtype=gl.float32, is_pure=True, pack=8)

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, rows_pos, cols, n0, seqlen_k, qk_scale, v_rel,
                      MASKED: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr,
                      LAZY: gl.constexpr = False, EXP_POLY: gl.constexpr = 0, window_left=0,
                      window_right=0, WINDOW: gl.constexpr = False, softcap_in=0.0,
                      SOFTCAP: gl.constexpr = False):
        """Online-softmax step on a fp32 score tile; returns (p, m_new, l_new, alpha).

        m is kept in log2 units of the scaled score. Its floor is finite (-1e30), so a row with no
        visible key so far gets alpha = 1 and p = exp2(-inf) = 0 rather than NaN.
        FP8: p comes out times V's relative descale ``v_rel`` (in (0, 256], so P still fits e4m3), by
        shifting the exponent; the running sum takes p without it.
        LAZY: each row's m is a reference that moves only when the row's max exceeds it by more
        than RESCALE_THRESHOLD (p stays below 2^RESCALE_THRESHOLD); alpha is exactly 1 where it
        did not move. A decision per row needs no exchange between the warps here, on the
        softmax's path; the caller asks once per tile whether any row moved.
        SOFTCAP (16-bit): the score is softcap * tanh(scale * s / softcap), ``softcap_in`` = scale /
        softcap and ``qk_scale`` = softcap * log2(e), as the portable kernel computes it.
        """
        if SOFTCAP == 2:  # (A/B: GluonVariant.softcap_approx)
            s = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * softcap_in],
                                          dtype=gl.float32, is_pure=True, pack=1)
        elif SOFTCAP:
            # tanh through exp2 (MUFU) and one reciprocal, the portable kernel's formula: saturates
            # to +-1 without NaN at either end
            s = 1.0 - 2.0 / (gl.exp2(s * (softcap_in * 2.8853900817779268)) + 1.0)
        if MASKED:
            keys = n0 + cols
            keep = gl.expand_dims(keys < seqlen_k, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows_pos, 1))
            if WINDOW:
                keep = (keep & (gl.expand_dims(keys, 0) >= gl.expand_dims(rows_pos - window_left, 1))
                        & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows_pos + window_right, 1)))
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if LAZY:
            m_new = gl.where(m_new - m_i > RESCALE_THRESHOLD, m_new, m_i)
        alpha = gl.exp2(m_i - m_new)
        if FP8:
            # One FMA per score (LLVM left this one as a multiply and a subtract).
            shift = gl.expand_dims(gl.log2(v_rel) - m_new, 1)
            p = _exp2(gl.fma(s, qk_scale, shift), 0 if MASKED else EXP_POLY)
            l_new = l_i * alpha + gl.sum(p, 1) * (1.0 / v_rel)
        else:
            p = _exp2(s * qk_scale - gl.expand_dims(m_new, 1), 0 if MASKED else EXP_POLY)
            l_new = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _v_operand(v_bufs, slot, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr):
        """V tile of a ring slot as the (keys, head dim) B operand of P V. e4m3 wgmma takes B
        K-major only: e4m3 V arrives as V^T (head dim, keys) and is read through its transpose."""
        if FP8:
            return v_bufs.index(slot).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
        else:
            return v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])

    @gluon.jit
    def _to_16bit(p, dtype: gl.constexpr, PACK: gl.constexpr):
        """fp32 P to the input dtype; PACK: one cvt per pair, element 0 in the low half (cvt puts
        its first source in the high half)."""
        if PACK and dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [p],
                                             dtype=gl.bfloat16, is_pure=True, pack=2)
        elif PACK and dtype == gl.float16:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [p],
                                             dtype=gl.float16, is_pure=True, pack=2)
        else:
            return p.to(dtype)

    @gluon.jit
    def _stage_p(p, p_op, p_bufs, j, WG: gl.constexpr, FP8: gl.constexpr):
        """P of key tile j as the A operand of its P V: 16-bit P stays in registers (returned in
        the operand layout); e4m3 P goes to this consumer's shared-memory slot j % 2 of p_bufs (the
        register-A wgmma's wait cannot keep 8-bit registers alive in Triton 3.6) and p_op is
        passed on unchanged."""
        if FP8 == 1 or FP8 == 3:
            SLOTS: gl.constexpr = 2 if FP8 == 1 else 1
            p_buf = p_bufs.index(SLOTS * WG + j % SLOTS).reshape(p.shape)
            p_buf.store(p)
            fence_async_shared()
            return p_op
        else:
            return gl.convert_layout(p, p_op.type.layout)

    @gluon.jit
    def _pv_wait(o_tok, p_op, v_tile, FP8: gl.constexpr):
        """Wait for the P V wgmma; returns O. e4m3 P in registers (FP8 == 2) cannot be a dependency
        of the wait in Triton 3.6 (its lowering takes no 8-bit registers): every later value is a
        new PTX register, and ptxas keeps a wgmma's register operands until its wait_group."""
        if FP8 == 2:
            o, _ = warpgroup_mma_wait(0, deps=(o_tok, v_tile))
        else:
            o, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op, v_tile))
        return o

    @gluon.jit
    def _p_operand(p_op, p_bufs, j, WG: gl.constexpr, FP8: gl.constexpr):
        """The A operand holding P of key tile j (see _stage_p)."""
        if FP8 == 1 or FP8 == 3:
            SLOTS: gl.constexpr = 2 if FP8 == 1 else 1
            return p_bufs.index(SLOTS * WG + j % SLOTS).reshape([p_bufs.shape[2], p_bufs.shape[3]])
        else:
            return p_op

    @gluon.jit
    def _scores_mma(q_tile, q_lo, k_tile, zero_s, Q_REGS: gl.constexpr):
        """Issue S = Q K^T: one wgmma from shared memory, or (Q_REGS > 0) the first Q_REGS columns
        from the register operand ``q_lo`` and the rest from shared memory, as two wgmmas that the
        caller waits for as one (both precede the P V it issues next)."""
        if Q_REGS > 0:
            HEAD_DIM: gl.constexpr = q_tile.shape[1]
            tok = warpgroup_mma(q_lo, k_tile.slice(0, Q_REGS, dim=1).permute((1, 0)), zero_s,
                                use_acc=False, is_async=True)
            tok = warpgroup_mma(q_tile.slice(Q_REGS, HEAD_DIM - Q_REGS, dim=1),
                                k_tile.slice(Q_REGS, HEAD_DIM - Q_REGS, dim=1).permute((1, 0)), tok,
                                is_async=True)
        else:
            tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return tok

    @gluon.jit
    def _kv_iteration(j, ring0, event0, q_tile, k_bufs, v_bufs, p_bufs, k_ready, v_ready, k_empty,
                      v_empty, turn_bars, k_desc, v_desc, batch, kv_head, num_tiles,
                      o, p_op, m_i, l_i, zero_s, rows_pos, cols, seqlen_k, qk_scale,
                      k_scales, v_scales, scale_shift_k,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                      CAUSAL: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                      LOADS: gl.constexpr, FP8: gl.constexpr, JOINT: gl.constexpr,
                      LAZY: gl.constexpr = False, EXP_POLY: gl.constexpr = 0,
                      P_PACK: gl.constexpr = True, q_lo=None, Q_REGS: gl.constexpr = 0,
                      first_tile=0, window_left=0, window_right=0, WINDOW: gl.constexpr = False,
                      softcap_in=0.0, SOFTCAP: gl.constexpr = False):
        """Key tile first_tile + j, j >= 1: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, the softmax
        of S_j while the second runs, then O rescaled to the new running max."""
        o_layout: gl.constexpr = o.type.layout
        HEAD_DIM: gl.constexpr = q_tile.shape[1]
        ring = ring0 + j
        slot = ring % STAGES
        prev = (ring - 1) % STAGES
        # e4m3: the tile's descales load now, under the two wgmmas.
        tile_scale, v_rel = _tile_scales(k_scales, v_scales, j, scale_shift_k, qk_scale, BLOCK_N, FP8)
        _take_turn(turn_bars, event0 + j, WG, PINGPONG)
        mbarrier.wait(k_ready.index(slot), (ring // STAGES) & 1)
        k_tile = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s_tok = _scores_mma(q_tile, q_lo, k_tile, zero_s, Q_REGS)
        mbarrier.wait(v_ready.index(prev), ((ring - 1) // STAGES) & 1)
        v_tile = _v_operand(v_bufs, prev, BLOCK_N, HEAD_DIM, FP8)
        p_prev = _p_operand(p_op, p_bufs, j - 1, WG, FP8)
        o_tok = warpgroup_mma(p_prev, v_tile, o, is_async=True)
        _pass_turn(turn_bars, WG, PINGPONG)
        # The older of the two groups (S_j) is done; P V keeps running through the softmax.
        if Q_REGS > 0:
            s, _, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_tile, q_lo))
        else:
            s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_tile, k_tile))
        if not JOINT:
            mbarrier.arrive(k_empty.index(slot))
        if LOADS:
            _issue_tile_load(k_desc, k_bufs, k_ready, k_empty, batch, kv_head, j + STAGES,
                             ring + STAGES, BLOCK_N, STAGES, j + STAGES < num_tiles)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, rows_pos, cols, (first_tile + j) * BLOCK_N,
                                           seqlen_k, tile_scale, v_rel, MASKED, CAUSAL, FP8, LAZY,
                                           EXP_POLY, window_left, window_right, WINDOW, softcap_in,
                                           SOFTCAP)
        if FP8 == 3:  # one P slot: P_j may overwrite it once P_{j-1} V has retired
            o = _pv_wait(o_tok, p_prev, v_tile, FP8)
            p_next = _stage_p(p.to(q_tile.dtype), p_op, p_bufs, j, WG, FP8)
        else:
            p_next = _stage_p(_to_16bit(p, q_tile.dtype, P_PACK), p_op, p_bufs, j, WG, FP8)
            if LAZY:  # whether any row's reference moved: warps exchange it while P V still runs
                rescale = gl.min(alpha, 0) < 1.0
            o = _pv_wait(o_tok, p_prev, v_tile, FP8)
        mbarrier.arrive(v_empty.index(prev))
        if LOADS:
            _issue_tile_load(v_desc, v_bufs, v_ready, v_empty, batch, kv_head, j - 1 + STAGES,
                             ring - 1 + STAGES, BLOCK_N, STAGES, j - 1 + STAGES < num_tiles, FP8)
        if LAZY:
            if rescale:
                o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        else:
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        return o, p_next, m_i, l_i

    @gluon.jit
    def _attend_block(q_desc, k_desc, v_desc, o_desc, q_smem, o_smem, p_bufs, q_bar, q_phase, k_bufs,
                      v_bufs,
                      k_ready, v_ready, k_empty, v_empty, turn_bars, Lse, stride_lb, stride_lh,
                      batch, head, kv_head, row0, seqlen_q, seqlen_k, num_tiles, num_full,
                      ring0, event0, qk_scale, q_scales, k_scales, v_scales, scale_shift_q,
                      scale_shift_k, v_max_index,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                      LOADS: gl.constexpr, FP8: gl.constexpr, JOINT: gl.constexpr,
                      Q_PREFETCHED: gl.constexpr = False, OWN_RANGE: gl.constexpr = False,
                      LAZY: gl.constexpr = False, EXP_POLY: gl.constexpr = 0,
                      P_PACK: gl.constexpr = True, Q_REGS: gl.constexpr = 0,
                      ZERO_TAIL: gl.constexpr = False, SeqlensK=None, CuSeqlensQ=None, Out=None,
                      num_heads=0, VARLEN: gl.constexpr = False, seqlen_cap=0, first_tile=0, num_left=1,
                      window_left=0, window_right=0, WINDOW: gl.constexpr = False, Sinks=None,
                      SINKS: gl.constexpr = False, softcap_in=0.0, SOFTCAP: gl.constexpr = False):
        """16 * num_warps query rows from ``row0`` of one (batch, head) against key tiles
        first_tile + j for j in [0, num_tiles), which sit at ring positions ring0 + j; writes their
        output and LSE. Tiles j in [num_left, num_full) need no mask (see _tile_span; WINDOW: the
        sliding window's sides, masked on the others).
        ``Q_PREFETCHED``: the caller has issued Q's load (on ``q_bar``) and waits for the output
        store itself. ``OWN_RANGE``: run only the key tiles these rows see (a causal block's first
        consumers see fewer than its last), then release the block's remaining tiles unread; 2:
        rows that all lie past the query length run tile 0 only.
        FP8: ``q_scales`` points at this (batch, head)'s query-block descales, ``k_scales`` and
        ``v_scales`` at its KV head's key-block ones (V's relative to their largest, which sits at
        ``v_max_index``); blocks are 2^scale_shift_q queries and 2^scale_shift_k keys.
        ``ZERO_TAIL``: V rows past ``seqlen_k`` in the last key tile are zeroed before P V (keys
        from a cache whose slots past the sequence hold anything); the count is read again from
        ``SeqlensK`` there rather than kept in a register through the loop (packed sequences on
        page pools: the cu_seqlens_k length clamped to ``seqlen_cap``).
        ``VARLEN``: the rows are packed sequence ``batch``'s, from row CuSeqlensQ[batch] of the
        (1, total, H, D) tensors (``seqlen_q``/``seqlen_k`` its lengths); a block reaching past the
        sequence's rows stores its output through ``Out`` (contiguous, ``num_heads`` heads) under a
        row mask instead of by TMA. The offset is read again for the epilogue rather than kept in a
        register through the key loop."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        ROWS: gl.constexpr = 16 * NUM_WARPS
        INSTR_K: gl.constexpr = 32 if FP8 else 16
        s_layout: gl.constexpr = _wgmma_layout(NUM_WARPS, BLOCK_N, INSTR_K)
        o_layout: gl.constexpr = _wgmma_layout(NUM_WARPS, HEAD_DIM, INSTR_K)
        # P as the register A operand of P @ V: 32 bits of k per register (two 16-bit values, four e4m3).
        K_WIDTH: gl.constexpr = 4 if FP8 else 2
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        coord = _batch_coord(batch, VARLEN)
        q_start = _sequence_start(CuSeqlensQ, batch, q_desc.shape[1], VARLEN)
        if not Q_PREFETCHED:
            mbarrier.expect(q_bar, q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [coord, q_start + row0, head, 0], q_bar, q_smem)
        if LOADS:  # fill the ring before waiting on anything
            for t in gl.static_range(STAGES):
                _issue_tile_load(k_desc, k_bufs, k_ready, k_empty, batch, kv_head, t, ring0 + t,
                                 BLOCK_N, STAGES, t < num_tiles)
                _issue_tile_load(v_desc, v_bufs, v_ready, v_empty, batch, kv_head, t, ring0 + t,
                                 BLOCK_N, STAGES, t < num_tiles, FP8)
        if FP8:  # the query block's descale joins the score scale
            qk_scale = qk_scale * gl.load(q_scales + (row0 >> scale_shift_q))
        tile_scale, v_rel = _tile_scales(k_scales, v_scales, 0, scale_shift_k, qk_scale, BLOCK_N, FP8)
        mbarrier.wait(q_bar, q_phase)
        q_tile = q_smem.reshape([ROWS, HEAD_DIM])
        if Q_REGS > 0:  # Q's first Q_REGS columns as a register operand, loaded once per block
            q_reg_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                             k_width=2)
            q_lo = q_tile.slice(0, Q_REGS, dim=1).load(q_reg_layout)
        else:
            q_lo = q_tile

        rows = row0 + gl.arange(0, ROWS, layout=row_layout)
        rows_pos = rows + (seqlen_k - seqlen_q)  # the key position each row is aligned with
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([ROWS], -1.0e30, gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

        # Key tile 0 on its own (it has no P V to overlap with); always masked, which also makes
        # rows that see no key at all (causal, Sq > Sk) come out with p = 0 everywhere. (Unmasked
        # where every row sees all of it: within noise at d64, gluon-ab-own2-h200-20261130.json.)
        slot = ring0 % STAGES
        _take_turn(turn_bars, event0, WG, PINGPONG)
        mbarrier.wait(k_ready.index(slot), (ring0 // STAGES) & 1)
        k_tile = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s_tok = _scores_mma(q_tile, q_lo, k_tile, zero_s, Q_REGS)
        _pass_turn(turn_bars, WG, PINGPONG)
        if Q_REGS > 0:
            s, _, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_tile, q_lo))
        else:
            s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_tile, k_tile))
        if not JOINT:
            mbarrier.arrive(k_empty.index(slot))
        if LOADS:
            _issue_tile_load(k_desc, k_bufs, k_ready, k_empty, batch, kv_head, STAGES,
                             ring0 + STAGES, BLOCK_N, STAGES, STAGES < num_tiles)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, rows_pos, cols, first_tile * BLOCK_N, seqlen_k,
                                           tile_scale, v_rel, True, CAUSAL, FP8, False, 0, window_left,
                                           window_right, WINDOW, softcap_in, SOFTCAP)
        if FP8 == 1 or FP8 == 3:  # p_op only rides along (P is in p_bufs)
            p_op = gl.zeros([ROWS], gl.float32, row_layout)
        else:
            p_op = gl.zeros([ROWS, BLOCK_N], q_tile.dtype, p_layout)
        if FP8:
            p_op = _stage_p(p.to(q_tile.dtype), p_op, p_bufs, 0, WG, FP8)
        else:
            p_op = _stage_p(_to_16bit(p, q_tile.dtype, P_PACK), p_op, p_bufs, 0, WG, FP8)

        block_tiles = num_tiles
        if OWN_RANGE:
            num_tiles, num_full = _key_range(row0, seqlen_q, seqlen_k, ROWS, BLOCK_N, CAUSAL)
            num_tiles = gl.minimum(num_tiles, block_tiles)
            if OWN_RANGE == 2:  # no row here exists: tile 0 (done above) only
                live = (row0 < seqlen_q).to(gl.int32)
                num_tiles = live * num_tiles + (1 - live)
                num_full = live * num_full
        if WINDOW:  # the window's left edge: masked
            for j in range(1, num_left):
                o, p_op, m_i, l_i = _kv_iteration(
                    j, ring0, event0, q_tile, k_bufs, v_bufs, p_bufs, k_ready, v_ready, k_empty, v_empty,
                    turn_bars, k_desc, v_desc, batch, kv_head, num_tiles, o, p_op, m_i, l_i, zero_s,
                    rows_pos, cols, seqlen_k, qk_scale, k_scales, v_scales, scale_shift_k, BLOCK_N,
                    STAGES, True, CAUSAL, WG, PINGPONG, LOADS, FP8, JOINT, LAZY, EXP_POLY, P_PACK,
                    q_lo, Q_REGS, first_tile, window_left, window_right, WINDOW, softcap_in, SOFTCAP)
        # Tiles every row sees in full: no mask. Then the diagonal / ragged tail, masked.
        for j in range(gl.maximum(num_left, 1), num_full):
            o, p_op, m_i, l_i = _kv_iteration(
                j, ring0, event0, q_tile, k_bufs, v_bufs, p_bufs, k_ready, v_ready, k_empty, v_empty,
                turn_bars, k_desc, v_desc, batch, kv_head, num_tiles, o, p_op, m_i, l_i, zero_s,
                rows_pos, cols, seqlen_k, qk_scale, k_scales, v_scales, scale_shift_k, BLOCK_N,
                STAGES, False, CAUSAL, WG, PINGPONG, LOADS, FP8, JOINT, LAZY, EXP_POLY, P_PACK,
                q_lo, Q_REGS, first_tile, window_left, window_right, WINDOW, softcap_in, SOFTCAP)
        for j in range(gl.maximum(gl.maximum(num_full, num_left), 1), num_tiles):
            o, p_op, m_i, l_i = _kv_iteration(
                j, ring0, event0, q_tile, k_bufs, v_bufs, p_bufs, k_ready, v_ready, k_empty, v_empty,
                turn_bars, k_desc, v_desc, batch, kv_head, num_tiles, o, p_op, m_i, l_i, zero_s,
                rows_pos, cols, seqlen_k, qk_scale, k_scales, v_scales, scale_shift_k, BLOCK_N,
                STAGES, True, CAUSAL, WG, PINGPONG, LOADS, FP8, JOINT, LAZY, EXP_POLY, P_PACK,
                q_lo, Q_REGS, first_tile, window_left, window_right, WINDOW, softcap_in, SOFTCAP)

        # The last P V.
        last = ring0 + num_tiles - 1
        slot = last % STAGES
        _take_turn(turn_bars, event0 + num_tiles, WG, PINGPONG)
        mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
        if ZERO_TAIL:  # the only tile that can reach past the sequence's keys
            if VARLEN:  # (boxes past a table's last page read that page again: clamped count)
                tail_keys = _packed_keys(SeqlensK, batch, seqlen_cap)
            else:  # (past the capacity the TMA filled zeros: the unclamped count is as good there)
                tail_keys = gl.maximum(gl.load(SeqlensK + batch), 0)
            _zero_v_tail(v_bufs.index(slot), num_tiles - 1, tail_keys, BLOCK_N, HEAD_DIM)
        v_tile = _v_operand(v_bufs, slot, BLOCK_N, HEAD_DIM, FP8)
        p_last = _p_operand(p_op, p_bufs, num_tiles - 1, WG, FP8)
        o_tok = warpgroup_mma(p_last, v_tile, o, is_async=True)
        _pass_turn(turn_bars, WG, PINGPONG)
        o = _pv_wait(o_tok, p_last, v_tile, FP8)
        mbarrier.arrive(v_empty.index(slot))
        if OWN_RANGE:
            # The block's tiles past these rows' diagonal: release each once it has landed (its
            # ready phase is the proof that the slot's previous occupant is released by everyone).
            for j in range(num_tiles, block_tiles):
                pos = ring0 + j
                mbarrier.wait(k_ready.index(pos % STAGES), (pos // STAGES) & 1)
                mbarrier.wait(v_ready.index(pos % STAGES), (pos // STAGES) & 1)
                if not JOINT:
                    mbarrier.arrive(k_empty.index(pos % STAGES))
                mbarrier.arrive(v_empty.index(pos % STAGES))

        # Normalize once; rows that saw no key: output 0 (o is 0 there) and LSE +inf.
        seen = l_i > 0.0
        if SINKS:  # the sink's column joins the sum (rows that saw no key keep output 0, LSE +inf)
            sink = gl.load(Sinks + head).to(gl.float32) * 1.4426950408889634
            m_new = gl.where(seen, gl.maximum(m_i, sink), m_i)
            alpha = gl.exp2(m_i - m_new)
            l_i = gl.where(seen, l_i * alpha + gl.exp2(gl.minimum(sink - m_new, 0.0)), l_i)
            m_i = m_new
        l_safe = gl.where(seen, l_i, 1.0)
        if FP8:  # P V summed V / V's largest descale
            inv_l = gl.load(v_scales + v_max_index) / l_safe
        else:
            inv_l = 1.0 / l_safe
        if SINKS:
            inv_l = inv_l * alpha
        o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * _LN2, float("inf"))

        # Stage O in shared memory and let TMA write it, clipped at the sequence end. Without FP8
        # o_smem is Q's tile, free now (its last reader, S of the last key tile, has retired). The
        # wait keeps the next work tile's Q load from overwriting the tile before the store read it.
        out_tile = o_smem.reshape([ROWS, HEAD_DIM])
        if Q_PREFETCHED and FP8:  # e4m3: one output buffer, the last work tile's store read it
            tma.store_wait(0)
        q_start = _sequence_start(CuSeqlensQ, batch, q_desc.shape[1], VARLEN)
        lse_keep = rows < seqlen_q
        if VARLEN:
            # Pointer stores stay within the (total_q) rows whatever the offsets hold (CUDA-graph
            # capture and torch.compile leave them unchecked); TMA clips its own past the end.
            total_q = q_desc.shape[1]
            lse_keep = lse_keep & (q_start + rows >= 0) & (q_start + rows < total_q)
            if row0 + ROWS <= seqlen_q:
                _store_out(o, out_tile, o_desc, o_smem, [coord, q_start + row0, head, 0])
            else:  # a box past the sequence's rows would overwrite the next sequence's output
                o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
                o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                o_ptrs = (Out + head.to(gl.int64) * HEAD_DIM
                          + gl.expand_dims((q_start + o_rows).to(gl.int64) * (num_heads * HEAD_DIM), 1)
                          + gl.expand_dims(o_cols, 0))
                o_keep = (o_rows < seqlen_q) & (q_start + o_rows >= 0) & (q_start + o_rows < total_q)
                gl.store(o_ptrs, o.to(o_desc.dtype), mask=gl.expand_dims(o_keep, 1))
        else:
            _store_out(o, out_tile, o_desc, o_smem, [batch, row0, head, 0])
        lse_ptrs = (Lse + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + q_start
                    + rows)
        gl.store(lse_ptrs, lse, mask=lse_keep)
        if not Q_PREFETCHED:
            tma.store_wait(0)

    @gluon.jit
    def _store_out(o, out_tile, o_desc, o_smem, coords):
        """Stage the output rows in shared memory and let TMA write them (clipped at the tensor's
        end)."""
        out_tile.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, coords, o_smem)

    @gluon.jit
    def _load_q(q_desc, q_buf, q_bar, tile_id, num_heads, num_m_blocks, num_bh, head_group,
                BLOCK_M: gl.constexpr, ROWS: gl.constexpr, WG: gl.constexpr, CAUSAL: gl.constexpr):
        """TMA this consumer's Q rows of work tile ``tile_id`` into ``q_buf``."""
        pid_m, head, batch = _tile_coords(tile_id, num_heads, num_m_blocks, num_bh, head_group, CAUSAL)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, pid_m * BLOCK_M + WG * ROWS, head, 0], q_bar,
                                        q_buf)

    @gluon.jit
    def _consumer(q_smem, o_smem, q_bars, shared,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                  PINGPONG: gl.constexpr, LOADS: gl.constexpr, FP8: gl.constexpr,
                  JOINT: gl.constexpr, Q_BUFS: gl.constexpr, SNAKE: gl.constexpr,
                  OWN_RANGE: gl.constexpr = False, LAZY: gl.constexpr = False,
                  EXP_POLY: gl.constexpr = 0, P_PACK: gl.constexpr = True,
                  Q_REGS: gl.constexpr = 0, SEQUSED_K: gl.constexpr = False,
                  VARLEN: gl.constexpr = False, WINDOW: gl.constexpr = False,
                  WORK_LIST: gl.constexpr = False, SINKS: gl.constexpr = False,
                  SOFTCAP: gl.constexpr = False):
        """A consumer partition: rows [WG * R, (WG + 1) * R) of every work tile this CTA takes, R =
        16 * num_warps (64 for a warpgroup under warp specialization, all 128 rows without).
        ``LOADS``: issue the K/V loads itself (no producer partition). ``shared``: the runtime
        arguments every consumer takes alike (see _attn_fwd_gluon). This consumer's Q buffers
        are q_smem[WG * Q_BUFS + b] with barriers q_bars[WG * Q_BUFS + b]; with Q_BUFS = 2 the next
        work tile's Q loads while this one runs (persistent CTAs), and the output is staged in the
        Q buffer it came from (16-bit) or in o_smem[WG] (e4m3)."""
        (q_desc, k_desc, v_desc, o_desc, p_bufs, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
         turn_bars, Lse, stride_lb, stride_lh, seqlen_q, seqlen_k, group_size, num_heads, num_m_blocks,
         batch_size, qk_scale, QScale, KScale, VScale, stride_qsb, stride_qsh, stride_ksb, stride_ksh,
         scale_shift_q, scale_shift_k, v_max_index, head_group, SeqlensK, CuSeqlensQ, Out, window_left,
         window_right, WorkList, Sinks, softcap_in) = shared
        ROWS: gl.constexpr = 16 * gl.num_warps()
        num_bh = num_heads * batch_size
        total, entries = _work_total(WorkList, num_m_blocks, num_bh, num_heads, WORK_LIST)
        count = _work_tile_count(total, SNAKE)
        code = _first_code(WorkList, entries, num_heads, CAUSAL, SNAKE, WORK_LIST)
        ring = 0
        event = 0
        live = 0
        if Q_BUFS == 2:  # the first work tile's Q now, every later one during the tile before it
            if count > 0:
                _load_q(q_desc, q_smem.index(WG * 2), q_bars.index(WG * 2), _work_tile(0, SNAKE),
                        num_heads, num_m_blocks, num_bh, head_group, BLOCK_M, ROWS, WG, CAUSAL)
        for t in range(count):  # t: work tiles done by this CTA before this one
            b = t % Q_BUFS
            if Q_BUFS == 2:
                if t + 1 < count:
                    # The other buffer staged the previous tile's output: its store must have read it.
                    tma.store_wait(0)
                    _load_q(q_desc, q_smem.index(WG * 2 + 1 - b), q_bars.index(WG * 2 + 1 - b),
                            _work_tile(t + 1, SNAKE), num_heads, num_m_blocks, num_bh, head_group,
                            BLOCK_M, ROWS, WG, CAUSAL)
            q_buf = q_smem.index(WG * Q_BUFS + b)
            if FP8:
                o_buf = o_smem.index(WG)
            else:
                o_buf = q_buf
            pid_m, head, batch, code = _dealt(t, code, WorkList, entries, num_heads, num_m_blocks, num_bh,
                                              batch_size, head_group, CAUSAL, SNAKE, WORK_LIST)
            kv_head = head // group_size
            m0 = pid_m * BLOCK_M
            _, queries, _, keys = _sequence(CuSeqlensQ, SeqlensK, batch, seqlen_q, seqlen_k,
                                            k_desc.shape[1], SEQUSED_K, VARLEN)
            first, num_tiles, num_left, num_full = _tile_span(m0, queries, keys, window_left, window_right,
                                                              BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
            q_scales = QScale + batch.to(gl.int64) * stride_qsb + head.to(gl.int64) * stride_qsh
            k_scales = KScale + batch.to(gl.int64) * stride_ksb + kv_head.to(gl.int64) * stride_ksh
            v_scales = VScale + batch.to(gl.int64) * stride_ksb + kv_head.to(gl.int64) * stride_ksh
            if VARLEN:
                # A query block past the sequence's rows: no loads (the producer skips it too), no
                # turns, nothing stored. Listed work has no such blocks; its blocks of sequences
                # without keys store their zeros at once (the producer loads nothing for them).
                run = m0 < queries
                if WORK_LIST:
                    if run & (keys == 0):
                        _store_keyless(Out, Lse, stride_lb, stride_lh, batch, head,
                                       _sequence_start(CuSeqlensQ, batch, q_desc.shape[1], VARLEN),
                                       m0 + WG * ROWS, queries, q_desc.shape[1], num_heads, ROWS, HEAD_DIM)
                    run = run & (keys > 0)
                if run:
                    _attend_block(q_desc, k_desc, v_desc, o_desc, q_buf, o_buf, p_bufs,
                                  q_bars.index(WG), live & 1, k_bufs,
                                  v_bufs, k_ready, v_ready, k_empty, v_empty, turn_bars, Lse, stride_lb,
                                  stride_lh, batch, head, kv_head, m0 + WG * ROWS, queries, keys,
                                  num_tiles, num_full, ring, event, qk_scale, q_scales, k_scales,
                                  v_scales, scale_shift_q, scale_shift_k, v_max_index, BLOCK_N,
                                  HEAD_DIM, STAGES, CAUSAL, WG, PINGPONG, LOADS, FP8, JOINT, False,
                                  OWN_RANGE, LAZY, EXP_POLY, P_PACK, Q_REGS, SEQUSED_K, SeqlensK,
                                  CuSeqlensQ, Out, num_heads, VARLEN, seqlen_k, first_tile=first,
                                  num_left=num_left, window_left=window_left,
                                  window_right=window_right, WINDOW=WINDOW, Sinks=Sinks, SINKS=SINKS,
                                  softcap_in=softcap_in, SOFTCAP=SOFTCAP)
                    ring += num_tiles
                    event += num_tiles + 1
                    live += 1  # Q loads so far: the parity of this consumer's Q barrier
            else:
                _attend_block(q_desc, k_desc, v_desc, o_desc, q_buf, o_buf, p_bufs,
                              q_bars.index(WG * Q_BUFS + b), (t // Q_BUFS) & 1, k_bufs,
                              v_bufs, k_ready, v_ready, k_empty, v_empty, turn_bars, Lse, stride_lb,
                              stride_lh, batch, head, kv_head, m0 + WG * ROWS, queries, keys,
                              num_tiles, num_full, ring, event, qk_scale, q_scales, k_scales, v_scales,
                              scale_shift_q, scale_shift_k, v_max_index, BLOCK_N, HEAD_DIM, STAGES,
                              CAUSAL, WG, PINGPONG, LOADS, FP8, JOINT, Q_BUFS == 2, OWN_RANGE, LAZY,
                              EXP_POLY, P_PACK, Q_REGS, SEQUSED_K, SeqlensK, first_tile=first,
                              num_left=num_left, window_left=window_left, window_right=window_right,
                              WINDOW=WINDOW, Sinks=Sinks, SINKS=SINKS, softcap_in=softcap_in,
                              SOFTCAP=SOFTCAP)
                ring += num_tiles
                event += num_tiles + 1
        if Q_BUFS == 2:
            tma.store_wait(0)

    # Integer arguments stay unspecialized (no divisibility or == 1 variants): one compile per
    # variant and dtype, which is also what compile_for_sm90 builds.
    @gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "seqlen_q", "seqlen_k", "group_size",
                                  "num_heads", "num_m_blocks", "batch_size", "stride_qsb",
                                  "stride_qsh", "stride_ksb", "stride_ksh", "scale_shift_q",
                                  "scale_shift_k", "v_max_index", "head_group", "page_size",
                                  "stride_bt", "window_left", "window_right"])
    def _attn_fwd_gluon(q_desc, k_desc, v_desc, o_desc, Lse, QScale, KScale, VScale, SeqlensK, BlockTable,
                        CuSeqlensQ, Out, WorkList, Sinks, stride_lb,
                        stride_lh, seqlen_q, seqlen_k, group_size, num_heads, num_m_blocks, batch_size,
                        qk_scale, stride_qsb, stride_qsh, stride_ksb, stride_ksh,
                        scale_shift_q, scale_shift_k, v_max_index, head_group, page_size, stride_bt,
                        window_left, window_right, softcap_in, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
                        PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, FP8: gl.constexpr,
                        JOINT_RELEASE: gl.constexpr, Q_BUFS: gl.constexpr = 1,
                        CONSUMERS: gl.constexpr = 2, SNAKE: gl.constexpr = False,
                        OWN_RANGE: gl.constexpr = False, LAZY_RESCALE: gl.constexpr = False,
                        EXP2_POLY: gl.constexpr = 0, P_PACK_ASM: gl.constexpr = True,
                        Q_REGS: gl.constexpr = 0, SEQUSED_K: gl.constexpr = False,
                        PAGE_ROWS: gl.constexpr = 0, VARLEN: gl.constexpr = False,
                        WINDOW: gl.constexpr = False, WORK_LIST: gl.constexpr = False,
                        SINKS: gl.constexpr = False, SOFTCAP: gl.constexpr = False):
        """Work tiles are (query block of BLOCK_M rows, head, batch), num_m_blocks * num_heads *
        batch_size of them, dealt to the CTAs in rows of one tile each (every other row reversed
        with ``SNAKE``): one tile per CTA when the grid covers them all, persistent when the grid
        is the SM count. ``head_group``: causal tiles' (batch, head) grouping (see _tile_coords).

        FP8: q, k e4m3 through their descriptors, v_desc over e4m3 V^T (B, Hk, D, Sk), o_desc
        bf16; per-block descales at QScale (B, H, query blocks) and KScale / VScale (B, Hk, key
        blocks + 1; V's relative to their largest, which follows them). Otherwise the scale
        arguments are unused. SEQUSED_K: sequence b attends to its first SeqlensK[b] keys (int32,
        clamped to seqlen_k, the caches' capacity); with page_size > 0 the caches are page pools
        read through BlockTable (see _producer). VARLEN: packed sequences, the descriptors over
        (1, total, H, D) tensors (e4m3 V^T (1, Hk, D, total)), SeqlensK and CuSeqlensQ the (B + 1)
        int32 offsets of the keys and queries, seqlen_q the longest sequence's queries; the last
        query block of each sequence stores through Out (contiguous (total_q, H, D)) and the LSE
        (H, total_q) takes stride_lb 0. WINDOW: query row i (key position i + seqlen_k - seqlen_q)
        sees keys [pos - window_left, pos + window_right] (see _tile_span). WORK_LIST (with VARLEN,
        persistent): the work tiles are the entries WorkList lists (packed_work_list), times the heads.
        SINKS: Sinks (H,) holds one more logit a query head (attention sinks), a column with no value
        that each row's sum and LSE count. SOFTCAP (16-bit): scores capped as softcap * tanh(scale * s /
        softcap), ``softcap_in`` = scale / softcap and ``qk_scale`` = softcap * log2(e)."""
        dtype: gl.constexpr = q_desc.dtype
        if PAGE_ROWS > 0:  # the descriptors' boxes are page pieces; a slot holds a whole key tile
            k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
        else:
            k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        NUM_CONSUMERS: gl.constexpr = CONSUMERS if WARP_SPECIALIZE else 1
        q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS * Q_BUFS] + q_desc.block_type.shape,
                                           q_desc.layout)
        ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
        if FP8:  # a bf16 output tile does not fit in e4m3 Q's place
            o_smem = gl.allocate_shared_memory(o_desc.dtype, [NUM_CONSUMERS] + o_desc.block_type.shape,
                                               o_desc.layout)
        else:
            o_smem = q_smem
        if FP8 == 1 or FP8 == 3:  # P goes through shared memory, two slots per consumer (3: one)
            P_SLOTS: gl.constexpr = 2 if FP8 == 1 else 1
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, ROWS, BLOCK_N], dtype)
            p_smem = gl.allocate_shared_memory(dtype, [P_SLOTS * NUM_CONSUMERS, 1, ROWS, BLOCK_N],
                                               p_layout)
        else:  # never used
            p_smem = q_smem
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS * Q_BUFS, 1],
                                           mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
            mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
        for i in gl.static_range(NUM_CONSUMERS * Q_BUFS):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn_bars.index(i), count=1)

        # Runtime arguments every consumer takes alike (constexprs stay separate: a tuple would
        # turn them into values).
        shared = (q_desc, k_desc, v_desc, o_desc, p_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                  v_empty, turn_bars, Lse, stride_lb, stride_lh, seqlen_q, seqlen_k, group_size,
                  num_heads, num_m_blocks, batch_size, qk_scale, QScale, KScale, VScale, stride_qsb,
                  stride_qsh, stride_ksb, stride_ksh, scale_shift_q, scale_shift_k, v_max_index,
                  head_group, SeqlensK, CuSeqlensQ, Out, window_left, window_right, WorkList, Sinks,
                  softcap_in)
        # Two partition lists, not one built up: a tuple holding a partition function does not
        # survive assignment in Gluon (it is not a value), so each list is written out whole.
        if WARP_SPECIALIZE and CONSUMERS == 3:
            FIRST3: gl.constexpr = 0
            SECOND3: gl.constexpr = 1
            THIRD3: gl.constexpr = 2
            NO_LOADS3: gl.constexpr = False
            NO_PINGPONG: gl.constexpr = False
            gl.warp_specialize([
                (_consumer, (q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                             CAUSAL, FIRST3, NO_PINGPONG, NO_LOADS3, FP8, JOINT_RELEASE, Q_BUFS, SNAKE,
                             OWN_RANGE, LAZY_RESCALE, EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, VARLEN,
                             WINDOW, WORK_LIST, SINKS, SOFTCAP)),
                (_consumer, (q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                             CAUSAL, SECOND3, NO_PINGPONG, NO_LOADS3, FP8, JOINT_RELEASE, Q_BUFS, SNAKE,
                             OWN_RANGE, LAZY_RESCALE, EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, VARLEN,
                             WINDOW, WORK_LIST, SINKS, SOFTCAP)),
                (_consumer, (q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                             CAUSAL, THIRD3, NO_PINGPONG, NO_LOADS3, FP8, JOINT_RELEASE, Q_BUFS, SNAKE,
                             OWN_RANGE, LAZY_RESCALE, EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, VARLEN,
                             WINDOW, WORK_LIST, SINKS, SOFTCAP)),
                (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                             seqlen_q, seqlen_k, group_size, num_heads, num_m_blocks, batch_size,
                             head_group, SeqlensK, BlockTable, page_size, stride_bt, CuSeqlensQ,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, FP8, JOINT_RELEASE, SNAKE, SEQUSED_K,
                             PAGE_ROWS, VARLEN, window_left, window_right, WINDOW, WorkList,
                             WORK_LIST)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        elif WARP_SPECIALIZE:
            # Partition arguments are flattened to IR values: plain Python literals cannot ride along.
            FIRST: gl.constexpr = 0
            SECOND: gl.constexpr = 1
            NO_LOADS: gl.constexpr = False
            gl.warp_specialize([
                (_consumer, (q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                             CAUSAL, FIRST, PINGPONG, NO_LOADS, FP8, JOINT_RELEASE, Q_BUFS, SNAKE,
                             OWN_RANGE, LAZY_RESCALE, EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, VARLEN,
                             WINDOW, WORK_LIST, SINKS, SOFTCAP)),
                (_consumer, (q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                             CAUSAL, SECOND, PINGPONG, NO_LOADS, FP8, JOINT_RELEASE, Q_BUFS, SNAKE,
                             OWN_RANGE, LAZY_RESCALE, EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, VARLEN,
                             WINDOW, WORK_LIST, SINKS, SOFTCAP)),
                (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                             seqlen_q, seqlen_k, group_size, num_heads, num_m_blocks, batch_size,
                             head_group, SeqlensK, BlockTable, page_size, stride_bt, CuSeqlensQ,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, FP8, JOINT_RELEASE, SNAKE, SEQUSED_K,
                             PAGE_ROWS, VARLEN, window_left, window_right, WINDOW, WorkList,
                             WORK_LIST)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            _consumer(q_smem, o_smem, q_bars, shared, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, 0,
                      False, True, FP8, False, Q_BUFS, SNAKE, OWN_RANGE, LAZY_RESCALE,
                      EXP2_POLY, P_PACK_ASM, Q_REGS, SEQUSED_K, SINKS=SINKS, SOFTCAP=SOFTCAP)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def _launch_shape(variant: GluonVariant) -> dict:
    """Warps and register limit of a launch. Warp specialized: 4 (consumer 0, the default
    partition) + 4 (consumer 1) + 1 (producer, a warpgroup of its own for register allocation)
    warps = 12 rounded; maxnreg 168 over 384 threads fills the 64K register file and the
    partitions' budgets redistribute it (240 + 240 + 24 per warpgroup at the default budget)."""
    if variant.warp_specialize:
        # 3 consumers: 4 + 4 + 4 + 1 warps = 16 rounded, maxnreg 128 over 512 threads; the two
        # worker consumers and the producer take theirs, the default partition the rest.
        warpgroups = variant.consumers + 1
        maxnreg = 65536 // (128 * warpgroups) // 8 * 8  # 168 for 2 consumers, 128 for 3
        total = maxnreg * warpgroups * 128
        default_regs = (total - 128 * variant.consumer_regs * (variant.consumers - 1) - 128 * 24) // 128
        if default_regs < variant.consumer_regs:
            raise ValueError(f"{variant.name}: register budget does not fit")
        return {"num_warps": 4, "maxnreg": maxnreg}
    return {"num_warps": 8}


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv"}


def _smem_layout(block_shape, torch_dtype):
    return gl.NVMMASharedLayout.get_default_for(block_shape, getattr(gl, _GL_DTYPES[torch_dtype]))


def _kernel_constexprs(variant: GluonVariant) -> dict:
    return {"BLOCK_M": variant.block_m, "BLOCK_N": variant.block_n, "HEAD_DIM": variant.head_dim,
            "STAGES": variant.stages, "CAUSAL": variant.causal,
            "WARP_SPECIALIZE": variant.warp_specialize,
            "PINGPONG": variant.pingpong and variant.warp_specialize,
            "CONSUMER_REGS": variant.consumer_regs,
            "FP8": (2 if variant.p_in_registers else 3 if variant.p_slots == 1 else 1) if variant.fp8 else 0,
            "JOINT_RELEASE": variant.joint_release and variant.warp_specialize,
            "Q_BUFS": 2 if variant.prefetch_q else 1, "CONSUMERS": variant.consumers,
            "SNAKE": variant.snake,
            "OWN_RANGE": (2 if variant.skip_empty_rows else 1) if variant.own_range else 0,
            "LAZY_RESCALE": variant.lazy_rescale, "EXP2_POLY": variant.exp2_poly,
            "P_PACK_ASM": variant.p_pack_asm, "Q_REGS": variant.q_regs,
            "SEQUSED_K": variant.seqused_k, "PAGE_ROWS": variant.page_rows,
            "VARLEN": variant.varlen, "WINDOW": variant.window, "WORK_LIST": variant.work_list,
            "SINKS": variant.sinks, "SOFTCAP": (2 if variant.softcap_approx else 1) if variant.softcap else 0}


def _rows_per_consumer(variant: GluonVariant) -> int:
    return 64 if variant.warp_specialize else variant.block_m


def _tma_ok(t: torch.Tensor) -> bool:
    # TMA: 16-byte aligned base, contiguous last dim, other strides positive 16-byte multiples.
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and (st * size) % 16 == 0 for st in t.stride()[:-1]))


def supported(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              dropout_p: float = 0.0, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes=None, cu_seqlens_q=None, block_table=None, deterministic: bool = False,
              **unsupported) -> bool:
    """Whether ``gluon_attention_forward`` handles these inputs: (B, S, H, D) CUDA tensors on a
    compute capability 9.0 GPU, bf16 or fp16 (all three alike), head dim in HEAD_DIMS, H a multiple of
    Hk, rows TMA can address (16-byte aligned bases, positive 16-byte multiple strides, contiguous
    head dim), a positive softmax scale, any sliding window (``window_size``, bottom-right as
    flash_attn aligns it), a softcap where SOFTCAP_IN_KERNEL, and none of dropout,
    ALiBi, packed or paged sequences (any other
    keyword argument given as not None / nonzero counts as an unsupported feature, e.g.
    return_attn_probs=True)."""
    del causal, deterministic  # both masks are handled; the forward is deterministic anyway
    if not _GLUON or not options_supported(softmax_scale=softmax_scale, dropout_p=dropout_p,
                                           window_size=window_size, softcap=softcap,
                                           alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                           block_table=block_table, **unsupported):
        return False
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1 or _arch(q.device.index) != 90:
        return False
    return shapes_supported(q, k, v)


def options_supported(*, softmax_scale: float | None = None, dropout_p: float = 0.0,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                      cu_seqlens_q=None, block_table=None, **unsupported) -> bool:
    """The option half of ``supported`` (no tensor or device is looked at)."""
    if softmax_scale is not None and not softmax_scale > 0:  # the running max assumes scale > 0
        return False
    if dropout_p or alibi_slopes is not None or cu_seqlens_q is not None:
        return False
    if block_table is not None or len(tuple(window_size)) != 2:
        return False
    if softcap and not (SOFTCAP_IN_KERNEL and softcap > 0):
        return False
    return all(value in (None, 0, 0.0, False) for value in unsupported.values())


def qkv_shapes_ok(q, k, v, head_dims: tuple) -> bool:
    """q (B, Sq, H, D), k and v (B, Sk, Hk, D) alike, D in ``head_dims``, H a multiple of Hk > 0."""
    batch, _, heads, head_dim = q.shape
    if head_dim not in head_dims or k.shape[-1] != head_dim or v.shape != k.shape:
        return False
    return k.shape[0] == batch and k.shape[2] > 0 and heads % k.shape[2] == 0


def shapes_supported(q, k, v, head_dims: tuple = HEAD_DIMS) -> bool:
    """The layout half of ``supported``: dtypes, shapes and TMA-addressable strides, on any device."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    return qkv_shapes_ok(q, k, v, head_dims) and all(_tma_ok(t) for t in tensors)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_shapes_supported(q, k, v, scale_blocks: tuple[int, int], causal: bool = False,
                         variant: GluonVariant | None = None) -> bool:
    """Whether the e4m3 forward (``gluon_attention_forward`` with descales) takes these tensors:
    q (B, Sq, H, D) and k (B, Sk, Hk, D) e4m3 with TMA-addressable rows, v e4m3 (B, Sk, Hk, D) stored
    keys-contiguous (kernels.forward.keys_contiguous) with 16-byte aligned V^T rows, D in
    FP8_DISPATCH with ``causal``, and scale blocks (queries, keys) that are powers of two and multiples of 64
    query rows (a consumer's) and of the key tile of ``variant`` (default: the shipped one for
    ``causal``). Any device."""
    tensors = (q, k, v)
    e4m3 = torch.float8_e4m3fn
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype == e4m3 for t in tensors):
        return False
    # An explicit variant (a benchmark's) may be of any compiled head dim; dispatch: FP8_DISPATCH.
    if variant is None and (q.shape[-1], causal) not in FP8_DISPATCH:
        return False
    if not qkv_shapes_ok(q, k, v, (variant.head_dim,) if variant is not None else FP8_HEAD_DIMS):
        return False
    block_q, block_k = scale_blocks
    block_n = (variant or default_variant(q.shape[-1], "fp8", causal)).block_n
    if any(b < 1 or b & (b - 1) for b in scale_blocks) or block_q % 64 or block_k % block_n:
        return False
    vt = v.permute(0, 2, 3, 1)  # (B, Hk, D, Sk): keys contiguous
    return _tma_ok(q) and _tma_ok(k) and _tma_ok(vt)


@functools.lru_cache(maxsize=None)  # shared-memory layouts cost microseconds to build, on every call
def _layouts(block_m: int, block_n: int, head_dim: int, torch_dtype):
    """Shared layouts of the (Q and output, K, V) tiles; e4m3: (Q, K, V^T, bf16 output)."""
    if torch_dtype == torch.float8_e4m3fn:
        return (_smem_layout([1, block_m, 1, head_dim], torch_dtype),
                _smem_layout([1, block_n, 1, head_dim], torch_dtype),
                _smem_layout([1, 1, head_dim, block_n], torch_dtype),
                _smem_layout([1, block_m, 1, head_dim], torch.bfloat16))
    q_layout = _smem_layout([1, block_m, 1, head_dim], torch_dtype)
    kv_layout = _smem_layout([1, block_n, 1, head_dim], torch_dtype)
    return q_layout, kv_layout, kv_layout, q_layout


_NO_SCALES = (0, 0, 0, 0, 0, 0, 0)  # the e4m3 scale arguments of a 16-bit launch (never read)


class _Geometry(NamedTuple):
    """What a launch takes that depends only on the variant and the problem's sizes."""
    grid: tuple
    q_block: tuple
    kv_block: tuple
    layouts: tuple  # shared layouts of the Q, K, V and output tiles
    num_m_blocks: int
    head_group: int  # (batch, head) pairs per group of causal work tiles, at most all of them
    options: dict


@functools.lru_cache(maxsize=4096)
def _geometry(variant: GluonVariant, batch: int, seqlen_q: int, seqlen_k: int, heads: int,
              sm_count: int, head_group: int | None, torch_dtype) -> _Geometry:
    rows = _rows_per_consumer(variant)
    num_m_blocks = -(-seqlen_q // variant.block_m)
    work_tiles = num_m_blocks * heads * batch
    if head_group is None:
        head_group = head_group_order(variant, seqlen_q, seqlen_k, heads * batch, sm_count)
    elif head_group == 0:
        head_group = heads * batch
    return _Geometry((min(work_tiles, sm_count) if variant.persistent else work_tiles,),
                     (1, rows, 1, variant.head_dim),
                     (1, variant.page_rows or variant.block_n, 1, variant.head_dim),
                     _layouts(rows, variant.block_n, variant.head_dim, torch_dtype), num_m_blocks,
                     min(head_group, heads * batch), _launch_options(variant))


class _PlainPlan(NamedTuple):
    geometry: _Geometry
    device: torch.device
    device_index: int
    lse_shape: tuple
    out_strides: tuple
    scalars_head: tuple  # the launch's scalars before the score scale
    scalars_tail: tuple  # and after it


# Plain calls by (shapes, strides, dtypes, device, causal) of q, k, v: their plan, or None where
# ``supported`` refuses such tensors. Bounded like launch's caches (varlen-free prefill sees few
# geometries; a growing-cache caller could see many).
_PLAIN: dict = {}
_MAX_PLAIN = 1024


def plain_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               seqused_k: bool = False, block_table: torch.Tensor | None = None,
               sinks: bool = False, softcap: int = 0) -> _PlainPlan | None:
    """The cached launch plan of a plain call on tensors of this geometry (shapes, strides, dtypes,
    devices), or None where the kernel does not take them; ``seqused_k``: keys per sequence from the
    device; ``block_table`` (with seqused_k): k and v are page pools read through it. Data pointers
    are not looked at (callers check their alignment). ``sinks``: the variant with the attention
    sinks' epilogue; ``softcap``: the variant with the logit softcap, 1 by the exp2 formula, 2 by
    tanh.approx (without seqused_k; callers route softcapped calls here only with SOFTCAP_IN_KERNEL)."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), causal, seqused_k,
           None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                             block_table.get_device()), sinks, softcap)
    plan = _PLAIN.get(key, False)
    if plan is False:
        plan = _plain_plan(q, k, v, causal, seqused_k, block_table, sinks, softcap)
        if len(_PLAIN) >= _MAX_PLAIN:
            _PLAIN.clear()
        _PLAIN[key] = plan
    return plan


def plain_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                  causal: bool, seqused_k: torch.Tensor | None = None,
                  block_table: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  softcap: float = 0.0, softcap_approx: bool = False):
    """``gluon_attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal,
    seqused_k=seqused_k, block_table=block_table)`` (fresh out and LSE, the shipped variant) with
    everything that depends only on the tensors' shapes, strides, dtypes and device looked up rather
    than worked out again: ``supported``'s checks and the launch geometry cost ~20 us of host time a
    call, as much as the kernel itself at 1-2k tokens. Returns None, having launched nothing, where
    the kernel does not take the inputs or they sit on another than the current device: the caller
    then takes the general path. ``seqused_k``: (B,) int32 on q's device (the caller's guarantee).
    ``sinks`` (H,) on q's device: attention sinks, in the output and LSE (the epilogue's).
    ``softcap`` > 0: flash_attn's logit softcap (without seqused_k), its tanh by tanh.approx with
    ``softcap_approx`` (a call no backward follows)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 or not softmax_scale > 0 or softcap < 0:
        return None
    plan = plain_plan(q, k, v, causal, seqused_k is not None, block_table, sinks is not None,
                      (2 if softcap_approx else 1) if softcap > 0 else 0)
    if plan is None or plan.device_index != torch._C._cuda_getDevice():
        return None
    geo = plan.geometry
    q_shape = q.shape
    out = torch.empty(q_shape, dtype=q.dtype, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    q_layout, k_layout, v_layout, o_layout = geo.layouts
    descriptors = (_Descriptor(q, q_shape, q.stride(), geo.q_block, q_layout),
                   _Descriptor(k, k.shape, k.stride(), geo.kv_block, k_layout),
                   _Descriptor(v, k.shape, v.stride(), geo.kv_block, v_layout),
                   _Descriptor(out, q_shape, plan.out_strides, geo.q_block, o_layout))
    # Unread pointers: lse; an unpaged seqused_k call's table, the (int32) lengths.
    lengths = lse if seqused_k is None else seqused_k
    qk_scale, softcap_in = score_scalars(softmax_scale, softcap)
    launch(_attn_fwd_gluon, geo.grid, (lse, lse, lse, lse, lengths,
                                       lengths if block_table is None else block_table, lse, out, lse,
                                       lse if sinks is None else sinks),
           (*plan.scalars_head, qk_scale, *plan.scalars_tail, softcap_in), geo.options, descriptors)
    return out, lse


class _FP8Plan(NamedTuple):
    geometry: _Geometry
    device: torch.device
    device_index: int
    lse_shape: tuple
    out_strides: tuple
    vt_view: tuple  # (shape, strides) of V^T (B, Hk, D, Sk), keys contiguous
    scalars_head: tuple  # before the score scale
    scalars_tail: tuple  # after it


# e4m3 plain calls (flashtile.fp8.attention, flash_attn_func on e4m3) by the geometry of q, k, v,
# the Q descales' layout, the scale blocks and causal: their plan, or None where fp8_shapes_supported
# refuses them.
_FP8: dict = {}


def fp8_plan(q, k, v, q_descale, kv_blocks: int, scale_blocks: tuple, causal: bool,
             sinks: bool = False) -> _FP8Plan | None:
    """The cached launch plan of an e4m3 call on tensors of this geometry (as ``plain_plan``);
    ``kv_blocks``: K's and V's descales per row, which must be those ``scale_blocks`` give;
    ``sinks``: the variant with the attention sinks' epilogue."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), q_descale.shape, q_descale.stride(),
           q_descale.dtype, q_descale.get_device(), kv_blocks, tuple(scale_blocks), causal, sinks)
    plan = _FP8.get(key, False)
    if plan is False:
        plan = _fp8_plan(q, k, v, q_descale, kv_blocks, tuple(scale_blocks), causal, sinks)
        if len(_FP8) >= _MAX_PLAIN:
            _FP8.clear()
        _FP8[key] = plan
    return plan


def _on_one_sm90(*tensors) -> bool:
    """CUDA tensors on one compute capability 9.0 GPU (and the Gluon kernels built)."""
    if not _GLUON or not all(t.is_cuda for t in tensors):
        return False
    return len({t.device for t in tensors}) == 1 and _arch(tensors[0].device.index) == 90


def _fp8_plan(q, k, v, q_descale, kv_blocks: int, scale_blocks: tuple, causal: bool,
              sinks: bool = False) -> _FP8Plan | None:
    if not _on_one_sm90(q, k, v, q_descale):
        return None
    if not fp8_shapes_supported(q, k, v, scale_blocks, causal):
        return None
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or heads == 0 or seqlen_k == 0:
        return None  # the general path's conventions for empty inputs
    q_blocks, k_blocks = -(-seqlen_q // scale_blocks[0]), -(-seqlen_k // scale_blocks[1])
    # (the kernels read Q's descales along contiguous blocks, and V's largest at index k_blocks)
    if (q_descale.dtype != torch.float32 or tuple(q_descale.shape) != (batch, heads, q_blocks)
            or q_descale.stride(-1) != 1 or kv_blocks != k_blocks):
        return None
    variant = dispatch_variant(head_dim, "fp8", causal, seqlen_k)
    if sinks:
        variant = dataclasses.replace(variant, sinks=True)
    geo = _geometry(variant, batch, seqlen_q, seqlen_k, heads, _sm_count(q.device), None, q.dtype)
    vt = v.permute(0, 2, 3, 1)
    # descales as kernels.forward.fp8_kernel_descales makes them: K's and V's (B, Hk, blocks + 1)
    return _FP8Plan(geo, q.device, q.get_device(), (batch, heads, seqlen_q),
                    (seqlen_q * heads * head_dim, heads * head_dim, head_dim, 1),
                    (tuple(vt.shape), tuple(vt.stride())),
                    (heads * seqlen_q, seqlen_q, seqlen_q, seqlen_k, heads // heads_k, heads,
                     geo.num_m_blocks, batch),
                    (q_descale.stride(0), q_descale.stride(1), heads_k * (k_blocks + 1), k_blocks + 1,
                     scale_blocks[0].bit_length() - 1, scale_blocks[1].bit_length() - 1, k_blocks,
                     geo.head_group, 0, 0, 0, 0))


def fp8_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple, scale_blocks: tuple,
                softmax_scale: float, causal: bool, sinks: torch.Tensor | None = None):
    """``gluon_attention_forward`` of an e4m3 call (``descales`` (q, k, v) as flashtile.fp8.FP8QKV
    holds them, before kernels.forward.fp8_kernel_descales) with the checks and the launch geometry
    looked up (as ``plain_forward``): ~200 us of host time a call had made short e4m3 prefills slower
    than bf16. Returns None, having launched nothing, where the kernel does not take the call (v not
    stored keys-contiguous, other scale blocks, another device): the caller's general path then
    does. out (B, Sq, H, D) bfloat16 and lse (B, H, Sq). ``sinks`` (H,) on q's device: attention
    sinks, in the output and LSE (the epilogue's)."""
    q_d, k_d, v_d = descales
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 or not softmax_scale > 0:
        return None
    if k_d.dim() != 3 or v_d.shape != k_d.shape or k_d.shape[:2] != (k.shape[0], k.shape[2]):
        return None
    if k_d.dtype != torch.float32 or v_d.dtype != torch.float32:
        return None
    plan = fp8_plan(q, k, v, q_d, k_d.shape[2], scale_blocks, causal, sinks is not None)
    if (plan is None or plan.device_index != torch._C._cuda_getDevice()
            or k_d.get_device() != plan.device_index or v_d.get_device() != plan.device_index):
        return None
    from .forward import fp8_kernel_descales
    _, k_scales, v_scales = fp8_kernel_descales(q_d, k_d, v_d)
    geo = plan.geometry
    q_shape = q.shape
    out = torch.empty(q_shape, dtype=torch.bfloat16, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    q_layout, k_layout, v_layout, o_layout = geo.layouts
    variant_block_n = geo.kv_block[1]
    descriptors = (_Descriptor(q, q_shape, q.stride(), geo.q_block, q_layout),
                   _Descriptor(k, k.shape, k.stride(), geo.kv_block, k_layout),
                   _Descriptor(v, *plan.vt_view, (1, 1, q_shape[3], variant_block_n), v_layout),
                   _Descriptor(out, q_shape, plan.out_strides, geo.q_block, o_layout))
    launch(_attn_fwd_gluon, geo.grid, (lse, q_d, k_scales, v_scales, lse, lse, lse, out, lse,
                                       lse if sinks is None else sinks),
           (*plan.scalars_head, softmax_scale * LOG2E, *plan.scalars_tail, 0.0), geo.options, descriptors)
    return out, lse


class _PackedPlan(NamedTuple):
    geometry: _Geometry
    device: torch.device
    device_index: int
    out_shape: tuple  # (total_q, H, D)
    lse_shape: tuple  # (H, total_q)
    views: tuple  # (shape, strides) of q, k, v and out as the kernel's (1, S, H, D) tensors
    scalars_head: tuple
    scalars_tail: tuple
    work_list: bool  # the launch deals out listed work tiles (packed_work_list)


# Packed 16-bit calls (flash_attn_varlen_func without a window, page pools or e4m3) by the geometry
# of q, k, v and the offsets, max_seqlen_q/k and causal: their plan, or None where
# ``varlen_supported`` refuses them. The layers of one step repeat a key; the next step's batch
# (other lengths) makes a new one, hence the bound.
_PACKED: dict = {}
_MAX_PACKED = 1024


def packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                causal: bool, sinks: bool = False, softcap: int = 0) -> _PackedPlan | None:
    """The cached launch plan of ``packed_forward``'s call on tensors of this geometry (data
    pointers are not looked at: the caller checks their alignment); ``sinks`` and ``softcap`` as
    plain_plan's."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), cu_seqlens_q.shape, cu_seqlens_k.shape,
           cu_seqlens_q.stride(), cu_seqlens_k.stride(), cu_seqlens_q.dtype, cu_seqlens_k.dtype,
           cu_seqlens_q.get_device(), cu_seqlens_k.get_device(), max_seqlen_q, max_seqlen_k, causal, sinks,
           softcap)
    plan = _PACKED.get(key, False)
    if plan is False:
        plan = _packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sinks,
                            softcap)
        if len(_PACKED) >= _MAX_PACKED:
            _PACKED.clear()
        _PACKED[key] = plan
    return plan


def _packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                 causal: bool, sinks: bool = False, softcap: int = 0) -> _PackedPlan | None:
    if q.dtype not in (torch.bfloat16, torch.float16) or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return None
    if not varlen_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, causal):
        return None
    total_q, heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or heads == 0:
        return None  # gluon_varlen_forward's conventions for empty inputs, on the general path
    # gluon_varlen_forward's launch, everything but the pointers and the score scale worked out once
    variant = with_varlen(dispatch_variant(head_dim, _DTYPES[q.dtype], causal, max_seqlen_k))
    head_group = packed_head_group(batch, total_q, k.shape[0], max_seqlen_q, max_seqlen_k)
    if head_group == 0 and work_list_wanted(variant, batch, total_q, max_seqlen_q, heads, _sm_count(q.device)):
        variant = with_work_list(variant)
    variant = dataclasses.replace(variant, sinks=sinks)
    if softcap:
        variant = with_softcap(variant, approx=softcap == 2)
    geo = _geometry(variant, batch, max_seqlen_q, max_seqlen_k, heads, _sm_count(q.device), head_group, q.dtype)
    out4 = torch.empty((1, total_q, heads, head_dim), dtype=q.dtype, device="meta")
    views = tuple((t.shape, t.stride()) for t in (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out4))
    return _PackedPlan(geo, q.device, q.get_device(), (total_q, heads, head_dim), (heads, total_q), views,
                       (0, total_q, max_seqlen_q, max_seqlen_k, heads // k.shape[1], heads,
                        geo.num_m_blocks, batch),
                       (*_NO_SCALES, geo.head_group, 0, 0, 0, 0), variant.work_list)


def packed_head_group(batch: int, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int):
    """The work-tile order of packed sequences (``_geometry``'s head_group): 0, query-block-major
    over every (sequence, head), since the host does not know the lengths (no sync) and a short
    sequence's skipped tiles still take their slots in the persistent deal; but where q and k hold
    batch x max_seqlen rows (every sequence then has max_seqlen tokens, unless the offsets end
    before the packed rows: only the order, never a result, depends on this), None: the
    plain call's modelled grouping (head_group_order): on the H200 the packed call went from 0.81x
    to 0.99x the plain call's speed at 8 x 2048, 16/16 heads, d128 causal, and 0.78x to 1.01x at
    d256 (varlen-gap-h200-20261204(-after).json)."""
    if total_q == batch * max_seqlen_q and total_k == batch * max_seqlen_k:
        return None
    return 0


def packed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, causal: bool, sinks: torch.Tensor | None = None,
                   softcap: float = 0.0, softcap_approx: bool = False):
    """``gluon_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softmax_scale=softmax_scale, causal=causal)`` (16-bit packed sequences, fresh out and LSE, the
    shipped variant) with what depends only on the tensors' geometry looked up: that call's checks
    and launch geometry took ~45 of a packed call's ~95 us of host time on the H200
    (varlen-host-h200-20261204-before.json). ``max_seqlen_k`` > 0. Returns None, having launched nothing,
    where the kernel does not take the inputs or they sit on another than the current device.
    ``sinks`` (H,) on q's device: attention sinks, in the output and LSE (the epilogue's).
    ``softcap`` > 0: flash_attn's logit softcap, by tanh.approx with ``softcap_approx``."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 or not softmax_scale > 0 or softcap < 0:
        return None
    plan = packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sinks is not None,
                       (2 if softcap_approx else 1) if softcap > 0 else 0)
    if plan is None or plan.device_index != torch._C._cuda_getDevice():
        return None
    geo = plan.geometry
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    q_layout, k_layout, v_layout, o_layout = geo.layouts
    (q_shape, q_strides), (k_shape, k_strides), (v_shape, v_strides), (o_shape, o_strides) = plan.views
    descriptors = (_Descriptor(q, q_shape, q_strides, geo.q_block, q_layout),
                   _Descriptor(k, k_shape, k_strides, geo.kv_block, k_layout),
                   _Descriptor(v, v_shape, v_strides, geo.kv_block, v_layout),
                   _Descriptor(out, o_shape, o_strides, geo.q_block, o_layout))
    work = (packed_work_list(cu_seqlens_q, cu_seqlens_k, geo.num_m_blocks, geo.options["BLOCK_M"], causal)
            if plan.work_list else lse)
    qk_scale, softcap_in = score_scalars(softmax_scale, softcap)
    launch(_attn_fwd_gluon, geo.grid, (lse, lse, lse, lse, cu_seqlens_k, lse, cu_seqlens_q, out, work,
                                       lse if sinks is None else sinks),
           (*plan.scalars_head, qk_scale, *plan.scalars_tail, softcap_in), geo.options, descriptors)
    return out, lse


def varlen_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False,
                     scale_blocks: tuple[int, int] | None = None,
                     block_table: torch.Tensor | None = None) -> bool:
    """Whether ``gluon_varlen_forward`` takes these packed sequences: q (total_q, H, D), k and v
    (total_k, Hk, D) as ``supported`` (16-bit) takes them with a batch of one, or e4m3 (with
    ``scale_blocks``, one query and one key block spanning the longest sequence, powers of two as
    fp8_shapes_supported needs them; v in any layout: it is copied keys-contiguous), and the
    offsets int32 (B + 1) contiguous on q's sm_90 GPU. With ``block_table`` (B, max_pages) int32:
    16-bit k and v page pools (num_pages, page_size, Hk, D) as ``paged_supported`` takes them, or
    e4m3 ones of any page size (_fp8_pools_supported)."""
    if block_table is not None:
        if not (isinstance(q, torch.Tensor) and q.dim() == 3 and _offsets_ok(q, cu_seqlens_q, cu_seqlens_k)):
            return False
        if q.dtype == torch.float8_e4m3fn:  # gathered into packed K and V^T first (paged_keys_packed)
            return _fp8_pools_supported(q, k, v, block_table, cu_seqlens_q.shape[0] - 1, causal,
                                        scale_blocks)
        return paged_supported(q.unsqueeze(0), k, v, block_table, causal, batch=cu_seqlens_q.shape[0] - 1)
    tensors = (q, k, v)
    if not (_GLUON and all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_cuda for t in tensors)):
        return False
    if not _offsets_ok(q, cu_seqlens_q, cu_seqlens_k):
        return False
    if len({t.device for t in tensors}) != 1 or _arch(q.device.index) != 90:
        return False
    q4, k4, v4 = (t.unsqueeze(0) for t in tensors)
    if q.dtype == torch.float8_e4m3fn:
        if scale_blocks is None or (q.shape[-1], causal) not in FP8_DISPATCH:
            return False
        if not (k.dtype == v.dtype == q.dtype and qkv_shapes_ok(q4, k4, v4, FP8_HEAD_DIMS)):
            return False
        block_q, block_k = scale_blocks
        block_n = default_variant(q.shape[-1], "fp8", causal).block_n
        if any(b < 1 or b & (b - 1) for b in scale_blocks) or block_q % 64 or block_k % block_n:
            return False
        return _tma_ok(q4) and _tma_ok(k4)
    return shapes_supported(q4, k4, v4)


def _fp8_pools_supported(q, k, v, block_table, batch: int, causal: bool, scale_blocks) -> bool:
    """e4m3 page pools k, v (num_pages, page_size, Hk, D) with a (batch, max_pages) int32 table, all on
    q's sm_90 GPU: whether their gathered packed form (kernels.forward.paged_keys_packed: fresh
    contiguous tensors) is one ``varlen_supported`` takes."""
    if not (isinstance(block_table, torch.Tensor) and block_table.dim() == 2
            and block_table.dtype == torch.int32 and block_table.shape[0] == batch
            and block_table.stride(-1) == 1):
        return False
    tensors = (q, k, v)
    if not (_GLUON and all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
            and k.dim() == 4 and v.shape == k.shape and k.shape[0] > 0 and k.shape[1] > 0
            and len({t.device for t in (*tensors, block_table)}) == 1 and _arch(q.device.index) == 90):
        return False
    if scale_blocks is None or (q.shape[-1], causal) not in FP8_DISPATCH:
        return False
    heads_k = k.shape[2]
    if not (k.dtype == v.dtype == q.dtype and k.shape[-1] == q.shape[-1] and heads_k > 0
            and q.shape[1] % heads_k == 0):
        return False
    block_q, block_k = scale_blocks
    block_n = default_variant(q.shape[-1], "fp8", causal).block_n
    if any(b < 1 or b & (b - 1) for b in scale_blocks) or block_q % 64 or block_k % block_n:
        return False
    return _tma_ok(q.unsqueeze(0))


def _offsets_ok(q, cu_seqlens_q, cu_seqlens_k) -> bool:
    """cu_seqlens_q and cu_seqlens_k: int32 (B + 1) contiguous on q's device, B >= 1."""
    for cu in (cu_seqlens_q, cu_seqlens_k):
        if not (isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.dim() == 1
                and cu.is_contiguous() and cu.device == q.device):
            return False
    return cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.shape[0] >= 2


def gluon_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                         softmax_scale: float, causal: bool, out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None, descales=None,
                         scale_blocks: tuple[int, int] = (0, 0), variant: GluonVariant | None = None,
                         block_table: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                         keyed_sequences: int = 0, sinks: torch.Tensor | None = None,
                         softcap: float = 0.0, softcap_approx: bool = False):
    """Packed sequences on inputs ``varlen_supported`` accepts: sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (total_q, H, D) against rows cu_seqlens_k[b]:... of k
    and v (total_k, Hk, D), causal bottom-right on its own lengths; ``max_seqlen_q`` must bound
    every sequence's queries (it sizes the grid), ``max_seqlen_k`` its keys. Returns (out, lse):
    out (total_q, H, D) in q's dtype (bf16 for e4m3), lse float32 (H, total_q) in natural log;
    ``out`` (TMA-aligned rows) and ``lse`` (contiguous last dim) may be given to write into.

    e4m3: ``descales`` as kernels.forward.fp8_kernel_descales makes them from flash_attn's (B, Hk)
    ones, one block of ``scale_blocks`` = (queries, keys) per sequence; v is copied keys-contiguous
    (the P V wgmma reads V^T) with every sequence from a 16-key boundary
    (kernels.forward.packed_keys_transposed: TMA's innermost coordinates are 16-byte multiples).
    ``variant``: a schedule of packed sequences (``with_varlen``) instead of the shipped one.

    ``block_table`` (B, max_pages) int32 (as ``varlen_supported`` takes it): k and v are page pools
    (num_pages, page_size, Hk, D) and sequence b's keys the first cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] slots of pages block_table[b, 0], block_table[b, 1], ... (clamped to the
    table's max_pages * page_size). 16-bit pools are read in place; e4m3 ones are gathered first
    (kernels.forward.paged_keys_packed: B * max_seqlen_k keys of K rows and of V^T, or
    ``keyed_sequences`` * max_seqlen_k where the caller knows at most that many sequences have keys).

    ``window_size`` (left, right), -1 for an unbounded side: flash_attn's sliding window on each
    sequence's own lengths (16-bit contiguous sequences only), as gluon_attention_forward takes it.
    The shipped variant deals out only the work tiles that hold query rows where work_list_wanted
    says so (with_work_list); a given ``variant`` runs as it is. ``sinks`` (H,) on q's device:
    attention sinks, taken in the epilogue (the variant's with ``sinks``). ``softcap`` > 0
    (16-bit sequences): flash_attn's logit softcap (the variant's with ``softcap``; its tanh by
    tanh.approx with ``softcap_approx``, for calls no backward follows)."""
    total_q, heads, head_dim = q.shape
    heads_k = k.shape[-2]  # (total_k, Hk, D), or page pools (num_pages, page_size, Hk, D)
    batch = cu_seqlens_q.shape[0] - 1
    fp8 = q.dtype == torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 else q.dtype
    if out is None:
        out = torch.empty(total_q, heads, head_dim, dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device)
    out4 = out.unsqueeze(0)
    if (out.shape != q.shape or out.dtype != out_dtype or not out.is_contiguous() or not _tma_ok(out4)
            or lse.stride(-1) != 1 or lse.shape != (heads, total_q)):
        raise ValueError("gluon_varlen_forward: out must be like q (bf16 for e4m3 q), contiguous and "
                         "16-byte aligned, and lse (H, total_q) float32 with a contiguous last dim")
    if batch == 0 or total_q == 0 or heads == 0 or max_seqlen_q <= 0:
        return out, lse
    dtype = _DTYPES[q.dtype]
    v_packed_t = None
    paged = block_table is not None
    window_size = tuple(window_size)  # checked before the e4m3 pools' gather below
    windowed = len(window_size) == 2 and (window_size[0] >= 0 or (not causal and window_size[1] >= 0))
    if windowed and (fp8 or block_table is not None):
        raise ValueError("gluon_varlen_forward: a window takes 16-bit contiguous packed sequences")
    if softcap and (not softcap > 0 or fp8):
        raise ValueError("gluon_varlen_forward: a softcap (> 0) takes 16-bit packed sequences")
    window_left, window_right = window_arguments(causal, window_size) if windowed else (0, 0)
    if paged and (block_table.dim() != 2 or block_table.shape[0] != batch):
        raise ValueError("gluon_varlen_forward: block_table must be (B, max_pages)")
    if paged and fp8:
        # e4m3 wgmma reads V K-major, which a page pool is not: the sequences' keys are gathered
        # through the table into packed K rows and packed V^T (V through rows: three Triton passes
        # in all), and run as contiguous packed sequences.
        from .forward import paged_keys_packed
        k, v_packed_t = paged_keys_packed(k, v, block_table, cu_seqlens_k, max_seqlen_k, keyed_sequences)
        paged = False
    dispatched = variant is None
    if variant is None:
        if paged:
            variant = varlen_paged_variant(head_dim, dtype, causal, k.shape[1])
        else:
            variant = with_varlen(dispatch_variant(head_dim, dtype, causal, max_seqlen_k))
            if windowed:
                variant = with_window(variant)
    elif not variant.varlen or (variant.head_dim, variant.dtype, variant.causal) != (head_dim, dtype, causal):
        raise ValueError(f"variant {variant.name} is not a varlen d{head_dim} {dtype} causal={causal} one")
    if variant.window != windowed:
        raise ValueError(f"variant {variant.name}: a window is {'needed' if variant.window else 'not taken'}")
    if variant.seqused_k != paged:
        raise ValueError(f"variant {variant.name}: a block table is {'needed' if variant.seqused_k else 'not taken'}")
    if fp8 and descales is None:
        raise ValueError("gluon_varlen_forward: e4m3 inputs need descales")
    # Every sequence's keys fit a key range of max_seqlen_k; the grid's query blocks, max_seqlen_q.
    head_group = 0 if paged else packed_head_group(batch, total_q, k.shape[0], max_seqlen_q, max_seqlen_k)
    if (dispatched and head_group == 0
            and work_list_wanted(variant, batch, total_q, max_seqlen_q, heads, _sm_count(q.device))):
        variant = with_work_list(variant)
    if sinks is not None:
        variant = dataclasses.replace(variant, sinks=True)
    if softcap:
        variant = with_softcap(variant, approx=softcap_approx or variant.softcap_approx)
    geo = _geometry(variant, batch, max_seqlen_q, max(max_seqlen_k, 1), heads, _sm_count(q.device),
                    head_group, q.dtype)
    seqlen_k, page_size, stride_bt = max(max_seqlen_k, 1), 0, 0
    if paged:  # the pools as they are; keys are clamped to the capacity a table row gives
        k4, v4 = k, v
        page_size, stride_bt = k.shape[1], block_table.stride(0)
        seqlen_k = block_table.shape[1] * page_size
    elif fp8:  # V^T (1, Hk, D, width), keys contiguous, each sequence from a 16-key boundary
        from .forward import packed_keys_transposed
        if v_packed_t is None:
            v_packed_t = packed_keys_transposed(v, cu_seqlens_k, max_seqlen_k)
        k4, v4 = k.unsqueeze(0), v_packed_t.permute(0, 2, 3, 1)
    else:
        k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    descriptors = _descriptors(q.unsqueeze(0), k4, v4, out4, geo, variant)
    scales, scale_scalars = _scale_arguments(descales if fp8 else None, scale_blocks, max(max_seqlen_k, 1), lse)
    qk_scale, softcap_in = score_scalars(softmax_scale, softcap)
    scalars = (0, lse.stride(0), max_seqlen_q, seqlen_k, heads // heads_k, heads,
               geo.num_m_blocks, batch, qk_scale, *scale_scalars, geo.head_group, page_size,
               stride_bt, window_left, window_right, softcap_in)
    on_other_device = q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if on_other_device else contextlib.nullcontext():
        work = (packed_work_list(cu_seqlens_q, cu_seqlens_k, geo.num_m_blocks, variant.block_m, causal)
                if variant.work_list else lse)
        launch(_attn_fwd_gluon, geo.grid, (lse, *scales, cu_seqlens_k, block_table if paged else lse,
                                           cu_seqlens_q, out, work, lse if sinks is None else sinks),
               scalars, geo.options, descriptors)
    return out, lse


def paged_supported(q, k, v, block_table, causal: bool = False, batch: int | None = None,
                    any_page_size: bool = False) -> bool:
    """Whether the forward reads these page pools with seqused_k: q (B, Sq, H, D) as ``supported``
    takes it, k and v (num_pages, page_size, Hk, D) alike with TMA-addressable rows, page_size a
    multiple of the smallest PAGED_BOX_ROWS (pages of whole key tiles are read a box a tile, others
    in smaller boxes: ``paged_variant``), and block_table (B, max_pages) int32 with a
    contiguous last dim, all on one sm_90 GPU. ``batch``: the table's rows, where q's first
    dimension is not B (packed sequences). ``any_page_size``: the rest of the checks, for pools
    gathered into a contiguous cache first (decode.prefill_gathers)."""
    if not (isinstance(block_table, torch.Tensor) and block_table.dim() == 2
            and block_table.dtype == torch.int32
            and block_table.shape[0] == (q.shape[0] if batch is None else batch)
            and block_table.shape[1] > 0 and block_table.stride(-1) == 1):
        return False
    tensors = (q, k, v)
    if not (_GLUON and all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_cuda for t in tensors)
            and len({t.device for t in (*tensors, block_table)}) == 1 and _arch(q.device.index) == 90):
        return False
    head_dim, heads, heads_k = q.shape[-1], q.shape[2], k.shape[2]
    if (q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype
            or head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or v.shape != k.shape
            or k.shape[0] == 0 or heads_k == 0 or heads % heads_k or not all(_tma_ok(t) for t in tensors)):
        return False
    return any_page_size or k.shape[1] % min(PAGED_BOX_ROWS) == 0


def _plain_plan(q, k, v, causal: bool, seqused_k: bool = False,
                block_table: torch.Tensor | None = None, sinks: bool = False,
                softcap: int = 0) -> _PlainPlan | None:
    batch, seqlen_q, heads, head_dim = q.shape
    if softcap and seqused_k:
        return None
    if block_table is not None:
        if not seqused_k or not paged_supported(q, k, v, block_table, causal):
            return None
        page_size, stride_bt = k.shape[1], block_table.stride(0)
        seqlen_k = block_table.shape[1] * page_size  # the capacity a sequence's table gives
    else:
        if not supported(q, k, v, causal=causal):
            return None
        page_size, stride_bt = 0, 0
        seqlen_k = k.shape[1]
    heads_k = k.shape[2]
    if batch == 0 or seqlen_q == 0 or heads == 0 or seqlen_k == 0:
        return None  # gluon_attention_forward's conventions for empty inputs, on the general path
    variant = dispatch_variant(head_dim, _DTYPES[q.dtype], causal, seqlen_k)
    if block_table is not None:
        variant = paged_variant(variant, page_size)
    elif seqused_k:
        variant = with_seqused_k(variant)
    variant = dataclasses.replace(variant, sinks=sinks)
    if softcap:
        variant = with_softcap(variant, approx=softcap == 2)
    geo = _geometry(variant, batch, seqlen_q, seqlen_k, heads, _sm_count(q.device), None, q.dtype)
    # out (B, Sq, H, D) and lse (B, H, Sq), both contiguous: gluon_attention_forward's allocations
    return _PlainPlan(geo, q.device, q.get_device(), (batch, heads, seqlen_q),
                      (seqlen_q * heads * head_dim, heads * head_dim, head_dim, 1),
                      (heads * seqlen_q, seqlen_q, seqlen_q, seqlen_k, heads // heads_k, heads,
                       geo.num_m_blocks, batch),
                      (*_NO_SCALES, geo.head_group, page_size, stride_bt, 0, 0))


def _descriptors(q, k, v, out, geo: "_Geometry", variant: GluonVariant) -> tuple:
    """The launch's TMA descriptors over (B, S, H, D) q, k, out and v, e4m3 V as V^T (B, Hk, D, S)."""
    q_layout, k_layout, v_layout, o_layout = geo.layouts
    v_block = (1, 1, variant.head_dim, variant.block_n) if variant.fp8 else geo.kv_block
    return (_Descriptor(q, q.shape, q.stride(), geo.q_block, q_layout),
            _Descriptor(k, k.shape, k.stride(), geo.kv_block, k_layout),
            _Descriptor(v, v.shape, v.stride(), v_block, v_layout),
            _Descriptor(out, out.shape, out.stride(), geo.q_block, o_layout))


# The softcap's tanh (SOFTCAP_IN_KERNEL) by one MUFU op (tanh.approx.f32, relative error ~2^-11)
# instead of the exp2 formula (an ex2 and a division), for calls that no backward follows (the routes'
# ``softcap_approx``: ops.forward's calls without gradients): the portable backward recomputes P with
# the formula from the forward's LSE, which tanh.approx's scores would leave off by up to ~2.5% at a
# cap of 50. H100 (softcap-ab-h100-20261205, Gemma 2's shapes, B2 4k, cap 50): 1.24-1.28x the formula
# at d128, 1.10-1.14x at d256, errors 0.02-0.04 of the budget against float64 either way; through
# flash_attn_func (softcap-check-h100-20261205-approx): 1.22-1.25x / 1.05-1.20x, 17 float64 checks
# within 0.49 of the budget, compute-sanitizer clean. FLASHTILE_GLUON_SOFTCAP_APPROX=0 turns it off.
SOFTCAP_APPROX = os.environ.get("FLASHTILE_GLUON_SOFTCAP_APPROX", "1") not in ("", "0")


def score_scalars(softmax_scale: float, softcap: float = 0.0) -> tuple[float, float]:
    """(qk_scale, softcap_in), the launch's score scalars: the scale in log2 units, or with a
    softcap, softcap * log2(e) after the tanh and softmax_scale / softcap before it (SOFTCAP)."""
    if softcap:
        return softcap * LOG2E, softmax_scale / softcap
    return softmax_scale * LOG2E, 0.0


def _scale_arguments(descales, scale_blocks: tuple[int, int], seqlen_k: int, lse: torch.Tensor):
    """(QScale, KScale, VScale) and their scalars for a launch: e4m3 ``descales`` as
    gluon_attention_forward takes them, or (None) the LSE standing in for unread pointers."""
    if descales is None:
        return (lse, lse, lse), _NO_SCALES
    q_d, k_d, v_d = descales
    return (q_d, k_d, v_d), (q_d.stride(0), q_d.stride(1), k_d.stride(0), k_d.stride(1),
                             scale_blocks[0].bit_length() - 1, scale_blocks[1].bit_length() - 1,
                             -(-seqlen_k // scale_blocks[1]))


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                            causal: bool, variant: GluonVariant | None = None,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                            descales=None, scale_blocks: tuple[int, int] = (0, 0),
                            head_group: int | None = None, seqused_k: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            sinks: torch.Tensor | None = None, softcap_approx: bool = False):
    """Attention forward on inputs ``supported`` accepts: q (B, Sq, H, D), k/v (B, Sk, Hk, D).

    Returns (out, lse): out (B, Sq, H, D) contiguous in q's dtype, lse float32 (B, H, Sq) in natural
    log. ``causal`` aligns the diagonal bottom-right (flash_attn's convention). ``variant``
    overrides the shipped schedule for this head dim (benchmarks); its head dim, dtype and mask
    must match the call. ``out`` (like q, 16-byte aligned rows) and ``lse`` (B, H, Sq) float32
    with a contiguous last dim may be given to write into.

    e4m3 (inputs ``fp8_shapes_supported`` accepts): ``descales`` = (q (B, H, query blocks), k and v
    (B, Hk, key blocks + 1)) float32 as kernels.forward.attention_forward prepares them (K's padded,
    V's relative to their largest, which follows them), one per ``scale_blocks`` = (queries, keys)
    tokens; out is bfloat16.

    ``head_group`` (causal): the work tiles in groups of that many (batch, head) pairs, each group
    query-block-major: 1 is (batch, head)-major, 0 (or >= B * H) query-block-major over all of
    them; None: ``head_group_order`` decides.

    ``seqused_k`` (B,) int32 on q's device (16-bit inputs): sequence b attends to its first
    seqused_k[b] keys (clamped to [0, Sk]), read on the device; k and v are then caches whose
    slots past those keys may hold anything (a KV cache's lengths: chunked prefill, causal
    bottom-right against each sequence's own length). With it, ``block_table`` (B, max_pages) int32
    makes k and v page pools (num_pages, page_size, Hk, D) as ``paged_supported`` takes them.

    ``window_size`` (left, right), -1 for an unbounded side (16-bit q, k, v without seqused_k):
    flash_attn's sliding window, row i seeing keys [i + Sk - Sq - left, i + Sk - Sq + right] (causal:
    right 0 whatever is given).

    ``softcap`` > 0 (16-bit q, k, v without seqused_k): flash_attn's logit softcap,
    scores softcap * tanh(softmax_scale * q.k / softcap); with ``softcap_approx`` the tanh by
    tanh.approx.f32 (a call no backward follows: the portable backward recomputes P by the exp2 formula).

    ``sinks`` (H,) on q's device: attention sinks, in the output and LSE (the variant's with
    ``sinks``: one more logit a head in the epilogue).
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    page_size = stride_bt = 0
    if block_table is not None:
        if seqused_k is None or not paged_supported(q, k, v, block_table, causal):
            raise ValueError("gluon_attention_forward: block_table needs seqused_k and the page pools, "
                             "page size and table paged_supported accepts")
        page_size, stride_bt = k.shape[1], block_table.stride(0)
        seqlen_k = block_table.shape[1] * page_size  # the capacity a sequence's table gives
    fp8 = q.dtype == torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if fp8 else q.dtype
    if out is None:
        out = torch.empty(batch, seqlen_q, heads, head_dim, dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if out.shape != q.shape or out.dtype != out_dtype or not _tma_ok(out) or lse.stride(-1) != 1:
        raise ValueError("gluon_attention_forward: out must be like q (bf16 for e4m3 q) with TMA-aligned "
                         "rows and lse (B, H, Sq) float32 with a contiguous last dim")
    if fp8 and (descales is None
                or not fp8_shapes_supported(q, k, v, scale_blocks, causal, variant)):
        raise ValueError("gluon_attention_forward: e4m3 inputs need descales and the layout and "
                         "scale blocks fp8_shapes_supported accepts")
    if batch == 0 or seqlen_q == 0 or heads == 0:
        return out, lse
    if seqlen_k == 0:  # nothing to attend to: flash_attn's empty-row convention
        out.zero_()
        lse.fill_(math.inf)
        return out, lse
    dtype = _DTYPES[q.dtype]
    if seqused_k is not None and (fp8 or seqused_k.dtype != torch.int32 or seqused_k.shape != (batch,)
                                  or seqused_k.device != q.device):
        raise ValueError("gluon_attention_forward: seqused_k must be (B,) int32 on q's device, with "
                         "16-bit inputs")
    if variant is None:
        variant = dispatch_variant(head_dim, dtype, causal, seqlen_k)
        if block_table is not None:
            variant = paged_variant(variant, page_size)
        elif seqused_k is not None:
            variant = with_seqused_k(variant)
    elif (variant.head_dim, variant.dtype, variant.causal) != (head_dim, dtype, causal):
        raise ValueError(f"variant {variant.name} does not match d{head_dim} {dtype} causal={causal}")
    if variant.seqused_k != (seqused_k is not None):
        raise ValueError(f"variant {variant.name}: seqused_k is {'needed' if variant.seqused_k else 'not taken'}")
    if head_group is not None and head_group < 0:
        raise ValueError("head_group must be >= 0")
    windowed = window_size[0] >= 0 or (not causal and window_size[1] >= 0)
    # (a call without a window passes zeros, as plain_forward's and the varlen launches do)
    window_left, window_right = window_arguments(causal, tuple(window_size)) if windowed else (0, 0)
    if windowed and not variant.window:
        if fp8 or seqused_k is not None:
            raise ValueError("gluon_attention_forward: a window takes 16-bit inputs without seqused_k")
        variant = with_window(variant)
    if softcap:
        if not softcap > 0 or fp8 or seqused_k is not None:
            raise ValueError("gluon_attention_forward: a softcap (> 0) takes 16-bit inputs without seqused_k")
        variant = with_softcap(variant, approx=softcap_approx or variant.softcap_approx)
    if sinks is not None:
        if not (sinks.shape == (heads,) and sinks.device == q.device and sinks.is_contiguous()):
            raise ValueError("gluon_attention_forward: sinks must be (H,), contiguous, on q's device")
        variant = dataclasses.replace(variant, sinks=True)

    geo = _geometry(variant, batch, seqlen_q, seqlen_k, heads, _sm_count(q.device), head_group, q.dtype)
    # e4m3 V^T: (B, Hk, D, Sk) with keys contiguous; the descriptor clips at Sk, not the padding
    descriptors = _descriptors(q, k, v.permute(0, 2, 3, 1) if fp8 else v, out, geo, variant)
    scales, scale_scalars = _scale_arguments(descales if fp8 else None, scale_blocks, seqlen_k, lse)
    qk_scale, softcap_in = score_scalars(softmax_scale, softcap)
    scalars = (lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, heads // heads_k, heads,
               geo.num_m_blocks, batch, qk_scale, *scale_scalars, geo.head_group,
               page_size, stride_bt, window_left, window_right, softcap_in)
    # Launches go to the current device: switch only when the inputs live on another one.
    on_other_device = q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if on_other_device else contextlib.nullcontext():
        lengths = lse if seqused_k is None else seqused_k  # also an unpaged call's (unread) table
        launch(_attn_fwd_gluon, geo.grid, (lse, *scales, lengths,
                                           lengths if block_table is None else block_table, lse, out, lse,
                                           lse if sinks is None else sinks),
               scalars, geo.options, descriptors)
    return out, lse


# How much worse (busiest CTA over the mean) the modelled balance of a grouped order may be than the
# query-block-major one's and still be picked: (batch, head)-major (groups of one) at d128 and d256,
# 4k tokens, is modelled at 1.031 against 1.002 and ran 4-8% faster; the three-consumer groups of
# 22-66 heads gain less, so they must model (almost) no worse.
HEADS_OUTER_SLACK = 0.035
GROUP_SLACK = 0.005


def head_group_order(variant: GluonVariant, seqlen_q: int, seqlen_k: int, num_bh: int,
                     sm_count: int) -> int:
    """How many (batch, head) pairs a causal call's work tiles are grouped by (see _tile_coords):
    num_bh means query-block-major over all heads, 1 (batch, head)-major.

    Query-block-major (the longest tiles of every head first) runs one query block of each of
    up to sm_count heads at once: their K/V stream from DRAM rather than L2, at short lengths
    with many heads the bound (+13% at d128 1k-2k, +4-8% at 4k-8k and +16-25% at d256 1k-2k for
    (batch, head)-major, medians of 5 shuffled rounds, gluon-ab-order-h200-20261130.json). But
    smaller groups put long tiles later, so a grouping is taken only where a model of the
    persistent deal (tile cost = key tiles + 1, snake rows over sm_count CTAs) balances it nearly
    as well. Two consumers: groups of one, or none. Three (d64), where (batch, head)-major measured
    8-35% slower at every length: the smallest of sm_count / 6, / 4, / 3, / 2 heads the model puts
    within GROUP_SLACK (+4-6% for 22 or 32 at 2k-4k with 32 heads, gluon-ab-group-h200-20261130.json).
    """
    if not (variant.causal and variant.persistent):
        return num_bh
    key = (variant.block_m, variant.block_n, seqlen_q, seqlen_k, num_bh, sm_count)
    blocks_major = _modelled_balance(*key, num_bh)
    if variant.consumers == 2:
        return 1 if _modelled_balance(*key, 1) <= blocks_major + HEADS_OUTER_SLACK else num_bh
    for group in sorted({-(-sm_count // k) for k in (6, 4, 3, 2)}):
        if group < num_bh and _modelled_balance(*key, group) <= blocks_major + GROUP_SLACK:
            return group
    return num_bh


@functools.lru_cache(maxsize=4096)
def _modelled_balance(block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, num_bh: int,
                      sm_count: int, group: int) -> float:
    """Busiest CTA over the mean for the snake deal of causal work tiles grouped by ``group``
    (batch, head) pairs (see _tile_coords); the key tiles per query block follow _key_range."""
    num_m = -(-seqlen_q // block_m)
    m0 = torch.arange(num_m) * block_m
    key_end = (m0 + block_m + seqlen_k - seqlen_q).clamp(max=seqlen_k)
    cost = ((key_end + block_n - 1) // block_n).clamp(min=1).double() + 1.0
    tiles = torch.arange(num_m * num_bh)
    row, pos = tiles // sm_count, tiles % sm_count
    cta = torch.where(row % 2 == 1, sm_count - 1 - pos, pos)  # the snake deal
    within = tiles % (group * num_m)
    size = (num_bh - tiles // (group * num_m) * group).clamp(max=group)
    m_index = num_m - 1 - within // size
    loads = torch.zeros(sm_count, dtype=torch.float64).index_add_(0, cta, cost[m_index])
    return loads.max().item() / (cost.sum().item() * num_bh / min(sm_count, len(tiles)))


class _Descriptor(NamedTuple):
    """What the launcher reads of a TMA descriptor (base, shape, strides, padding), built in a
    fraction of TensorDescriptor's validation time; ``real()`` is the descriptor, for the JIT."""
    base: torch.Tensor
    shape: tuple
    strides: tuple
    block_shape: tuple
    layout: object
    padding: str = "zero"

    def real(self):
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                self.layout, self.padding)


@functools.lru_cache(maxsize=None)
def _launch_options(variant: GluonVariant) -> dict:
    """Constexprs and launch shape of a variant: one dict per variant (``launch`` keys it by identity)."""
    return {**_kernel_constexprs(variant), **_launch_shape(variant)}


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------------------------

_GL_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
_SIGNATURE_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8e4nv"}


def compile_for_sm90(variant: GluonVariant):
    """Compile a variant to a cubin for sm_90 the way a launch would; returns the compiled kernel
    (``.metadata.shared`` the shared memory, ``.asm`` the ttgir, ptx and cubin; ``resource_usage``
    reads registers and spills off the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    torch_dtype = _GL_DTYPE_NAMES[variant.dtype]
    rows = _rows_per_consumer(variant)
    q_layout, k_layout, v_layout, o_layout = _layouts(rows, variant.block_n, variant.head_dim,
                                                      torch_dtype)
    d, n = variant.head_dim, variant.block_n
    dt = _SIGNATURE_DTYPES[variant.dtype]
    out_dt = "bf16" if variant.fp8 else dt

    def desc(dtype, block, layout):
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"

    fn = _attn_fwd_gluon
    box = variant.page_rows or n  # keys a K/V box carries
    v_block = (1, 1, d, n) if variant.fp8 else (1, box, 1, d)
    signature = {"q_desc": desc(dt, (1, rows, 1, d), q_layout), "k_desc": desc(dt, (1, box, 1, d), k_layout),
                 "v_desc": desc(dt, v_block, v_layout), "o_desc": desc(out_dt, (1, rows, 1, d), o_layout),
                 "Lse": "*fp32", "QScale": "*fp32", "KScale": "*fp32", "VScale": "*fp32",
                 "SeqlensK": "*i32" if variant.seqused_k or variant.varlen else "*fp32",
                 "BlockTable": "*i32" if variant.seqused_k else "*fp32",
                 "CuSeqlensQ": "*i32" if variant.varlen else "*fp32", "Out": f"*{out_dt}",
                 "WorkList": "*i32" if variant.work_list else "*fp32",
                 "Sinks": "*fp32", "qk_scale": "fp32", "softcap_in": "fp32"}
    constexprs = _kernel_constexprs(variant)
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Lse", "QScale", "KScale", "VScale", "SeqlensK", "BlockTable", "CuSeqlensQ", "Out",
                      "WorkList", "Sinks"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=_launch_shape(variant))


def _bundled_tool(name: str) -> str | None:
    """Path of one of the CUDA tools Triton ships (cuobjdump, ptxas), or None."""
    import os

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return tool if os.path.exists(tool) else None


def resource_usage(compiled) -> dict:
    """Registers per thread at launch, local memory (spills) and stack bytes from ``cuobjdump
    -res-usage`` on the cubin; {} if the tool is missing."""
    import re
    import tempfile

    tool = _bundled_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    found = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|LOCAL|STACK):(\d+)", res.stdout)}
    return found


def wgmma_serialized(compiled) -> bool | None:
    """Whether ptxas serialized the kernel's wgmmas (its C7515 advisory: a wait after every one,
    which Triton's own ptxas call does not show); None if the bundled ptxas is missing."""
    import os
    import tempfile

    tool = _bundled_tool("ptxas")
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([tool, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return "C7515" in res.stdout + res.stderr


def stack_allowance(variant: GluonVariant) -> int:
    """The stack bytes the compile check accepts: ``max_stack``, 16 more with the sinks' epilogue (its
    logit and the rescale keep a few more values live: d128 full windowed, 32 -> 48 on sm_90)."""
    return variant.max_stack + (16 if variant.sinks else 0)


def describe(variant: GluonVariant, compiled) -> tuple[str, bool]:
    """One report line for a compiled variant, and whether it spills."""
    usage = resource_usage(compiled)
    spills = usage.get("local", 0) > 0 or usage.get("stack", 0) > stack_allowance(variant)
    if variant.warp_specialize:
        regs = (f"{usage.get('reg', '?')} registers/thread at launch, partitions: {variant.consumers} "
                f"consumer warpgroups x {variant.consumer_regs}, producer 24")
    else:
        regs = f"{usage.get('reg', '?')} registers/thread"
    return (f"{variant.name}: ok, shared memory {compiled.metadata.shared} B, {regs}, "
            f"local {usage.get('local', '?')} B, stack {usage.get('stack', '?')} B"), spills


def compile_checked(everything: bool | None = None) -> list[GluonVariant]:
    """The variants the compile check builds: GLUON_VARIANTS but for the fp16 twins of bf16 variants
    and the work-listed twins of the sinks and softcap variants, whose kernel code is their twin's
    (the element type; the tile deal, itself compiled in the work-listed variants without sinks or
    softcap). Those twins cost a cold CI run on two cores ~5 minutes of its 30 (each compile ~5.5 s
    there, 102 of them). ``everything`` (default: FLASHTILE_COMPILE_ALL=1) keeps them."""
    if everything is None:
        everything = os.environ.get("FLASHTILE_COMPILE_ALL", "0") not in ("", "0")
    if everything:
        return list(GLUON_VARIANTS)
    shipped = set(GLUON_VARIANTS)
    return [v for v in GLUON_VARIANTS
            if not (v.dtype == "fp16" and dataclasses.replace(v, dtype="bf16") in shipped)
            and not ((v.sinks or v.softcap) and v.work_list and dataclasses.replace(v, work_list=False) in shipped)]


def main(argv=None) -> int:
    """Compile the shipped variants (compile_checked's; --all: every one) for sm_90 and print their
    resources; exit 1 if any fails, spills or has its wgmmas serialized by ptxas."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", default="", help="substring of the variant names to compile")
    parser.add_argument("--shard", default="0/1", help="K/N: compile every N-th variant from K")
    parser.add_argument("--all", action="store_true", help="every shipped variant (FLASHTILE_COMPILE_ALL=1)")
    args = parser.parse_args(argv)
    shard, shards = (int(x) for x in args.shard.split("/"))
    failed = 0
    for variant in compile_checked(args.all or None)[shard::shards]:
        if args.only not in variant.name:
            continue
        try:
            compiled = compile_for_sm90(variant)
            line, spills = describe(variant, compiled)
            serialized = bool(wgmma_serialized(compiled))
            if spills or serialized:
                failed += 1
                line = line.replace(": ok,", ": FAILED (spills)," if spills
                                    else ": FAILED (wgmmas serialized by ptxas),")
            print(line, flush=True)
        except Exception as exc:  # report every failing variant, not only the first
            failed += 1
            print(f"{variant.name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
