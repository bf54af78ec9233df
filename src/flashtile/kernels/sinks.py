"""Attention sinks on a finished call, in place and in one launch.

A sink s (one logit per query head, gpt-oss's) takes its share of each row's softmax and adds no
value: the output becomes out * sigmoid(lse - s) and the LSE logaddexp(lse, s). Eager inference
calls take this kernel instead of the half-dozen elementwise torch ops (a launch each, host time on
every layer of a decode step); calls that need gradients, and compiled graphs, take the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forward import head_dim_padded, interpreting
from .launch import launch

BLOCK_ROWS = 16
_OPTIONS: dict = {}


@triton.jit
def _apply_sinks(Out, Lse, Sinks, seqlen, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                 BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    row_ok = rows < seqlen
    lse_at = Lse + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + rows.to(tl.int64) * stride_ls
    lse = tl.load(lse_at, mask=row_ok, other=0.0)
    sink = tl.load(Sinks + head).to(tl.float32)
    gap = lse - sink  # +inf on rows that saw no key: kept 1 (their output is 0), LSE stays +inf
    kept = 1.0 / (1.0 + tl.exp(-gap))
    d = tl.arange(0, HEAD_DIM_PAD)
    out_at = (Out + batch.to(tl.int64) * stride_ob + rows[:, None].to(tl.int64) * stride_os
              + head.to(tl.int64) * stride_oh + d[None, :])
    ok = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.load(out_at, mask=ok, other=0.0).to(tl.float32)  # (fp32 at once: the interpreter's bf16)
    tl.store(out_at, (o * kept[:, None]).to(Out.dtype.element_ty), mask=ok)
    # logaddexp(lse, sink): the larger plus the smaller's share (an infinite gap adds log 1 = 0)
    merged = tl.maximum(lse, sink) + tl.log(1.0 + tl.exp(-tl.abs(gap)))
    tl.store(lse_at, merged, mask=row_ok)


def apply_sinks_(out, lse, sinks) -> None:
    """out (B, S, H, D) and lse (B, H, S) float32, both written in place; sinks (H,). Views of any
    strides (the last dimension of out contiguous)."""
    batch, seqlen, heads, head_dim = out.shape
    if out.numel() == 0:
        return
    if interpreting() and out.dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 stores
        upcast = out.float()
        apply_sinks_(upcast, lse, sinks)
        out.copy_(upcast)
        return
    options = _OPTIONS.get(head_dim)
    if options is None:
        options = _OPTIONS[head_dim] = dict(BLOCK_ROWS=BLOCK_ROWS, HEAD_DIM=head_dim,
                                            HEAD_DIM_PAD=head_dim_padded(head_dim), num_warps=4)
    launch(_apply_sinks, (triton.cdiv(seqlen, BLOCK_ROWS), heads, batch), (out, lse, sinks),
           (seqlen, *out.stride()[:3], *lse.stride()), options)
