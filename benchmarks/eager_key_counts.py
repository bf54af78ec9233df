"""Probe: flash_attn_func calls that take the split route, timed eagerly (do_bench, host time
included) with the key counts filled by torch.full each call against forward.key_counts (made once
per shape); three alternating rounds, the median printed. The two outputs compared bitwise.

    PYTHONPATH=src python benchmarks/eager_key_counts.py
"""

import torch
import triton

import flashtile
from flashtile.kernels import forward as fwd


def filled(batch, keys, device):
    return torch.full((batch,), keys, dtype=torch.int32, device=device)


def main():
    device = torch.device("cuda")
    cached = fwd.key_counts
    for (b, h, hk, sq, sk) in ((1, 12, 2, 128, 1024), (1, 32, 8, 128, 4096), (1, 32, 8, 1, 8192)):
        q = torch.randn(b, sq, h, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        times = {"torch.full": [], "cached": []}
        outs = {}
        for _ in range(3):
            for name, fn in (("torch.full", filled), ("cached", cached)):
                fwd.key_counts = fn
                outs[name] = flashtile.flash_attn_func(q, k, v, causal=True)
                times[name].append(triton.testing.do_bench(
                    lambda: flashtile.flash_attn_func(q, k, v, causal=True), warmup=50, rep=300) * 1e3)
        fwd.key_counts = cached
        med = {name: sorted(t)[1] for name, t in times.items()}
        print(f"eager B{b} {h}/{hk} Sq{sq} Sk{sk}: torch.full {med['torch.full']:.1f} us, cached "
              f"{med['cached']:.1f} us, outputs equal {torch.equal(outs['torch.full'], outs['cached'])} "
              f"(rounds {[round(x, 1) for x in times['torch.full']]} / {[round(x, 1) for x in times['cached']]})",
              flush=True)


if __name__ == "__main__":
    main()
