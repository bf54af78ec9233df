"""flash_attn_func with few query tiles against long keys: the Gluon forward (one CTA per 128 query
positions and head, no key split) against the split-KV decode kernel on the same tensors
(flash_attn_with_kvcache with cache_seqlens = Sk, the chunked-prefill route off), both causal
bottom-right or both full, each call replayed from a CUDA graph (chunked_prefill.graph_time).

    PYTHONPATH=src python benchmarks/short_queries.py --out $OUT [--points 'B,H,Hk,Sq,Sk,causal;...']

Every decode-kernel result is checked against float64 attention on the first KV head's query
heads of the first sequence (error / the accuracy rule's budget). "forward" is flash_attn_func as
dispatched (since forward.split_keys_wanted, the decode kernel where it holds), "gluon" the Gluon
forward with that rule off, with SDPA's flash and cudnn backends on the same tensors as anchors
(bottom-right causal mask). First, ``check_routed``: flash_attn_func on shapes the rule sends to the
decode kernel, output, LSE and gradients against float64 (2x / 3x the bf16 textbook error).
Writes short-queries.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import flashtile
from flashtile import reference
from flashtile.kernels import decode as dec
from flashtile.kernels import forward as fwd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunked_prefill import graph_time, sdpa_call  # noqa: E402

POINTS = ";".join(f"{b},{h},{hk},{sq},{sk},{c}" for (b, h, hk) in ((1, 32, 8), (1, 12, 2), (2, 32, 8))
                  for sq in (128, 256) for sk in (1024, 2048, 4096, 16384, 65536) for c in (1,))
POINTS += ";1,32,8,128,8192,0;1,12,2,256,8192,0;4,32,8,128,8192,1;1,64,8,128,8192,1"


def budget_check(out, q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    qb, kb, vb = q[:1, :, :group], k[:1, :, :1], v[:1, :, :1]
    ref, _ = reference.attention(qb.double(), kb.double(), vb.double(), causal=causal)
    low, _ = reference.attention(qb, kb, vb, causal=causal)
    budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
    got = out[:1, :, :group].double()
    return (got - ref).abs().max().item() / budget if torch.isfinite(got).all() else math.inf


# (B, H, Hk, Sq, Sk, D, causal): each routed on an H200 (work tiles <= a quarter of the SMs)
ROUTED_CHECKS = ((1, 8, 2, 200, 3000, 128, True), (2, 4, 4, 64, 1500, 64, False),
                 (1, 16, 1, 256, 5000, 256, True), (3, 5, 5, 1, 1024, 128, True))


def check_routed(device) -> list:
    records = []
    for batch, heads, heads_k, seqlen_q, seqlen_k, d, causal in ROUTED_CHECKS:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        routed = fwd.split_keys_wanted(batch, seqlen_q, heads, seqlen_k, sms)
        q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, seqlen_k, heads_k, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        refs = {}
        for name, dtype in (("f64", torch.float64), ("low", torch.bfloat16)):
            qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
            o, l = reference.attention(qq, kk, vv, causal=causal)
            refs[name] = (o, l, torch.autograd.grad(o, (qq, kk, vv), dout.to(dtype)))
        ref_o, ref_l, ref_g = refs["f64"]
        low_o, _, low_g = refs["low"]
        ratios = [(out.double() - ref_o).abs().max().item()
                  / (2 * (low_o.double() - ref_o).abs().max().item() + 1e-6)]
        ratios += [(g.double() - r).abs().max().item() / (3 * (lg.double() - r).abs().max().item() + 1e-6)
                   for g, r, lg in zip(grads, ref_g, low_g)]
        lse_err = (lse.double() - ref_l).abs().max().item()
        worst = max(ratios + [lse_err / 1e-3])
        records.append({"case": [batch, heads, heads_k, seqlen_q, seqlen_k, d, causal], "routed": routed,
                        "err_over_budget": ratios, "lse_err": lse_err, "ok": routed and worst <= 1})
        print(f"check B{batch} {heads}/{heads_k} Sq{seqlen_q} Sk{seqlen_k} d{d} causal={causal}: "
              f"routed {routed}, out/dq/dk/dv error over budget "
              f"{' / '.join(f'{r:.3f}' for r in ratios)}, lse {lse_err:.1e}", flush=True)
    return records


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(1)
    checks = check_routed(device)
    print(f"routed checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", flush=True)
    records = []
    print(f"{'point':34s} {'tiles':>5s} {'gluon us':>10s} {'decode us':>10s} {'gl/dec':>7s} {'check':>6s} "
          f"{'forward us':>10s}")
    for text in args.points.split(";"):
        batch, heads, heads_k, seqlen_q, seqlen_k, causal = (int(x) for x in text.split(","))
        torch.manual_seed(0)
        q = torch.randn(batch, seqlen_q, heads, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, heads_k, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)

        def forward():
            return flashtile.flash_attn_func(q, k, v, causal=bool(causal))

        def decode_kernel():
            saved, dec.PREFILL_MIN_QUERIES = dec.PREFILL_MIN_QUERIES, 1 << 30
            try:
                return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=bool(causal))
            finally:
                dec.PREFILL_MIN_QUERIES = saved
        def gluon():
            saved, fwd.SPLIT_KEYS_MAX_TILES_PER_SM = fwd.SPLIT_KEYS_MAX_TILES_PER_SM, 0.0
            try:
                return forward()
            finally:
                fwd.SPLIT_KEYS_MAX_TILES_PER_SM = saved
        check = budget_check(decode_kernel(), q, k, v, bool(causal))
        gluon_us = graph_time(gluon) * 1e3
        dec_us = graph_time(decode_kernel) * 1e3
        fwd_us = graph_time(forward) * 1e3
        anchors = {}
        for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
            try:
                anchors[f"{name}_us"] = graph_time(sdpa_call(q, k, v, bool(causal), backend)) * 1e3
            except Exception as exc:  # a refused shape is a result here
                anchors[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.synchronize()
        tiles = batch * heads * -(-seqlen_q // 128)
        records.append({"batch": batch, "heads": heads, "heads_k": heads_k, "seqlen_q": seqlen_q,
                        "seqlen_k": seqlen_k, "causal": bool(causal), "work_tiles": tiles, "sms": sms,
                        "gluon_us": gluon_us, "decode_us": dec_us, "decode_check": check,
                        "forward_us": fwd_us, **anchors})
        print(f"B{batch} {heads}/{heads_k} Sq{seqlen_q} Sk{seqlen_k} {'causal' if causal else 'full':6s} "
              f"{tiles:5d} {gluon_us:10.1f} {dec_us:10.1f} {gluon_us / dec_us:7.2f} {check:6.3f} "
              f"{fwd_us:10.1f} sdpa flash {anchors.get('sdpa_flash_us', math.nan):7.1f} "
              f"cudnn {anchors.get('sdpa_cudnn_us', math.nan):7.1f}", flush=True)
        q = k = v = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "short-queries.json"), "w") as f:
        json.dump({"checks": checks, "points": records}, f, indent=1)


if __name__ == "__main__":
    main()
