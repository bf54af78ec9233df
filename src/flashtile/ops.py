"""flashtile's registered custom ops: what torch.compile and CUDA graphs see of the kernels."""

from __future__ import annotations

from typing import Optional

import torch

from .kernels.forward import attention_forward


def forward(q, k, v, softmax_scale: float, window_left: int, window_right: int, bottom_right: bool,
            softcap: float, alibi_slopes):
    """The forward as the public functions call it.

    Eager calls that autograd need not see go straight to the launcher: the custom-op dispatcher costs
    tens of microseconds a call, as much as a short prefill kernel. Under torch.compile, or with inputs
    that require grad, the registered op runs instead.
    """
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return attn_fwd(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                        alibi_slopes)
    return _attn_fwd_impl(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                          alibi_slopes)


def _attn_fwd_impl(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                   alibi_slopes):
    diag_offset = k.shape[1] - q.shape[1] if bottom_right else 0
    return attention_forward(q, k, v, softmax_scale=softmax_scale, window_left=window_left,
                             window_right=window_right, diag_offset=diag_offset, softcap=softcap,
                             alibi_slopes=alibi_slopes)


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             window_left: int, window_right: int, bottom_right: bool, softcap: float,
             alibi_slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on validated (B, S, H, D) tensors; returns (out, lse)."""
    return _attn_fwd_impl(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                          alibi_slopes)


@attn_fwd.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes):
    batch, seqlen_q, heads, head_dim = q.shape
    out = q.new_empty(batch, seqlen_q, heads, head_dim)
    lse = q.new_empty(batch, heads, seqlen_q, dtype=torch.float32)
    return out, lse


def _setup_fwd_context(ctx, inputs, output):
    pass


def _attn_fwd_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "flashtile: the attention backward is not implemented yet (tracked by the training issue); "
        "call the forward under torch.no_grad() or with inputs that do not require grad")


attn_fwd.register_autograd(_attn_fwd_backward, setup_context=_setup_fwd_context)
