"""The backward of packed sequences (flash_attn_varlen_func) on the Gluon kernel, on the GPU machine.

Check (first): for each of CHECKS (sequences of different lengths, empty ones, Sq != Sk per sequence
both ways, lengths off the tiles, GQA/MQA, d64/d128, bf16/fp16, causal or not, windows at d128):
1. the kernel itself (gluon_backward.gluon_dkdv with cu_seqlens, dK and dV NaN-filled first, dQ from
   its float32 accumulator) from the forward's output and LSE (gluon_backward.packed_row_copy's rows);
2. the same call through flash_attn_varlen_func and autograd, which must take the Gluon kernel where
   backward.gluon_backward_mode says so;
each sequence's dQ, dK and dV against float64 under the test suite's rule for gradients
(tests/helpers.assert_grads_match_reference), and no NaN anywhere in dK/dV of the sequences' keys.

Timing (after): a training step (forward and backward) of packed batches through
flash_attn_varlen_func with the backward on the Gluon kernel and on the portable kernels
(backward.GLUON_VARLEN off); for batches of equal lengths also flash_attn_func on the (B, S) batch and
SDPA's flash and cudnn backends on it (the anchors). TFLOP/s: 3.5x the forward's 4 * pairs * d per
head (FlashAttention-2's count; a causal sequence's pairs are about half of n^2). Medians of do_bench
over balanced rounds (window_probe.balanced_rounds).

    PYTHONPATH=src python benchmarks/varlen_bwd.py [--out DIR] [--rounds N] [--check-only] [--small]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import flashtile
from flashtile.kernels import backward, gluon_backward
from flashtile.kernels.forward import attention_forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from window_probe import balanced_rounds, median, write_results  # noqa: E402

# (query lengths, key lengths, heads, kv heads, head dim, dtype, causal, window_size)
CHECKS = [([300, 1, 130, 0, 517], [300, 40, 400, 64, 517], 8, 2, 128, "bf16", True, (-1, -1)),
          ([1000, 129, 64, 700], [1000, 129, 0, 700], 4, 4, 64, "fp16", False, (-1, -1)),
          ([777, 1531], [1531, 777], 4, 1, 128, "bf16", False, (-1, -1)),
          ([2048, 1, 63, 1100], [2048, 1, 65, 1100], 16, 8, 128, "fp16", True, (-1, -1)),
          ([4096, 333], [4096, 333], 8, 2, 64, "bf16", True, (-1, -1)),
          ([1000, 0, 1531, 700], [1000, 50, 1531, 700], 4, 2, 128, "bf16", True, (600, 0)),
          ([1200, 777], [1300, 600], 4, 4, 128, "fp16", False, (700, 300)),
          ([2500, 129], [2500, 1000], 2, 1, 128, "bf16", False, (-1, 600)),
          # wide enough for the dispatch rule: a windowed packed call through the API too
          ([3000, 2500, 7, 2800], [3000, 2500, 900, 2800], 16, 8, 128, "bf16", True, (700, 0))]
SMALL = 4  # --small: the first checks only (compute-sanitizer; the 4th reaches the kernel through the API too)

# (name, sequence lengths, heads, kv heads, head dim, causal[, window_size])
SHAPES = [("equal 8x2048", [2048] * 8, 16, 16, 128, True), ("equal 8x2048", [2048] * 8, 16, 16, 128, False),
          ("equal 8x2048", [2048] * 8, 32, 8, 128, True), ("equal 4x4096", [4096] * 4, 32, 32, 64, True),
          ("ragged 16k", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 32, 8, 128, True),
          ("ragged 16k", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 16, 16, 128, False),
          ("ragged 64 seqs", None, 16, 16, 128, True),
          ("ragged 16k, window 1024", [1024, 3072, 2048, 512, 4096, 1536, 2560, 1536], 32, 8, 128, True,
           (1024, 0))]


def offsets(lengths, dev):
    return torch.tensor([0] + list(lengths), device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def ragged_lengths(count: int = 64, seed: int = 0) -> list[int]:
    """``count`` lengths of 64-7005 tokens, log-uniform (about 63k tokens at 64)."""
    g = torch.Generator().manual_seed(seed)
    return [int(64 * math.exp(torch.rand(1, generator=g).item() * math.log(7005 / 64))) for _ in range(count)]


def visible_pairs(sq: int, sk: int, causal: bool, left: int = -1) -> int:
    """(query, key) pairs a call sees (bottom-right causal; ``left``: a causal window's left side)."""
    if left >= 0 and causal and sq == sk:
        w = min(left + 1, sq)
        return w * (w + 1) // 2 + (sq - w) * w
    if not causal:
        return sq * sk
    return sum(max(0, min(sk, i + 1 + sk - sq)) for i in range(sq)) if sq != sk else sq * (sq + 1) // 2


def _check_sequences(grads, q, k, v, dout, out, lens_q, lens_k, cu_q, cu_k, causal, window, check) -> str:
    error = ""
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs = slice(int(cu_q[b]), int(cu_q[b]) + lq)
        ks = slice(int(cu_k[b]), int(cu_k[b]) + lk)
        if torch.isnan(grads[1][ks]).any() or torch.isnan(grads[2][ks]).any():
            error += f"sequence {b}: NaN in dK/dV (unwritten rows?); "
            continue
        if lq == 0:
            if lk and (grads[1][ks].abs().max().item() or grads[2][ks].abs().max().item()):
                error += f"sequence {b}: keys without queries got nonzero dK/dV; "
            continue
        if lk == 0:
            if grads[0][qs].abs().max().item():
                error += f"sequence {b}: queries without keys got a nonzero dQ; "
            continue
        try:
            check(tuple(g[None, s] for g, s in zip(grads, (qs, ks, ks))), q[None, qs], k[None, ks], v[None, ks],
                  dout[None, qs], out=out[None, qs], causal=causal, window_size=window)
        except AssertionError as exc:
            error += f"sequence {b}: {exc}; "
    return error


def run_checks(dev, count: int) -> list[dict]:
    from helpers import assert_grads_match_reference
    checks = []
    for lens_q, lens_k, h, hk, d, dt, causal, window in CHECKS[:count]:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        torch.manual_seed(sum(lens_q) + 7 * sum(lens_k) + d)
        q = torch.randn(sum(lens_q), h, d, device=dev, dtype=dtype)
        k = torch.randn(sum(lens_k), hk, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        cu_q, cu_k = offsets(lens_q, dev), offsets(lens_k, dev)
        scale = d ** -0.5
        left, right = window[0], (0 if causal else window[1])
        out, lse = attention_forward(q, k, v, softmax_scale=scale, window_left=left,
                                     window_right=right, diag_offset=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        lse = lse.contiguous()
        delta = (out.float() * dout.float()).sum(-1).t().contiguous()  # (H, total_q)
        dk = torch.full_like(k, math.nan)
        dv = torch.full_like(v, math.nan)
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        lse_rows, delta_rows = (gluon_backward.packed_row_copy(t, cu_q) for t in (lse, delta))
        gluon_backward.gluon_dkdv(q[None], k[None], v[None], dout[None], lse_rows, delta_rows, dk[None],
                                  dv[None], softmax_scale=scale, causal=causal, dq_accum=dq_accum[None],
                                  window_size=(left, right), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_k=max(lens_k))
        torch.cuda.synchronize()
        kernel_error = _check_sequences((dq_accum.to(dtype), dk, dv), q, k, v, dout, out, lens_q, lens_k, cu_q,
                                        cu_k, causal, window, assert_grads_match_reference)
        # through flash_attn_varlen_func: the dispatch must take the Gluon kernel where the rule says
        flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=False, ALIBI=False, DROPOUT=False,
                     VARLEN=True, UPCAST=False)
        mode = backward.gluon_backward_mode(q[None], k[None], v[None], dout[None], flags, 0, right, False, False,
                                            left)
        calls = []
        real = gluon_backward.gluon_dkdv

        def counted(*args, **kwargs):
            calls.append(kwargs.get("cu_seqlens_q") is not None)
            return real(*args, **kwargs)
        gluon_backward.gluon_dkdv = counted
        try:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            api_out = flashtile.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       causal=causal, window_size=window)
            grads = torch.autograd.grad(api_out, (qq, kk, vv), dout)
        finally:
            gluon_backward.gluon_dkdv = real
        api_error = _check_sequences(grads, q, k, v, dout, api_out.detach(), lens_q, lens_k, cu_q, cu_k, causal,
                                     window, assert_grads_match_reference)
        dispatched = calls == [True]
        ok = not kernel_error and not api_error and dispatched == (mode == "fused")
        rec = {"lens_q": lens_q, "lens_k": lens_k, "h": h, "hk": hk, "d": d, "dtype": dt, "causal": causal,
               "window": list(window), "mode": mode or "triton", "gluon_ran": dispatched,
               "kernel_error": kernel_error, "api_error": api_error, "ok": ok}
        print(("ok  " if ok else "BAD ") + json.dumps(rec), flush=True)
        checks.append(rec)
    bad = sum(not c["ok"] for c in checks)
    print(f"varlen backward check: {len(checks) - bad}/{len(checks)} ok", flush=True)
    return checks


def run_bench(dev, rounds: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for name, lengths, h, hk, d, causal, *window in SHAPES:
        window = tuple(window[0]) if window else (-1, -1)
        lengths = lengths or ragged_lengths()
        torch.manual_seed(len(lengths) + h + d)
        total = sum(lengths)
        q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16)
        cu = offsets(lengths, dev)
        longest = max(lengths)

        def packed(gluon: bool, q=q, k=k, v=v, cu=cu, longest=longest, dout=dout, causal=causal, window=window):
            backward.GLUON_VARLEN = gluon
            try:
                out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                                       window_size=window)
                return torch.autograd.grad(out, (q, k, v), dout)
            finally:
                backward.GLUON_VARLEN = True
        calls = {"varlen gluon": lambda: packed(True), "varlen portable": lambda: packed(False)}
        if len(set(lengths)) == 1:  # the same batch unpacked: flash_attn_func and SDPA
            b, n = len(lengths), lengths[0]
            q4, k4, v4, do4 = (t.detach().reshape(b, n, *t.shape[1:]).clone().requires_grad_(t is not dout)
                               for t in (q, k, v, dout))

            def plain(q4=q4, k4=k4, v4=v4, do4=do4, causal=causal):
                out = flashtile.flash_attn_func(q4, k4, v4, causal=causal)
                return torch.autograd.grad(out, (q4, k4, v4), do4)
            qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_(t is not do4)
                               for t in (q4, k4, v4, do4))

            def sdpa(backend, qt=qt, kt=kt, vt=vt, dot=dot, causal=causal, gqa=h != hk):
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                           enable_gqa=gqa)
                return torch.autograd.grad(out, (qt, kt, vt), dot)
            calls["flash_attn_func (B, S)"] = plain
            calls["sdpa cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION)
            if h == hk:  # SDPA's FlashAttention-2 takes no GQA
                calls["sdpa flash"] = lambda: sdpa(SDPBackend.FLASH_ATTENTION)
        ms_rounds = balanced_rounds(calls, rounds)
        pairs = sum(visible_pairs(n, n, causal, window[0]) for n in lengths)
        for provider in calls:
            ms = median(ms_rounds[provider])
            rec = {"shape": name, "window": list(window), "tokens": total, "sequences": len(lengths), "heads": h, "heads_k": hk,
                   "head_dim": d, "causal": causal, "provider": provider, "ms": round(ms, 4),
                   "ms_rounds": [round(t, 4) for t in ms_rounds[provider]],
                   "tflops_fwd_bwd": round(3.5 * 4 * pairs * d * h / (ms * 1e-3) / 1e12, 1)}
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    print("\n| batch | H/Hk | d | causal | provider | ms a step | TFLOP/s (fwd+bwd) | vs portable |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x["ms"] for x in rows if x["shape"] == r["shape"] and x["heads"] == r["heads"]
                    and x["head_dim"] == r["head_dim"] and x["causal"] == r["causal"]
                    and x["provider"] == "varlen portable")
        print(f"| {r['shape']} ({r['tokens']} tokens) | {r['heads']}/{r['heads_k']} | {r['head_dim']} | "
              f"{r['causal']} | {r['provider']} | {r['ms']:.3f} | {r['tflops_fwd_bwd']:.0f} | {base / r['ms']:.2f}x |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="where the JSON goes (none: not written)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--small", action="store_true", help=f"the first {SMALL} checks only, no timing")
    parser.add_argument("--name", default="varlen-bwd-h200")
    args = parser.parse_args()
    dev = torch.device("cuda")
    checks = run_checks(dev, SMALL if args.small else len(CHECKS))
    rows = [] if args.check_only or args.small else run_bench(dev, args.rounds)
    write_results(args.out, f"{args.name}.json", checks, rows)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
