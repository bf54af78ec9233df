"""The DRAM read ceiling the decode benchmarks judge GB/s against: a Triton kernel that only streams.

``torch.sum`` over 2 GiB (the ceiling until 2026-12-01) is a reduction kernel, not a read: on the
H200 it read 4,190-4,230 GB/s while decode kernels (flashtile's and cuDNN's) read up to 4,660 GB/s
of K+V, "110% of the ceiling". This kernel does nothing but load: each program XORs its blocks of
32-bit words into a register vector (no arithmetic unit can be the limit, no load can be dropped)
and writes one word. It runs over a few block sizes, warp counts and grid sizes and the fastest is
the ceiling, next to torch.sum and a copy for comparison.

Imported only where a GPU (or the interpreter, for the tests) is chosen: the kernel is decorated on
import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# (words per block, warps, programs per SM; 0 = one program per block, no grid-stride loop). On the
# H200 (2026-12-01, 8 GiB) one program per 8192-word block with 8 warps was fastest (4,603 GB/s),
# 4096-word blocks within 0.4%, every grid-stride config 1.6-3.9% slower, 16384-word blocks 4-7%
# (read-ceiling-h200-20261201-b.log).
CONFIGS = ((1024, 1, 0), (2048, 2, 0), (2048, 4, 0), (4096, 2, 0), (4096, 4, 0), (4096, 8, 0),
           (8192, 4, 0), (8192, 8, 0), (16384, 4, 0), (16384, 8, 0),
           (4096, 4, 8), (4096, 8, 4), (8192, 8, 4), (16384, 8, 8))


@triton.jit
def _stream_read(src, out, num_blocks, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program p XORs blocks p, p + grid, p + 2 grid, ... of ``src`` and writes the result. ``PDL``:
    launched while the previous kernel runs, it waits for it before any load and lets the next one in."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    ptrs = src + pid.to(tl.int64) * BLOCK + offsets
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for _ in range(pid, num_blocks, tl.num_programs(0)):
        acc ^= tl.load(ptrs)
        ptrs += step
    tl.store(out + pid, tl.xor_sum(acc, 0))


def grid_size(num_blocks: int, per_sm: int, sm_count: int) -> int:
    return num_blocks if per_sm == 0 else min(num_blocks, per_sm * sm_count)


def stream_read(words: torch.Tensor, block: int, warps: int, per_sm: int,
                out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """XOR of ``words`` (1-D int32, a whole number of blocks) per program: (grid,) int32. ``pdl``: a
    programmatic dependent launch (read_sizes.py's chained layers)."""
    if words.dtype != torch.int32 or words.dim() != 1 or words.numel() % block:
        raise ValueError("words: a 1-D int32 tensor of a whole number of blocks")
    num_blocks = words.numel() // block
    sm_count = (torch.cuda.get_device_properties(words.device).multi_processor_count
                if words.is_cuda else 4)
    grid = grid_size(num_blocks, per_sm, sm_count)
    if out is None:
        out = torch.empty(grid, dtype=torch.int32, device=words.device)
    _stream_read[(grid,)](words, out, num_blocks, BLOCK=block, PDL=pdl, num_warps=warps,
                          **({"launch_pdl": True} if pdl else {}))
    return out


def verify(words: torch.Tensor) -> None:
    """Every config's programs together XOR each word of ``words`` (a few MiB, random) once: the XOR
    of their outputs equals the XOR of the whole buffer, computed on the host (a word skipped or read
    twice changes it). Raises if not."""
    import numpy as np
    expected = int(np.bitwise_xor.reduce(words.cpu().numpy()))
    for block, warps, per_sm in CONFIGS:
        got = int(np.bitwise_xor.reduce(stream_read(words, block, warps, per_sm).cpu().numpy()))
        if got != expected:
            raise RuntimeError(f"stream_read ({block}, {warps}, {per_sm}) read {got:#x}, expected {expected:#x}")


def measure(words: torch.Tensor, timer) -> dict:
    """Read rate of every config over ``words`` (GB/s of the bytes of ``words``): the best and all.
    The configs are first checked on the buffer's first 4 MiB (``verify``)."""
    nbytes = words.numel() * words.element_size()
    verify(words[:min(words.numel(), 1 << 20)])
    rows = []
    for block, warps, per_sm in CONFIGS:
        out = stream_read(words, block, warps, per_sm)  # compile and check the launch once
        ms = timer(lambda: stream_read(words, block, warps, per_sm, out))
        rows.append({"block_words": block, "warps": warps, "per_sm": per_sm, "ms": ms,
                     "gbps": nbytes / (ms * 1e-3) / 1e9})
    best = max(rows, key=lambda r: r["gbps"])
    return {"gbps": best["gbps"], "best": best, "configs": rows}
