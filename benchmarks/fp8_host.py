"""Host time of flashtile.fp8.attention on the GPU machine against flash_attn_func in bf16: the e4m3
call reads below bf16 at short, few-head shapes (bench prefill --dtype fp8: B1 12/2 causal 4k 205
against 543 TFLOP/s, 8k 591 against 619) where the host's work per call outlasts the GPU's.

    PYTHONPATH=src python benchmarks/fp8_host.py [--out DIR] [--profile] [--check-only]

For each shape: host microseconds per call (enqueueing 200 calls without waiting, least of 5
rounds), GPU microseconds per call (20 calls in a CUDA graph) and do_bench's median, for
flash_attn_func (bf16) and fp8.attention on the same inputs quantized once (outside the timed call,
as bench prefill --dtype fp8 does), the latter also as the code before the cached e4m3 plan ran it
and with its kernel descales made beforehand (what finding V's largest descale inside the kernel
could save), and flash_attn_func on e4m3 inputs with FlashAttention-3's (B, Hk) descales
(host times differ by up to 2x between machine starts: compare within one run); the e4m3 outputs are compared with float64 attention of the
dequantized inputs first, and fp8.attention's output and LSE through the cached plan against the
general path's, bit for bit (--check-only: that alone, small shapes). --profile: cProfiles of
fp8.attention and of flash_attn_func's e4m3 call at the first shape. Writes fp8-host.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_host import gpu_us, host_us  # noqa: E402

import flashtile  # noqa: E402
from flashtile import fp8, reference  # noqa: E402

SHAPES = [(1, 1024, 12, 2, True), (1, 4096, 12, 2, True), (1, 8192, 12, 2, True),
          (4, 4096, 16, 16, False), (4, 4096, 16, 16, True)]


def dequantized(z: fp8.FP8QKV, which: str) -> torch.Tensor:
    """z.q/k/v in float64 times their block descales (rotated Q and K: scores unchanged)."""
    x = getattr(z, which).double()
    ds = getattr(z, f"{which}_descale").double()  # (B, heads, blocks)
    block = z.block_q if which == "q" else z.block_k
    per_token = ds.repeat_interleave(block, dim=-1)[..., :x.shape[1]]  # (B, heads, S)
    return x * per_token.permute(0, 2, 1)[..., None]


def check(z: fp8.FP8QKV, causal: bool) -> float:
    """max |fp8.attention - float64 attention of the dequantized inputs| on the first sequence."""
    out = fp8.attention(z, causal=causal)
    q, k, v = (dequantized(z, w)[:1] for w in ("q", "k", "v"))
    ref, _ = reference.attention(q, k, v, causal=causal)
    return (out[:1].double() - ref).abs().max().item()


def before(call):
    """``call()`` as the code before the cached e4m3 plan ran it: the general path
    (gluon_forward.fp8_forward declining) with the descales made by five torch operations."""
    from flashtile.kernels import forward, gluon_forward
    plan, fused = gluon_forward.fp8_forward, forward._fused_kernel_descales

    def by_torch(k_d, v_d):
        v_max = v_d.amax(-1, keepdim=True) / forward.P_SHIFT
        return torch.nn.functional.pad(k_d, (0, 1), value=1.0), torch.cat([v_d / v_max, v_max], -1)
    gluon_forward.fp8_forward, forward._fused_kernel_descales = (lambda *a: None), by_torch
    try:
        return call()
    finally:
        gluon_forward.fp8_forward, forward._fused_kernel_descales = plan, fused


def descales_given(call, z: fp8.FP8QKV):
    """``call()`` with the kernel descales made once beforehand (a lookup instead of their launch):
    what the call's host time would be with that launch gone, e.g. V's largest descale found inside
    the attention kernel. The values are the same, so is the output."""
    from flashtile.kernels import forward
    made = forward.fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale)
    real = forward.fp8_kernel_descales
    forward.fp8_kernel_descales = lambda q_d, k_d, v_d: made
    try:
        return call()
    finally:
        forward.fp8_kernel_descales = real


def bitwise(shapes) -> bool:
    """fp8.attention and flash_attn_func's e4m3 call through the cached plan against the general
    path (gluon_forward.fp8_forward declining), and the fused kernel descales against the torch
    formula: bit for bit."""
    from flashtile.kernels import forward, gluon_forward
    dev = torch.device("cuda")
    ok = True
    for b, s, h, hk, causal in shapes:
        q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k) * 3
        z = fp8.quantize_qkv(q, k, v, block=fp8.kernel_blocks(128, dev), hadamard=True)
        planned, planned_lse = fp8.attention(z, causal=causal, return_lse=True)
        real = gluon_forward.fp8_forward
        gluon_forward.fp8_forward = lambda *a: None
        try:
            general, general_lse = fp8.attention(z, causal=causal, return_lse=True)
        finally:
            gluon_forward.fp8_forward = real
        # flash_attn_func's FP8 call (FlashAttention-3's descales, V as given)
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        fa3 = dict(q_descale=torch.rand(b, hk, device=dev) + 0.5, k_descale=torch.rand(b, hk, device=dev) + 0.5,
                   v_descale=torch.rand(b, hk, device=dev) + 0.5)
        planned_fa3 = flashtile.flash_attn_func(q8, k8, v8, causal=causal, **fa3)
        gluon_forward.fp8_forward = lambda *a: None
        try:
            general_fa3 = flashtile.flash_attn_func(q8, k8, v8, causal=causal, **fa3)
        finally:
            gluon_forward.fp8_forward = real
        fused = forward._fused_kernel_descales(z.k_descale, z.v_descale)
        v_max = z.v_descale.amax(-1, keepdim=True) / forward.P_SHIFT
        formula = (torch.nn.functional.pad(z.k_descale, (0, 1), value=1.0),
                   torch.cat([z.v_descale / v_max, v_max], -1))
        same = (torch.equal(planned, general) and torch.equal(planned_lse, general_lse)
                and torch.equal(planned_fa3, general_fa3)
                and all(torch.equal(x, y) for x, y in zip(fused, formula)))
        ok &= same
        print(f"bitwise B{b} S{s} {h}/{hk} {'causal' if causal else 'full'}: "
              f"{'same' if same else 'DIFFERENT'} (plan entries {len(gluon_forward._FP8)})", flush=True)
    return ok


def main() -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--check-only", action="store_true",
                    help="only the bit-for-bit comparison, on small shapes (for compute-sanitizer)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.check_only:
        ok = bitwise([(1, 300, 4, 2, True), (2, 1000, 8, 8, False), (1, 129, 12, 2, True)])
        print("PASS" if ok else "FAIL", "fp8 plan against the general path")
        return 0 if ok else 1
    ok = bitwise(SHAPES)
    print("PASS" if ok else "FAIL", "fp8 plan against the general path", flush=True)
    rows = []
    for b, s, h, hk, causal in SHAPES:
        q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        z = fp8.quantize_qkv(q, k, v, block=fp8.kernel_blocks(128, dev), hadamard=True)
        err = check(z, causal)
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        fa3 = {n: torch.rand(b, hk, device=dev) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
        calls = {"flash_attn_func bf16": lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                 "fp8.attention": lambda: fp8.attention(z, causal=causal),
                 "fp8.attention before": lambda: before(lambda: fp8.attention(z, causal=causal)),
                 "fp8.attention descales given": lambda: descales_given(lambda: fp8.attention(z, causal=causal), z),
                 "flash_attn_func e4m3 (FA3 descales)":
                     lambda: flashtile.flash_attn_func(q8, k8, v8, causal=causal, **fa3)}
        for name, fn in calls.items():
            with torch.no_grad():
                rec = {"batch": b, "seqlen": s, "heads": h, "heads_k": hk, "causal": causal,
                       "call": name, "host_us": round(host_us(fn), 1), "gpu_us": round(gpu_us(fn), 1),
                       "do_bench_us": round(1e3 * triton.testing.do_bench(fn, return_mode="median"), 1)}
                if name.startswith("fp8.attention"):
                    rec["max_abs_err_vs_float64_dequantized"] = err
            rows.append(rec)
            print(f"B{b:<3d} S{s:<5d} {h}/{hk} {'causal' if causal else 'full':6s} {name:22s} host "
                  f"{rec['host_us']:7.1f} us  gpu {rec['gpu_us']:7.1f} us  do_bench {rec['do_bench_us']:7.1f} us"
                  + (f"  max err {err:.2e}" if name.startswith("fp8.attention") else ""), flush=True)
    if args.out:
        with open(os.path.join(args.out, "fp8-host.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "bitwise_same": ok,
                       "method": "host: 200 enqueued calls, least of 5 rounds; gpu: 20 calls in a "
                                 "CUDA graph; do_bench: triton.testing.do_bench median"}, f, indent=1)
    if args.profile:
        import cProfile
        import pstats
        b, s, h, hk, causal = SHAPES[0]
        q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
        z = fp8.quantize_qkv(q, k, k, block=fp8.kernel_blocks(128, dev))
        q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        d = torch.rand(b, hk, device=dev) + 0.5
        for name, fn in (("fp8.attention", lambda: fp8.attention(z, causal=causal)),
                         ("flash_attn_func e4m3", lambda: flashtile.flash_attn_func(
                             q8, k8, k8, causal=causal, q_descale=d, k_descale=d, v_descale=d))):
            profile = cProfile.Profile()
            with torch.no_grad():
                for _ in range(20):
                    fn()
                profile.enable()
                for _ in range(500):
                    fn()
                profile.disable()
            torch.cuda.synchronize()
            print(f"--- cProfile of {name}, 500 calls")
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
