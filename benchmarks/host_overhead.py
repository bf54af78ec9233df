"""Host time per call (Python checks + launch) for a tiny prefill, flashtile against SDPA's flash backend."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


q = torch.randn(1, 128, 12, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
mine = per_call_us(lambda: flashtile.flash_attn_func(q, k, k, causal=True))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    theirs = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, kt, is_causal=True, enable_gqa=True))
print(f"host+device per call, B1 H12/2 S128 d128 causal: flashtile {mine:.1f} us, sdpa-flash {theirs:.1f} us")

if __name__ == "__main__":
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        flashtile.flash_attn_func(q, k, k, causal=True)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
