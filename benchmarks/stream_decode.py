"""Stream-K decode (every program an equal share of all pairs' key tiles) against the shipped plans,
on caches of equal and of ragged lengths: the opt-in (FLASHTILE_DECODE_STREAM=1, decode.STREAM_CONFIG;
until 2026-12-01's -c run it was the plans' own program counts, "the plan's programs") and CONFIGS.

    PYTHONPATH=src python benchmarks/stream_decode.py --out $OUT [--points B,H,Hk,ctx,ragged;...] [--page-size N]

``ragged`` 1: sequence lengths drawn uniformly from [1, ctx] (fixed seed), the capacity ctx. Each
point: a float64 check of every config's output on the point's first layer (rows of up to four
sequences), then CUDA graphs over >= 1 GiB of layers timed in balanced rounds
(bench.common.time_in_rounds; the stream-decode-h200-20261201* runs alternated the order plainly);
GB/s counts the K/V bytes the lengths cover. ``--page-size N``: the caches as page pools of N keys
read through a shuffled block table (bench.decode's, shared by the layers as in vLLM). Writes
stream-decode.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode import LayerCaches, Point, build_replay, ceiling_rate, gpu_timer, \
    layers_for, measure_ceiling, read_tokens, shuffled_block_table
from flashtile.kernels import decode as dec

POINTS = ("16,32,8,4096,0;16,32,8,16384,0;16,32,8,131072,0;64,12,2,16384,0;16,32,8,16384,1;"
          "16,32,8,65536,1;64,32,8,16384,1;16,12,2,32768,1;4,32,8,32768,1")
CONFIGS = {
    "stream n64 s3 x2": dec.DecodeConfig(64, 4, 3, waves=1, pdl=True, stream=2, programs_per_sm=2),
}


def _check(out, q, k, v, lengths, scale):
    """max |out - fp64| over the first four sequences against 2x the bf16 textbook's error."""
    worst = 0.0
    for b in range(min(4, q.shape[0])):
        n = int(lengths[b])
        group = q.shape[2] // k.shape[2]
        qq = q[b, 0].double()
        kk = k[b, :n].double().repeat_interleave(group, dim=1)  # (n, H, D)
        vv = v[b, :n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", qq, kk) * scale
        ref = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)
        s16 = torch.einsum("hd,nhd->hn", q[b, 0].float(), kk.float()) * scale
        low = torch.einsum("hn,nhd->hd", torch.softmax(s16, -1).bfloat16().float(), vv.float()).bfloat16()
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        err = (out[b, 0].double() - ref).abs().max().item()
        worst = max(worst, err / budget)
    return worst


def graph_replays_follow_lengths(device, batch=16, heads=32, heads_k=8, capacity=8192, small=False):
    """One stream-K decode step captured in a CUDA graph, replayed after the lengths (ragged,
    zero-length rows among them) change in place: each replay against float64. Returns the worst
    error/budget ratio."""
    k = torch.randn(batch, capacity, heads_k, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
    lengths = torch.full((batch,), capacity // 2, dtype=torch.int32, device=device)
    scale = 128 ** -0.5
    dec.STREAM_PLANS = True
    dec._PLANS.clear()
    captured = {}

    def step(_layer):  # the captured call's output stays where the graph writes it
        captured["out"] = dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                               window_right=0, need_lse=False)[0]
    try:
        step(0)
        replay = build_replay(step, 1, device)
        out = captured["out"]
    finally:
        dec.STREAM_PLANS = False
        dec._PLANS.clear()
    worst = 0.0
    gen = torch.Generator().manual_seed(7)
    for trial in range(2 if small else 4):
        new = torch.randint(0, capacity + 1, (batch,), generator=gen, dtype=torch.int32)
        new[trial % batch] = 0
        lengths.copy_(new.to(device))
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        order = torch.argsort(new, descending=True)[:4]  # the longest rows (and a zero below)
        rows = torch.cat([order, torch.tensor([trial % batch])]).to(device)
        got = out[rows]
        if torch.isnan(got).any():
            return float("nan")
        zero = got[-1]
        if not torch.all(zero == 0):
            return float("nan")
        worst = max(worst, _check(got[:-1], q[rows[:-1]], k[rows[:-1]], v[rows[:-1]],
                                  lengths[rows[:-1]], scale))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=0, help="page pools of this many keys (0: contiguous)")
    parser.add_argument("--splits", default="", help="comma-separated num_splits to time the shipped "
                        "dispatch with as well (e.g. 2,4)")
    parser.add_argument("--small", action="store_true",
                        help="only small cases, no timing (for compute-sanitizer)")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.small:
        ratio = graph_replays_follow_lengths(device, batch=6, heads=12, heads_k=2, capacity=700, small=True)
        print(f"graph replays as lengths change: worst error/budget {ratio:.2f}")
        q = torch.randn(5, 2, 8, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(5, 300, 2, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.tensor([0, 1, 77, 300, 190], dtype=torch.int32, device=device)
        for name, cfg in {"opt-in": dec.STREAM_CONFIG, **CONFIGS}.items():
            for programs in (0, 3, 40):
                out = dec.decode_attention(q, k, v, lengths, softmax_scale=128 ** -0.5, window_left=-1,
                                           window_right=0, num_splits=programs, config=cfg)[0]
                torch.cuda.synchronize()
                print(f"  {name} programs {programs}: finite {bool(torch.isfinite(out).all())}")
        return 0 if ratio <= 1.0 else 1
    ratio = graph_replays_follow_lengths(device)
    print(f"graph replays as lengths change (B16 32/8, 8k capacity): worst error/budget {ratio:.2f}",
          flush=True)
    ceiling = ceiling_rate(measure_ceiling(device))
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    results = []
    for item in args.points.split(";"):
        batch, heads, heads_k, context, ragged = (int(x) for x in item.split(","))
        point = Point("probe", batch, heads, heads_k, context)
        layers = layers_for(point)
        caches = LayerCaches.allocate(point, layers, device)
        q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
        if ragged:
            gen = torch.Generator().manual_seed(batch * 1000 + context)
            lengths = torch.randint(1, context + 1, (batch,), generator=gen, dtype=torch.int32).to(device)
        else:
            lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        nbytes = int(lengths.sum()) * heads_k * 128 * 2 * 2
        scale = 128 ** -0.5

        page = args.page_size
        table = (shuffled_block_table(batch, context // page, device, torch.Generator().manual_seed(context))
                 if page else None)

        def call_with(cfg, splits=0):
            def call(layer):
                k, v = caches.pools(layer, page) if page else caches.nhd(layer)
                return dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                            window_right=0, config=cfg, need_lse=False,
                                            block_table=table, num_splits=splits)[0]
            return call

        variants = {"shipped": call_with(None), "stream (opt-in)": "plans",
                    **{n: call_with(c) for n, c in CONFIGS.items()},
                    **{f"num_splits={n}": call_with(None, int(n)) for n in filter(None, args.splits.split(","))}}
        if page:  # the checked sequences' keys in order, gathered through the table
            pools = caches.pools(0, page)
            k0, v0 = (torch.stack([read_tokens(pool, table, b, 0, context) for b in range(min(4, batch))])
                      for pool in pools)
        else:
            k0, v0 = caches.nhd(0)
        checks, replays = {}, {}
        for n, fn in variants.items():
            plans = fn == "plans"  # what FLASHTILE_DECODE_STREAM=1 runs
            if plans:
                fn = variants[n] = call_with(None)
            dec.STREAM_PLANS = plans
            dec._PLANS.clear()
            try:
                checks[n] = _check(fn(0), q, k0, v0, lengths, scale)
                replays[n] = build_replay(fn, layers, device)
            finally:
                dec.STREAM_PLANS = False
                dec._PLANS.clear()
        names = list(variants)
        times, errors = time_in_rounds({n: lambda r=replays[n]: gpu_timer(r) * 1e3 / layers
                                        for n in names}, args.rounds)
        if errors:
            raise next(iter(errors.values()))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": context,
               "ragged": bool(ragged), "page_size": page, "lengths_sum": int(lengths.sum()), "bytes_per_layer": nbytes,
               "layers": layers, "us": med, "rounds": times, "check_ratio": checks,
               "plan": dec.describe_plan(q, *(caches.pools(0, page) if page else (k0, v0)), table)}
        results.append(row)
        print(f"B{batch} {heads}/{heads_k} {context} {'ragged' if ragged else 'equal'}"
              f"{f' page {page}' if page else ''} "
              f"({row['plan']}):", flush=True)
        for n in names:
            gbps = nbytes / med[n] / 1e3
            print(f"   {n:22s} {med[n]:9.2f} us  {100 * gbps / ceiling:5.1f}%  x{med['shipped'] / med[n]:.3f}"
                  f"  check {checks[n]:.2f}", flush=True)
        replays = caches = None
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "stream-decode.json"), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "graph_replay_check": ratio, "points": results}, f,
                      indent=1, default=str)
    bad = [(r["batch"], r["context"], n) for r in results for n, c in r["check_ratio"].items()
           if not c <= 1.0 or math.isnan(c)]
    if not ratio <= 1.0:
        bad.append("graph replays")
    print("checks:", "all within budget" if not bad else f"FAILED {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
