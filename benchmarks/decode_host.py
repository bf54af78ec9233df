"""Where a decode call's host time goes, on the GPU machine (transformers' generate is host-bound, so
every microsecond per layer is a microsecond per token):

    PYTHONPATH=src python benchmarks/decode_host.py [--out DIR]

1. Direct launches (kernels/launch.py) against Triton's JIT: for several decode configurations (one
   launch, split + merge, pages, an e4m3 cache, left padding, with and without the LSE) and for the
   Gluon prefill forward (d64/d128/d256) the output of the JIT launch and of later direct launches
   must be bitwise equal.
2. Host microseconds per call at Qwen2.5-1.5B's decode shape (12/2 heads, d128, 768 cached keys,
   K/V as transposed views of a (B, Hk, S, D) cache as transformers passes them), batch 1 and 16:
   flash_attn_with_kvcache with direct and with JIT launches, decode_attention alone, SDPA, and the
   attention function transformers calls per layer: flashtile's and transformers' own sdpa one.
3. A 128-token prefill (Gluon, Triton, SDPA flash) and a profile of flash_attn_with_kvcache.

Host time = wall time of 1000 back-to-back calls / 1000 (the GPU keeps up at these sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import flashtile
from flashtile.kernels import decode, launch


def per_call_us(fn, n=1000):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def host_us(fn, n=200, reps=5):
    """Host time alone: enqueueing n calls, without waiting for the GPU (the launch queue holds
    them all); the least of ``reps`` rounds (this host's timings vary by tens of percent)."""
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best / n * 1e6


def gpu_us(fn, n=20, replays=20):
    """GPU time alone: n calls captured in a CUDA graph, replayed."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (n * replays)


def direct_equals_jit(dev) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    cases = []
    for batch, cached, lse in ((1, 768, False), (16, 768, True), (1, 8192, True), (4, 30000, False)):
        q = randn(batch, 1, 12, 128)
        k, v = randn(batch, 2, cached, 128).transpose(1, 2), randn(batch, 2, cached, 128).transpose(1, 2)
        cases.append((f"B{batch} {cached} keys lse={lse}", lambda q=q, k=k, v=v, lse=lse:
                      flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=k.shape[1], causal=True,
                                                        return_softmax_lse=lse)))
    q = randn(4, 1, 32, 128)
    pool_k, pool_v = randn(4096, 16, 8, 128), randn(4096, 16, 8, 128)
    table = torch.randperm(4096, device=dev, dtype=torch.int32)[:4 * 256].view(4, 256)
    lengths = torch.tensor([4000, 17, 2500, 4096], dtype=torch.int32, device=dev)
    cases.append(("paged 16, B4 32/8", lambda: flashtile.flash_attn_with_kvcache(
        q, pool_k, pool_v, cache_seqlens=lengths, block_table=table, causal=True, return_softmax_lse=True)))
    k8, v8 = (randn(4, 5000, 8, 128).to(torch.float8_e4m3fn) for _ in range(2))
    ks, vs = randn(4, 5000, 8, dtype=torch.float32).abs(), randn(4, 5000, 8, dtype=torch.float32).abs()
    cases.append(("e4m3 cache B4 32/8", lambda: flashtile.flash_attn_with_kvcache(
        q, k8, v8, cache_seqlens=lengths, k_descale=ks, v_descale=vs, causal=True,
        return_softmax_lse=True)))
    kc, vc = randn(4, 5000, 8, 128), randn(4, 5000, 8, 128)
    leftpad = torch.tensor([0, 10, 2000, 4095], dtype=torch.int32, device=dev)
    cases.append(("left padding B4 32/8", lambda: flashtile.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lengths, cache_leftpad=leftpad, causal=True, return_softmax_lse=True)))
    for d, causal in ((128, True), (256, False), (64, True)):  # the Gluon forward (sm_90)
        qp, kp, vp = randn(2, 1000, 8, d), randn(2, 1000, 2, d), randn(2, 1000, 2, d)
        cases.append((f"prefill d{d} causal={causal}", lambda qp=qp, kp=kp, vp=vp, causal=causal:
                      flashtile.flash_attn_func(qp, kp, vp, causal=causal, return_attn_probs=False)))
    results = []
    for name, call in cases:
        launch.ENABLED = False
        expected = call()
        launch.ENABLED = True
        runs = [call(), call(), call()]

        def same(a, b):
            if isinstance(a, tuple):
                return all(same(x, y) for x, y in zip(a, b))
            return torch.equal(a, b)
        results.append({"case": name, "identical": all(same(expected, r) for r in runs)})
    return results


class LayerStub(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, heads, heads_k):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = heads // heads_k
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16), requires_grad=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    checks = direct_equals_jit(dev)
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from flashtile.integrations.transformers import flashtile_attention_forward
    except ImportError:
        sdpa_attention_forward = flashtile_attention_forward = None
    for batch in (1, 16):
        heads, heads_k, dim, cached = 12, 2, 128, 768
        q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, heads_k, cached, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
        lengths = torch.full((batch,), cached, dtype=torch.int32, device=dev)
        scale = dim ** -0.5
        with torch.no_grad():
            for direct in (False, True):
                launch.ENABLED = direct
                rows.append((batch, f"flash_attn_with_kvcache, {'direct' if direct else 'JIT'} launch",
                             per_call_us(lambda: flashtile.flash_attn_with_kvcache(
                                 qf, kf, vf, cache_seqlens=cached, causal=True))))
            for splits in (0, 1, 2, 4, 6, 8, 16):
                def call(splits=splits):
                    return decode.decode_attention(qf, kf, vf, lengths, softmax_scale=scale,
                                                   window_left=-1, window_right=0, num_splits=splits,
                                                   need_lse=False)
                rows.append((batch, f"decode_attention splits={splits or 'auto'}: host", host_us(call)))
                rows.append((batch, f"decode_attention splits={splits or 'auto'}: GPU (graph)",
                             gpu_us(call)))
            rows.append((batch, "sdpa: host", host_us(lambda: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=True))))
            rows.append((batch, "sdpa: GPU (graph)", gpu_us(lambda: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=True))))
            rows.append((batch, "flash_attn_with_kvcache + LSE", per_call_us(
                lambda: flashtile.flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=cached, causal=True,
                                                          return_softmax_lse=True))))
            rows.append((batch, "decode_attention, no LSE", per_call_us(
                lambda: decode.decode_attention(qf, kf, vf, lengths, softmax_scale=scale, window_left=-1,
                                                window_right=0, need_lse=False))))
            rows.append((batch, "decode_attention, 8 splits (2 launches)", per_call_us(
                lambda: decode.decode_attention(qf, kf, vf, lengths, softmax_scale=scale, window_left=-1,
                                                window_right=0, num_splits=8))))
            rows.append((batch, "sdpa (cuDNN/flash as torch picks)", per_call_us(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))))
            if flashtile_attention_forward is not None:
                module = LayerStub(heads, heads_k).to(dev)
                for name, fn in (("transformers layer call: flashtile", flashtile_attention_forward),
                                 ("transformers layer call: sdpa", sdpa_attention_forward)):
                    rows.append((batch, name, per_call_us(
                        lambda fn=fn: fn(module, q, k, v, None, dropout=0.0, scaling=scale))))
                    rows.append((batch, name + ": host", host_us(
                        lambda fn=fn: fn(module, q, k, v, None, dropout=0.0, scaling=scale))))
    from flashtile.kernels import forward
    q = torch.randn(1, 128, 12, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 128, 2, 128, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for enabled in (True, False):
            forward.GLUON_ENABLED = enabled
            rows.append((1, f"flash_attn_func S128 causal, {'gluon' if enabled else 'triton'}", per_call_us(
                lambda: flashtile.flash_attn_func(q, k, k, causal=True))))
        forward.GLUON_ENABLED = True
        launch.ENABLED = False
        rows.append((1, "flash_attn_func S128 causal, gluon, JIT launch", per_call_us(
            lambda: flashtile.flash_attn_func(q, k, k, causal=True))))
        launch.ENABLED = True
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows.append((1, "sdpa flash S128 causal", per_call_us(
                lambda: F.scaled_dot_product_attention(qt, kt, kt, is_causal=True, enable_gqa=True))))
    print("direct launch == JIT launch, bitwise:")
    for c in checks:
        print(f"  {c['case']:<28s} {'ok' if c['identical'] else 'DIFFERENT'}")
    print("host us per call, Qwen2.5-1.5B decode shape (12/2 heads, d128, 768 keys)")
    for batch, name, us in rows:
        print(f"  B{batch:<3d} {name:<45s} {us:8.1f}")
    if args.out:
        with open(os.path.join(args.out, "decode-host.json"), "w") as f:
            json.dump({"direct_equals_jit": checks, "host_us": [
                {"batch": b, "call": n, "us": round(u, 1)} for b, n, u in rows]}, f, indent=1)

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
    return 0 if all(c["identical"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
