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
from flashtile.bench.decode import (LayerCaches, Point, ceiling_rate, gpu_timer, layers_for, measure_ceiling,
                                    point_bytes, prepare_replay)
from flashtile.bench.decode_fp8 import FP8Caches, fp8_layers, fp8_point_bytes, fp8_step

def rate(nbytes: int, ms: list, ceiling: float) -> tuple[float, float, float]:
    """(median ms, % of the read ceiling, spread of the rounds in % of the median) of ``nbytes``
    read in each of the times ``ms``."""
    med = statistics.median(ms)
    return med, 100 * nbytes / (med * 1e-3) / 1e9 / ceiling, 100 * (max(ms) - min(ms)) / med


def start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, torch.device, float]:
    """Arguments (``parser``'s and --out), the GPU and its read ceiling (printed)."""
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = ceiling_rate(measure_ceiling(device))
    print(f"read ceiling {ceiling:.0f} GB/s")
    return args, device, ceiling


def point_inputs(batch: int, heads: int, heads_k: int, context: int, device: torch.device):
    """(point, layers holding >= 1 GiB of either cache, a bf16 query, full lengths)."""
    point = Point("p", batch, heads, heads_k, context)
    layers = max(layers_for(point), fp8_layers(point, None))
    q = torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16)
    return point, layers, q, torch.full((batch,), context, dtype=torch.int32, device=device)


def write_points(out: str, name: str, ceiling: float, rows: list) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump({"ceiling_gbps": ceiling, "points": rows}, f, indent=1)


POINTS = ((64, 32, 8, 16384), (16, 32, 8, 32768), (16, 32, 8, 131072), (64, 12, 2, 16384),
          (16, 12, 2, 16384))


def main() -> int:
    args, device, ceiling = start(argparse.ArgumentParser())
    rows = []
    for batch, heads, heads_k, context in POINTS:
        point, layers, q, lengths = point_inputs(batch, heads, heads_k, context, device)
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
                _, pct, spread = rate(nbytes[name], ms, ceiling)
                result[f"{mode}: {name}"] = {"ms": ms, "pct_ceiling": pct}
                print(f"B{batch} {heads}/{heads_k} {context:>6} {mode:16s} {name:5s} {pct:6.1f}%  "
                      f"spread {spread:4.1f}%", flush=True)
        rows.append(result)
        del caches, caches8, replay16, replay8, calls
        torch.cuda.empty_cache()
    write_points(args.out, "decode-fp8-rounds.json", ceiling, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
