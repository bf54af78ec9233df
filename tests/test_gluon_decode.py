"""The Gluon (TMA) paged decode's host side: which calls it takes, the plans it gets, the cache views
its descriptors read. The kernel itself cannot run in the interpreter: it compiles for sm_90 in
test_gluon_compile.py and is checked on the H200 by benchmarks/gluon_decode_check.py."""

import dataclasses

import pytest
import torch

from flashtile.kernels import decode, gluon_decode


def _paged(page=16, heads=32, heads_k=8, d=128, dtype=torch.bfloat16):
    q = torch.randn(2, 1, heads, d, dtype=dtype)
    k = torch.randn(10, page, heads_k, d, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_not_supported_on_cpu():
    assert not gluon_decode.supported(*_paged(), paged=True, window=False, softcap=False,
                                      alibi=False, leftpad=False)


@pytest.mark.parametrize("change", [dict(head_dim=96), dict(paged=True, page_rows=4),
                                    dict(paged=True, block_n=64, page_rows=48)])
def test_variant_rejects_what_the_kernel_cannot_tile(change):
    with pytest.raises(ValueError):
        gluon_decode.DecodeVariant(**{"head_dim": 128, **change})


def test_contiguous_variant_boxes_whole_tiles():
    assert gluon_decode.DecodeVariant(128, block_n=64, page_rows=16).page_rows == 64


def test_cache_rows_views_contiguous_caches_only():
    k = torch.randn(10, 16, 8, 128, dtype=torch.bfloat16)
    rows = gluon_decode.cache_rows(k)
    assert rows.shape == (160, 1024) and rows.data_ptr() == k.data_ptr()
    assert gluon_decode.cache_rows(k[:, :8]) is None  # a slice along the slots: not one 2-D view
    assert gluon_decode.cache_rows(k.transpose(1, 2)) is None
    assert gluon_decode.rows_viewable(k) and not gluon_decode.rows_viewable(k[:, :8])
    assert not gluon_decode.rows_viewable(torch.randn(10, 16, 1, 4, dtype=torch.bfloat16))  # 8-byte rows


@pytest.mark.parametrize("batch,heads_k,capacity,page,stages,splits,page_rows", [
    (1, 8, 32768, 16, 4, 16, 16),     # one wave of 1-CTA-per-SM programs: SMs // pairs splits
    (1, 2, 32768, 16, 4, 66, 16),
    (16, 2, 16384, 16, 4, 4, 16),
    (16, 8, 16384, 16, 4, 1, 16),     # 128 pairs, under the SM count
    (64, 8, 16384, 16, 3, 1, 16),     # more pairs than SMs: two CTAs per SM
    (1, 8, 32768, 256, 4, 16, 64),    # pages larger than a tile: one box per tile
    (1, 8, 32768, 8, 4, 16, 8),
    (1, 8, 1024, 16, 4, 8, 16),       # no split shorter than 128 keys of the capacity
])
def test_gluon_plan(monkeypatch, batch, heads_k, capacity, page, stages, splits, page_rows):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    got_splits, upcast, kernel, merge, variant = decode._gluon_plan(
        batch, heads_k, 128, torch.bfloat16, torch.device("cpu"), capacity, 0, page, False, False,
        False)
    assert (variant.block_n, variant.stages, variant.page_rows) == (64, stages, page_rows)
    assert variant.paged and variant.pdl and variant.heads_first and not variant.causal
    assert got_splits == splits and kernel is None and not upcast
    assert (merge is None) == (splits == 1)


def test_gluon_plan_keeps_asked_splits(monkeypatch):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    assert decode._gluon_plan(1, 8, 128, torch.float16, torch.device("cpu"), 32768, 5, 16, True,
                              True, False)[0] == 5
    plan = decode._gluon_plan(1, 8, 128, torch.float16, torch.device("cpu"), 32768, 0, 16, True,
                              True, True)
    assert plan[0] == 1 and plan[4].dtype == "fp16" and plan[4].causal and plan[4].batch_idx


def test_stream_opt_in_splits_gluon_plans(monkeypatch):
    # FLASHTILE_DECODE_STREAM=1 (lengths that differ): the Gluon kernel's 16-bit plans cut every
    # pair into at least STREAM_GLUON_SPLITS; plans with more, asked counts, one launch and e4m3
    # caches stay as they are.
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")

    def splits(batch, heads_k, capacity, asked=0, one_launch=False, fp8=False):
        return decode._gluon_plan(batch, heads_k, 128, torch.bfloat16, cpu, capacity, asked, 16, True,
                                  False, one_launch, fp8, 4)[0]

    plain = [splits(16, 8, 16384), splits(64, 8, 16384), splits(1, 8, 32768), splits(64, 2, 8192, fp8=True)]
    assert plain[:3] == [1, 1, 16]
    monkeypatch.setattr(decode, "STREAM_PLANS", True)
    assert splits(16, 8, 16384) == splits(64, 8, 16384) == decode.STREAM_GLUON_SPLITS
    assert splits(1, 8, 32768) == 16 and splits(64, 2, 8192, fp8=True) == plain[3]
    assert splits(16, 8, 16384, asked=2) == 2 and splits(16, 8, 16384, one_launch=True) == 1


def test_cpu_calls_keep_the_portable_kernel():
    q, k, v = _paged()
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    plan = decode.describe_plan(q, k, v, table)
    assert plan["kernel"] == "triton"


@pytest.mark.parametrize("paged,pairs,capacity,wanted", [
    (True, 8, 32768, True), (True, 128, 131072, True), (True, 132, 4096, False),
    (True, 395, 4096, False), (True, 512, 1024, True),
    (False, 128, 1024, True), (False, 8, 4096, True), (False, 8, 4097, False),
    (False, 132, 1024, False), (False, 128, 4096, False), (False, 32, 1024, False),
])
def test_gluon_wanted(paged, pairs, capacity, wanted):
    assert decode.gluon_wanted(paged, pairs, 132, capacity) == wanted


def test_gluon_plan_contiguous(monkeypatch):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    splits, _, _, _, variant = decode._gluon_plan(16, 8, 128, torch.bfloat16, torch.device("cpu"),
                                                  1024, 0, 0, False, False, False)
    assert splits == 1 and not variant.paged and variant.page_rows == variant.block_n == 64


def test_e4m3_caches_take_the_transposed_gluon_kernel(monkeypatch):
    # e4m3 caches go to the Gluon kernel's transposed consumer, paged ones too (at most 32 query
    # rows a KV head, as contiguous ones), their descales through the producer's ring
    assert decode.gluon_wanted(False, 8, 132, 1 << 17, fp8=True)
    assert decode.gluon_wanted(False, 512, 132, 1024, fp8=True)
    assert decode.gluon_wanted(True, 8, 132, 1 << 17, fp8=True, rows=4)
    assert decode.gluon_wanted(True, 512, 132, 1024, fp8=True, rows=16)
    assert decode.gluon_wanted(True, 8, 132, 1 << 17, fp8=True, rows=32)
    assert not decode.gluon_wanted(True, 8, 132, 1 << 17, fp8=True, rows=33)
    monkeypatch.setattr(decode, "GLUON_E4M3_PAGED", False)
    assert not decode.gluon_wanted(True, 8, 132, 1 << 17, fp8=True, rows=4)
    assert decode.gluon_wanted(False, 8, 132, 1 << 17, fp8=True, rows=4)
    monkeypatch.setattr(decode, "GLUON_E4M3_PAGED", True)
    with pytest.raises(ValueError):  # the consumer's own descale loads index contiguous caches
        gluon_decode.DecodeVariant(128, block_n=64, paged=True, page_rows=16, fp8=True, rows_n=8,
                                   v_regs=True)
    paged = gluon_decode.DecodeVariant(128, block_n=64, paged=True, page_rows=16, fp8=True, rows_n=8,
                                       v_regs=True, ds_ring=True)
    assert paged.name.endswith("dsring") and "paged16" in paged.name
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    # paged plans are the contiguous ones (splits, CTAs per SM), with the ring at every split length
    for batch, capacity, page in ((1, 32768, 16), (64, 16384, 8), (16, 131072, 256)):
        contiguous = decode._gluon_plan(batch, 8, 128, torch.bfloat16, torch.device("cpu"), capacity,
                                        0, 0, False, False, False, True, 4)
        splits, _, _, _, variant = decode._gluon_plan(batch, 8, 128, torch.bfloat16,
                                                      torch.device("cpu"), capacity, 0, page, False,
                                                      False, False, True, 4)
        assert splits == contiguous[0] and variant.ds_ring and variant.paged
        assert variant.page_rows == min(page, 64)
        assert dataclasses.replace(variant, paged=False, page_rows=0,
                                   ds_ring=contiguous[4].ds_ring) == contiguous[4]
    # 17-32 rows (V widened into shared tiles, two per SM at 128 registers), the descale ring at
    # every split length
    for page, causal in ((16, True), (0, True), (64, False)):
        splits, _, _, _, variant = decode._gluon_plan(2, 8, 128, torch.bfloat16, torch.device("cpu"),
                                                      8192, 0, page, causal, False, False, True, 32)
        assert variant.rows_n == 32 and not variant.v_regs and variant.ds_ring
        assert splits == 2 * 132 // 16 and variant.causal == causal
        assert gluon_decode._launch_shape(variant)["maxnreg"] == 128
        assert gluon_decode._launch_shape(dataclasses.replace(variant, head_dim=64))["maxnreg"] == 128
    with pytest.raises(ValueError):
        gluon_decode.DecodeVariant(128, block_n=64, rows_n=8, v_regs=True)  # 16-bit: no widening
    with pytest.raises(ValueError):
        gluon_decode.DecodeVariant(128, block_n=64, rows_n=8, ds_ring=True)  # 16-bit: no descales
    for bad in ({"rows_n": 12}, {"rows_n": 8, "block_n": 128}, {"rows_n": 0}):
        with pytest.raises(ValueError):
            gluon_decode.DecodeVariant(**{"head_dim": 128, "block_n": 64, "fp8": True, **bad})
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    # B1 with 32/8 heads (4 query rows a KV head): three programs per SM, one wave of splits, V^T
    # in registers
    splits, _, _, merge, variant = decode._gluon_plan(1, 8, 128, torch.bfloat16, torch.device("cpu"),
                                                      32768, 0, 0, False, False, False, True, 4)
    assert variant.fp8 and not variant.paged and (variant.block_n, variant.stages) == (64, 2)
    assert variant.rows_n == 8 and variant.v_regs and gluon_decode._launch_shape(variant)["maxnreg"] == 80
    assert splits == 49 and merge is not None
    assert variant.ds_ring  # splits of 669 keys: the producer loads the descales

    def e4m3_plan(batch, capacity, rows=4):
        splits, _, _, merge, variant = decode._gluon_plan(batch, 8, 128, torch.bfloat16,
                                                          torch.device("cpu"), capacity, 0, 0, False,
                                                          False, False, True, rows)
        assert (merge is not None) == (splits > 1)
        return splits, variant.stages, variant.v_regs, gluon_decode._launch_shape(variant)["maxnreg"]
    # From E4M3_FOUR_MIN_PAIRS pairs with <= 8 rows: four per SM at 64 registers; 512 pairs (B64
    # 32/8) and 400 (B50) are one wave of them, unsplit, at any length
    for batch in (64, 50):
        for capacity in (1024, 2048, 16384):
            assert e4m3_plan(batch, capacity) == (1, 2, True, 64)
    assert e4m3_plan(16, 32768) == (4, 2, True, 64)  # 128 pairs: 4 splits, one wave
    assert e4m3_plan(4, 32768) == (12, 2, True, 80)  # 32 pairs: three per SM
    assert e4m3_plan(64, 16384, rows=12) == (3, 2, True, 80)  # 16 rows: three per SM, 3 splits
    # past one wave: the fewest splits that fill >= 95% of their waves, four per SM first, else
    # the fullest waves
    assert e4m3_plan(128, 16384) == (1, 2, True, 64)  # 1024 pairs: 1.94 waves of four per SM
    assert e4m3_plan(96, 16384) == (1, 2, True, 80)  # 768: 1.45 waves of four, 1.94 of three
    assert e4m3_plan(80, 1024) == (1, 2, True, 80)  # 640, 1k: 1.21 waves of four, 1.62 of three
    assert e4m3_plan(160, 16384) == (2, 2, True, 64)  # 1280: 2.42 / 3.23 waves, 2 splits 4.85 of four
    # the descales through the producer's ring for splits of at most E4M3_DS_RING_SPLIT keys
    for batch, capacity, ring in ((64, 16384, False), (64, 2048, True), (16, 16384, False),
                                  (16, 32768, False), (1, 131072, True)):
        assert decode._gluon_plan(batch, 8, 128, torch.bfloat16, torch.device("cpu"), capacity, 0, 0,
                                  False, False, False, True, 4)[4].ds_ring == ring
    # V^T in shared memory (E4M3_V_REGS off): three per SM and 3 splits, or two per SM unsplit
    monkeypatch.setattr(decode, "E4M3_V_REGS", False)
    assert e4m3_plan(64, 16384) == (3, 2, False, 80)
    assert e4m3_plan(64, 1024) == (1, 4, False, 128)
    monkeypatch.setattr(decode, "E4M3_V_REGS", True)
    # query rows a KV head: 8 -> 8, 12 (Sq 3 x group 4) -> 16, 32 -> 32, 33 -> the 64-row consumer
    for rows, rows_n, per_sm in ((8, 8, 3), (12, 16, 3), (17, 32, 2), (32, 32, 2)):
        variant = decode._gluon_plan(2, 2, 128, torch.bfloat16, torch.device("cpu"), 4096, 0, 0, True,
                                     False, False, True, rows)[4]
        assert (variant.rows_n, variant.stages) == (rows_n, 2)
        shared = 3 if gluon_decode._launch_shape(variant)["maxnreg"] == 80 else 2
        assert shared == per_sm  # the CTAs per SM the plan's split count assumes fit


def test_e4m3_supported_is_false_on_cpu():
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 128).to(torch.float8_e4m3fn)
    ds = torch.ones(1, 64, 2)
    assert not gluon_decode.supported(q, k, k, paged=False, window=False, softcap=False, alibi=False,
                                      leftpad=False, k_descale=ds, v_descale=ds)


@pytest.mark.parametrize("paged,pairs,capacity,rows,wanted,stages,transposed", [
    # contiguous caches: long splits (>= T16_LONG_SPLIT keys a split at one CTA per SM) of at most
    # 32 pairs take the transposed consumer; the rest keep the earlier rule and consumer
    (False, 8, 32768, 4, True, 4, True), (False, 2, 32768, 6, False, None, False),
    (False, 2, 131072, 6, True, 3, True), (False, 8, 32768, 64, False, None, False),
    (False, 8, 16384, 4, True, 4, True), (False, 8, 8192, 4, False, None, False),
    (False, 132, 32768, 4, False, None, False), (False, 32, 32768, 6, True, 4, True),
    (False, 32, 4096, 6, False, None, False), (False, 16, 65536, 4, True, 4, True),
    (False, 64, 32768, 4, False, None, False), (False, 128, 32768, 4, False, None, False),
    (False, 128, 1024, 4, True, 4, False),
    # paged: every pair count under the SMs, two per SM where the splits would be short
    (True, 2, 32768, 6, True, 3, True), (True, 32, 32768, 6, True, 4, True),
    (True, 8, 32768, 4, True, 4, True), (True, 128, 1024, 4, True, 4, False),
    (True, 128, 16384, 4, True, 4, True), (True, 2, 16384, 6, True, 3, True),
])
def test_transposed_16bit_rule(monkeypatch, paged, pairs, capacity, rows, wanted, stages, transposed):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    assert decode.gluon_wanted(paged, pairs, 132, capacity, rows=rows) == wanted
    if stages is not None:
        variant = decode._gluon_plan(pairs, 1, 128, torch.bfloat16, torch.device("cpu"), capacity, 0,
                                     16 if paged else 0, False, False, False, False, rows)[4]
        assert variant.rows_n == (next(n for n in (8, 16, 32) if rows <= n) if transposed else 0)
        assert variant.stages == stages


@pytest.mark.parametrize("paged,pairs,capacity,splits,stages,one_per_sm", [
    (True, 2, 16384, 66, 3, True),  # two per SM would split below 256 keys: one per SM, 3 stages
    (True, 2, 32768, 128, 3, False),  # 1-2 pairs: two per SM (capped at 128 splits)
    (False, 2, 131072, 128, 3, False),  # ... also where the splits are long
    (True, 8, 16384, 16, 4, True),  # 8 pairs: 16 one-per-SM splits of 1024 keys are long
    (True, 8, 8192, 33, 3, False),  # ... 512 keys are not: two per SM
])
def test_transposed_16bit_plans_for_few_pairs(monkeypatch, paged, pairs, capacity, splits, stages,
                                              one_per_sm):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    got, _, _, merge, variant = decode._gluon_plan(pairs, 1, 128, torch.bfloat16, torch.device("cpu"),
                                                   capacity, 0, 16 if paged else 0, False, False,
                                                   False, False, 6)
    assert variant.rows_n == 8 and (got, variant.stages) == (splits, stages) and merge is not None
    # the merge lets the next kernel launch as it starts after plans of one CTA per SM only
    assert merge["LAUNCH_DEPENDENTS"] == one_per_sm


def test_merge_launches_dependents_after_16bit_one_per_sm_plans_only(monkeypatch):
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)

    def merge(batch, heads_k, capacity, fp8=False):
        return decode._gluon_plan(batch, heads_k, 128, torch.bfloat16, torch.device("cpu"), capacity, 0, 0,
                                  False, False, False, fp8, 4)[3]
    assert merge(1, 8, 32768)["LAUNCH_DEPENDENTS"]  # B1 32/8: 16 splits, one CTA per SM
    assert merge(16, 2, 65536)["LAUNCH_DEPENDENTS"]  # 32 pairs, 4 splits, one per SM
    assert not merge(1, 2, 131072)["LAUNCH_DEPENDENTS"]  # 1-2 pairs: two per SM
    assert not merge(1, 8, 32768, fp8=True)["LAUNCH_DEPENDENTS"]  # e4m3: three or four per SM
    assert not merge(16, 8, 65536, fp8=True)["LAUNCH_DEPENDENTS"]


def test_the_gluon_route_launches_the_plans_merge(monkeypatch):
    """run_decode hands the Gluon kernel the merge options its plan made (the early launch of the next
    kernel, the sinks) rather than a merge of its own: before, the plan's were dropped."""
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    splits, _, _, merge, variant = decode._gluon_plan(1, 8, 128, torch.bfloat16, torch.device("cpu"), 32768, 0,
                                                      0, False, False, False, False, 4, sinks=True)
    assert merge["LAUNCH_DEPENDENTS"] and merge["SINKS"]
    seen = {}

    def fake_gluon_decode(q, k_cache, v_cache, cache_seqlens, **kwargs):
        seen.update(kwargs)
        return q, None

    monkeypatch.setattr(gluon_decode, "gluon_decode", fake_gluon_decode)
    prepared = decode.PreparedDecode(splits, False, None, merge, (), (1, 1, 32, 128), (1, 32, 1), (splits, 1, 8),
                                     torch.bfloat16, torch.device("cpu"), (variant, 0.1, False))
    sinks = torch.zeros(32)
    q = torch.zeros(1, 1, 32, 128)
    decode.run_decode(prepared, q, q, q, torch.ones(1, dtype=torch.int32), sinks=sinks)
    assert seen["combine_options"] is merge and seen["sinks"] is sinks and seen["splits"] == splits
