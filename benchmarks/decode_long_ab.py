"""bf16 decode with 64-128 (sequence, KV head) pairs at long contexts: the dispatched plan (one
unsplit 64-key, 4-stage program a pair, one CTA per SM) against split plans with more programs per
SM, and SDPA cuDNN, in many balanced rounds (each round's time kept, to see drift).

    PYTHONPATH=src python benchmarks/decode_long_ab.py --out $OUT [--points 'B,H,Hk,ctx;...'] [--rounds 10]

Every provider is a CUDA graph of bench decode's calls (bench.decode.graph_calls, cycling through L
layers with their own caches of >= 1 GiB in all);
the flashtile providers' outputs are checked against float64 first. Writes decode-long-ab.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from flashtile.bench import decode as bench
from flashtile.kernels import decode as dec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import forced, run_points  # noqa: E402
from spec_decode_ab import check  # noqa: E402

POINTS = "16,32,8,131072;64,12,2,131072;16,32,8,16384"
# (name, DecodeConfig, num_splits): the configs of decode-long-ab-h200-20261201-b.log; the first run
# (decode-long-ab-h200-20261201.log) had 32-key 4-warp 4-stage programs in 2 splits in place of the
# two 8-warp ones, and SDPA cuDNN as its only anchor
CONFIGS = (("n64 w8 s4, unsplit", dec.DecodeConfig(64, 8, 4, waves=1, min_split_keys=128, pdl=True,
                                                   max_splits=1), 1),
           ("n128 w8 s2, unsplit", dec.DecodeConfig(128, 8, 2, waves=1, min_split_keys=128, pdl=True,
                                                    max_splits=1), 1),
           ("n32 w2 s3, 3 splits", dec.DecodeConfig(32, 2, 3, waves=2, min_split_keys=128, pdl=True,
                                                    resident_per_sm=4), 3),
           ("n64 w4 s3, 2 splits", dec.DecodeConfig(64, 4, 3, waves=2, min_split_keys=128, pdl=True), 2))
# the Gluon TMA kernel's transposed consumer (as B1 32/8 runs it) forced onto these pair counts:
# one CTA per SM, 4 stages, splits filling one wave (SMs // pairs), "long" by those splits' keys
# (as decode-long-ab-h200-20261203(-b) ran it)
GLUON_CONFIGS = (("gluon-t8-one-per-sm", {"T16_CONTIGUOUS_PAIRS": 1 << 20, "T16_FEW_PAIRS": 1 << 20}),)
# SDPA's FlashAttention-2 too: in bench decode the unsplit plan ran 4-16% slower in the rounds
# right after it (the GPU at its power cap), so it stays in the rounds here
ANCHORS = ("sdpa-flash", "sdpa-cudnn")


ONLY = None  # --only


def probe(point: bench.Point, device, ceiling: float, rounds: int) -> dict:
    import flashtile
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, bench.DTYPE)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    layers = bench.layers_for(point)
    caches = bench.LayerCaches.allocate(point, layers, device)

    def call_with(num_splits):
        def call(layer):
            k, v = caches.nhd(layer)
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True,
                                                     num_splits=num_splits)
        return call

    steps = {"plan": bench.make_step(bench.CONTIGUOUS, caches, q, lengths, {})}
    for name, config, splits in CONFIGS:
        if ONLY is None or name in ONLY:
            steps[name] = bench.Step(forced(call_with(splits), False,
                                            decode_config=lambda *a, c=config, **k: c))
    for name, settings in GLUON_CONFIGS:
        if ONLY is None or name in ONLY:
            steps[name] = bench.Step(forced(call_with(0), True, **settings))
    record = {"point": point.__dict__, "layers": layers,
              "check": check(steps, q, *caches.nhd(0), point.lengths())}
    for name in ANCHORS:
        steps[name] = bench.make_step(name, caches, q, lengths, {})
    results = bench.measure_providers(list(steps), caches, q, lengths, {}, bench.gpu_timer,
                                      bench.point_bytes(point), ceiling, rounds=rounds, steps=steps)
    report(results)
    record["results"] = results
    return record


def report(results: dict, width: int = 24) -> None:
    """One line a provider: us per layer, GB/s, % of the ceiling, x cuDNN, every round's us."""
    base = results["sdpa-cudnn"]
    for name, r in results.items():
        if not r.get("available"):
            print(f"  {name:{width}s} unavailable: {r.get('error')}", flush=True)
            continue
        rounds_us = [1e3 * t / r["graph_calls"] for t in r["replay_ms_rounds"]]
        print(f"  {name:{width}s} {r['us_per_layer']:8.1f} us {r['gbps']:6.0f} GB/s {r['pct_ceiling']:5.1f}% "
              f"{base['ms_per_layer'] / r['ms_per_layer']:.3f}x cudnn  rounds "
              + " ".join(f"{t:.0f}" for t in rounds_us), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", default=None,
                        help="comma-separated config names to time beside the plan and the anchors "
                             "(default: all of CONFIGS and GLUON_CONFIGS)")
    args = parser.parse_args()
    if args.only is not None:
        global ONLY
        ONLY = set(args.only.split(","))
    run_points(args.points, lambda point, device, ceiling: probe(point, device, ceiling, args.rounds),
               args.out, "decode-long-ab.json", rounds=args.rounds)


if __name__ == "__main__":
    main()
