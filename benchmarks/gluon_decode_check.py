"""The Gluon (TMA) decode kernel on the H200: correctness against float64 textbook attention, then
its time per layer against the portable decode kernel, both in CUDA graphs over L layers (>= 1 GiB of
K+V, as ``bench decode``).

    PYTHONPATH=src python benchmarks/gluon_decode_check.py --out $OUT [--quick]

Correctness: per case, the error of each kernel against the float64 reference must be at most twice
the error of the same textbook attention computed in bf16 (+1e-6); caches hold NaN past every
sequence's end and outputs start as NaN. Writes gluon-decode-check.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import torch

from decode_probe import time_layers  # this directory: run as a script
from flashtile import reference
from flashtile.bench.common import source_digest
from flashtile.bench.decode import (LayerCaches, Point, ceiling_rate, layers_for, measure_ceiling, paginate,
                                    shuffled_block_table)
from flashtile.kernels import decode as dec
from flashtile.kernels import gluon_decode as gd


def _gather(cache, table, b, length, page):
    if table is None:
        return cache[b, :length]
    pages = -(-length // page)
    return cache[table[b, :pages].long()].flatten(0, 1)[:length]


def check_case(batch, heads, heads_k, seqlen_q, lengths, page, splits, causal, batch_idx, pdl, device,
               head_dim=128, fp16=False, seed=0, heads_first=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    capacity = max(lengths) + 5
    dtype = torch.float16 if fp16 else torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g).to(device, dtype)
    if page:
        per_seq = -(-capacity // page)
        n_pages = batch * per_seq + 3
        k = torch.randn(n_pages, page, heads_k, head_dim, generator=g).to(device, dtype)
        v = torch.randn(n_pages, page, heads_k, head_dim, generator=g).to(device, dtype)
        table = torch.randperm(n_pages, generator=g)[:batch * per_seq].view(batch, per_seq)
        table = table.to(device=device, dtype=torch.int32)
        idx = None
        # NaN in every slot past each sequence's end.
        for b in range(batch):
            for j in range(per_seq):
                lo = j * page
                if lo + page > lengths[b]:
                    start = max(0, lengths[b] - lo)
                    k[table[b, j], start:] = float("nan")
                    v[table[b, j], start:] = float("nan")
    else:
        rows = batch + 2 if batch_idx else batch
        k = torch.randn(rows, capacity, heads_k, head_dim, generator=g).to(device, dtype)
        v = torch.randn(rows, capacity, heads_k, head_dim, generator=g).to(device, dtype)
        table = None
        idx = (torch.randperm(rows, generator=g)[:batch].to(device=device, dtype=torch.int32)
               if batch_idx else None)
        for b in range(batch):
            row = int(idx[b]) if idx is not None else b
            k[row, lengths[b]:] = float("nan")
            v[row, lengths[b]:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    page_rows = min(page, 64) if page else 0
    rows = heads // heads_k * seqlen_q
    rows_n = next((n for n in (8, 16, 32) if rows <= n), 0) if dec.GLUON_T16 else 0
    variant = gd.DecodeVariant(head_dim, "fp16" if fp16 else "bf16", 64, 2 if rows_n else 4, page > 0,
                               page_rows, causal and seqlen_q > 1, batch_idx, pdl, heads_first,
                               rows_n=rows_n)
    if splits == 0:  # the shipped plan, through decode.py's dispatch
        prepared = dec.prepare_decode(q, k, v, softmax_scale=head_dim ** -0.5,
                                      window_left=-1, window_right=0 if causal else -1,
                                      block_table=table, cache_batch_idx=idx)
        assert prepared.gluon is not None, "the shipped plan did not take the Gluon kernel"
        variant, splits = prepared.gluon[0], prepared.splits
    out, lse = gd.gluon_decode(q, k, v, seqlens, softmax_scale=scale, causal=causal, splits=splits,
                               block_table=table, cache_batch_idx=idx, variant=variant)
    torch.cuda.synchronize()
    worst, rows_out = 0.0, []
    for b in range(batch):
        row = int(idx[b]) if idx is not None else b
        kb = _gather(k, table, row if table is None else b, lengths[b], page)[None]
        vb = _gather(v, table, row if table is None else b, lengths[b], page)[None]
        ref, ref_lse = reference.attention(q[b:b + 1].double(), kb.double(), vb.double(),
                                           softmax_scale=scale, causal=causal)
        low, _ = reference.attention(q[b:b + 1], kb, vb, softmax_scale=scale, causal=causal)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        got = lse[b:b + 1].double()
        same = (got == ref_lse) | (got - ref_lse).abs().le(0)  # inf == inf where a row saw no key
        lse_err = torch.where(same, torch.zeros_like(got), (got - ref_lse).abs()).max().item()
        finite = bool(torch.isfinite(out[b]).all())
        worst = max(worst, err / budget if finite else math.inf)
        rows_out.append({"err": err, "budget": budget, "lse_err": lse_err, "finite": finite})
    ok = worst <= 1.0 and all(r["lse_err"] < 1e-3 for r in rows_out)
    return {"batch": batch, "heads": heads, "heads_k": heads_k, "seqlen_q": seqlen_q,
            "lengths": lengths, "page": page, "splits": splits, "stages": variant.stages,
            "rows_n": variant.rows_n, "causal": causal,
            "batch_idx": batch_idx, "pdl": pdl, "heads_first": heads_first, "head_dim": head_dim,
            "fp16": fp16, "worst_err_over_budget": worst, "ok": ok, "rows": rows_out}


CASES = [
    # batch, heads, heads_k, Sq, lengths, page, splits, causal, batch_idx, pdl
    (1, 32, 8, 1, [1000], 0, 1, False, False, False),
    (1, 32, 8, 1, [4097], 0, 7, False, False, True),
    (3, 12, 2, 1, [1, 300, 2049], 0, 4, False, False, False),
    (2, 8, 1, 1, [128, 129], 0, 2, False, False, False),
    (2, 32, 8, 4, [517, 1024], 0, 3, True, False, False),
    (2, 16, 4, 1, [777, 65], 0, 2, False, True, True),
    (2, 32, 8, 1, [3000, 1500], 16, 5, False, False, False),
    (2, 32, 8, 1, [3000, 1500], 8, 1, False, False, False),
    (2, 12, 2, 1, [2000, 33], 64, 3, False, False, False),
    (1, 32, 8, 1, [5000], 256, 4, False, False, False),
    (2, 32, 8, 2, [700, 1300], 128, 2, True, False, False),
    (3, 32, 8, 1, [0, 50, 9], 16, 2, False, False, True),
    (1, 32, 8, 1, [70000], 16, 16, False, False, False),
    (4, 32, 8, 1, [1, 64, 65, 20000], 32, 3, False, False, False),
    # splits over more than one window of page numbers with pages of one tile and of four
    (1, 32, 8, 1, [9000], 64, 2, False, False, True),
    (1, 12, 2, 1, [40000], 256, 1, False, False, True),
    (2, 16, 2, 1, [900, 2000], 16, 3, False, False, True, 64),
    (2, 32, 8, 3, [900, 2000], 16, 3, True, False, True, 128, True),
    (100, 16, 4, 1, [(i * 997) % 3000 + 1 for i in range(100)], 16, 0, False, False, True),
    (1, 32, 8, 1, [4000], 0, 0, False, False, True),
    (1, 12, 2, 2, [3000], 0, 0, True, True, True),
    (16, 32, 8, 1, [(i * 331) % 1000 + 1 for i in range(16)], 0, 0, False, False, True),
    # the plans for 1-8 pairs (decode._t16_plan): paged 2 pairs with short splits (one per SM, 3
    # stages), contiguous 8 pairs at 16k (one per SM, 4 stages), contiguous 2 pairs at 128k (two
    # per SM)
    (1, 12, 2, 1, [16000], 16, 0, False, False, True),
    (1, 32, 8, 1, [16384], 0, 0, False, False, True),
    (1, 12, 2, 1, [131072], 0, 0, False, False, True),
]


def check_fp8_case(batch, heads, heads_k, seqlen_q, lengths, splits, causal, batch_idx, device, seed=0,
                   head_dim=128, page=0):
    """An e4m3 cache with per-key descales (``page``: as page pools, descales too, in a shuffled
    order) through decode.py's planning with the Gluon kernel forced, against float64 attention of
    the dequantized cache."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    capacity = max(lengths) + 5
    rows = batch + 2 if batch_idx else batch
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g).to(device, torch.bfloat16)
    k = torch.randn(rows, capacity, heads_k, head_dim, generator=g).to(device) * 3
    v = torch.randn(rows, capacity, heads_k, head_dim, generator=g).to(device)
    k_ds = k.abs().amax(-1).clamp(min=1e-6) / 448
    v_ds = v.abs().amax(-1).clamp(min=1e-6) / 448
    k8 = (k / k_ds[..., None]).to(torch.float8_e4m3fn)
    v8 = (v / v_ds[..., None]).to(torch.float8_e4m3fn)
    idx = (torch.randperm(rows, generator=g)[:batch].to(device=device, dtype=torch.int32)
           if batch_idx else None)
    for b in range(batch):  # NaN bytes (0x7f) past each sequence's end
        row = int(idx[b]) if idx is not None else b
        k8.view(torch.uint8)[row, lengths[b]:] = 0x7F
        v8.view(torch.uint8)[row, lengths[b]:] = 0x7F
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    kc, vc, kdc, vdc, table = k8, v8, k_ds, v_ds, None
    if page:
        kc, vc, table = paginate(k8.view(torch.uint8), v8.view(torch.uint8), page,
                                 generator=torch.Generator().manual_seed(seed))
        kc, vc = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
        kdc, vdc, _ = paginate(k_ds[..., None], v_ds[..., None], page,
                               generator=torch.Generator().manual_seed(seed))
        kdc, vdc = kdc[..., 0].contiguous(), vdc[..., 0].contiguous()
    wanted = dec.gluon_wanted  # every case through the Gluon kernel, whatever dispatch would pick
    dec.gluon_wanted = lambda *a, **k: True
    try:
        prepared = dec.prepare_decode(q, kc, vc, softmax_scale=scale, window_left=-1,
                                      window_right=0 if causal else -1, cache_batch_idx=idx,
                                      block_table=table, num_splits=splits, k_descale=kdc)
    finally:
        dec.gluon_wanted = wanted
    if prepared.gluon is None:
        raise AssertionError("the e4m3 cache did not take the Gluon kernel")
    out, lse = dec.run_decode(prepared, q, kc, vc, seqlens, idx, None, table, None, kdc, vdc)
    torch.cuda.synchronize()
    kd = k8.float() * k_ds[..., None]
    vd = v8.float() * v_ds[..., None]
    worst, rows_out = 0.0, []
    for b in range(batch):
        row = int(idx[b]) if idx is not None else b
        kb, vb = kd[row:row + 1, :lengths[b]], vd[row:row + 1, :lengths[b]]
        ref, ref_lse = reference.attention(q[b:b + 1].double(), kb.double(), vb.double(),
                                           softmax_scale=scale, causal=causal)
        low, _ = reference.attention(q[b:b + 1], kb.bfloat16(), vb.bfloat16(), softmax_scale=scale,
                                     causal=causal)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        got = lse[b:b + 1].double()
        same = got == ref_lse
        lse_err = torch.where(same, torch.zeros_like(got), (got - ref_lse).abs()).max().item()
        finite = bool(torch.isfinite(out[b]).all())
        worst = max(worst, err / budget if finite else math.inf)
        rows_out.append({"err": err, "budget": budget, "lse_err": lse_err, "finite": finite})
    ok = worst <= 1.0 and all(r["lse_err"] < 2e-3 for r in rows_out)
    return {"fp8": True, "batch": batch, "heads": heads, "heads_k": heads_k, "seqlen_q": seqlen_q,
            "lengths": lengths, "splits": prepared.splits, "causal": causal, "batch_idx": batch_idx,
            "head_dim": head_dim, "page": page, "variant": prepared.gluon[0].name,
            "worst_err_over_budget": worst, "ok": ok, "rows": rows_out}


FP8_CASES = [
    # batch, heads, heads_k, Sq, lengths, splits (0: the plan's), causal, batch_idx
    (1, 32, 8, 1, [4097], 0, False, False),
    (3, 12, 2, 1, [1, 300, 2049], 0, False, False),
    (2, 32, 8, 4, [517, 1024], 3, True, False),
    (2, 16, 4, 1, [777, 65], 1, False, True),
    (16, 32, 8, 1, [(i * 331) % 5000 + 1 for i in range(16)], 0, False, False),
    (2, 8, 1, 1, [3000, 129], 0, False, False, 64),
    # 512 pairs: one wave of four programs per SM (V^T in registers), unsplit
    (64, 32, 8, 1, [(i * 797) % 6000 + 1 for i in range(63)] + [6000], 0, False, False),
    # 640 pairs of <= 1000 keys: two per SM, 4 stages, V widened into shared tiles
    (80, 32, 8, 1, [(i * 389) % 1000 + 1 for i in range(80)], 0, False, False),
    # 32 query rows a KV head (Sq 8 x group 4): two per SM, V widened into shared tiles, the
    # descales through the producer's ring
    (2, 32, 8, 8, [700, 1500], 0, True, False),
    # ... with the cache's rows picked by cache_batch_idx (32 rows: Sq 4 x group 8)
    (2, 16, 2, 4, [900, 2000], 0, True, True),
    # paged (page size last): pages smaller than, equal to and larger than a 64-key tile, four per
    # SM, 16 rows, head dim 64
    (3, 12, 2, 1, [1, 300, 2049], 0, False, False, 128, 16),
    (2, 32, 8, 4, [517, 1024], 3, True, False, 128, 8),
    (2, 8, 1, 1, [3000, 129], 0, False, False, 64, 64),
    (16, 32, 8, 1, [(i * 331) % 5000 + 1 for i in range(16)], 0, False, False, 128, 256),
    (64, 32, 8, 1, [(i * 797) % 6000 + 1 for i in range(63)] + [6000], 0, False, False, 128, 16),
    (1, 32, 8, 1, [40000], 0, False, False, 128, 32),
    # paged, 17-32 query rows a KV head (two per SM, V widened into shared tiles): speculative
    # steps of 8 and 3 positions, causal and not
    (2, 32, 8, 8, [700, 1500], 0, True, False, 128, 16),
    (3, 12, 2, 3, [1, 300, 2049], 0, True, False, 64, 8),
    (2, 16, 2, 4, [5000, 333], 0, False, False, 128, 64),
    (1, 32, 8, 5, [30000], 0, True, False, 128, 256),
]


def time_point(point, page, device, ceiling, variants):
    layers = layers_for(point)
    caches = LayerCaches.allocate(point, layers, device)
    nbytes = 2 * point.batch * point.context * point.heads_k * point.head_dim * 2
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, device=device, dtype=torch.bfloat16)
    lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device=device)
    table = shuffled_block_table(point.batch, point.context // page, device) if page else None
    scale = point.head_dim ** -0.5
    rows = []

    def run(label, call):
        us = time_layers(call, layers, device)
        gbps = nbytes / us / 1e3
        rows.append({"variant": label, "us_per_layer": us, "gbps": gbps, "pct": 100 * gbps / ceiling})
        print(f"  {point.batch:3d} {point.heads}/{point.heads_k} {point.context:6d} P{page:<3d} "
              f"{label:34s} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}%", flush=True)

    def triton_call(layer, caches=caches):
        k, v = caches.pools(layer, page) if page else caches.nhd(layer)
        return dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                    window_right=0, block_table=table, need_lse=False)[0]
    if page:  # the comparator of a paged point: the same bytes as a contiguous cache
        run("triton contiguous", lambda layer, caches=caches: dec.decode_attention(
            q, *caches.nhd(layer), lengths, softmax_scale=scale, window_left=-1, window_right=0,
            need_lse=False)[0])
    run("triton (shipped plan)", triton_call)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pairs = point.batch * point.heads_k
    for block_n, stages, per_sm, pdl, hf in variants:
        page_rows = min(page, block_n) if page else 0
        variant = gd.DecodeVariant(128, "bf16", block_n, stages, bool(page), page_rows, pdl=pdl,
                                   heads_first=hf)
        splits = max(1, min(128, per_sm * sms // pairs))

        def call(layer, variant=variant, splits=splits, caches=caches):
            k, v = caches.pools(layer, page) if page else caches.nhd(layer)
            return gd.gluon_decode(q, k, v, lengths, softmax_scale=scale, causal=False,
                                   splits=splits, block_table=table, need_lse=False,
                                   variant=variant)[0]
        run(f"gluon n{block_n} s{stages}{' pdl' if pdl else ''}{' hf' if hf else ''} splits {splits}",
            call)
    del caches
    torch.cuda.empty_cache()
    return {"point": point.__dict__, "page": page, "layers": layers, "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--fp8-only", action="store_true", help="check the e4m3-cache cases only")
    ap.add_argument("--rows-consumer", action="store_true",
                    help="16-bit cases through the 64-row consumer (decode.GLUON_T16 off)")
    ap.add_argument("--contiguous", action="store_true", help="time contiguous caches too")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--e4m3-plan", help="'stages,programs per SM,V in registers 0/1' for the e4m3 "
                    "cases (decode.GLUON_E4M3, GLUON_E4M3_FOUR, GLUON_E4M3_WIDE, E4M3_V_REGS)")
    ap.add_argument("--points", help="'B,H,Hk,context;...' (default: the seven below)")
    ap.add_argument("--variants", help="'block_n,stages,programs_per_sm,pdl,heads_first;...'")
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.rows_consumer:
        dec.GLUON_T16 = False
    if args.e4m3_plan:
        stages, per_sm, v_regs = (int(x) for x in args.e4m3_plan.split(","))
        for name in ("GLUON_E4M3", "GLUON_E4M3_FOUR", "GLUON_E4M3_WIDE"):
            setattr(dec, name, dataclasses.replace(getattr(dec, name), num_stages=stages,
                                                   programs_per_sm=per_sm))
        dec.E4M3_V_REGS = bool(v_regs)
    result = {"source_digest": source_digest(), "cases": [], "timings": []}
    if not args.skip_check:
        cases = [] if args.fp8_only else [(c, False) for c in CASES] + [(c, True) for c in CASES]
        for i, (case, hf) in enumerate(cases):
            t = time.time()
            try:
                extra = dict(zip(("head_dim", "fp16"), case[10:]))
                r = check_case(*case[:10], device=device, seed=i, heads_first=hf, **extra)
            except Exception as e:  # report and go on: one failing case must not hide the others
                r = {"case": list(case), "ok": False, "error": f"{type(e).__name__}: {e}"}
            result["cases"].append(r)
            shown = case if len(str(case)) < 200 else (*case[:4], "...", *case[5:])
            print(f"case {i} {shown} hf={hf}: {'ok' if r['ok'] else 'FAIL'} "
                  f"{r.get('worst_err_over_budget', r.get('error'))} splits {r.get('splits')} "
                  f"stages {r.get('stages')} ({time.time() - t:.1f}s)", flush=True)
        for i, case in enumerate(FP8_CASES):
            t = time.time()
            try:
                r = check_fp8_case(*case[:8], device=device, seed=100 + i,
                                   **dict(zip(("head_dim", "page"), case[8:])))
            except Exception as e:
                r = {"case": list(case), "ok": False, "error": f"{type(e).__name__}: {e}"}
            result["cases"].append(r)
            shown = case if len(str(case)) < 200 else (*case[:4], "...", *case[5:])
            print(f"fp8 case {i} {shown}: {'ok' if r['ok'] else 'FAIL'} "
                  f"{r.get('worst_err_over_budget', r.get('error'))} splits {r.get('splits')} "
                  f"({time.time() - t:.1f}s)", flush=True)
    ceiling = ceiling_rate(measure_ceiling(device))
    result["ceiling_gbps"] = ceiling
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    points = [(1, 12, 2, 32768), (1, 32, 8, 16384), (1, 32, 8, 32768), (16, 32, 8, 16384),
              (16, 12, 2, 16384), (64, 12, 2, 16384), (64, 32, 8, 16384)]
    if args.points:
        points = [tuple(int(x) for x in p.split(",")) for p in args.points.split(";")]
    if args.quick:
        points = points[1:2]
    if args.no_timing:
        points = []
    variants = [(64, 3, 2, False, False), (64, 3, 2, False, True), (64, 4, 1, True, False),
                (64, 4, 1, True, True), (64, 4, 1, False, True)]
    if args.variants:
        variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
    for b, h, hk, n in points:
        for page in (0, 16) if args.contiguous else (16,):
            point = Point("x", b, h, hk, n)
            result["timings"].append(time_point(point, page, device, ceiling, variants))
    with open(os.path.join(args.out, "gluon-decode-check.json"), "w") as f:
        json.dump(result, f, indent=1)
    bad = [c for c in result["cases"] if not c["ok"]]
    print(f"{len(result['cases']) - len(bad)}/{len(result['cases'])} cases ok")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
