"""Check and time the Gluon backward kernels (flashtile.kernels.gluon_backward) on an H200: the dK/dV
kernel and the one that adds dQ too (``fused_dq``, TMA reductions).

    PYTHONPATH=src python benchmarks/gluon_bwd_check.py --out $OUT [--phase check|bench|both]

check: every variant's dK and dV (and dQ for fused_dq variants), and the whole backward as
attention_backward dispatches it (dQ, dK, dV; deterministic and not), against float64 textbook
attention with the project's gradient rule: max error <= 3x textbook attention's error in bf16. Outputs NaN-filled before each call. Cases: d64/d128, causal
and full, Sq != Sk both ways (causal rows that see no key included), odd lengths, GQA and MQA,
batch > 1.
bench: forward + backward TFLOP/s (FA2 counting, 3.5x the forward's FLOPs) of flashtile with the
Gluon dK/dV kernel, flashtile with the portable one, SDPA cudnn and flash, and the dK/dV kernels
alone (Gluon variants against the portable backward minus its dQ pass is not separable, so the
whole backward is timed for each), do_bench medians.

Writes $OUT/gluon-bwd-check.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import torch

from flashtile.kernels import backward as bwd
from flashtile.kernels import gluon_backward as gb
from flashtile.kernels.forward import attention_forward
from flashtile.reference import attention as reference

CASES = [  # (B, Sq, Sk, H, Hk, D, causal)
    (2, 1000, 1500, 8, 2, 128, True),
    (2, 1000, 1500, 8, 2, 128, False),
    (1, 1500, 1000, 4, 4, 128, True),
    (3, 257, 257, 6, 1, 64, True),
    (2, 777, 777, 4, 2, 64, False),
    (1, 4096, 4096, 4, 4, 128, True),
    (1, 64, 3000, 2, 2, 128, True),
    (1, 1, 130, 2, 1, 128, True),
    (1, 2048, 2048, 2, 2, 64, False),
    (2, 1000, 1500, 8, 2, 64, True),
    (1, 1500, 1000, 4, 4, 64, True),
    (1, 64, 3000, 2, 2, 64, True),
]


def variants_for(d: int, causal: bool, every: bool = True):
    base = gb.default_variant(d, "bf16", causal)
    fused = [gb.default_variant(d, "bf16", causal, True)]
    if not every:
        return [base] + fused
    changes = [dict(overlap=not base.overlap), dict(block_m=32, stages=4, overlap=True)]
    changes.append(dict(block_m=64, stages=3 if base.stages == 2 else 2, overlap=True))
    if d == 128:
        changes.append(dict(block_m=32, stages=3, overlap=True))
    return [base] + [dataclasses.replace(base, **c) for c in changes] + fused


def _inputs(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    dout = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    return q, k, v, dout


def _fwd(q, k, v, causal):
    return attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                             window_right=0 if causal else -1, diag_offset=k.shape[1] - q.shape[1])


def _ref_grads(q, k, v, dout, causal, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    o = reference(*leaves, causal=causal)
    o = o[0] if isinstance(o, tuple) else o
    return torch.autograd.grad(o, leaves, dout.to(dtype))


def check(results: list, small: bool = False) -> bool:
    ok_all = True
    for case in CASES:
        if small and case[1] * case[2] > 1500 * 1500:  # --small: the sanitizer's cases
            continue
        b, sq, sk, h, hk, d, causal = case
        torch.manual_seed(hash(case) % 2 ** 31)
        q, k, v, dout = _inputs(b, sq, sk, h, hk, d)
        out, lse = _fwd(q, k, v, causal)
        exact = _ref_grads(q, k, v, dout, causal, torch.float64)
        low = _ref_grads(q, k, v, dout, causal, torch.bfloat16)
        budgets = [max(3 * (lo.double() - e).abs().max().item(), 1e-6) for lo, e in zip(low, exact)]
        lse_c = lse.contiguous()
        delta = torch.empty_like(lse_c).copy_((dout.float() * out.float()).sum(-1).transpose(1, 2))
        for variant in variants_for(d, causal):
            dk = torch.full_like(k, math.nan)
            dv = torch.full_like(v, math.nan)
            # zeros: the reductions add into it; rows no key block reaches must stay 0
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if variant.fused_dq else None
            gb.gluon_dkdv(q, k, v, dout, lse_c, delta, dk, dv, softmax_scale=d ** -0.5, causal=causal,
                          variant=variant, dq_accum=dq)
            torch.cuda.synchronize()
            got = (dk, dv) + ((dq,) if dq is not None else ())
            want, budget = exact[1:] + exact[:1], budgets[1:] + budgets[:1]
            ratios = [(g.double() - e).abs().max().item() / bd for g, e, bd in zip(got, want, budget)]
            ok = all(r <= 1 for r in ratios) and not any(bool(t.isnan().any()) for t in got)
            ok_all &= ok
            rec = {"case": case, "variant": variant.name, "dk_over_budget": ratios[0],
                   "dv_over_budget": ratios[1], "ok": ok}
            if dq is not None:
                rec["dq_over_budget"] = ratios[2]
            results.append(rec)
            print(("PASS" if ok else "FAIL"), case, variant.name,
                  " ".join(f"{n} {r:.3f}" for n, r in zip(("dk", "dv", "dq"), ratios)), flush=True)
        # The whole backward as dispatched: deterministic (portable dQ pass) and not (fused at d128)
        for deterministic in (True, False):
            grads = bwd.attention_backward(dout, q, k, v, out, lse, softmax_scale=d ** -0.5,
                                           window_left=-1, window_right=0 if causal else -1,
                                           diag_offset=sk - sq, deterministic=deterministic)
            torch.cuda.synchronize()
            ratios = [(g.double() - e).abs().max().item() / bd for g, e, bd in zip(grads, exact, budgets)]
            ok = all(r <= 1 for r in ratios) and not any(bool(g.isnan().any()) for g in grads)
            ok_all &= ok
            name = f"attention_backward(deterministic={deterministic})"
            results.append({"case": case, "variant": name, "over_budget": ratios, "ok": ok})
            print(("PASS" if ok else "FAIL"), case, name,
                  " ".join(f"{n} {r:.3f}" for n, r in zip(("dq", "dk", "dv"), ratios)), flush=True)
    return ok_all


def bench(rows: list) -> None:
    import triton.testing
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    for d, points in ((128, ((8, 2048), (4, 4096), (2, 8192), (1, 16384))),
                      (64, ((8, 2048), (4, 4096), (1, 16384)))):
        h = 2048 // d
        for b, n in points:
            for causal in (False, True):
                q, k, v, dout = _inputs(b, n, n, h, h, d)
                flops = 3.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                row = {"d": d, "batch": b, "seqlen": n, "heads": h, "causal": causal}
                out, lse = _fwd(q, k, v, causal)
                fwd_ms = timed(lambda: _fwd(q, k, v, causal))

                def step(gluon, variant=None):
                    bwd.GLUON_DKDV = gluon
                    bwd.GLUON_FUSED_DQ = variant is not None and variant.fused_dq
                    gb._VARIANT_OVERRIDE = variant
                    return fwd_ms + timed(lambda: bwd.attention_backward(
                        dout, q, k, v, out, lse, softmax_scale=d ** -0.5, window_left=-1,
                        window_right=0 if causal else -1, diag_offset=0,
                        deterministic=not bwd.GLUON_FUSED_DQ))

                row["flashtile-triton-bwd"] = flops / step(False) / 1e9
                for variant in variants_for(d, causal, every=False):
                    row[variant.name] = flops / step(True, variant) / 1e9
                bwd.GLUON_DKDV = False
                bwd.GLUON_FUSED_DQ = True
                gb._VARIANT_OVERRIDE = None
                qt, kt, vt, dt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
                leaves = [t.requires_grad_(True) for t in (qt, kt, vt)]
                for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                    def sdpa_step():
                        with sdpa_kernel(backend):
                            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                        return torch.autograd.grad(o, leaves, dt)
                    try:
                        row[name] = flops / timed(sdpa_step) / 1e9
                    except Exception as exc:  # a backend that refuses the shape
                        row[name] = None
                        print(name, "failed:", exc)
                rows.append(row)
                print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--phase", default="both", choices=("check", "bench", "both"))
    ap.add_argument("--small", action="store_true", help="check the small cases only (sanitizer)")
    args = ap.parse_args()
    t0 = time.time()
    checks, rows = [], []
    passed = None
    if args.phase in ("check", "both"):
        passed = check(checks, args.small)
        print(f"check: {'all passed' if passed else 'FAILURES'} ({len(checks)} records)", flush=True)
    if args.phase in ("bench", "both") and passed is not False:
        bench(rows)
    payload = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "check": checks, "bench": rows,
               "method": "fwd+bwd TFLOP/s = 3.5 * 4 * B * H * S^2 * D (halved causal) / (forward ms + "
                         "backward ms), do_bench medians; SDPA: forward + autograd.grad"}
    with open(os.path.join(args.out, "gluon-bwd-check.json"), "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\n{time.time() - t0:.0f} s. fwd+bwd TFLOP/s (vs cudnn)")
    for r in rows:
        names = [n for n in r if n.startswith(("flashtile", "gluon"))]
        cu = r.get("sdpa-cudnn") or float("nan")
        print(f"d{r['d']} B{r['batch']} {r['seqlen']:6d} {'causal' if r['causal'] else 'full  '} | cudnn {cu:4.0f} "
              f"flash {r.get('sdpa-flash') or 0:4.0f} | "
              + "  ".join(f"{n.replace('gluon-bwd-', '')}={r[n]:.0f} ({r[n] / cu:.2f})" for n in names))


if __name__ == "__main__":
    main()
