"""The dropout mask the attention kernels draw, materialized: for ``return_attn_probs`` and tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dropout_keep, dropout_seed


@triton.jit
def _dropout_mask(Seed, Keep, seqlen_q, seqlen_k, dropout_p,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    num_heads = tl.num_programs(1)
    rng_seed = dropout_seed(Seed, batch, head, num_heads)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = Keep + (batch * num_heads + head).to(tl.int64) * seqlen_q * seqlen_k
    for n0 in range(0, seqlen_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        keep = dropout_keep(rng_seed, rows[:, None] * seqlen_k, cols[None, :], dropout_p)
        ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
        tl.store(base + rows[:, None].to(tl.int64) * seqlen_k + cols[None, :], keep.to(tl.int8), mask=ok)


def dropout_mask(seed: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                 dropout_p: float) -> torch.Tensor:
    """Boolean (batch, heads, seqlen_q, seqlen_k): True where the kernels keep a probability."""
    keep = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.int8, device=seed.device)
    if keep.numel():
        grid = (triton.cdiv(seqlen_q, 32), heads, batch)
        _dropout_mask[grid](seed, keep, seqlen_q, seqlen_k, dropout_p, BLOCK_M=32, BLOCK_N=64)
    return keep.bool()
