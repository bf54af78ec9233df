"""Attention sinks on a finished call, in place and in one launch.

A sink s (one logit per query head, gpt-oss's) takes its share of each row's softmax and adds no
value: the output becomes out * sigmoid(lse - s) and the LSE logaddexp(lse, s). The portable forward
and the decode kernels take the sink's column in their epilogues (SINKS); the Gluon forward routes
get apply_sinks_ on their outputs (forward.attention_forward), as do the decode plans that end
without an epilogue of their own (stream-K). The prefill op's backward reads the output and LSE as
they are: the backward kernels, given those of the softmax with the sink's column, give that
softmax's dq, dk, dv unchanged (the column carries no value, so it adds nothing to
D = rowsum(dO * O) and no dP), and the sink's own gradient is sink_grad's one pass. Compiled graphs
of the inference calls take the torch ops instead (interface._with_sinks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forward import head_dim_padded, interpreting
from .launch import launch

BLOCK_ROWS = 16
_OPTIONS: dict = {}
_GRAD_OPTIONS: dict = {}


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


def apply_sinks_(out, lse, sinks, packed: bool = False) -> None:
    """out (B, S, H, D) and lse (B, H, S) float32, both written in place; sinks (H,). Views of any
    strides (the last dimension of out contiguous). ``packed``: out (total, H, D), lse (H, total)."""
    if packed:
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)
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


@triton.jit
def _sink_grad(Out, DOut, Lse, DLse, Sinks, Partial, seqlen, blocks, stride_ob, stride_os, stride_oh,
               stride_gb, stride_gs, stride_gh, stride_lb, stride_lh, stride_ls, stride_db, stride_dh, stride_ds,
               HAS_DLSE: tl.constexpr, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < seqlen
    lse = tl.load(Lse + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
                  + rows.to(tl.int64) * stride_ls, mask=row_ok, other=float("inf"))
    sink = tl.load(Sinks + head).to(tl.float32)
    share = tl.exp(sink - lse)  # the sink's probability; 0 on rows that saw no key (LSE +inf)
    d = tl.arange(0, HEAD_DIM_PAD)
    ok = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.load(Out + batch.to(tl.int64) * stride_ob + rows[:, None].to(tl.int64) * stride_os
                + head.to(tl.int64) * stride_oh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(DOut + batch.to(tl.int64) * stride_gb + rows[:, None].to(tl.int64) * stride_gs
                + head.to(tl.int64) * stride_gh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    weight = -tl.sum(o * g, axis=1)  # -D, the softmax's rowsum(dO * O)
    if HAS_DLSE:
        weight += tl.load(DLse + batch.to(tl.int64) * stride_db + head.to(tl.int64) * stride_dh
                          + rows.to(tl.int64) * stride_ds, mask=row_ok, other=0.0)
    total = tl.sum(tl.where(row_ok & (share > 0), share * weight, 0.0), axis=0)
    tl.store(Partial + (batch * tl.num_programs(1) + head).to(tl.int64) * blocks + block, total)


def sink_grad(out, dout, lse, dlse, sinks, packed: bool = False) -> torch.Tensor:
    """The sinks' gradient (H,) in sinks' dtype, from out (B, S, H, D) and lse (B, H, S) of the softmax
    with the sinks (as apply_sinks_ left them), dout like out and dlse like lse or None:
    ds[h] = sum over rows of p_i (dlse_i - rowsum(dout_i * out_i)), p_i = exp(s[h] - lse_i) the sink's
    probability (a sink's logit moves only the normalizer). One pass over out and dout; per-block sums
    added by torch, so the result does not depend on the launch order. ``packed``: out and dout
    (total, H, D), lse and dlse (H, total)."""
    if packed:
        out, dout, lse = out.unsqueeze(0), dout.unsqueeze(0), lse.unsqueeze(0)
        dlse = dlse.unsqueeze(0) if dlse is not None else None
    batch, seqlen, heads, head_dim = out.shape
    if out.numel() == 0:
        return torch.zeros_like(sinks)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    blocks = triton.cdiv(seqlen, BLOCK_ROWS)
    partial = torch.empty(batch, heads, blocks, dtype=torch.float32, device=out.device)
    key = (head_dim, dlse is not None)
    options = _GRAD_OPTIONS.get(key)
    if options is None:
        options = _GRAD_OPTIONS[key] = dict(HAS_DLSE=dlse is not None, BLOCK_ROWS=BLOCK_ROWS, HEAD_DIM=head_dim,
                                            HEAD_DIM_PAD=head_dim_padded(head_dim), num_warps=4)
    launch(_sink_grad, (blocks, heads, batch), (out, dout, lse, dlse if dlse is not None else lse, sinks, partial),
           (seqlen, blocks, *out.stride()[:3], *dout.stride()[:3], *lse.stride(),
            *(dlse.stride() if dlse is not None else (0, 0, 0))), options)
    return partial.sum((0, 2)).to(sinks.dtype)
