"""The logit softcap (flash_attn's ``softcap``, Gemma 2's 50.0) inside the Gluon forward
(gluon_forward.SOFTCAP_IN_KERNEL), checked and timed against the portable kernel that runs softcapped
calls without it.

    PYTHONPATH=src python benchmarks/softcap_check.py --out $OUT [--rounds N] [--check-only] [--smoke]

Checks: flash_attn_func and flash_attn_varlen_func with the switch on, at head dims 64/128/256, full
and causal, sliding windows (Gemma 2's local layers), packed sequences on page pools (vLLM's
prefill), odd lengths (Sq != Sk, not multiples of the
tiles), batch > 1, GQA and MQA, against float64 textbook attention with the same softcap (2x the
error of textbook attention in bf16; the LSE to fp32 rounding), with the allocator's free memory
filled with NaN before each call (the call allocates its output there: an unwritten element fails),
and that the call ran the Gluon kernel (its launch is counted). A training
step's gradients (the portable backward after the Gluon forward: the same tanh formula) against
autograd through textbook attention in bf16 (3x its error). Calls without gradients take the tanh by
tanh.approx.f32 (gluon_forward.SOFTCAP_APPROX, as shipped); the training step, the exp2 formula.
Timings (medians of triton.testing.do_bench over rounds that rotate the calls): prefill, batch 2,
4k causal and full, Gemma-2 9B's heads (16/8, d256) and 27B's (32/16, d128): the Gluon kernel with
the softcap ("gluon": tanh.approx, as calls without gradients run; "formula": the exp2 formula, as
calls with gradients run), the portable kernel with it ("portable": the switch off), the Gluon kernel
without a softcap ("nocap"), and SDPA's flash and cudnn backends without one (they take no softcap:
the anchors of what the softcap costs); TFLOP/s as FlashAttention-2 counts them.
``--check-only``: the checks alone (compute-sanitizer). ``--smoke``: the CPU interpreter (the
portable kernel; no Gluon, no timings worth reading).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

SOFTCAP = 50.0


def set_switch(on: bool) -> bool:
    """gluon_forward.SOFTCAP_IN_KERNEL set to ``on``; returns what it was."""
    from flashtile.kernels import gluon_forward
    was, gluon_forward.SOFTCAP_IN_KERNEL = gluon_forward.SOFTCAP_IN_KERNEL, on
    return was


def gluon_launches():
    """A counter of Gluon forward launches (wraps launch.launch as gluon_forward sees it)."""
    from flashtile.kernels import gluon_forward
    count = [0]
    inner = gluon_forward.launch

    def counted(jit, *args, **kwargs):
        if jit is gluon_forward._attn_fwd_gluon:
            count[0] += 1
        return inner(jit, *args, **kwargs)
    gluon_forward.launch = counted
    return count, lambda: setattr(gluon_forward, "launch", inner)


def poison(device) -> None:
    """NaN into memory the caching allocator will hand out next (the calls' outputs come from it)."""
    if device.type == "cuda":
        torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(float("nan"))


def check_cases(smoke: bool):
    """(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal, window) of the plain checks."""
    if smoke:
        return [(2, 37, 45, 4, 2, 64, True, (-1, -1)), (1, 33, 33, 2, 1, 128, False, (-1, -1)),
                (1, 40, 40, 2, 1, 128, True, (9, 0))]
    full = (-1, -1)
    return [(2, 1000, 1000, 8, 2, 64, True, full), (1, 777, 1533, 4, 4, 64, False, full),
            (2, 1031, 2049, 16, 8, 128, True, full), (1, 4096, 4096, 8, 1, 128, False, full),
            (2, 1500, 1500, 16, 8, 256, True, full), (1, 700, 3000, 4, 2, 256, False, full),
            (1, 3000, 700, 4, 2, 128, True, full),
            # Gemma 2's local layers: a sliding window with the softcap
            (1, 3000, 3000, 16, 8, 256, True, (1024, 0)), (2, 2000, 2500, 8, 2, 128, False, (700, 600))]


def run_checks(device, smoke: bool) -> list:
    from helpers import assert_matches_reference, reference_grads
    results = []
    count, restore = gluon_launches()
    switch = set_switch(True)
    try:
        for batch, sq, sk, h, hk, d, causal, window in check_cases(smoke):
            q = torch.randn(batch, sq, h, d, device=device, dtype=torch.bfloat16)
            k = torch.randn(batch, sk, hk, d, device=device, dtype=torch.bfloat16)
            v = torch.randn(batch, sk, hk, d, device=device, dtype=torch.bfloat16)
            q, k = q * 3, k * 3  # scores past the cap's knee
            before = count[0]
            poison(device)
            out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=SOFTCAP,
                                                    return_attn_probs=True)
            launched = count[0] - before
            rows = slice(max(0, sq - 512), sq)  # the reference on the last rows (bottom-right: the same rows)
            err, budget = assert_matches_reference(out[:, rows], lse[:, :, rows], q[:, rows], k, v, causal=causal,
                                                   window_size=window, softcap=SOFTCAP)
            results.append(dict(case="plain", shape=[batch, sq, sk, h, hk, d], causal=causal, window=list(window),
                                gluon=launched, of_budget=err / budget))
            print(json.dumps(results[-1]), flush=True)
            if not smoke:
                assert launched == 1, f"the Gluon kernel did not run ({launched} launches)"
        # packed sequences of different lengths
        for d, causal, window in (((64, True, (-1, -1)), (128, False, (-1, -1)), (256, True, (-1, -1)),
                                   (128, True, (1024, 0))) if not smoke else ((64, True, (-1, -1)),)):
            lens_q = [1, 300, 1024, 77, 2000] if not smoke else [1, 20, 9]
            lens_k = [5, 300, 1500, 900, 2500] if not smoke else [3, 20, 30]
            h, hk = 8, 2
            cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
            cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
            q = torch.randn(sum(lens_q), h, d, device=device, dtype=torch.bfloat16) * 3
            k = torch.randn(sum(lens_k), hk, d, device=device, dtype=torch.bfloat16) * 3
            v = torch.randn(sum(lens_k), hk, d, device=device, dtype=torch.bfloat16)
            before = count[0]
            poison(device)
            out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                           causal=causal, window_size=window, softcap=SOFTCAP,
                                                           return_attn_probs=True)
            launched = count[0] - before
            worst = 0.0
            for b in range(len(lens_q)):
                q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
                err, budget = assert_matches_reference(out[q0:q1].unsqueeze(0), lse[:, q0:q1].unsqueeze(0),
                                                       q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0),
                                                       v[k0:k1].unsqueeze(0), causal=causal, window_size=window,
                                                       softcap=SOFTCAP)
                worst = max(worst, err / budget if budget else 0.0)
            results.append(dict(case="packed", head_dim=d, causal=causal, window=list(window), gluon=launched,
                                of_budget=worst))
            print(json.dumps(results[-1]), flush=True)
            if not smoke:
                assert launched == 1, f"the Gluon kernel did not run ({launched} launches)"
        # vLLM's prefill: packed queries on shuffled page pools, the keys' counts as seqused_k
        for d, causal, page in (((128, True, 16), (256, True, 256), (64, False, 16)) if not smoke
                                else ((64, True, 16),)):
            lens_q = [3, 512, 200] if not smoke else [3, 12]
            lens_k = [1000, 1500, 200] if not smoke else [40, 12]
            h, hk = 8, 2
            cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
            width = -(-max(lens_k) // page)
            table = torch.randperm(len(lens_k) * width, device=device).view(len(lens_k), width).to(torch.int32)
            pool_k, pool_v = (torch.randn(len(lens_k) * width, page, hk, d, device=device, dtype=torch.bfloat16)
                              for _ in range(2))
            pool_k = pool_k * 3
            q = torch.randn(sum(lens_q), h, d, device=device, dtype=torch.bfloat16) * 3
            used = torch.tensor(lens_k, dtype=torch.int32, device=device)
            before = count[0]
            poison(device)
            out, lse, _ = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, None, max(lens_q), max(lens_k),
                                                           causal=causal, softcap=SOFTCAP, block_table=table,
                                                           seqused_k=used, return_attn_probs=True)
            launched = count[0] - before
            worst = 0.0
            for b in range(len(lens_q)):
                q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
                rows = table[b].long()
                k_b = pool_k[rows].flatten(0, 1)[:lens_k[b]].unsqueeze(0)
                v_b = pool_v[rows].flatten(0, 1)[:lens_k[b]].unsqueeze(0)
                err, budget = assert_matches_reference(out[q0:q1].unsqueeze(0), lse[:, q0:q1].unsqueeze(0),
                                                       q[q0:q1].unsqueeze(0), k_b, v_b, causal=causal,
                                                       softcap=SOFTCAP)
                worst = max(worst, err / budget if budget else 0.0)
            results.append(dict(case="pools", head_dim=d, causal=causal, page=page, gluon=launched,
                                of_budget=worst))
            print(json.dumps(results[-1]), flush=True)
            if not smoke:
                assert launched == 1, f"the Gluon kernel did not run ({launched} launches)"
        # training: the Gluon forward, then the portable backward
        batch, s, h, hk, d = (1, 1000, 8, 2, 128) if not smoke else (1, 40, 2, 1, 64)
        q, k, v = (torch.randn(batch, s, n, d, device=device, dtype=torch.bfloat16) * f
                   for n, f in ((h, 3), (hk, 3), (hk, 1)))
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        dout = torch.randn(batch, s, h, d, device=device, dtype=torch.bfloat16)
        before = count[0]
        flashtile.flash_attn_func(q, k, v, causal=True, softcap=SOFTCAP).backward(dout)
        launched = count[0] - before
        ref = reference_grads(q.detach().double(), k.detach().double(), v.detach().double(), dout.double(),
                              causal=True, softcap=SOFTCAP)
        low = reference_grads(q.detach(), k.detach(), v.detach(), dout, causal=True, softcap=SOFTCAP)
        worst = 0.0
        for name, got, r, lo in zip("qkv", (q.grad, k.grad, v.grad), ref, low):
            err = (got.double() - r).abs().max().item()
            budget = 3 * (lo.double() - r).abs().max().item()
            assert err <= budget, f"d{name}: error {err:.3g} > 3x textbook bf16 ({budget:.3g})"
            worst = max(worst, err / budget)
        results.append(dict(case="train", gluon=launched, of_budget=worst))
        print(json.dumps(results[-1]), flush=True)
        if not smoke:
            assert launched == 1, f"the Gluon kernel did not run ({launched} launches)"
    finally:
        restore()
        set_switch(switch)
    return results


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def run_timings(rounds: int) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashtile.kernels import gluon_forward
    rows = []
    switch, approx = set_switch(True), gluon_forward.SOFTCAP_APPROX
    points = [(16, 8, 256, True, (-1, -1), 2, 4096), (16, 8, 256, False, (-1, -1), 2, 4096),
              (32, 16, 128, True, (-1, -1), 2, 4096), (32, 16, 128, False, (-1, -1), 2, 4096),
              (16, 8, 256, True, (4096, 0), 1, 16384)]  # (a local layer: SDPA takes no window)
    for heads, heads_k, d, causal, window, batch, s in points:
        q = torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, s, heads_k, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, s, heads_k, d, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call(mode):
            if mode in ("flash", "cudnn"):
                backend = SDPBackend.FLASH_ATTENTION if mode == "flash" else SDPBackend.CUDNN_ATTENTION
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                            enable_gqa=True)
            set_switch(mode in ("gluon", "formula"))
            gluon_forward.SOFTCAP_APPROX = mode != "formula"
            return flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                             softcap=0.0 if mode == "nocap" else SOFTCAP)
        modes = ["gluon", "formula", "portable", "nocap"] + (["flash", "cudnn"] if window == (-1, -1) else [])
        available = []
        for mode in modes:
            try:
                call(mode)
                available.append(mode)
            except RuntimeError as e:  # (an SDPA backend that refuses the shape)
                print(f"{mode}: {str(e).splitlines()[0]}")
        times = {m: [] for m in available}
        for r in range(rounds):
            for i in range(len(available)):
                mode = available[(r + i) % len(available)]
                times[mode].append(do_bench(lambda: call(mode)))
        if window == (-1, -1):
            flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
        else:  # the pairs a causal window keeps
            pairs = sum(min(i + 1, window[0] + 1) for i in range(s))
            flops = 4 * batch * heads * pairs * d
        row = dict(heads=heads, heads_k=heads_k, head_dim=d, batch=batch, seqlen=s, causal=causal, window=window,
                   **{f"ms_{m}": median(times[m]) for m in available})
        row.update({f"tflops_{m}": flops / row[f"ms_{m}"] / 1e9 for m in available})
        rows.append(row)
        print(json.dumps(row), flush=True)
    set_switch(switch)
    gluon_forward.SOFTCAP_APPROX = approx
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cpu" if args.smoke else "cuda")
    from flashtile.kernels import gluon_forward
    checks = run_checks(device, args.smoke)
    rows = [] if args.check_only or args.smoke else run_timings(args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "softcap-check.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                       softcap=SOFTCAP, rounds=args.rounds, softcap_approx=gluon_forward.SOFTCAP_APPROX,
                       checks=checks, rows=rows), f, indent=1)
    print(f"checks: {len(checks)} passed, worst {max(c['of_budget'] for c in checks):.2f} of the budget")
    if rows:
        print(f"{'heads':>6} {'d':>4} {'causal':>6} {'window':>6} | ms: {'gluon':>7} {'formula':>7} {'portable':>8}"
              f" {'nocap':>7} {'flash':>7} {'cudnn':>7} | gluon/formula gluon/portable gluon/nocap gluon/cudnn(no cap)")
        for r in rows:
            ms = [r.get(f"ms_{m}", float("nan")) for m in ("gluon", "formula", "portable", "nocap", "flash", "cudnn")]
            print(f"{r['heads']:>3}/{r['heads_k']:<2} {r['head_dim']:>4} {str(r['causal']):>6} {r['window'][0]:>6} | "
                  + " ".join(f"{x:7.3f}" for x in ms)
                  + f" | {ms[1] / ms[0]:13.2f}x {ms[2] / ms[0]:14.2f}x {ms[3] / ms[0]:10.2f}x {ms[5] / ms[0]:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
