"""Host time of a packed forward call, and where the Gluon backward's packed threshold sits.

    PYTHONPATH=src python benchmarks/varlen_host.py [--out DIR] [--rounds N] [--threshold] [--bitwise-only]

1. Host microseconds per call (200 enqueued calls, least of 5 rounds) of flash_attn_varlen_func
   against flash_attn_func on the same tokens (8 x 64, 16/16 heads, d128, causal: the GPU work is
   negligible), and of the layers under the packed call; then a cProfile of 500 packed calls.
2. Packed training steps (forward + backward) under the dispatch threshold of the fused Gluon
   backward (programs = total keys / 128 x Hk < SM count): the step with the Gluon backward forced
   against the portable one that the threshold picks, in balanced rounds of do_bench, with the
   gradients of the two compared against a float64 reference (the 3x-textbook gradient rule).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_host import host_us  # noqa: E402
from window_probe import balanced_rounds, median  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels import backward as bwd_mod  # noqa: E402
from flashtile.kernels import gluon_backward  # noqa: E402
from flashtile.kernels import gluon_forward as gf  # noqa: E402
from flashtile.kernels.forward import _gluon_varlen, attention_forward  # noqa: E402


def host_section(dev) -> dict:
    b, n, h, d = 8, 64, 16, 128
    q = torch.randn(b * n, h, d, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)
    q4, k4, v4 = (t.reshape(b, n, h, d) for t in (q, k, v))
    out, lse = torch.empty_like(q), torch.empty(h, b * n, device=dev)
    scale = d ** -0.5
    pieces = {
        "flash_attn_func (B, S)": lambda: flashtile.flash_attn_func(q4, k4, v4, causal=True),
        "flash_attn_varlen_func": lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True),
        "attention_forward (packed)": lambda: attention_forward(
            q, k, v, softmax_scale=scale, window_left=-1, window_right=0, diag_offset=0,
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n),
        "_gluon_varlen": lambda: _gluon_varlen(
            q, k, v, cu, cu, n, n, softmax_scale=scale, window_left=-1, window_right=0, softcap=0.0,
            alibi_slopes=None, out=None, lse=None, config=None, dropout_seed=None,
            descales=(None, None, None), scale_blocks=(0, 0)),
        "varlen_supported": lambda: gf.varlen_supported(q, k, v, cu, cu, True),
        "gluon_varlen_forward (out, lse given)": lambda: gf.gluon_varlen_forward(
            q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True, out=out, lse=lse),
        "torch.empty out + lse": lambda: (torch.empty_like(q), torch.empty(h, b * n, device=dev)),
    }
    result = {}
    with torch.no_grad():
        for name, fn in pieces.items():
            result[name] = round(host_us(fn), 1)
            print(f"  {name:45s} {result[name]:7.1f} us", flush=True)
        profile = cProfile.Profile()
        for _ in range(20):
            flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
        profile.enable()
        for _ in range(500):
            flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
        profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[-6000:], flush=True)
    return result


def bitwise_section(dev) -> list[dict]:
    """flash_attn_varlen_func (the cached plan's launch) against gluon_varlen_forward called directly
    (the general path): out and LSE bitwise equal, on ragged batches with Sq != Sk, GQA/MQA, d64-256."""
    rows = []
    for lens_q, lens_k, h, hk, d, causal, dtype in (
            ([5, 300, 0, 129], [7, 300, 40, 1], 8, 2, 128, True, torch.bfloat16),
            ([1000, 3000, 17], [1000, 3500, 17], 16, 16, 64, False, torch.float16),
            ([2048] * 4, [2048] * 4, 12, 1, 256, True, torch.bfloat16),
            ([777, 5000], [900, 5000], 6, 2, 256, False, torch.bfloat16)):
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), device=dev, dtype=torch.int32)
        q = torch.randn(sum(lens_q), h, d, device=dev, dtype=dtype)
        k, v = (torch.randn(sum(lens_k), hk, d, device=dev, dtype=dtype) for _ in range(2))
        gf._PACKED.clear()
        with torch.no_grad():
            out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                        causal=causal, return_attn_probs=True)[:2]
            planned = len(gf._PACKED) == 1 and next(iter(gf._PACKED.values())) is not None
            ref = gf.gluon_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          softmax_scale=d ** -0.5, causal=causal)
        same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        rows.append({"lens_q": lens_q, "lens_k": lens_k, "heads": h, "heads_k": hk, "head_dim": d,
                     "causal": causal, "planned": planned, "bitwise_equal": same})
        print(f"  {lens_q} {lens_k} {h}/{hk} d{d} causal={causal}: planned {planned}, bitwise equal {same}",
              flush=True)
    return rows


def _reference_grads(q, k, v, dout, cu, causal, dtype):
    """Per-sequence textbook attention in ``dtype`` (float64: the reference): (dq, dk, dv)."""
    grads = [torch.zeros_like(t, dtype=dtype) for t in (q, k, v)]
    for s in range(cu.numel() - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = (t[lo:hi].detach().to(dtype).requires_grad_() for t in (q, k, v))
        group = qs.shape[1] // ks.shape[1]
        kk, vv = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * qs.shape[-1] ** -0.5
        if causal:
            mask = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), dout[lo:hi].to(dtype))
        grads[0][lo:hi], grads[1][lo:hi], grads[2][lo:hi] = gq, gk, gv
    return grads


# (sequence lengths, H, Hk, D): every one under the threshold (total keys / 128 x Hk < 132) but the last
THRESHOLD_CASES = [([4096, 4096], 12, 2, 128), ([1024] * 4, 12, 2, 128), ([256, 256], 16, 16, 128),
                   ([8192], 8, 1, 128), ([2048] * 4, 16, 2, 64), ([3000, 1100, 2500, 1500], 32, 4, 128)]
# --threshold-set b: d128 between 64 and 131 programs (80, 96, 112, 128), and d64 at 128 again
THRESHOLD_CASES_B = [([2560, 2560], 12, 2, 128), ([3072, 3072], 12, 2, 128), ([3584, 3584], 12, 2, 128),
                     ([4096, 4096], 12, 2, 128), ([1024] * 8, 12, 2, 128), ([1536, 1536], 16, 4, 128),
                     ([768, 768], 32, 8, 128), ([6144, 6144], 8, 1, 128), ([5000, 1000, 1000], 12, 2, 128),
                     ([2048] * 4, 16, 2, 64)]
# --threshold-set c: out of sample for a rule read off set b (fused from 96 programs where the longest
# sequence has >= 3584 keys): predicted wins, predicted losses, and full masks
THRESHOLD_CASES_C = [([4096, 2560], 12, 2, 128), ([4096, 2048], 12, 2, 128), ([3840, 3840], 12, 2, 128),
                     ([12288], 8, 1, 128), ([16384], 4, 1, 128), ([3200, 3072], 12, 2, 128),
                     ([2048, 1920], 16, 4, 128), ([4096, 4096], 12, 2, 128, False),
                     ([3072, 3072], 12, 2, 128, False), ([1024] * 8, 12, 2, 128, False)]


def threshold_section(dev, rounds: int, cases=THRESHOLD_CASES) -> list[dict]:
    real_programs = gluon_backward.programs
    rows = []
    for lens, h, hk, d, *mask in cases:
        causal = mask[0] if mask else True
        total = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)
        n = max(lens)
        programs = -(-total // 128) * hk

        def step():
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        def forced():
            gluon_backward.programs = lambda *a: 1 << 30
            try:
                return step()
            finally:
                gluon_backward.programs = real_programs

        modes = {}
        shipped_mode = bwd_mod.gluon_backward_mode

        def recording(*a, **kw):
            mode = shipped_mode(*a, **kw)
            modes[current[0]] = mode
            return mode
        current = ["portable"]
        bwd_mod.gluon_backward_mode = recording
        check = {}
        if total <= 12288:
            ref = _reference_grads(q, k, v, dout, cu, causal, torch.float64)
            text = _reference_grads(q, k, v, dout, cu, causal, torch.bfloat16)
            for name, fn in (("portable", step), ("gluon", forced)):
                current[0] = name
                got = fn()
                ratios = []
                for g, r, t in zip(got, ref, text):
                    err = (g.double() - r).abs().max().item()
                    budget = 3 * (t.double() - r).abs().max().item()
                    ratios.append(err / budget if budget > 0 else float("inf"))
                check[name] = round(max(ratios), 3)
        if not check:
            for name, fn in (("portable", step), ("gluon", forced)):
                current[0] = name
                fn()
        bwd_mod.gluon_backward_mode = shipped_mode
        times = balanced_rounds({"portable": step, "gluon": forced}, rounds)
        flops = sum(4 * s * s * d * h for s in lens) / (2 if causal else 1) * 3.5
        row = {"lens": lens, "heads": h, "heads_k": hk, "head_dim": d, "causal": causal, "programs": programs,
               "ms": {name: round(median(t), 4) for name, t in times.items()},
               "rounds_ms": {name: [round(x, 4) for x in t] for name, t in times.items()},
               "err_over_budget": check, "backward_modes": dict(modes)}
        row["tflops"] = {name: round(flops / ms * 1e-9, 1) for name, ms in row["ms"].items()}
        row["gluon_over_portable"] = round(row["ms"]["portable"] / row["ms"]["gluon"], 3)
        rows.append(row)
        print(f"  {lens} {h}/{hk} d{d}{'' if causal else ' full'} programs {programs}: "
              f"portable {row['ms']['portable']:.3f} ms, "
              f"gluon {row['ms']['gluon']:.3f} ms ({row['gluon_over_portable']:.3f}x), "
              f"err/budget {check}, modes {modes}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threshold", action="store_true", help="also the backward's threshold probe")
    ap.add_argument("--name", default="varlen-host-h200")
    ap.add_argument("--bitwise-only", action="store_true", help="only the bitwise check (for compute-sanitizer)")
    ap.add_argument("--threshold-only", choices=("a", "b", "c"), help="only the threshold probe, on a case set")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.bitwise_only:
        rows = bitwise_section(dev)
        return 0 if all(r["planned"] and r["bitwise_equal"] for r in rows) else 1
    if args.threshold_only:
        cases = {"a": THRESHOLD_CASES, "b": THRESHOLD_CASES_B, "c": THRESHOLD_CASES_C}[args.threshold_only]
        result = {"gpu": torch.cuda.get_device_name(), "threshold": threshold_section(dev, args.rounds, cases)}
        if args.out:
            with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
                json.dump(result, f, indent=1)
        return 0
    print("host us per call (least of 5 rounds of 200 enqueued calls):", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "host_us": host_section(dev)}
    print("the cached plan's launch against the general path:", flush=True)
    result["bitwise"] = bitwise_section(dev)
    if args.threshold:
        print("packed training steps under the fused backward's threshold:", flush=True)
        result["threshold"] = threshold_section(dev, args.rounds)
    if args.out:
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
