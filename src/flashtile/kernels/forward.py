"""Prefill forward: FlashAttention-2 loop order in Triton.

One program owns BLOCK_M query rows of one (batch, head) and streams the K/V tiles it can see through
an online softmax kept in base 2 (log2(e) is folded into the score scale, so every exponential is an
exp2). The key range of a query block splits into stretches: blocks that every row sees in full run the
inner loop with masking compiled out; blocks on the edges of the visible band (causal diagonal, sliding
window edges, the ragged end of the keys) run it with the mask; blocks outside the band are never loaded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime._allocation import _allocator as _triton_allocator

from .common import (dropout_keep, head_terms, key_blocks, load_tile, sequence_descriptor,
                     sequence_span, softcap_tanh, tile_pages, tile_rows, visible, widen_e4m3)

LOG2E = 1.4426950408889634


# Read once, as @triton.jit does when it decorates the kernels below.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    return _INTERPRET


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # K/V (and Q) through device-side tensor descriptors, where layout allows


def head_dim_padded(head_dim: int) -> int:
    # tl.dot wants power-of-two extents of at least 16. (Plain int math: triton.next_power_of_2 is
    # a constexpr function that costs microseconds per call on the host.)
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.lru_cache(maxsize=None)
def config_for_arch(head_dim: int, arch: int, fp8: bool = False) -> TileConfig:
    """Tile shape for a head dim on sm_<arch> (e.g. 90 for H100/H200, 80 for A100); ``fp8`` for
    e4m3 inputs."""
    d = head_dim_padded(head_dim)
    if fp8 and 90 <= arch < 120:
        return FP8_CONFIGS.get(d, TileConfig(128, 64, 4, 2, use_tma=True))
    if 90 <= arch < 120:
        # Hopper (and data-center Blackwell, same shared memory, unmeasured), from the sweeps in
        # benchmarks/results/tune-*.json: tiles that leave room for two CTAs per SM (one CTA's
        # softmax runs while the other's MMAs do), K/V through TMA.
        if d <= 64:
            return TileConfig(128, 128, 4, 3, use_tma=True)
        if d <= 128:
            return TileConfig(128, 64, 4, 2, use_tma=True)
        return TileConfig(128, 64, 8, 2, use_tma=True)
    # Ampere, Ada and consumer Blackwell: 164 KB (A100) or 99 KB (consumer) of shared memory.
    if d <= 64:
        return TileConfig(128, 64, 4, 3)
    if d <= 128:
        return TileConfig(128, 64, 8, 2)
    if small_shared_memory(arch):
        # 64 x 64 tiles take 104 KB at head dim 256 (compiled for sm_89); 64 x 32 (FlashAttention-2's
        # choice for these GPUs) fits. Compiled, not timed: no such GPU here.
        return TileConfig(64, 32, 4, 2)
    return TileConfig(64, 64, 4, 2)


# GPUs whose CTAs may have at most 99 KB of shared memory (RTX 30/40/50, A10, A40, L4, L40S), not
# the 163-227 KB of A100, H100/H200 and B200.
SMALL_SHARED_MEMORY_ARCHS = (86, 89, 120, 121)


def small_shared_memory(arch: int) -> bool:
    return arch in SMALL_SHARED_MEMORY_ARCHS


@functools.lru_cache(maxsize=None)
def _arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


# e4m3 tiles on Hopper by padded head dim (FP8 takes power-of-two head dims), from the H200 sweep
# benchmarks/results/tune-fp8-h200-20261129-a.json (8k tokens): at d128, 64x128 tiles with 4 warps
# and 3 stages gave 1.32x / 1.42x bf16 (full / causal) where bf16's 128x64 tiles gave 1.19x / 1.23x.
FP8_CONFIGS = {64: TileConfig(128, 128, 4, 3, use_tma=True), 128: TileConfig(64, 128, 4, 3, use_tma=True),
               256: TileConfig(128, 128, 8, 2, use_tma=True)}


# Short sliding windows of 16-bit calls on sm_90 (a row's window spans at most SHORT_WINDOW_KEYS keys
# at that padded head dim): 64-row query tiles, which compute fewer of the masked pairs around a
# window than 128-row ones, with 2 stages. H200, causal windows over 16k tokens, against the causal
# call's tiles (window-tiles-h200-20261204-b.json; -a without the 2-stage 64 x 32 tiles):
# d64 (64/8 heads, 128 x 128 x 3) 64 x 64 x 2 1.38/1.38/1.32/1.21/1.12x at windows of
# 128/256/512/1024/2048 keys (1.11/1.20/1.22/1.17/1.14x FlexAttention); d128 (32/8, 128 x 64 x 2)
# 64 x 32 x 2 1.25/1.20x at 128/256 (1.47/1.38x Flex; from 512 keys the Gluon kernel takes them).
# Plain (B, S, H, D) calls: packed sequences and page pools keep the causal call's tiles.
SHORT_WINDOW_KEYS = {64: 2049, 128: 513}
SHORT_WINDOW_CONFIGS = {64: TileConfig(64, 64, 4, 2, use_tma=True), 128: TileConfig(64, 32, 4, 2, use_tma=True)}


def short_window_config(head_dim: int, device: torch.device, window_left: int,
                        window_right: int) -> TileConfig | None:
    """SHORT_WINDOW_CONFIGS' tiles for a window of these sides (-1: unbounded) on sm_90, else None."""
    padded = head_dim_padded(head_dim)
    if (device.type != "cuda" or interpreting() or padded not in SHORT_WINDOW_CONFIGS
            or window_span(window_left, window_right) > SHORT_WINDOW_KEYS[padded]):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _arch(index) != 90:
        return None
    return SHORT_WINDOW_CONFIGS[padded]


def pick_config(head_dim: int, device: torch.device, fp8: bool = False) -> TileConfig:
    """Tile shape for a head dim on a device; one fixed config under the interpreter."""
    if device.type != "cuda":
        return TileConfig(32, 32, 4, 1)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return config_for_arch(head_dim, _arch(index), fp8)


def empty_keys_contiguous(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty (B, S, H, D) tensor viewing (B, H, D, S16) storage, S16 = S rounded up to 16: each
    (batch, head) is stored transposed, keys contiguous, rows 16-byte aligned (e4m3 V's layout)."""
    batch, seqlen, heads, head_dim = shape
    padded = max(16, -(-seqlen // 16) * 16)
    out = torch.empty(batch, heads, head_dim, padded, dtype=dtype, device=device)
    return out[..., :seqlen].permute(0, 3, 1, 2)


def keys_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A copy of x (B, S, H, D) in ``empty_keys_contiguous``'s layout, by one pass of _copy_keys on
    the GPU (or the interpreter): torch's copy into the transposed layout read 352 GB/s on the
    H200, the kernel ~2 TB/s (pack-probe-h200-20261202.json)."""
    out = empty_keys_contiguous(x.shape, x.dtype, x.device)
    batch, seqlen, heads, head_dim = x.shape
    if not (x.is_cuda or _INTERPRET) or x.numel() == 0:
        return out.copy_(x)
    raw, raw_out = _as_bytes(x), _as_bytes(out)
    _launch_copy_keys((-(-seqlen // _COPY_BLOCK_K), heads, batch), raw, raw_out, raw, None, raw.stride(),
                      raw_out.stride(), seqlen, batch, 0, head_dim, packed=False)
    return out


def packed_keys_transposed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> torch.Tensor:
    """Packed sequences x (total, H, D) as a (1, width, H, D) view of (H, D, width) storage, keys
    contiguous (e4m3 V's layout), sequence b from column 16 * ceil(cu_seqlens[b] / 16) + 16 * b: a
    16-byte boundary, which a tensor descriptor's base and TMA's innermost coordinates need, and
    zeros between sequences and for at least PACKED_TAIL columns after the last (or up to the
    width: the rest of the width, where x has rows past the last sequence, is left unwritten). One
    pass of _copy_keys writes the sequences and their gaps (no zero fill first), a one-program-a-head
    launch the zeros after the last, the sequences' starts read on the device (no host sync);
    ``max_seqlen`` bounds every sequence's length (None: the total)."""
    total, heads, head_dim = x.shape
    batch = cu_seqlens.shape[0] - 1
    width = -(-total // 16) * 16 + 16 * (batch + 1)
    longest = total if max_seqlen is None else min(max_seqlen, total)
    if batch <= 0 or heads == 0:
        out = torch.zeros(heads, head_dim, width, dtype=x.dtype, device=x.device)
        return out.permute(2, 0, 1).unsqueeze(0)
    out = torch.empty(heads, head_dim, width, dtype=x.dtype, device=x.device)
    raw, raw_out = _as_bytes(x), _as_bytes(out)
    # a sequence's programs also zero the gap after it: up to 31 columns (47 after the last)
    grid = (-(-(longest + 48) // _COPY_BLOCK_K), heads, batch)
    _launch_copy_keys(grid, raw, raw_out, cu_seqlens, None, raw.stride(),
                      (0, 1, raw_out.stride(0), raw_out.stride(1)), total, batch, width, head_dim, packed=True)
    # x may hold rows past the last sequence (flash_attn_varlen_func allows k past cu_seqlens_k[-1];
    # paged_keys_packed's rows are laid out for B x L keys): a second launch zeros PACKED_TAIL columns
    # after it (a widened first grid with clamped spans was 7x slower: gather-probe-h200-20261202-c).
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _zero_after_last[(heads,)](raw_out, cu_seqlens, batch, width, raw_out.stride(0), raw_out.stride(1),
                                   HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                                   TAIL=PACKED_TAIL)
    return out.permute(2, 0, 1).unsqueeze(0)


def paged_keys_packed(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                      cu_seqlens: torch.Tensor, max_seqlen: int,
                      keyed_sequences: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences on page pools k, v (num_pages, page_size, H, D) gathered through ``block_table``
    (B, max_pages) int32 into the packed layouts the e4m3 Gluon forward reads: K as (S * L, H, D)
    rows, sequence b from row cu_seqlens[b] (rows past the last sequence left unwritten), L =
    ``max_seqlen`` clamped to a table row's capacity, S the B sequences or ``keyed_sequences`` where
    the caller knows that at most that many have keys (a mixed batch's prefill part: the decode
    steps' are 0), and V^T as packed_keys_transposed makes it from V's rows gathered alike. The
    lengths and offsets are read on the device (no host sync), and every index is clamped into its
    tensor (values that CUDA-graph capture left unchecked cannot reach outside them). V in two
    passes: one pass straight into V^T read ~310 GB/s on the H200 (gather-probe-h200-20261202-a/-b);
    all three copies 43 us for 4 x 4096 keys, ~2.35 TB/s (-d)."""
    v_rows = _paged_rows(v, block_table, cu_seqlens, max_seqlen, sequences=keyed_sequences)
    # (the pack clips its rows cu_seqlens[b]:cu_seqlens[b + 1] to v_rows itself: no clamp launch)
    return (_paged_rows(k, block_table, cu_seqlens, max_seqlen, sequences=keyed_sequences),
            packed_keys_transposed(v_rows, cu_seqlens, _gathered_length(k, block_table, max_seqlen)))


def _gathered_length(pool: torch.Tensor, block_table: torch.Tensor, max_seqlen: int) -> int:
    """L of paged_keys_packed: max_seqlen clamped to a table row's capacity."""
    return max(0, min(max_seqlen, block_table.shape[1] * pool.shape[1]))


def _gathered_sequences(block_table: torch.Tensor, keyed_sequences: int) -> int:
    """The sequences a gather makes room for: the table's rows, or fewer that have keys (0: all)."""
    return keyed_sequences if 0 < keyed_sequences < block_table.shape[0] else block_table.shape[0]


def _paged_rows(pool: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, zeros: bool = False, sequences: int = 0) -> torch.Tensor:
    """paged_keys_packed's rows: (S * L, H, D) (S: _gathered_sequences), sequence b from row
    cu_seqlens[b], clamped into them; with ``zeros`` the rows past the last sequence are zeros, else
    left unwritten."""
    batch = cu_seqlens.shape[0] - 1
    heads, head_dim = pool.shape[-2:]
    longest = _gathered_length(pool, block_table, max_seqlen)
    rows = (torch.zeros if zeros else torch.empty)(_gathered_sequences(block_table, sequences) * longest, heads,
                                                    head_dim, dtype=pool.dtype, device=pool.device)
    if batch > 0 and heads > 0 and longest > 0:
        raw, raw_out = _as_bytes(pool), _as_bytes(rows)
        _launch_copy_keys((-(-longest // _COPY_BLOCK_K), heads, batch), raw, raw_out, cu_seqlens,
                          block_table, raw.stride(), (0, *raw_out.stride()), 0, batch, rows.shape[0], head_dim,
                          packed=True, transposed=False)
    return rows


def gathered_cache(pool: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sequences on a page pool (num_pages, page_size, H, D) gathered through ``block_table``
    (B, max_pages) int32 into a (B, max_pages * page_size, H, D) cache: sequence b's first
    lengths[b] keys ((B,) int32, read on the device and clamped to the table row's capacity) from
    row 0; the rows past them are left unwritten. Table entries are clamped into the pool."""
    batch, pages = block_table.shape
    heads, head_dim = pool.shape[-2:]
    capacity = pages * pool.shape[1]
    out = torch.empty(batch, capacity, heads, head_dim, dtype=pool.dtype, device=pool.device)
    if out.numel():
        raw, raw_out = _as_bytes(pool), _as_bytes(out)
        _launch_copy_keys((-(-capacity // _COPY_BLOCK_K), heads, batch), raw, raw_out, lengths, block_table,
                          raw.stride(), raw_out.stride(), 0, batch, 0, head_dim, packed=False,
                          transposed=False)
    return out


_COPY_BLOCK_K = 128
# Zeros written after the last packed V^T sequence: the Gluon e4m3 kernel's widest key tile, which
# may reach that far past a sequence's end (a power of two: one tile of zeros a program).
PACKED_TAIL = 256


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x  # e4m3 moved as bytes


def _launch_copy_keys(grid, x, out, cu_seqlens, block_table, x_strides, out_strides, seqlen, batch,
                      width, head_dim, *, packed: bool, transposed: bool = True):
    paged = block_table is not None
    page_args = ((block_table.stride(0), block_table.shape[1], x.shape[1], x.shape[0]) if paged
                 else (0, 0, 1, 1))
    x_strides = (0,) * (4 - len(x_strides)) + tuple(x_strides)  # packed (total, H, D): no batch stride
    key = (head_dim, packed, paged, transposed)
    options = _COPY_OPTIONS.get(key)
    if options is None:  # one dict per constexpr set: ``launch`` keys its cache by the dict's identity
        options = _COPY_OPTIONS[key] = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                                            BLOCK_K=_COPY_BLOCK_K, PACKED=packed, PAGED=paged,
                                            TRANSPOSED=transposed)
    from .launch import launch  # (its direct launch: the JIT's dispatch cost ~40 us of host time a call)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch(_copy_keys, grid, (x, out, cu_seqlens, block_table if paged else cu_seqlens),
               (*map(int, x_strides), *map(int, out_strides), int(seqlen), int(batch), int(width),
                *map(int, page_args)), options)


_COPY_OPTIONS: dict = {}


@triton.jit
def _zero_after_last(Out, CuSeqlens, batch, width, stride_oh, stride_od, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, TAIL: tl.constexpr):
    """Zeros in columns [end, end + TAIL) of head ``program_id(0)`` of packed V^T (H, D, width),
    ``end`` the last sequence's first column past its keys (packed_keys_transposed's layout),
    clamped to [0, width)."""
    head = tl.program_id(0)
    start = tl.load(CuSeqlens + batch - 1)
    end = (start + 15) // 16 * 16 + 16 * (batch - 1) + tl.load(CuSeqlens + batch) - start
    columns = tl.maximum(end, 0) + tl.arange(0, TAIL)
    dims = tl.arange(0, BLOCK_D)
    keep = (dims < HEAD_DIM)[:, None] & (columns < width)[None, :]
    tl.store(Out + head.to(tl.int64) * stride_oh + dims[:, None] * stride_od + columns.to(tl.int64)[None, :],
             tl.zeros([BLOCK_D, TAIL], Out.dtype.element_ty), mask=keep)


@triton.jit
def _copy_keys(X, Out, CuSeqlens, BlockTable, stride_xb, stride_xt, stride_xh, stride_xd, stride_ob,
               stride_ot, stride_oh, stride_od, seqlen, batch, width, stride_bt, table_width, page_size,
               num_pages,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
               PACKED: tl.constexpr, PAGED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Keys [chunk * BLOCK_K, +BLOCK_K) of sequence ``seq``, head ``head``.

    keys_contiguous: X (B, S, H, D) with any strides into Out (B, H, D, >= S) (TRANSPOSED, keys
    contiguous). packed_keys_transposed (PACKED, TRANSPOSED): X (seqlen rows, H, D) with sequence b at
    rows cu_seqlens[b]:cu_seqlens[b + 1] (clipped to X) into Out (H, D, width), the sequence from column
    16 * ceil(start / 16) + 16 * seq and zeros after it up to the next sequence's first column (or
    ``width`` after the last). _paged_rows (PACKED, PAGED, not TRANSPOSED): X
    a page pool (num_pages, page_size, H, D), key t of sequence b in page BlockTable[b, t //
    page_size], slot t % page_size, its length clamped to the table row's capacity, into Out
    (width, H, D) rows from row cu_seqlens[b]. gathered_cache (PAGED, neither PACKED nor TRANSPOSED):
    the same gather, CuSeqlens then holding each sequence's length (B,), into Out (B, L, H, D)
    from row 0 of batch b. Out's four strides (batch, key, head, dim) place every form's tile."""
    tl.static_assert(not (PAGED and TRANSPOSED), "pages are gathered into rows (see paged_keys_packed)")
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if PACKED:
        start = tl.load(CuSeqlens + seq)
        end = tl.load(CuSeqlens + seq + 1)
        length = end - start
        if PAGED:
            length = tl.minimum(tl.maximum(length, 0), table_width * page_size)
        else:  # no row past X's ``seqlen`` rows (offsets go unchecked under CUDA-graph capture)
            length = tl.minimum(length, seqlen - start)
        if TRANSPOSED:
            column = (start + 15) // 16 * 16 + 16 * seq
            next_column = (end + 15) // 16 * 16 + 16 * (seq + 1)
            span = tl.where(seq == batch - 1, width, next_column) - column
        else:
            column = start
            span = length
    elif PAGED:  # CuSeqlens: the lengths
        start = 0
        length = tl.minimum(tl.maximum(tl.load(CuSeqlens + seq), 0), table_width * page_size)
        column = 0
        span = length
    else:
        start = 0
        length = seqlen
        column = 0
        span = seqlen
    if chunk * BLOCK_K < span:
        keys = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        dims = tl.arange(0, BLOCK_D)
        mask = ((keys < length) & (start + keys >= 0))[:, None] & (dims < HEAD_DIM)[None, :]
        if PAGED:
            entry = tl.minimum(keys // page_size, table_width - 1)
            page = tl.load(BlockTable + seq.to(tl.int64) * stride_bt + entry, mask=keys < length, other=0)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            rows = page.to(tl.int64) * stride_xb + (keys % page_size).to(tl.int64) * stride_xt
        else:
            rows = seq.to(tl.int64) * stride_xb + (start + keys).to(tl.int64) * stride_xt
        x = tl.load(X + rows[:, None] + head.to(tl.int64) * stride_xh + dims.to(tl.int64)[None, :] * stride_xd,
                    mask=mask, other=0)
        inside = (keys < span) & (column + keys >= 0)
        if PACKED:
            inside = inside & (column + keys < width)
        base = Out + seq.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
        if TRANSPOSED:
            # stored through the transposed tile, so that a thread's neighbours write neighbouring keys
            store = (dims < HEAD_DIM)[:, None] & inside[None, :]
            tl.store(base + dims[:, None] * stride_od + (column + keys).to(tl.int64)[None, :] * stride_ot,
                     tl.trans(x), mask=store)
        else:
            store = inside[:, None] & (dims < HEAD_DIM)[None, :]
            tl.store(base + (column + keys).to(tl.int64)[:, None] * stride_ot + dims[None, :] * stride_od, x,
                     mask=store)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, q_lo, k_ptrs, v_ptrs, stride_kn, stride_vn,
                    rows_pos, offs_n, offs_d, blk_lo, blk_hi, seqlen_k,
                    window_left, window_right, qk_scale, softcap_in, alibi_slope,
                    rng_seed, rng_rows, dropout_p, block_table_row, page_size, num_pages,
                    stride_kpage, stride_vpage, k_descale, v_descale, stride_scale_n, stride_scale_page,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, UPCAST: tl.constexpr,
                    USE_TMA: tl.constexpr, DROPOUT: tl.constexpr, PAGED: tl.constexpr,
                    FP8: tl.constexpr = 0, SCALE_BLOCK_K: tl.constexpr = 1,
                    PAGE_SHIFT: tl.constexpr = -1, Q_TERMS: tl.constexpr = 2):
    """Online softmax over key blocks [blk_lo, blk_hi); ``rows_pos`` = query row + diagonal offset.

    ``k_ptrs``/``v_ptrs`` are pointer tiles, or with USE_TMA tensor descriptors bounded to one
    (batch, head), whose loads zero-fill past the keys and the head dim. PAGED: they point at one
    head of the page pool, and each tile gathers its keys through the sequence's block table row
    (any page size: every key looks up its own page). PAGED == 2 loads the next tile's page numbers
    one iteration ahead, so the K/V loads never wait on the block table; PAGED == 3 does the same
    with one entry per tile, for pages of a power of two >= BLOCK_N keys. PAGE_SHIFT >= 0: pages hold
    2**PAGE_SHIFT keys (shifts and masks instead of divisions by ``page_size``). FP8 == 1: K and V
    are e4m3 with one descale per SCALE_BLOCK_K keys (a multiple of BLOCK_N) at ``k_descale``, and
    V's relative to its largest at ``v_descale`` (the largest multiplies the output at the end); both
    are read one tile ahead. K's joins the score scale and V's scales P before its cast to e4m3, so
    no tile is multiplied by a descale and P @ V accumulates in place. V is stored transposed (keys
    contiguous: e4m3 wgmma reads its B operand K-major only); with USE_TMA ``v_ptrs`` is a descriptor
    over V^T.
    FP8 == 2 (an e4m3 KV cache read by a bf16/fp16 query): one descale per key and KV head, at
    ``k_descale``/``v_descale`` + key * ``stride_scale_n`` (+ page * ``stride_scale_page`` when PAGED);
    K and V tiles widen to the query's dtype (the decode kernel hands over an fp16 query: e4m3 widens
    to fp16 in one instruction per pair, to bf16 through a second conversion), K's descales scale the
    score columns, V's the columns of P. FP8 == 3: the same, V widened by PTX where it is loaded
    (``widen_e4m3``; GPU only). FP8 == 4 and 5: the query comes as two e4m3 terms, ``q`` (its
    leading bits) and ``q_lo`` (the rest), and S = q K^T + q_lo K^T runs as e4m3 dots on K as loaded
    (not widened; the tensor cores' own accumulation over the head dim: promoting the sums to fp32
    every 32 products spilled); V widens to fp16 by PTX (4, GPU only) or by Triton (5). ``q_lo`` is
    unused otherwise, and with Q_TERMS == 1 (an e4m3 query as given: one term, one dot) too.
    """
    if not USE_TMA and not PAGED:
        start = blk_lo * BLOCK_N
        k_ptrs += start.to(tl.int64) * stride_kn
        v_ptrs += start.to(tl.int64) * stride_vn
    D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    # PAGED == 3: pages of 2**PAGE_SHIFT >= BLOCK_N keys, so a tile lies in one page: one table entry
    # per tile (a scalar), its rows at fixed offsets from the tile's first key.
    ONE_PAGE: tl.constexpr = PAGED == 3
    if PAGED >= 2:
        page_ahead = tile_pages(block_table_row, blk_lo * BLOCK_N, offs_n, seqlen_k, page_size,
                                ONE_PAGE, PAGE_SHIFT)
    if FP8 >= 2:  # per-key descales, read one tile ahead: a load in the loop would stall every step
        first = blk_lo * BLOCK_N + offs_n
        if PAGED:
            if PAGED >= 2:
                first_page = page_ahead
            else:
                first_page = tile_pages(block_table_row, blk_lo * BLOCK_N, offs_n, seqlen_k, page_size,
                                        ONE_PAGE, PAGE_SHIFT)
            first_at = tile_rows(first_page, blk_lo * BLOCK_N, offs_n, page_size, num_pages,
                                 stride_scale_page, stride_scale_n, ONE_PAGE, PAGE_SHIFT)
        else:
            first_at = first * stride_scale_n
        k_scales_ahead = tl.load(k_descale + first_at, mask=first < seqlen_k, other=0.0)
        v_scales_ahead = tl.load(v_descale + first_at, mask=first < seqlen_k, other=0.0)
    if FP8 == 1:
        k_scale_ahead = tl.load(k_descale + (blk_lo * BLOCK_N) // SCALE_BLOCK_K, mask=blk_lo < blk_hi,
                                other=1.0)
        v_scale_ahead = tl.load(v_descale + (blk_lo * BLOCK_N) // SCALE_BLOCK_K, mask=blk_lo < blk_hi,
                                other=1.0)
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        kv_ok = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        if PAGED:
            if PAGED >= 2:
                page = page_ahead
                page_ahead = tile_pages(block_table_row, (blk + 1) * BLOCK_N, offs_n, seqlen_k,
                                        page_size, ONE_PAGE, PAGE_SHIFT)
            else:
                page = tile_pages(block_table_row, blk * BLOCK_N, offs_n, seqlen_k, page_size,
                                  ONE_PAGE, PAGE_SHIFT)
            k_rows = tile_rows(page, blk * BLOCK_N, offs_n, page_size, num_pages, stride_kpage,
                               stride_kn, ONE_PAGE, PAGE_SHIFT)
            v_rows = tile_rows(page, blk * BLOCK_N, offs_n, page_size, num_pages, stride_vpage,
                               stride_vn, ONE_PAGE, PAGE_SHIFT)
            k = load_tile(k_ptrs + k_rows[:, None], blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, False)
        else:
            k = load_tile(k_ptrs, blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, USE_TMA)
        if FP8 >= 2:
            k_scales = k_scales_ahead
            v_scales = v_scales_ahead
            if not PAGED:  # paged caches find the next tile's pages first: at the end of the step
                nxt = cols + BLOCK_N
                k_scales_ahead = tl.load(k_descale + nxt * stride_scale_n, mask=nxt < seqlen_k, other=0.0)
                v_scales_ahead = tl.load(v_descale + nxt * stride_scale_n, mask=nxt < seqlen_k, other=0.0)
            if FP8 < 4:
                k = k.to(q.dtype)
            else:  # e4m3 as loaded (a no-op), or back from the interpreter's exact upcast
                k = k.to(tl.float8e4nv)
        if FP8 >= 4:
            qk = tl.dot(q, tl.trans(k))
            if Q_TERMS == 2:
                qk = tl.dot(q_lo, tl.trans(k), qk)
        else:
            qk = tl.dot(q, tl.trans(k))
        if FP8 >= 2:
            qk = qk * k_scales[None, :]
        tile_scale = 1.0
        if FP8 == 1:
            tile_scale = k_scale_ahead
            v_scale = v_scale_ahead
            nxt = (blk + 1) * BLOCK_N // SCALE_BLOCK_K
            k_scale_ahead = tl.load(k_descale + nxt, mask=blk + 1 < blk_hi, other=1.0)
            v_scale_ahead = tl.load(v_descale + nxt, mask=blk + 1 < blk_hi, other=1.0)
        # s * s_scale is the score in log2 units; the plain path leaves the scale to one FMA
        # inside the exponential below.
        if SOFTCAP:  # softcap * tanh(scale * qk / softcap), qk_scale = softcap * log2(e)
            s = softcap_tanh(qk * (softcap_in * tile_scale), SOFTCAP == 2) * qk_scale
            s_scale = 1.0
        else:
            s = qk
            s_scale = qk_scale * tile_scale
        if ALIBI:
            s = s * s_scale - alibi_slope * tl.abs(rows_pos[:, None] - cols[None, :]).to(tl.float32)
            s_scale = 1.0
        if MASKED:
            keep = visible(rows_pos[:, None], cols[None, :], seqlen_k, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * s_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PAGED:
            v = load_tile(v_ptrs + v_rows[:, None], blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, False)
        elif FP8 == 1 and USE_TMA:  # a (head dim, keys) tile of V^T, read as its (keys, head dim) view
            v = tl.trans(v_ptrs.load([0, blk * BLOCK_N]))
        else:
            v = load_tile(v_ptrs, blk, kv_ok, MASKED, BLOCK_N, D_MASK, UPCAST, USE_TMA)
        if DROPOUT:  # the normalizer keeps every probability; only the product with V drops some
            keep = dropout_keep(rng_seed, rng_rows[:, None], cols[None, :], dropout_p)
            p = tl.where(keep, p, 0.0)
        if FP8 == 1:  # P in e4m3 too: in [0, 1] times V's relative descale, in (0, P_SHIFT]
            p = p * v_scale
        if FP8 >= 2:
            # V's descales scale P's columns, relative to the tile's largest so that P stays within
            # [0, 1] in a 16-bit type; the largest multiplies this tile's P V.
            v_max = tl.max(v_scales, 0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            p = p * (v_scales / v_max)[None, :]
            if FP8 == 3 or FP8 == 4:  # fp16 math (the decode kernel's fp16 or Q_FP16-scaled query)
                tl.static_assert(q.dtype == tl.float16 or FP8 == 4, "FP8 == 3 widens V to fp16 only")
                v = widen_e4m3(v)
            elif FP8 == 5:
                v = v.to(tl.float16)
            else:
                v = v.to(q.dtype)
            acc += tl.dot(p.to(v.dtype), v) * v_max
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        if FP8 >= 2 and PAGED:
            nxt = cols + BLOCK_N
            if PAGED >= 2:  # page_ahead, loaded at the top of this step, holds the next tile's pages
                nxt_page = page_ahead
            else:
                nxt_page = tile_pages(block_table_row, (blk + 1) * BLOCK_N, offs_n, seqlen_k,
                                      page_size, ONE_PAGE, PAGE_SHIFT)
            nxt_at = tile_rows(nxt_page, (blk + 1) * BLOCK_N, offs_n, page_size, num_pages,
                               stride_scale_page, stride_scale_n, ONE_PAGE, PAGE_SHIFT)
            k_scales_ahead = tl.load(k_descale + nxt_at, mask=nxt < seqlen_k, other=0.0)
            v_scales_ahead = tl.load(v_descale + nxt_at, mask=nxt < seqlen_k, other=0.0)
        if not USE_TMA and not PAGED:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, Alibi, CuSeqlensQ, CuSeqlensK, DropoutSeed, BlockTable,
              QDescale, KDescale, VDescale, Sinks, stride_sqb, stride_sqh, stride_skb, stride_skh,
              stride_qb, stride_qs, stride_qh,
              stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_vd,
              stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ab,
              seqlen_q, seqlen_k, group_size, diag_offset, window_left, window_right,
              qk_scale, softcap_in, dropout_p, stride_btb, block_table_width, page_size, num_pages,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
              ALIBI: tl.constexpr, LONGEST_FIRST: tl.constexpr, UPCAST: tl.constexpr,
              USE_TMA: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr,
              PAGED: tl.constexpr, FP8: tl.constexpr = 0, SCALE_BLOCK_Q: tl.constexpr = 1,
              SCALE_BLOCK_K: tl.constexpr = 1, SINKS: tl.constexpr = False):
    """FP8 == 1: e4m3 q, k, v with block descales, V stored transposed (see _attn_fwd_inner).
    FP8 == 2, 3 or 4 (packed sequences, contiguous or on page pools): e4m3 q, k, v with one descale
    per (sequence, KV head), the inner loop's e4m3-cache modes with key and page strides 0 for the
    descales; 2 and 3 widen the query to fp16 (exact), 4 keeps it e4m3 for e4m3 score dots (one
    term). SINKS: Sinks (H,) holds one more logit a head (attention sinks, gpt-oss's), a column with
    no value that the normalizer and the LSE count."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if LONGEST_FIRST:  # with a right bound, later query blocks see more keys: launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    kv_head = head // group_size
    m0 = pid_m * BLOCK_M
    # Packed sequences (VARLEN): batch strides are 0 and each sequence starts at its cu_seqlens
    # offset; a program past its sequence's end loads nothing and stores nothing.
    q_start, seqlen_q = sequence_span(CuSeqlensQ, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_span(CuSeqlensK, batch, seqlen_k, VARLEN)
    block_table_row = BlockTable
    if PAGED:  # K/V live in a page pool (num_pages, page_size, Hk, D): stride_kb walks pages
        seqlen_k = tl.minimum(seqlen_k, block_table_width * page_size)
        k_start = k_start * 0
        block_table_row = BlockTable + batch.to(tl.int64) * stride_btb
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows_pos = offs_m + diag_offset

    blk_lo, full_blk_lo, full_blk_hi, blk_hi = key_blocks(
        m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT)

    q_base = (Q + batch.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs
              + head.to(tl.int64) * stride_qh)
    if PAGED:
        k_base = K + kv_head.to(tl.int64) * stride_kh
        v_base = V + kv_head.to(tl.int64) * stride_vh
    else:
        k_base = (K + batch.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks
                  + kv_head.to(tl.int64) * stride_kh)
        v_start = k_start
        if FP8 == 1 and VARLEN:  # packed V^T: sequence b from a 16-key boundary (packed_keys_transposed)
            v_start = (k_start + 15) // 16 * 16 + 16 * batch
        v_base = (V + batch.to(tl.int64) * stride_vb + v_start.to(tl.int64) * stride_vs
                  + kv_head.to(tl.int64) * stride_vh)
    q_ok = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    if USE_TMA and not PAGED:
        q_desc = sequence_descriptor(q_base, Q, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
        k_src = sequence_descriptor(k_base, K, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        if FP8:  # V^T: HEAD_DIM rows of seqlen_k keys (stride_vs is 1)
            v_src = tl.make_tensor_descriptor(tl.where(seqlen_k > 0, v_base, V),
                                              [HEAD_DIM, tl.maximum(seqlen_k, 1)], [stride_vd, 1],
                                              [HEAD_DIM_PAD, BLOCK_N])
        else:
            v_src = sequence_descriptor(v_base, V, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        q = q_desc.load([m0, 0])
    else:
        if PAGED:  # rows are gathered per tile
            k_src = k_base + offs_d[None, :]
            v_src = v_base + offs_d[None, :] * stride_vd
        else:
            k_src = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
            v_src = v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif FP8 == 2 or FP8 == 3:
        q = q.to(tl.float16)

    alibi_slope, rng_seed = head_terms(Alibi, stride_ab, DropoutSeed, batch, head,
                                       tl.num_programs(1), ALIBI, DROPOUT)
    rng_rows = offs_m * seqlen_k
    k_descale = KDescale
    v_descale = VDescale
    if FP8:  # the query block's descale folds into the score scale; K's and V's come per tile
        q_descale = tl.load(QDescale + batch.to(tl.int64) * stride_sqb + head * stride_sqh
                            + m0 // SCALE_BLOCK_Q)
        if SOFTCAP:
            softcap_in = softcap_in * q_descale
        else:
            qk_scale = qk_scale * q_descale
        k_descale = KDescale + batch.to(tl.int64) * stride_skb + kv_head * stride_skh
        v_descale = VDescale + batch.to(tl.int64) * stride_skb + kv_head * stride_skh
        if FP8 == 1:
            # After the relative descales of the key blocks: the largest, applied to the output.
            v_descale_max = tl.load(v_descale + (seqlen_k + SCALE_BLOCK_K - 1) // SCALE_BLOCK_K)

    # Running-max floor: finite, so a row with no visible key so far keeps exp2(floor - floor) = 1
    # and p = exp2(-inf - floor) = 0 instead of NaN from (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    if HAS_LEFT:  # left edge of a sliding window
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, q, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
            blk_lo, full_blk_lo, seqlen_k, window_left, window_right, qk_scale, softcap_in,
            alibi_slope, rng_seed, rng_rows, dropout_p, block_table_row, page_size, num_pages,
            stride_kb, stride_vb, k_descale, v_descale, 0, 0, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, USE_TMA, DROPOUT, PAGED, FP8, SCALE_BLOCK_K,
            Q_TERMS=1)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, q, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
        full_blk_lo, full_blk_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in,
        alibi_slope, rng_seed, rng_rows, dropout_p, block_table_row, page_size, num_pages,
        stride_kb, stride_vb, k_descale, v_descale, 0, 0, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, HAS_LEFT,
        HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, USE_TMA, DROPOUT, PAGED, FP8, SCALE_BLOCK_K, Q_TERMS=1)
    # Diagonal / right window edge and the ragged end of the keys.
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, q, k_src, v_src, stride_ks, stride_vs, rows_pos, offs_n, offs_d,
        full_blk_hi, blk_hi, seqlen_k, window_left, window_right, qk_scale, softcap_in,
        alibi_slope, rng_seed, rng_rows, dropout_p, block_table_row, page_size, num_pages,
        stride_kb, stride_vb, k_descale, v_descale, 0, 0, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT,
        HAS_RIGHT, SOFTCAP, ALIBI, UPCAST, USE_TMA, DROPOUT, PAGED, FP8, SCALE_BLOCK_K, Q_TERMS=1)

    # Rows that saw no key: output 0 and LSE +inf (flash_attn's convention).
    seen = l_i > 0.0
    if SINKS:  # the sink's column joins the running sum here, so the output is rounded once
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.where(seen, tl.maximum(m_i, sink), m_i)
        alpha = tl.exp2(m_i - m_new)
        l_i = tl.where(seen, l_i * alpha + tl.exp2(tl.minimum(sink - m_new, 0.0)), l_i)
        acc = acc * alpha[:, None]
        m_i = m_new
    l_safe = tl.where(seen, l_i, 1.0)
    inv_l = 1.0 / l_safe
    if DROPOUT:  # kept probabilities are scaled by 1 / (1 - p)
        inv_l = inv_l / (1.0 - dropout_p)
    if FP8 == 1:
        inv_l = inv_l * v_descale_max
    out = acc * inv_l[:, None]  # acc is 0 on unseen rows
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))

    o_ptrs = (Out + batch.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os
              + head.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_ok)
    l_ptrs = Lse + batch.to(tl.int64) * stride_lb + head * stride_lh + q_start + offs_m
    tl.store(l_ptrs, lse, mask=offs_m < seqlen_q)


class _DescriptorScratch:
    """Global memory for the tensor descriptors the kernel builds (a few hundred bytes per program).

    Kept per (device, stream) and grown on demand, so a call allocates nothing beyond its output and
    LSE; launches on one stream run in order, so they can share it. During CUDA graph capture the
    memory comes from the graph's pool instead, so replays never share it with eager launches.
    """

    def __init__(self):
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, size: int, alignment: int, stream):
        device = torch.cuda.current_device()
        if torch.cuda.is_current_stream_capturing():
            return torch.empty(size, dtype=torch.int8, device=device)
        key = (device, stream)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < size:
            buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device=device)
            self._buffers[key] = buf
        return buf


_descriptor_scratch = _DescriptorScratch()


def _tma_eligible(tensors, strides) -> bool:
    """TMA needs 16-byte aligned bases, 16-byte multiples for every stride but the contiguous
    one (the head dim's, or the keys' for a transposed e4m3 V) and 16-byte rows."""
    for t, st in zip(tensors, strides):
        size = t.element_size()
        inner = 1 if st[3] != 1 and st[1] == 1 else 3
        if t.data_ptr() % 16 or any((x * size) % 16 for i, x in enumerate(st) if i != inner):
            return False
        if t.shape[inner] * size < 16 and inner == 3:
            return False
    return True


# The Hopper (sm_90) forward in Gluon runs wherever it applies (gluon_forward.supported: bf16/fp16,
# head dims 64/128/256, full or bottom-right causal, sliding windows where GLUON_WINDOW_MIN_KEYS says,
# nothing else); FLASHTILE_GLUON=0 keeps every call on the portable Triton kernel.
GLUON_ENABLED = os.environ.get("FLASHTILE_GLUON", "1") not in ("", "0")
_PLAIN_GLUON = GLUON_ENABLED and not _INTERPRET
# Sliding windows (window_size, plain calls and contiguous 16-bit packed sequences) on the Gluon forward
# as well, at the head dims below
# where a row's window spans at least that many keys (left + right + 1, causal: left + 1);
# FLASHTILE_GLUON_WINDOW=0 leaves them all on the portable kernel. H200, causal windows over 16k tokens
# (window-probe-h200-20261204.json), Gluon / portable TFLOP/s at windows of 128/256/512/1024/2048/4096
# keys: d128 (32/8 heads) 0.91/0.94/1.15/1.29/1.33/1.34x, d256 (16/8) 1.50/1.49/1.43/1.43/1.43/1.42x;
# d64 (64/8, the 192-row three-consumer blocks) 0.51/0.54/0.60/0.77/0.90x up to 2048: not taken.
GLUON_WINDOW = os.environ.get("FLASHTILE_GLUON_WINDOW", "1") not in ("", "0")
GLUON_WINDOW_MIN_KEYS = {128: 512, 256: 0}


def window_span(window_left: int, window_right: int) -> float:
    """Keys a row's window spans (-1: an unbounded side)."""
    if window_left < 0 or window_right < 0:
        return math.inf
    return window_left + window_right + 1


# A plain call with few query tiles against many keys runs the split-KV decode kernel instead of the
# Gluon forward, whose grid is the query tiles alone (one CTA per 128 positions and head): at most
# SPLIT_KEYS_MAX_QUERIES positions, SPLIT_KEYS_MIN_KEYS keys, and work tiles for a quarter of the SMs.
# H200, CUDA-graph replays (short-queries-h200-20261201): 12-32 tiles 1.05-5.9x faster from 1k keys
# (B1 32/8 Sq 128: 2k 1.31x, 16k 2.13x; B1 12/2 Sq 128 16k 4.48x); 64 tiles 0.82-0.93x at 1-2k keys,
# 1.03-1.20x from 4k; 128 tiles 0.51-0.69x.
SPLIT_KEYS_MAX_QUERIES = 256
SPLIT_KEYS_MIN_KEYS = 1024
SPLIT_KEYS_MAX_TILES_PER_SM = 0.25


def split_keys_wanted(batch: int, seqlen_q: int, heads: int, seqlen_k: int, sm_count: int) -> bool:
    """Whether a plain call of these sizes takes the decode kernel (see SPLIT_KEYS_MAX_QUERIES)."""
    return (seqlen_q <= SPLIT_KEYS_MAX_QUERIES and seqlen_k >= SPLIT_KEYS_MIN_KEYS
            and batch * heads * -(-seqlen_q // 128) <= SPLIT_KEYS_MAX_TILES_PER_SM * sm_count)


_KEY_COUNTS: dict = {}  # (device, stream, batch, keys) -> the (batch,) int32 tensor of that many keys
_MAX_KEY_COUNTS = 256


def key_counts(batch: int, keys: int, device: torch.device) -> torch.Tensor:
    """A (batch,) int32 tensor of ``keys`` (the decode kernel's per-sequence lengths for a plain
    call), made once per (device, stream, batch, keys) instead of filled by a kernel each call; the
    kernels only read it. Kept per stream: its fill precedes every later read on that stream, with
    no host sync. Under CUDA-graph capture a fresh one, filled in the graph and not kept (a captured
    fill has not run when capture ends)."""
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.full((batch,), keys, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream, batch, keys)
    counts = _KEY_COUNTS.get(key)
    if counts is None:
        if len(_KEY_COUNTS) >= _MAX_KEY_COUNTS:
            _KEY_COUNTS.clear()
        counts = _KEY_COUNTS[key] = torch.full((batch,), keys, dtype=torch.int32, device=device)
    return counts


def _gluon_takes_softcap(softcap: float) -> bool:
    """Whether a call's softcap leaves it to the Gluon forward: none, or gluon_forward.SOFTCAP_IN_KERNEL
    (16-bit plain calls and packed sequences; the routes' own checks refuse the rest)."""
    if not softcap:
        return True
    from . import gluon_forward
    return gluon_forward.SOFTCAP_IN_KERNEL


def gluon_applies(q, k, v, *, softmax_scale, window_left, window_right, diag_offset, softcap=0.0,
                  alibi_slopes=None, config=None, cu_seqlens_q=None, dropout_seed=None,
                  block_table=None, descales=None) -> bool:
    """Whether attention_forward hands this call to the Gluon kernel."""
    if not GLUON_ENABLED or _INTERPRET or not q.is_cuda:
        return False
    if (config is not None or cu_seqlens_q is not None or dropout_seed is not None
            or block_table is not None or descales is not None or alibi_slopes is not None
            or not _gluon_takes_softcap(softcap)):
        return False
    if q.dim() != 4:
        return False
    bottom_right = diag_offset == k.shape[1] - q.shape[1]
    causal = window_right == 0 and bottom_right
    if window_left >= 0 or (window_right >= 0 and not causal):  # a sliding window
        if not (GLUON_WINDOW and bottom_right
                and window_span(window_left, window_right) >= GLUON_WINDOW_MIN_KEYS.get(q.shape[-1], math.inf)):
            return False
    from . import gluon_forward
    return gluon_forward.supported(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   window_size=(window_left, window_right), softcap=softcap)


# The e4m3 kernels multiply P (in [0, 1]) by V's relative descale before P's cast to e4m3; times
# this power of two as well, P lies in (0, 256] (e4m3 holds up to 448) and its small values stay off
# e4m3's subnormals (below 2^-6, 3 bits down to 1) for 8 more binades.
P_SHIFT = 256.0


def fp8_kernel_descales(q_d: torch.Tensor, k_d: torch.Tensor, v_d: torch.Tensor):
    """The descales as the e4m3 kernels read them: Q's as given; K's and V's relative to V's
    largest (times P_SHIFT), each row followed by that largest (over P_SHIFT: the kernels multiply
    the output by it), both (B, Hk, blocks + 1) in one layout. On a GPU (outside the interpreter)
    one launch of _kernel_descale_rows, whose values are bit for bit these (descales on the current
    device: the launch goes there; torch follows the tensors to another one)."""
    if (k_d.is_cuda and not _INTERPRET and k_d.dim() == 3 and v_d.shape == k_d.shape
            and k_d.get_device() == v_d.get_device() == torch._C._cuda_getDevice()):
        return (q_d, *_fused_kernel_descales(k_d, v_d))
    v_max = v_d.amax(-1, keepdim=True) / P_SHIFT
    return (q_d, torch.nn.functional.pad(k_d, (0, 1), value=1.0), torch.cat([v_d / v_max, v_max], -1))


@triton.jit
def _kernel_descale_rows(KIn, VIn, KOut, VOut, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                         stride_vn, heads_k, blocks, P_SHIFT_: tl.constexpr, BLOCK: tl.constexpr):
    """One (batch, KV head) row of fp8_kernel_descales: K's row then 1, V's row over its largest
    / P_SHIFT_ then that. (Five torch operations cost ~35 us of host time a call, more than the
    GPU time of a short e4m3 prefill.)"""
    row = tl.program_id(0)
    b = row // heads_k
    h = row % heads_k
    k_in = KIn + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_in = VIn + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    out_row = row.to(tl.int64) * (blocks + 1)
    offs = tl.arange(0, BLOCK)
    largest = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, blocks, BLOCK):
        n = start + offs
        largest = tl.maximum(largest, tl.load(v_in + n * stride_vn, mask=n < blocks, other=float("-inf")))
    v_max = tl.max(largest, 0) / P_SHIFT_
    for start in range(0, blocks, BLOCK):
        n = start + offs
        keep = n < blocks
        tl.store(KOut + out_row + n, tl.load(k_in + n * stride_kn, mask=keep), mask=keep)
        tl.store(VOut + out_row + n, tl.load(v_in + n * stride_vn, mask=keep) / v_max, mask=keep)
    tl.store(KOut + out_row + blocks, 1.0)
    tl.store(VOut + out_row + blocks, v_max)


_DESCALE_ROW_OPTIONS = {"P_SHIFT_": P_SHIFT, "BLOCK": 256, "num_warps": 1}


def _fused_kernel_descales(k_d: torch.Tensor, v_d: torch.Tensor):
    from .launch import launch
    batch, heads_k, blocks = k_d.shape
    # one allocation, V's half 16-byte aligned as a tensor of its own would be (the kernels that read
    # it are specialized on that)
    total = batch * heads_k * (blocks + 1)
    half = -(-total // 4) * 4
    both = torch.empty(2 * half, dtype=torch.float32, device=k_d.device)
    k_out = both[:total].view(batch, heads_k, blocks + 1)
    v_out = both[half:half + total].view(batch, heads_k, blocks + 1)
    if batch * heads_k:
        launch(_kernel_descale_rows, (batch * heads_k,), (k_d, v_d, k_out, v_out),
               (*k_d.stride(), *v_d.stride(), heads_k, blocks), _DESCALE_ROW_OPTIONS)
    return k_out, v_out


# e4m3 calls with one descale per (sequence, KV head): flash_attn_varlen_func's, on page pools or
# contiguous. H200, 8 x 2048 causal, 32/8 heads, d128 (varlen-fp8-modes-h200-20261202.json):
# contiguous packed sequences took 4.20 ms in the block-descale kernel (FP8 == 1, V^T through
# pointers: packed sequences start mid-row) against 0.95 ms here (64 x 64 tiles, 4 warps, 3 stages);
# pages of 16 1.08 ms with 128 x 64 tiles and 8 warps (1.63 ms with the 16-bit tiles, 4 warps).
# Measurement overrides (None: the choices below): the FP8 constexpr, the tiles, and whether
# contiguous packed sequences take these modes instead of FP8 == 1.
SEQUENCE_FP8_MODE: int | None = None
SEQUENCE_FP8_CONFIG: TileConfig | None = None
VARLEN_FP8_BY_SEQUENCE = os.environ.get("FLASHTILE_VARLEN_FP8_BY_SEQUENCE", "1") not in ("", "0")


def sequence_fp8_config_for_arch(head_dim: int, arch: int, paged: bool) -> TileConfig:
    """Tiles for the per-sequence e4m3 modes on sm_<arch> (pointer loads, no TMA)."""
    if 90 <= arch < 120:
        if head_dim_padded(head_dim) <= 128 and not paged:
            return TileConfig(64, 64, 4, 3)
        return TileConfig(128, 64, 8, 2)
    return config_for_arch(head_dim, arch)


def sequence_fp8_config(device: torch.device, head_dim: int, paged: bool) -> TileConfig:
    if SEQUENCE_FP8_CONFIG is not None:
        return SEQUENCE_FP8_CONFIG
    if device.type != "cuda" or interpreting():
        return pick_config(head_dim, device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sequence_fp8_config_for_arch(head_dim, _arch(index), paged)


def sequence_fp8_mode(device: torch.device, head_dim: int) -> int:
    """_attn_fwd's FP8 constexpr for e4m3 q, k, v with one descale per (sequence, KV head): 4 (e4m3
    score dots, V widened by PTX) where e4m3 tensor cores and conversions exist and the head dim
    fills an e4m3 dot's 32-deep reduction, 3 (all fp16, V widened by PTX) on those GPUs below it,
    else 2 (fp16 by Triton's conversions; the interpreter: float32)."""
    if SEQUENCE_FP8_MODE is not None:
        return SEQUENCE_FP8_MODE
    if interpreting() or device.type != "cuda":
        return 2
    if _arch(device.index if device.index is not None else torch.cuda.current_device()) < 89:
        return 2
    return 4 if head_dim_padded(head_dim) >= 32 else 3


def gluon_fp8_applies(q, k, v, *, window_left, window_right, diag_offset, scale_blocks, softcap=0.0,
                      alibi_slopes=None, config=None, cu_seqlens_q=None, softmax_scale=1.0) -> bool:
    """Whether attention_forward hands an e4m3 call (v already keys-contiguous) to the Gluon kernel:
    sm_90, full or bottom-right causal, a positive softmax scale (the running max assumes it), no
    softcap, ALiBi, packed sequences or tile override, and the tensors and scale blocks
    gluon_forward.fp8_shapes_supported takes."""
    if not GLUON_ENABLED or _INTERPRET or not q.is_cuda or config is not None or not softmax_scale > 0:
        return False
    if cu_seqlens_q is not None or softcap or alibi_slopes is not None or window_left >= 0:
        return False
    causal = window_right == 0 and diag_offset == k.shape[1] - q.shape[1]
    if window_right >= 0 and not causal:
        return False
    from . import gluon_forward
    if not gluon_forward._GLUON or _arch(q.device.index) != 90:
        return False
    return gluon_forward.fp8_shapes_supported(q, k, v, scale_blocks, causal)


def fp8_forward_kernel_name(q, k, v, *, causal: bool, scale_blocks: tuple[int, int]) -> str:
    """Which forward kernel an e4m3 call (flashtile.fp8.attention, no window or softcap) runs."""
    v = v if v.stride(1) == 1 and v.stride(3) % 16 == 0 else keys_contiguous(v)
    if gluon_fp8_applies(q, k, v, window_left=-1, window_right=0 if causal else -1,
                         diag_offset=k.shape[1] - q.shape[1], scale_blocks=scale_blocks):
        from . import gluon_forward
        return gluon_forward.default_variant(q.shape[-1], "fp8", causal).name
    return "triton"


def forward_kernel_name(q, k, v, *, causal: bool, softmax_scale: float | None = None) -> str:
    """Which forward kernel a plain flash_attn_func call (no dropout, window, softcap or ALiBi) runs:
    the Gluon variant's name, or "triton" (the portable kernel)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if gluon_applies(q, k, v, softmax_scale=scale, window_left=-1, window_right=0 if causal else -1,
                     diag_offset=k.shape[1] - q.shape[1]):
        from . import gluon_forward
        return gluon_forward.dispatch_variant(q.shape[-1], gluon_forward._DTYPES[q.dtype], causal,
                                              k.shape[1]).name
    return "triton"


def _sinks_after(result, sinks):
    """A Gluon route's (out, lse) with the attention sinks applied in place (kernels/sinks.py): the
    portable kernel and the decode route take them in their epilogues instead, and so do the Gluon
    plain and packed launches (16-bit and e4m3; page pools and windows included) with
    gluon_forward.SINKS_IN_EPILOGUE."""
    if sinks is not None:
        from .sinks import apply_sinks_  # (sinks imports this module)
        apply_sinks_(*result, sinks, packed=result[0].dim() == 3)
    return result


# Training steps with a logit softcap take its tanh by tanh.approx.f32 in the forward and the backward
# alike, as flash-attn's kernels do (cutlass::fast_tanh): both recompute the same capped scores, so P
# stays consistent with the LSE. sm_90 only (where it was measured). H200, Gemma-2 27B's heads, cap 50
# (softcap-train-h200-20261205-approx(-b)): 1.17-1.20x a d128 step against the formula, 14/14 float64
# gradient checks (the fused backward, the portable one at d96/d256/deterministic=True). d64 steps
# timed noisily there. FLASHTILE_SOFTCAP_APPROX_TRAIN=0 keeps exp2's formula in both.
SOFTCAP_APPROX_TRAIN = os.environ.get("FLASHTILE_SOFTCAP_APPROX_TRAIN", "1") not in ("", "0")


def softcap_approx_in_training(q: torch.Tensor, softcap: float) -> bool:
    """Whether a training call's forward and backward (attention_forward's and attention_backward's
    ``softcap_approx``) take the softcap's tanh by tanh.approx: a function of the inputs and flags
    only, so the backward, eager or registered, reaches the forward's answer again."""
    return bool(softcap > 0 and SOFTCAP_APPROX_TRAIN and q.is_cuda and not _INTERPRET
                and _arch(q.device.index if q.device.index is not None else torch.cuda.current_device()) == 90)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                      window_left: int, window_right: int, diag_offset: int, softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None, config: TileConfig | None = None,
                      cu_seqlens_q: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0,
                      max_seqlen_k: int = 0, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, descales=None,
                      scale_blocks: tuple[int, int] = (0, 0), keyed_sequences: int = 0, sinks=None,
                      forward_only: bool = False, softcap_approx: bool = False):
    """Launch the forward on validated (batch, seqlen, heads, head_dim) tensors.

    ``window_left``/``window_right`` are -1 for an unbounded side (causal = right 0); query row i sits
    at key position i + ``diag_offset``. Returns (out, lse): out (B, Sq, H, D) in q's dtype, lse
    float32 (B, H, Sq).

    Packed sequences: with ``cu_seqlens_q``/``cu_seqlens_k`` (int32, B + 1 offsets) q is
    (total_q, H, D), k/v (total_k, Hk, D), every sequence is aligned bottom-right on its own
    (``diag_offset`` is ignored), and out is (total_q, H, D), lse (H, total_q); ``max_seqlen_q``
    bounds every sequence's queries and ``max_seqlen_k`` (0: not given) its keys.

    Dropout: ``dropout_p`` > 0 with ``dropout_seed`` (int64, one element, on the device) drops
    probabilities from the product with V by a Philox draw that the backward regenerates.

    Paged KV (with packed queries): k/v are page pools (num_pages, page_size, Hk, D), sequence b's
    keys are its cu_seqlens_k length, found through ``block_table`` (B, max_pages) int32 rows.

    FP8: q, k, v float8_e4m3fn (no block table, no dropout) with ``descales`` = (q (B, H, Sq blocks),
    k and v (B, Hk, Sk blocks)) float32, one per ``scale_blocks`` = (queries, keys) tokens, each a
    multiple of the kernel's tile; out is bfloat16. ``keyed_sequences`` > 0: at most that many
    packed sequences have keys (sizes e4m3 page pools' gathers, paged_keys_packed).

    ``forward_only``: no backward follows (its LSE is not used to recompute P), so the Gluon routes
    may take the softcap's tanh by tanh.approx (gluon_forward.SOFTCAP_APPROX). ``softcap_approx``:
    every route takes it, the portable kernel too (a training step whose backward is told the same:
    softcap_approx_in_training), and none hands the call to the decode kernels, which do not.
    """
    approx = softcap > 0 and softcap_approx
    if forward_only and softcap > 0 and not approx:
        from . import gluon_forward
        approx = gluon_forward.SOFTCAP_APPROX
    if (_PLAIN_GLUON and out is None and lse is None and config is None and cu_seqlens_q is None
            and dropout_seed is None and block_table is None and descales is None
            and alibi_slopes is None and window_left < 0 and _gluon_takes_softcap(softcap)):
        # flash_attn_func's plain call: the Gluon kernel's plan looked up by the inputs' geometry
        causal = window_right == 0 and diag_offset == k.shape[1] - q.shape[1]
        if window_right < 0 or causal:
            from . import gluon_forward
            if (q.is_cuda and not softcap_approx
                    and split_keys_wanted(q.shape[0], q.shape[1], q.shape[2], k.shape[1],
                                          gluon_forward._sm_count(q.device))
                    and gluon_forward.plain_plan(q, k, v, causal) is not None):
                from .decode import decode_attention
                lengths = key_counts(q.shape[0], k.shape[1], q.device)
                return decode_attention(q, k, v, lengths, softmax_scale=softmax_scale, window_left=-1,
                                        window_right=0 if causal else -1, softcap=softcap, sinks=sinks)
            inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
            result = gluon_forward.plain_forward(q, k, v, softmax_scale, causal, sinks=inside, softcap=softcap,
                                                 softcap_approx=approx)
            if result is not None:
                return result if inside is not None else _sinks_after(result, sinks)
    if (_PLAIN_GLUON and descales is not None and out is None and lse is None and config is None
            and cu_seqlens_q is None and dropout_seed is None and block_table is None and not softcap
            and alibi_slopes is None and window_left < 0 and q.is_cuda and q.dtype == torch.float8_e4m3fn):
        # an e4m3 plain call (flashtile.fp8.attention, flash_attn_func's): the Gluon kernel's plan
        # looked up by geometry
        causal = window_right == 0 and diag_offset == k.shape[1] - q.shape[1]
        if window_right < 0 or causal:
            from . import gluon_forward
            if v.stride(1) != 1 or v.stride(3) % 16:  # V^T, as the general path below reads it too
                v = keys_contiguous(v)
            inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
            result = gluon_forward.fp8_forward(q, k, v, descales, scale_blocks, softmax_scale, causal,
                                               sinks=inside)
            if result is not None:
                return result if inside is not None else _sinks_after(result, sinks)
    if (_PLAIN_GLUON and cu_seqlens_q is not None and out is None and lse is None and config is None
            and dropout_seed is None and block_table is None and descales is None
            and alibi_slopes is None and window_left < 0 and window_right <= 0 and q.is_cuda
            and (q.dtype is torch.bfloat16 or q.dtype is torch.float16) and _gluon_takes_softcap(softcap)):
        # flash_attn_varlen_func's plain call: _gluon_varlen's launch from a plan looked up by the
        # inputs' geometry (max_seqlen_k 0: not given, the packed keys bound every sequence)
        from . import gluon_forward
        inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
        result = gluon_forward.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k if max_seqlen_k > 0 else k.shape[0],
                                              softmax_scale, window_right == 0, sinks=inside, softcap=softcap,
                                              softcap_approx=approx)
        if result is not None:
            return result if inside is not None else _sinks_after(result, sinks)
    if gluon_applies(q, k, v, softmax_scale=softmax_scale, window_left=window_left,
                     window_right=window_right, diag_offset=diag_offset, softcap=softcap,
                     alibi_slopes=alibi_slopes, config=config, cu_seqlens_q=cu_seqlens_q,
                     dropout_seed=dropout_seed, block_table=block_table, descales=descales):
        from . import gluon_forward
        if (out is None or gluon_forward._tma_ok(out)) and (lse is None or lse.stride(-1) == 1):
            inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
            result = gluon_forward.gluon_attention_forward(
                q, k, v, softmax_scale=softmax_scale, causal=window_right == 0, out=out, lse=lse,
                window_size=(window_left, window_right), softcap=softcap, sinks=inside, softcap_approx=approx)
            return result if inside is not None else _sinks_after(result, sinks)
    if cu_seqlens_q is not None and GLUON_ENABLED and not _INTERPRET:
        from . import gluon_forward
        inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
        result = _gluon_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=softmax_scale,
                               window_left=window_left, window_right=window_right, softcap=softcap,
                               alibi_slopes=alibi_slopes, out=out, lse=lse, config=config,
                               dropout_seed=dropout_seed, descales=descales, scale_blocks=scale_blocks,
                               block_table=block_table, keyed_sequences=keyed_sequences, sinks=inside,
                               softcap_approx=approx)
        if result is not None:
            return result if inside is not None else _sinks_after(result, sinks)
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    if varlen:
        q = q.unsqueeze(0)
        if not paged:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        if out is not None:
            out = out.unsqueeze(0)
        if lse is not None:
            lse = lse.unsqueeze(0)
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    if paged:  # lengths come from cu_seqlens_k; this only bounds their clamp
        seqlen_k = block_table.shape[0] * block_table.shape[1] * k.shape[1]
    fp8 = q.dtype == torch.float8_e4m3fn
    if out is None:
        out = torch.empty(batch, seqlen_q, heads, head_dim, dtype=torch.bfloat16 if fp8 else q.dtype,
                          device=q.device)
    if lse is None:
        lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if varlen:
        result = out[0], lse[0]
        batch, grid_rows = cu_seqlens_q.shape[0] - 1, max_seqlen_q
    else:
        result, grid_rows = (out, lse), seqlen_q
    if grid_rows == 0 or batch == 0 or heads == 0:
        return result
    # e4m3 with one descale per sequence (varlen, page pools): V as given, not transposed
    by_sequence = fp8 and (paged or (varlen and VARLEN_FP8_BY_SEQUENCE))
    if config is not None:
        cfg = config
    elif by_sequence:
        cfg = sequence_fp8_config(q.device, head_dim, paged)
    else:
        # (plain calls only: packed sequences and page pools on these tiles are not measured)
        cfg = ((not (fp8 or varlen or paged) and short_window_config(head_dim, q.device, window_left,
                                                                      window_right))
               or pick_config(head_dim, q.device, fp8))
    fp8_mode = 0
    if fp8 and dropout_seed is not None:
        raise NotImplementedError("flashtile: FP8 attention takes no dropout")
    if by_sequence:
        fp8_mode = sequence_fp8_mode(q.device, head_dim)
    elif fp8:
        fp8_mode = 1
        if scale_blocks[0] % cfg.block_m or scale_blocks[1] % cfg.block_n:
            raise ValueError(f"FP8 scale blocks {scale_blocks} must be multiples of the kernel's tiles "
                             f"({cfg.block_m}, {cfg.block_n}); see flashtile.fp8.kernel_blocks")
        if varlen:
            v = packed_keys_transposed(v[0], cu_seqlens_k, max_seqlen_k or None)
        elif v.stride(1) != 1 or v.stride(3) % 16:  # the kernel reads V^T (see _attn_fwd_inner)
            v = keys_contiguous(v)
        descales = fp8_kernel_descales(*descales)
        if gluon_fp8_applies(q, k, v, window_left=window_left, window_right=window_right,
                             diag_offset=diag_offset, scale_blocks=scale_blocks, softcap=softcap,
                             alibi_slopes=alibi_slopes, config=config, cu_seqlens_q=cu_seqlens_q,
                             softmax_scale=softmax_scale):
            from . import gluon_forward
            if gluon_forward._tma_ok(out) and lse.stride(-1) == 1:
                inside = sinks if gluon_forward.SINKS_IN_EPILOGUE else None
                gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=softmax_scale,
                                                      causal=window_right == 0, out=out, lse=lse,
                                                      descales=descales, scale_blocks=scale_blocks, sinks=inside)
                return result if inside is not None else _sinks_after(result, sinks)
    if softcap > 0:
        qk_scale, softcap_in = softcap * LOG2E, softmax_scale / softcap
    else:
        qk_scale, softcap_in = softmax_scale * LOG2E, 1.0
    if alibi_slopes is not None:
        alibi_stride_b = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    else:
        alibi_stride_b = 0
    # The interpreter truncates fp32 -> bf16 stores; store fp32 there and let torch round.
    upcast = interpreting() and (q.dtype == torch.bfloat16 or fp8)
    out_buf = torch.empty(out.shape, dtype=torch.float32, device=out.device) if upcast else out
    strides = (q.stride(), k.stride(), v.stride(), out_buf.stride(), lse.stride())
    use_tma = cfg.use_tma and not paged and _tma_eligible((q, k, v), strides[:3])
    if varlen:  # one packed "batch": sequences are found through cu_seqlens, not a batch stride
        strides = tuple(st if paged and i in (1, 2) else (0, *st[1:]) for i, st in enumerate(strides))
    # Our allocator only for this launch: the caller's own Triton allocator stays as it was.
    token = _triton_allocator.set(_descriptor_scratch) if use_tma and not _INTERPRET else None
    grid = (-(-grid_rows // cfg.block_m), heads, batch)  # plain ints: triton.cdiv costs ~8 us here
    # Triton launches on the current device: follow the inputs when they live on another one.
    on_other_device = q.is_cuda and q.device.index != torch.cuda.current_device()
    try:
        with torch.cuda.device(q.device) if on_other_device else contextlib.nullcontext():
            _launch_forward(grid, cfg, q, k, v, out_buf, lse, strides, alibi_slopes,
                            alibi_stride_b, seqlen_q, seqlen_k, heads // heads_k, diag_offset,
                            window_left, window_right, qk_scale, softcap_in, head_dim,
                            (2 if softcap_approx else True) if softcap > 0 else False,
                            upcast, use_tma, cu_seqlens_q, cu_seqlens_k,
                            dropout_p if dropout_seed is not None else 0.0, dropout_seed,
                            block_table, k.shape[0] if paged else 1, k.shape[1] if paged else 1,
                            descales if fp8 else None, scale_blocks, fp8_mode, sinks)
    finally:
        if token is not None:
            _triton_allocator.reset(token)
    if upcast:
        out.copy_(out_buf)
    return result


# Packed sequences (flash_attn_varlen_func, keys contiguous) run the Gluon forward on sm_90 where it
# takes the call: 16-bit inputs always; e4m3 ones with VARLEN_FP8_GLUON (env FLASHTILE_VARLEN_FP8_GLUON,
# default on), which then round P to e4m3 as flash_attn_func's e4m3 call and FlashAttention-3 do,
# instead of the portable kernel's per-sequence path with 16-bit P (more accurate, slower than bf16).
VARLEN_FP8_GLUON = os.environ.get("FLASHTILE_VARLEN_FP8_GLUON", "1") not in ("", "0")


def _gluon_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale,
                  window_left, window_right, softcap, alibi_slopes, out, lse, config, dropout_seed,
                  descales, scale_blocks, block_table=None, keyed_sequences=0, sinks=None,
                  softcap_approx=False):
    """attention_forward's packed call through gluon_forward.gluon_varlen_forward, or None where
    that kernel does not take it (the caller then runs the portable kernel). ``sinks``: attention
    sinks for the kernel's epilogue; ``softcap_approx``: the softcap's tanh by tanh.approx. ``block_table``:
    page pools, e4m3 ones while their gathered copies fit (_gather_fits). Sliding windows under
    GLUON_WINDOW_MIN_KEYS's rule, 16-bit and contiguous: H200, 16k tokens in 8 sequences
    (window-varlen-h200-20261204.json), 1.41/1.51/2.10x the portable kernel at d128 windows of
    512/1024/4096 keys, 1.35/2.30x at d256 windows of 512/4096."""
    if (not q.is_cuda or config is not None or dropout_seed is not None
            or alibi_slopes is not None or not softmax_scale > 0):
        return None
    fp8 = q.dtype == torch.float8_e4m3fn
    if softcap and not (_gluon_takes_softcap(softcap) and not fp8):
        return None
    if window_left >= 0 or window_right > 0:  # a sliding window: plain calls' rule, 16-bit contiguous
        if not (GLUON_WINDOW and not fp8 and block_table is None
                and window_span(window_left, window_right) >= GLUON_WINDOW_MIN_KEYS.get(q.shape[-1], math.inf)):
            return None
    if fp8 and (not VARLEN_FP8_GLUON or max_seqlen_k <= 0):  # (it sets the descales' block count)
        return None
    from . import gluon_forward
    causal = window_right == 0
    if block_table is not None and fp8 and not _gather_fits(k, block_table, max_seqlen_k, keyed_sequences):
        return None
    if not gluon_forward.varlen_supported(q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
                                          scale_blocks if fp8 else None, block_table):
        if (block_table is None or fp8
                or not _gathering_pays(q, k, block_table, max_seqlen_k, max_seqlen_q, keyed_sequences)):
            return None
        # 16-bit pools whose pages no TMA box fits (sizes that are no multiple of 16, e.g. SGLang's 1):
        # the sequences gathered into packed rows first, then the contiguous packed route. V's rows
        # past the last sequence are zeros: the last key tile reads them (0 x NaN would be NaN).
        k_gathered = _paged_rows(k, block_table, cu_seqlens_k, max_seqlen_k, sequences=keyed_sequences)
        v_gathered = _paged_rows(v, block_table, cu_seqlens_k, max_seqlen_k, zeros=True, sequences=keyed_sequences)
        if not gluon_forward.varlen_supported(q, k_gathered, v_gathered, cu_seqlens_q, cu_seqlens_k, causal):
            return None
        k, v, block_table = k_gathered, v_gathered, None
    if out is not None and not (out.is_contiguous() and gluon_forward._tma_ok(out.unsqueeze(0))):
        return None
    if lse is not None and lse.stride(-1) != 1:
        return None
    # max_seqlen_k (validated by the caller; 0: not given) picks the d256 schedule and e4m3's V
    # block count; the kernel reads the lengths from cu_seqlens_k.
    if max_seqlen_k <= 0:
        max_seqlen_k = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[0]
    return gluon_forward.gluon_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal, out=out, lse=lse, descales=fp8_kernel_descales(*descales) if fp8 else None,
        scale_blocks=scale_blocks, block_table=block_table, window_size=(window_left, window_right),
        keyed_sequences=keyed_sequences, sinks=sinks, softcap=softcap, softcap_approx=softcap_approx)


# 16-bit page pools whose pages no TMA box fits are gathered (K and V copies of B x max_seqlen_k keys
# here, of the tables' capacity in flash_attn_with_kvcache's chunked prefill: decode.prefill_gathers)
# where the query rows a sequence, times a GQA group's heads, reach GATHER_MIN_ROWS on average. Those
# rows are the attention's work per gathered key, so the copies' share of the time goes as their
# inverse, whatever the keys. H200, 32/8 and 12/2 heads, d128, pages of 1 and 8: packed calls
# (varlen-gather-h200-20261204, -long) 1.44-2.62x the portable kernel from 1024 rows (1k-64k keys),
# 1.02x at 512, 0.99x at 256 and 64; chunked prefill (chunked-prefill-h200-20261204-gather, -b)
# 1.14-1.57x the decode kernel at 1024-4096 rows, 0.95x at 512. The copies are bounded by
# GATHER_BYTES, not by the pools' size: a serving engine's pools fill most of the GPU's memory.
GATHER_MIN_ROWS = 1024
GATHER_BYTES = 1 << 30


def _gathering_pays(q, pool, block_table, max_seqlen_k, max_seqlen_q=0, keyed_sequences=0) -> bool:
    """For packed q (total, H, D) of block_table.shape[0] sequences. ``keyed_sequences`` > 0 (a mixed
    batch's prefill part: at most that many sequences have keys, the others are decode steps of at
    most VARLEN_DECODE_MAX_QUERIES queries): the copies hold that many sequences, and the rows that
    count are a keyed sequence's, not the batch's average, which the decode steps (whose keys are not
    copied) pull down: the longest, ``max_seqlen_q``, the one chunk length the host knows. Where the
    other chunks are short the gather costs ~1% (0.99x at 64-256 rows, varlen-gather-h200-20261204)."""
    sequences = _gathered_sequences(block_table, keyed_sequences)
    if max_seqlen_k <= 0 or sequences <= 0:
        return False
    keys = sequences * _gathered_length(pool, block_table, max_seqlen_k)
    group = q.shape[1] // max(pool.shape[2], 1)
    if 0 < keyed_sequences:
        return gather_fits(pool, keys) and min(max_seqlen_q, q.shape[0]) * group >= GATHER_MIN_ROWS
    return gather_fits(pool, keys) and q.shape[0] * group >= GATHER_MIN_ROWS * sequences


def gather_fits(pool: torch.Tensor, keys: int) -> bool:
    """Whether K and V copies of ``keys`` keys of ``pool`` (num_pages, page_size, Hk, D) stay
    within GATHER_BYTES."""
    return 2 * keys * pool.shape[2] * pool.shape[3] * pool.element_size() <= GATHER_BYTES


# e4m3 page pools reach the Gluon kernel through copies of B x max_seqlen_k keys (K rows, V rows and
# V^T, gluon_forward.gluon_varlen_forward): taken while those copies stay within this many bytes,
# else the portable kernel reads the pages in place. Not the pools' size: a serving engine's pools
# fill most of the GPU's memory, so copies as large as they are would not fit beside them.
FP8_GATHER_BYTES = 1 << 30


def _gather_fits(pool: torch.Tensor, block_table: torch.Tensor, max_seqlen_k: int, keyed_sequences: int = 0) -> bool:
    keys = _gathered_sequences(block_table, keyed_sequences) * _gathered_length(pool, block_table, max_seqlen_k)
    return 3 * keys * pool.shape[2] * pool.shape[3] * pool.element_size() <= FP8_GATHER_BYTES


def _launch_forward(grid, cfg, q, k, v, out_buf, lse, strides, alibi_slopes, alibi_stride_b,
                    seqlen_q, seqlen_k, group_size, diag_offset, window_left, window_right,
                    qk_scale, softcap_in, head_dim, has_softcap, upcast, use_tma, cu_seqlens_q,
                    cu_seqlens_k, dropout_p, dropout_seed, block_table, num_pages, page_size,
                    descales=None, scale_blocks=(0, 0), fp8_mode=1, sinks=None):
    ((sqb, sqs, sqh, _), (skb, sks, skh, _), (svb, svs, svh, svd), (sob, sos, soh, _),
     (slb, slh, _)) = strides
    q_descale, k_descale, v_descale = descales if descales is not None else (None, None, None)
    fp8 = {} if descales is None else {"FP8": fp8_mode, "SCALE_BLOCK_Q": scale_blocks[0],
                                       "SCALE_BLOCK_K": scale_blocks[1]}
    _attn_fwd[grid](
        q, k, v, out_buf, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, block_table,
        q_descale, k_descale, v_descale, sinks,
        q_descale.stride(0) if descales is not None else 0,
        q_descale.stride(1) if descales is not None else 0,
        k_descale.stride(0) if descales is not None else 0,
        k_descale.stride(1) if descales is not None else 0,
        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, svd, sob, sos, soh, slb, slh, alibi_stride_b,
        seqlen_q, seqlen_k, group_size, diag_offset,
        max(window_left, 0), max(window_right, 0), qk_scale, softcap_in, dropout_p,
        block_table.stride(0) if block_table is not None else 0,
        block_table.shape[1] if block_table is not None else 0, page_size, num_pages,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_padded(head_dim), HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0, SOFTCAP=has_softcap, ALIBI=alibi_slopes is not None,
        LONGEST_FIRST=window_right >= 0, UPCAST=upcast, USE_TMA=use_tma,
        VARLEN=cu_seqlens_q is not None, DROPOUT=dropout_p > 0, PAGED=block_table is not None,
        SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fp8,
    )
