"""How fast can one kernel a layer read a decode step's bytes? The streaming read (bench.stream_read,
every config) over L per-layer buffers of a decode point's K+V size, replayed as one CUDA graph as
bench decode times a step (graph_calls layer calls cycling through the layers: since 2026-12-03;
read-sizes-h200-20261201.log was timed with graphs of L calls), against the 8 GiB ceiling of the
same run: the bound a step of that size approaches with a single launch per layer and no attention
at all. Each point also times the best config as a PDL chain (every layer's read launched while
the one before runs, waiting for it before its first load and letting the next one launch at once):
the closest a kernel that must wait for the previous layer can follow it.

    PYTHONPATH=src python benchmarks/read_sizes.py --out $OUT [--points 'B,H,Hk,ctx;...']
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashtile.bench import decode as bench
from flashtile.bench import stream_read

POINTS = "1,32,8,16384;1,32,8,32768;1,32,8,65536;1,32,8,131072;1,12,2,32768;1,12,2,131072;16,12,2,16384"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = bench.measure_ceiling(device)
    top = bench.ceiling_rate(ceiling)
    print(bench.ceiling_line(ceiling), flush=True)
    rows = []
    for item in args.points.split(";"):
        b, h, hk, ctx = (int(x) for x in item.split(","))
        point = bench.Point("read", b, h, hk, ctx)
        nbytes = bench.point_bytes(point)
        layers = bench.layers_for(point)
        calls = bench.graph_calls(layers, nbytes, device)  # as bench decode's graphs (since 2026-12-03)
        words = [torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_() for _ in range(layers)]
        best = None
        for block, warps, per_sm in stream_read.CONFIGS:
            if (nbytes // 4) % block:
                continue
            outs = [stream_read.stream_read(w, block, warps, per_sm) for w in words]
            replay = bench.build_replay(
                lambda layer: stream_read.stream_read(words[layer], block, warps, per_sm, outs[layer]),
                layers, device, calls)
            us = 1e3 * bench.gpu_timer(replay) / calls
            gbps = nbytes / us / 1e3
            if best is None or gbps > best["gbps"]:
                best = {"block_words": block, "warps": warps, "per_sm": per_sm, "us": us, "gbps": gbps}
            del replay
        best["pct_ceiling"] = 100 * best["gbps"] / top
        block, warps, per_sm = best["block_words"], best["warps"], best["per_sm"]
        outs = [stream_read.stream_read(w, block, warps, per_sm, pdl=True) for w in words]
        replay = bench.build_replay(
            lambda layer: stream_read.stream_read(words[layer], block, warps, per_sm, outs[layer], pdl=True),
            layers, device, calls)
        us = 1e3 * bench.gpu_timer(replay) / calls
        del replay
        pdl = {"us": us, "gbps": nbytes / us / 1e3, "pct_ceiling": 100 * nbytes / us / 1e3 / top}
        rows.append({"point": point.__dict__, "bytes_per_layer": nbytes, "layers": layers,
                     "graph_calls": calls, "best": best, "best_config_pdl_chain": pdl})
        print(f"B{b} {h}/{hk} {ctx // 1024}k: {nbytes / 1e6:.0f} MB a layer, L {layers}: best read "
              f"{best['us']:.1f} us, {best['gbps']:.0f} GB/s = {best['pct_ceiling']:.1f}% of the ceiling "
              f"({best['block_words']}-word blocks, {best['warps']} warps, {best['per_sm'] or 'no'} per SM); "
              f"as a PDL chain {pdl['us']:.1f} us = {pdl['pct_ceiling']:.1f}%", flush=True)
        words = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "read-sizes.json"), "w") as f:
        json.dump({"ceiling": ceiling, "points": rows}, f, indent=1)


if __name__ == "__main__":
    main()
