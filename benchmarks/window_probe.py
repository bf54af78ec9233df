"""Sliding-window prefill on the GPU machine.

Check (first): the Gluon forward's windowed calls (gluon_attention_forward with window_size, outputs
and LSE NaN-filled first) against float64 textbook attention with the same window, over odd shapes
(Sq != Sk both ways, lengths off the tiles, windows of 0 keys up to past the sequence, one-sided and
two-sided, causal or not, GQA/MQA, head dims 64/128/256, bf16/fp16); each also through
flash_attn_func, which must dispatch it to the Gluon kernel where forward.GLUON_WINDOW_MIN_KEYS says so
(and then give the same bits). Timing (after): flash_attn_func(causal=True, window_size=(w, 0)) as
dispatched (the Gluon kernel, or the portable one below the rule's span), the same on the portable
Triton kernel (forward.GLUON_WINDOW off), the call without the window and PyTorch's FlexAttention
with a sliding-window block mask (torch.compile'd), each checked against float64 on sampled rows.

With --train: the gradients of windowed flash_attn_func calls (dQ, dK, dV within the test suite's rule
against float64, tests/helpers.assert_grads_match_reference), whether the backward took the Gluon kernel
where backward.gluon_backward_mode's rule says so, and the time of a training step (forward and
backward) with the windows on the Gluon kernels against both on the portable ones (GLUON_WINDOW off);
TFLOP/s 3.5x the forward's.

    PYTHONPATH=src python benchmarks/window_probe.py [--out DIR] [--rounds N] [--check-only [--max-len N]]
                                                    [--train | --varlen]

With --varlen: packed sequences (flash_attn_varlen_func), windowed. Check: gluon_varlen_forward with
window_size on VARLEN_CHECKS (sequences of different lengths, empty ones, Sq != Sk per sequence), each
sequence against float64 under the accuracy rule, the LSE to fp32 rounding, flash_attn_varlen_func
the same bits where forward.GLUON_WINDOW_MIN_KEYS hands it the call. Timing: VARLEN_SHAPES through
flash_attn_varlen_func on the Gluon kernel, on the portable one, without the window, and FlexAttention
with a document-and-window block mask.

TFLOP/s count each call's own visible (query, key) pairs, 4 * pairs * d per head (FlashAttention-2's
count; a causal call's pairs are about half of n^2). Medians of do_bench over balanced rounds (each
provider in every position equally often, forward and reversed).
"""

from __future__ import annotations

import argparse
import math
import json
import os

import torch

import flashtile
from flashtile.bench.common import source_digest
from flashtile.kernels import backward
from flashtile.kernels import forward
from flashtile.kernels.gluon_forward import gluon_attention_forward, gluon_varlen_forward
from flashtile.reference import attention as reference_attention

# (batch, seqlen_q, seqlen_k, heads, kv heads, head dim, dtype, causal, window_size)
CHECKS = [(1, 1000, 1000, 4, 2, 128, "bf16", True, (37, 0)),
          (2, 777, 1531, 4, 1, 64, "fp16", True, (300, 0)),
          (1, 1531, 777, 2, 2, 256, "bf16", True, (128, 0)),
          (1, 2048, 2048, 4, 4, 128, "bf16", False, (128, 128)),
          (1, 3000, 3000, 2, 1, 128, "bf16", False, (-1, 200)),
          (1, 3000, 2500, 2, 1, 128, "fp16", False, (200, -1)),
          (1, 3000, 2500, 4, 2, 64, "bf16", False, (500, 300)),
          (1, 4096, 4096, 8, 2, 64, "bf16", True, (127, 0)),
          (1, 4096, 4096, 8, 2, 64, "bf16", True, (128, 0)),
          (1, 4095, 4095, 4, 2, 128, "bf16", True, (0, 0)),
          (2, 5000, 5000, 4, 2, 256, "fp16", True, (1000, 0)),
          (1, 8192, 8192, 4, 1, 128, "bf16", True, (4096, 0)),
          (1, 1, 4096, 8, 2, 128, "bf16", True, (100, 0)),
          (1, 200, 200, 2, 2, 64, "bf16", False, (10, 5)),
          (1, 1000, 1000, 2, 2, 128, "bf16", True, (5000, 0)),
          (1, 4000, 4000, 2, 2, 256, "bf16", False, (3, 3000)),
          (3, 333, 4444, 6, 3, 128, "fp16", True, (2000, 0)),
          (1, 2500, 2500, 16, 2, 64, "fp16", False, (64, 64))]

# (batch, seqlen, heads, kv heads, head dim, window, all providers): Mistral-7B's 4096 window, GPT-OSS's
# 128 at d64, a 4096 window at d256 (Gemma's local layers, without their softcap); then windows from
# 128 to 2048 keys timed on the two flashtile kernels alone (where the Gluon kernel starts to win)
SHAPES = [(1, 8192, 32, 8, 128, 4096, True), (1, 16384, 32, 8, 128, 4096, True),
          (1, 32768, 32, 8, 128, 4096, True), (1, 16384, 64, 8, 64, 128, True),
          (1, 32768, 64, 8, 64, 128, True), (1, 16384, 16, 8, 256, 4096, True)]
SHAPES += [(1, 16384, 64, 8, 64, w, False) for w in (256, 512, 1024, 2048)]
SHAPES += [(1, 16384, 32, 8, 128, w, False) for w in (128, 256, 512, 1024, 2048)]
SHAPES += [(1, 16384, 16, 8, 256, w, False) for w in (128, 256, 512, 1024, 2048)]


def visible_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs a causal call over n tokens sees, with a left window or without."""
    if window is None or window + 1 >= n:
        return n * (n + 1) // 2
    w = window + 1
    return w * (w + 1) // 2 + (n - w) * w


def write_results(out_dir: str, name: str, checks: list, rows: list) -> None:
    """``checks`` and ``rows`` as out_dir/name with the GPU, torch and the source digest (no out_dir:
    nothing written)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "source_digest": source_digest(), "checks": checks, "rows": rows}, f, indent=1)


def balanced_rounds(calls: dict, rounds: int) -> dict[str, list[float]]:
    """do_bench milliseconds of each of ``calls`` (name -> function) over ``rounds`` rounds, each
    provider in every position equally often (rotated, forward and reversed)."""
    import triton.testing
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order[::-1] if (r // len(names)) % 2 else order):
            times[name].append(triton.testing.do_bench(calls[name], warmup=10, rep=40))
    return times


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def over_budget(err: float, textbook_err: float) -> float:
    """An error over the accuracy rule's budget, 2x textbook attention's error in the input dtype
    (no floor: where textbook is exact, only an exact result passes)."""
    budget = 2 * textbook_err
    return err / budget if budget > 0 else (0.0 if err == 0 else math.inf)


def check(out: torch.Tensor, q, k, v, window: int | None) -> float:
    """Largest error on 64 sampled rows of every head against float64, over the budget
    (over_budget)."""
    n = q.shape[1]
    rows = torch.linspace(0, n - 1, 64, device=q.device).long()
    ws = (window, 0) if window is not None else (-1, 0)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), causal=True, window_size=ws,
                                 query_rows=rows)
    low, _ = reference_attention(q, k, v, causal=True, window_size=ws, query_rows=rows)
    err = (out[:, rows].double() - ref).abs().max().item()
    return over_budget(err, (low.double() - ref).abs().max().item())


def run_checks(dev, max_len: int = 1 << 30) -> list[dict]:
    """The CHECKS cases; each a dict with its worst output error over the accuracy budget, its LSE
    error and whether flash_attn_func took the Gluon kernel."""
    results = []
    for b, sq, sk, h, hk, d, dt, causal, window in CHECKS:
        if max(sq, sk) > max_len:
            continue
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sq * 7 + sk + d)
        q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        scale = d ** -0.5
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device=dev)
        gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal, out=out, lse=lse,
                                window_size=window)
        rows = torch.unique(torch.linspace(0, sq - 1, min(sq, 256), device=dev).long())
        ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=causal,
                                           window_size=window, query_rows=rows)
        low, _ = reference_attention(q, k, v, causal=causal, window_size=window, query_rows=rows)
        ratio = over_budget((out[:, rows].double() - ref).abs().max().item(),
                            (low.double() - ref).abs().max().item())
        got_lse = lse[:, :, rows].double()
        finite = torch.isfinite(ref_lse)
        lse_err = (got_lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        # fp32 rounding of the running sums, as tests/helpers.py bounds the LSE (relative to the row's)
        lse_ok = bool(((got_lse[finite] - ref_lse[finite]).abs()
                       <= 1e-5 * ref_lse[finite].abs().clamp(min=1.0) + 1e-5).all())
        inf_ok = bool(torch.equal(torch.isinf(got_lse), ~finite))
        right = 0 if causal else window[1]
        applies = forward.gluon_applies(q, k, v, softmax_scale=scale, window_left=window[0],
                                        window_right=right, diag_offset=sk - sq)
        wanted = forward.window_span(window[0], right) >= forward.GLUON_WINDOW_MIN_KEYS.get(d, math.inf)
        api = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
        same = bool(torch.equal(api, out)) or not wanted  # the portable kernel rounds otherwise
        ok = (ratio <= 1 and lse_ok and inf_ok and applies == wanted and same
              and not torch.isnan(out).any().item() and not torch.isnan(lse).any().item())
        rec = {"b": b, "sq": sq, "sk": sk, "h": h, "hk": hk, "d": d, "dtype": dt, "causal": causal,
               "window": list(window), "err_over_budget": round(ratio, 3), "lse_err": lse_err,
               "empty_rows_inf": inf_ok, "gluon_dispatch": applies, "dispatch_wanted": wanted, "api_equal": same,
               "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        results.append(rec)
    return results


# (batch, seqlen_q, seqlen_k, heads, kv heads, dtype, causal, window_size), head dim 128; key blocks of
# 128 x KV heads x batch at least the SM count (else the portable backward runs anyway)
TRAIN_CHECKS = [(2, 4096, 4096, 8, 4, "bf16", True, (1000, 0)),
                (1, 3000, 5000, 8, 8, "fp16", True, (2000, 0)),
                (2, 5000, 3000, 4, 4, "bf16", True, (700, 0)),
                (2, 4096, 4096, 4, 4, "bf16", False, (600, 600)),
                (2, 4096, 4096, 4, 4, "fp16", False, (-1, 800)),
                (2, 4096, 4096, 4, 4, "bf16", False, (900, -1)),
                (1, 4096, 4096, 16, 8, "bf16", True, (511, 0)),
                (1, 4096, 4096, 16, 8, "bf16", True, (300, 0)),
                (3, 2000, 2000, 6, 6, "bf16", True, (4000, 0)),
                (1, 1500, 2900, 6, 6, "fp16", True, (700, 0))]
TRAIN_SHAPES = [(1, 16384, 32, 8, w) for w in (256, 512, 1024, 2048, 4096)] + [(1, 32768, 32, 8, 4096)]


def run_train(dev, rounds: int, max_len: int = 1 << 30, check_only: bool = False
              ) -> tuple[list[dict], list[dict]]:
    """The TRAIN_CHECKS gradients (up to ``max_len`` tokens) and, unless ``check_only``, the
    TRAIN_SHAPES step times (see the module's docstring)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from helpers import assert_grads_match_reference
    checks, times = [], []
    for b, sq, sk, h, hk, dt, causal, window in TRAIN_CHECKS:
        if max(sq, sk) > max_len:
            continue
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sq + 3 * sk + window[0])
        q = torch.randn(b, sq, h, 128, device=dev, dtype=dtype)
        k = torch.randn(b, sk, hk, 128, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        right = 0 if causal else window[1]
        flags = dict(HAS_LEFT=window[0] >= 0, HAS_RIGHT=right >= 0, SOFTCAP=False, ALIBI=False,
                     DROPOUT=False, VARLEN=False, UPCAST=False)
        mode = backward.gluon_backward_mode(q, k, v, dout, flags, sk - sq, right, False, False, window[0])
        wanted = forward.window_span(window[0], right) >= forward.GLUON_WINDOW_MIN_KEYS[128]
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = flashtile.flash_attn_func(qq, kk, vv, causal=causal, window_size=window)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        try:
            assert_grads_match_reference(grads, q, k, v, dout, out=out, causal=causal, window_size=window)
            error = ""
        except AssertionError as exc:
            error = str(exc)
        ok = not error and (mode == "fused") == wanted
        rec = {"b": b, "sq": sq, "sk": sk, "h": h, "hk": hk, "dtype": dt, "causal": causal,
               "window": list(window), "backward": mode or "triton", "gluon_wanted": wanted, "error": error,
               "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        checks.append(rec)
    for b, n, h, hk, w in [] if check_only else TRAIN_SHAPES:
        torch.manual_seed(n + w)
        q, k, v = (torch.randn(b, n, hh, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for hh in (h, hk, hk))
        dout = torch.randn(b, n, h, 128, device=dev, dtype=torch.bfloat16)

        def step(gluon: bool, w=w, q=q, k=k, v=v, dout=dout):
            forward.GLUON_WINDOW = gluon
            try:
                out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0))
                return torch.autograd.grad(out, (q, k, v), dout)
            finally:
                forward.GLUON_WINDOW = True
        calls = {"gluon-window": lambda: step(True), "portable-window": lambda: step(False)}
        ms_rounds = balanced_rounds(calls, rounds)
        for name in calls:
            ms = median(ms_rounds[name])
            tflops = 3.5 * 4 * visible_pairs(n, w) * 128 * h * b / (ms * 1e-3) / 1e12
            rec = {"batch": b, "seqlen": n, "heads": h, "heads_k": hk, "head_dim": 128, "window": w,
                   "provider": name, "ms": round(ms, 4), "ms_rounds": [round(t, 4) for t in ms_rounds[name]],
                   "tflops_fwd_bwd": round(tflops, 1)}
            print(json.dumps(rec), flush=True)
            times.append(rec)
    print("\n| n | H/Hk | window | provider | ms a step | TFLOP/s (fwd+bwd) |")
    print("|---|---|---|---|---|---|")
    for r in times:
        print(f"| {r['seqlen']} | {r['heads']}/{r['heads_k']} | {r['window']} | {r['provider']} | {r['ms']:.3f} | "
              f"{r['tflops_fwd_bwd']:.0f} |")
    bad = sum(not c["ok"] for c in checks)
    print(f"train check: {len(checks) - bad}/{len(checks)} ok", flush=True)
    return checks, times


# (query lengths, key lengths, heads, kv heads, head dim, dtype, causal, window_size): packed sequences
VARLEN_CHECKS = [([1000, 1531, 0, 700], [1000, 777, 50, 2900], 4, 2, 128, "bf16", True, (600, 0)),
                 ([3000, 5, 2048], [3000, 5, 2048], 4, 1, 128, "fp16", True, (1000, 0)),
                 ([2500, 129, 1777], [2500, 1000, 1777], 2, 2, 128, "bf16", False, (700, 300)),
                 ([4096, 1000], [4096, 1000], 4, 2, 128, "bf16", False, (-1, 600)),
                 ([1531, 2048, 1], [1531, 2048, 3000], 4, 2, 256, "bf16", True, (128, 0)),
                 ([3000, 2000], [3000, 2000], 2, 1, 256, "fp16", False, (900, -1)),
                 ([1200, 4000, 333], [1200, 4000, 4444], 6, 3, 256, "bf16", False, (1500, 1500)),
                 ([2048, 2048], [2048, 2048], 4, 2, 128, "bf16", True, (300, 0))]  # under the rule: portable

# (sequence lengths, heads, kv heads, head dim, window): 16k tokens in sequences of 512-4096
VARLEN_LENGTHS = [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536]
VARLEN_SHAPES = [(VARLEN_LENGTHS, 32, 8, 128, w) for w in (512, 1024, 4096)]
VARLEN_SHAPES += [(VARLEN_LENGTHS, 16, 8, 256, w) for w in (512, 4096)]


def _packed(lengths, heads, dim, dtype, dev):
    return torch.randn(sum(lengths), heads, dim, device=dev, dtype=dtype)


def _offsets(lengths, dev):
    return torch.tensor([0] + lengths, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)


# (sequence lengths, heads, kv heads, head dim, dtype, causal, window_size): packed gradients (the
# portable backward, from the Gluon forward's output and LSE)
VARLEN_GRAD_CHECKS = [([1000, 0, 1531, 700], 4, 2, 128, "bf16", True, (600, 0)),
                      ([1200, 777], 4, 4, 256, "fp16", False, (700, 300))]


def _varlen_grad_checks(dev) -> list[dict]:
    """dQ, dK, dV of windowed flash_attn_varlen_func calls, each sequence's against float64 under the
    test suite's rule (tests/helpers.assert_grads_match_reference)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from helpers import assert_grads_match_reference
    checks = []
    for lengths, h, hk, d, dt, causal, window in VARLEN_GRAD_CHECKS:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sum(lengths) + d)
        q, k, v = (_packed(lengths, hh, d, dtype, dev) for hh in (h, hk, hk))
        dout = torch.randn_like(q)
        cu = _offsets(lengths, dev)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = flashtile.flash_attn_varlen_func(qq, kk, vv, cu, cu, max(lengths), max(lengths), causal=causal,
                                               window_size=window)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        error = ""
        for b, length in enumerate(lengths):
            sl = slice(int(cu[b]), int(cu[b]) + length)
            if length == 0:
                continue
            try:
                assert_grads_match_reference(tuple(g[None, sl] for g in grads), q[None, sl], k[None, sl],
                                             v[None, sl], dout[None, sl], out=out[None, sl], causal=causal,
                                             window_size=window)
            except AssertionError as exc:
                error += f"sequence {b}: {exc}; "
        ok = not error and all(torch.isfinite(g).all().item() for g in grads)
        rec = {"lengths": lengths, "h": h, "hk": hk, "d": d, "dtype": dt, "causal": causal,
               "window": list(window), "grads": True, "error": error, "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        checks.append(rec)
    return checks


def run_varlen(dev, rounds: int, check_only: bool) -> tuple[list[dict], list[dict]]:
    """VARLEN_CHECKS and, unless ``check_only``, VARLEN_SHAPES' times (see the module's docstring)."""
    checks, rows_out = [], []
    for lens_q, lens_k, h, hk, d, dt, causal, window in VARLEN_CHECKS:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sum(lens_q) + 3 * sum(lens_k) + d)
        q = _packed(lens_q, h, d, dtype, dev)
        k, v = _packed(lens_k, hk, d, dtype, dev), _packed(lens_k, hk, d, dtype, dev)
        cu_q, cu_k = _offsets(lens_q, dev), _offsets(lens_k, dev)
        scale = d ** -0.5
        right = 0 if causal else window[1]
        wanted = forward.window_span(window[0], right) >= forward.GLUON_WINDOW_MIN_KEYS.get(d, math.inf)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((h, q.shape[0]), float("nan"), device=dev)
        gluon_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=scale, causal=causal,
                             out=out, lse=lse, window_size=window)
        ratio, lse_err, lse_ok, inf_ok = 0.0, 0.0, True, True
        for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
            if sq == 0:
                continue
            q0, k0 = int(cu_q[b]), int(cu_k[b])
            qb, kb, vb = q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk]
            rows = torch.unique(torch.linspace(0, sq - 1, min(sq, 128), device=dev).long())
            ref, ref_lse = reference_attention(qb.double(), kb.double(), vb.double(), causal=causal,
                                               window_size=window, query_rows=rows)
            low, _ = reference_attention(qb, kb, vb, causal=causal, window_size=window, query_rows=rows)
            ratio = max(ratio, over_budget((out[None, q0 + rows].double() - ref).abs().max().item(),
                                           (low.double() - ref).abs().max().item()))
            got = lse[:, q0 + rows].double()[None]
            finite = torch.isfinite(ref_lse)
            if finite.any():
                diff = (got[finite] - ref_lse[finite]).abs()
                lse_err = max(lse_err, diff.max().item())
                lse_ok &= bool((diff <= 1e-5 * ref_lse[finite].abs().clamp(min=1.0) + 1e-5).all())
            inf_ok &= bool(torch.equal(torch.isinf(got), ~finite))
        api = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                               window_size=window)
        same = bool(torch.equal(api, out)) or not wanted  # the portable kernel rounds otherwise
        ok = (ratio <= 1 and lse_ok and inf_ok and same and not torch.isnan(out).any().item()
              and not torch.isnan(lse).any().item())
        rec = {"lens_q": lens_q, "lens_k": lens_k, "h": h, "hk": hk, "d": d, "dtype": dt, "causal": causal,
               "window": list(window), "err_over_budget": round(ratio, 3), "lse_err": lse_err,
               "empty_rows_inf": inf_ok, "dispatch_wanted": wanted, "api_equal": same, "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        checks.append(rec)
    checks += _varlen_grad_checks(dev)
    if check_only:
        return checks, rows_out
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    for lengths, h, hk, d, w in VARLEN_SHAPES:
        # a fresh compile per shape: the mask's window is a default argument, which the compiled
        # kernel of the shape before would keep (wrong output at the next window, seen at 1024)
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        torch.manual_seed(h + d + w)
        n = sum(lengths)
        q, k, v = (_packed(lengths, hh, d, torch.bfloat16, dev) for hh in (h, hk, hk))
        cu = _offsets(lengths, dev)
        longest = max(lengths)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev),
                                      torch.tensor(lengths, device=dev))

        def sliding_doc(b_, h_, qi, ki, w=w, doc=doc):
            return (doc[qi] == doc[ki]) & (qi >= ki) & (qi - ki <= w)
        mask = create_block_mask(sliding_doc, None, None, n, n, device=dev)
        qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))

        def call(window, gluon=True, q=q, k=k, v=v, cu=cu, longest=longest):
            forward.GLUON_WINDOW = gluon
            try:
                return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True,
                                                        window_size=window)
            finally:
                forward.GLUON_WINDOW = True
        calls = {"flashtile-window": (lambda: call((w, 0)), w),
                 "portable-window": (lambda: call((w, 0), False), w),
                 "flashtile-causal": (lambda: call((-1, -1)), None),
                 "flex-window": (lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True)[0].transpose(0, 1), w)}
        errors = {}
        for name, (fn, win) in calls.items():
            out = fn()
            torch.cuda.synchronize()
            worst = 0.0
            for b, length in enumerate(lengths):
                start = int(cu[b])
                sl = slice(start, start + length)
                worst = max(worst, check(out[None, sl], q[None, sl], k[None, sl], v[None, sl], win))
            errors[name] = round(worst, 3)
        times = balanced_rounds({name: fn for name, (fn, _) in calls.items()}, rounds)
        for name in calls:
            ms = median(times[name])
            pairs = sum(visible_pairs(length, calls[name][1]) for length in lengths)
            tflops = 4 * pairs * d * h / (ms * 1e-3) / 1e12
            rec = {"lengths": lengths, "tokens": n, "heads": h, "heads_k": hk, "head_dim": d, "window": w,
                   "provider": name, "ms": round(ms, 4), "ms_rounds": [round(t, 4) for t in times[name]],
                   "tflops": round(tflops, 1), "err_over_budget": errors[name]}
            rows_out.append(rec)
            print(json.dumps(rec), flush=True)
    print("\n| d | tokens | H/Hk | window | provider | ms | TFLOP/s | err/budget |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['head_dim']} | {r['tokens']} | {r['heads']}/{r['heads_k']} | {r['window']} | {r['provider']} | "
              f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['err_over_budget']} |")
    return checks, rows_out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--max-len", type=int, default=1 << 30, help="check only cases up to this many tokens")
    ap.add_argument("--train", action="store_true", help="only the gradients' check and the step times")
    ap.add_argument("--varlen", action="store_true", help="only packed sequences: their check and times")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.varlen:
        checks, rows = run_varlen(dev, args.rounds, args.check_only)
        write_results(args.out, "window-varlen.json", checks, rows)
        bad = sum(not c["ok"] for c in checks)
        print(f"varlen check: {len(checks) - bad}/{len(checks)} ok", flush=True)
        return 1 if bad else 0
    if args.train:
        train_checks, train_times = run_train(dev, args.rounds, args.max_len, args.check_only)
        write_results(args.out, "window-train.json", train_checks, train_times)
        return 1 if any(not c["ok"] for c in train_checks) else 0
    checks = run_checks(dev, args.max_len)
    bad = sum(not c["ok"] for c in checks)
    print(f"check: {len(checks) - bad}/{len(checks)} ok", flush=True)
    if args.check_only:
        return 1 if bad else 0
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    rows_out = []
    for b, n, h, hk, d, w, everyone in SHAPES:
        torch.manual_seed(n + d + w)
        q = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, n, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        if everyone:
            def sliding(b_, h_, qi, ki, w=w):
                return (qi >= ki) & (qi - ki <= w)
            mask = create_block_mask(sliding, None, None, n, n, device=dev)
        def portable(w=w, q=q, k=k, v=v):
            forward.GLUON_WINDOW = False
            try:
                return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0))
            finally:
                forward.GLUON_WINDOW = True
        calls = {
            "flashtile-window": (lambda: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0)), w),
            "portable-window": (portable, w),
            "flashtile-causal": (lambda: flashtile.flash_attn_func(q, k, v, causal=True), None),
        }
        if everyone:
            calls["flex-window"] = (lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True).transpose(1, 2), w)
        else:
            del calls["flashtile-causal"]
        errors = {}
        for name, (fn, win) in calls.items():
            out = fn()
            torch.cuda.synchronize()
            errors[name] = round(check(out, q, k, v, win), 3)
        times = balanced_rounds({name: fn for name, (fn, _) in calls.items()}, args.rounds)
        for name in calls:
            ms = median(times[name])
            pairs = visible_pairs(n, calls[name][1])
            tflops = 4 * pairs * d * h * b / (ms * 1e-3) / 1e12
            rec = {"batch": b, "seqlen": n, "heads": h, "heads_k": hk, "head_dim": d, "window": w,
                   "provider": name, "ms": round(ms, 4), "ms_rounds": [round(t, 4) for t in times[name]],
                   "tflops": round(tflops, 1), "err_over_budget": errors[name]}
            rows_out.append(rec)
            print(json.dumps(rec), flush=True)
    write_results(args.out, "window-probe.json", checks, rows_out)
    print("\n| d | n | H/Hk | window | provider | ms | TFLOP/s | err/budget |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['head_dim']} | {r['seqlen']} | {r['heads']}/{r['heads_k']} | {r['window']} | {r['provider']} | "
              f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['err_over_budget']} |")
    print(f"check: {len(checks) - bad}/{len(checks)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
