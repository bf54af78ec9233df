"""Decode with the key tile split among the warps, each warp its own online softmax (no cross-warp
reduction inside the loop), merged once at the end: a standalone Triton kernel for unsplit,
contiguous 16-bit calls (one program per (sequence, KV head), Sq = 1), timed against the shipped
plan, SDPA flash and cuDNN in balanced rounds.

Why: the shipped unsplit Triton plan (64-key tiles, 4 warps, one CTA per SM at 128 pairs) runs
~350 instructions and 10 barriers per warp per tile, one warp per SM sub-partition: its loop is
latency-bound near the tile's memory time, and its rounds slow by up to 40% when the GPU lowers its
clock under the power cap (bench decode -d, B16 32/8). Here the tile's keys are [WARPS, SUB]: a
3-D dot puts each warp on its own SUB keys, so the row max and sum stay inside a warp.

    PYTHONPATH=src python benchmarks/warp_split_probe.py --out $OUT [--points 'B,H,Hk,ctx;...']
        [--configs 'sub,warps,stages[,pdl[,interleave]];...'] [--rounds 10]

Writes warp-split-probe.json under --out.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.bench import decode as bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

POINTS = "16,32,8,131072;16,32,8,32768;16,32,8,16384;64,12,2,32768"
CONFIGS = "16,4,4,1;16,4,4,1,1;16,4,3,1,1;32,4,3,1,1"
ANCHORS = ("sdpa-flash", "sdpa-cudnn")
LAYOUTS = False  # --layouts


@triton.jit
def _warp_split_decode(Q, K, V, Out, CacheSeqlens, heads_k, group_size, qk_scale,
                       stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_ob, stride_oh,
                       ROWS: tl.constexpr, SUB: tl.constexpr, WARPS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, PDL: tl.constexpr, INTERLEAVE: tl.constexpr):
    if PDL:  # launched before the previous kernel ends (as the shipped plan): wait before any read
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    batch = pid // heads_k
    kv_head = pid % heads_k
    seqlen = tl.load(CacheSeqlens + batch)
    w = tl.arange(0, WARPS)
    r = tl.arange(0, ROWS)
    j = tl.arange(0, SUB)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * group_size + r
    row_ok = r < group_size
    # every warp's copy of the query rows: [WARPS, ROWS, HEAD_DIM] (the same addresses)
    q = tl.load(Q + batch.to(tl.int64) * stride_qb + (head[None, :, None] + 0 * w[:, None, None]).to(tl.int64)
                * stride_qh + d[None, None, :], mask=row_ok[None, :, None], other=0.0)
    if INTERLEAVE:  # warp w takes keys w, w + WARPS, ...: a load instruction's rows are neighbours
        key = j[None, :] * WARPS + w[:, None]
    else:  # warp w takes keys [w SUB, (w + 1) SUB)
        key = w[:, None] * SUB + j[None, :]
    k_ptrs = (K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
              + key[:, :, None].to(tl.int64) * stride_ks + d[None, None, :])
    v_ptrs = (V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
              + key[:, :, None].to(tl.int64) * stride_vs + d[None, None, :])
    m_i = tl.full([WARPS, ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([WARPS, ROWS], dtype=tl.float32)
    acc = tl.zeros([WARPS, ROWS, HEAD_DIM], dtype=tl.float32)
    BLOCK: tl.constexpr = WARPS * SUB
    full_tiles = seqlen // BLOCK
    for _ in range(0, full_tiles):
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
        k_ptrs += BLOCK * stride_ks
        v_ptrs += BLOCK * stride_vs
        s = tl.dot(q, tl.trans(k, (0, 2, 1)))
        m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if full_tiles * BLOCK < seqlen:  # the last, partial tile, masked
        k0 = full_tiles * BLOCK
        ok = (k0 + key) < seqlen
        k = tl.load(k_ptrs, mask=ok[:, :, None], other=0.0)
        v = tl.load(v_ptrs, mask=ok[:, :, None], other=0.0)
        s = tl.dot(q, tl.trans(k, (0, 2, 1)))
        s = tl.where(ok[:, None, :], s * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, :, None])
        p = tl.where(ok[:, None, :], p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # the warps' states merged once
    m_all = tl.max(m_i, 0)
    share = tl.exp2(m_i - m_all[None, :])
    l_all = tl.sum(l_i * share, 0)
    out = tl.sum(acc * share[:, :, None], 0)
    l_safe = tl.where(l_all > 0.0, l_all, 1.0)
    out = out / l_safe[:, None]
    tl.store(Out + batch.to(tl.int64) * stride_ob + head[:, None].to(tl.int64) * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def warp_split_decode(q, k_cache, v_cache, cache_seqlens, sub=16, warps=4, stages=4, pdl=False, interleave=False,
                      out=None):
    """q (B, 1, H, D); caches (B, S, Hk, D) contiguous; cache_seqlens int32 (B,)."""
    batch, _, heads, head_dim = q.shape
    heads_k = k_cache.shape[2]
    group = heads // heads_k
    rows = max(16, triton.next_power_of_2(group))
    if out is None:
        out = torch.empty_like(q)
    _warp_split_decode[(batch * heads_k,)](
        q, k_cache, v_cache, out, cache_seqlens, heads_k, group, head_dim ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(2),
        ROWS=rows, SUB=sub, WARPS=warps, HEAD_DIM=head_dim, PDL=pdl, INTERLEAVE=interleave, num_warps=warps,
        num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    return out


def probe(point: bench.Point, device, ceiling: float, rounds: int, configs) -> dict:
    from decode_long_ab import report
    from spec_decode_ab import check
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, bench.DTYPE)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    layers = bench.layers_for(point)
    caches = bench.LayerCaches.allocate(point, layers, device)
    import flashtile
    from paged_gap import forced
    steps = {"plan": bench.make_step(bench.CONTIGUOUS, caches, q, lengths, {})}
    if LAYOUTS:  # the shipped call and its 2-D loop, on flash_attn's layout and on SDPA's memory

        def shipped(view):
            def call(layer):
                k, v = view(layer)
                return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)
            return call

        def hnd_as_nhd(layer):  # (B, S, Hk, D) views of (B, Hk, S, D) memory
            k, v = caches.hnd(layer)
            return k.transpose(1, 2), v.transpose(1, 2)
        steps["2-D loop"] = bench.Step(forced(shipped(caches.nhd), False, WARP_SPLIT=False))
        steps["plan, (B, Hk, S, D) memory"] = bench.Step(forced(shipped(hnd_as_nhd), False))
        steps["2-D loop, (B, Hk, S, D) memory"] = bench.Step(forced(shipped(hnd_as_nhd), False, WARP_SPLIT=False))
    for sub, warps, stages, *flags in configs:
        pdl, interleave = (bool(x) for x in (list(flags) + [0, 0])[:2])

        def call(layer, sub=sub, warps=warps, stages=stages, pdl=pdl, interleave=interleave):
            k, v = caches.nhd(layer)
            return warp_split_decode(q, k, v, lengths, sub, warps, stages, pdl, interleave)
        steps[f"warp-split sub{sub} w{warps} s{stages}{' pdl' if pdl else ''}{' il' if interleave else ''}"] = \
            bench.Step(call)
    # (each provider against the cache it reads: the (B, Hk, S, D) ones against that memory's views)
    hnd = {name: step for name, step in steps.items() if "(B, Hk, S, D)" in name}
    nhd = {name: step for name, step in steps.items() if name not in hnd}
    worst = check(nhd, q, *caches.nhd(0), point.lengths())
    if hnd:
        k0, v0 = caches.hnd(0)
        worst.update(check(hnd, q, k0.transpose(1, 2), v0.transpose(1, 2), point.lengths()))
    record = {"point": point.__dict__, "layers": layers, "check": worst}
    for name in ANCHORS:
        steps[name] = bench.make_step(name, caches, q, lengths, {})
    results = bench.measure_providers(list(steps), caches, q, lengths, {}, bench.gpu_timer,
                                      bench.point_bytes(point), ceiling, rounds=rounds, steps=steps)
    report(results, 30)
    record["results"] = results
    return record


def shipped_cases() -> None:
    """The shipped warp-split path (decode._warp_split_loop, forced at every cache length) on small
    cases against float64, for compute-sanitizer: lengths ending inside a tile and inside a warp's
    slice, a sequence of one key, GQA/MQA/MHA, 1-4 query rows causal and full."""
    import flashtile
    from flashtile import reference
    from flashtile.kernels import decode
    decode.WARP_SPLIT_MIN_KEYS = 0
    decode._PLANS.clear()
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for batch, heads, heads_k, sq, capacity, causal, dtype in (
            (4, 32, 8, 1, 300, True, torch.bfloat16), (3, 12, 2, 1, 200, True, torch.float16),
            (2, 8, 8, 2, 130, False, torch.bfloat16), (5, 16, 1, 4, 257, True, torch.bfloat16)):
        q = torch.randn(batch, sq, heads, 128, generator=gen).cuda().to(dtype)
        k = torch.randn(batch, capacity, heads_k, 128, generator=gen).cuda().to(dtype)
        v = torch.randn(batch, capacity, heads_k, 128, generator=gen).cuda().to(dtype)
        lengths = torch.randint(sq, capacity + 1, (batch,), generator=gen, dtype=torch.int32)
        lengths[0] = max(sq, 1)
        lengths[-1] = 70 if capacity >= 70 else capacity
        out, lse = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths.cuda(), causal=causal,
                                                     num_splits=1, return_softmax_lse=True)
        torch.cuda.synchronize()
        assert any(p[2]["WARPS"] for p in decode._PLANS.values() if p[2] is not None), "not the warp-split path"
        for b in range(batch):
            n = int(lengths[b])
            ref, ref_lse = reference.attention(q[b:b + 1].double(), k[b:b + 1, :n].double(),
                                               v[b:b + 1, :n].double(), causal=causal)
            low, _ = reference.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            err = (out[b:b + 1].double() - ref).abs().max().item()
            lse_err = (lse[b:b + 1].double() - ref_lse).abs().max().item()
            worst = max(worst, err / budget if torch.isfinite(out[b]).all() else math.inf)
            assert lse_err < 1e-3, lse_err
        print(f"B{batch} {heads}/{heads_k} Sq{sq} cap{capacity} {'causal' if causal else 'full'} {dtype}: "
              f"worst err/budget so far {worst:.3f}", flush=True)
    print("PASS" if worst <= 1 else "FAIL", f"warp-split shipped path, worst {worst:.3f} of the budget")


def main():
    from paged_gap import run_points
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--configs", default=CONFIGS, help="'sub,warps,stages[,pdl[,interleave]];...'")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layouts", action="store_true",
                        help="also the shipped call with its 2-D loop forced, each on (B, S, Hk, D) views of "
                             "(B, Hk, S, D) memory too")
    parser.add_argument("--shipped-cases", action="store_true",
                        help="only the shipped path's small cases against float64 (for compute-sanitizer)")
    args = parser.parse_args()
    if args.shipped_cases:
        shipped_cases()
        return
    global LAYOUTS
    LAYOUTS = args.layouts
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    run_points(args.points, lambda point, device, ceiling: probe(point, device, ceiling, args.rounds, configs),
               args.out, "warp-split-probe.json", rounds=args.rounds, configs=configs)


if __name__ == "__main__":
    main()
