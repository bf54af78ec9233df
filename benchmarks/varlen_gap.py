"""How far the packed Gluon forward trails the plain one on the same equal-length batch.

    PYTHONPATH=src python benchmarks/varlen_gap.py [--out DIR] [--rounds N] [--ragged]

flash_attn_varlen_func on B sequences of S tokens against flash_attn_func on the same tokens as
(B, S, H, D), and SDPA cuDNN as the anchor, each a CUDA-graph replay (no host time), medians of
do_bench over balanced rounds; the two flashtile outputs compared bit for bit per sequence. The
2026-12-02 table (32/8 heads) read 0.96-0.97x; varlen_bwd_host.py's eager forwards at 16/16 heads
read 0.87-0.88x, which this separates from host time.

--ragged: on ragged causal batches instead, the packed call's query-block-major tile order (what it
runs) against the plain call's modelled grouping computed for max_seqlen (packed_head_group forced
to None), outputs compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from window_probe import balanced_rounds, median  # noqa: E402

import flashtile  # noqa: E402

POINTS = [(8, 2048, 16, 16, 128, True), (8, 2048, 32, 8, 128, True), (16, 2048, 16, 16, 128, True),
          (4, 4096, 16, 16, 128, True), (8, 2048, 16, 16, 128, False), (8, 2048, 16, 16, 64, True),
          (8, 2048, 16, 16, 256, True), (32, 512, 16, 16, 128, True),
          (8, 2048, 16, 16, 128, True, torch.float8_e4m3fn), (8, 2048, 16, 16, 128, True, torch.bfloat16, 1024)]


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def point(b, s, h, hk, d, causal, dtype=torch.bfloat16, window=-1, *, rounds):
    dev = torch.device("cuda")
    q = torch.randn(b * s, h, d, device=dev).to(dtype)
    k, v = (torch.randn(b * s, hk, d, device=dev).to(dtype) for _ in range(2))
    opts = dict(causal=causal, window_size=(window, 0 if causal else window))
    cu = torch.arange(0, b * s + 1, s, device=dev, dtype=torch.int32)
    q4, k4, v4 = (t.view(b, s, -1, d) for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q4, k4, v4))
    with torch.no_grad():
        packed = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, s, s, **opts)
        plain = flashtile.flash_attn_func(q4, k4, v4, **opts)
    same = torch.equal(packed.view(b, s, h, d), plain)
    calls = {
        "packed": graphed(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, s, s, **opts)),
        "plain": graphed(lambda: flashtile.flash_attn_func(q4, k4, v4, **opts)),
    }
    if dtype != torch.float8_e4m3fn and window < 0:  # (the anchor: no e4m3 or window in cuDNN's SDPA)
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk)
        calls["cudnn"] = graphed(cudnn)
    times = balanced_rounds(calls, rounds)
    ms = {name: median(t) for name, t in times.items()}
    flops = 4 * b * s * s * d * h / (2 if causal else 1)  # (the window's too: a ratio between the two)
    row = {"batch": b, "seqlen": s, "heads": h, "heads_k": hk, "head_dim": d, "causal": causal,
           "dtype": str(dtype), "window": window,
           "bitwise_equal": same, "ms": {n: round(t, 4) for n, t in ms.items()},
           "rounds_ms": {n: [round(x, 4) for x in t] for n, t in times.items()},
           "tflops": {n: round(flops / t * 1e-9, 1) for n, t in ms.items()},
           "packed_over_plain": round(ms["plain"] / ms["packed"], 3),
           "packed_over_cudnn": round(ms["cudnn"] / ms["packed"], 3) if "cudnn" in ms else None}
    kind = ("causal" if causal else "full  ") + (" e4m3" if dtype == torch.float8_e4m3fn else "") + \
        (f" window {window}" if window >= 0 else "")
    print(f"  {b} x {s} {h}/{hk} d{d} {kind}: packed {row['tflops']['packed']:6.1f} "
          f"plain {row['tflops']['plain']:6.1f} cudnn {row['tflops'].get('cudnn', float('nan')):6.1f} TFLOP/s; "
          f"packed/plain {row['packed_over_plain']:.3f}x, packed/cudnn {row['packed_over_cudnn']}, bitwise {same}",
          flush=True)
    return row


RAGGED = [("8 ragged 512-4096", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 16, 16, 128),
          ("8 ragged 512-4096", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 32, 8, 128),
          ("8 ragged 512-4096", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 16, 16, 256),
          ("8 near-equal", [2048] * 7 + [1900], 16, 16, 128),
          ("16 ragged 64-7005", None, 32, 8, 128),
          ("64 ragged 64-7005", "64", 16, 16, 128)]


def ragged_point(name, lens, h, hk, d, rounds):
    from varlen_bwd import ragged_lengths
    from flashtile.kernels import gluon_forward as gf
    if lens is None:
        lens = ragged_lengths(16, seed=1)
    elif lens == "64":
        lens = ragged_lengths(64)
    dev = torch.device("cuda")
    total, n = sum(lens), max(lens)
    q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0] + lens, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    shipped = gf.packed_head_group

    def call(order):
        gf.packed_head_group = shipped if order == "block-major" else (lambda *a: None)
        try:
            gf._PACKED.clear()
            with torch.no_grad():
                out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
            return out, gf._PACKED
        finally:
            gf.packed_head_group = shipped
    results = {}
    calls = {}
    for order in ("block-major", "grouped"):
        out, plans = call(order)
        plan = next(iter(plans.values()))
        results[order] = (out, plan.geometry.head_group)
        gf.packed_head_group = shipped if order == "block-major" else (lambda *a: None)
        gf._PACKED.clear()
        calls[order] = graphed(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True))
        gf.packed_head_group = shipped
    gf._PACKED.clear()
    same = torch.equal(results["block-major"][0], results["grouped"][0])
    times = balanced_rounds(calls, rounds)
    ms = {o: median(t) for o, t in times.items()}
    row = {"shape": name, "lens": lens, "heads": h, "heads_k": hk, "head_dim": d,
           "head_group": {o: r[1] for o, r in results.items()}, "bitwise_equal": same,
           "ms": {o: round(t, 4) for o, t in ms.items()},
           "rounds_ms": {o: [round(x, 4) for x in t] for o, t in times.items()},
           "grouped_over_block_major": round(ms["block-major"] / ms["grouped"], 3)}
    print(f"  {name} ({total} tokens) {h}/{hk} d{d}: block-major {ms['block-major']:.3f} ms, grouped "
          f"(head_group {row['head_group']['grouped']}) {ms['grouped']:.3f} ms: "
          f"{row['grouped_over_block_major']:.3f}x, bitwise {same}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--name", default="varlen-gap-h200")
    ap.add_argument("--ragged", action="store_true")
    args = ap.parse_args()
    if args.ragged:
        rows = [ragged_point(*p, args.rounds) for p in RAGGED]
    else:
        rows = [point(*p, rounds=args.rounds) for p in POINTS]
    if args.out:
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "points": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
