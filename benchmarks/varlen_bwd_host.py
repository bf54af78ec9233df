"""Whether a packed training step is bound by the host: the step of varlen_bwd.py's 8 x 2048 16/16
causal batch and of a tiny batch (8 x 64, where the GPU work is negligible: the step's time is its
host time), flash_attn_varlen_func against flash_attn_func, medians of do_bench over 6 alternated rounds.

    PYTHONPATH=src python benchmarks/varlen_bwd_host.py
"""

import os
import sys

import torch

import flashtile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from window_probe import balanced_rounds, median  # noqa: E402


def calls(b, n, h, d, causal=True):
    dev = torch.device("cuda")
    q = torch.randn(b * n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b * n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    cu = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)
    q4, k4, v4, do4 = (t.detach().reshape(b, n, h, d).clone().requires_grad_(t is not dout) for t in (q, k, v, dout))

    def packed():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    def plain():
        out = flashtile.flash_attn_func(q4, k4, v4, causal=causal)
        return torch.autograd.grad(out, (q4, k4, v4), do4)

    def packed_fwd():
        with torch.no_grad():
            return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal)

    def plain_fwd():
        with torch.no_grad():
            return flashtile.flash_attn_func(q4, k4, v4, causal=causal)
    return {"varlen step": packed, "plain step": plain, "varlen fwd": packed_fwd, "plain fwd": plain_fwd}


for shape in [(8, 64, 16, 128), (8, 2048, 16, 128), (16, 2048, 16, 128)]:
    times = balanced_rounds(calls(*shape), 6)
    print(shape, {name: round(median(t), 4) for name, t in times.items()},
          {name: [round(x, 3) for x in t] for name, t in times.items() if "step" in name}, flush=True)
