"""Portable kernel's tiles for short sliding windows, on the GPU machine.

Windows under the Gluon kernel's rule (head dim 64; head dim 128 under 512 keys) run the portable
Triton kernel with the tiles of its causal call (forward.config_for_arch). Each query block of 128
rows against a 128-key window computes 2-3 key tiles of which about half the pairs are visible.
This times forward.attention_forward with other tiles (config=TileConfig) on causal windows of
128-512 keys, against FlexAttention with a sliding-window block mask (compiled afresh per shape), each
output checked against float64 on sampled rows under the accuracy rule (window_probe.check).

    PYTHONPATH=src python benchmarks/window_tiles.py [--out DIR] [--rounds N] [--check-only]

The timing includes flash_attn_func as dispatched (forward.short_window_config's tiles since
2026-12-04). First (alone with --check-only): CHECKS, odd shapes through forward.attention_forward
without a config (the dispatched tiles), output and LSE NaN-filled first, against float64 under the
accuracy rule, the LSE to fp32 rounding.

TFLOP/s count visible (query, key) pairs, 4 * pairs * d per head; medians of do_bench over balanced
rounds.
"""

from __future__ import annotations

import argparse
import json

import torch

import flashtile
from flashtile.kernels import forward
from flashtile.kernels.forward import TileConfig
from flashtile.reference import attention as reference_attention

from window_probe import balanced_rounds, check, median, over_budget, visible_pairs, write_results

# (seqlen, heads, kv heads, head dim, window)
SHAPES = [(16384, 64, 8, 64, 128), (16384, 64, 8, 64, 256), (16384, 64, 8, 64, 512), (16384, 64, 8, 64, 1024),
          (16384, 64, 8, 64, 2048), (16384, 32, 8, 128, 128), (16384, 32, 8, 128, 256)]
# the first of each: the causal call's (forward.config_for_arch); the first run (window-tiles-h200-20261204-a)
# also timed 64 x 128 tiles (d64, d128) and 128 x 128 with 8 warps (d128), all slower than the default
CONFIGS = {64: [TileConfig(128, 128, 4, 3, True), TileConfig(128, 64, 4, 3, True), TileConfig(64, 64, 4, 3, True),
                TileConfig(64, 32, 4, 3, True), TileConfig(128, 32, 4, 3, True), TileConfig(64, 64, 4, 2, True),
                TileConfig(64, 32, 4, 2, True)],
           128: [TileConfig(128, 64, 4, 2, True), TileConfig(64, 64, 4, 3, True), TileConfig(64, 32, 4, 3, True),
                 TileConfig(128, 32, 4, 3, True), TileConfig(64, 32, 4, 2, True)]}


# (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, window_size, causal)
CHECKS = [(2, 1000, 1000, 8, 2, 64, "bf16", (128, 0), True), (1, 777, 1531, 4, 1, 64, "fp16", (300, 0), True),
          (1, 1531, 777, 4, 4, 64, "bf16", (0, 0), True), (1, 2000, 2000, 4, 2, 64, "bf16", (100, 200), False),
          (3, 513, 513, 2, 2, 40, "bf16", (512, 0), True), (1, 1, 3000, 8, 2, 128, "bf16", (256, 0), True),
          (2, 1999, 1999, 8, 2, 128, "fp16", (255, 0), True), (1, 1000, 2500, 4, 1, 96, "bf16", (150, 150), False),
          (1, 3000, 1000, 4, 2, 128, "bf16", (300, 0), True), (1, 3000, 3000, 8, 1, 64, "bf16", (2048, 0), True),
          (1, 2500, 2000, 4, 2, 64, "fp16", (700, 900), False)]


def run_checks(dev) -> list[dict]:
    """CHECKS through the dispatched tiles (see the module's docstring)."""
    results = []
    for b, sq, sk, h, hk, d, dt, window, causal in CHECKS:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sq + 7 * sk + d)
        q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        right = 0 if causal else window[1]
        tiles = forward.short_window_config(d, dev, window[0], right)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device=dev)
        forward.attention_forward(q, k, v, softmax_scale=d ** -0.5, window_left=window[0], window_right=right,
                                  diag_offset=sk - sq, out=out, lse=lse)
        rows = torch.unique(torch.linspace(0, sq - 1, min(sq, 256), device=dev).long())
        ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=causal, window_size=window,
                                           query_rows=rows)
        low, _ = reference_attention(q, k, v, causal=causal, window_size=window, query_rows=rows)
        ratio = over_budget((out[:, rows].double() - ref).abs().max().item(), (low.double() - ref).abs().max().item())
        got = lse[:, :, rows].double()
        finite = torch.isfinite(ref_lse)
        diff = (got[finite] - ref_lse[finite]).abs()
        lse_ok = bool((diff <= 1e-5 * ref_lse[finite].abs().clamp(min=1.0) + 1e-5).all())
        ok = (tiles is not None and ratio <= 1 and lse_ok and bool(torch.equal(torch.isinf(got), ~finite))
              and not torch.isnan(out).any().item() and not torch.isnan(lse).any().item())
        rec = {"b": b, "sq": sq, "sk": sk, "h": h, "hk": hk, "d": d, "dtype": dt, "window": list(window),
               "causal": causal, "tiles": None if tiles is None else [tiles.block_m, tiles.block_n, tiles.num_stages],
               "err_over_budget": round(ratio, 3), "lse_err": diff.max().item() if diff.numel() else 0.0, "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        results.append(rec)
    return results


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    checks = run_checks(dev)
    bad = sum(not c["ok"] for c in checks)
    print(f"check: {len(checks) - bad}/{len(checks)} ok", flush=True)
    rows_out = []
    for n, h, hk, d, w in [] if args.check_only else SHAPES:
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
        tiles = forward.short_window_config(d, dev, w, 0) or forward.pick_config(d, dev)
        dispatched = f"{tiles.block_m}x{tiles.block_n}-w{tiles.num_warps}-s{tiles.num_stages}"
        calls = {}
        for cfg in CONFIGS[d]:
            name = f"{cfg.block_m}x{cfg.block_n}-w{cfg.num_warps}-s{cfg.num_stages}"

            def call(cfg=cfg, q=q, k=k, v=v, w=w):
                return forward.attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_left=w,
                                                 window_right=0, diag_offset=0, config=cfg)[0]
            calls[name] = call
        calls["flash_attn_func"] = lambda q=q, k=k, v=v, w=w: flashtile.flash_attn_func(q, k, v, causal=True,
                                                                                       window_size=(w, 0))
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
                   "default": name == names[0], "dispatched_tiles": dispatched, "ms": round(ms, 4),
                   "ms_rounds": [round(t, 4) for t in times[name]],
                   "tflops": round(tflops, 1), "err_over_budget": errors[name]}
            rows_out.append(rec)
            print(json.dumps(rec), flush=True)
    write_results(args.out, "window-tiles.json", checks, rows_out)
    print("\n| d | H/Hk | window | tiles | ms | TFLOP/s | err/budget |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['head_dim']} | {r['heads']}/{r['heads_k']} | {r['window']} | {r['provider']} | {r['ms']:.3f} | "
              f"{r['tflops']:.0f} | {r['err_over_budget']} |")
    bad += sum(r["err_over_budget"] > 1 for r in rows_out)
    print(f"check: {len(checks) - sum(not c['ok'] for c in checks)}/{len(checks)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
