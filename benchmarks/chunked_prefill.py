"""Chunked prefill against a KV cache: flash_attn_with_kvcache with many query positions (Sq up to
thousands, causal bottom-right), checked against float64 attention and timed against the prefill
forward (flash_attn_func) on the same keys.

    PYTHONPATH=src python benchmarks/chunked_prefill.py --out $OUT [--points 'B,H,Hk,ctx,Sq;...']
        [--configs 'block_n,warps,stages[,waves[,pdl[,min split keys]]];...']

Each point: a contiguous bf16 cache of ``ctx`` keys per sequence (all filled, the chunk's own keys
included, as after the append), q (B, Sq, H, 128). The check covers the first KV head's query heads
of the first and last sequence (the accuracy rule: 2x textbook attention in bf16). Timing:
triton.testing.do_bench median of one call (the cache is read warm; at these sizes the step is
compute-bound), TFLOP/s as FlashAttention-2 counts a causal forward. ``--configs``: the Triton
decode kernel forced to these plans too. Writes chunked-prefill.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

import flashtile
from flashtile import reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import forced  # noqa: E402
from spec_decode_ab import config_name, triton_config  # noqa: E402

POINTS = ("1,32,8,8192,1;1,32,8,8192,16;1,32,8,8192,64;1,32,8,8192,128;1,32,8,8192,512;"
          "1,32,8,8192,2048;4,12,2,4096,512;2,32,8,16384,1024")


def causal_flops(batch, heads, seqlen_q, seqlen_k, head_dim):
    """4 * d per visible (query, key) pair, bottom-right causal."""
    visible = sum(min(seqlen_k, seqlen_k - seqlen_q + i + 1) for i in range(seqlen_q))
    return 4.0 * batch * heads * head_dim * visible


def check(out, q, k, v):
    worst = 0.0
    group = q.shape[2] // k.shape[2]
    for b in sorted({0, q.shape[0] - 1}):
        qb, kb, vb = q[b:b + 1, :, :group], k[b:b + 1, :, :1], v[b:b + 1, :, :1]
        ref, _ = reference.attention(qb.double(), kb.double(), vb.double(), causal=True)
        low, _ = reference.attention(qb, kb, vb, causal=True)
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        got = out[b:b + 1, :, :group].double()
        err = (got - ref).abs().max().item() if torch.isfinite(got).all() else math.inf
        worst = max(worst, err / budget)
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--configs", default="")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    device = torch.device("cuda")
    records = []
    print(f"{'point':28s} {'kvcache us':>11s} {'TFLOP/s':>8s} {'check':>6s} {'prefill us':>11s} "
          f"{'TFLOP/s':>8s} {'kvcache/prefill':>15s}", flush=True)
    for text in args.points.split(";"):
        batch, heads, heads_k, ctx, seqlen_q = (int(x) for x in text.split(","))
        torch.manual_seed(0)
        q = torch.randn(batch, seqlen_q, heads, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, ctx, heads_k, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn(batch, ctx, heads_k, 128, device=device, dtype=torch.bfloat16)
        lengths = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        flops = causal_flops(batch, heads, seqlen_q, ctx, 128)
        record = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": ctx, "seqlen_q": seqlen_q,
                  "flops": flops}

        def kvcache():
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)

        def prefill():
            return flashtile.flash_attn_func(q, k, v, causal=True)
        providers = [("kvcache", kvcache), ("prefill", prefill)]
        providers += [(f"kvcache {config_name(c)}", forced(lambda layer: kvcache(), False,
                                                           decode_config=triton_config(*c)))
                      for c in configs]
        for name, fn in providers:
            if name.startswith("kvcache "):
                fn = (lambda f: lambda: f(0))(fn)
            try:
                out = fn()
                torch.cuda.synchronize()
                record[f"{name}_check"] = check(out, q, k, v)
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                record[f"{name}_us"] = ms * 1e3
                record[f"{name}_tflops"] = flops / ms / 1e9
            except Exception as exc:  # a failing call is a result here
                record[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                torch.cuda.synchronize()
        records.append(record)

        def cell(name):
            if f"{name}_error" in record:
                return f"{'error':>11s} {'':>8s}"
            return f"{record[name + '_us']:11.1f} {record[name + '_tflops']:8.1f}"
        ratio = (record["prefill_us"] / record["kvcache_us"]
                 if "kvcache_us" in record and "prefill_us" in record else float("nan"))
        print(f"B{batch} {heads}/{heads_k} ctx{ctx} Sq{seqlen_q:<6d} {cell('kvcache')} "
              f"{record.get('kvcache_check', math.nan):6.3f} {cell('prefill')} {ratio:15.3f}", flush=True)
        for name, _ in providers[2:]:
            if f"{name}_us" in record:
                print(f"  {name:40s} {record[name + '_us']:9.1f} us {record[name + '_tflops']:6.1f} TFLOP/s "
                      f"check {record[name + '_check']:.3f}", flush=True)
        for name, _ in providers:
            if f"{name}_error" in record:
                print(f"  {name}: {record[name + '_error']}", flush=True)
        q = k = v = out = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "chunked-prefill.json"), "w") as f:
        json.dump({"points": records}, f, indent=1)


if __name__ == "__main__":
    main()
