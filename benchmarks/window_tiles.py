"""Portable kernel's tiles for short sliding windows, on the GPU machine.

Windows under the Gluon kernel's rule (head dim 64; head dim 128 under 512 keys) run the portable
Triton kernel with the tiles of its causal call (forward.config_for_arch). Each query block of 128
rows against a 128-key window computes 2-3 key tiles of which about half the pairs are visible.
This times forward.attention_forward with other tiles (config=TileConfig) on causal windows of
128-512 keys, against FlexAttention with a sliding-window block mask (compiled afresh per shape), each
output checked against float64 on sampled rows under the accuracy rule (window_probe.check).

    PYTHONPATH=src python benchmarks/window_tiles.py [--out DIR] [--rounds N]

TFLOP/s count visible (query, key) pairs, 4 * pairs * d per head; medians of do_bench over balanced
rounds.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashtile.bench.common import source_digest
from flashtile.kernels import forward
from flashtile.kernels.forward import TileConfig

from window_probe import balanced_rounds, check, median, visible_pairs

# (seqlen, heads, kv heads, head dim, window)
SHAPES = [(16384, 64, 8, 64, 128), (16384, 64, 8, 64, 256), (16384, 64, 8, 64, 512),
          (16384, 32, 8, 128, 128), (16384, 32, 8, 128, 256)]
CONFIGS = {64: [TileConfig(128, 128, 4, 3, True), TileConfig(128, 64, 4, 3, True), TileConfig(64, 64, 4, 3, True),
                TileConfig(64, 128, 4, 3, True), TileConfig(64, 32, 4, 3, True), TileConfig(128, 32, 4, 3, True),
                TileConfig(64, 64, 4, 2, True)],
           128: [TileConfig(128, 64, 4, 2, True), TileConfig(64, 64, 4, 3, True), TileConfig(64, 32, 4, 3, True),
                 TileConfig(128, 32, 4, 3, True), TileConfig(64, 128, 4, 2, True), TileConfig(128, 128, 8, 2, True)]}


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for n, h, hk, d, w in SHAPES:
        torch.manual_seed(n + d + w)
        q = torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, n, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        torch._dynamo.reset()  # the mask's window is a default argument: compile afresh
        flex = torch.compile(flex_attention, dynamic=False)

        def sliding(b_, h_, qi, ki, w=w):
            return (qi >= ki) & (qi - ki <= w)
        mask = create_block_mask(sliding, None, None, n, n, device=dev)
        calls = {}
        for cfg in CONFIGS[d]:
            name = f"{cfg.block_m}x{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"

            def call(cfg=cfg, q=q, k=k, v=v, w=w):
                return forward.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_left=w,
                                                 window_right=0, diag_offset=0, config=cfg)[0]
            calls[name] = call
        calls["flex"] = lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True).transpose(1, 2)
        errors = {}
        for name, fn in calls.items():
            errors[name] = round(check(fn(), q, k, v, w), 3)
        times = balanced_rounds(calls, args.rounds)
        names = list(calls)
        for name in names:
            ms = median(times[name])
            tflops = 4 * visible_pairs(n, w) * d * h / (ms * 1e-3) / 1e12
            rec = {"seqlen": n, "heads": h, "heads_k": hk, "head_dim": d, "window": w, "provider": name,
                   "default": name == names[0], "ms": round(ms, 4), "ms_rounds": [round(t, 4) for t in times[name]],
                   "tflops": round(tflops, 1), "err_over_budget": errors[name]}
            rows_out.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "window-tiles.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "source_digest": source_digest(), "rows": rows_out}, f, indent=1)
    print("\n| d | H/Hk | window | tiles | ms | TFLOP/s | err/budget |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['head_dim']} | {r['heads']}/{r['heads_k']} | {r['window']} | {r['provider']} | {r['ms']:.3f} | "
              f"{r['tflops']:.0f} | {r['err_over_budget']} |")
    bad = sum(r["err_over_budget"] > 1 for r in rows_out)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
