"""Does timing the e4m3-cache decode next to the bf16 one (balanced rounds, as `bench decode-fp8`
does since 2026-12-01) change what it reads? For a few points, both replays built once, then timed
three ways in one run: each alone six times in a row, and the two in six balanced rounds.

    PYTHONPATH=src python benchmarks/decode_fp8_rounds.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode import LayerCaches, Point, gpu_timer, layers_for, measure_ceiling, point_bytes, prepare_replay
from flashtile.bench.decode_fp8 import FP8Caches, fp8_layers, fp8_point_bytes, fp8_step

POINTS = ((64, 32, 8, 16384), (16, 32, 8, 32768), (16, 32, 8, 131072), (64, 12, 2, 16384),
          (16, 12, 2, 16384))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = measure_ceiling(device)["sum_gbps"]
    print(f"read ceiling {ceiling:.0f} GB/s")
    rows = []
    for batch, heads, heads_k, context in POINTS:
        point = Point("p", batch, heads, heads_k, context)
        layers = max(layers_for(point), fp8_layers(point, None))
        q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        caches = LayerCaches.allocate(point, layers, device)
        caches8 = FP8Caches.allocate(point, layers, device)
        replay16, _, err16 = prepare_replay("flashtile", caches, q, lengths, {})
        replay8, _, err8 = prepare_replay("flashtile-fp8", caches, q, lengths, {}, fp8_step(caches8, q, lengths))
        assert err16 is None and err8 is None, (err16, err8)
        calls = {"bf16": lambda r=replay16: gpu_timer(r), "fp8": lambda r=replay8: gpu_timer(r)}
        nbytes = {"bf16": point_bytes(point) * layers, "fp8": fp8_point_bytes(point) * layers}
        result = {"point": [batch, heads, heads_k, context], "layers": layers}
        for mode in ("fp8 alone", "bf16 alone", "rounds", "fp8 alone again"):
            if mode == "rounds":
                times, _ = time_in_rounds(calls, 6)
            else:
                name = mode.split()[0]
                calls[name]()  # warm-up pass
                times = {name: [calls[name]() for _ in range(6)]}
            for name, ms in times.items():
                med = statistics.median(ms)
                pct = 100 * nbytes[name] / (med * 1e-3) / 1e9 / ceiling
                result[f"{mode}: {name}"] = {"ms": ms, "pct_ceiling": pct}
                print(f"B{batch} {heads}/{heads_k} {context:>6} {mode:16s} {name:5s} {pct:6.1f}%  "
                      f"spread {100 * (max(ms) - min(ms)) / med:4.1f}%", flush=True)
        rows.append(result)
        del caches, caches8, replay16, replay8, calls
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "decode-fp8-rounds.json"), "w") as f:
        json.dump({"ceiling_gbps": ceiling, "points": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
