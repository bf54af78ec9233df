"""Chunked prefill against a KV cache: flash_attn_with_kvcache with many query positions (Sq up to
thousands, causal bottom-right), checked against float64 attention and timed against the prefill
forward (flash_attn_func) on the same keys.

    PYTHONPATH=src python benchmarks/chunked_prefill.py --out $OUT [--points 'B,H,Hk,ctx,Sq;...']
        [--configs 'block_n,warps,stages[,waves[,pdl[,min split keys]]];...'] [--check-only]
        [--small] [--pages 'p,...'] [--only 'provider,...']

Each point: a contiguous bf16 cache of ``ctx`` keys per sequence (all filled, the chunk's own keys
included, as after the append), q (B, Sq, H, 128). The check covers the first KV head's query heads
of the first and last sequence (the accuracy rule: 2x textbook attention in bf16). Timing:
triton.testing.do_bench median of one call replayed from a CUDA graph (graph_time), TFLOP/s as
FlashAttention-2 counts a causal forward. ``--configs``: the Triton decode kernel forced to these plans too; "decode-kernel" is the call with the Gluon prefill route
turned off (decode.PREFILL_MIN_QUERIES raised), i.e. the decode kernel's default plan,
"route-forced" the call with the route taken whatever the query and work-tile counts, "paged-256"
and "paged-16" the same cache as shuffled pools of 256- and 16-key pages, "paged-16-ordered" the
cache itself read as a pool of 16-key pages in order (the same bytes as the contiguous call, through
the paged boxes), "paged-16-decode-kernel" the shuffled 16-key pool with the route turned off;
``--pages`` picks the pools (default 256,16): "paged-P" for each, and for sizes no TMA box fits
(no multiple of 16, read through a contiguous copy where the queries pay for it:
decode.prefill_gathers) also "paged-P-decode-kernel" (the route off) and "paged-P-gather-forced"
(the copy whatever the query rows); "sdpa-flash"/"sdpa-cudnn" SDPA's backends on the same tensors
(bottom-right causal mask, enable_gqa) as anchors. ``--only`` times these providers alone.

First, correctness of the route (``check_route``, every case against float64 attention per
sequence within the accuracy rule): caches longer than the sequences with NaN in every slot past
them (whatever a cache holds there must not reach the output), sequences of different lengths
in one batch (0 included), appended k/v, causal and full, GQA/MQA, head dims 64/128/256, fp16,
Sq not a multiple of 128, rotary (against the decode kernel's result, the same rotation), the
LSE, a CUDA graph replayed as the lengths change, and that the slots past the lengths stay
untouched. ``--check-only --small`` (the sanitizer's run) does the checks on small shapes only.
Writes chunked-prefill.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

import flashtile
from flashtile import reference
from flashtile.bench.decode import build_replay
from flashtile.kernels import decode as dec
from flashtile.kernels import forward as fwd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import forced  # noqa: E402
from spec_decode_ab import config_name, triton_config  # noqa: E402

POINTS = ("1,32,8,8192,64;1,32,8,8192,128;2,32,8,8192,128;1,32,8,8192,256;1,32,8,8192,384;"
          "1,32,8,8192,512;1,12,2,8192,128;1,32,8,32768,512;8,32,8,2048,128;1,32,8,8192,2048;"
          "4,12,2,4096,512;2,32,8,16384,1024")


def causal_flops(batch, heads, seqlen_q, seqlen_k, head_dim):
    """4 * d per visible (query, key) pair, bottom-right causal."""
    visible = sum(min(seqlen_k, seqlen_k - seqlen_q + i + 1) for i in range(seqlen_q))
    return 4.0 * batch * heads * head_dim * visible


def point_tensors(text: str, device, head_dim: int = 128, causal: bool = True):
    """A point 'B,H,Hk,ctx,Sq': q (B, Sq, H, D), a full bf16 cache k, v (B, ctx, Hk, D), the (B,)
    lengths (ctx each) and the FLOPs (FlashAttention-2's count, bottom-right causal or full)."""
    batch, heads, heads_k, ctx, seqlen_q = (int(x) for x in text.split(","))
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, ctx, heads_k, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch, ctx, heads_k, head_dim, device=device, dtype=torch.bfloat16)
    lengths = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    flops = (causal_flops(batch, heads, seqlen_q, ctx, head_dim) if causal
             else 4.0 * batch * heads * head_dim * seqlen_q * ctx)
    return q, k, v, lengths, flops


def graph_time(fn) -> float:
    """Median ms of one call replayed from a CUDA graph (the calls here are 50-1000 us of GPU
    time, near the host's own cost of a call: timed eagerly, the host's time shows through)."""
    replay = build_replay(lambda layer: fn(), 1, torch.device("cuda"))
    return triton.testing.do_bench(replay, warmup=25, rep=200)


def sdpa_call(q, k, v, causal: bool, backend: str):
    """SDPA pinned to ``backend`` ("FLASH_ATTENTION", "CUDNN_ATTENTION") on (B, S, H, D) tensors
    viewed as (B, H, S, D), GQA by enable_gqa, causal aligned bottom-right (``causal_lower_right``,
    flash_attn's convention; SDPA's is_causal is top-left). A refused call raises."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from flashtile.bench.prefill import backend_context
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))
    mask = causal_lower_right(q.shape[1], k.shape[1]) if causal else None
    gqa = q.shape[2] != k.shape[2]

    def call():
        with backend_context(backend):
            return F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)
    return call


def check(out, q, k, v, causal: bool = True):
    worst = 0.0
    group = q.shape[2] // k.shape[2]
    for b in sorted({0, q.shape[0] - 1}):
        qb, kb, vb = q[b:b + 1, :, :group], k[b:b + 1, :, :1], v[b:b + 1, :, :1]
        ref, _ = reference.attention(qb.double(), kb.double(), vb.double(), causal=causal)
        low, _ = reference.attention(qb, kb, vb, causal=causal)
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        got = out[b:b + 1, :, :group].double()
        err = (got - ref).abs().max().item() if torch.isfinite(got).all() else math.inf
        worst = max(worst, err / budget)
    return worst


# (batch, heads, heads_k, head_dim, capacity, lengths before the chunk, Sq, causal, dtype, append)
CHECKS = (
    (4, 32, 8, 128, 5000, (1000, 0, 2047, 3333), 300, True, "bf16", True),
    (2, 12, 2, 128, 4096, (100, 1500), 128, False, "bf16", False),
    (3, 8, 8, 64, 3000, (17, 999, 2500), 200, True, "bf16", True),
    (3, 8, 8, 64, 3000, (17, 999, 2500), 200, False, "bf16", True),
    (2, 16, 2, 256, 4000, (0, 1234), 257, True, "bf16", True),
    (2, 16, 2, 256, 3000, (5, 2000), 130, False, "bf16", False),
    (2, 16, 2, 256, 9000, (5, 7000), 130, False, "bf16", True),
    (2, 32, 8, 128, 2048, (64, 640), 129, True, "fp16", True),
    (1, 16, 1, 128, 9000, (8000,), 512, True, "bf16", True),
    (1, 4, 4, 128, 1024, (0,), 128, False, "bf16", False),
)
SMALL_CHECKS = (
    (2, 4, 2, 128, 700, (100, 0), 130, True, "bf16", True),
    (2, 4, 2, 64, 500, (3, 250), 128, False, "bf16", False),
    (2, 4, 1, 256, 600, (0, 300), 129, True, "bf16", True),
)


# (batch, heads, heads_k, head_dim, pages a sequence, page size, lengths, Sq, causal, dtype, append,
#  routed): page pools in shuffled order, NaN in every slot no sequence owns
PAGED_CHECKS = (
    (3, 16, 4, 128, 20, 128, (1000, 0, 2100), 300, True, "bf16", True, True),
    (2, 16, 2, 128, 8, 256, (100, 1700), 200, False, "bf16", True, True),
    (2, 16, 2, 256, 30, 64, (5, 1500), 150, True, "bf16", True, True),
    (2, 8, 8, 64, 10, 128, (17, 999), 130, True, "fp16", True, True),
    (2, 16, 4, 128, 100, 16, (100, 1000), 200, True, "bf16", True, True),  # boxes of 16 keys
    (2, 16, 4, 128, 40, 48, (100, 1000), 200, False, "bf16", True, True),  # boxes straddle no page
    (2, 16, 2, 256, 60, 32, (0, 1500), 129, True, "fp16", True, True),
    (2, 8, 8, 64, 120, 16, (999, 17), 300, True, "bf16", False, True),
    (2, 16, 4, 128, 40, 64, (100, 1800), 200, True, "bf16", True, True),  # boxes of 64 keys
    (2, 16, 4, 128, 60, 32, (1, 1500), 150, False, "bf16", True, True),  # boxes of 32 keys
    (2, 8, 8, 64, 12, 192, (500, 2000), 130, True, "fp16", True, True),  # 64-key boxes, 1.5-tile pages
    (2, 8, 2, 64, 30, 96, (17, 2700), 256, False, "bf16", False, True),  # 32-key boxes
    (2, 16, 4, 128, 200, 8, (100, 1000), 256, True, "bf16", True, True),  # gathered (8-key pages)
    (2, 16, 4, 128, 200, 8, (100, 1000), 255, True, "bf16", True, False),  # 1020 rows: the decode kernel
    (2, 16, 4, 128, 1300, 1, (100, 1000), 256, True, "bf16", True, True),  # gathered (1-key pages)
    (3, 8, 2, 64, 450, 3, (0, 1000, 17), 256, False, "fp16", True, True),  # gathered (3-key pages)
    (2, 16, 2, 256, 300, 5, (640, 1300), 130, True, "bf16", False, True),  # gathered (5-key pages)
    (1, 8, 8, 128, 16000, 1, (15000,), 128, True, "bf16", True, False),  # the decode kernel (no reuse)
)
SMALL_PAGED_CHECKS = (
    (2, 4, 2, 128, 6, 128, (100, 0), 130, True, "bf16", True, True),
    (2, 4, 2, 128, 30, 16, (100, 250), 130, True, "bf16", True, True),
    (2, 4, 1, 256, 6, 64, (3, 200), 128, False, "bf16", False, True),
    (2, 4, 2, 128, 12, 64, (100, 250), 130, True, "bf16", True, True),
    (2, 4, 2, 64, 20, 32, (3, 400), 128, False, "bf16", True, True),
    (2, 8, 1, 128, 400, 1, (100, 250), 130, True, "bf16", True, True),  # gathered (1040 rows)
)


def page_pools(k_cache, v_cache, page, spare=3):
    """k_cache/v_cache (B, pages * page, Hk, D) as shuffled page pools with ``spare`` unowned pages
    of NaN, and the block table (B, pages) int32."""
    batch, cap, heads_k, d = k_cache.shape
    pages = cap // page
    order = torch.randperm(batch * pages + spare, device=k_cache.device)
    table = order[:batch * pages].view(batch, pages).to(torch.int32)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.full((batch * pages + spare, page, heads_k, d), math.nan, dtype=cache.dtype,
                          device=cache.device)
        pool[table.flatten().long()] = cache.reshape(batch * pages, page, heads_k, d)
        pools.append(pool)
    return pools[0], pools[1], table


def gathered(pool, table):
    """The page pool read back in each sequence's order: (B, pages * page, Hk, D)."""
    batch, pages = table.shape
    return pool[table.flatten().long()].view(batch, pages * pool.shape[1], *pool.shape[2:])


def _reference_check(out, lse, q, k_cache, v_cache, lengths, causal):
    """Worst error / budget over the sequences (float64 attention on each one's own keys)."""
    worst = 0.0
    for b in range(q.shape[0]):
        n = int(lengths[b])
        qb, kb, vb = q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        if n == 0:  # no key: output 0, LSE +inf
            ok = bool((out[b] == 0).all()) and bool(torch.isinf(lse[b]).all())
            worst = max(worst, 0.0 if ok else math.inf)
            continue
        ref, ref_lse = reference.attention(qb.double(), kb.double(), vb.double(), causal=causal)
        low, _ = reference.attention(qb, kb, vb, causal=causal)
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        got = out[b:b + 1].double()
        err = (got - ref).abs().max().item() if torch.isfinite(got).all() else math.inf
        lse_err = (lse[b:b + 1].double() - ref_lse).abs().max().item()
        worst = max(worst, err / budget, lse_err / 1e-3)
    return worst


def check_route(device, small: bool) -> list:
    """The chunked-prefill route against float64 attention (see the module docstring), taken
    whatever the work-tile count (small cases would go to the decode kernel otherwise)."""
    saved, dec.PREFILL_MIN_TILES_PER_SM = dec.PREFILL_MIN_TILES_PER_SM, 0.0
    try:
        return _check_route(device, small)
    finally:
        dec.PREFILL_MIN_TILES_PER_SM = saved


def _check_route(device, small: bool) -> list:
    records = []
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for case in (SMALL_CHECKS if small else CHECKS):
        batch, heads, heads_k, d, cap, lens, seqlen_q, causal, dt, append = case
        dtype = dtypes[dt]
        q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype)
        k_cache = torch.full((batch, cap, heads_k, d), math.nan, device=device, dtype=dtype)
        v_cache = torch.full_like(k_cache, math.nan)
        for b, n in enumerate(lens):
            k_cache[b, :n] = torch.randn(n, heads_k, d, device=device, dtype=dtype)
            v_cache[b, :n] = torch.randn(n, heads_k, d, device=device, dtype=dtype)
        lengths = torch.tensor(lens, dtype=torch.int32, device=device)
        k_new = torch.randn(batch, seqlen_q, heads_k, d, device=device, dtype=dtype) if append else None
        v_new = torch.randn_like(k_new) if append else None
        after = lengths + seqlen_q if append else lengths
        plan = dec.describe_plan(q, k_cache, v_cache, causal=causal)["kernel"]
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                     cache_seqlens=lengths, causal=causal,
                                                     return_softmax_lse=True)
        torch.cuda.synchronize()
        slack_nan = all(bool(torch.isnan(k_cache[b, n:]).all() and torch.isnan(v_cache[b, n:]).all())
                        for b, n in enumerate(after.tolist()))
        worst = _reference_check(out, lse, q, k_cache, v_cache, after.tolist(), causal)
        record = {"case": list(case), "route": plan, "err_over_budget": worst, "slack_untouched": slack_nan}
        records.append(record)
        print(f"check {case}: route {plan}, error/budget {worst:.3f}, slack untouched {slack_nan}",
              flush=True)

    # cache_batch_idx: sequences on shuffled rows of a larger cache (NaN in the rows nobody reads)
    for batch, heads, heads_k, d, cap, lens, seqlen_q, causal in (
            ((3, 16, 4, 128, 2048, (100, 0, 1500), 200, True),) if not small
            else ((2, 4, 2, 128, 640, (100, 3), 130, True),)):
        q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=torch.bfloat16)
        k_cache = torch.full((batch + 2, cap, heads_k, d), math.nan, device=device, dtype=torch.bfloat16)
        v_cache = torch.full_like(k_cache, math.nan)
        rows = torch.randperm(batch + 2, device=device)[:batch].to(torch.int32)
        for b, n in enumerate(lens):
            k_cache[rows[b], :n] = torch.randn(n, heads_k, d, device=device, dtype=torch.bfloat16)
            v_cache[rows[b], :n] = torch.randn(n, heads_k, d, device=device, dtype=torch.bfloat16)
        lengths = torch.tensor(lens, dtype=torch.int32, device=device)
        k_new = torch.randn(batch, seqlen_q, heads_k, d, device=device, dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        routed = dec.prefill_wanted(q, k_cache, v_cache, causal=causal, window_left=-1,
                                    window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None,
                                    block_table=None, cache_batch_idx=rows, cache_leftpad=None,
                                    num_splits=0, config=None)
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                     cache_batch_idx=rows, causal=causal,
                                                     return_softmax_lse=True)
        torch.cuda.synchronize()
        after = (lengths + seqlen_q).tolist()
        k_seq, v_seq = k_cache[rows.long()], v_cache[rows.long()]
        unused = torch.ones(batch + 2, dtype=torch.bool, device=device)
        unused[rows.long()] = False
        slack_nan = (all(bool(torch.isnan(k_seq[b, n:]).all() and torch.isnan(v_seq[b, n:]).all())
                         for b, n in enumerate(after))
                     and bool(torch.isnan(k_cache[unused]).all() and torch.isnan(v_cache[unused]).all()))
        worst = _reference_check(out, lse, q, k_seq, v_seq, after, causal)
        case = (batch, heads, heads_k, d, cap, lens, seqlen_q, causal, "cache_batch_idx")
        records.append({"case": list(case), "route": "gluon-prefill" if routed else "decode kernel",
                        "err_over_budget": worst, "slack_untouched": slack_nan, "ok": routed})
        print(f"check {case}: routed {routed}, error/budget {worst:.3f}, slack untouched {slack_nan}",
              flush=True)

    for case in (SMALL_PAGED_CHECKS if small else PAGED_CHECKS):
        batch, heads, heads_k, d, pages, page, lens, seqlen_q, causal, dt, append, routed = case
        dtype = dtypes[dt]
        q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype)
        k_cache = torch.full((batch, pages * page, heads_k, d), math.nan, device=device, dtype=dtype)
        v_cache = torch.full_like(k_cache, math.nan)
        for b, n in enumerate(lens):
            k_cache[b, :n] = torch.randn(n, heads_k, d, device=device, dtype=dtype)
            v_cache[b, :n] = torch.randn(n, heads_k, d, device=device, dtype=dtype)
        k_pool, v_pool, table = page_pools(k_cache, v_cache, page)
        lengths = torch.tensor(lens, dtype=torch.int32, device=device)
        k_new = torch.randn(batch, seqlen_q, heads_k, d, device=device, dtype=dtype) if append else None
        v_new = torch.randn_like(k_new) if append else None
        after = lengths + seqlen_q if append else lengths
        described = dec.describe_plan(q, k_pool, v_pool, block_table=table, causal=causal)
        plan = described["kernel"] + ("-gathered" if described["gathered"] else "")
        out, lse = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths,
                                                     block_table=table, causal=causal,
                                                     return_softmax_lse=True)
        torch.cuda.synchronize()
        k_seq, v_seq = gathered(k_pool, table), gathered(v_pool, table)
        owned = torch.zeros(k_pool.shape[0], dtype=torch.bool, device=device)
        owned[table.flatten().long()] = True
        slack_nan = (all(bool(torch.isnan(k_seq[b, n:]).all() and torch.isnan(v_seq[b, n:]).all())
                         for b, n in enumerate(after.tolist()))
                     and bool(torch.isnan(k_pool[~owned]).all() and torch.isnan(v_pool[~owned]).all()))
        worst = _reference_check(out, lse, q, k_seq, v_seq, after.tolist(), causal)
        route_ok = plan.startswith("gluon-prefill") == routed and described["gathered"] == (routed and page % 16 != 0)
        records.append({"case": list(case), "paged": True, "route": plan, "err_over_budget": worst,
                        "slack_untouched": slack_nan, "ok": route_ok})
        print(f"check paged {case}: route {plan}, error/budget {worst:.3f}, slack untouched {slack_nan}",
              flush=True)

    # Rotary (rotated by the append kernel either way): the route against the decode kernel.
    batch, heads, heads_k, d, cap, seqlen_q = (2, 32, 8, 128, 3000, 256) if not small else (1, 4, 2, 128, 600, 128)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=torch.bfloat16)
    k0 = torch.randn(batch, cap, heads_k, d, device=device, dtype=torch.bfloat16)
    v0 = torch.randn_like(k0)
    kn, vn = torch.randn(2, batch, seqlen_q, heads_k, d, device=device, dtype=torch.bfloat16)
    lengths = torch.tensor([300, 1200][:batch], dtype=torch.int32, device=device)
    angle = torch.rand(cap, d // 2, device=device) * 6.28
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    results = []
    for min_queries in (dec.PREFILL_MIN_QUERIES, 1 << 30):
        saved, dec.PREFILL_MIN_QUERIES = dec.PREFILL_MIN_QUERIES, min_queries
        try:
            kc, vc = k0.clone(), v0.clone()
            results.append(flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos,
                                                             rotary_sin=sin, cache_seqlens=lengths,
                                                             causal=True))
        finally:
            dec.PREFILL_MIN_QUERIES = saved
    diff = (results[0].double() - results[1].double()).abs().max().item()
    scale = results[1].double().abs().max().item()
    rec = {"case": "rotary, route vs decode kernel", "max_abs_diff": diff, "out_abs_max": scale,
           "ok": diff <= 2e-2 * max(scale, 1.0)}
    records.append(rec)
    print(f"check rotary: route vs decode kernel max |diff| {diff:.2e} (|out| <= {scale:.2f})", flush=True)

    # CUDA graph: one capture, replayed as the lengths grow (no append: the cache is fixed).
    batch, heads, heads_k, d, cap, seqlen_q = (2, 16, 4, 128, 4096, 256) if not small else (1, 4, 2, 128, 700, 128)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=torch.bfloat16)
    kc = torch.randn(batch, cap, heads_k, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lengths = torch.full((batch,), seqlen_q, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True)
    same = []
    for n in (seqlen_q, seqlen_q + 1, cap // 2 + 3, cap):
        lengths.fill_(n)
        graph.replay()
        eager = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True)
        torch.cuda.synchronize()
        same.append(bool(torch.equal(graphed, eager)))
    records.append({"case": "CUDA graph replay as the lengths grow", "bitwise_equal": same})
    print(f"check CUDA graph replay: bitwise equal to eager at 4 lengths: {same}", flush=True)
    return records


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--configs", default="")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--pages", default="256,16", help="page sizes of the paged providers")
    parser.add_argument("--no-check", action="store_true", help="time only (the route checks ran before)")
    parser.add_argument("--only", default="", help="comma-separated providers to time (kvcache always)")
    args = parser.parse_args()
    pages = [int(x) for x in args.pages.split(",") if x]
    only = {x for x in args.only.split(",") if x}
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    device = torch.device("cuda")
    torch.manual_seed(1)
    checks = check_route(device, args.small) if not args.no_check else []
    failed = [c for c in checks if c.get("err_over_budget", 0) > 1 or c.get("slack_untouched") is False
              or c.get("ok") is False or (c.get("bitwise_equal") and not all(c["bitwise_equal"]))]
    print(f"route checks: {len(checks) - len(failed)} of {len(checks)} passed", flush=True)
    if args.check_only:
        with open(os.path.join(args.out, "chunked-prefill-check.json"), "w") as f:
            json.dump({"checks": checks}, f, indent=1)
        sys.exit(1 if failed else 0)
    records = []
    print(f"{'point':28s} {'kvcache us':>11s} {'TFLOP/s':>8s} {'check':>6s} {'prefill us':>11s} "
          f"{'TFLOP/s':>8s} {'kvcache/prefill':>15s}", flush=True)
    for text in args.points.split(";"):
        batch, heads, heads_k, ctx, seqlen_q = (int(x) for x in text.split(","))
        q, k, v, lengths, flops = point_tensors(text, device)
        record = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": ctx, "seqlen_q": seqlen_q,
                  "flops": flops}

        def kvcache():
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)

        def prefill():
            return flashtile.flash_attn_func(q, k, v, causal=True)

        def kvcache_decode():
            saved, dec.PREFILL_MIN_QUERIES = dec.PREFILL_MIN_QUERIES, 1 << 30
            try:
                return kvcache()
            finally:
                dec.PREFILL_MIN_QUERIES = saved
        def kvcache_route():
            saved = dec.PREFILL_MIN_QUERIES, dec.PREFILL_MIN_TILES_PER_SM
            dec.PREFILL_MIN_QUERIES, dec.PREFILL_MIN_TILES_PER_SM = 1, 0.0
            try:
                return kvcache()
            finally:
                dec.PREFILL_MIN_QUERIES, dec.PREFILL_MIN_TILES_PER_SM = saved
        pools = {page: page_pools(k, v, page, spare=0) for page in pages}
        if 16 in pages:
            pools["16-ordered"] = (k.view(-1, 16, heads_k, 128), v.view(-1, 16, heads_k, 128),
                                   torch.arange(batch * ctx // 16, device=device, dtype=torch.int32
                                                ).view(batch, -1))

        def paged(page, min_queries=None, gather_rows=None):
            """The paged call, with decode.PREFILL_MIN_QUERIES / forward.GATHER_MIN_ROWS overridden
            while it runs (and is captured)."""
            k_pool, v_pool, table = pools[page]

            def call():
                saved = dec.PREFILL_MIN_QUERIES, fwd.GATHER_MIN_ROWS
                if min_queries is not None:
                    dec.PREFILL_MIN_QUERIES = min_queries
                if gather_rows is not None:
                    fwd.GATHER_MIN_ROWS = gather_rows
                try:
                    return flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                             block_table=table, causal=True)
                finally:
                    dec.PREFILL_MIN_QUERIES, fwd.GATHER_MIN_ROWS = saved
            return call
        record["route"] = dec.describe_plan(q, k, v, causal=True)["kernel"]
        for page, (k_pool, v_pool, table) in pools.items():
            described = dec.describe_plan(q, k_pool, v_pool, block_table=table, causal=True)
            record[f"route_paged-{page}"] = described["kernel"] + ("-gathered" if described["gathered"] else "")
        providers = [("kvcache", kvcache), ("prefill", prefill), ("decode-kernel", kvcache_decode),
                     ("route-forced", kvcache_route)]
        for page in pools:
            providers.append((f"paged-{page}", paged(page)))
            if page == 16 or (isinstance(page, int) and page % 16):
                providers.append((f"paged-{page}-decode-kernel", paged(page, min_queries=1 << 30)))
            if isinstance(page, int) and page % 16:
                providers.append((f"paged-{page}-gather-forced", paged(page, gather_rows=0)))
        providers += [("sdpa-flash", sdpa_call(q, k, v, True, "FLASH_ATTENTION")),
                      ("sdpa-cudnn", sdpa_call(q, k, v, True, "CUDNN_ATTENTION"))]
        if only:
            providers = [(name, fn) for name, fn in providers if name in only or name == "kvcache"]
        providers += [(f"kvcache {config_name(c)}", forced(lambda layer: kvcache(), False,
                                                           decode_config=triton_config(*c)))
                      for c in configs]
        for name, fn in providers:
            if name.startswith("kvcache "):
                fn = (lambda f: lambda: f(0))(fn)
            try:
                out = fn()
                torch.cuda.synchronize()
                record[f"{name}_check"] = check(out, q, k, v)
                ms = graph_time(fn)
                record[f"{name}_us"] = ms * 1e3
                record[f"{name}_tflops"] = flops / ms / 1e9
            except Exception as exc:  # a failing call is a result here
                record[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                torch.cuda.synchronize()
        records.append(record)

        def cell(name):
            if f"{name}_us" not in record:
                return f"{'-':>11s} {'':>8s}"
            if f"{name}_error" in record:
                return f"{'error':>11s} {'':>8s}"
            return f"{record[name + '_us']:11.1f} {record[name + '_tflops']:8.1f}"
        ratio = (record["prefill_us"] / record["kvcache_us"]
                 if "kvcache_us" in record and "prefill_us" in record else float("nan"))
        print(f"B{batch} {heads}/{heads_k} ctx{ctx} Sq{seqlen_q:<6d} {cell('kvcache')} "
              f"{record.get('kvcache_check', math.nan):6.3f} {cell('prefill')} {ratio:15.3f}", flush=True)
        for name, _ in providers:
            if name in ("kvcache", "prefill"):
                continue
            if not name.startswith("kvcache ") and f"{name}_us" in record:
                route = record.get(f"route_{name}", record["route"])
                print(f"  (route {route}) {name} {record[name + '_us']:9.1f} us "
                      f"{record[name + '_tflops']:6.1f} TFLOP/s check {record[name + '_check']:.3f}",
                      flush=True)
                continue
            if f"{name}_us" in record:
                print(f"  {name:40s} {record[name + '_us']:9.1f} us {record[name + '_tflops']:6.1f} TFLOP/s "
                      f"check {record[name + '_check']:.3f}", flush=True)
        for name, _ in providers:
            if f"{name}_error" in record:
                print(f"  {name}: {record[name + '_error']}", flush=True)
        q = k = v = out = pools = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "chunked-prefill.json"), "w") as f:
        json.dump({"checks": checks, "points": records}, f, indent=1)


if __name__ == "__main__":
    main()
