"""Decode steps through flash_attn_varlen_func on page pools (a few queries a sequence, as vLLM's
FlashAttention backend batches them): the split-KV decode route (interface._varlen_decode) against
the prefill kernels the call ran before, on an H200.

    PYTHONPATH=src python benchmarks/varlen_decode.py [--out DIR] [--rounds N] [--small]

First the checks: ragged query lengths (0 among them) and key lengths (0 among them) on shuffled
pools whose unused slots hold NaN, 16-bit at head dims 64/128/256 (causal, full, window + softcap,
ALiBi) and e4m3 (per-sequence descales): each sequence against float64 attention (16-bit: the test
suite's rule; e4m3: on the dequantized inputs, 2x textbook bf16's error, LSE within 1e-3), and a
call captured in a CUDA graph replayed as the key lengths change in place, each replay against
float64 on the keys it covers. ``--small``: the checks on small shapes only (the sanitizer's run); ``--check-only``: no timing. Then CUDA-graph replays
in balanced rounds: the shipped call, the call with the route off (interface.VARLEN_DECODE_MAX_QUERIES
= 0), and flash_attn_with_kvcache on the same pools with q as (B, Sq, H, D). Writes varlen-decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import assert_matches_reference  # noqa: E402

import flashtile  # noqa: E402
from flashtile import interface  # noqa: E402
from flashtile.reference import attention as textbook  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_gather import graph_rounds  # noqa: E402
from varlen_paged_fp8 import quantize  # noqa: E402

DEV = "cuda"


def offsets(lens):
    return torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)


def case_tensors(lens_q, lens_k, heads, heads_k, d, page, fp8, dtype=torch.bfloat16):
    """Packed q (and e4m3 descales), pools and table; also the dequantized packed tensors."""
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    if fp8:
        q, qd, dq = quantize(torch.randn(sum(lens_q), heads, d, device=DEV) * 2, cu_q, heads_k)
        k, kd, dk = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV), cu_k, heads_k)
        v, vd, dv = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV), cu_k, heads_k)
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        plain = (dq, dk, dv)
    else:
        q = torch.randn(sum(lens_q), heads, d, device=DEV, dtype=dtype)
        k = torch.randn(sum(lens_k), heads_k, d, device=DEV, dtype=dtype)
        v = torch.randn_like(k)
        descales, plain = {}, (q, k, v)
    k_pool, v_pool, table = fuzz_gpu._varlen_pools(k, v, lens_k, page, nan_fill=True)
    return cu_q, cu_k, q, k_pool, v_pool, table, descales, plain


def check_sequences(out, lse, plain, cu_q, cu_k, fp8, kw):
    worst = 0.0
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.stop == sq.start:
            continue
        kwb = dict(kw)
        if "alibi_slopes" in kwb:
            kwb["alibi_slopes"] = kwb["alibi_slopes"][b:b + 1]
        q, k, v = (t[s].unsqueeze(0) for t, s in zip(plain, (sq, sk, sk)))
        if not fp8:
            err, budget = assert_matches_reference(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), q, k, v, **kwb)
        else:
            ref, ref_lse = textbook(q.double(), k.double(), v.double(), **kwb)
            low, _ = textbook(*(t.to(torch.bfloat16) for t in (q, k, v)), **kwb)
            err = (out[sq].double() - ref[0]).abs().max().item() if torch.isfinite(out[sq]).all() else math.inf
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            seen = torch.isfinite(ref_lse[0])
            assert torch.isinf(lse[:, sq][~seen]).all() and (out[sq].transpose(0, 1)[~seen] == 0).all()
            assert (lse[:, sq].double()[seen] - ref_lse[0][seen]).abs().max().item() <= 1e-3 if seen.any() else True
            assert err <= budget, f"sequence {b}: error {err:.3g} over {budget:.3g}"
        worst = max(worst, err / budget if budget else 0.0)
    return worst


CHECKS = [  # (d, heads, heads_k, page, fp8, dtype, kw, lens_q, lens_k)
    (128, 32, 8, 16, False, torch.bfloat16, dict(causal=True), [1, 0, 3, 2, 16], [700, 17, 0, 4000, 9]),
    (128, 32, 8, 1, False, torch.bfloat16, dict(), [1, 1, 1, 1], [5, 1, 3000, 0]),
    (64, 8, 1, 3, False, torch.float16, dict(window_size=(100, 2), softcap=20.0), [4, 1, 7], [900, 3, 64]),
    (256, 16, 2, 64, False, torch.bfloat16, dict(causal=True, alibi=True), [2, 5, 1], [1000, 5, 0]),
    (128, 12, 2, 256, False, torch.float16, dict(causal=True), [8] * 3, [8, 300, 2500]),
    (128, 32, 8, 16, True, None, dict(causal=True), [1, 0, 3, 2], [700, 17, 0, 4000]),
    (128, 16, 2, 1, True, None, dict(softcap=30.0), [1, 4, 1], [5, 1500, 2]),
    (256, 8, 2, 16, True, None, dict(causal=True), [2, 1], [333, 2048]),
]
SMALL_CHECKS = [
    (128, 8, 2, 16, False, torch.bfloat16, dict(causal=True), [1, 0, 3], [70, 17, 200]),
    (64, 4, 1, 3, False, torch.float16, dict(window_size=(20, 1), softcap=10.0), [2, 1], [90, 3]),
    (128, 8, 2, 1, True, None, dict(causal=True), [1, 2, 0], [50, 7, 3]),
]


def run_checks(small: bool) -> list:
    records = []
    for d, h, hk, page, fp8, dtype, kw, lens_q, lens_k in (SMALL_CHECKS if small else CHECKS):
        kw = dict(kw)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(len(lens_q), h, device=DEV)
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, h, hk, d, page, fp8,
                                                                            dtype)
        label = f"{'e4m3' if fp8 else str(dtype)[6:]} d{d} {h}/{hk} page {page} {sorted(kw)} q{lens_q} k{lens_k}"
        try:
            out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                                           block_table=table, return_attn_probs=True, **descales, **kw)
            worst = check_sequences(out, lse, plain, cu_q, cu_k, fp8, kw)
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: {worst:.3f} of the budget", flush=True)
        except Exception as exc:  # a failing check is a result here
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    # one capture, replayed as the key lengths change in place (bf16 and e4m3), each replay against
    # float64 on the keys its lengths cover (eager calls on short caches may run another plan: one
    # launch without the split, so replays and eager calls need not agree bit for bit)
    for fp8 in (False, True):
        lens_q, lens_k = [1, 2, 1], [300, 40, 1000]
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, 8, 2, 128, 16, fp8)
        first_k = cu_k.clone()

        def call():
            return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 2, 1000, block_table=table,
                                                    causal=True, return_attn_probs=True, **descales)[:2]
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed, graphed_lse = call()
        worst, label = 0.0, f"CUDA graph replay as the key lengths change ({'e4m3' if fp8 else 'bf16'})"
        try:
            for new in ([300, 40, 1000], [299, 39, 999], [0, 5, 2], [1, 40, 512]):  # (within the keys written)
                cu_k.copy_(offsets(new))
                graph.replay()
                torch.cuda.synchronize()
                # sequence b's first new[b] keys, at first_k[b] in the packed tensors
                starts = first_k[:-1].tolist()
                keys = [torch.cat([t[s:s + n] for s, n in zip(starts, new)]) for t in plain[1:]]
                worst = max(worst, check_sequences(graphed, graphed_lse, (plain[0], *keys), cu_q, offsets(new), fp8,
                                                   dict(causal=True)))
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: 4 replays, {worst:.3f} of the budget", flush=True)
        except Exception as exc:
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return records


POINTS = [  # (B, Sq, keys, heads, heads_k, page, fp8)
    (64, 1, 4096, 32, 8, 16, False), (64, 1, 4096, 32, 8, 1, False), (16, 4, 8192, 32, 8, 16, False),
    (16, 16, 8192, 32, 8, 16, False), (128, 1, 2048, 12, 2, 16, False), (8, 1, 32768, 32, 8, 16, False),
    (64, 1, 4096, 32, 8, 16, True), (16, 4, 8192, 32, 8, 16, True), (16, 1, 8192, 32, 8, 1, True),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    checks = run_checks(args.small)
    ok = all(c["ok"] for c in checks)
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", flush=True)
    rows = []
    for batch, sq, sk, h, hk, page, fp8 in ([] if args.small or args.check_only else POINTS):
        cu_q, cu_k, q, k_pool, v_pool, table, descales, _ = case_tensors([sq] * batch, [sk] * batch, h, hk, 128,
                                                                         page, fp8)
        shipped_max = interface.VARLEN_DECODE_MAX_QUERIES

        def varlen(max_queries):
            def run():
                interface.VARLEN_DECODE_MAX_QUERIES = max_queries
                try:
                    return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, sq, sk, block_table=table,
                                                            causal=True, **descales)
                finally:
                    interface.VARLEN_DECODE_MAX_QUERIES = shipped_max
            return run
        lengths = torch.full((batch,), sk, dtype=torch.int32, device=DEV)
        kv_descales = {}
        if fp8:
            kv_descales = dict(k_descale=descales["k_descale"], v_descale=descales["v_descale"],
                               q_descale=descales["q_descale"])

        def kvcache():
            return flashtile.flash_attn_with_kvcache(q.view(batch, sq, h, 128), k_pool, v_pool, cache_seqlens=lengths,
                                                     block_table=table, causal=True, **kv_descales)
        med = graph_rounds({"shipped": varlen(shipped_max), "prefill kernels": varlen(0), "kvcache": kvcache},
                           args.rounds)
        nbytes = 2 * batch * sk * hk * 128 * (1 if fp8 else 2)
        rec = {"batch": batch, "seqlen_q": sq, "keys": sk, "heads": [h, hk], "page": page, "fp8": fp8, "us": med,
               "speedup": round(med["prefill kernels"] / med["shipped"], 2),
               "shipped_gbps": round(nbytes / med["shipped"] / 1e3, 1)}
        rows.append(rec)
        print(f"B{batch:<4d} Sq{sq:<3d} {sk:6d} keys {h}/{hk} P{page:<3d} {'e4m3' if fp8 else 'bf16'}  shipped "
              f"{med['shipped']:8.1f} us ({rec['shipped_gbps']:6.1f} GB/s)  prefill kernels {med['prefill kernels']:8.1f} us"
              f"  kvcache {med['kvcache']:8.1f} us  speedup {rec['speedup']:.2f}x", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "varlen-decode.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "checks": checks, "points": rows}, f, indent=1)
    print("PASS" if ok else "FAIL", "checks")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
