"""Hopper (sm_90) split-KV decode in Gluon: the KV cache reaches shared memory by TMA, pages too.

The portable decode kernel (``decode.py``) gathers each K/V tile with per-thread loads whose
addresses, on a paged cache, wait for the block table: at batch 1 its few programs (one per split and
KV head) leave the read rate 5-23% under the contiguous cache's. Here a 1-warp producer partition
reads the block table and issues TMA copies of whole pages (or of whole tiles on a contiguous cache)
into a ring of ``STAGES`` shared-memory slots, ahead of a 4-warp consumer that runs the online softmax
with wgmma. The consumer never computes an address; the producer's table loads overlap its wait for
a free slot.

Layout: every cache is read as a 2-D tensor (rows = (cache row or page, slot), columns = (KV head,
head dim)), so one descriptor type serves contiguous caches (B_cache, S_max, Hk, D) and page pools
(num_pages, page_size, Hk, D). A K or V tile of ``BLOCK_N`` keys sits in shared memory in the 128-byte
swizzled layout wgmma reads, which stores the tile as head-dim slabs of 64 columns, each slab all
rows deep; a page of ``PAGE_ROWS`` keys lands as one TMA box [PAGE_ROWS, 64] per slab at its rows of
each slab (``_slab_rows``). Pages of 8 keys or more (a power of two) and tiles of whole pages keep
every box on the swizzle's 8-row period.

Rows of the consumer's 64-row tile are (query head of the KV head's group, query position); rows past
group x Sq are zeros and never stored. Keys past the sequence in its last tile are masked in the
scores and their V rows zeroed in shared memory (whatever the cache holds there, NaN included, must
not reach P V). Splits and the LSE merge are the portable kernel's (``decode.combine``).

Which calls come here is ``decode.gluon_wanted``'s rule (from the H200 runs it cites): paged caches
but at 1-3x the SM count of (sequence, KV head) pairs, a few short contiguous-cache shapes, long
contiguous caches of at most 8 pairs, and e4m3 caches. Under the SM count of pairs a
16-bit call with at most 32 query rows per KV head runs the transposed consumer
(``_decode_consumer_t``: the keys as the wgmmas' M, the query rows as their N). The
e4m3-cache form (``fp8``: S by e4m3 wgmma with the query as hi + mid e4m3 terms, V widened to
fp16 in registers as P V's A operand (``v_regs``) or in shared memory) runs transposed (``rows_n``:
the keys as the wgmmas' M, the query rows as their N); on a paged e4m3 cache the producer, which
holds the page numbers, fetches the descales too (``ds_ring``).

This module imports on machines without a GPU; ``compile_for_sm90`` builds a variant there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .forward import LOG2E, _arch
from .gluon_forward import _GLUON, _Descriptor
from .launch import launch

if _GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from .gluon_forward import _to_16bit, _wgmma_layout

    _ROWS = gl.constexpr(64)

ROWS = 64  # one wgmma M: the query rows a program packs (group x Sq)
# e4m3 V^T in registers (DecodeVariant.v_regs) at head dim 128 read by ldmatrix as pairs of
# dimensions (_v_pairs_operand) rather than byte by byte (head dim 64: bytes)
V_PAIRS = True
SLAB = 64  # head-dim columns per 128-byte swizzle slab (16-bit elements)


@dataclass(frozen=True)
class DecodeVariant:
    """One compiled specialization: ``block_n`` keys per tile, ``stages`` ring slots, ``page_rows``
    keys per TMA box (the page size when pages are smaller than a tile, else the tile)."""
    head_dim: int = 128
    dtype: str = "bf16"
    block_n: int = 128
    stages: int = 3
    paged: bool = False
    page_rows: int = 0  # 0: the tile
    causal: bool = False
    batch_idx: bool = False
    pdl: bool = False  # programmatic dependent launch: may start while the previous kernel ends
    heads_first: bool = False  # grid (Hk, splits, B) rather than (splits, B, Hk)
    fp8: bool = False  # an e4m3 cache with per-key descales, ``dtype`` the query's
    # > 0: the transposed consumer, with the query rows (8, 16 or 32) as the N of its wgmmas (S^T =
    # K Q^T, O^T = V^T P^T); 0: 64 query rows as their M (16-bit caches only)
    rows_n: int = 0
    # e4m3: V^T widened into registers as the A operand of P V (no widened V tiles in shared
    # memory, whose 32 KB then go to ring stages)
    v_regs: bool = False
    regs: int = 0  # > 0: registers a thread (maxnreg), else from the CTAs per SM shared memory allows
    # e4m3: the producer loads each tile's descales into a shared ring (else the consumer, a tile
    # ahead)
    ds_ring: bool = False
    # e4m3: an e4m3 query (FlashAttention-3's FP8 call, ``dtype`` then the output's), and with
    # q_descale its (B, Hk) float32 descales
    q_fp8: bool = False
    q_descale: bool = False
    # e4m3: one K and one V descale a (sequence, KV head), FlashAttention-3's (B, Hk) on a paged
    # cache or one read through cache_batch_idx (descales (B, 1, Hk), indexed by the sequence),
    # read once by a program
    seq_ds: bool = False

    def __post_init__(self):
        if not self.page_rows or not self.paged:
            object.__setattr__(self, "page_rows", self.block_n)
        if self.fp8 and self.paged and not self.ds_ring and not self.seq_ds:
            # the consumer's own descale loads index a contiguous cache; the producer's follow pages
            raise ValueError("paged e4m3 caches: with ds_ring only")
        if (self.fp8 and not self.rows_n) or (self.rows_n and (self.rows_n not in (8, 16, 32)
                                                               or self.block_n != 64)):
            # (128-key tiles faulted with an illegal address on the H200 in fp8-decode-ab: not
            # investigated, not allowed; 64 rows spilled)
            raise ValueError("rows_n: 8, 16 or 32 query rows (required with e4m3 caches), 64-key "
                             "tiles")
        if (self.v_regs or self.ds_ring or self.q_fp8 or self.q_descale or self.seq_ds) \
                and not self.fp8:
            raise ValueError("v_regs, ds_ring, q_fp8, q_descale, seq_ds: e4m3 caches only")
        if self.seq_ds and self.ds_ring:
            raise ValueError("seq_ds: no descale ring (nothing to load per tile)")
        if self.head_dim % SLAB or self.block_n % self.page_rows or self.page_rows < 8:
            raise ValueError(f"decode variant {self}: head dim a multiple of 64, pages of >= 8 keys "
                             "dividing the tile")

    @property
    def name(self) -> str:
        kind = f"paged{self.page_rows}" if self.paged else "contiguous"
        return (f"decode-d{self.head_dim}-{self.dtype}-{kind}-n{self.block_n}-s{self.stages}"
                + ("-causal" if self.causal else "") + ("-batchidx" if self.batch_idx else "")
                + ("-pdl" if self.pdl else "") + ("-hf" if self.heads_first else "")
                + ("-e4m3" if self.fp8 else "") + (f"-t{self.rows_n}" if self.rows_n else "")
                + ("-vregs" if self.v_regs else "") + (f"-r{self.regs}" if self.regs else "")
                + ("-dsring" if self.ds_ring else "") + ("-q8" if self.q_fp8 else "")
                + ("-qds" if self.q_descale else "") + ("-seqds" if self.seq_ds else ""))

    @property
    def shared_bytes(self) -> int:
        if self.fp8:  # e4m3 ring (and its float32 descales), two e4m3 Q terms, two widened fp16 V
            # tiles (not with v_regs) and two P^T tiles
            return 2 * self.stages * self.block_n * (self.head_dim + (4 if self.ds_ring else 0)) \
                + 2 * self.rows_n * self.head_dim \
                + 2 * 2 * self.block_n * ((0 if self.v_regs else self.head_dim) + self.rows_n)
        if self.rows_n:  # the transposed consumer: Q of rows_n rows and two P^T tiles
            return 2 * (2 * self.stages * self.block_n * self.head_dim + self.rows_n * self.head_dim
                        + 2 * self.block_n * self.rows_n)
        return 2 * (2 * self.stages * self.block_n * self.head_dim + ROWS * self.head_dim)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

if _GLUON:

    @gluon.jit
    def _slab_rows(bufs, slot, slab, row0, PAGE_ROWS: gl.constexpr, SLAB_COLS: gl.constexpr,
                   SLAB_LAYOUT: gl.constexpr):
        """Rows [row0, row0 + PAGE_ROWS) of one slab (128 bytes of columns: 64 16-bit, 128 e4m3) of
        a ring slot's [BLOCK_N, D] tile."""
        BLOCK_N: gl.constexpr = bufs.shape[1]
        HEAD_DIM: gl.constexpr = bufs.shape[2]
        slabs = bufs.index(slot)._reinterpret(bufs.dtype, [HEAD_DIM // SLAB_COLS, BLOCK_N, SLAB_COLS],
                                              SLAB_LAYOUT)
        return slabs.index(slab).slice(row0, PAGE_ROWS)

    @gluon.jit
    def _program(HEADS_FIRST: gl.constexpr):
        """(split, batch, KV head, splits) of this program: the grid is (splits, B, Hk), or
        (Hk, splits, B) with ``HEADS_FIRST`` (a sequence's KV heads, which read the same cache rows,
        launched next to each other)."""
        if HEADS_FIRST:
            return gl.program_id(1), gl.program_id(2), gl.program_id(0), gl.num_programs(1)
        else:
            return gl.program_id(0), gl.program_id(1), gl.program_id(2), gl.num_programs(0)

    @gluon.jit
    def _split_tiles(seqlen_k, split, num_splits, BLOCK_N: gl.constexpr):
        """Key tiles [t_lo, t_hi) of this split of a sequence of seqlen_k keys."""
        tiles = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        chunk = (tiles + num_splits - 1) // num_splits
        t_lo = gl.minimum(split * chunk, tiles)
        return t_lo, gl.minimum(t_lo + chunk, tiles)

    @gluon.jit
    def _decode_producer(k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable, CacheSeqlens,
                         CacheBatchIdx, stride_btb, table_width, capacity, page_size, page_shift,
                         BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr,
                         PAGED: gl.constexpr, BATCH_IDX: gl.constexpr, HEADS_FIRST: gl.constexpr,
                         SLAB_COLS: gl.constexpr, SLAB_LAYOUT: gl.constexpr, ds_bufs=None,
                         KDescale=None, VDescale=None, stride_dsb=0, stride_dss=0, stride_dsh=0,
                         DS_RING: gl.constexpr = False):
        """1 warp: for each key tile of the split, its pages' numbers from the block table (loaded
        before the wait for the slot, so their latency hides under it), then one TMA box per page
        and slab for K and for V, all completing the slot's ``ready`` barrier. DS_RING: then the
        tile's K and V descales, loaded and stored to rows 2 slot and 2 slot + 1 of ``ds_bufs``
        [2 STAGES, BLOCK_N] (zeros past the sequence; on a paged cache from each key's page and
        slot, by the page numbers held here), and a second arrival on ``ready``: their latency waits
        here, in a warp that otherwise waits for free slots, and under the tile's TMA, not in the
        consumer's loop."""
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        PAGES: gl.constexpr = BLOCK_N // PAGE_ROWS
        TILE_BYTES: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * k_bufs.dtype.primitive_bitwidth // 8
        split, batch, kv_head, num_splits = _program(HEADS_FIRST)
        col0 = kv_head * HEAD_DIM
        table_row = batch.to(gl.int64) * stride_btb
        # The page numbers of a tile: one vector load, issued a tile ahead (before the wait for the
        # slot of the tile before), every lane holding all of them, so each number comes out of
        # the lane's own registers (spread over the lanes, each one took a chain of shuffles
        # between the TMA issues). The first tile's are loaded together with the sequence
        # length, for the split this program would have if the sequence filled its capacity, and
        # loaded again only where it does not.
        id_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [1], [0])
        offs = gl.arange(0, PAGES, layout=id_layout)
        ids_next = offs
        if PAGED:
            guess_lo, _ = _split_tiles(capacity, split, num_splits, BLOCK_N)
            first = (guess_lo * BLOCK_N >> page_shift) + offs
            ids_guess = gl.load(BlockTable + table_row + first, mask=first < table_width, other=0)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)
        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)
        cache_row = batch
        if BATCH_IDX:
            cache_row = gl.load(CacheBatchIdx + batch)
        row_base = cache_row * capacity  # a contiguous cache: this sequence's first row
        if DS_RING:
            ds_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
            ds_keys = gl.arange(0, BLOCK_N, layout=ds_layout)
            if PAGED:  # descales laid out like the page pool: (pages, page size, Hk)
                ds_base = kv_head.to(gl.int64) * stride_dsh
            else:
                ds_base = cache_row.to(gl.int64) * stride_dsb + kv_head.to(gl.int64) * stride_dsh
        if PAGED:
            first = (t_lo * BLOCK_N >> page_shift) + offs
            again = gl.load(BlockTable + table_row + first,
                            mask=(first < table_width) & (t_lo != guess_lo), other=0)
            ids_next = gl.where(t_lo == guess_lo, ids_guess, again)
        for t in range(t_lo, t_hi):
            i = t - t_lo
            slot = i % STAGES
            key0 = t * BLOCK_N
            ids = ids_next
            if PAGED:
                first = ((key0 + BLOCK_N) >> page_shift) + offs
                ids_next = gl.load(BlockTable + table_row + first,
                                   mask=(first < table_width) & (t + 1 < t_hi), other=0)
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), TILE_BYTES)
            if DS_RING and PAGED:
                ds_at = gl.zeros([BLOCK_N], gl.int64, layout=ds_layout)
            for p in gl.static_range(PAGES):
                if PAGED:
                    page = gl.sum(gl.where(offs == p, ids, 0), 0)
                    row = page * page_size
                    if PAGES == 1:  # a tile inside one page: from the tile's offset in the page
                        row += key0 & (page_size - 1)
                    if DS_RING:  # the descales of the keys this page holds
                        slot_in_page = (row - page * page_size) + ds_keys % PAGE_ROWS
                        # A page number outside the pool (only CUDA-graph capture or
                        # torch.compile let one through) reads the last page's descales: TMA
                        # zero-fills the tile itself, but pointer loads would leave the tensor.
                        # (Unsigned: a negative number clamps too, in one minimum. The rows of
                        # cache_batch_idx, BATCH_IDX's table, are clamped before the launch.)
                        ds_page = page
                        if not BATCH_IDX:
                            ds_page = gl.minimum(page.to(gl.uint32),
                                                 ((k_desc.shape[0] >> page_shift) - 1).to(gl.uint32))
                        ds_at = gl.where(ds_keys // PAGE_ROWS == p,
                                         ds_page.to(gl.int64) * stride_dsb
                                         + slot_in_page.to(gl.int64) * stride_dss, ds_at)
                else:
                    row = row_base + key0 + p * PAGE_ROWS
                for c in gl.static_range(HEAD_DIM // SLAB_COLS):
                    tma.async_copy_global_to_shared(
                        k_desc, [row, col0 + c * SLAB_COLS], ready.index(slot),
                        _slab_rows(k_bufs, slot, c, p * PAGE_ROWS, PAGE_ROWS, SLAB_COLS, SLAB_LAYOUT))
                    tma.async_copy_global_to_shared(
                        v_desc, [row, col0 + c * SLAB_COLS], ready.index(slot),
                        _slab_rows(v_bufs, slot, c, p * PAGE_ROWS, PAGE_ROWS, SLAB_COLS, SLAB_LAYOUT))
            if DS_RING:
                key = key0 + ds_keys
                if PAGED:
                    at = ds_base + ds_at
                else:
                    at = ds_base + key.to(gl.int64) * stride_dss
                ds_bufs.index(2 * slot).store(gl.load(KDescale + at, mask=key < seqlen_k, other=0.0))
                ds_bufs.index(2 * slot + 1).store(gl.load(VDescale + at, mask=key < seqlen_k, other=0.0))
                mbarrier.arrive(ready.index(slot))

    @gluon.jit
    def _loop_state(seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    s_layout: gl.constexpr, o_layout: gl.constexpr):
        """(each row's key position for the causal mask, score columns, running max, running sum,
        output accumulator, zero scores) before the first tile."""
        rows_s = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
        rows_pos = gl.expand_dims(rows_s % seqlen_q + seqlen_k - seqlen_q, 1)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([_ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        zero_s = gl.zeros([_ROWS, BLOCK_N], gl.float32, layout=s_layout)
        return rows_pos, cols, m_i, l_i, o, zero_s

    @gluon.jit
    def _softmax_step(s, m_i, l_i, scale):
        """Online softmax on a masked score tile, in base 2 (``scale`` includes log2(e)); returns
        (p, new max, new sum, the factor the accumulator takes)."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * scale - gl.expand_dims(m_new, 1))
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _load_q_rows(Q, batch, kv_head, seqlen_q, group_size, stride_qb, stride_qs, stride_qh,
                     HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """The [64, HEAD_DIM] query tile: row r is query head r // Sq of the KV head's group at
        position r % Sq; rows past the group are zeros."""
        r = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        g = r // seqlen_q
        qi = r % seqlen_q
        head = kv_head * group_size + g
        return gl.load(Q + batch.to(gl.int64) * stride_qb
                       + gl.expand_dims(qi * stride_qs + head * stride_qh, 1) + gl.expand_dims(d, 0),
                       mask=gl.expand_dims(g < group_size, 1), other=0.0)

    @gluon.jit
    def _decode_consumer(Q, OutPart, LsePart, Out, Lse, Sinks, q_smem, k_bufs, v_bufs, ready, empty,
                         CacheSeqlens, capacity, seqlen_q, group_size, qk_scale,
                         stride_qb, stride_qs, stride_qh, stride_os, stride_ob, stride_oq, stride_oh,
                         stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh,
                         stride_lrb, stride_lrh,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, EMPTY_LSE: gl.constexpr,
                         HEADS_FIRST: gl.constexpr, SINKS: gl.constexpr = False):
        """4 warps: S = Q K^T and O += P V by wgmma from the ring, the online softmax between."""
        split, batch, kv_head, num_splits = _program(HEADS_FIRST)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)
        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        dtype: gl.constexpr = k_bufs.dtype
        s_layout: gl.constexpr = _wgmma_layout(4, BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(4, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        # Q rows (query head g of the group, position qi) -> shared memory, once.
        q = _load_q_rows(Q, batch, kv_head, seqlen_q, group_size, stride_qb, stride_qs, stride_qh,
                         HEAD_DIM, io_layout)
        q_smem.store(q)
        fence_async_shared()

        rows_pos, cols, m_i, l_i, o, zero_s = _loop_state(seqlen_q, seqlen_k, BLOCK_N, HEAD_DIM,
                                                          s_layout, o_layout)
        for t in range(t_lo, t_hi):
            i = t - t_lo
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            k_tile = k_bufs.index(slot)
            v_tile = v_bufs.index(slot)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero_s, use_acc=False)
            keys = gl.expand_dims(t * BLOCK_N + cols, 0)
            keep = keys < seqlen_k
            if CAUSAL:
                keep = keep & (keys <= rows_pos)
            s = gl.where(keep, s, float("-inf"))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
            _zero_tail_rows(v_tile, t, seqlen_k, BLOCK_N, io_layout)
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(_to_16bit(p, dtype, True), p_layout)
            o = warpgroup_mma(p_op, v_tile, o)
            mbarrier.arrive(empty.index(slot))

        _write_rows(o, l_i, m_i, OutPart, LsePart, Out, Lse, split, batch, kv_head, seqlen_q,
                    group_size, stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb,
                    stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh, SPLIT,
                    WRITE_LSE, EMPTY_LSE, Sinks=Sinks, SINKS=SINKS)

    @gluon.jit
    def _write_rows(o, l_i, m_i, OutPart, LsePart, Out, Lse, split, batch, kv_head, seqlen_q,
                    group_size, stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb,
                    stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
                    SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, EMPTY_LSE: gl.constexpr,
                    ROWS_AXIS: gl.constexpr = 0, D_PAIRS: gl.constexpr = 0, Sinks=None,
                    SINKS: gl.constexpr = False):
        """The rows' output (divided by their sums) and natural-log LSE: a split's partials, or the
        result. Row r is query head r // Sq of the group at position r % Sq; the rows run along
        ``o``'s axis ROWS_AXIS (1: O^T of the transposed consumer). Stored from the wgmma layout
        itself: a layout change would take shared memory the ring needs. SINKS (unsplit only: a
        split launch's merge takes them): Sinks[head] one more logit of each row with no value,
        joined before the one rounding; rows that saw no key keep output 0 and EMPTY_LSE."""
        o_layout: gl.constexpr = o.type.layout
        R: gl.constexpr = ROWS_AXIS
        C: gl.constexpr = 1 - ROWS_AXIS
        N: gl.constexpr = o.shape[R]
        HEAD_DIM: gl.constexpr = o.shape[C]
        seen = l_i > 0.0
        rows_s = gl.arange(0, N, layout=l_i.type.layout)
        g_l = rows_s // seqlen_q
        q_l = rows_s % seqlen_q
        h_l = kv_head * group_size + g_l
        lse_ok = g_l < group_size
        scale = gl.full_like(l_i, 1.0)
        if SINKS:
            sink = gl.load(Sinks + h_l, mask=lse_ok, other=0.0).to(gl.float32) * 1.4426950408889634
            m_new = gl.where(seen, gl.maximum(m_i, sink), m_i)
            scale = gl.exp2(m_i - m_new)
            l_i = gl.where(seen, l_i * scale + gl.exp2(gl.minimum(sink - m_new, 0.0)), l_i)
            m_i = m_new
        l_safe = gl.where(seen, l_i, 1.0)
        lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
        o = o * gl.expand_dims(gl.convert_layout(scale / l_safe, gl.SliceLayout(C, o_layout)), C)
        ro = gl.arange(0, N, layout=gl.SliceLayout(C, o_layout))
        do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(R, o_layout))
        if D_PAIRS:  # o holds the even (1) or the odd (2) head dims only
            do = 2 * do + (D_PAIRS - 1)
        do = gl.expand_dims(do, R)
        go = ro // seqlen_q
        qo = ro % seqlen_q
        ho = kv_head * group_size + go
        o_ok = gl.expand_dims(go < group_size, C)
        if SPLIT:  # normalized partial output and its LSE (-inf where the split saw nothing)
            gl.store(OutPart + split.to(gl.int64) * stride_os + batch.to(gl.int64) * stride_ob
                     + gl.expand_dims(qo * stride_oq + ho * stride_oh, C) + do, o, mask=o_ok)
            if D_PAIRS < 2:  # (the odd half's call: the even one wrote the LSE)
                gl.store(LsePart + split.to(gl.int64) * stride_ls + batch.to(gl.int64) * stride_lb
                         + h_l * stride_lh + q_l, gl.where(seen, lse, float("-inf")), mask=lse_ok)
        else:
            gl.store(Out + batch.to(gl.int64) * stride_rb
                     + gl.expand_dims(qo * stride_rq + ho * stride_rh, C) + do,
                     o.to(Out.dtype.element_ty), mask=o_ok)
            if WRITE_LSE and D_PAIRS < 2:
                gl.store(Lse + batch.to(gl.int64) * stride_lrb + h_l * stride_lrh + q_l,
                         gl.where(seen, lse, EMPTY_LSE), mask=lse_ok)

    @gluon.jit
    def _load_q_cols(Q, batch, kv_head, seqlen_q, group_size, stride_qb, stride_qs, stride_qh,
                     N: gl.constexpr, HEAD_DIM: gl.constexpr):
        """The transposed consumers' [N, HEAD_DIM] query rows (query head n // Sq of the group at
        position n % Sq; rows past the group zero), in a blocked layout."""
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        r = gl.arange(0, N, layout=gl.SliceLayout(1, q_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        g = r // seqlen_q
        head = kv_head * group_size + g
        return gl.load(Q + batch.to(gl.int64) * stride_qb
                       + gl.expand_dims((r % seqlen_q) * stride_qs + head * stride_qh, 1)
                       + gl.expand_dims(d, 0), mask=gl.expand_dims(g < group_size, 1), other=0.0)

    @gluon.jit
    def _t_softmax(u, key, seqlen_k, cols_pos, m_i, CAUSAL: gl.constexpr):
        """Online-softmax step of the transposed consumers on a (keys, rows) tile of scores ``u``
        in log2 units: keys past the sequence (and, causal, past a row's position) masked; returns
        (p, the rows' new max, the factor their accumulators take)."""
        keep = gl.expand_dims(key < seqlen_k, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(key, 1) <= cols_pos)
        u = gl.where(keep, u, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(u, 0))
        return gl.exp2(u - gl.expand_dims(m_new, 0)), m_new, gl.exp2(m_i - m_new)

    @gluon.jit
    def _zero_tail_rows(v_tile, t, seqlen_k, BLOCK_N: gl.constexpr, io_layout: gl.constexpr):
        """The sequence's last tile: V rows past its end hold whatever the cache does there (0 x NaN
        would poison every row of P V); zero them where the wgmma reads."""
        if t * BLOCK_N + BLOCK_N > seqlen_k:
            v = v_tile.load(io_layout)
            v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
            keep_v = gl.expand_dims(t * BLOCK_N + v_rows < seqlen_k, 1)
            v_tile.store(gl.where(keep_v, v, gl.zeros_like(v)))
            fence_async_shared()
            gl.thread_barrier()

    @gluon.jit
    def _decode_consumer_t(Q, OutPart, LsePart, Out, Lse, Sinks, q_smem, pt_smem, k_bufs, v_bufs, ready,
                           empty, CacheSeqlens, capacity, seqlen_q, group_size, qk_scale,
                           stride_qb, stride_qs, stride_qh, stride_os, stride_ob, stride_oq,
                           stride_oh, stride_ls, stride_lb, stride_lh, stride_rb, stride_rq,
                           stride_rh, stride_lrb, stride_lrh,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                           SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, EMPTY_LSE: gl.constexpr,
                           HEADS_FIRST: gl.constexpr, SINKS: gl.constexpr = False):
        """4 warps, 16-bit cache, every tile transposed (as ``_decode_consumer_fp8``): S^T = K Q^T
        with the keys as the wgmma's M and the N query rows its N, the softmax on BLOCK_N x N
        scores, O^T += V^T P^T with V^T read straight from the ring (16-bit wgmma takes its A operand
        MN-major) and P^T from a small shared tile. Tile t's P V runs under tile t + 1's S and
        softmax, so its ring slot is released a tile later than S alone would allow."""
        split, batch, kv_head, num_splits = _program(HEADS_FIRST)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)
        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        N: gl.constexpr = q_smem.shape[0]
        dtype: gl.constexpr = k_bufs.dtype
        st_layout: gl.constexpr = _wgmma_layout(4, N, 16)  # S^T (keys, rows)
        ot_layout: gl.constexpr = _wgmma_layout(4, N, 16)  # O^T (head dim, rows)
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

        q_smem.store(_load_q_cols(Q, batch, kv_head, seqlen_q, group_size, stride_qb, stride_qs,
                                  stride_qh, N, HEAD_DIM))
        fence_async_shared()
        gl.thread_barrier()
        scale = qk_scale
        n_cols = gl.arange(0, N, layout=col_layout)
        cols_pos = gl.expand_dims(n_cols % seqlen_q + seqlen_k - seqlen_q, 0)  # causal bound per row
        keys0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        m_i = gl.full([N], -1.0e30, gl.float32, layout=col_layout)
        l_acc = gl.zeros([BLOCK_N, N], gl.float32, layout=st_layout)
        o_t = gl.zeros([HEAD_DIM, N], gl.float32, layout=ot_layout)
        zero_st = gl.zeros([BLOCK_N, N], gl.float32, layout=st_layout)
        if t_hi > t_lo:  # the first tile: no P V before it to overlap
            mbarrier.wait(ready.index(0), 0)
            _zero_tail_rows(v_bufs.index(0), t_lo, seqlen_k, BLOCK_N, io_layout)
            s = warpgroup_mma(k_bufs.index(0), q_smem.permute((1, 0)), zero_st, use_acc=False)
            p, m_i, alpha = _t_softmax(s * scale, t_lo * BLOCK_N + keys0, seqlen_k, cols_pos, m_i,
                                       CAUSAL)
            l_acc = p
            pt_smem.index(0).store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
        for t in range(t_lo + 1, t_hi):
            i = t - t_lo
            slot = i % STAGES
            prev = (i - 1) % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            k_tile = k_bufs.index(slot)
            _zero_tail_rows(v_bufs.index(slot), t, seqlen_k, BLOCK_N, io_layout)
            s_tok = warpgroup_mma(k_tile, q_smem.permute((1, 0)), zero_st, use_acc=False,
                                  is_async=True)
            v_prev = v_bufs.index(prev).permute((1, 0))
            pt_prev = pt_smem.index((i + 1) % 2)
            o_tok = warpgroup_mma(v_prev, pt_prev, o_t, is_async=True)
            s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, k_tile, q_smem))
            p, m_i, alpha = _t_softmax(s * scale, t * BLOCK_N + keys0, seqlen_k, cols_pos, m_i,
                                       CAUSAL)
            l_acc = l_acc * gl.expand_dims(alpha, 0) + p
            pt_smem.index(i % 2).store(p.to(dtype))
            o_t, _, _ = warpgroup_mma_wait(0, deps=(o_tok, v_prev, pt_prev))
            mbarrier.arrive(empty.index(prev))  # tile t - 1's K and V are both read now
            o_t = o_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout)), 0)
            fence_async_shared()
            gl.thread_barrier()
        if t_hi > t_lo:  # the last tile's P V
            last = (t_hi - t_lo - 1)
            o_t = warpgroup_mma(v_bufs.index(last % STAGES).permute((1, 0)), pt_smem.index(last % 2),
                                o_t)
            mbarrier.arrive(empty.index(last % STAGES))
        _write_rows(o_t, gl.sum(l_acc, 0), m_i, OutPart, LsePart, Out, Lse, split, batch, kv_head,
                    seqlen_q, group_size, stride_os, stride_ob, stride_oq, stride_oh, stride_ls,
                    stride_lb, stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
                    SPLIT, WRITE_LSE, EMPTY_LSE, 1, Sinks=Sinks, SINKS=SINKS)

    @gluon.jit
    def _s_part(k_tile, q_smem, c: gl.constexpr, zero_st):
        """S^T's share of head dims [32c, 32c + 32): one e4m3 wgmma step, asynchronous."""
        return warpgroup_mma(k_tile.slice(32 * c, 32, dim=1),
                             q_smem.slice(32 * c, 32, dim=1).permute((1, 0)), zero_st, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _v_pairs_operand(v_tile, a_layout: gl.constexpr):
        """V^T of an e4m3 ring slot [BLOCK_N keys, D] widened to fp16 as two A operands [D / 2,
        BLOCK_N] of O^T += V^T P^T: the even head dims and the odd ones (the caller keeps two O^T
        halves). The tile read as 16-bit pairs of dimensions goes through ldmatrix.trans (the
        128-byte swizzle is the same bytes at either element width); one cvt widens each key's pair
        (2m, 2m + 1) into the two halves' row m. (Loaded as bytes in V^T's own layout it took 64
        byte loads, 32 cvts and ~40 integer ops a thread per 64-key tile. One [D, BLOCK_N] operand
        joined from the halves compiled with every wgmma serialized by ptxas.)"""
        BLOCK_N: gl.constexpr = v_tile.shape[0]
        D: gl.constexpr = v_tile.shape[1]
        pairs = v_tile._reinterpret(gl.int16, [BLOCK_N, D // 2],
                                    gl.NVMMASharedLayout(128, 16)).permute((1, 0)).load(a_layout)
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [pairs], dtype=(gl.float16, gl.float16), is_pure=True, pack=1)

    @gluon.jit
    def _decode_consumer_fp8(Q, OutPart, LsePart, Out, Lse, Sinks, ds_bufs, KDescale, VDescale, qh_smem,
                               qm_smem, v16_smem, pt_smem, k_bufs, v_bufs, ready, empty,
                               CacheSeqlens, CacheBatchIdx, capacity, seqlen_q, group_size,
                               qk_scale, stride_qb, stride_qs, stride_qh, stride_dsb, stride_dss,
                               stride_dsh, stride_os, stride_ob, stride_oq, stride_oh,
                               stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh,
                               stride_lrb, stride_lrh,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, EMPTY_LSE: gl.constexpr,
                               HEADS_FIRST: gl.constexpr, BATCH_IDX: gl.constexpr,
                               V_REGS: gl.constexpr = False, DS_RING: gl.constexpr = False,
                               SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False,
                               SINKS: gl.constexpr = False):
        """4 warps, e4m3 cache, 16-bit or e4m3 query, every tile transposed: the keys are the wgmmas' M and
        the N (8-64) query rows their N, so the softmax runs on BLOCK_N x N scores (4 a thread at
        N = 8), not on 64 rows of which 4-6 are real. S^T = K Q^T by e4m3 wgmmas straight from the
        ring, the query as hi + mid e4m3 terms (q scaled by a power of two into [128, 256), hi its
        e4m3 rounding, mid the e4m3 rounding of the rest: bf16's 8 significant bits); K's per-key
        descales on the score rows: loaded here a tile ahead, or (DS_RING) left by the producer in
        ``ds_bufs`` rows 2 slot and 2 slot + 1 (loaded here, the loop waits for each load at its
        end, where the prefetched value moves into its loop-carried register: a third of the loop's
        stall samples at B16 12/2 16k). O^T += V^T P^T in fp16 (e4m3 widens to it in one cvt per pair)
        with V^T widened in registers as the A operand (V_REGS: byte loads of key pairs from the
        ring, so no widened tile, its stores and fence; the P V of a tile retires before the next
        tile, whose S accumulators then take the registers) or V
        widened into a shared tile (e4m3 wgmma takes its operands K-major only, and V's keys
        are its rows) and P^T stored next to it. V_PAIRS (with V_REGS, head dim 128): V^T
        as two A operands, the even and the odd head dims (_v_pairs_operand), O^T as two halves.

        V's per-key descale joins the exponent: u = s + log2(v_ds) (s the scaled score in log2
        units), P' = 2^(u - m_u) <= 1 weights the e4m3 V rows, and the row sum takes P' / v_ds =
        2^(s - m_u), so O = sum P' V / sum P' / v_ds needs no per-tile largest descale. A key whose
        descale is 0 (its V row is zero) counts in the sum with u = s and weight 0. Each thread
        keeps its own share of the row sums (reduced once at the end); the row max crosses the
        warps every tile. Without V_REGS each tile's P V runs under the next tile's S and softmax."""
        split, batch, kv_head, num_splits = _program(HEADS_FIRST)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)
        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        N: gl.constexpr = qh_smem.shape[0]
        st_layout: gl.constexpr = _wgmma_layout(4, N, 32)  # S^T (keys, rows)
        ot_layout: gl.constexpr = _wgmma_layout(4, N, 16)  # O^T (head dim, rows)
        key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])

        # Q rows (query head n // Sq of the group, position n % Sq) as hi + mid e4m3 terms.
        q = _load_q_cols(Q, batch, kv_head, seqlen_q, group_size, stride_qb, stride_qs, stride_qh, N,
                         HEAD_DIM).to(gl.float32)
        amax_bits = gl.max(gl.max(gl.abs(q), 1), 0).to(gl.int32, bitcast=True)
        shift = gl.minimum(gl.maximum(7 - ((amax_bits >> 23) - 127), -120), 120)
        q_scale = ((127 + shift) << 23).to(gl.float32, bitcast=True)
        q = q * q_scale
        q_hi = q.to(gl.float8e4nv)
        qh_smem.store(q_hi)
        qm_smem.store((q - q_hi.to(gl.float32)).to(gl.float8e4nv))
        score_scale = qk_scale / q_scale
        if not V_REGS:
            for b in gl.static_range(2):
                v16_smem.index(b).store(gl.zeros([BLOCK_N, HEAD_DIM], gl.float16, layout=io_layout))
                pt_smem.index(b).store(gl.zeros([BLOCK_N, N], gl.float16, layout=st_layout))
        # V_REGS: V^T [HEAD_DIM, BLOCK_N] read from the ring straight into the A operand's registers
        # (pairs of keys per head dim: byte loads), widened there
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ot_layout, k_width=2)
        fence_async_shared()
        gl.thread_barrier()

        cache_row = batch
        if BATCH_IDX:
            cache_row = gl.load(CacheBatchIdx + batch)
        ds_base = cache_row.to(gl.int64) * stride_dsb + kv_head.to(gl.int64) * stride_dsh
        n_cols = gl.arange(0, N, layout=col_layout)
        cols_pos = gl.expand_dims(n_cols % seqlen_q + seqlen_k - seqlen_q, 0)  # causal bound per row
        keys0 = gl.arange(0, BLOCK_N, layout=key_layout)
        v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        m_u = gl.full([N], -1.0e30, gl.float32, layout=col_layout)
        l_acc = gl.zeros([BLOCK_N, N], gl.float32, layout=st_layout)
        # V_PAIRS: O^T as two halves, o_t the even head dims and o_odd the odd ones
        o_t = gl.zeros([HEAD_DIM // 2 if V_PAIRS else HEAD_DIM, N], gl.float32, layout=ot_layout)
        o_odd = gl.zeros([HEAD_DIM // 2, N], gl.float32, layout=ot_layout)
        zero_st = gl.zeros([BLOCK_N, N], gl.float32, layout=st_layout)
        key = t_lo * BLOCK_N + keys0
        k_ds_next = gl.zeros([BLOCK_N], gl.float32, layout=key_layout)
        v_ds_next = k_ds_next
        if SEQ_DS:  # the sequence's one K and one V descale, for every tile (keys past the
            # sequence are masked in the softmax, their V rows zeroed)
            seq_base = batch.to(gl.int64) * stride_dsb + kv_head.to(gl.int64) * stride_dsh
            k_ds_next = k_ds_next + gl.load(KDescale + seq_base)
            v_ds_next = v_ds_next + gl.load(VDescale + seq_base)
        elif not DS_RING:
            k_ds_next = gl.load(KDescale + ds_base + key.to(gl.int64) * stride_dss,
                                mask=key < seqlen_k, other=0.0)
            v_ds_next = gl.load(VDescale + ds_base + key.to(gl.int64) * stride_dss,
                                mask=key < seqlen_k, other=0.0)
        for t in range(t_lo, t_hi):
            i = t - t_lo
            slot = i % STAGES
            key = t * BLOCK_N + keys0
            k_ds = k_ds_next
            v_ds = v_ds_next
            if not DS_RING and not SEQ_DS:
                nxt = key + BLOCK_N
                k_ds_next = gl.load(KDescale + ds_base + nxt.to(gl.int64) * stride_dss,
                                    mask=nxt < seqlen_k, other=0.0)
                v_ds_next = gl.load(VDescale + ds_base + nxt.to(gl.int64) * stride_dss,
                                    mask=nxt < seqlen_k, other=0.0)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            k_tile = k_bufs.index(slot)
            # S^T as eight one-step e4m3 wgmmas (32 head dims of one query term each) into their
            # own accumulators, added in fp32: an e4m3 wgmma keeps a running sum of more products
            # in reduced precision (4 values a thread at N = 8: 28 adds).
            # (At head dim 64 the parts past it are the first ones again, never read.)
            C: gl.constexpr = HEAD_DIM // 32
            s0 = _s_part(k_tile, qh_smem, 0, zero_st)
            s1 = _s_part(k_tile, qh_smem, 1, zero_st)
            s2 = _s_part(k_tile, qh_smem, 2 % C, zero_st)
            s3 = _s_part(k_tile, qh_smem, 3 % C, zero_st)
            s4 = _s_part(k_tile, qm_smem, 0, zero_st)
            s5 = _s_part(k_tile, qm_smem, 1, zero_st)
            s6 = _s_part(k_tile, qm_smem, 2 % C, zero_st)
            s7 = _s_part(k_tile, qm_smem, 3 % C, zero_st)
            if V_REGS:
                s0, s1, s2, s3, s4, s5, s6, s7, _, _, _ = warpgroup_mma_wait(
                    0, deps=(s0, s1, s2, s3, s4, s5, s6, s7, k_tile, qh_smem, qm_smem))
            else:
                # The tile before's P V (zeros before the first tile), under this tile's S and
                # softmax.
                prev = (i + 1) % 2
                o_tok = warpgroup_mma(v16_smem.index(prev).permute((1, 0)), pt_smem.index(prev), o_t,
                                      is_async=True)
                s0, s1, s2, s3, s4, s5, s6, s7, _, _, _ = warpgroup_mma_wait(
                    1, deps=(s0, s1, s2, s3, s4, s5, s6, s7, k_tile, qh_smem, qm_smem))
            if C == 4:
                s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
            else:
                s = (s0 + s1) + (s4 + s5)
            if V_REGS:
                _zero_tail_rows(v_bufs.index(slot), t, seqlen_k, BLOCK_N, io_layout)
                if V_PAIRS:
                    v_even, v_odd = _v_pairs_operand(v_bufs.index(slot), a_layout)
                else:
                    v_a = v_bufs.index(slot).permute((1, 0)).load(a_layout).to(gl.float16)
            else:
                v8 = v_bufs.index(slot).load(io_layout)
            if DS_RING:
                k_ds = ds_bufs.index(2 * slot).load(key_layout)
                v_ds = ds_bufs.index(2 * slot + 1).load(key_layout)
            mbarrier.arrive(empty.index(slot))  # K, V and their descales are out of the ring
            has_v = v_ds > 0.0
            log_v = gl.where(has_v, gl.log2(gl.where(has_v, v_ds, 1.0)), 0.0)
            u = s * gl.expand_dims(k_ds * score_scale, 1) + gl.expand_dims(log_v, 1)
            p, m_u, alpha = _t_softmax(u, key, seqlen_k, cols_pos, m_u, CAUSAL)
            l_acc = l_acc * gl.expand_dims(alpha, 0) + p * gl.expand_dims(gl.exp2(-log_v), 1)
            p16 = gl.where(gl.expand_dims(has_v, 1), p, 0.0).to(gl.float16)
            if V_REGS:
                # P^T in the buffer the P V of tile t - 2 read. This tile's P V is waited for here:
                # left in flight into the next tile's TMA wait, as it was until 2026-12-03, ptxas
                # serialized every wgmma of the loop (the S ones too) in 11 of the 60 compiled
                # variants (the C7515 advisory: causal, batch_idx, e4m3 query, paged, head dim 64).
                pt_smem.index(i % 2).store(p16)
                alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout)), 0)
                o_t = o_t * alpha_o
                if V_PAIRS:
                    o_odd = o_odd * alpha_o
                fence_async_shared()
                gl.thread_barrier()
                if V_PAIRS:
                    even_tok = warpgroup_mma(v_even, pt_smem.index(i % 2), o_t, is_async=True)
                    odd_tok = warpgroup_mma(v_odd, pt_smem.index(i % 2), o_odd, is_async=True)
                    o_t, o_odd, _, _, _ = warpgroup_mma_wait(
                        0, deps=(even_tok, odd_tok, v_even, v_odd, pt_smem))
                else:
                    o_tok = warpgroup_mma(v_a, pt_smem.index(i % 2), o_t, is_async=True)
                    o_t, _, _ = warpgroup_mma_wait(0, deps=(o_tok, v_a, pt_smem))
            else:
                v16 = v8.to(gl.float16)
                if t * BLOCK_N + BLOCK_N > seqlen_k:
                    # Rows past the sequence (its last tile) hold whatever the cache does: zeros.
                    v16 = gl.where(gl.expand_dims(t * BLOCK_N + v_rows < seqlen_k, 1), v16,
                                   gl.zeros_like(v16))
                # Two V / P^T buffers: tile t's go to the one P V of tile t - 2 read, retired by
                # every warp before the last tile's closing barrier, so no warp waits for another.
                v16_smem.index(i % 2).store(v16)
                pt_smem.index(i % 2).store(p16)
                o_t, _, _ = warpgroup_mma_wait(0, deps=(o_tok, v16_smem, pt_smem))
                o_t = o_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout)), 0)
                fence_async_shared()
                gl.thread_barrier()
        if not V_REGS and t_hi > t_lo:
            last = (t_hi - t_lo + 1) % 2
            o_t = warpgroup_mma(v16_smem.index(last).permute((1, 0)), pt_smem.index(last), o_t)
        l_i = gl.sum(l_acc, 0)
        _write_rows(o_t, l_i, m_u, OutPart, LsePart, Out, Lse, split, batch, kv_head,
                    seqlen_q, group_size, stride_os, stride_ob, stride_oq, stride_oh, stride_ls,
                    stride_lb, stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
                    SPLIT, WRITE_LSE, EMPTY_LSE, 1, 1 if V_PAIRS else 0, Sinks=Sinks, SINKS=SINKS)
        if V_PAIRS:
            _write_rows(o_odd, l_i, m_u, OutPart, LsePart, Out, Lse, split, batch, kv_head,
                        seqlen_q, group_size, stride_os, stride_ob, stride_oq, stride_oh, stride_ls,
                        stride_lb, stride_lh, stride_rb, stride_rq, stride_rh, stride_lrb,
                        stride_lrh, SPLIT, WRITE_LSE, EMPTY_LSE, 1, 2, Sinks=Sinks, SINKS=SINKS)

    @gluon.jit
    def _attn_decode_gluon(k_desc, v_desc, Q, OutPart, LsePart, Out, Lse, CacheSeqlens,
                           CacheBatchIdx, BlockTable, KDescale, VDescale, QDescale, Sinks,
                           stride_qb, stride_qs, stride_qh, stride_dsb, stride_dss, stride_dsh,
                           stride_os, stride_ob, stride_oq, stride_oh,
                           stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh,
                           stride_lrb, stride_lrh, stride_btb, seqlen_q, capacity, group_size,
                           qk_scale, page_size, page_shift, table_width,
                           BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr,
                           PAGED: gl.constexpr, PDL: gl.constexpr, BATCH_IDX: gl.constexpr,
                           HEADS_FIRST: gl.constexpr,
                           CAUSAL: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
                           EMPTY_LSE: gl.constexpr, HEAD_DIM: gl.constexpr,
                           TILE_LAYOUT: gl.constexpr, SLAB_LAYOUT: gl.constexpr,
                           Q_LAYOUT: gl.constexpr, SLAB_COLS: gl.constexpr, FP8: gl.constexpr,
                           V16_LAYOUT: gl.constexpr, ROWS_N: gl.constexpr = 0,
                           PT_LAYOUT: gl.constexpr = None, V_REGS: gl.constexpr = False,
                           DS_RING: gl.constexpr = False, Q_DESCALE: gl.constexpr = False,
                           SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False,
                           SINKS: gl.constexpr = False):
        """Grid (splits, B, Hk). ``capacity``: keys a sequence can hold (S_max, or pages x page
        size); a contiguous cache is rows of ``capacity`` keys per cache row, a paged one rows of
        ``page_size`` keys per page. Layouts: TILE_LAYOUT the [BLOCK_N, HEAD_DIM] K/V tile's,
        SLAB_LAYOUT the same bytes as [HEAD_DIM // SLAB_COLS, BLOCK_N, SLAB_COLS], Q_LAYOUT the
        [64, HEAD_DIM] Q's (e4m3 with ``FP8``). FP8: an e4m3 cache with float32 descales (one per
        key and KV head, strides dsb, dss, dsh like the contiguous cache's rows), a 16-bit query;
        V16_LAYOUT the widened bf16 V tile's."""
        dtype: gl.constexpr = k_desc.dtype
        if PDL:  # launched before the previous kernel ends: touch no memory until it has
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)
        # An e4m3 query's descale, (B, Hk) contiguous (one per sequence and KV head), joins the score
        # scale here, so the partitions take no more arguments (and the kernel no stride: with one
        # more parameter two variants spilled, whatever Q_DESCALE).
        if Q_DESCALE:
            _, q_batch, q_kv_head, _ = _program(HEADS_FIRST)
            heads_k = gl.num_programs(0) if HEADS_FIRST else gl.num_programs(2)
            qk_scale = qk_scale * gl.load(QDescale + q_batch.to(gl.int64) * heads_k + q_kv_head)

        # the producer keeps a tile's page numbers (and the next tile's) in every lane
        PRODUCER_REGS: gl.constexpr = 32 if PAGED or DS_RING else 24
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # DS_RING: the TMA bytes' arrival and the producer's once the descales are stored
            mbarrier.init(ready.index(i), count=2 if DS_RING else 1)
            mbarrier.init(empty.index(i), count=1)
        if FP8:
            qh_smem = gl.allocate_shared_memory(dtype, [ROWS_N, HEAD_DIM], Q_LAYOUT)
            qm_smem = gl.allocate_shared_memory(dtype, [ROWS_N, HEAD_DIM], Q_LAYOUT)
            pt_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, ROWS_N], PT_LAYOUT)
            ds_bufs = pt_smem if not DS_RING else gl.allocate_shared_memory(
                gl.float32, [2 * STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            # (V_REGS: no widened V tiles; the consumer never reads the argument)
            v16_smem = pt_smem if V_REGS else gl.allocate_shared_memory(
                gl.float16, [2, BLOCK_N, HEAD_DIM], V16_LAYOUT)
            gl.warp_specialize([
                (_decode_consumer_fp8, (Q, OutPart, LsePart, Out, Lse, Sinks, ds_bufs, KDescale, VDescale,
                                          qh_smem, qm_smem, v16_smem, pt_smem, k_bufs, v_bufs, ready,
                                          empty, CacheSeqlens, CacheBatchIdx, capacity, seqlen_q,
                                          group_size, qk_scale, stride_qb, stride_qs, stride_qh,
                                          stride_dsb, stride_dss, stride_dsh,
                                          stride_os, stride_ob, stride_oq,
                                          stride_oh, stride_ls, stride_lb, stride_lh, stride_rb,
                                          stride_rq, stride_rh, stride_lrb, stride_lrh, BLOCK_N, STAGES,
                                          CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE, HEADS_FIRST,
                                          BATCH_IDX, V_REGS, DS_RING, SEQ_DS, V_PAIRS, SINKS)),
                (_decode_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable,
                                    CacheSeqlens, CacheBatchIdx, stride_btb, table_width, capacity,
                                    page_size, page_shift, BLOCK_N, PAGE_ROWS, STAGES, PAGED,
                                    BATCH_IDX, HEADS_FIRST, SLAB_COLS, SLAB_LAYOUT, ds_bufs,
                                    KDescale, VDescale, stride_dsb, stride_dss, stride_dsh, DS_RING)),
            ], [1], [PRODUCER_REGS])
        elif ROWS_N > 0:
            q_smem = gl.allocate_shared_memory(dtype, [ROWS_N, HEAD_DIM], Q_LAYOUT)
            pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROWS_N], PT_LAYOUT)
            gl.warp_specialize([
                (_decode_consumer_t, (Q, OutPart, LsePart, Out, Lse, Sinks, q_smem, pt_smem, k_bufs, v_bufs,
                                      ready, empty, CacheSeqlens, capacity, seqlen_q, group_size,
                                      qk_scale, stride_qb, stride_qs, stride_qh, stride_os, stride_ob,
                                      stride_oq, stride_oh, stride_ls, stride_lb, stride_lh,
                                      stride_rb, stride_rq, stride_rh, stride_lrb, stride_lrh,
                                      BLOCK_N, STAGES, CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE,
                                      HEADS_FIRST, SINKS)),
                (_decode_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable,
                                    CacheSeqlens, CacheBatchIdx, stride_btb, table_width, capacity,
                                    page_size, page_shift, BLOCK_N, PAGE_ROWS, STAGES, PAGED,
                                    BATCH_IDX, HEADS_FIRST, SLAB_COLS, SLAB_LAYOUT)),
            ], [1], [PRODUCER_REGS])
        else:
            q_smem = gl.allocate_shared_memory(dtype, [_ROWS, HEAD_DIM], Q_LAYOUT)
            gl.warp_specialize([
                (_decode_consumer, (Q, OutPart, LsePart, Out, Lse, Sinks, q_smem, k_bufs, v_bufs, ready,
                                    empty, CacheSeqlens, capacity, seqlen_q, group_size, qk_scale,
                                    stride_qb, stride_qs, stride_qh, stride_os, stride_ob,
                                    stride_oq, stride_oh, stride_ls, stride_lb, stride_lh, stride_rb,
                                    stride_rq, stride_rh, stride_lrb, stride_lrh,
                                    BLOCK_N, STAGES, CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE, HEADS_FIRST,
                                    SINKS)),
                (_decode_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable,
                                    CacheSeqlens, CacheBatchIdx, stride_btb, table_width, capacity,
                                    page_size, page_shift, BLOCK_N, PAGE_ROWS, STAGES, PAGED,
                                    BATCH_IDX, HEADS_FIRST, SLAB_COLS, SLAB_LAYOUT)),
            ], [1], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _layouts(block_n: int, page_rows: int, head_dim: int, dtype: str, fp8: bool = False,
             rows_n: int = 0):
    """(tile, slab view, Q, TMA box, widened V) shared layouts; slab columns. ``fp8``: the cache
    and the Q terms are e4m3, the widened V tile fp16. ``rows_n``: Q has that many rows."""
    el = gl.float8e4nv if fp8 else getattr(gl, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    cols = min(head_dim, 128 if fp8 else SLAB)  # 128 bytes of columns: one swizzle span
    tile = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], el)
    slab = gl.NVMMASharedLayout.get_default_for([block_n, cols], el)
    q = gl.NVMMASharedLayout.get_default_for([rows_n or ROWS, head_dim], el)
    box = gl.NVMMASharedLayout.get_default_for([page_rows, cols], el)
    v16 = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl.float16)
    return tile, slab, q, box, v16, cols


@functools.lru_cache(maxsize=None)
def _pt_layout(block_n: int, rows_n: int):
    """Shared layout of the transposed consumers' 16-bit P^T tile [block_n keys, rows_n rows]."""
    return gl.NVMMASharedLayout.get_default_for([block_n, max(rows_n, 8)], gl.float16)


@functools.lru_cache(maxsize=None)
def _options(variant: DecodeVariant, split: bool, write_lse: bool, sinks: bool = False) -> dict:
    """Constexprs and launch shape (one dict per value: ``launch`` keys options by identity);
    ``sinks``: the unsplit epilogue takes attention sinks."""
    tile, slab, q, _, v16, cols = _layouts(variant.block_n, variant.page_rows, variant.head_dim,
                                           variant.dtype, variant.fp8, variant.rows_n)
    return dict(BLOCK_N=variant.block_n, PAGE_ROWS=variant.page_rows, STAGES=variant.stages,
                PAGED=variant.paged, PDL=variant.pdl, BATCH_IDX=variant.batch_idx,
                HEADS_FIRST=variant.heads_first,
                CAUSAL=variant.causal, SPLIT=split, WRITE_LSE=write_lse or split,
                EMPTY_LSE=math.inf, HEAD_DIM=variant.head_dim, TILE_LAYOUT=tile, SLAB_LAYOUT=slab,
                Q_LAYOUT=q, SLAB_COLS=cols, FP8=variant.fp8, V16_LAYOUT=v16,
                ROWS_N=variant.rows_n, PT_LAYOUT=_pt_layout(variant.block_n, variant.rows_n),
                V_REGS=variant.v_regs, DS_RING=variant.ds_ring, Q_DESCALE=variant.q_descale,
                SEQ_DS=variant.seq_ds,
                V_PAIRS=variant.v_regs and V_PAIRS and variant.head_dim % 128 == 0, SINKS=sinks and not split,
                **_launch_shape(variant), **({"launch_pdl": True} if variant.pdl else {}))


def _launch_shape(variant: DecodeVariant) -> dict:
    # 4 consumer + 1 producer warps launch as 8; two CTAs per SM (the 64-key ring) need registers
    # for both: 128 per thread, of which the producer warp keeps 24.
    if variant.regs:
        return {"num_warps": 4, "maxnreg": variant.regs}
    if variant.rows_n and not (variant.fp8 and variant.rows_n > 16) \
            and 3 * (variant.shared_bytes + 2048) <= 228 * 1024:
        # the transposed consumers: three CTAs per SM (e4m3 with 32 rows spilled at 80 registers
        # at head dim 64: its plan, decode.GLUON_E4M3_ROWS32, is two per SM)
        return {"num_warps": 4, "maxnreg": 80}
    if 2 * (variant.shared_bytes + 2048) <= 228 * 1024:
        return {"num_warps": 4, "maxnreg": 128}
    return {"num_warps": 4}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def rows_viewable(cache: torch.Tensor) -> bool:
    """Whether the cache reads as the 2-D (rows, Hk x D) tensor the descriptors take: contiguous,
    16-byte aligned rows (TMA), row coordinates in int32. Checked without building the view: it
    runs on every decode call."""
    return (cache.dim() == 4 and cache.is_contiguous() and cache.data_ptr() % 16 == 0
            and cache.shape[0] * cache.shape[1] < 2 ** 31 - 2 ** 20
            and (cache.shape[2] * cache.shape[3] * cache.element_size()) % 16 == 0)


def cache_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as the 2-D (rows, Hk x D) tensor the descriptors read, or None (rows_viewable)."""
    if not rows_viewable(cache):
        return None
    return cache.view(cache.shape[0] * cache.shape[1], cache.shape[2] * cache.shape[3])


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool,
              window: bool, softcap: bool, alibi: bool, leftpad: bool, k_descale=None,
              v_descale=None) -> bool:
    """Whether this kernel takes the call (else the portable one does): sm_90, 16-bit q and cache
    of one dtype (or an e4m3 cache, contiguous or paged, with a bf16 query, float32 descales of one
    layout and at most 32 query rows per KV head), head dim 64 or 128, at most 64 query rows per KV
    head, no window, softcap, ALiBi or left padding; paged: pages of 8-256 keys, a power of two."""
    if not _GLUON or q.device.type != "cuda" or window or softcap or alibi or leftpad:
        return False
    if k_cache.dtype == torch.float8_e4m3fn:
        if (q.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype
                or k_descale is None
                or q.shape[2] // k_cache.shape[2] * q.shape[1] > 32
                or v_descale is None or k_descale.dtype != torch.float32
                or v_descale.dtype != torch.float32 or k_descale.stride() != v_descale.stride()
                or k_descale.dim() != 3):
            return False
    elif q.dtype not in _NAMES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    if head_dim not in (64, 128) or heads % heads_k or heads // heads_k * seqlen_q > ROWS:
        return False
    if paged:
        page = k_cache.shape[1]
        if page < 8 or page > 256 or page & (page - 1):
            return False
    if k_cache.shape != v_cache.shape or not rows_viewable(k_cache) or not rows_viewable(v_cache):
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _arch(index) == 90


def gluon_decode(q, k_cache, v_cache, cache_seqlens, *, softmax_scale: float, causal: bool,
                 splits: int, variant: DecodeVariant, block_table=None, cache_batch_idx=None,
                 need_lse: bool = True, k_descale=None, v_descale=None, q_descale=None,
                 combine_options: dict | None = None, sinks=None):
    # (q_descale: (B, Hk) rows of Hk contiguous values, decode.descale_rows)
    """One decode launch (plus the merge when ``splits`` > 1) on inputs ``supported`` accepts, with
    a variant matching them (decode.py's plan picks it). Returns out (B, Sq, H, D) in q's dtype and
    lse (B, H, Sq) float32 (+inf where a row saw no key), or None when not needed and unsplit.
    ``combine_options``: the merge's, as the plan made them (default: a plain PDL merge);
    ``sinks`` (H,): attention sinks, taken by the kernel's epilogue unsplit, by the merge split
    (where its options have SINKS)."""
    from .decode import _combine_options, _launch_combine

    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    split = splits > 1
    write_lse = need_lse or split
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    out = torch.empty(batch, seqlen_q, heads, head_dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device) if write_lse else None
    if out.numel() == 0:
        return out, lse
    if split:
        out_partial = torch.empty(splits, batch, seqlen_q, heads, head_dim, dtype=torch.float32,
                                  device=q.device)
        lse_partial = torch.empty(splits, batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    else:
        out_partial, lse_partial = out, out if lse is None else lse
    _, _, _, box, _, cols = _layouts(variant.block_n, variant.page_rows, head_dim, variant.dtype,
                                     variant.fp8)
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    descriptors = (_Descriptor(k_rows, k_rows.shape, k_rows.stride(), (variant.page_rows, cols), box),
                   _Descriptor(v_rows, v_rows.shape, v_rows.stride(), (variant.page_rows, cols), box))
    lse_t = out if lse is None else lse
    epilogue_sinks = sinks if sinks is not None and not split else None
    tensors = (q, out_partial, lse_partial, out, lse_t, cache_seqlens, cache_batch_idx, block_table,
               k_descale, v_descale, q_descale, epilogue_sinks)
    part = out_partial.stride()[:4] if split else (0, 0, 0, 0)
    lpart = lse_partial.stride()[:3] if split else (0, 0, 0)
    ds = k_descale.stride() if k_descale is not None else (0, 0, 0)
    scalars = (*q.stride()[:3], *ds, *part, *lpart, *out.stride()[:3],
               *(lse.stride()[:2] if lse is not None else (0, 0)),
               block_table.stride(0) if paged else 0, seqlen_q, capacity, heads // heads_k,
               softmax_scale * LOG2E, page_size if paged else 1,
               page_size.bit_length() - 1 if paged else 0, block_table.shape[1] if paged else 0)
    grid = (heads_k, splits, batch) if variant.heads_first else (splits, batch, heads_k)
    launch(_attn_decode_gluon, grid, tensors, scalars,
           _options(variant, split, need_lse, epilogue_sinks is not None), descriptors)
    if split:
        merge = combine_options or _combine_options(splits, head_dim, math.inf, True)
        _launch_combine(out_partial, lse_partial, out, lse, merge, sinks if merge["SINKS"] else None)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# ----------------------------------------------------------------------------------------------

def compile_for_sm90(variant: DecodeVariant, split: bool | str = True):
    """Compile a variant to a cubin for sm_90 the way a launch would (see gluon_forward); ``split``
    "sinks": unsplit, the epilogue taking attention sinks."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    dt = variant.dtype
    _, _, _, box, _, cols = _layouts(variant.block_n, variant.page_rows, variant.head_dim, dt,
                                     variant.fp8)
    desc = f"tensordesc<{'fp8e4nv' if variant.fp8 else dt}[{variant.page_rows}, {cols}],{box!r}>"
    fn = _attn_decode_gluon
    sinks = split == "sinks"
    split = split is True
    constexprs = _options(variant, split, True, sinks)
    if not variant.q_descale:  # as a launch passes it: None, which the JIT makes a constexpr
        constexprs = {**constexprs, "QDescale": None}
    if not sinks:
        constexprs = {**constexprs, "Sinks": None}
    signature, attrs = {"k_desc": desc, "v_desc": desc,
                        "Q": "*fp8e4nv" if variant.q_fp8 else f"*{dt}", "OutPart": "*fp32",
                        "LsePart": "*fp32", "Out": f"*{dt}", "Lse": "*fp32",
                        "CacheSeqlens": "*i32", "CacheBatchIdx": "*i32", "BlockTable": "*i32",
                        "KDescale": "*fp32", "VDescale": "*fp32", "QDescale": "*fp32",
                        "Sinks": "*fp32", "qk_scale": "fp32"}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "OutPart", "LsePart", "Out", "Lse"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    src = GluonASTSource(fn, signature, {k: v for k, v in constexprs.items()
                                         if k not in ("num_warps", "maxnreg", "launch_pdl")}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=_launch_shape(variant))


def _checked() -> list[tuple[DecodeVariant, bool | str]]:
    """What the compile check builds: the plans (decode.GLUON_ONE_PER_SM, GLUON_TWO_PER_SM) at both
    head dims and dtypes, pages smaller than, equal to and larger than a tile, causal, batch_idx,
    unsplit, contiguous caches, and the e4m3-cache form (compiled, not dispatched)."""
    out = []
    for d in (64, 128):
        for dt in ("bf16", "fp16"):
            for stages in (4, 3):
                out.append((DecodeVariant(d, dt, 64, stages, True, 16, pdl=True, heads_first=True),
                            True))
    base = DecodeVariant(128, "bf16", 64, 4, True, 16, pdl=True, heads_first=True)
    for change in ({"page_rows": 8}, {"page_rows": 64}, {"causal": True}, {"batch_idx": True}):
        out.append((dataclasses.replace(base, **change), True))
    out.append((base, False))
    contiguous = DecodeVariant(128, "bf16", 64, 4, pdl=True, heads_first=True)
    out += [(contiguous, True), (contiguous, False)]
    # the transposed 16-bit consumer (decode.GLUON_T16_LONG: 4 stages, one CTA per SM;
    # GLUON_T16_SHORT: 3 stages, two per SM)
    t16 = dataclasses.replace(base, rows_n=8)
    out += [(t16, True), (t16, False), (dataclasses.replace(t16, stages=3), True),
            (dataclasses.replace(t16, causal=True, rows_n=16, dtype="fp16"), True),
            (dataclasses.replace(contiguous, rows_n=8), True),
            (dataclasses.replace(t16, head_dim=64, rows_n=32, batch_idx=True), True)]
    # the e4m3 form (decode.GLUON_E4M3: 2 stages, three CTAs per SM; GLUON_E4M3_WIDE: 4 stages,
    # two per SM) at every query-row count
    fp8 = DecodeVariant(128, "bf16", 64, 2, pdl=True, heads_first=True, fp8=True, rows_n=8)
    out += [(fp8, True), (fp8, False), (dataclasses.replace(fp8, causal=True, batch_idx=True), True),
            (dataclasses.replace(fp8, head_dim=64, rows_n=16), True),
            (dataclasses.replace(fp8, rows_n=16), True), (dataclasses.replace(fp8, rows_n=32), True),
            (dataclasses.replace(fp8, stages=4), True)]
    # V^T in registers (decode.E4M3_V_REGS): three per SM (80 registers) at 8 and 16 rows, four per
    # SM (64) at 8
    vregs = dataclasses.replace(fp8, v_regs=True)
    out += [(vregs, True), (dataclasses.replace(vregs, rows_n=16), True),
            (dataclasses.replace(vregs, regs=64), True), (dataclasses.replace(vregs, regs=64), False),
            (dataclasses.replace(vregs, regs=64, causal=True, batch_idx=True), True),
            (dataclasses.replace(vregs, head_dim=64, rows_n=16), True)]
    # ... with the descales loaded by the producer into a shared ring (short splits)
    ring = dataclasses.replace(vregs, ds_ring=True)
    out += [(ring, True), (dataclasses.replace(ring, rows_n=16), True),
            (dataclasses.replace(ring, regs=64), True),
            (dataclasses.replace(ring, regs=64, causal=True, batch_idx=True), False),
            (dataclasses.replace(ring, head_dim=64, rows_n=16), True)]
    # paged e4m3 caches (always with the descale ring): pages smaller than, equal to and larger
    # than a tile, three and four per SM
    paged = dataclasses.replace(ring, paged=True, page_rows=16)
    out += [(paged, True), (paged, False), (dataclasses.replace(paged, page_rows=8, regs=64), True),
            (dataclasses.replace(paged, page_rows=64, causal=True), True),
            (dataclasses.replace(paged, page_rows=64, rows_n=16, regs=0), True),
            (dataclasses.replace(paged, head_dim=64, rows_n=16), True)]
    # ... and 17-32 query rows a KV head (decode.GLUON_E4M3_ROWS32: two per SM), V widened into
    # shared tiles
    rows32 = dataclasses.replace(paged, rows_n=32, v_regs=False, regs=0)
    out += [(rows32, True), (dataclasses.replace(rows32, causal=True), True),
            (dataclasses.replace(rows32, page_rows=64, causal=True), True),
            (dataclasses.replace(rows32, page_rows=8, head_dim=64, batch_idx=True), False),
            (dataclasses.replace(fp8, rows_n=32, causal=True, ds_ring=True), True)]
    # FlashAttention-3's FP8 call: an e4m3 query with its (B, Hk) descales, contiguous and paged
    q8 = dict(q_fp8=True, q_descale=True)
    out += [(dataclasses.replace(vregs, regs=64, causal=True, **q8), True),
            (dataclasses.replace(ring, **q8), False), (dataclasses.replace(paged, causal=True, **q8), True),
            (dataclasses.replace(rows32, causal=True, **q8), True)]
    # FlashAttention-3's (B, Hk) descales on pages and through cache_batch_idx (decode: per
    # sequence, read once by a program, no descale ring)
    seq = dict(seq_ds=True, ds_ring=False)
    out += [(dataclasses.replace(paged, **seq), True), (dataclasses.replace(paged, regs=64, **seq), True),
            (dataclasses.replace(paged, page_rows=64, rows_n=16, causal=True, **seq, **q8), False),
            (dataclasses.replace(rows32, causal=True, **seq), True),
            (dataclasses.replace(vregs, rows_n=16, causal=True, batch_idx=True, **seq), True),
            (dataclasses.replace(paged, head_dim=64, rows_n=16, **seq), True)]
    # attention sinks in the unsplit epilogue ("sinks"): each consumer, gpt-oss's head dim 64 too
    out += [(base, "sinks"), (dataclasses.replace(contiguous, head_dim=64), "sinks"), (t16, "sinks"),
            (dataclasses.replace(vregs, regs=64), "sinks"),
            (dataclasses.replace(paged, head_dim=64, rows_n=16), "sinks")]
    return out


CHECKED = _checked()
# Stack bytes the compile check accepts (else none): e4m3 pages, 32 rows, causal, at the 128
# registers of two CTAs per SM; in the sm_90 SASS a few values are stored before the key loop and
# reloaded after it. (The contiguous cache's causal 32-row variant without the descale ring, no
# longer planned, spilled 32 bytes, one register stored and reloaded every tile.)
STACK_ALLOWED = {
    "decode-d128-bf16-paged16-n64-s2-causal-pdl-hf-e4m3-t32-dsring": 24,
    "decode-d128-bf16-paged64-n64-s2-causal-pdl-hf-e4m3-t32-dsring": 8,
    "decode-d128-bf16-paged16-n64-s2-causal-pdl-hf-e4m3-t32-dsring-q8-qds": 24,
}


def main(argv=None) -> int:
    """Compile every checked variant for sm_90 and print its resources; exit 1 if any fails,
    spills or has its wgmmas serialized by ptxas."""
    from .gluon_forward import resource_usage, wgmma_serialized

    bad = 0
    for variant, split in CHECKED:
        name = variant.name + {True: "", False: "-unsplit", "sinks": "-unsplit-sinks"}[split]
        try:
            compiled = compile_for_sm90(variant, split)
        except Exception as e:  # report every variant, then fail
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            bad += 1
            continue
        usage = resource_usage(compiled)
        spills = usage.get("local", 0) > 0 or usage.get("stack", 0) > STACK_ALLOWED.get(name, 0)
        serialized = bool(wgmma_serialized(compiled))
        bad += spills or serialized
        print(f"{name}: ok, shared memory {compiled.metadata.shared} B, {usage.get('reg', '?')} "
              f"registers/thread, local {usage.get('local', '?')} B, stack {usage.get('stack', '?')} B"
              + (" SPILLS" if spills else "") + (" WGMMA SERIALIZED" if serialized else ""),
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
