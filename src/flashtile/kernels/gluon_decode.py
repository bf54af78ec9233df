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
                                                                  warpgroup_mma)

    from .gluon_forward import _to_16bit, _wgmma_layout

    _ROWS = gl.constexpr(64)

ROWS = 64  # one wgmma M: the query rows a program packs (group x Sq)
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

    def __post_init__(self):
        if not self.page_rows or not self.paged:
            object.__setattr__(self, "page_rows", self.block_n)
        if self.head_dim % SLAB or self.block_n % self.page_rows or self.page_rows < 8:
            raise ValueError(f"decode variant {self}: head dim a multiple of 64, pages of >= 8 keys "
                             "dividing the tile")

    @property
    def name(self) -> str:
        kind = f"paged{self.page_rows}" if self.paged else "contiguous"
        return (f"decode-d{self.head_dim}-{self.dtype}-{kind}-n{self.block_n}-s{self.stages}"
                + ("-causal" if self.causal else "") + ("-batchidx" if self.batch_idx else "")
                + ("-pdl" if self.pdl else "") + ("-hf" if self.heads_first else ""))

    @property
    def shared_bytes(self) -> int:
        return 2 * (2 * self.stages * self.block_n * self.head_dim + ROWS * self.head_dim)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

if _GLUON:

    @gluon.jit
    def _slab_rows(bufs, slot, slab, row0, PAGE_ROWS: gl.constexpr, SLAB_LAYOUT: gl.constexpr):
        """Rows [row0, row0 + PAGE_ROWS) of one 64-column slab of a ring slot's [BLOCK_N, D] tile."""
        BLOCK_N: gl.constexpr = bufs.shape[1]
        HEAD_DIM: gl.constexpr = bufs.shape[2]
        slabs = bufs.index(slot)._reinterpret(bufs.dtype, [HEAD_DIM // 64, BLOCK_N, 64], SLAB_LAYOUT)
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
                         SLAB_LAYOUT: gl.constexpr):
        """1 warp: for each key tile of the split, its pages' numbers from the block table (loaded
        before the wait for the slot, so their latency hides under it), then one TMA box per page
        and slab for K and for V, all completing the slot's ``ready`` barrier."""
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        PAGES: gl.constexpr = BLOCK_N // PAGE_ROWS
        TILE_BYTES: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * k_bufs.dtype.primitive_bitwidth // 8
        split, batch, kv_head, num_splits = _program(HEADS_FIRST)
        col0 = kv_head * HEAD_DIM
        table_row = batch.to(gl.int64) * stride_btb
        # The page numbers of a tile: one vector load, issued a tile ahead (before the wait for the
        # slot of the tile before), each number then taken out by a warp reduction. The first
        # tile's are loaded together with the sequence length, for the split this program would
        # have if the sequence filled its capacity, and loaded again only where it does not.
        id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs = gl.arange(0, PAGES, layout=id_layout)
        ids_next = offs
        if PAGED:
            guess_lo, _ = _split_tiles(capacity, split, num_splits, BLOCK_N)
            first = (guess_lo * BLOCK_N >> page_shift) + offs
            ids_guess = gl.load(BlockTable + table_row + first, mask=first < table_width, other=0)
        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)
        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)
        row_base = batch * capacity  # a contiguous cache: this sequence's first row
        if BATCH_IDX:
            row_base = gl.load(CacheBatchIdx + batch) * capacity
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
            for p in gl.static_range(PAGES):
                if PAGED:
                    page = gl.sum(gl.where(offs == p, ids, 0), 0)
                    row = page * page_size
                    if PAGES == 1:  # a tile inside one page: from the tile's offset in the page
                        row += key0 & (page_size - 1)
                else:
                    row = row_base + key0 + p * PAGE_ROWS
                for c in gl.static_range(HEAD_DIM // 64):
                    tma.async_copy_global_to_shared(
                        k_desc, [row, col0 + c * 64], ready.index(slot),
                        _slab_rows(k_bufs, slot, c, p * PAGE_ROWS, PAGE_ROWS, SLAB_LAYOUT))
                    tma.async_copy_global_to_shared(
                        v_desc, [row, col0 + c * 64], ready.index(slot),
                        _slab_rows(v_bufs, slot, c, p * PAGE_ROWS, PAGE_ROWS, SLAB_LAYOUT))

    @gluon.jit
    def _decode_consumer(Q, OutPart, LsePart, Out, Lse, q_smem, k_bufs, v_bufs, ready, empty,
                         CacheSeqlens, capacity, seqlen_q, group_size, qk_scale,
                         stride_qb, stride_qs, stride_qh, stride_os, stride_ob, stride_oq, stride_oh,
                         stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh,
                         stride_lrb, stride_lrh,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr, EMPTY_LSE: gl.constexpr,
                         HEADS_FIRST: gl.constexpr):
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
        r = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, io_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
        g = r // seqlen_q
        qi = r % seqlen_q
        row_ok = gl.expand_dims(g < group_size, 1)
        head = kv_head * group_size + g
        q = gl.load(Q + batch.to(gl.int64) * stride_qb + gl.expand_dims(qi * stride_qs + head * stride_qh, 1)
                    + gl.expand_dims(d, 0), mask=row_ok, other=0.0)
        q_smem.store(q)
        fence_async_shared()

        rows_s = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
        rows_pos = gl.expand_dims(rows_s % seqlen_q + seqlen_k - seqlen_q, 1)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        v_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        m_i = gl.full([_ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        zero_s = gl.zeros([_ROWS, BLOCK_N], gl.float32, layout=s_layout)
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
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            if t * BLOCK_N + BLOCK_N > seqlen_k:
                # The sequence's last tile: V rows past its end hold whatever the cache does there
                # (0 x NaN would poison every row of P V); zero them where the wgmma reads.
                v = v_tile.load(io_layout)
                keep_v = gl.expand_dims(t * BLOCK_N + v_rows < seqlen_k, 1)
                v_tile.store(gl.where(keep_v, v, gl.zeros_like(v)))
                fence_async_shared()
                gl.thread_barrier()
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(_to_16bit(p, dtype, True), p_layout)
            o = warpgroup_mma(p_op, v_tile, o)
            mbarrier.arrive(empty.index(slot))

        seen = l_i > 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
        o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
        # Stored from the wgmma layout itself: a layout change would take shared memory this
        # kernel needs for its ring.
        ro = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, o_layout))
        do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        go = ro // seqlen_q
        qo = ro % seqlen_q
        ho = kv_head * group_size + go
        o_ok = gl.expand_dims(go < group_size, 1)
        lse_ok = (rows_s // seqlen_q) < group_size
        g_l = rows_s // seqlen_q
        q_l = rows_s % seqlen_q
        h_l = kv_head * group_size + g_l
        if SPLIT:  # normalized partial output and its LSE (-inf where the split saw nothing)
            gl.store(OutPart + split.to(gl.int64) * stride_os + batch.to(gl.int64) * stride_ob
                     + gl.expand_dims(qo * stride_oq + ho * stride_oh, 1) + gl.expand_dims(do, 0),
                     o, mask=o_ok)
            gl.store(LsePart + split.to(gl.int64) * stride_ls + batch.to(gl.int64) * stride_lb
                     + h_l * stride_lh + q_l, gl.where(seen, lse, float("-inf")), mask=lse_ok)
        else:
            gl.store(Out + batch.to(gl.int64) * stride_rb
                     + gl.expand_dims(qo * stride_rq + ho * stride_rh, 1) + gl.expand_dims(do, 0),
                     o.to(Out.dtype.element_ty), mask=o_ok)
            if WRITE_LSE:
                gl.store(Lse + batch.to(gl.int64) * stride_lrb + h_l * stride_lrh + q_l,
                         gl.where(seen, lse, EMPTY_LSE), mask=lse_ok)

    @gluon.jit
    def _attn_decode_gluon(k_desc, v_desc, Q, OutPart, LsePart, Out, Lse, CacheSeqlens,
                           CacheBatchIdx, BlockTable,
                           stride_qb, stride_qs, stride_qh, stride_os, stride_ob, stride_oq, stride_oh,
                           stride_ls, stride_lb, stride_lh, stride_rb, stride_rq, stride_rh,
                           stride_lrb, stride_lrh, stride_btb, seqlen_q, capacity, group_size,
                           qk_scale, page_size, page_shift, table_width,
                           BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr,
                           PAGED: gl.constexpr, PDL: gl.constexpr, BATCH_IDX: gl.constexpr,
                           HEADS_FIRST: gl.constexpr,
                           CAUSAL: gl.constexpr, SPLIT: gl.constexpr, WRITE_LSE: gl.constexpr,
                           EMPTY_LSE: gl.constexpr, HEAD_DIM: gl.constexpr,
                           TILE_LAYOUT: gl.constexpr, SLAB_LAYOUT: gl.constexpr,
                           Q_LAYOUT: gl.constexpr):
        """Grid (splits, B, Hk). ``capacity``: keys a sequence can hold (S_max, or pages x page
        size); a contiguous cache is rows of ``capacity`` keys per cache row, a paged one rows of
        ``page_size`` keys per page. Layouts: TILE_LAYOUT the [BLOCK_N, HEAD_DIM] K/V tile's,
        SLAB_LAYOUT the same bytes as [HEAD_DIM // 64, BLOCK_N, 64], Q_LAYOUT the [64, HEAD_DIM] Q's."""
        dtype: gl.constexpr = k_desc.dtype
        if PDL:  # launched before the previous kernel ends: touch no memory until it has
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)

        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], TILE_LAYOUT)
        q_smem = gl.allocate_shared_memory(dtype, [_ROWS, HEAD_DIM], Q_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_decode_consumer, (Q, OutPart, LsePart, Out, Lse, q_smem, k_bufs, v_bufs, ready, empty,
                                CacheSeqlens, capacity, seqlen_q, group_size, qk_scale, stride_qb, stride_qs, stride_qh, stride_os, stride_ob,
                                stride_oq, stride_oh, stride_ls, stride_lb, stride_lh, stride_rb,
                                stride_rq, stride_rh, stride_lrb, stride_lrh,
                                BLOCK_N, STAGES, CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE, HEADS_FIRST)),
            (_decode_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable,
                                CacheSeqlens, CacheBatchIdx, stride_btb, table_width, capacity,
                                page_size, page_shift, BLOCK_N, PAGE_ROWS, STAGES, PAGED, BATCH_IDX,
                                HEADS_FIRST, SLAB_LAYOUT)),
        ], [1], [24])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _layouts(block_n: int, page_rows: int, head_dim: int, dtype: str):
    """(tile, slab view, Q, TMA box) shared layouts."""
    el = getattr(gl, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    tile = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], el)
    slab = gl.NVMMASharedLayout.get_default_for([block_n, SLAB], el)
    q = gl.NVMMASharedLayout.get_default_for([ROWS, head_dim], el)
    box = gl.NVMMASharedLayout.get_default_for([page_rows, SLAB], el)
    return tile, slab, q, box


@functools.lru_cache(maxsize=None)
def _options(variant: DecodeVariant, split: bool, write_lse: bool) -> dict:
    """Constexprs and launch shape (one dict per value: ``launch`` keys options by identity)."""
    tile, slab, q, _ = _layouts(variant.block_n, variant.page_rows, variant.head_dim, variant.dtype)
    return dict(BLOCK_N=variant.block_n, PAGE_ROWS=variant.page_rows, STAGES=variant.stages,
                PAGED=variant.paged, PDL=variant.pdl, BATCH_IDX=variant.batch_idx,
                HEADS_FIRST=variant.heads_first,
                CAUSAL=variant.causal, SPLIT=split, WRITE_LSE=write_lse or split,
                EMPTY_LSE=math.inf, HEAD_DIM=variant.head_dim, TILE_LAYOUT=tile, SLAB_LAYOUT=slab,
                Q_LAYOUT=q, **_launch_shape(variant), **({"launch_pdl": True} if variant.pdl else {}))


def _launch_shape(variant: DecodeVariant) -> dict:
    # 4 consumer + 1 producer warps launch as 8; two CTAs per SM (the 64-key ring) need registers
    # for both: 128 per thread, of which the producer warp keeps 24.
    if 2 * (variant.shared_bytes + 2048) <= 228 * 1024:
        return {"num_warps": 4, "maxnreg": 128}
    return {"num_warps": 4}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def cache_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as the 2-D (rows, Hk x D) tensor the descriptors read, or None when its strides
    do not allow that view or TMA (16-byte aligned rows) or int32 row coordinates."""
    if not cache.is_contiguous() or cache.data_ptr() % 16 or cache.dim() != 4:
        return None
    rows = cache.shape[0] * cache.shape[1]
    width = cache.shape[2] * cache.shape[3]
    if rows >= 2 ** 31 - 2 ** 20 or (width * cache.element_size()) % 16:
        return None
    return cache.view(rows, width)


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, paged: bool,
              window: bool, softcap: bool, alibi: bool, leftpad: bool) -> bool:
    """Whether this kernel takes the call (else the portable one does): sm_90, 16-bit q and cache
    of one dtype, head dim 64 or 128, at most 64 query rows per KV head, no window, softcap, ALiBi
    or left padding; paged: pages of 8-256 keys, a power of two."""
    if not _GLUON or q.device.type != "cuda" or window or softcap or alibi or leftpad:
        return False
    if q.dtype not in _NAMES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    if head_dim not in (64, 128) or heads % heads_k or heads // heads_k * seqlen_q > ROWS:
        return False
    if paged:
        page = k_cache.shape[1]
        if page < 8 or page > 256 or page & (page - 1):
            return False
    if k_cache.shape != v_cache.shape or cache_rows(k_cache) is None or cache_rows(v_cache) is None:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _arch(index) == 90


def gluon_decode(q, k_cache, v_cache, cache_seqlens, *, softmax_scale: float, causal: bool,
                 splits: int, variant: DecodeVariant, block_table=None, cache_batch_idx=None,
                 need_lse: bool = True):
    """One decode launch (plus the merge when ``splits`` > 1) on inputs ``supported`` accepts, with
    a variant matching them (decode.py's plan picks it). Returns out (B, Sq, H, D) in q's dtype and
    lse (B, H, Sq) float32 (+inf where a row saw no key), or None when not needed and unsplit."""
    from .decode import _combine_options, _launch_combine

    batch, seqlen_q, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    split = splits > 1
    write_lse = need_lse or split
    out = torch.empty(batch, seqlen_q, heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device) if write_lse else None
    if out.numel() == 0:
        return out, lse
    if split:
        out_partial = torch.empty(splits, batch, seqlen_q, heads, head_dim, dtype=torch.float32,
                                  device=q.device)
        lse_partial = torch.empty(splits, batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    else:
        out_partial, lse_partial = out, out if lse is None else lse
    _, _, _, box = _layouts(variant.block_n, variant.page_rows, head_dim, variant.dtype)
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    descriptors = (_Descriptor(k_rows, k_rows.shape, k_rows.stride(), (variant.page_rows, SLAB), box),
                   _Descriptor(v_rows, v_rows.shape, v_rows.stride(), (variant.page_rows, SLAB), box))
    lse_t = out if lse is None else lse
    tensors = (q, out_partial, lse_partial, out, lse_t, cache_seqlens, cache_batch_idx, block_table)
    part = out_partial.stride()[:4] if split else (0, 0, 0, 0)
    lpart = lse_partial.stride()[:3] if split else (0, 0, 0)
    scalars = (*q.stride()[:3], *part, *lpart, *out.stride()[:3],
               *(lse.stride()[:2] if lse is not None else (0, 0)),
               block_table.stride(0) if paged else 0, seqlen_q, capacity, heads // heads_k,
               softmax_scale * LOG2E, page_size if paged else 1,
               page_size.bit_length() - 1 if paged else 0, block_table.shape[1] if paged else 0)
    grid = (heads_k, splits, batch) if variant.heads_first else (splits, batch, heads_k)
    launch(_attn_decode_gluon, grid, tensors, scalars,
           _options(variant, split, need_lse), descriptors)
    if split:
        _launch_combine(out_partial, lse_partial, out, lse, _combine_options(splits, head_dim,
                                                                             math.inf, True))
    return out, lse


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# ----------------------------------------------------------------------------------------------

def compile_for_sm90(variant: DecodeVariant, split: bool = True):
    """Compile a variant to a cubin for sm_90 the way a launch would (see gluon_forward)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    dt = variant.dtype
    _, _, _, box = _layouts(variant.block_n, variant.page_rows, variant.head_dim, dt)
    desc = f"tensordesc<{dt}[{variant.page_rows}, {SLAB}],{box!r}>"
    fn = _attn_decode_gluon
    constexprs = _options(variant, split, True)
    signature, attrs = {"k_desc": desc, "v_desc": desc, "Q": f"*{dt}", "OutPart": "*fp32",
                        "LsePart": "*fp32", "Out": f"*{dt}", "Lse": "*fp32",
                        "CacheSeqlens": "*i32", "CacheBatchIdx": "*i32", "BlockTable": "*i32",
                        "qk_scale": "fp32"}, {}
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


def _checked() -> list[tuple[DecodeVariant, bool]]:
    """What the compile check builds: the paged plans (decode.GLUON_PAGED, GLUON_PAGED_MANY) at both
    head dims and dtypes, pages smaller than, equal to and larger than a tile, causal, batch_idx,
    unsplit."""
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
    return out


CHECKED = _checked()


def main(argv=None) -> int:
    """Compile every checked variant for sm_90 and print its resources; exit 1 if any fails or
    spills."""
    from .gluon_forward import resource_usage

    bad = 0
    for variant, split in CHECKED:
        name = variant.name + ("" if split else "-unsplit")
        try:
            compiled = compile_for_sm90(variant, split)
        except Exception as e:  # report every variant, then fail
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            bad += 1
            continue
        usage = resource_usage(compiled)
        spills = usage.get("local", 0) > 0 or usage.get("stack", 0) > 0
        bad += spills
        print(f"{name}: ok, shared memory {compiled.metadata.shared} B, {usage.get('reg', '?')} "
              f"registers/thread, local {usage.get('local', '?')} B, stack {usage.get('stack', '?')} B"
              + (" SPILLS" if spills else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
