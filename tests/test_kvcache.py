"""flash_attn_with_kvcache (split-KV decode, appends, paged caches) and flash_attn_combine."""

from __future__ import annotations

import math
import os

import pytest
import torch

import flashtile
from flashtile import interface
from helpers import assert_matches_reference, rotary_reference as rotate

F16, BF16 = torch.float16, torch.bfloat16


def cache_case(batch=3, seqlen_q=1, heads=8, heads_k=2, head_dim=64, capacity=150, dtype=F16):
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k_cache = torch.randn(batch, capacity, heads_k, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.randint(seqlen_q, capacity + 1, (batch,), dtype=torch.int32)
    lengths[0] = seqlen_q  # one sequence as short as its queries
    return q, k_cache, v_cache, lengths


def assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, rows=None, **kw):
    slopes = kw.pop("alibi_slopes", None)
    for b in range(q.shape[0]):
        row = b if rows is None else int(rows[b])
        n = int(lengths[b])
        if slopes is not None:
            kw["alibi_slopes"] = slopes[b:b + 1] if slopes.dim() == 2 else slopes
        assert_matches_reference(out[b:b + 1], None if lse is None else lse[b:b + 1], q[b:b + 1],
                                 k_cache[row:row + 1, :n],
                                 v_cache[row:row + 1, :n], **kw)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 8])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(40, -1), softcap=5.0),
                                dict(causal=True, alibi_slopes="per-batch")],
                         ids=["causal", "full", "window-softcap", "alibi"])
def test_decode_matches_reference(kw, seqlen_q, num_splits):
    kw = dict(kw)
    q, k_cache, v_cache, lengths = cache_case(seqlen_q=seqlen_q, dtype=BF16 if num_splits == 3 else F16)
    if kw.get("alibi_slopes") == "per-batch":
        kw["alibi_slopes"] = torch.rand(3, 8)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 num_splits=num_splits, return_softmax_lse=True, **kw)
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, **kw)


@pytest.mark.parametrize("heads,heads_k", [(4, 4), (8, 1), (12, 2)])
def test_gqa_mqa_and_int_seqlens(heads, heads_k):
    q, k_cache, v_cache, _ = cache_case(heads=heads, heads_k=heads_k, capacity=90)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=70, causal=True,
                                                 return_softmax_lse=True)
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, torch.full((3,), 70), causal=True)
    whole = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)  # default: whole cache
    assert_matches_reference(whole, None, q, k_cache, v_cache, causal=True)


def test_append_then_attend():
    q, k_cache, v_cache, lengths = cache_case(seqlen_q=4, capacity=120)
    lengths = lengths.clamp(max=110)
    k_new, v_new = torch.randn(3, 4, 2, 64, dtype=F16), torch.randn(3, 4, 2, 64, dtype=F16)
    before_k = k_cache.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                 causal=True, return_softmax_lse=True)
    for b in range(3):
        n = int(lengths[b])
        assert torch.equal(k_cache[b, n:n + 4], k_new[b]) and torch.equal(v_cache[b, n:n + 4], v_new[b])
        assert torch.equal(k_cache[b, :n], before_k[b, :n]) and torch.equal(k_cache[b, n + 4:], before_k[b, n + 4:])
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths + 4, causal=True)


def test_cache_batch_idx():
    q, k_cache, v_cache, _ = cache_case(capacity=60)
    big_k = torch.randn(5, 60, 2, 64, dtype=F16)
    big_v = torch.randn_like(big_k)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    lengths = torch.tensor([10, 60, 33], dtype=torch.int32)
    out, lse = flashtile.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lengths, cache_batch_idx=rows,
                                                 return_softmax_lse=True)
    assert_each_sequence_matches(out, lse, q, big_k, big_v, lengths, rows=rows)


def test_unchecked_cache_batch_idx_is_clamped(monkeypatch):
    """Where cache_batch_idx's values cannot be read on the host (torch.compile, CUDA-graph
    capture), a copy clamped into the cache's rows stands in: a row past the cache reads its last
    row and a negative one its first, never memory outside the cache."""
    q, _, _, _ = cache_case(capacity=60)
    big_k = torch.randn(5, 60, 2, 64, dtype=F16)
    big_v = torch.randn_like(big_k)
    lengths = torch.tensor([10, 60, 33], dtype=torch.int32)
    expected = flashtile.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lengths,
                                                 cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32))
    monkeypatch.setattr(interface, "_values_unreadable", lambda tensor: True)
    out = flashtile.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lengths,
                                            cache_batch_idx=torch.tensor([9, -3, 2], dtype=torch.int32))
    assert torch.equal(out, expected)


def test_unchecked_leftpad_past_seqlens_is_an_empty_sequence(monkeypatch):
    """Under torch.compile or capture cache_leftpad is not read on the host: one past cache_seqlens
    (which eagerly is a ValueError) leaves that sequence without keys, whose rows are 0, and the
    other sequences as they were."""
    q, k_cache, v_cache, _ = cache_case(capacity=60)
    lengths = torch.tensor([10, 60, 33], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 5], dtype=torch.int32)
    expected = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 cache_leftpad=leftpad)
    monkeypatch.setattr(interface, "_values_unreadable", lambda tensor: True)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                            cache_leftpad=torch.tensor([2, 0, 40], dtype=torch.int32))
    assert torch.equal(out[:2], expected[:2])
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def paged_cache(k_cache, v_cache, page_size, spare=2):
    """The contiguous cache's rows scattered over a page pool, and the block table that finds them."""
    batch, capacity = k_cache.shape[:2]
    per_seq = -(-capacity // page_size)
    num_pages = batch * per_seq + spare
    order = torch.randperm(num_pages)[:batch * per_seq].view(batch, per_seq)
    k_pool = torch.randn(num_pages, page_size, *k_cache.shape[2:], dtype=k_cache.dtype)
    v_pool = torch.randn_like(k_pool)
    for b in range(batch):
        for j in range(per_seq):
            rows = slice(j * page_size, min((j + 1) * page_size, capacity))
            k_pool[order[b, j], :rows.stop - rows.start] = k_cache[b, rows]
            v_pool[order[b, j], :rows.stop - rows.start] = v_cache[b, rows]
    return k_pool, v_pool, order.to(torch.int32)


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paged_cache_matches_contiguous(page_size):
    q, k_cache, v_cache, lengths = cache_case(seqlen_q=2, capacity=100)
    lengths = lengths.clamp(max=96)
    k_pool, v_pool, table = paged_cache(k_cache, v_cache, page_size)
    k_new, v_new = torch.randn(3, 2, 2, 64, dtype=F16), torch.randn(3, 2, 2, 64, dtype=F16)
    expected = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                 causal=True, num_splits=2)
    out = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths,
                                            block_table=table, causal=True, num_splits=2)
    assert torch.equal(out, expected)


def test_combine_matches_logsumexp():
    splits, batch, seqlen, heads, d = 5, 2, 3, 4, 32
    parts = torch.randn(splits, batch, seqlen, heads, d)
    lse = torch.randn(splits, batch, heads, seqlen) * 3
    lse[1, 0] = -math.inf  # a part that saw nothing
    lse[:, 1, 2, 1] = -math.inf  # a row no part saw
    out, merged = flashtile.flash_attn_combine(parts, lse, out_dtype=torch.float32)
    ref_lse = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - ref_lse).nan_to_num(0.0)  # (splits, B, H, Sq)
    ref = (weights.permute(0, 1, 3, 2)[..., None] * parts).sum(0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1, 1, 2] == 0)


def test_combine_compiles_with_fullgraph():
    """flash_attn_combine under torch.compile(fullgraph=True) runs its registered op: the same
    output and LSE as eager, bit for bit, with a dtype asked for and into a given ``out``."""
    parts = torch.randn(3, 2, 5, 4, 32)
    lse = torch.randn(3, 2, 4, 5) * 3
    lse[0, 1] = -math.inf
    torch.library.opcheck(torch.ops.flashtile.combine.default, (parts, lse, torch.float16),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

    def merged(parts, lse):
        return flashtile.flash_attn_combine(parts, lse, out_dtype=torch.float16)

    def into(parts, lse, out):
        return flashtile.flash_attn_combine(parts, lse, out=out)

    torch._dynamo.reset()
    for fn, args in ((merged, (parts, lse)), (into, (parts, lse, torch.full((2, 5, 4, 32), float("nan"))))):
        eager = fn(*[a.clone() for a in args])
        given = [a.clone() for a in args]
        compiled = torch.compile(fn, fullgraph=True)(*given)
        assert all(torch.equal(e, c) for e, c in zip(eager, compiled))
    assert torch.equal(given[2], eager[0])  # ``out`` written in place


def _bad_calls():
    def call(**overrides):
        q, k_cache, v_cache, lengths = cache_case(capacity=50)
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                    cache_seqlens=torch.tensor([1, 45, 20], dtype=torch.int32))
        args.update(overrides)
        return lambda: flashtile.flash_attn_with_kvcache(**args)

    k_pool, v_pool, table = paged_cache(torch.randn(3, 50, 2, 64, dtype=F16), torch.randn(3, 50, 2, 64, dtype=F16), 8)
    return [
        pytest.param(call(k_cache=torch.randn(3, 50, 2, 64, dtype=BF16)), TypeError, "k_cache has dtype", id="dtype"),
        pytest.param(call(k=torch.randn(3, 6, 2, 64, dtype=F16), v=torch.randn(3, 6, 2, 64, dtype=F16)),
                     ValueError, "cache holds 50 positions", id="cache-too-small"),
        pytest.param(call(cache_seqlens=torch.zeros(3, dtype=torch.int64)), TypeError, "int32", id="seqlens-dtype"),
        pytest.param(call(k_cache=k_pool, v_cache=v_pool, block_table=table + 100), ValueError,
                     "block_table entries", id="table-range"),
        pytest.param(call(k_cache=k_pool, v_cache=v_pool[:, :4], block_table=table), ValueError,
                     "same shape", id="page-size-mismatch"),
        pytest.param(call(rotary_cos=torch.zeros(1), rotary_sin=torch.zeros(1)), ValueError, "rotary_cos must be",
                     id="rotary-shape"),
        pytest.param(call(rotary_cos=torch.zeros(30, 16), rotary_sin=torch.zeros(30, 16)), ValueError,
                     "rotary_cos/rotary_sin have 30 positions", id="rotary-too-short"),
        pytest.param(call(num_splits=-1), ValueError, "num_splits", id="splits"),
        pytest.param(call(num_splits=129), ValueError, r"num_splits must be an int in \[0, 128\]",
                     id="splits-past-128"),
        pytest.param(call(cache_leftpad=torch.tensor([0, 46, 3], dtype=torch.int32)), ValueError,
                     "got 46 with cache_seqlens 45", id="leftpad-past-seqlens"),
        pytest.param(call(cache_leftpad=torch.tensor([0, 0, -1], dtype=torch.int32)), ValueError,
                     r"cache_leftpad must be in \[0, cache_seqlens\]", id="leftpad-negative"),
        pytest.param(call(cache_batch_idx=torch.tensor([0, 3, 1], dtype=torch.int32)), ValueError,
                     r"cache_batch_idx entries must be in \[0, 3\)", id="batch-idx-range"),
    ]


@pytest.mark.parametrize("fn,exc,message", _bad_calls())
def test_bad_input_is_named(fn, exc, message):
    with pytest.raises(exc, match=message):
        fn()


def test_decode_compiles():
    q, k_cache, v_cache, lengths = cache_case(capacity=40)

    def step(q, k_cache, v_cache, lengths):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)

    assert torch.equal(torch.compile(step, fullgraph=True)(q, k_cache, v_cache, lengths),
                       step(q, k_cache, v_cache, lengths))


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rotary_and_leftpad(interleaved, rotary_dim, causal):
    batch, seqlen_q, capacity = 3, 3, 80
    q, k_cache, v_cache, _ = cache_case(batch=batch, seqlen_q=seqlen_q, capacity=capacity)
    lengths = torch.tensor([5, 60, 30], dtype=torch.int32)
    leftpad = torch.tensor([0, 7, 29], dtype=torch.int32)
    k_new, v_new = torch.randn(batch, seqlen_q, 2, 64, dtype=F16), torch.randn(batch, seqlen_q, 2, 64, dtype=F16)
    angles = torch.rand(100, rotary_dim // 2) * 6
    cos, sin = torch.cos(angles).to(F16), torch.sin(angles).to(F16)
    cache_before = k_cache.clone()
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                            cache_seqlens=lengths, cache_leftpad=leftpad, causal=causal,
                                            rotary_interleaved=interleaved)
    for b in range(batch):
        start, n = int(leftpad[b]), int(lengths[b])
        pos = torch.arange(seqlen_q) + (n - start)
        k_rot = rotate(k_new[b:b + 1], cos, sin, pos[None], interleaved)
        torch.testing.assert_close(k_cache[b, n:n + seqlen_q], k_rot[0], atol=2e-3, rtol=0)
        assert torch.equal(k_cache[b, :n], cache_before[b, :n])
        q_pos = pos if causal else torch.full((seqlen_q,), n - start)
        q_rot = rotate(q[b:b + 1], cos, sin, q_pos[None], interleaved)
        keys = slice(start, n + seqlen_q)
        assert_matches_reference(out[b:b + 1], None, q_rot, k_cache[b:b + 1, keys], v_cache[b:b + 1, keys],
                                 causal=causal)


def test_lengths_checked_again_after_an_in_place_change():
    q, k_cache, v_cache, _ = cache_case(capacity=50)
    lengths = torch.tensor([1, 40, 20], dtype=torch.int32)
    k_new, v_new = torch.randn(3, 2, 2, 64, dtype=F16), torch.randn(3, 2, 2, 64, dtype=F16)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)
    lengths[1] = 49  # a cached check must notice the new version
    with pytest.raises(ValueError, match="cache holds 50 positions"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)


@pytest.mark.parametrize("batch,heads_k,context,expected", [
    (16, 2, 32768, 8),   # the target, 9 splits x 32 pairs = 288 programs, leaves 24 SMs with a third
    (1, 8, 32768, 33),   # 264 programs: two full waves, kept
    (1, 2, 32768, 128),  # the cap
    (16, 8, 32768, 2),   # pairs fill the SMs: one wave of splits
    (1, 8, 1024, 8),     # no split shorter than min_split_keys
])
def test_split_heuristic_fills_the_last_wave(monkeypatch, batch, heads_k, context, expected):
    from flashtile.kernels import decode
    monkeypatch.setitem(decode._SM_COUNTS, 0, 132)  # an H200
    cfg = decode.DecodeConfig(32, 4, 4, waves=2, min_split_keys=128)
    splits = decode.split_heuristic(batch, heads_k, context, torch.device("cuda", 0), cfg)
    assert splits == expected
    programs = splits * batch * heads_k
    per_sm = programs / 132
    if per_sm >= 1:  # full waves, or a last wave at least 90% full
        assert per_sm / math.ceil(per_sm) >= 0.9


@pytest.fixture
def h200_plans(monkeypatch):
    """The decode module planning for an H200 (sm_90, 132 SMs) without one: (module, device)."""
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    monkeypatch.setattr(decode, "_arch", lambda index: 90)
    monkeypatch.setitem(decode._SM_COUNTS, 0, 132)
    return decode, torch.device("cuda", 0)


def test_pairs_near_the_sm_count_run_unsplit(h200_plans, monkeypatch):
    # 99..132 (sequence, KV head) pairs on 132 SMs: one unsplit program each with 64-key steps
    # (tune-decode-unsplit-h200-20261130.json); fewer or more pairs, or an e4m3 cache: split as before.
    decode, dev = h200_plans
    for pairs in (99, 128, 132):
        cfg = decode.decode_config(False, dev, pairs)
        assert (cfg.block_n, cfg.num_stages, cfg.max_splits) == (64, 4, 1)
        assert decode.split_heuristic(pairs, 1, 131072, dev, cfg) == 1
    for pairs in (98, 133, 512):  # 2-warp programs (decode-probe-bf16-w2-ab2-h200-20261130.log)
        cfg = decode.decode_config(False, dev, pairs)
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.max_splits) == (32, 2, 3, 128)
    assert decode.decode_config(False, dev, 128, fp8_cache=True).max_splits == 128
    assert decode.planned_splits(16, 8, 32768, dev) == 1
    assert decode.planned_splits(16, 2, 4096, dev) == 8
    assert decode.decode_config(False, dev, 512, head_dim=256).num_warps == 4  # 2 warps would spill
    assert decode.decode_config(False, dev, 512, fp8_cache=True, head_dim=256).num_warps == 4
    # a speculative step's 17+ query rows a KV head: 4 warps (2 ran 3x slower at 48 rows)
    for fp8_cache in (False, True):
        assert decode.decode_config(False, dev, 512, fp8_cache, rows=16).num_warps == 2
        assert decode.decode_config(False, dev, 512, fp8_cache, rows=17).num_warps == 4
    # ... an e4m3 cache's 4-warp plan at 33-64 rows on sm_90 without a software pipeline (1
    # stage), 3 at up to 32
    # (with one stage the query as two e4m3 terms and S by e4m3 dots, decode.FP8_SPLIT_Q_ROWS64; on
    # pages too)
    for pairs in (2, 32, 128):
        for rows, stages in ((48, 1), (64, 1), (32, 3), (17, 3)):
            cfg = decode.decode_config(False, dev, pairs, True, rows=rows)
            assert cfg.num_stages == stages and cfg.fp8_split_q == (stages == 1)
            paged = decode.decode_config(True, dev, pairs, True, rows=rows)
            assert paged.fp8_split_q == (stages == 1) == (paged.num_stages == 1)
            assert not decode.decode_config(False, dev, pairs, False, rows=rows).fp8_split_q
    # ... past 64 rows 128-row tiles on 8 warps, 64-key steps, 3 stages, one wave (32-key steps and
    # 2 stages over head dim 128, but 64-key steps on e4m3 pages), any cache; PDL on contiguous caches
    # only
    for paged in (False, True):
        for fp8_cache in (False, True):
            for pairs in (2, 32, 128, 512):
                cfg = decode.decode_config(paged, dev, pairs, fp8_cache, rows=65)
                assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.waves, cfg.min_split_keys,
                        cfg.pdl, cfg.fp8_split_q) == (64, 8, 3, 1, 256, not paged, fp8_cache)
            cfg = decode.decode_config(paged, dev, 2, fp8_cache, head_dim=256, rows=96)
            assert (cfg.block_n, cfg.num_warps, cfg.num_stages) == (64 if paged and fp8_cache else 32, 8, 2)

    def tile_rows(heads, heads_k, seqlen_q, paged=False, fp8_cache=False):
        plan = decode._plan(16, seqlen_q, heads, heads_k, 128, torch.bfloat16, dev, paged, 16384, 0,
                            None, False, True, False, False, False, False, fp8_cache, False, True,
                            16 if paged else 0)
        # the row-block code only where the rows need more than one tile
        assert plan[2]["ROW_BLOCKS"] == (heads // heads_k * seqlen_q > plan[2]["ROWS"])
        return plan[2]["ROWS"]
    # ... and 16-bit caches tiles of at least 64 rows (a wgmma's M) past 16 rows, 16 rows at least
    # up to them; e4m3 caches the rows' own power of two
    assert (tile_rows(32, 8, 1), tile_rows(32, 8, 4), tile_rows(12, 2, 4), tile_rows(12, 2, 8)) \
        == (16, 16, 64, 64)
    assert tile_rows(12, 2, 4, paged=True) == 64
    assert (tile_rows(12, 2, 4, fp8_cache=True), tile_rows(12, 2, 8, fp8_cache=True)) == (32, 64)
    # ... and at most 128 rows: chunked prefill's thousands of rows take blocks of them
    assert (tile_rows(12, 2, 16), tile_rows(32, 8, 512), tile_rows(32, 8, 512, fp8_cache=True)) \
        == (128, 128, 128)
    monkeypatch.setattr(decode, "_arch", lambda index: 80)  # measured on Hopper only
    assert decode.decode_config(False, dev, 128).max_splits == 128
    assert decode.decode_config(False, dev, 512).num_warps == 4
    assert decode.decode_config(False, dev, 32, True, rows=48).num_stages == 3
    assert not decode.decode_config(False, dev, 32, True, rows=48).fp8_split_q


def test_long_caches_take_one_wave_of_splits(h200_plans):
    # Pairs under half the SMs with at least 2048 keys per split: as many splits of 64-key steps as
    # fill the SMs once (tune-decode-merged/-wave-h200-20261130.json); shorter caches, or an e4m3
    # one, split as before.
    decode, dev = h200_plans
    for batch, heads_k, capacity, splits in ((1, 8, 32768, 16), (1, 8, 131072, 16), (4, 8, 16384, 4),
                                             (16, 2, 65536, 4)):
        cfg = decode.decode_config(False, dev, batch * heads_k, capacity=capacity)
        assert (cfg.block_n, cfg.num_stages, cfg.waves) == (64, 4, 1)
        assert decode.planned_splits(batch, heads_k, capacity, dev) == splits
    assert decode.planned_splits(1, 8, 16384, dev) == 33
    assert decode.planned_splits(1, 2, 131072, dev) == 128
    assert decode.decode_config(False, dev, 8, fp8_cache=True, capacity=32768).block_n == 64


@pytest.mark.parametrize("pairs,capacity,splits", [
    (80, 4096, 4), (96, 16384, 3), (160, 4096, 2), (192, 16384, 2), (263, 16384, 2), (264, 16384, 1),
    (512, 131072, 1), (96, 256, 2)])  # at most capacity / 128 splits
def test_many_pairs_split_to_two_to_four_resident_programs_per_sm(h200_plans, pairs, capacity, splits):
    # 2-warp programs with pairs filling half the SMs or more: at least 264 programs, at most 528
    # (decode-probe-mid-pairs/-mid-plan-h200-20261130.log)
    decode, dev = h200_plans
    cfg = decode.decode_config(False, dev, pairs, capacity=capacity)
    assert (cfg.num_warps, cfg.resident_per_sm) == (2, 4)
    assert decode.split_heuristic(pairs, 1, capacity, dev, cfg) == splits


@pytest.mark.parametrize("pairs,splits", [(132, 2), (160, 2), (192, 2), (198, 2), (199, 1), (512, 1)])
def test_paged_many_pairs_split_to_three_resident_programs_per_sm(h200_plans, pairs, splits):
    # 32-key paged programs for pairs >= SMs: 2 splits while 3 per SM hold them all
    # (tune-paged-mid-h200-20261130.json); fewer pairs keep the 128-key plan's counts.
    decode, dev = h200_plans
    cfg = decode.decode_config(True, dev, pairs, capacity=16384)
    assert (cfg.block_n, cfg.num_warps, cfg.resident_per_sm) == (32, 4, 3)
    assert decode.split_heuristic(pairs, 1, 16384, dev, cfg) == splits
    under = decode.decode_config(True, dev, 96, capacity=16384)
    assert under.resident_per_sm == 0 and decode.split_heuristic(96, 1, 16384, dev, under) == 2


@pytest.mark.parametrize("batch,heads_k,splits", [(1, 8, 66), (16, 8, 4), (64, 2, 4), (32, 8, 2), (64, 8, 2)])
def test_e4m3_caches_take_a_wave_of_two_warp_programs(h200_plans, batch, heads_k, splits):
    # Four 2-warp, 64-key programs per SM, one wave of them (decode-probe-fp8-warps-h200-20261130.json)
    decode, dev = h200_plans
    cfg = decode.decode_config(False, dev, batch * heads_k, fp8_cache=True, capacity=32768)
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm) == (64, 2, 3, 4)
    assert decode.split_heuristic(batch, heads_k, 32768, dev, cfg) == splits
    if batch == 1:  # short caches split down to one 64-key step per program
        assert decode.split_heuristic(batch, heads_k, 1024, dev, cfg) == 16
    paged = decode.decode_config(True, dev, batch * heads_k, fp8_cache=True, capacity=32768)
    assert (paged.block_n, paged.num_warps) == (128, 4)  # pages keep the 4-warp plan


@pytest.mark.parametrize("block_n,page_size,max_splits", [
    (64, 0, 1), (64, 0, 4), (128, 0, 128), (32, 16, 128), (64, 16, 1), (128, 16, 128),
    (128, 128, 1), (64, 256, 128)])  # pages >= the steps: one table entry per step
def test_decode_with_the_gpu_key_steps(block_n, page_size, max_splits):
    # The interpreter's default plan takes 32-key steps; the H200 plans take these too.
    from flashtile.bench.decode import paginate
    from flashtile.kernels.decode import DecodeConfig, decode_attention
    q, k_cache, v_cache, lengths = cache_case(head_dim=128, capacity=200)
    keys, values, table = ((*paginate(k_cache, v_cache, page_size),) if page_size
                           else (k_cache, v_cache, None))
    out, lse = decode_attention(q, keys, values, lengths, softmax_scale=128 ** -0.5, window_left=-1,
                                window_right=0, block_table=table,
                                config=DecodeConfig(block_n, 4, 4, max_splits=max_splits))
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True)


def test_paged_plans(h200_plans):
    decode, dev = h200_plans
    # Pairs under the SM count: 128-key steps, 2 stages (3 for an e4m3 cache); over it: 32-key steps,
    # 4 stages (an e4m3 cache keeps the 128-key plan it was measured with).
    under = decode.decode_config(True, dev, 128)
    assert (under.block_n, under.num_stages) == (128, 2)
    assert decode.decode_config(True, dev, 128, fp8_cache=True).num_stages == 3
    assert decode.decode_config(True, dev, 128, fp8_cache=True, rows=48).num_stages == 1
    assert decode.decode_config(True, dev, 128, fp8_cache=True, rows=24).num_stages == 3
    assert decode.decode_config(True, dev, 128, fp8_cache=True, rows=65).num_warps == 8
    over = decode.decode_config(True, dev, 512)
    assert (over.block_n, over.num_stages) == (32, 4)
    assert decode.decode_config(True, dev, 512, fp8_cache=True).block_n == 128


def test_wide_rows_plans_on_e4m3_pages_past_head_dim_128_take_64_key_steps(h200_plans):
    # 32-key steps gave wrong outputs there on the H200 (fuzz-e4m3-wide-h200-20261201.log); other
    # caches past head dim 128 keep 32-key steps, head dims up to 128 their 64-key plan.
    decode, dev = h200_plans
    for head_dim in (192, 256):
        pages = decode.decode_config(True, dev, 64, fp8_cache=True, head_dim=head_dim, rows=80)
        assert (pages.block_n, pages.num_warps, pages.num_stages, pages.fp8_split_q) == (64, 8, 2, True)
        assert decode.decode_config(False, dev, 64, fp8_cache=True, head_dim=head_dim, rows=80).block_n == 32
        assert decode.decode_config(True, dev, 64, head_dim=head_dim, rows=80).block_n == 32
    assert decode.decode_config(True, dev, 64, fp8_cache=True, head_dim=128, rows=80).block_n == 64


def test_16bit_plans_past_head_dim_128_with_17_to_64_rows_fit_in_shared_memory(h200_plans, monkeypatch):
    # 64-row tiles at head dim 256: 128-key steps with 2 stages (pages, pairs under the SM count)
    # and 64-key steps with 4 stages (long caches, pairs near the SM count) took 288-289 KB of the
    # 227 KB a CTA may have (fuzz-gpu-h200-20261202-seed5.json); 32-key steps with 4 stages take 160.
    decode, dev = h200_plans
    for paged, pairs, capacity in ((True, 64, 4096), (False, 8, 131072), (False, 128, 4096)):
        for head_dim in (192, 256):
            cfg = decode.decode_config(paged, dev, pairs, capacity=capacity, head_dim=head_dim, rows=24)
            assert (cfg.block_n, cfg.num_warps, cfg.num_stages) == (32, 4, 4)
        # up to 16 rows (16-row tiles) and at head dim 128 the plans stay
        assert decode.decode_config(paged, dev, pairs, capacity=capacity, head_dim=256, rows=16).block_n > 32
        assert decode.decode_config(paged, dev, pairs, capacity=capacity, head_dim=128, rows=24).block_n > 32
    # off sm_90 (an A100's 163 KB): 32-key steps, 3 stages once the tiles hold 64 rows or more
    monkeypatch.setattr(decode, "_arch", lambda index: 80)
    cfg = decode.decode_config(True, dev, 64, head_dim=256, rows=40)
    assert (cfg.block_n, cfg.num_stages) == (32, 3)
    assert decode.decode_config(True, dev, 64, head_dim=256, rows=32).block_n == 128


def test_plans_on_gpus_with_99_kb_of_shared_memory(h200_plans, monkeypatch):
    # L4, L40S, A10, RTX (sm_86/89/120): e4m3 caches and 16-bit ones past head dim 128 take plans
    # that fit in 99 KB a CTA (compiled for sm_89: tests/test_gpu_targets.py), tiles of at most 32
    # rows past head dim 128; 16-bit caches up to head dim 128 keep the other GPUs' plans.
    decode, dev = h200_plans
    monkeypatch.setattr(decode, "_arch", lambda index: 89)
    for paged in (False, True):
        for pairs in (8, 64, 512):
            def plan(**kw):
                cfg = decode.decode_config(paged, dev, pairs, capacity=32768, **kw)
                return cfg.block_n, cfg.num_warps, cfg.num_stages
            assert plan(fp8_cache=True, head_dim=128, rows=4) == (64, 4, 3)
            assert plan(fp8_cache=True, head_dim=128, rows=80) == (64, 4, 3)
            assert plan(fp8_cache=True, head_dim=256, rows=24) == (64, 4, 2)
            assert plan(head_dim=256, rows=1) == (32, 4, 3)
            assert plan(head_dim=192, rows=40) == (32, 4, 3)
    monkeypatch.setattr(decode, "_arch", lambda index: 80)
    a100 = decode.decode_config(True, dev, 8, capacity=32768, head_dim=128, rows=4)
    monkeypatch.setattr(decode, "_arch", lambda index: 89)
    assert decode.decode_config(True, dev, 8, capacity=32768, head_dim=128, rows=4) == a100
    assert decode.tile_rows_for(80, False, dev, head_dim=256) == 32
    assert decode.tile_rows_for(80, False, dev, head_dim=128) == 128
    monkeypatch.setattr(decode, "_arch", lambda index: 90)
    assert decode.tile_rows_for(80, False, dev, head_dim=256) == 128


def test_query_rows_in_32_row_tiles_on_gpus_with_99_kb(monkeypatch):
    # Past head dim 128 those GPUs' tiles hold at most 32 rows; the grid had counted blocks of
    # MAX_TILE_ROWS, so 80 rows a KV head ran one program of 32 rows where the kernel wanted three
    # (two thirds of the rows unwritten, the others under another KV head). Here on the interpreter
    # by the same planning (decode.small_shared_memory).
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "small_shared_memory", lambda arch: True)
    decode._PLANS.clear()
    try:
        q, k_cache, v_cache, lengths = cache_case(batch=2, seqlen_q=10, heads=16, heads_k=2, head_dim=192,
                                                  capacity=40, dtype=BF16)
        prepared = decode.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1,
                                         window_right=0, num_splits=2)
        assert prepared.kernel_options["ROWS"] == decode.SMALL_SHARED_MEMORY_TILE_ROWS == 32
        assert prepared.grid[2] == 2 * 3
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                     num_splits=2, return_softmax_lse=True)
        assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True)
        # and the grid's limit counts those blocks before anything is written (the append here)
        monkeypatch.setattr(decode, "MAX_GRID_Z", 5)
        k_new, v_new = torch.randn(2, 10, 2, 192, dtype=BF16), torch.randn(2, 10, 2, 192, dtype=BF16)
        before = k_cache.clone()
        with pytest.raises(ValueError, match="too many programs"):
            flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths - 10)
        assert torch.equal(k_cache, before)
    finally:
        decode._PLANS.clear()


@pytest.fixture
def small_row_blocks(monkeypatch):
    """The Triton decode kernel with tiles of at most 16 query rows, so that small cases take
    several row blocks a KV head."""
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "MAX_TILE_ROWS", 16)
    decode._PLANS.clear()
    yield decode
    decode._PLANS.clear()


@pytest.mark.parametrize("seqlen_q,heads,heads_k", [(7, 6, 2), (16, 8, 2), (20, 4, 4), (40, 4, 1)],
                         ids=["straddling-heads", "head-per-block", "MHA", "MQA-long-chunk"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(20, -1), softcap=4.0),
                                dict()], ids=["causal", "window-softcap", "full"])
def test_query_rows_in_blocks(small_row_blocks, seqlen_q, heads, heads_k, num_splits, kw):
    # A KV head's group x Sq rows over several programs (chunked prefill against the cache): blocks
    # that hold the end of one query head and the start of the next, a block per head, splits.
    rows = heads // heads_k * seqlen_q
    q, k_cache, v_cache, lengths = cache_case(batch=2, seqlen_q=seqlen_q, heads=heads, heads_k=heads_k,
                                              capacity=90, dtype=BF16 if num_splits == 3 else F16)
    prepared = small_row_blocks.prepare_decode(q, k_cache, v_cache, softmax_scale=0.125, window_left=-1,
                                               window_right=0, num_splits=num_splits)
    assert prepared.grid[2] == heads_k * -(-rows // 16) > heads_k
    assert prepared.kernel_options["ROW_BLOCKS"]
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 num_splits=num_splits, return_softmax_lse=True, **kw)
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, **kw)


@pytest.mark.parametrize("page_size", [3, 16])
def test_query_rows_in_blocks_paged_and_appended(small_row_blocks, page_size):
    q, k_cache, v_cache, lengths = cache_case(seqlen_q=9, heads=6, heads_k=2, capacity=100)
    lengths = lengths.clamp(max=91)
    k_pool, v_pool, table = paged_cache(k_cache, v_cache, page_size)
    k_new, v_new = torch.randn(3, 9, 2, 64, dtype=F16), torch.randn(3, 9, 2, 64, dtype=F16)
    out = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths,
                                            block_table=table, causal=True, num_splits=2)
    expected = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                 causal=True, num_splits=2)
    assert torch.equal(out, expected)
    assert_each_sequence_matches(out, None, q, k_cache, v_cache, lengths + 9, causal=True)


def test_chunked_prefill_over_128_rows():
    # The shipped cap: 4 x 40 = 160 query rows a KV head take two programs of up to 128 rows.
    q, k_cache, v_cache, lengths = cache_case(batch=1, seqlen_q=40, heads=4, heads_k=1, capacity=70)
    lengths[0] = 63
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True)
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True)


def test_too_many_row_blocks_is_a_clear_error(small_row_blocks, monkeypatch):
    # CUDA grids hold at most 65535 programs along the axis of KV heads x row blocks: past it, a
    # ValueError naming seqlen_q before any launch (here with the limit lowered to 3).
    monkeypatch.setattr(small_row_blocks, "MAX_GRID_Z", 3)
    q, k_cache, v_cache, lengths = cache_case(batch=1, seqlen_q=5, heads=8, heads_k=2, capacity=20)
    with pytest.raises(ValueError, match="seqlen_q=5"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    # ... raised before an append writes anything into the cache
    k_before, v_before = k_cache.clone(), v_cache.clone()
    new = torch.randn(1, 5, 2, 64, dtype=F16)
    with pytest.raises(ValueError, match="seqlen_q=5"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lengths.clamp(max=15),
                                          causal=True)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    q1 = q[:, :4]  # 16 rows a KV head: one block each, 2 programs along the axis
    out = flashtile.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    assert_each_sequence_matches(out, None, q1, k_cache, v_cache, lengths, causal=True)


def _route_args(**overrides):
    kw = dict(causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None,
              block_table=None, cache_batch_idx=None, cache_leftpad=None, num_splits=0, config=None)
    kw.update(overrides)
    return kw


@pytest.fixture
def prefill_route(monkeypatch):
    """decode.prefill_wanted as on an H200 (132 SMs, kernels compiled, not interpreted), with
    gluon_forward.plain_plan (the sm_90 check) answering yes for every tensor it is asked about."""
    from flashtile.kernels import decode as dec
    from flashtile.kernels import gluon_forward
    asked = []
    monkeypatch.setattr(dec, "interpreting", lambda: False)
    monkeypatch.setattr(dec, "_sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_forward, "plain_plan", lambda *args: asked.append(args) or "plan")
    return dec, asked


@pytest.mark.parametrize("batch, seqlen_q, heads, routed", [
    (1, 384, 32, True),  # 96 work tiles of 128 positions: at least half the 132 SMs
    (1, 256, 32, False),  # 64 tiles: the decode kernel's key splits are faster (chunked-prefill-...-d)
    (2, 128, 32, False),
    (8, 128, 32, True),
    (1, 127, 256, False),  # under PREFILL_MIN_QUERIES
    (4, 512, 12, True),
])
def test_chunked_prefill_route_needs_positions_and_work_tiles(prefill_route, batch, seqlen_q, heads, routed):
    dec, asked = prefill_route
    q = torch.randn(batch, seqlen_q, heads, 64, dtype=F16)
    k = torch.randn(batch, 600, 4, 64, dtype=F16)
    assert dec.prefill_wanted(q, k, k, **_route_args()) is routed
    assert len(asked) == int(routed) and (not routed or asked[0][3:] == (True, True, None))


@pytest.mark.parametrize("overrides", [
    {"cache_leftpad": torch.zeros(4, dtype=torch.int32)}, {"alibi_slopes": torch.ones(32)},
    {"softcap": 30.0}, {"window_left": 64}, {"causal": False, "window_right": 8},
    {"num_splits": 2}, {"config": "a forced plan"},
])
def test_chunked_prefill_route_leaves_the_rest_to_the_decode_kernel(prefill_route, overrides):
    dec, asked = prefill_route
    q = torch.randn(4, 512, 32, 64, dtype=F16)
    k = torch.randn(4, 600, 8, 64, dtype=F16)
    assert dec.prefill_wanted(q, k, k, **_route_args()) is True
    assert dec.prefill_wanted(q, k, k, **_route_args(**overrides)) is False
    assert dec.prefill_wanted(q, k, k, **_route_args(causal=False, window_right=-1, num_splits=1)) is True


def test_chunked_prefill_route_asks_about_page_pools_with_their_table(prefill_route):
    """Paged caches: whether the forward reads the pools (pages of whole key tiles) is the plan's
    question, asked with the block table."""
    dec, asked = prefill_route
    q = torch.randn(4, 512, 32, 64, dtype=F16)
    pool = torch.randn(40, 128, 8, 64, dtype=F16)
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    assert dec.prefill_wanted(q, pool, pool, **_route_args(block_table=table)) is True
    assert asked[-1][3:] == (True, True, table)
    # cache_batch_idx: the cache's rows as one-page tables
    rows = torch.tensor([5, 0, 2, 7], dtype=torch.int32)
    cache = torch.randn(8, 640, 8, 64, dtype=F16)
    assert dec.prefill_wanted(q, cache, cache, **_route_args(cache_batch_idx=rows)) is True
    assert asked[-1][4] is True and asked[-1][5].tolist() == [[5], [0], [2], [7]]


def test_chunked_prefill_route_is_off_in_the_interpreter():
    from flashtile.kernels import decode as dec
    q = torch.randn(4, 512, 32, 64, dtype=F16)
    k = torch.randn(4, 600, 8, 64, dtype=F16)
    assert not dec.prefill_wanted(q, k, k, **_route_args())


def test_chunked_prefill_route_runs_the_forward_on_the_cache_lengths(prefill_route, monkeypatch):
    """A routed call: prepare_decode plans the prefill forward, run_decode hands it the cache and
    the lengths (int32, as the kernel reads them) and returns its (out, lse)."""
    from flashtile.kernels import gluon_forward
    dec, _ = prefill_route
    calls = []
    monkeypatch.setattr(gluon_forward, "plain_forward",
                        lambda *args, **kw: calls.append((args, kw)) or ("out", "lse"))
    q = torch.randn(2, 512, 16, 64, dtype=F16)
    k = torch.randn(2, 900, 4, 64, dtype=F16)
    v = torch.randn_like(k)
    lengths = torch.tensor([700, 3], dtype=torch.int64)
    assert dec.describe_plan(q, k, v)["kernel"] == "gluon-prefill"
    assert dec.decode_attention(q, k, v, lengths, softmax_scale=0.3, window_left=-1,
                                window_right=0) == ("out", "lse")
    (args, kw), = calls
    assert args[:3] == (q, k, v) and args[3:] == (0.3, True)
    assert kw["seqused_k"].dtype == torch.int32 and kw["seqused_k"].tolist() == [700, 3]


def test_chunked_prefill_route_applies_sinks_to_the_forwards_result(prefill_route, monkeypatch):
    """With the Gluon epilogues' sinks off (FLASHTILE_GLUON_SINKS=0) the routed call's forward takes
    no sinks: run_decode applies them to the (out, lse) it returns, as apply_sinks_ does anywhere (the
    formula checked in test_sinks; with the switch on, as by default, the forward gets them: test_sinks'
    chunked-prefill route test)."""
    from flashtile.kernels import gluon_forward, sinks as sinks_module
    monkeypatch.setattr(gluon_forward, "SINKS_IN_EPILOGUE", False)
    dec, _ = prefill_route
    q = torch.randn(2, 512, 16, 64, dtype=F16)
    k = torch.randn(2, 900, 4, 64, dtype=F16)
    v = torch.randn_like(k)
    out, lse = torch.randn(2, 512, 16, 64, dtype=F16), torch.randn(2, 16, 512)
    monkeypatch.setattr(gluon_forward, "plain_forward", lambda *args, **kw: (out.clone(), lse.clone()))
    sinks = torch.randn(16) * 3
    got, got_lse = dec.decode_attention(q, k, v, torch.tensor([700, 3]), softmax_scale=0.3, window_left=-1,
                                        window_right=0, sinks=sinks)
    want, want_lse = out.clone(), lse.clone()
    sinks_module.apply_sinks_(want, want_lse, sinks)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse) and not torch.equal(got, out)


def _shuffled_pool(batch, pages, page_size, heads_k, head_dim, dtype=F16):
    """A pool of batch x pages pages in shuffled order plus two spare pages, NaN everywhere, and
    its (batch, pages) table."""
    order = torch.randperm(batch * pages + 2)
    table = order[:batch * pages].view(batch, pages).to(torch.int32)
    pool = torch.full((batch * pages + 2, page_size, heads_k, head_dim), math.nan, dtype=dtype)
    return pool, table


@pytest.mark.parametrize("page_size", [1, 3, 7])
def test_page_pools_gather_into_a_contiguous_cache(page_size):
    """forward.gathered_cache, the copy that brings pools of pages no TMA box fits to the prefill
    forward: sequence b's first lengths[b] keys (clamped to its table's capacity) through its
    shuffled table row into row b of a (B, capacity, Hk, D) cache; nothing of a page past the
    length is read into it (the pools hold NaN there)."""
    from flashtile.kernels import forward
    pages = 6
    k_pool, table = _shuffled_pool(4, pages, page_size, 2, 24, BF16)
    capacity = pages * page_size
    lengths = [capacity - 1, 0, 5, capacity + 9]  # the last one clamped to the capacity
    keys = [torch.randn(min(n, capacity), 2, 24, dtype=BF16) for n in lengths]
    for b, rows in enumerate(keys):
        for t in range(rows.shape[0]):
            k_pool[table[b, t // page_size], t % page_size] = rows[t]
    got = forward.gathered_cache(k_pool, table, torch.tensor(lengths, dtype=torch.int32))
    assert got.shape == (4, capacity, 2, 24) and got.dtype == BF16
    for b, rows in enumerate(keys):
        assert torch.equal(got[b, :rows.shape[0]], rows)
    # table entries past a sequence's pages may hold anything: clamped into the pool, never read
    table[2, -(-5 // page_size):] = 10 ** 6
    got = forward.gathered_cache(k_pool, table, torch.tensor(lengths, dtype=torch.int32))
    assert torch.equal(got[2, :5], keys[2])


@pytest.fixture
def gather_route(prefill_route, monkeypatch):
    """prefill_route, with gluon_forward.paged_supported answering yes (the sm_90 check)."""
    from flashtile.kernels import gluon_forward
    dec, asked = prefill_route
    monkeypatch.setattr(gluon_forward, "paged_supported", lambda *args, **kw: True)
    return dec, asked


@pytest.mark.parametrize("page_size, seqlen_q, pages, gathered", [
    (1, 512, 4096, True),  # 512 positions x group 4: 2048 rows a KV head
    (3, 512, 1366, True),
    (1, 512, 40000, True),  # the rows pay whatever the keys (the copy grows with them as the work)
    (8, 256, 64, True),  # 1024 rows
    (8, 255, 64, False),
    (1, 128, 4096, False),  # 512 rows: the copy would cost more than the decode kernel loses
])
def test_chunked_prefill_gathers_pools_no_box_fits(gather_route, page_size, seqlen_q, pages, gathered):
    """Page pools of a size no TMA box fits (no multiple of 16) reach the prefill forward through a
    contiguous copy from forward.GATHER_MIN_ROWS query rows a KV head; the plan is then asked
    about that copy at run time, not about the pools."""
    dec, asked = gather_route
    q = torch.randn(4, seqlen_q, 32, 64, dtype=F16)
    pool = torch.empty(4 * pages, page_size, 8, 64, dtype=F16)
    table = torch.arange(4 * pages, dtype=torch.int32).view(4, pages)
    assert dec.prefill_wanted(q, pool, pool, **_route_args(block_table=table)) is gathered
    assert dec.prefill_gathers(q, pool, pool, table) is gathered
    assert asked == []
    # pages of a multiple of 16 keys are read in place, as before
    pool16 = torch.empty(64, 16, 8, 64, dtype=F16)
    table16 = torch.arange(64, dtype=torch.int32).view(4, 16)
    assert dec.prefill_wanted(q, pool16, pool16, **_route_args(block_table=table16)) is True
    assert not dec.prefill_gathers(q, pool16, pool16, table16) and asked[-1][5] is table16


def test_chunked_prefill_gather_is_bounded_in_bytes(gather_route, monkeypatch):
    from flashtile.kernels import forward
    dec, _ = gather_route
    q = torch.randn(2, 512, 32, 64, dtype=F16)
    pool = torch.empty(2 * 1000, 1, 8, 64, dtype=F16)
    table = torch.arange(2000, dtype=torch.int32).view(2, 1000)
    copies = 2 * 2 * 1000 * 8 * 64 * 2  # K and V, B x capacity keys
    monkeypatch.setattr(forward, "GATHER_BYTES", copies)
    assert dec.prefill_gathers(q, pool, pool, table)
    monkeypatch.setattr(forward, "GATHER_BYTES", copies - 1)
    assert not dec.prefill_gathers(q, pool, pool, table)
    assert not dec.prefill_wanted(q, pool, pool, **_route_args(block_table=table))


def test_chunked_prefill_gather_runs_the_forward_on_the_copy(gather_route, monkeypatch):
    """run_decode on a gathered route: the forward gets contiguous K and V holding each sequence's
    keys up to its length (the pools' NaN past them not read), the lengths, and no table."""
    from flashtile.kernels import gluon_forward
    dec, _ = gather_route
    calls = []
    monkeypatch.setattr(gluon_forward, "plain_forward",
                        lambda *args, **kw: calls.append((args, kw)) or ("out", "lse"))
    page_size, pages = 3, 200
    k_pool, table = _shuffled_pool(2, pages, page_size, 4, 64)
    v_pool = k_pool.clone()
    lengths = [599, 250]
    for b, n in enumerate(lengths):
        for t in range(n):
            k_pool[table[b, t // page_size], t % page_size] = torch.randn(4, 64, dtype=F16)
            v_pool[table[b, t // page_size], t % page_size] = torch.randn(4, 64, dtype=F16)
    q = torch.randn(2, 512, 16, 64, dtype=F16)
    plan = dec.describe_plan(q, k_pool, v_pool, block_table=table)
    assert plan["kernel"] == "gluon-prefill" and plan["gathered"]
    assert dec.decode_attention(q, k_pool, v_pool, torch.tensor(lengths), softmax_scale=0.3, window_left=-1,
                                window_right=0, block_table=table) == ("out", "lse")
    (args, kw), = calls
    assert args[0] is q and args[3:] == (0.3, True) and kw["block_table"] is None
    assert kw["seqused_k"].tolist() == lengths
    for cache, pool in zip(args[1:3], (k_pool, v_pool)):
        assert cache.shape == (2, pages * page_size, 4, 64)
        for b, n in enumerate(lengths):
            want = pool[table[b].long()].reshape(-1, 4, 64)[:n]
            assert torch.equal(cache[b, :n], want)


@pytest.mark.parametrize("batch, seqlen_q, heads, seqlen_k, wanted", [
    (1, 128, 32, 2048, True),  # 32 work tiles on 132 SMs
    (1, 256, 12, 65536, True),
    (1, 100, 32, 1024, True),
    (1, 128, 32, 1000, False),  # too few keys
    (1, 257, 12, 8192, False),  # too many query positions
    (1, 256, 32, 8192, False),  # 64 tiles: under half the gain, losses at 1-2k keys
    (4, 128, 32, 8192, False),
])
def test_plain_calls_with_few_query_tiles_split_the_keys(batch, seqlen_q, heads, seqlen_k, wanted):
    """flash_attn_func's plain call runs the split-KV decode kernel where the Gluon forward's grid
    (query tiles alone) would leave most SMs idle (short-queries-h200-20261201)."""
    from flashtile.kernels.forward import split_keys_wanted
    assert split_keys_wanted(batch, seqlen_q, heads, seqlen_k, 132) is wanted


def test_key_counts_made_once_per_shape_and_stream_and_fresh_under_capture(monkeypatch):
    """The split route's per-sequence key counts: the right values, one tensor per (device, stream,
    batch, keys) reused across calls (its fill ordered before every read on its stream, no host
    sync), and a new one while a CUDA graph is being captured (a captured fill has not run when
    capture ends)."""
    import types

    from flashtile.kernels import forward
    monkeypatch.setattr(forward, "_KEY_COUNTS", {})
    cpu = torch.device("cpu")
    counts = forward.key_counts(3, 4096, cpu)
    assert counts.dtype == torch.int32 and counts.tolist() == [4096] * 3
    assert forward.key_counts(3, 4096, cpu) is counts
    assert forward.key_counts(2, 4096, cpu).tolist() == [4096] * 2
    assert forward.key_counts(3, 1000, cpu).tolist() == [1000] * 3
    cuda = torch.device("cuda", 0)
    made = []
    monkeypatch.setattr(torch, "full", lambda *a, **kw: made.append((a, kw)) or object())
    stream = types.SimpleNamespace(cuda_stream=1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    first = forward.key_counts(1, 2048, cuda)
    assert forward.key_counts(1, 2048, cuda) is first and len(made) == 1
    stream.cuda_stream = 2  # another stream: its own tensor
    assert forward.key_counts(1, 2048, cuda) is not first and len(made) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kept = len(forward._KEY_COUNTS)
    a, b = forward.key_counts(1, 2048, cuda), forward.key_counts(1, 2048, cuda)
    assert a is not b and len(made) == 4 and len(forward._KEY_COUNTS) == kept


def _stream_config():
    from flashtile.kernels.decode import DecodeConfig
    return DecodeConfig(32, 4, 1, stream=2)


@pytest.mark.parametrize("programs", [1, 3, 7, 50])
def test_stream_decode_matches_reference(nan_empty, programs):
    # Ragged lengths (one sequence empty), two query positions, 12/2 heads, a window and softcap:
    # every program an equal share of all pairs' key tiles, 1 to more programs than tiles.
    from flashtile.kernels.decode import decode_attention
    q, k_cache, v_cache, lengths = cache_case(batch=4, seqlen_q=2, heads=12, heads_k=2, capacity=130,
                                              dtype=BF16)
    lengths[2] = 0
    kw = dict(causal=True, window_size=(40, -1), softcap=5.0) if programs == 7 else dict(causal=True)
    window = kw.get("window_size", (-1, 0))[0]
    out, lse = decode_attention(q, k_cache, v_cache, lengths, softmax_scale=64 ** -0.5,
                                window_left=window, window_right=0, softcap=kw.get("softcap", 0.0),
                                num_splits=programs, config=_stream_config())
    assert torch.all(out[2] == 0) and torch.all(lse[2] == math.inf)  # no keys: 0 and LSE +inf
    keep = [0, 1, 3]
    assert_each_sequence_matches(out[keep], lse[keep], q[keep], k_cache[keep], v_cache[keep],
                                 lengths[keep], **kw)


@pytest.mark.parametrize("page_size", [3, 16])
def test_stream_decode_paged_alibi_and_leftpad(nan_empty, page_size):
    from flashtile.bench.decode import paginate
    from flashtile.kernels.decode import decode_attention
    q, k_cache, v_cache, lengths = cache_case(head_dim=64, capacity=96)
    slopes = torch.rand(3, 8)
    keys, values, table = paginate(k_cache, v_cache, page_size)
    out, lse = decode_attention(q, keys, values, lengths, softmax_scale=0.125, window_left=-1,
                                window_right=0, block_table=table, alibi_slopes=slopes, num_splits=4,
                                config=_stream_config())
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True,
                                 alibi_slopes=slopes)
    leftpad = torch.tensor([5, 0, 30], dtype=torch.int32)
    lengths = torch.tensor([60, 96, 90], dtype=torch.int32)
    out, lse = decode_attention(q, k_cache, v_cache, lengths, softmax_scale=0.125, window_left=-1,
                                window_right=0, cache_leftpad=leftpad, num_splits=5,
                                config=_stream_config())
    for b in range(3):
        lo, hi = int(leftpad[b]), int(lengths[b])
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, lo:hi],
                                 v_cache[b:b + 1, lo:hi], causal=True)


def test_stream_plans_are_opt_in_and_run_stream_config(monkeypatch):
    # FLASHTILE_DECODE_STREAM=1: the Triton kernel's calls as stream-K in STREAM_CONFIG's programs
    # (programs_per_sm per SM; the CPU device counts 4 SMs); an explicit num_splits keeps the plain
    # split, and calls stream-K cannot take keep the plain plan's config.
    import flashtile.kernels.decode as dec
    assert dec.STREAM_PLANS is (os.environ.get("FLASHTILE_DECODE_STREAM", "0") not in ("", "0"))
    q, k_cache, v_cache, lengths = cache_case(seqlen_q=2, dtype=BF16)
    monkeypatch.setattr(dec, "_PLANS", {})
    monkeypatch.setattr(dec, "STREAM_PLANS", False)
    plain = dec.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1, window_right=0)
    monkeypatch.setattr(dec, "_PLANS", {})
    monkeypatch.setattr(dec, "STREAM_PLANS", True)
    stream = dec.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1, window_right=0)
    forced = dec.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1, window_right=0,
                                num_splits=3)
    assert plain.stream is None and forced.stream is None and forced.splits == 3
    assert stream.stream is not None
    assert stream.grid == (dec._sm_count(q.device) * dec.STREAM_CONFIG.programs_per_sm, 1, 1)
    assert stream.kernel_options["BLOCK_N"] == dec.STREAM_CONFIG.block_n
    monkeypatch.setattr(dec, "_PLANS", {})
    monkeypatch.setattr(dec, "STREAM_MAX_BATCH", 2)  # each program holds all the lengths: capped
    capped = dec.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1, window_right=0)
    assert capped.stream is None and capped.grid == plain.grid and capped.kernel_options == plain.kernel_options
    monkeypatch.setattr(dec, "_PLANS", {})
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True)
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True)


def test_one_query_row_plans_causal_as_full_attention():
    # As flash-attn does: a single query row, aligned with the last key, sees every key either way,
    # so a causal call plans (and runs) the full-attention kernel; with two rows, or a window, or
    # ALiBi slopes, causal stays.
    from flashtile.kernels import decode
    for seqlen_q, same in ((1, True), (2, False)):
        q, k_cache, v_cache, lengths = cache_case(batch=2, seqlen_q=seqlen_q, heads=4, heads_k=2,
                                                  head_dim=64, capacity=40, dtype=BF16)
        plans = [decode.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1,
                                       window_right=right) for right in (0, -1)]
        assert (plans[0] == plans[1]) == same
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                     causal=True, return_softmax_lse=True)
        assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True)
    q, k_cache, v_cache, lengths = cache_case(batch=2, seqlen_q=1, heads=4, heads_k=2, head_dim=64,
                                              capacity=40, dtype=BF16)
    windowed = [decode.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=8,
                                      window_right=right) for right in (0, -1)]
    assert windowed[0] != windowed[1]
    slopes = torch.rand(4)
    with_alibi = [decode.prepare_decode(q, k_cache, v_cache, softmax_scale=0.1, window_left=-1,
                                        window_right=right, alibi_slopes=slopes) for right in (0, -1)]
    assert with_alibi[0] != with_alibi[1]


@pytest.fixture
def warp_split_plans(monkeypatch):
    """The Triton decode kernel's unsplit plans with the warp-split loop at every cache length: the
    H200's 64-key, 4-warp steps (the interpreter's own plans take 32-key steps, 8 keys a warp)."""
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "WARP_SPLIT_MIN_KEYS", 0)
    monkeypatch.setattr(decode, "decode_config",
                        lambda *a, **k: decode.DecodeConfig(64, 4, 2, waves=1, min_split_keys=128, max_splits=1))
    decode._PLANS.clear()
    yield decode
    decode._PLANS.clear()


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("seqlen_q,heads,heads_k,kw", [(1, 8, 2, dict(causal=True)), (3, 8, 2, dict(causal=True)),
                                                        (2, 2, 2, dict()), (1, 16, 1, dict(causal=True))],
                         ids=["decode", "speculative-causal", "MHA-full", "MQA"])
def test_warp_split_loop_matches_reference(warp_split_plans, nan_empty, dtype, seqlen_q, heads, heads_k, kw):
    # Each key tile's keys split among the warps, every warp its own softmax state, merged at the
    # end: lengths that end inside a tile and inside a warp's slice, one sequence as short as its
    # queries, outputs allocated NaN-filled.
    decode = warp_split_plans
    # (at most one program per SM: the interpreter's 4 "SMs" hold 4 (sequence, KV head) pairs)
    q, k_cache, v_cache, lengths = cache_case(batch=4 // heads_k, seqlen_q=seqlen_q, heads=heads, heads_k=heads_k,
                                              head_dim=128, capacity=200, dtype=dtype)
    lengths[1] = 70  # 64 + 6: the second tile's first warp slice, partly
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 return_softmax_lse=True, **kw)
    assert [p[2]["WARPS"] for p in decode._PLANS.values()] == [4]
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, **kw)


def test_warp_split_loop_takes_sinks(warp_split_plans, nan_empty):
    # Attention sinks in the unsplit epilogue after the warps' states are merged: one rounding.
    decode = warp_split_plans
    q, k_cache, v_cache, lengths = cache_case(batch=2, heads=8, heads_k=2, head_dim=128, capacity=200, dtype=BF16)
    lengths[1] = 70
    sinks = torch.randn(8) * 3
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True, s_aux=sinks)
    assert [(p[2]["WARPS"], p[2]["SINKS"]) for p in decode._PLANS.values()] == [(4, True)]
    assert_each_sequence_matches(out, lse, q, k_cache, v_cache, lengths, causal=True, sinks=sinks)


def test_warp_split_plans(h200_plans):
    # Only unsplit plans of contiguous 16-bit caches with head dim 128, from WARP_SPLIT_MIN_KEYS keys
    # and at most one program per SM, without left windows, softcap or ALiBi.
    decode, dev = h200_plans

    def warps(batch=16, heads=32, heads_k=8, capacity=32768, paged=False, fp8=False, left=False, softcap=False,
              head_dim=128, seqlen_q=1, num_splits=0):
        kernel = decode._plan(batch, seqlen_q, heads, heads_k, head_dim, torch.bfloat16, dev, paged, capacity,
                              num_splits, None, left, True, softcap, False, False, False, fp8, False, False,
                              16 if paged else 1, gluon_ok=False, causal=True)[2]
        return kernel["WARPS"]
    assert warps() == 4 and warps(capacity=16384) == 4 and warps(batch=64, heads=12, heads_k=2) == 4
    assert warps(capacity=8192) == 0  # shorter caches: the 2-D loop
    assert warps(batch=64) == 0  # 512 pairs: more than one program per SM
    assert warps(paged=True) == 0 and warps(fp8=True) == 0 and warps(head_dim=256) == 0
    assert warps(left=True) == 0 and warps(softcap=True) == 0
    assert warps(num_splits=2) == 0
    assert warps(seqlen_q=4) == 4 and warps(seqlen_q=5) == 0  # 16 rows a tile at most


def test_warp_split_loop_with_leftpad_batch_idx_and_an_empty_sequence(warp_split_plans, nan_empty, monkeypatch):
    # cache_leftpad and cache_batch_idx move the rows the warps read; a sequence without keys gives
    # rows of 0 (no NaN from the merge of warps that saw nothing). Against the 2-D loop's call.
    decode = warp_split_plans
    q, k_cache, v_cache, _ = cache_case(batch=2, heads=8, heads_k=2, head_dim=128, capacity=160, dtype=BF16)
    big_k, big_v = torch.randn(5, 160, 2, 128, dtype=BF16), torch.randn(5, 160, 2, 128, dtype=BF16)
    kw = dict(cache_seqlens=torch.tensor([150, 0], dtype=torch.int32), causal=True,
              cache_leftpad=torch.tensor([37, 0], dtype=torch.int32),
              cache_batch_idx=torch.tensor([4, 1], dtype=torch.int32))
    out = flashtile.flash_attn_with_kvcache(q, big_k, big_v, **kw)
    assert [p[2]["WARPS"] for p in decode._PLANS.values()] == [4]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_matches_reference(out[:1], None, q[:1], big_k[4:5, 37:150], big_v[4:5, 37:150], causal=True)
    monkeypatch.setattr(decode, "WARP_SPLIT", False)
    decode._PLANS.clear()
    two_d = flashtile.flash_attn_with_kvcache(q, big_k, big_v, **kw)
    assert [p[2]["WARPS"] for p in decode._PLANS.values()] == [0]
    torch.testing.assert_close(out, two_d, atol=2e-2, rtol=0)


def _packed_cache_case(lens_q, lens_k, heads=6, heads_k=2, head_dim=32, cache_rows=None, capacity=80, dtype=F16):
    """FlashAttention-3's packed call: q (total_q, H, D), offsets, a contiguous cache of
    ``cache_rows`` rows and each sequence's key count."""
    q = torch.randn(sum(lens_q), heads, head_dim, dtype=dtype)
    rows = cache_rows or len(lens_q)
    k_cache = torch.randn(rows, capacity, heads_k, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    cu = torch.tensor([0] + list(lens_q)).cumsum(0).to(torch.int32)
    return q, cu, k_cache, v_cache, torch.tensor(lens_k, dtype=torch.int32)


def _assert_packed_sequences_match(out, lse, q, cu, k_cache, v_cache, lengths, rows=None, **kw):
    for b in range(cu.shape[0] - 1):
        sq = slice(int(cu[b]), int(cu[b + 1]))
        if sq.stop == sq.start:
            continue
        row, n = (b if rows is None else int(rows[b])), int(lengths[b])
        assert_matches_reference(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), q[sq].unsqueeze(0),
                                 k_cache[row:row + 1, :n], v_cache[row:row + 1, :n], **kw)


@pytest.mark.parametrize("lens_q", [[1, 2, 0, 1, 1], [1, 20, 0, 3, 7], [1, 70, 0, 3, 7]],
                         ids=["decode", "wide", "mixed"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(30, 0), softcap=8.0), dict()],
                         ids=["causal", "window-softcap", "full"])
def test_fa3_packed_queries_against_a_contiguous_cache(lens_q, kw, nan_empty):
    """FlashAttention-3's cu_seqlens_q / max_seqlen_q: sequence b's packed queries against the first
    cache_seqlens[b] keys of cache row b, aligned bottom-right; LSE (H, total_q). Decode steps,
    up to 64 queries and a mixed batch (the three routes of flash_attn_varlen_func)."""
    q, cu, k_cache, v_cache, lengths = _packed_cache_case(lens_q, [30, 75, 5, 3, 40])
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cu_seqlens_q=cu,
                                                 max_seqlen_q=max(lens_q), return_softmax_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    _assert_packed_sequences_match(out, lse, q, cu, k_cache, v_cache, lengths, **kw)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_fa3_packed_queries_on_a_page_table(page_size, nan_empty):
    """page_table (FlashAttention-3's name for block_table) with packed queries: the same results as
    each sequence's keys in a contiguous cache."""
    lens_q = [1, 20, 0, 3, 7]
    q, cu, k_cache, v_cache, lengths = _packed_cache_case(lens_q, [30, 75, 5, 3, 40], heads=8, heads_k=1)
    k_pool, v_pool, table = paged_cache(k_cache, v_cache, page_size)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, page_table=table,
                                                 cu_seqlens_q=cu, max_seqlen_q=20, causal=True,
                                                 return_softmax_lse=True, scheduler_metadata=torch.zeros(4),
                                                 pack_gqa=True, sm_margin=8)
    _assert_packed_sequences_match(out, lse, q, cu, k_cache, v_cache, lengths, causal=True)


def test_fa3_packed_queries_through_cache_batch_idx_and_int_seqlens(nan_empty):
    """cache_batch_idx picks each sequence's cache row; an int cache_seqlens (or None: the whole
    cache) counts for every sequence."""
    lens_q = [2, 1, 9, 1]
    q, cu, k_cache, v_cache, _ = _packed_cache_case(lens_q, [0] * 4, cache_rows=6, capacity=40)
    rows = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    for seqlens, expected in ((33, 33), (None, 40)):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=rows,
                                                     cu_seqlens_q=cu, max_seqlen_q=9, causal=True,
                                                     return_softmax_lse=True)
        _assert_packed_sequences_match(out, lse, q, cu, k_cache, v_cache, [expected] * 4, rows=rows, causal=True)


def test_fa3_packed_queries_are_flash_attn_varlen_func_with_seqused_k(monkeypatch):
    """The packed kvcache call is flash_attn_varlen_func on the pools with cache_seqlens as
    seqused_k, bit for bit, e4m3 pools and descales included; num_splits reaches the decode, and
    the split call meets the e4m3 accuracy rule against float64 as the unsplit one does."""
    from test_fp8 import _check_per_sequence, _packed_e4m3
    lens_q, lens_k = [1, 3, 0, 2], [40, 9, 3, 70]
    cu, _, tensors, descales, _ = _packed_e4m3(lens_q, lens_k, 8, 2, 32)
    k_cache, v_cache = (torch.randn(4, 72, 2, 32).to(torch.float8_e4m3fn) for _ in range(2))
    k_pool, v_pool, table = paged_cache(k_cache.float(), v_cache.float(), 8)
    k_pool, v_pool = k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn)
    packed = [torch.cat([c[b, :n] for b, n in enumerate(lens_k)]) for c in (k_cache, v_cache)]
    used = torch.tensor(lens_k, dtype=torch.int32)
    splits = []
    real = interface.ops.kvcache
    monkeypatch.setattr(interface.ops, "kvcache", lambda *a, **k: splits.append(a[11]) or real(*a, **k))

    def call(num_splits):
        return flashtile.flash_attn_with_kvcache(
            tensors[0], k_pool, v_pool, cache_seqlens=used, page_table=table, cu_seqlens_q=cu, max_seqlen_q=3,
            causal=True, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2], num_splits=num_splits,
            return_softmax_lse=True)
    out, lse = call(0)
    ref_out, ref_lse, _ = flashtile.flash_attn_varlen_func(
        tensors[0], k_pool, v_pool, cu, None, 3, 72, causal=True, block_table=table, seqused_k=used,
        q_descale=descales[0], k_descale=descales[1], v_descale=descales[2], return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    split_out, split_lse = call(3)
    assert splits == [0, 0, 3]
    cu_k = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    for o, l in ((out, lse), (split_out, split_lse)):
        _check_per_sequence(o, l, (tensors[0], *packed), descales, cu.tolist(), cu_k, 2, causal=True)


def test_fa3_packed_call_compiles_with_fullgraph():
    q, cu, k_cache, v_cache, lengths = _packed_cache_case([1, 3, 0, 2], [40, 9, 3, 70])

    def fn(q):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cu_seqlens_q=cu,
                                                 max_seqlen_q=3, causal=True, return_softmax_lse=True)
    torch._dynamo.reset()
    eager = fn(q)
    compiled = torch.compile(fn, fullgraph=True)(q)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def _bad_fa3_calls():
    def call(**overrides):
        q, cu, k_cache, v_cache, lengths = _packed_cache_case([1, 4, 2], [30, 20, 10])
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, cu_seqlens_q=cu, max_seqlen_q=4)
        args.update(overrides)
        return lambda: flashtile.flash_attn_with_kvcache(**args)
    table = torch.zeros(3, 2, dtype=torch.int32)
    return [
        pytest.param(call(block_table=table, page_table=table), ValueError, "not both", id="both-tables"),
        pytest.param(call(max_seqlen_q=None), ValueError, "max_seqlen_q is required", id="no-max-seqlen-q"),
        pytest.param(call(qv=torch.zeros(7, 6, 32)), NotImplementedError, "qv", id="qv"),
        pytest.param(call(attention_chunk=64), NotImplementedError, "attention_chunk", id="attention-chunk"),
        pytest.param(call(attention_chunk=-1), ValueError, "attention_chunk must be", id="attention-chunk-negative"),
        pytest.param(call(rotary_seqlens=torch.zeros(3, dtype=torch.int32)), NotImplementedError, "rotary_seqlens",
                     id="rotary-seqlens"),
        pytest.param(call(k=torch.zeros(7, 2, 32, dtype=F16), v=torch.zeros(7, 2, 32, dtype=F16)),
                     NotImplementedError, "new k/v", id="new-kv"),
        pytest.param(call(cu_seqlens_k_new=torch.zeros(4, dtype=torch.int32)), NotImplementedError, "new k/v",
                     id="cu-seqlens-k-new"),
        pytest.param(call(cu_seqlens_q=None, cu_seqlens_k_new=torch.zeros(4, dtype=torch.int32)), ValueError,
                     "goes with cu_seqlens_q", id="k-new-without-q"),
        pytest.param(call(rotary_cos=torch.zeros(40, 16), rotary_sin=torch.zeros(40, 16)), NotImplementedError,
                     "rotary", id="rotary"),
        pytest.param(call(cache_leftpad=torch.zeros(3, dtype=torch.int32)), NotImplementedError, "cache_leftpad",
                     id="leftpad"),
        pytest.param(call(q=torch.randn(1, 7, 6, 32, dtype=F16)), ValueError, "q must", id="q-not-packed"),
        pytest.param(call(cache_seqlens=torch.tensor([30, 81, 1], dtype=torch.int32)), ValueError,
                     r"cache_seqlens entries must be in \[0, 80\]", id="seqlens-past-cache"),
        pytest.param(call(cache_seqlens=torch.tensor([30, 8], dtype=torch.int32)), ValueError,
                     r"cache_seqlens must have shape \(3,\)", id="seqlens-shape"),
        pytest.param(call(cache_seqlens=torch.tensor([30, 8, 1])), TypeError, "cache_seqlens must be int32",
                     id="seqlens-dtype"),
        pytest.param(call(cache_seqlens=81), ValueError, r"cache_seqlens must be in \[0, 80\]", id="int-seqlens"),
        pytest.param(call(k_cache=torch.randn(2, 80, 2, 32, dtype=F16)), ValueError, "rows for 3 sequences",
                     id="cache-rows"),
        pytest.param(call(cache_batch_idx=torch.tensor([0, 3, 1], dtype=torch.int32)), ValueError,
                     r"cache_batch_idx entries must be in \[0, 3\)", id="batch-idx-range"),
        pytest.param(call(num_splits=200), ValueError, "num_splits", id="splits"),
        pytest.param(call(sm_margin=-1), ValueError, "sm_margin", id="sm-margin"),
        pytest.param(call(scheduler_metadata=[1]), TypeError, "scheduler_metadata", id="scheduler-metadata"),
        pytest.param(call(k_cache=torch.randn(3, 80, 2, 32, dtype=BF16)), TypeError, "k_cache has dtype",
                     id="dtype"),
        pytest.param(call(k_cache=torch.randn(3, 80, 2, 32).to(torch.float8_e4m3fn)), TypeError,
                     "takes an e4m3 q", id="e4m3-cache-16-bit-q"),
    ]


@pytest.mark.parametrize("fn,exc,message", _bad_fa3_calls())
def test_fa3_keywords_bad_input_is_named(fn, exc, message):
    with pytest.raises(exc, match=message):
        fn()


@pytest.mark.parametrize("paged", [False, True])
def test_fa3_packed_call_reads_its_values_once_per_tensor_version(paged, monkeypatch):
    """Every layer passes the same cache_seqlens, cu_seqlens_q and page table (or, contiguous, the
    same cache rows): their values are read on the host at the first layer only, and again after an
    in-place change."""
    q, cu, k_cache, v_cache, lengths = _packed_cache_case([1, 3, 0, 2], [40, 9, 3, 70])
    kw = dict(cache_seqlens=lengths, cu_seqlens_q=cu, max_seqlen_q=3, causal=True)
    if paged:
        k_cache, v_cache, kw["page_table"] = paged_cache(k_cache, v_cache, 16)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    first = len(reads)
    assert first > 0
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert len(reads) == first
    lengths[0] = 81
    with pytest.raises(ValueError, match="cache_seqlens entries must be in"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
