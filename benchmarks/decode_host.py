"""Where a decode call's host time goes, on the GPU machine (transformers' generate is host-bound, so
every microsecond per layer is a microsecond per token):

    PYTHONPATH=src python benchmarks/decode_host.py

Per call, at Qwen2.5-1.5B's decode shape (12/2 heads, d128, 768 cached keys, batch 1 and 16, K/V as
transposed views of a (B, Hk, S, D) cache as transformers passes them): flash_attn_with_kvcache,
decode_attention alone, the split kernel's and the combine kernel's launches through Triton's JIT,
the same compiled kernels launched directly (CompiledKernel.run, checked to give identical output),
and SDPA; then a 128-token prefill (flash_attn_func through the Gluon and the Triton kernel, SDPA
flash) and a profile of flash_attn_with_kvcache. Host time = wall time of 1000 back-to-back calls / 1000 (the GPU keeps up at this size).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import flashtile
from flashtile.kernels import decode


def per_call_us(fn, n=1000):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


class Recorder:
    """Stands in for a JIT kernel for one call: records (grid, args, kwargs), then launches it."""

    def __init__(self, jit):
        self.jit, self.calls = jit, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.jit[grid](*args, **kwargs)
        return launch


def direct_launcher(jit, grid, args, kwargs):
    """The compiled kernel and its bound arguments, launched without the JIT's dispatch."""
    kernel = jit[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    binder = jit.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = tuple(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def run():
        stream = torch.cuda.current_stream().cuda_stream
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *values)
    return run


def main():
    dev = torch.device("cuda")
    rows = []
    for batch in (1, 16):
        heads, heads_k, dim, cached = 12, 2, 128, 768
        q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, heads_k, cached, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
        lengths = torch.full((batch,), cached, dtype=torch.int32, device=dev)
        scale = dim ** -0.5
        with torch.no_grad():
            rows.append((batch, "flash_attn_with_kvcache", per_call_us(
                lambda: flashtile.flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=cached, causal=True))))
            rows.append((batch, "decode_attention", per_call_us(
                lambda: decode.decode_attention(qf, kf, vf, lengths, softmax_scale=scale, window_left=-1,
                                                window_right=0))))
            split_jit, combine_jit = decode._attn_decode, decode._combine
            rec_split, rec_combine = Recorder(split_jit), Recorder(combine_jit)
            decode._attn_decode, decode._combine = rec_split, rec_combine
            try:
                expected = decode.decode_attention(qf, kf, vf, lengths, softmax_scale=scale, window_left=-1,
                                                   window_right=0)[0].clone()
            finally:
                decode._attn_decode, decode._combine = split_jit, combine_jit
            for name, jit, rec in (("split kernel, JIT launch", split_jit, rec_split),
                                   ("combine kernel, JIT launch", combine_jit, rec_combine)):
                if not rec.calls:
                    rows.append((batch, name, float("nan")))
                    continue
                grid, args, kwargs = rec.calls[0]
                rows.append((batch, name, per_call_us(lambda: jit[grid](*args, **kwargs))))
                direct = direct_launcher(jit, grid, args, kwargs)
                rows.append((batch, name.replace("JIT", "direct"), per_call_us(direct)))
            # The direct launches alone must reproduce the JIT's output exactly.
            runners = [direct_launcher(jit, *rec.calls[0])
                       for jit, rec in ((split_jit, rec_split), (combine_jit, rec_combine)) if rec.calls]
            out_tensor = rec_combine.calls[0][1][2] if rec_combine.calls else rec_split.calls[0][1][5]
            torch.cuda.synchronize()
            out_tensor.fill_(float("nan"))
            for run in runners:
                run()
            torch.cuda.synchronize()
            same = torch.equal(out_tensor, expected)
            rows.append((batch, f"direct launches reproduce the output: {same}", float("nan")))
            rows.append((batch, "sdpa (cuDNN/flash as torch picks)", per_call_us(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
    # The prefill forward at a size where the host dominates, Gluon and Triton kernels.
    from flashtile.kernels import forward
    q = torch.randn(1, 128, 12, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 128, 2, 128, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for enabled in (True, False):
            forward.GLUON_ENABLED = enabled
            rows.append((1, f"flash_attn_func S128 causal, {'gluon' if enabled else 'triton'}", per_call_us(
                lambda: flashtile.flash_attn_func(q, k, k, causal=True))))
        forward.GLUON_ENABLED = True
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows.append((1, "sdpa flash S128 causal", per_call_us(
                lambda: F.scaled_dot_product_attention(qt, kt, kt, is_causal=True, enable_gqa=True))))
    print("host us per call, Qwen2.5-1.5B decode shape (12/2 heads, d128, 768 keys)")
    for batch, name, us in rows:
        print(f"  B{batch:<3d} {name:<45s} {us:8.1f}")

    import cProfile
    import pstats
    q = torch.randn(16, 1, 12, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(16, 768, 2, 128, device=dev, dtype=torch.bfloat16)
    profile = cProfile.Profile()
    with torch.no_grad():
        profile.enable()
        for _ in range(500):
            flashtile.flash_attn_with_kvcache(q, k, k, cache_seqlens=768, causal=True)
        profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
