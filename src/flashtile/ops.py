"""flashtile's registered custom ops: what torch.compile and CUDA graphs see of the kernels.

One forward and one backward op serve padded (B, S, H, D) batches and packed sequences: with
``cu_seqlens_q``/``cu_seqlens_k`` the tensors are (total, H, D) and the LSE is (H, total_q).
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels.backward import attention_backward
from .kernels.decode import block_packed_rows, combine, decode_attention, out_dtype, unblock_rows
from .kernels.forward import attention_forward, softcap_approx_in_training
from .kernels.sinks import sink_grad


def new_dropout_seed(dropout_p: float, device: torch.device):
    """A Philox seed for one call from torch's default generator of the device (so torch.manual_seed
    reproduces a run), kept on the device: no host sync, and CUDA graphs replay a fresh draw."""
    if dropout_p <= 0:
        return None
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)


def forward(q, k, v, softmax_scale: float, window_left: int, window_right: int, bottom_right: bool,
            softcap: float, alibi_slopes, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
            max_seqlen_k: int = 0, dropout_p: float = 0.0, dropout_seed=None, block_table=None,
            deterministic: bool = False, keyed_sequences: int = 0, sinks=None):
    """The forward as the public functions call it. ``keyed_sequences`` > 0: at most that many packed
    sequences have keys (a mixed batch's prefill part on page pools, no autograd): it sizes the
    pools' gathers (forward._gluon_varlen). ``sinks`` (H,): attention sinks (s_aux), in the outputs
    (the portable kernel's epilogue, or in place after a Gluon kernel: forward.attention_forward), which
    the backward reads as they are; they get a gradient (kernels/sinks.py).

    Eager calls that autograd need not see go straight to the launcher: the custom-op dispatcher costs
    tens of microseconds a call, as much as a short prefill kernel. Eager calls with inputs that
    require grad go through a plain autograd.Function with the same forward and backward: the
    registered op with its registered autograd cost ~0.4 ms more per training step (measured on a
    CPU: 503 against 81 us of overhead for forward + backward). Under torch.compile the registered op
    runs.

    Calls without gradients are forward-only (attention_forward's ``forward_only``: the Gluon forward
    may take a softcap's tanh by tanh.approx). Calls with them take it too where
    softcap_approx_in_training says so, the backward alike.
    """
    args = (q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed,
            block_table)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or sinks is not None and sinks.requires_grad)
    if torch.compiler.is_compiling():
        return attn_fwd(*args, deterministic, keyed_sequences, sinks, not needs_grad)
    if needs_grad:
        return _EagerAttention.apply(*args, deterministic, 0, sinks)
    return _attn_fwd_impl(*args, keyed_sequences, sinks, True)


def _attn_fwd_impl(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                   alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   dropout_seed, block_table, keyed_sequences=0, sinks=None, forward_only=False):
    diag_offset = k.shape[1] - q.shape[1] if bottom_right and cu_seqlens_q is None else 0
    out, lse = attention_forward(q, k, v, softmax_scale=softmax_scale, window_left=window_left,
                                 window_right=window_right, diag_offset=diag_offset, softcap=softcap,
                                 alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                 block_table=block_table, keyed_sequences=keyed_sequences,
                                 sinks=sinks.detach() if sinks is not None else None,
                                 forward_only=forward_only,
                                 softcap_approx=not forward_only and softcap_approx_in_training(q, softcap))
    return out, lse


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             window_left: int, window_right: int, bottom_right: bool, softcap: float,
             alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor] = None,
             cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
             max_seqlen_k: int = 0, dropout_p: float = 0.0,
             dropout_seed: Optional[torch.Tensor] = None,
             block_table: Optional[torch.Tensor] = None,
             deterministic: bool = False, keyed_sequences: int = 0,
             sinks: Optional[torch.Tensor] = None, forward_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on validated tensors; returns (out, lse), with ``sinks`` those of the softmax
    with one more logit a head. ``deterministic`` only chooses the backward's dQ path;
    ``forward_only``: no backward follows (attention_forward's)."""
    return _attn_fwd_impl(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
                          alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, dropout_seed, block_table, keyed_sequences, sinks, forward_only)


@attn_fwd.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0,
      dropout_seed=None, block_table=None, deterministic=False, keyed_sequences=0, sinks=None,
      forward_only=False):
    if cu_seqlens_q is not None:
        total_q, heads, _ = q.shape
        return q.new_empty(q.shape), q.new_empty(heads, total_q, dtype=torch.float32)
    batch, seqlen_q, heads, head_dim = q.shape
    out = q.new_empty(batch, seqlen_q, heads, head_dim)
    lse = q.new_empty(batch, heads, seqlen_q, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, window_left: int,
             window_right: int, bottom_right: bool, softcap: float,
             alibi_slopes: Optional[torch.Tensor], dlse: Optional[torch.Tensor],
             cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0, dropout_p: float = 0.0,
             dropout_seed: Optional[torch.Tensor] = None, deterministic: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attn_fwd, from the saved output and LSE."""
    return _attn_bwd_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right,
                          bottom_right, softcap, alibi_slopes, dlse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed, deterministic)


def _attn_bwd_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right,
                   softcap, alibi_slopes, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, dropout_seed, deterministic):
    diag_offset = k.shape[1] - q.shape[1] if bottom_right and cu_seqlens_q is None else 0
    return attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                              window_left=window_left, window_right=window_right,
                              diag_offset=diag_offset, softcap=softcap, alibi_slopes=alibi_slopes,
                              dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              dropout_p=dropout_p, dropout_seed=dropout_seed,
                              deterministic=deterministic,
                              softcap_approx=softcap_approx_in_training(q, softcap))


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right, softcap,
      alibi_slopes, dlse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
      dropout_p=0.0, dropout_seed=None, deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_fwd_context(ctx, inputs, output):
    (q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed,
     block_table, *rest) = inputs
    ctx.deterministic = bool(rest[0]) if rest else False  # (rest[1]: keyed_sequences; rest[3]: forward_only)
    sinks = rest[2] if len(rest) > 2 else None
    ctx.inputs = len(inputs)
    ctx.paged = block_table is not None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, sinks)
    ctx.params = (softmax_scale, window_left, window_right, bottom_right, softcap)
    ctx.extra = (max_seqlen_q, max_seqlen_k, dropout_p)


@torch.library.custom_op("flashtile::sinks_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def sinks_bwd(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, grad_lse: Optional[torch.Tensor],
              sinks: torch.Tensor, packed: bool) -> torch.Tensor:
    """The sinks' gradient (kernels.sinks.sink_grad) from attn_fwd's saved output and LSE; ``packed``:
    (total, H, D) and (H, total)."""
    return sink_grad(out, grad_out, lse, grad_lse, sinks, packed)


@sinks_bwd.register_fake
def _(out, grad_out, lse, grad_lse, sinks, packed):
    return sinks.new_empty(sinks.shape)


# attn_fwd's inputs: the 16 of ``forward``'s args, deterministic, keyed_sequences, sinks, forward_only
_SINKS_INPUT = 18


def _attn_fwd_backward(ctx, grad_out, grad_lse, backward=attn_bwd, sinks_backward=sinks_bwd):
    if ctx.paged:
        raise NotImplementedError("flashtile: no backward through a paged KV cache (block_table)")
    q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dropout_seed, sinks = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq = dk = dv = ds = None
    if any(ctx.needs_input_grad[:3]):
        # out and lse are the softmax's with the sinks' column when there are sinks: the same kernels
        # give its dq, dk, dv (the column adds no value, so nothing to dP or to D = rowsum(dO * O))
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, *ctx.params, alibi_slopes, grad_lse,
                              cu_seqlens_q, cu_seqlens_k, *ctx.extra, dropout_seed, ctx.deterministic)
    if sinks is not None and ctx.needs_input_grad[_SINKS_INPUT]:
        ds = sinks_backward(out, grad_out, lse, grad_lse, sinks, cu_seqlens_q is not None)
    grads = (dq, dk, dv) + (None,) * (ctx.inputs - 3)
    if sinks is not None:
        grads = grads[:_SINKS_INPUT] + (ds,) + grads[_SINKS_INPUT + 1:]
    return grads


attn_fwd.register_autograd(_attn_fwd_backward, setup_context=_setup_fwd_context)


class _EagerAttention(torch.autograd.Function):
    """attn_fwd and its registered backward for eager autograd, without the custom-op dispatcher."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)  # an unused LSE gives None: no zeros, no dLSE pass
        output = _attn_fwd_impl(*inputs[:16], 0, inputs[18] if len(inputs) > 18 else None)
        _setup_fwd_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        return _attn_fwd_backward(ctx, grad_out, grad_lse, backward=_attn_bwd_impl, sinks_backward=sink_grad)


def fp8_forward(q, k, v, q_descale, k_descale, v_descale, softmax_scale: float, window_left: int,
                window_right: int, diag_offset: int, softcap: float, alibi_slopes, block_q: int,
                block_k: int, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
                max_seqlen_k: int = 0, block_table=None, keyed_sequences: int = 0, sinks=None):
    """The e4m3 forward as flash_attn_func / flash_attn_varlen_func (on float8_e4m3fn inputs) and
    flashtile.fp8.attention call it: (out bfloat16, lse). As ``forward``: eager calls go straight to
    the launcher; under torch.compile the registered op runs (its Python, the launch plans and the
    kernels' pointer checks, is not something Dynamo can trace). ``sinks`` (H,): attention sinks, in
    the output and LSE (no gradient: the caller applies sinks that want one to the result)."""
    args = (q, k, v, q_descale, k_descale, v_descale, softmax_scale, window_left, window_right,
            diag_offset, softcap, alibi_slopes, block_q, block_k, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, block_table, keyed_sequences, sinks)
    if torch.compiler.is_compiling():
        return attn_fwd_fp8(*args)
    return _attn_fwd_fp8_impl(*args)


def _attn_fwd_fp8_impl(q, k, v, q_descale, k_descale, v_descale, softmax_scale, window_left,
                       window_right, diag_offset, softcap, alibi_slopes, block_q, block_k, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, keyed_sequences=0, sinks=None):
    packed = {} if cu_seqlens_q is None else dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, block_table=block_table, keyed_sequences=keyed_sequences)
    return attention_forward(q, k, v, softmax_scale=softmax_scale, window_left=window_left,
                             window_right=window_right, diag_offset=diag_offset, softcap=softcap,
                             alibi_slopes=alibi_slopes, descales=(q_descale, k_descale, v_descale),
                             scale_blocks=(block_q, block_k), sinks=sinks, **packed)


@torch.library.custom_op("flashtile::attn_fwd_fp8", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor,
                 k_descale: torch.Tensor, v_descale: torch.Tensor, softmax_scale: float,
                 window_left: int, window_right: int, diag_offset: int, softcap: float,
                 alibi_slopes: Optional[torch.Tensor], block_q: int, block_k: int,
                 cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                 max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                 block_table: Optional[torch.Tensor] = None,
                 keyed_sequences: int = 0,
                 sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 attention forward on validated tensors and kernel-layout descales (one per block_q
    queries / block_k keys of each batch row and head, or per sequence when packed); returns (out
    bfloat16, lse float32). Forward only. ``keyed_sequences`` > 0: at most that many packed
    sequences have keys (a mixed batch's prefill part; sizes page pools' gathers). ``sinks`` (H,):
    attention sinks, in the output and LSE."""
    return _attn_fwd_fp8_impl(q, k, v, q_descale, k_descale, v_descale, softmax_scale, window_left,
                              window_right, diag_offset, softcap, alibi_slopes, block_q, block_k,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                              keyed_sequences, sinks)


@attn_fwd_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale, window_left, window_right, diag_offset,
      softcap, alibi_slopes, block_q, block_k, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
      max_seqlen_k=0, block_table=None, keyed_sequences=0, sinks=None):
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    if cu_seqlens_q is not None:
        total_q, heads, _ = q.shape
        return out, q.new_empty(heads, total_q, dtype=torch.float32)
    batch, seqlen_q, heads, _ = q.shape
    return out, q.new_empty(batch, heads, seqlen_q, dtype=torch.float32)


@torch.library.custom_op("flashtile::quantize_qkv", mutates_args=(), device_types=("cuda", "cpu"))
def quantize_qkv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                    hadamard: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashtile.fp8.quantize_qkv on checked inputs, for torch.compile: (q8, k8, v8, q_descale,
    k_descale, v_descale, signs), V keys-contiguous as the e4m3 forward reads it, signs all ones
    without the rotation."""
    from .fp8 import _quantize_qkv
    return tuple(_quantize_qkv(q, k, v, block_q, block_k, hadamard, seed))


@quantize_qkv_op.register_fake
def _(q, k, v, block_q, block_k, hadamard, seed):
    from .kernels.forward import empty_keys_contiguous

    def descales(x, block):
        batch, seqlen, heads, _ = x.shape
        return x.new_empty(batch, heads, max(-(-seqlen // block), 1), dtype=torch.float32)

    e4m3 = torch.float8_e4m3fn
    return (q.new_empty(q.shape, dtype=e4m3), k.new_empty(k.shape, dtype=e4m3),
            empty_keys_contiguous(v.shape, e4m3, v.device), descales(q, block_q), descales(k, block_k),
            descales(v, block_k), q.new_empty(q.shape[-1], dtype=torch.float32))


@torch.library.custom_op("flashtile::combine", mutates_args=(), device_types=("cuda", "cpu"))
def attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_combine on checked inputs, for torch.compile: (out (B, Sq, H, D) in ``out_dtype``,
    lse (B, H, Sq))."""
    _, batch, seqlen, heads, head_dim = out_partial.shape
    out = torch.empty(batch, seqlen, heads, head_dim, device=out_partial.device, dtype=out_dtype)
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=out_partial.device)
    combine(out_partial, lse_partial, out, lse)
    return out, lse


@attn_combine.register_fake
def _(out_partial, lse_partial, out_dtype):
    _, batch, seqlen, heads, head_dim = out_partial.shape
    return (out_partial.new_empty(batch, seqlen, heads, head_dim, dtype=out_dtype),
            out_partial.new_empty(batch, heads, seqlen, dtype=torch.float32))


def kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, alibi_slopes,
            softmax_scale: float, window_left: int, window_right: int, softcap: float, num_splits: int,
            cache_leftpad=None, k_descale=None, v_descale=None, need_lse: bool = True, q_descale=None,
            seq_descales: bool = False, sinks=None):
    """The decode as ``flash_attn_with_kvcache`` calls it; (out, lse), lse None when not
    ``need_lse`` and the kernel could skip it. ``sinks`` (H,): attention sinks, taken inside the
    decode (no gradient: a caller that wants one applies them to the result instead).

    As ``forward``: eager calls go straight to the launcher, since the custom-op dispatcher costs
    tens of microseconds on the host, paid by every layer at every decode step. Under torch.compile,
    or with inputs that require grad (the op then raises on backward, having no autograd formula),
    the registered op runs instead.
    """
    args = (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, alibi_slopes,
            softmax_scale, window_left, window_right, softcap, num_splits, cache_leftpad, k_descale,
            v_descale, q_descale, seq_descales, sinks)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
            or (alibi_slopes is not None and alibi_slopes.requires_grad))):
        return attn_kvcache(*args)
    return _attn_kvcache_impl(*args, need_lse=need_lse)


def _attn_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx,
                       alibi_slopes, softmax_scale, window_left, window_right, softcap, num_splits,
                       cache_leftpad, k_descale=None, v_descale=None, q_descale=None, seq_descales=False,
                       sinks=None, need_lse=True):
    return decode_attention(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale,
                            window_left=window_left, window_right=window_right, softcap=softcap,
                            alibi_slopes=alibi_slopes, block_table=block_table,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                            num_splits=num_splits, k_descale=k_descale, v_descale=v_descale,
                            need_lse=need_lse, q_descale=q_descale, seq_descales=seq_descales, sinks=sinks)


@torch.library.custom_op("flashtile::attn_kvcache", mutates_args=(), device_types=("cuda", "cpu"))
def attn_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                 cache_batch_idx: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                 softmax_scale: float, window_left: int, window_right: int, softcap: float,
                 num_splits: int,
                 cache_leftpad: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
                 v_descale: Optional[torch.Tensor] = None,
                 q_descale: Optional[torch.Tensor] = None,
                 seq_descales: bool = False,
                 sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode of q (B, Sq, H, D) against the first cache_seqlens[b] keys of each cache row;
    an e4m3 cache with per-key descales (k_descale/v_descale), an e4m3 q with q_descale (B, Hk);
    attention sinks (H,)."""
    return _attn_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx,
                              alibi_slopes, softmax_scale, window_left, window_right, softcap,
                              num_splits, cache_leftpad, k_descale, v_descale, q_descale, seq_descales,
                              sinks)


@attn_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, alibi_slopes, softmax_scale,
      window_left, window_right, softcap, num_splits, cache_leftpad=None, k_descale=None,
      v_descale=None, q_descale=None, seq_descales=False, sinks=None):
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty(q.shape, dtype=out_dtype(q.dtype)),
            q.new_empty(batch, heads, seqlen_q, dtype=torch.float32))


def block_rows(packed: torch.Tensor, cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """decode.block_packed_rows; the registered op under torch.compile (the launcher is opaque to
    Dynamo), the launcher directly otherwise."""
    if torch.compiler.is_compiling():
        return attn_block_rows(packed, cu_seqlens, seqlen)
    return block_packed_rows(packed, cu_seqlens, seqlen)


def unblock(blocked: torch.Tensor, lse_blocked: Optional[torch.Tensor], cu_seqlens: torch.Tensor, total: int,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
    """decode.unblock_rows; the registered ops under torch.compile (which always move the LSE)."""
    if torch.compiler.is_compiling():
        if out is not None:
            attn_unblock_rows_into(blocked, lse_blocked, cu_seqlens, out, lse)
            return out, lse
        return attn_unblock_rows(blocked, lse_blocked, cu_seqlens, total)
    return unblock_rows(blocked, lse_blocked, cu_seqlens, total, out, lse)


@torch.library.custom_op("flashtile::block_rows", mutates_args=(), device_types=("cuda", "cpu"))
def attn_block_rows(packed: torch.Tensor, cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    return block_packed_rows(packed, cu_seqlens, seqlen)


@attn_block_rows.register_fake
def _(packed, cu_seqlens, seqlen):
    return packed.new_empty(cu_seqlens.shape[0] - 1, seqlen, *packed.shape[1:])


@torch.library.custom_op("flashtile::unblock_rows", mutates_args=(), device_types=("cuda", "cpu"))
def attn_unblock_rows(blocked: torch.Tensor, lse_blocked: torch.Tensor, cu_seqlens: torch.Tensor,
                      total: int) -> tuple[torch.Tensor, torch.Tensor]:
    return unblock_rows(blocked, lse_blocked, cu_seqlens, total)


@attn_unblock_rows.register_fake
def _(blocked, lse_blocked, cu_seqlens, total):
    return (blocked.new_empty(total, *blocked.shape[2:]),
            lse_blocked.new_empty(blocked.shape[2], total))


@torch.library.custom_op("flashtile::unblock_rows_into", mutates_args=("out", "lse"), device_types=("cuda", "cpu"))
def attn_unblock_rows_into(blocked: torch.Tensor, lse_blocked: torch.Tensor, cu_seqlens: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor) -> None:
    unblock_rows(blocked, lse_blocked, cu_seqlens, out.shape[0], out, lse)


@attn_unblock_rows_into.register_fake
def _(blocked, lse_blocked, cu_seqlens, out, lse):
    return None
