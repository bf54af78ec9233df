"""Training with the logit softcap (flash_attn's ``softcap``, Gemma 2's 50.0): the fused Gluon
backward's softcap variants (backward.GLUON_SOFTCAP) checked and timed against the portable
backward that ran softcapped gradients before them, and the softcap's tanh by tanh.approx in the
forward and backward of a training step (forward.SOFTCAP_APPROX_TRAIN) against exp2's formula.

    PYTHONPATH=src python benchmarks/softcap_train.py --out $OUT [--rounds N] [--check-only] [--small]

Checks: gradients of flash_attn_func and flash_attn_varlen_func with the softcap (inputs x3, so that
scores pass the cap's knee) at head dims 64 and 128, full, causal, sliding windows (Gemma 2's local
layers), Sq != Sk (also Sq > Sk: rows that see no key), lengths off the tiles, batch > 1, GQA and
MQA, bf16 and fp16, packed sequences, each against autograd through float64 textbook attention with
the same softcap (3x the error of textbook attention in the input dtype, or 2x that of D taken from
the stored output: helpers.assert_grads_match_reference), and that the fused Gluon kernel ran (its
launches counted), or did not where the dispatch rule sends the call to the portable kernels
(deterministic=True, few programs, head dims 96 and 256: the portable backward, after the portable
forward at d96), with tanh.approx in both wherever forward.softcap_approx_in_training says so.
Timings (medians of triton.testing.do_bench over rounds that rotate the calls): one training step
(forward and backward of attention alone) at Gemma-2 27B's heads (32/16, d128), 4k and 8k causal, the
local layer's 4096-key window at 8k, and d64: "gluon" (the fused backward with the softcap, tanh.approx
in both), "formula" (the same with exp2's formula: forward.SOFTCAP_APPROX_TRAIN off), "portable"
(backward.GLUON_SOFTCAP off: the portable backward after the same forward), "nocap" (the
same call without a softcap), textbook attention in bf16 with the softcap, and SDPA's flash and cudnn
backends without one (they take no softcap; K and V expanded to every query head before the timing);
TFLOP/s as FlashAttention-2 counts them (fwd+bwd = 3.5x the forward's 4 n^2 d a head, halved
causal; a window counts its visible pairs). ``--check-only``: the checks alone; ``--small``: small
checks (compute-sanitizer); ``--smoke``: tiny checks on the CPU interpreter (the portable backward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile.kernels import backward, forward as fwd, gluon_backward

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SOFTCAP = 50.0
FULL = (-1, -1)

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, causal, window, fused expected[,
# deterministic]): the fused kernel wants at least one program (128 keys of a KV head) per SM
CHECKS = [(2, 2000, 2000, 16, 8, 64, "bf16", True, FULL, True),
          (1, 777, 4100, 8, 8, 64, "fp16", False, FULL, True),
          (2, 1031, 2049, 16, 8, 128, "bf16", True, FULL, True),
          (6, 3000, 3000, 8, 1, 128, "bf16", False, FULL, True),
          (2, 3000, 2100, 8, 4, 128, "fp16", True, FULL, True),
          (2, 3000, 3000, 8, 4, 128, "bf16", True, (1024, 0), True),
          (2, 2000, 2500, 8, 4, 128, "fp16", False, (700, 600), True),
          (1, 1000, 1000, 8, 2, 128, "bf16", True, FULL, False),  # 16 programs: the portable kernels
          (2, 1500, 1500, 16, 8, 256, "bf16", True, FULL, False),  # d256: the portable kernels
          (2, 700, 900, 8, 2, 96, "bf16", True, FULL, False),  # d96: the portable forward too
          (2, 2000, 2000, 16, 8, 128, "fp16", False, FULL, False, True)]  # deterministic: portable
SMALL_CHECKS = [(4, 600, 600, 8, 8, 64, "bf16", True, FULL, True),
                (2, 300, 1100, 8, 8, 128, "fp16", False, FULL, True),
                (2, 1100, 1100, 8, 8, 128, "bf16", True, (600, 0), True)]
# (query lengths, key lengths, heads, heads_k, head_dim, dtype, causal, window): packed sequences
VARLEN_CHECKS = [([1000, 1531, 1, 2900], [1000, 1531, 40, 2900], 8, 4, 128, "bf16", True, FULL),
                 ([2500, 700, 3000], [2500, 1900, 3000], 8, 4, 64, "fp16", False, FULL),
                 ([3000, 129, 2777], [3000, 1000, 2777], 8, 4, 128, "bf16", True, (1024, 0))]
SMOKE_CHECKS = [(2, 37, 45, 4, 2, 64, "fp16", True, FULL, False), (1, 33, 20, 2, 1, 40, "fp16", False, (9, 3), False)]
SMOKE_VARLEN_CHECKS = []
SMALL_VARLEN_CHECKS = [([300, 1000, 9], [300, 2000, 40], 8, 8, 128, "bf16", True, (512, 0))]  # 152 programs
# (batch, seqlen, heads, heads_k, head_dim, window left): causal training steps
SHAPES = [(2, 4096, 32, 16, 128, -1), (1, 8192, 32, 16, 128, -1), (1, 8192, 32, 16, 128, 4096),
          (2, 4096, 16, 16, 64, -1)]


def fused_launches():
    """A counter of the fused Gluon backward's launches (wraps gluon_backward.launch)."""
    count = [0]
    inner = gluon_backward.launch

    def counted(jit, *args, **kwargs):
        count[0] += 1
        return inner(jit, *args, **kwargs)
    gluon_backward.launch = counted
    return count, lambda: setattr(gluon_backward, "launch", inner)


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def run_checks(dev, size: str = "full") -> list[dict]:
    """The gradient checks of ``size``: "full", "small" (compute-sanitizer) or "smoke" (CPU)."""
    from helpers import assert_grads_match_reference
    plain, packed_cases = {"full": (CHECKS, VARLEN_CHECKS), "small": (SMALL_CHECKS, SMALL_VARLEN_CHECKS),
                           "smoke": (SMOKE_CHECKS, SMOKE_VARLEN_CHECKS)}[size]
    checks = []
    count, restore = fused_launches()
    try:
        for case in plain:
            b, sq, sk, h, hk, d, dt, causal, window, fused = case[:10]
            deterministic = len(case) > 10 and case[10]
            torch.manual_seed(sq + 7 * sk + d)
            q = torch.randn(b, sq, h, d, device=dev, dtype=_dtype(dt)) * 3
            k = torch.randn(b, sk, hk, d, device=dev, dtype=_dtype(dt)) * 3
            v = torch.randn(b, sk, hk, d, device=dev, dtype=_dtype(dt))
            dout = torch.randn_like(q)
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = flashtile.flash_attn_func(qq, kk, vv, causal=causal, window_size=window, softcap=SOFTCAP,
                                            deterministic=deterministic)
            before = count[0]
            grads = torch.autograd.grad(out, (qq, kk, vv), dout)
            launched = count[0] - before
            try:
                assert_grads_match_reference(grads, q, k, v, dout, out=out, causal=causal, window_size=window,
                                             softcap=SOFTCAP)
                error = ""
            except AssertionError as exc:
                error = str(exc)
            ok = not error and (launched == 1) == fused
            rec = dict(case="plain", shape=[b, sq, sk, h, hk, d], dtype=dt, causal=causal, window=list(window),
                       deterministic=deterministic, approx=fwd.softcap_approx_in_training(q, SOFTCAP),
                       fused_launches=launched, fused_expected=fused, error=error, ok=ok)
            print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
            checks.append(rec)
        for lens_q, lens_k, h, hk, d, dt, causal, window in packed_cases:
            torch.manual_seed(sum(lens_k) + d)
            cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=dev)
                          for n in (lens_q, lens_k))
            q = torch.randn(sum(lens_q), h, d, device=dev, dtype=_dtype(dt)) * 3
            k = torch.randn(sum(lens_k), hk, d, device=dev, dtype=_dtype(dt)) * 3
            v = torch.randn(sum(lens_k), hk, d, device=dev, dtype=_dtype(dt))
            dout = torch.randn_like(q)
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = flashtile.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                   window_size=window, softcap=SOFTCAP)
            before = count[0]
            grads = torch.autograd.grad(out, (qq, kk, vv), dout)
            launched = count[0] - before
            error = ""
            for i in range(len(lens_q)):
                q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
                parts = [g[a:z].unsqueeze(0) for g, (a, z) in zip(grads, ((q0, q1), (k0, k1), (k0, k1)))]
                try:
                    assert_grads_match_reference(parts, q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0),
                                                 v[k0:k1].unsqueeze(0), dout[q0:q1].unsqueeze(0),
                                                 out=out[q0:q1].unsqueeze(0), causal=causal, window_size=window,
                                                 softcap=SOFTCAP)
                except AssertionError as exc:
                    error += f"sequence {i}: {exc}; "
            ok = not error and launched == 1
            rec = dict(case="packed", lengths_q=lens_q, lengths_k=lens_k, heads=[h, hk], head_dim=d, dtype=dt,
                       approx=fwd.softcap_approx_in_training(q, SOFTCAP), causal=causal, window=list(window),
                       fused_launches=launched, error=error, ok=ok)
            print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
            checks.append(rec)
    finally:
        restore()
    bad = sum(not c["ok"] for c in checks)
    print(f"softcap training checks: {len(checks) - bad}/{len(checks)} ok", flush=True)
    return checks


def textbook_step(q, k, v, dout, left: int):
    """Textbook attention in q's dtype with the softcap, causal (and the window), then its backward."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (t.repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
    s = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = SOFTCAP * torch.tanh(s / SOFTCAP)
    n = q.shape[1]
    pos = torch.arange(n, device=q.device)
    rel = pos[:, None] - pos[None, :]
    hidden = (rel < 0) | ((rel > left) if left >= 0 else torch.zeros_like(rel, dtype=torch.bool))
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    out = (p @ vt).transpose(1, 2)
    return torch.autograd.grad(out, (q, k, v), dout)


def run_timings(dev, rounds: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from window_probe import balanced_rounds, median, visible_pairs
    rows = []
    for b, n, h, hk, d, left in SHAPES:
        torch.manual_seed(n + h + d)
        q, k, v = (torch.randn(b, n, hh, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for hh in (h, hk, hk))
        with torch.no_grad():
            q.mul_(3)
            k.mul_(3)
        dout = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
        group = h // hk
        ke, ve = (t.detach().repeat_interleave(group, 2).transpose(1, 2).contiguous().requires_grad_() for t in (k, v))
        qe = q.detach().transpose(1, 2).contiguous().requires_grad_()
        dout_e = dout.transpose(1, 2).contiguous()

        def step(softcap: float, gluon: bool = True, approx: bool = True, q=q, k=k, v=v, dout=dout, left=left):
            was = backward.GLUON_SOFTCAP, fwd.SOFTCAP_APPROX_TRAIN
            backward.GLUON_SOFTCAP, fwd.SOFTCAP_APPROX_TRAIN = gluon, approx
            try:
                out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(left, 0), softcap=softcap)
                return torch.autograd.grad(out, (q, k, v), dout)
            finally:
                backward.GLUON_SOFTCAP, fwd.SOFTCAP_APPROX_TRAIN = was

        def sdpa(backend, qe=qe, ke=ke, ve=ve, dout_e=dout_e):
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(qe, ke, ve, is_causal=True)
                return torch.autograd.grad(out, (qe, ke, ve), dout_e)

        calls = {"gluon": lambda: step(SOFTCAP), "formula": lambda: step(SOFTCAP, approx=False),
                 "portable": lambda: step(SOFTCAP, False), "nocap": lambda: step(0.0)}
        if left < 0:  # SDPA's is_causal has no window
            calls["sdpa-flash"] = lambda: sdpa(SDPBackend.FLASH_ATTENTION)
            calls["sdpa-cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION)
        if b * h * n * n * 2 * 4 <= 24 << 30:
            calls["textbook"] = lambda q=q, k=k, v=v, dout=dout, left=left: textbook_step(q, k, v, dout, left)
        for name, fn in list(calls.items()):  # a provider that cannot run this shape is left out
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (reported)
                print(f"{name} at {(b, n, h, hk, d, left)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                del calls[name]
        ms_rounds = balanced_rounds(calls, rounds)
        flops = 3.5 * 4 * visible_pairs(n, left if left >= 0 else None) * d * h * b
        for name in calls:
            ms = median(ms_rounds[name])
            rec = dict(batch=b, seqlen=n, heads=h, heads_k=hk, head_dim=d, window=left, provider=name,
                       ms=round(ms, 4), ms_rounds=[round(t, 4) for t in ms_rounds[name]],
                       tflops_fwd_bwd=round(flops / (ms * 1e-3) / 1e12, 1))
            print(json.dumps(rec), flush=True)
            rows.append(rec)
        del q, k, v, qe, ke, ve, calls
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B x n | H/Hk d | window | provider | ms a step | TFLOP/s fwd+bwd | x formula | x portable | x nocap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = {x["provider"]: x["ms"] for x in rows
                if (x["batch"], x["seqlen"], x["heads"], x["head_dim"], x["window"])
                == (r["batch"], r["seqlen"], r["heads"], r["head_dim"], r["window"])}
        lines.append(f"| {r['batch']} x {r['seqlen']} | {r['heads']}/{r['heads_k']} d{r['head_dim']} | {r['window']} | "
                     f"{r['provider']} | {r['ms']:.3f} | {r['tflops_fwd_bwd']:.0f} | "
                     f"{same['formula'] / r['ms']:.3f} | {same['portable'] / r['ms']:.3f} | "
                     f"{same['nocap'] / r['ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    from flashtile.bench.common import source_digest
    dev = torch.device("cpu" if args.smoke else "cuda")
    checks = run_checks(dev, "smoke" if args.smoke else "small" if args.small else "full")
    rows = [] if args.check_only or args.small or args.smoke else run_timings(dev, args.rounds)
    if rows:
        print("\n" + table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        size = "-smoke" if args.smoke else "-small" if args.small else ""  # (one $OUT may hold both runs)
        with open(os.path.join(args.out, f"softcap-train{size}.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                       "source_digest": source_digest(), "softcap": SOFTCAP, "checks": checks, "rows": rows}, f,
                      indent=1)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
