"""A/B timing of Gluon forward variants on an H200: rounds of do_bench in a fresh order each round,
medians over the rounds, so that run-to-run drift (up to 10% within one run for the same kernel)
does not decide a default. SDPA cuDNN is timed in every round as the anchor.

    PYTHONPATH=src python benchmarks/gluon_ab.py --out $OUT --group NAME[,NAME...] [--rounds 5]

``--group`` names comma-separated variant names of one head dim, mask and dtype family (bf16 or
fp8; fp8 variants run on quantized inputs as gluon_check.py prepares them, next to the portable
e4m3 kernel on the same tensors); several --group
options run one after another. A name may end in ``@heads`` or ``@blocks``: the causal work
tiles in (batch, head)-major or query-block-major order instead of what dispatch picks; ``@gN``:
in groups of N (batch, head) pairs, each group query-block-major. Shapes: gluon_check.SHAPES or --seqlens (16k tokens), --heads (16). Writes
$OUT/gluon-ab.json; prints medians and each variant's ratio to the first of its group.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_check import SHAPES, fp8_inputs  # noqa: E402


ORDERS = {"": None, "heads": 1, "blocks": 0}


def _parse(entry, by_name):
    """(variant, order keywords) of a --group entry ``name[@heads|@blocks|@gN]`` (@gN: causal
    work tiles in groups of N (batch, head) pairs)."""
    name, _, order = entry.partition("@")
    if order.startswith("g"):
        return by_name[name], {"head_group": int(order[1:])}
    return by_name[name], {"head_group": ORDERS[order]}


def _runs(entries, b, s, by_name, h=16):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.kernels.gluon_forward import gluon_attention_forward

    parsed = {entry: _parse(entry, by_name) for entry in entries}
    variants = [var for var, _ in parsed.values()]
    d, causal = variants[0].head_dim, variants[0].causal
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d ** -0.5
    runs = {}
    if variants[0].fp8:
        z, blocks, descales = fp8_inputs(q, k, v, variants)
        for entry, (var, order) in parsed.items():
            runs[entry] = (lambda var=var, order=order: gluon_attention_forward(
                z.q, z.k, z.v, softmax_scale=scale, causal=causal, variant=var, descales=descales,
                scale_blocks=blocks, **order))
        # The portable e4m3 kernel on the same tensors: what dispatch runs where Gluon does not.
        from flashtile.kernels.forward import attention_forward, pick_config
        cfg = pick_config(d, q.device, True)
        runs["fp8-triton"] = lambda: attention_forward(
            z.q, z.k, z.v, softmax_scale=scale, window_left=-1, window_right=0 if causal else -1,
            diag_offset=0, descales=(z.q_descale, z.k_descale, z.v_descale), scale_blocks=blocks,
            config=cfg)
    else:
        for entry, (var, order) in parsed.items():
            runs[entry] = (lambda var=var, order=order: gluon_attention_forward(
                q, k, v, softmax_scale=scale, causal=causal, variant=var, **order))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    runs["sdpa-cudnn"] = cudnn
    return runs, 4 * b * h * s * s * d / (2 if causal else 1)


def main():
    import triton.testing

    from flashtile.kernels.gluon_forward import GLUON_VARIANTS

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--group", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlens", default="", help="comma list of lengths (batch = 16k tokens / "
                    "length); default: gluon_check.SHAPES")
    args = ap.parse_args()
    by_name = {v.name: v for v in GLUON_VARIANTS}
    rng = random.Random(0)
    results = []
    for group in args.group:
        entries = group.split(",")
        shapes = ([(max(1, 16384 // int(n)), int(n)) for n in args.seqlens.split(",")]
                  if args.seqlens else SHAPES)
        for b, s in shapes:
            torch.manual_seed(0)
            runs, flops = _runs(entries, b, s, by_name, args.heads)
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                order = list(runs)
                rng.shuffle(order)
                for name in order:
                    times[name].append(triton.testing.do_bench(runs[name], warmup=10, rep=40,
                                                               return_mode="median"))
            tflops = {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}
            spread = {n: (max(t) - min(t)) / statistics.median(t) for n, t in times.items()}
            rec = {"group": group, "batch": b, "seqlen": s, "heads": args.heads, "tflops": tflops,
                   "spread": spread}
            results.append(rec)
            first = entries[0]
            print(f"B={b} S={s:5d} " + "  ".join(
                f"{n.replace('gluon-', '')}={v:.0f} ({v / tflops[first]:.3f}, spread {spread[n]:.0%})"
                for n, v in tflops.items()), flush=True)
            del runs
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gluon-ab.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
                   "method": "TFLOP/s from the median over rounds of do_bench medians (warmup 10 ms, "
                             "rep 40 ms), variant order shuffled each round",
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
