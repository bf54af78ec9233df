"""What the split-KV merge costs a decode step: each point's shipped call (split kernel + merge)
against the same split kernel with the merge launch skipped (wrong output, timing only), in
balanced rounds (bench.common.time_in_rounds), each a CUDA graph over L layers with their own caches
(>= 1 GiB, as ``bench decode``). (merge-share-h200-20261201 was timed in plain alternating rounds.)

    PYTHONPATH=src python benchmarks/merge_share.py --out $OUT [--points B,H,Hk,ctx,page;...]

Writes merge-share.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode import LayerCaches, Point, build_replay, ceiling_rate, gpu_timer, \
    layers_for, measure_ceiling, shuffled_block_table
from flashtile.kernels import decode as dec


POINTS = "1,32,8,16384,0;1,32,8,32768,0;1,32,8,65536,0;1,32,8,131072,0;1,32,8,16384,16;" \
         "1,32,8,32768,16;1,12,2,32768,0;1,12,2,131072,0"


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
        batch, heads, heads_k, context, page = (int(x) for x in item.split(","))
        point = Point("probe", batch, heads, heads_k, context)
        layers = layers_for(point)
        caches = LayerCaches.allocate(point, layers, device)
        nbytes = 2 * batch * context * heads_k * 128 * 2
        q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        table = shuffled_block_table(batch, context // page, device) if page else None

        def kv(layer):
            return caches.pools(layer, page) if page else caches.nhd(layer)

        def call(layer):
            k, v = kv(layer)
            return dec.decode_attention(q, k, v, lengths, softmax_scale=128 ** -0.5, window_left=-1,
                                        window_right=0, block_table=table, need_lse=False)[0]

        k0, v0 = kv(0)
        prepared = dec.prepare_decode(q, k0, v0, softmax_scale=128 ** -0.5, window_left=-1,
                                      window_right=0, block_table=table, need_lse=False)
        variants = {"shipped": (call, None)}
        if prepared.splits > 1:
            variants["no merge launch"] = (call, "skip")
        replays = {}
        original = dec._launch_combine
        for name, (fn, patch) in variants.items():
            if patch == "skip":
                dec._launch_combine = lambda *a, **k: None
            try:
                fn(0)
                replays[name] = build_replay(fn, layers, device)
            finally:
                dec._launch_combine = original
        times, errors = time_in_rounds({name: lambda r=replays[name]: gpu_timer(r) * 1e3 / layers
                                        for name in variants}, args.rounds)
        if errors:
            raise next(iter(errors.values()))
        row = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": context, "page": page,
               "splits": prepared.splits, "layers": layers, "bytes_per_layer": nbytes,
               "us": {n: statistics.median(t) for n, t in times.items()}, "rounds": times}
        results.append(row)
        cells = "  ".join(f"{n}: {statistics.median(t):7.2f} us ({100 * nbytes / statistics.median(t) / 1e3 / ceiling:4.1f}%)"
                          for n, t in times.items())
        print(f"B{batch} {heads}/{heads_k} {context} p{page} splits {prepared.splits}: {cells}", flush=True)
        replays = caches = None
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "merge-share.json"), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "points": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
