"""What the split-KV merge costs a decode step: each point's shipped call (split kernel + merge)
against the same split kernel with the merge launch skipped (wrong output, timing only) and
against the merge letting the next kernel launch as soon as it starts (``_combine``'s
LAUNCH_DEPENDENTS) and only at its end (either way whatever the plan ships), in balanced rounds (bench.common.time_in_rounds), each a CUDA graph of the
bench's calls (``bench.decode.graph_calls``, cycling through L layers with their own caches of
>= 1 GiB in all). (merge-share-h200-20261201 was timed in plain alternating rounds over graphs of
the L layers once.)

    PYTHONPATH=src python benchmarks/merge_share.py --out $OUT [--points B,H,Hk,ctx,page[,e4m3];...]

A point ending in ``e4m3`` reads e4m3 caches with per-key descales (as bench decode-fp8).

Writes merge-share.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode import LayerCaches, Point, build_replay, ceiling_rate, gpu_timer, graph_calls, \
    layers_for, measure_ceiling, shuffled_block_table
from flashtile.bench.decode_fp8 import FP8Caches, fp8_layers, fp8_point_bytes, fp8_step
from flashtile.kernels import decode as dec


POINTS = "1,32,8,32768,0;1,32,8,65536,0;1,32,8,131072,0;1,32,8,16384,16;16,12,2,16384,0,e4m3;" \
         "16,12,2,32768,0,e4m3;16,32,8,16384,0,e4m3;16,12,2,4096,0"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = ceiling_rate(measure_ceiling(device))
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    results = []
    for item in args.points.split(";"):
        fields = item.split(",")
        e4m3 = fields[5:] == ["e4m3"]
        batch, heads, heads_k, context, page = (int(x) for x in fields[:5])
        point = Point("probe", batch, heads, heads_k, context)
        q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        table = shuffled_block_table(batch, context // page, device) if page else None
        if e4m3:
            if page:
                raise SystemExit("e4m3 points: contiguous caches only here")
            layers = fp8_layers(point, None)
            caches = FP8Caches.allocate(point, layers, device)
            nbytes = fp8_point_bytes(point)

            call = fp8_step(caches, q, lengths).call  # bench decode-fp8's call
        else:
            layers = layers_for(point)
            caches = LayerCaches.allocate(point, layers, device)
            nbytes = 2 * batch * context * heads_k * 128 * 2

            def call(layer):
                k, v = caches.pools(layer, page) if page else caches.nhd(layer)
                return dec.decode_attention(q, k, v, lengths, softmax_scale=128 ** -0.5, window_left=-1,
                                            window_right=0, block_table=table, need_lse=False)[0]

        calls = graph_calls(layers, nbytes, device)
        merges = []
        original = dec._launch_combine
        dec._launch_combine = lambda *a, **k: (merges.append(1), original(*a, **k))
        try:
            call(0)
        finally:
            dec._launch_combine = original
        variants = {"shipped": None}
        if merges:
            variants["no merge launch"] = "skip"
            variants["merge launches dependents"] = "trigger"
            variants["merge launches at its end"] = "no trigger"
        replays = {}
        original_options = dec._combine_options
        for name, patch in variants.items():
            if patch == "skip":
                dec._launch_combine = lambda *a, **k: None
            elif patch in ("trigger", "no trigger"):
                dec._combine_options = lambda *a, t=patch == "trigger": dict(original_options(*a),
                                                                             LAUNCH_DEPENDENTS=t)
            dec._PLANS.clear()
            try:
                call(0)
                replays[name] = build_replay(call, layers, device, calls)
            finally:
                dec._launch_combine = original
                dec._combine_options = original_options
                dec._PLANS.clear()
        times, errors = time_in_rounds({name: lambda r=replays[name]: gpu_timer(r) * 1e3 / calls
                                        for name in variants}, args.rounds)
        if errors:
            raise next(iter(errors.values()))
        row = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": context, "page": page,
               "cache": "e4m3" if e4m3 else "bf16", "merges_per_call": len(merges), "layers": layers,
               "graph_calls": calls, "bytes_per_layer": nbytes,
               "us": {n: statistics.median(t) for n, t in times.items()}, "rounds": times}
        results.append(row)
        cells = "  ".join(f"{n}: {statistics.median(t):7.2f} us ({100 * nbytes / statistics.median(t) / 1e3 / ceiling:4.1f}%)"
                          for n, t in times.items())
        print(f"B{batch} {heads}/{heads_k} {context} p{page} {row['cache']}: {cells}", flush=True)
        replays = caches = None
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "merge-share.json"), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "points": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
