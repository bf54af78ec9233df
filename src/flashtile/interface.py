"""Public functions with flash_attn 2.8's names, argument order, defaults, layouts and return values.

They check their arguments (a ValueError or TypeError naming the argument, before any launch) and call
the custom ops in ``flashtile.ops``. Layout is (batch, seqlen, heads, head_dim), as in flash_attn.
"""

from __future__ import annotations

import math
import weakref
from numbers import Real

import torch

from . import ops
from .kernels import decode
from .kernels.forward import interpreting
from .kernels.rotary import rotate_and_append, rotate_new_keys
from .kernels.sinks import apply_sinks_

MAX_HEAD_DIM = 256
# flash_attn_with_kvcache's num_splits: at most flash-attn's limit (it raises past 128 too)
MAX_SPLITS = 128
_INTERPRETING = interpreting()
_DTYPES = (torch.float16, torch.bfloat16)


def _check_tensor(t, name: str, ndim: int, dtypes=_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    # is_cpu / is_cuda: reading t.device builds an object, microseconds per decode step and layer.
    if _INTERPRETING:
        if not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}, but TRITON_INTERPRET=1 runs kernels on CPU tensors")
    elif not t.is_cuda:
        raise ValueError(f"{name} is on {t.device}: flashtile needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 to run the kernels on the CPU)")
    if t.shape[-1] > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), "
                         f"got strides {tuple(t.stride())}")


def _check_attention_inputs(q, k, v, names=("q", "k", "v"), dtypes=_DTYPES) -> None:
    """q (B, Sq, H, D), k and v (B, Sk, Hk, D)."""
    for t, n in zip((q, k, v), names):
        _check_tensor(t, n, 4, dtypes)
    _check_attention_match(q, k, v, k.shape, v.shape, names)


def _check_attention_match(q, k, v, k_shape, v_shape, names, kv_dtype=None) -> None:
    """k and v against q, all three through ``_check_tensor`` already; ``k_shape``/``v_shape`` are
    the shapes k and v stand for (a KV cache: q's batch, then the cache's other dimensions).
    ``kv_dtype``: the dtype k and v must have when it is not q's (an e4m3 cache)."""
    qn, kn, vn = names
    for t, n in ((k, kn), (v, vn)):
        if kv_dtype is not None:
            if t.dtype != kv_dtype:
                raise TypeError(f"{n} has dtype {t.dtype}: {kn} and {vn} must both be {kv_dtype}")
        elif t.dtype != q.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {qn} has {q.dtype}: they must match")
        if t.get_device() != q.get_device():  # an int, cheaper than comparing t.device objects
            raise ValueError(f"{n} is on {t.device} but {qn} is on {q.device}")
    batch, _, heads, head_dim = q.shape
    if k_shape != v_shape:
        raise ValueError(f"{kn} and {vn} must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if k_shape[0] != batch:
        raise ValueError(f"{kn} has batch size {k_shape[0]} but {qn} has {batch}")
    if k_shape[3] != head_dim:
        raise ValueError(f"{kn} has head dim {k_shape[3]} but {qn} has {head_dim}")
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim of {qn} must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    heads_k = k_shape[2]
    if heads_k == 0 or heads % heads_k != 0:
        raise ValueError(f"number of query heads ({heads}, from {qn}) must be a multiple of the "
                         f"number of key/value heads ({heads_k}, from {kn})")
    if max(heads, batch) > 65535:
        raise ValueError(f"{qn}: batch and heads must each be at most 65535, got {batch} and {heads}")


def _check_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if type(softmax_scale) is float and 0 < softmax_scale < math.inf:  # skips the ABC check below
        return softmax_scale
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real):
        raise TypeError(f"{name} must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        # The kernel takes the row max on unscaled scores, which needs a positive scale.
        raise ValueError(f"{name} must be finite and > 0, got {softmax_scale}")
    return float(softmax_scale)


def _check_window(window_size, causal: bool) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"window_size entries must be ints (-1 = unbounded), got {window_size!r}")
        if side < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    if causal:
        right = 0
    return left, right


def _check_softcap(softcap) -> float:
    if (type(softcap) is float or type(softcap) is int) and softcap == 0:  # the default, cheaply
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    return float(softcap)


def _check_alibi(alibi_slopes, batch: int, heads: int, device: torch.device):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return alibi_slopes.contiguous()


def _check_dropout(dropout_p) -> float:
    if (type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0:  # the default, cheaply
        return 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _check_deterministic(deterministic) -> bool:
    if deterministic is not None and not isinstance(deterministic, (bool, int)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return bool(deterministic)


def _check_sinks(s_aux, q, ndim: int):
    """vLLM's ``s_aux`` (gpt-oss's attention sinks): one logit per query head, (H,) floating point on
    q's device; its shape is checked once q has the ``ndim`` dimensions its call takes (q's own check
    names a q without them). Returned contiguous: the kernels read sinks[h] at offset h."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"s_aux must be a torch.Tensor of shape (heads,) or None, got {type(s_aux).__name__}")
    if s_aux.dtype not in (torch.float32, *_DTYPES):
        raise TypeError(f"s_aux must be float32, float16 or bfloat16, got {s_aux.dtype}")
    if isinstance(q, torch.Tensor) and q.dim() == ndim:
        heads = q.shape[-2]
        if tuple(s_aux.shape) != (heads,) or s_aux.device != q.device:
            raise ValueError(f"s_aux must have shape ({heads},) (one logit per query head) on {q.device}, "
                             f"got {tuple(s_aux.shape)} on {s_aux.device}")
    if torch.is_grad_enabled() and s_aux.requires_grad and isinstance(q, torch.Tensor) \
            and q.dtype == torch.float8_e4m3fn:
        raise NotImplementedError("flashtile: FP8 attention is forward-only (s_aux requires grad)")
    return s_aux if s_aux.is_contiguous() else s_aux.contiguous()


def _with_sinks(out, lse, sinks, packed: bool, need_factor: bool = False):
    """Attention sinks on a finished call: the softmax with one more logit per row, sinks[h], which
    takes its share of the probability mass and adds no value, is the call's output times
    sigmoid(lse - sink), with LSE logaddexp(lse, sink). Exact; differentiable in out, lse and sinks
    (the LSE's gradient reaches the backward kernels as dLSE). Rows that saw no key (LSE +inf) keep
    output 0 and LSE +inf. ``packed``: out (total_q, H, D) and lse (H, total_q), else (B, Sq, H, D) and
    (B, H, Sq). Returns (out, lse, the factor in lse's layout, or None where not ``need_factor``).
    Eager calls without gradients write the call's own out and lse in place, in one launch."""
    if not (need_factor or torch.compiler.is_compiling() or out.stride(-1) != 1 or torch.is_grad_enabled()
            and (out.requires_grad or lse.requires_grad or sinks.requires_grad)):
        apply_sinks_(out, lse, sinks, packed)
        return out, lse, None
    gap = lse - sinks.to(torch.float32).unsqueeze(-1)
    kept = torch.sigmoid(gap)
    per_row = kept.t() if packed else kept.transpose(1, 2)
    out = (out * per_row.unsqueeze(-1)).to(out.dtype)  # (in float32: out's dtype times a float32 factor)
    return out, lse - torch.nn.functional.logsigmoid(gap), kept


def _sinks_applied(result, sinks, return_attn_probs: bool, packed: bool):
    """``result`` (out, lse, S_dmask) of a call made with its LSE, with ``sinks`` applied (None: as
    it is), returned as ``return_attn_probs`` asks."""
    if sinks is None:
        return result
    out, lse, s_dmask = result
    out, lse, kept = _with_sinks(out, lse, sinks, packed, need_factor=s_dmask is not None)
    if not return_attn_probs:
        return out
    if s_dmask is not None:  # the probabilities shrink by the same factor
        s_dmask = (s_dmask * kept.unsqueeze(-1)).to(s_dmask.dtype)
    return out, lse, s_dmask


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, deterministic=False, names=("q", "k", "v"), descales=(None, None, None),
               s_aux=None):
    sinks = _check_sinks(s_aux, q, 4)
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        return _fp8_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              return_attn_probs, descales, names, sinks=sinks)
    if descales[0] is not None or descales[1] is not None or descales[2] is not None:
        raise ValueError("q_descale, k_descale and v_descale apply to float8_e4m3fn inputs only")
    _check_attention_inputs(q, k, v, names)
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale(softmax_scale, q.shape[-1])
    left, right = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device) if alibi_slopes is not None else None
    seed = ops.new_dropout_seed(dropout_p, q.device) if dropout_p > 0 else None
    out, lse = ops.forward(q, k, v, scale, left, right, True, softcap, alibi, None, None, 0, 0,
                           dropout_p, seed, None, _check_deterministic(deterministic), sinks=sinks)
    if not return_attn_probs:
        return out
    s_dmask = None
    if seed is not None:
        s_dmask = _dropped_probabilities(q, k, seed, dropout_p, scale, left, right, softcap, alibi)
        if sinks is not None:  # the probabilities shrink by the sink's factor, 1 - exp(sink - lse)
            kept = -torch.expm1(sinks.detach().float().unsqueeze(-1) - lse.detach())
            s_dmask = (s_dmask * kept.unsqueeze(-1)).to(s_dmask.dtype)
    return out, lse, s_dmask


def _fp8_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, descales, names, packed=None, block_table=None, seqused_k=None,
                   num_splits=0, out=None, sinks=None):
    """FlashAttention-3's FP8 forward: e4m3 q, k, v with descales (B, Hk) (None: 1.0); bf16 out.
    ``packed`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed sequences, q
    (total_q, H, D) and k/v (total_k, Hk, D), or with ``block_table`` page pools (num_pages,
    page_size, Hk, D); descales per sequence. For per-block scales (and the Hadamard rotation) use
    flashtile.fp8.quantize_qkv and flashtile.fp8.attention. ``sinks`` (H,), checked: attention sinks,
    in the result (taken by the decode launches and the prefill forward, which applies them after the
    Gluon kernels)."""
    if packed is None:
        _check_attention_inputs(q, k, v, names, dtypes=(torch.float8_e4m3fn,))
    elif block_table is None:
        for t, n in zip((q, k, v), names):
            _check_tensor(t, n, 3, (torch.float8_e4m3fn,))
        _check_attention_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), names,
                                dtypes=(torch.float8_e4m3fn,))
    else:  # page pools: the table and shapes are checked below, once the batch is known
        _check_tensor(q, names[0], 3, (torch.float8_e4m3fn,))
        for t, n in zip((k, v), names[1:]):
            _check_tensor(t, n, 4, (torch.float8_e4m3fn,))
    if _check_dropout(dropout_p) > 0:
        raise NotImplementedError("flashtile: no dropout with FP8 inputs")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise NotImplementedError("flashtile: FP8 attention is forward-only (no backward)")
    if packed is None:
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, heads_k = k.shape[1], k.shape[2]
        varlen = {}
    else:
        cu_q, cu_k, max_q, max_k = packed  # cu_k None: the key counts are seqused_k (on page pools)
        batch = _check_cu_seqlens(cu_q, "cu_seqlens_q", None, q)
        if seqused_k is None:
            _check_cu_seqlens(cu_k, "cu_seqlens_k", batch, q)
        seqlen_q = _check_max_seqlen(max_q, "max_seqlen_q")
        seqlen_k = _check_max_seqlen(max_k, "max_seqlen_k")
        heads, head_dim = q.shape[1], q.shape[2]
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
        if block_table is None:
            _check_offsets(cu_q, cu_k, q.shape[0], k.shape[0], seqlen_q, seqlen_k)
            heads_k = k.shape[1]
        else:
            _check_block_table(block_table, k, v, batch, q.device)
            _check_attention_inputs(q.unsqueeze(0), k[:1], v[:1], names,  # a page stands for the pool
                                    dtypes=(torch.float8_e4m3fn,))
            _check_offsets(cu_q, cu_k, q.shape[0], None, seqlen_q, seqlen_k)
            _check_pages(block_table, k.shape[0], block_table.shape[1] * k.shape[1], seqlen_k)
            heads_k = k.shape[2]
            varlen["block_table"] = block_table
    per_head = []
    for d, n in zip(descales, ("q_descale", "k_descale", "v_descale")):
        if d is None:
            d = torch.ones(batch, heads_k, dtype=torch.float32, device=q.device)
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            raise TypeError(f"{n} must be a float32 tensor of shape (batch, heads_k)")
        if tuple(d.shape) != (batch, heads_k) or d.device != q.device:
            raise ValueError(f"{n} must have shape ({batch}, {heads_k}) on {q.device}, got "
                             f"{tuple(d.shape)} on {d.device}")
        per_head.append(d)
    scale = _check_scale(softmax_scale, head_dim)
    left, right = _check_window(window_size, causal)
    alibi = _check_alibi(alibi_slopes, batch, heads, q.device)
    if packed is not None and _varlen_decode_wanted(q, seqlen_q, 0.0, block_table, heads_k):
        out, lse = _varlen_decode(q, k, v, packed[0], _key_counts(packed[1], seqused_k), seqlen_q, scale, left,
                                  right, _check_softcap(softcap), alibi, block_table, per_head,
                                  need_lse=return_attn_probs, num_splits=num_splits,
                                  into=_decode_into(out, q, return_attn_probs), sinks=sinks)
        return (out, lse, None) if return_attn_probs else out
    group = heads // heads_k
    # One scale block spanning the whole (longest) sequence: a power of two of at least 256, so a
    # multiple of every kernel's tile (the portable kernel's are at most 128, the Gluon one's 256 keys);
    # no tile lookup, which under torch.compile would trace the device query behind it.
    block_q = 1 << max(seqlen_q, 128).bit_length()
    block_k = 1 << max(seqlen_k, 128).bit_length()
    # query head h reads its KV head's descale (one copy; repeat_interleave cost ~50 us of host time)
    q_d = per_head[0][:, :, None].expand(batch, heads_k, group).reshape(batch, heads, 1).contiguous()
    k_d, v_d = (d.unsqueeze(-1).contiguous() for d in per_head[1:])

    def prefill(key_offsets=None, keyed_sequences=0, sinks=None):
        if key_offsets is not None:
            varlen["cu_seqlens_k"] = key_offsets
        return ops.fp8_forward(q, k, v, q_d, k_d, v_d, scale, left, right, seqlen_k - seqlen_q,
                               _check_softcap(softcap), alibi, block_q, block_k, **varlen,
                               keyed_sequences=keyed_sequences, sinks=sinks)
    if packed is None:
        out, lse = prefill(sinks=sinks)
    elif _mixed_batch_wanted(q, seqlen_q, 0.0, block_table, batch):
        out, lse = _mixed_batch(q, k, v, cu_q, _key_counts(cu_k, seqused_k), scale, left, right,
                                _check_softcap(softcap), alibi, block_table, prefill, per_head, num_splits,
                                sinks=sinks)
    else:
        out, lse = prefill(_key_offsets(cu_k, seqused_k), sinks=sinks)
    return (out, lse, None) if return_attn_probs else out


def _dropped_probabilities(q, k, seed, dropout_p, scale, left, right, softcap, alibi):
    """flash_attn's S_dmask: the probabilities (B, H, Sq, Sk), negated where dropout dropped them.
    Materialized for testing and inspection; it costs the full score matrix."""
    from .kernels.dropout import dropout_mask
    from .reference import probabilities

    probs = probabilities(q.detach(), k.detach(), softmax_scale=scale, window_size=(left, right),
                          softcap=softcap, alibi_slopes=alibi)
    keep = dropout_mask(seed, q.shape[0], q.shape[2], q.shape[1], k.shape[1], dropout_p)
    return torch.where(keep, probs, -probs).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    q_descale=None, k_descale=None, v_descale=None, *, s_aux=None):
    """Attention over q (B, Sq, H, D), k and v (B, Sk, Hk, D) with H a multiple of Hk (GQA/MQA).

    ``causal`` is aligned to the bottom right when Sq != Sk: query i sees keys j <= i + Sk - Sq.
    ``window_size=(left, right)`` limits query i to keys in [i + Sk - Sq - left, i + Sk - Sq + right]
    (-1 = unbounded). ``softcap`` > 0 applies softcap * tanh(scores / softcap); ``alibi_slopes``
    (float32, (H,) or (B, H)) adds -slope * |i + Sk - Sq - j|. Returns out (B, Sq, H, D), or with
    ``return_attn_probs`` the tuple (out, softmax_lse (B, H, Sq) float32, None).

    FP8 (FlashAttention-3's convention, forward only): q, k, v in float8_e4m3fn with
    ``q_descale``/``k_descale``/``v_descale`` float32 (B, Hk) (None: 1.0), the factors that turn the
    stored values back into the real ones; the output is bfloat16.

    ``s_aux`` (H,) float (vLLM's name; gpt-oss's attention sinks): each row's softmax gets one more
    logit, s_aux[h] (compared with the scaled, softcapped scores), which takes its share of the
    probability mass and adds no value; the LSE returned counts it. Differentiable, s_aux included.
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      return_attn_probs, deterministic, descales=(q_descale, k_descale, v_descale), s_aux=s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, s_aux=None):
    """``flash_attn_func`` with kv packed as (B, Sk, 2, Hk, D)."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, heads_k, head_dim), got {tuple(kv.shape)}")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, return_attn_probs, deterministic,
                      names=("q", "kv[:, :, 0]", "kv[:, :, 1]"), s_aux=s_aux)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, s_aux=None):
    """``flash_attn_func`` with q, k, v packed as (B, S, 3, H, D)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, heads, head_dim), got {tuple(qkv.shape)}")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, return_attn_probs, deterministic,
                      names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"), s_aux=s_aux)


def _check_cu_seqlens(cu_seqlens, name: str, batch: int | None, q: torch.Tensor) -> int:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    if batch is not None and cu_seqlens.shape[0] != batch + 1:
        raise ValueError(f"{name} has {cu_seqlens.shape[0]} offsets but cu_seqlens_q has {batch + 1}: "
                         "both must hold batch + 1")
    if cu_seqlens.get_device() != q.get_device():  # ints: cheaper than comparing t.device objects
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {q.device}")
    return cu_seqlens.shape[0] - 1


def _check_max_seqlen(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# Value checks already passed, by (check, id of the tensor): every layer of a model reuses the same
# offsets, block table and lengths, so the device-to-host copy (which stalls the CPU until the GPU
# catches up) happens once per batch or decode step, not once per layer.
_checked: dict[tuple[str, int], tuple] = {}


def _values_unreadable(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host is impossible now: under torch.compile or
    CUDA-graph capture."""
    return torch.compiler.is_compiling() or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def _values_to_check(check: str, tensor: torch.Tensor, key: tuple) -> bool:
    """Whether ``check`` must read ``tensor``'s values now: not under torch.compile or CUDA graph
    capture (no sync possible there; the kernels clamp every index into its tensor instead), and not
    again for a tensor whose version and ``key`` were already checked."""
    if _values_unreadable(tensor):
        return False
    stored = _checked.get((check, id(tensor)))
    return stored is None or not _same_key(stored, (tensor._version, *key))


def _same_key(stored: tuple, key: tuple) -> bool:
    """Whether a remembered key is ``key``. A companion tensor in a key is remembered by a weak
    reference and its version, so a later tensor that happens to get a freed one's id (and so the
    same version, 0, as often as not) is not taken for it."""
    if len(stored) != len(key):
        return False
    for old, new in zip(stored, key):
        if isinstance(new, torch.Tensor):
            if not (isinstance(old, tuple) and old[0]() is new and old[1] == new._version):
                return False
        elif old != new:
            return False
    return True


def _remember_checked(check: str, tensor: torch.Tensor, key: tuple) -> None:
    slot = (check, id(tensor))
    if slot not in _checked:
        weakref.finalize(tensor, _checked.pop, slot, None)
    _checked[slot] = (tensor._version, *((weakref.ref(k), k._version) if isinstance(k, torch.Tensor)
                                         else k for k in key))


def _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """The offsets' values: start at 0, non-decreasing, within the packed tokens and max_seqlen
    (cu_seqlens_k None: the key counts come from seqused_k, checked by _check_seqused_k)."""
    key = (cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if not _values_to_check("offsets", cu_seqlens_q, key):
        return
    stats = []
    for cu in (cu_seqlens_q, cu_seqlens_k) if cu_seqlens_k is not None else (cu_seqlens_q,):
        lens = cu[1:] - cu[:-1]
        stats.append(torch.stack([cu[0], cu[-1], lens.min(), lens.max()]))
    names = (("cu_seqlens_q", total_q, "max_seqlen_q", max_seqlen_q),
             ("cu_seqlens_k", total_k, "max_seqlen_k", max_seqlen_k))
    for (name, total, max_name, max_value), (first, end, low, high) in zip(names, torch.stack(stats).tolist()):
        if first != 0:
            raise ValueError(f"{name} must start at 0, got {first}")
        if low < 0:
            raise ValueError(f"{name} must be non-decreasing (a sequence length is {low})")
        if total is not None and end > total:
            raise ValueError(f"{name} ends at {end}, past the {total} packed tokens")
        if high > max_value:
            raise ValueError(f"{max_name} is {max_value} but a sequence has {high} tokens")
    _remember_checked("offsets", cu_seqlens_q, key)


def _check_block_table(block_table, k, v, batch: int, device: torch.device):
    """Paged KV: k/v are page pools (num_pages, page_size, Hk, D), block_table (B, pages) int32."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape ({batch}, max_pages_per_sequence), "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must have a contiguous last dimension")
    for t, n in ((k, "k"), (v, "v")):
        _check_tensor(t, n, 4, _DTYPES + (torch.float8_e4m3fn,))  # dtypes are matched by the caller
    if k.shape != v.shape:
        raise ValueError(f"k and v page pools must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[1] < 1:
        raise ValueError(f"page size (k.shape[1]) must be >= 1, got {k.shape[1]}")


def _check_pages(block_table, num_pages: int, capacity: int, max_seqlen_k: int):
    if max_seqlen_k > capacity:
        raise ValueError(f"max_seqlen_k is {max_seqlen_k} but block_table holds only {capacity} keys "
                         "per sequence")
    if block_table.numel() and _values_to_check("pages", block_table, (num_pages,)):
        low, high = torch.stack([block_table.min(), block_table.max()]).tolist()
        if low < 0 or high >= num_pages:
            raise ValueError(f"block_table entries must be in [0, {num_pages}), got [{low}, {high}]")
        _remember_checked("pages", block_table, (num_pages,))


def _check_cache_batch_idx(cache_batch_idx, batch: int, cache_rows: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32:
        raise TypeError("cache_batch_idx must be an int32 tensor")
    if tuple(cache_batch_idx.shape) != (batch,) or cache_batch_idx.device != device:
        raise ValueError(f"cache_batch_idx must have shape ({batch},) on {device}")
    return _checked_cache_rows(cache_batch_idx, cache_rows)


def _checked_cache_rows(cache_batch_idx: torch.Tensor, cache_rows: int) -> torch.Tensor:
    """cache_batch_idx with its values in [0, cache_rows): read on the host once per tensor version
    (a ValueError otherwise); where they cannot be read (CUDA-graph capture, torch.compile) a copy
    clamped on the device stands in, so that no kernel reads a cache row that does not exist."""
    if _values_unreadable(cache_batch_idx):
        return cache_batch_idx.clamp(0, max(cache_rows - 1, 0))
    if cache_batch_idx.numel() and _values_to_check("cache rows", cache_batch_idx, (cache_rows,)):
        low, high = torch.stack([cache_batch_idx.min(), cache_batch_idx.max()]).tolist()
        if low < 0 or high >= cache_rows:
            raise ValueError(f"cache_batch_idx entries must be in [0, {cache_rows}), got [{low}, {high}]")
        _remember_checked("cache rows", cache_batch_idx, (cache_rows,))
    return cache_batch_idx


# flash_attn_varlen_func calls on page pools with few queries a sequence (decode and speculative
# steps, batched the way vLLM's FlashAttention backend batches them) run flash_attn_with_kvcache's
# split-KV decode, whose tiles pack a KV head's query heads and read each key once, instead of the
# prefill kernels, which spend a 128-row tile on each query head's few rows and read a KV head's keys
# once per query head. Taken up to VARLEN_DECODE_MAX_QUERIES queries a sequence, and past that up to
# VARLEN_DECODE_WIDE_QUERIES while a KV head's rows (queries x GQA group) stay within
# VARLEN_DECODE_MAX_ROWS: on the H200 (varlen-decode-h200-20261204-rows) the route is 2.3-3.5x the
# prefill kernels at 24-32 queries, 1.19-1.34x at 64 x group 4 (256 rows), 0.95-0.96x at 384-512 rows.
VARLEN_DECODE_MAX_QUERIES = 16
VARLEN_DECODE_WIDE_QUERIES = 64
VARLEN_DECODE_MAX_ROWS = 256


def _varlen_decode_wanted(q, max_seqlen_q: int, dropout_p: float, block_table, heads_k: int) -> bool:
    if block_table is None or dropout_p != 0 or q.shape[0] == 0 or not 0 < block_table.shape[0] <= decode.MAX_GRID_Z:
        return False
    rows = max_seqlen_q * max(q.shape[1] // max(heads_k, 1), 1)
    return 0 < max_seqlen_q <= VARLEN_DECODE_MAX_QUERIES or (
        max_seqlen_q <= VARLEN_DECODE_WIDE_QUERIES and rows <= VARLEN_DECODE_MAX_ROWS)


# Mixed batches on page pools (vLLM's chunked prefill: long query chunks among decode steps): past
# the decode route's limits, when the queries fill at most 1 / MIXED_BATCH_FILL of batch x
# max_seqlen_q, the prefill kernels take the sequences of more than VARLEN_DECODE_MAX_QUERIES
# queries (the others' key counts 0: their tiles load no key), and the split-KV decode the rest (the
# long ones' key counts 0), its rows written over the prefill kernels' zeros. The host cannot tell
# which sequences are short without a sync; the fill says whether many can be. (The short ones'
# tiles still cost the persistent Gluon kernel ~3 us each a CTA, varlen-decode-h200-20261204-mixed-b;
# moving the long sequences' rows to the front, so that the short ones have no queries, cost more,
# -mixed-compact.)
MIXED_BATCH_FILL = 4
# The decode part pads every short sequence to VARLEN_DECODE_MAX_QUERIES queries, the host not
# knowing their counts: 16 x group rows a KV head, where vLLM's decode steps have one query. On the
# H200 (varlen-decode-h200-20261204-mixed-b) that cost 2-7% over the one-query steps at 64 rows
# (32/8 heads), 30% at 96 (12/2) and 2.1x on e4m3 caches at 64. Past MIXED_PADDED_ROWS rows, or on
# e4m3 caches, two decode launches: one for the sequences of more than MIXED_FIRST_ROWS // group
# queries (speculative steps; the others' key counts 0, their rows written over next), then one for
# those of at most that many, padded to it (one query's rows fill no smaller MMA tile). Predicted,
# not yet measured: the extra launch's cost where no sequence needs it (~10 us: two row moves, a
# decode launch without keys, its merge) against 26 us (12/2, B128) and ~160 us (e4m3, B64) saved.
# MIXED_FIRST_ROWS 0: one launch always.
MIXED_FIRST_ROWS = 16
MIXED_PADDED_ROWS = 64


def _mixed_batch_wanted(q, max_seqlen_q: int, dropout_p: float, block_table, batch: int) -> bool:
    return (block_table is not None and dropout_p == 0 and max_seqlen_q > VARLEN_DECODE_MAX_QUERIES
            and 2 <= batch <= decode.MAX_GRID_Z and q.shape[0] * MIXED_BATCH_FILL <= batch * max_seqlen_q)


def _mixed_batch(q, k, v, cu_seqlens_q, key_counts, scale, left, right, softcap, alibi, block_table, prefill,
                 descales=None, num_splits=0, sinks=None):
    """A mixed batch as above: ``prefill(key_offsets, keyed_sequences, sinks)`` runs the prefill kernels
    on the whole batch with the given key offsets, of which at most ``keyed_sequences`` sequences have
    keys, and returns (out, lse). ``num_splits``: the decode's (flash_attn_with_kvcache's). ``sinks``
    (H,): attention sinks, taken by both parts (the prefill's rows of sequences without keys there
    stay output 0 and LSE +inf under them, and the decode overwrites those). Returns (out, lse)."""
    queries = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    short = queries <= VARLEN_DECODE_MAX_QUERIES
    none = torch.zeros_like(key_counts)
    # the long sequences (the only ones with keys here) have more than VARLEN_DECODE_MAX_QUERIES
    # queries each: at most total_q // (VARLEN_DECODE_MAX_QUERIES + 1) of them
    out, lse = prefill(torch.nn.functional.pad(torch.where(short, none, key_counts).cumsum(0, dtype=torch.int32),
                                               (1, 0)), max(q.shape[0] // (VARLEN_DECODE_MAX_QUERIES + 1), 1),
                       **({"sinks": sinks} if sinks is not None else {}))
    group = max(q.shape[1] // k.shape[2], 1)
    first = max(MIXED_FIRST_ROWS // group, 1) if MIXED_FIRST_ROWS > 0 else 0
    if VARLEN_DECODE_MAX_QUERIES * group <= MIXED_PADDED_ROWS and q.dtype != torch.float8_e4m3fn:
        first = 0
    decode_args = (scale, left, right, softcap, alibi, block_table, descales)
    if not 0 < first < VARLEN_DECODE_MAX_QUERIES:
        first = VARLEN_DECODE_MAX_QUERIES
    else:
        _varlen_decode(q, k, v, cu_seqlens_q, torch.where(short & (queries > first), key_counts, none),
                       VARLEN_DECODE_MAX_QUERIES, *decode_args, into=(out, lse), num_splits=num_splits,
                       sinks=sinks)
    return _varlen_decode(q, k, v, cu_seqlens_q, torch.where(queries <= first, key_counts, none), first,
                          *decode_args, into=(out, lse), num_splits=num_splits, sinks=sinks)


def _check_seqused_k(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k, block_table):
    """FlashAttention-3's (and vLLM's) ``seqused_k``: sequence b attends to only its first
    seqused_k[b] keys. Returns (k, v, max_seqlen_k, block_table) for the paged call that does so,
    whose key counts are seqused_k (cu_seqlens_k is then not read): with ``block_table`` the same
    pools; without one, k and v (total_k, Hk, D) seen as pools of one-key pages and a table whose
    row b lists keys cu_seqlens_k[b], cu_seqlens_k[b] + 1, ... (with no keys at all, block_table
    None: the packed call as it is)."""
    for t, name in ((q, "q"), (seqused_k, "seqused_k")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    batch = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None, q)
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"seqused_k must be int32, got {seqused_k.dtype}")
    if seqused_k.dim() != 1 or seqused_k.shape[0] != batch:
        raise ValueError(f"seqused_k must have shape (batch,) = ({batch},) as cu_seqlens_q, got "
                         f"{tuple(seqused_k.shape)}")
    if seqused_k.get_device() != q.get_device():
        raise ValueError(f"seqused_k is on {seqused_k.device} but q is on {q.device}")
    max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if block_table is None and cu_seqlens_k is None:
        raise ValueError("seqused_k without block_table needs cu_seqlens_k (where each sequence's keys start)")
    if cu_seqlens_k is not None:
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch, q)
    if seqused_k.numel() and _values_to_check("seqused_k", seqused_k, (cu_seqlens_k, max_seqlen_k)):
        low, high = torch.stack([seqused_k.min(), seqused_k.max()]).tolist()
        if low < 0 or high > max_seqlen_k:
            raise ValueError(f"seqused_k entries must be in [0, max_seqlen_k = {max_seqlen_k}], got [{low}, {high}]")
        if block_table is None and bool((seqused_k > cu_seqlens_k[1:] - cu_seqlens_k[:-1]).any()):
            raise ValueError("seqused_k exceeds a sequence's keys in cu_seqlens_k")
        _remember_checked("seqused_k", seqused_k, (cu_seqlens_k, max_seqlen_k))
    if block_table is not None:
        return k, v, max_seqlen_k, block_table
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 3 and v.dim() == 3):
        raise ValueError("seqused_k without block_table takes packed k and v (total_k, heads_k, head_dim)")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("flashtile: seqused_k is forward-only; call it under torch.no_grad()")
    if k.shape[0] == 0:  # no keys at all: the offsets say as much as the counts
        return k, v, max_seqlen_k, None
    width = min(max_seqlen_k, k.shape[0])
    table = (cu_seqlens_k[:-1, None] + torch.arange(width, dtype=torch.int32, device=q.device))
    return k.unsqueeze(1), v.unsqueeze(1), width, table.clamp_(max=max(k.shape[0] - 1, 0))


def _key_counts(cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None) -> torch.Tensor:
    return seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]


def _key_offsets(cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None) -> torch.Tensor:
    """The prefill kernels' key offsets: on page pools they carry only the key counts."""
    if seqused_k is None:
        return cu_seqlens_k
    return torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))


def _varlen_decode(q, k, v, cu_seqlens_q, key_counts, max_seqlen_q: int, scale: float, left: int,
                   right: int, softcap: float, alibi, block_table, descales=None, need_lse: bool = True,
                   into=None, num_splits: int = 0, sinks=None):
    """Packed queries q (total_q, H, D) of sequences on page pools k, v through the decode of
    flash_attn_with_kvcache (validated inputs; ``key_counts`` (B,) int32: each sequence's keys, on
    the device; ``descales``: the e4m3 call's (B, Hk) ones). Sequence b's queries take the last
    rows of a (B, max_seqlen_q, H, D) block, so that each row keeps its bottom-right position; the
    rows before them are zeros whose outputs are dropped (their positions come before the
    sequence's first query, so no mask moves). Returns out (total_q, H, D) and lse (H, total_q) or
    None without ``need_lse``; rows past cu_seqlens_q[-1] are left unwritten. ``into``: (out, lse)
    to write the rows of sequences of at most max_seqlen_q queries into (a mixed batch's).
    ``num_splits``: flash_attn_with_kvcache's (0: its heuristic). ``sinks`` (H,): attention sinks,
    taken inside the decode (no gradient)."""
    batch = cu_seqlens_q.shape[0] - 1
    total, heads, head_dim = q.shape
    seqlen = max_seqlen_q
    blocked = ops.block_rows(q, cu_seqlens_q, seqlen)
    fp8 = q.dtype == torch.float8_e4m3fn
    k_view = v_view = q_descale = None
    per_sequence = False
    if fp8:
        q_descale = descales[0]
        k_view, v_view, per_sequence = _cache_descales(descales[1], descales[2], k, batch, True, False)
    rows = heads // k.shape[2] * seqlen
    decode.check_grid(batch, seqlen, heads, k.shape[2],
                      decode.tile_rows_for(rows, fp8, q.device, head_dim)
                      if rows > decode.SMALL_SHARED_MEMORY_TILE_ROWS else None)
    out, lse = ops.kvcache(blocked, k, v, key_counts, block_table, None, alibi, scale, left, right, softcap,
                           num_splits, None, k_view, v_view, need_lse=need_lse, q_descale=q_descale,
                           seq_descales=per_sequence, sinks=sinks)
    if into is not None:
        return ops.unblock(out, lse, cu_seqlens_q, total, *into)
    if lse is None or not (need_lse or torch.compiler.is_compiling()):
        return ops.unblock(out, None, cu_seqlens_q, total)
    out, lse = ops.unblock(out, lse, cu_seqlens_q, total)
    return out, (lse if need_lse else None)


def _decode_into(out, q, need_lse: bool):
    """The decode route's ``into`` for a caller's ``out`` (vLLM's; checked by _check_out): its rows
    moved there straight from the decode's block, no copy after; an LSE beside it where one is
    wanted (or the compiled row move needs one). None where ``out`` is not given or its head dim is
    strided (then the result is copied)."""
    if out is None or out.stride(-1) != 1:
        return None
    lse = None
    if need_lse or torch.compiler.is_compiling():
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    return out, lse


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                      block_table, deterministic=False, names=("q", "k", "v"),
                      descales=(None, None, None), seqused_k=None, num_splits=0, s_aux=None, out=None):
    """The packed call (flash_attn_varlen_func's, checked here); returns out, or (out, lse (H, total_q),
    None) with ``return_attn_probs``. ``out`` (checked): where the decode route writes its rows; the
    other routes leave it to the caller (who copies)."""
    sinks = _check_sinks(s_aux, q, 3)
    if seqused_k is not None:
        k, v, max_seqlen_k, block_table = _check_seqused_k(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                           max_seqlen_k, block_table)
        if block_table is None:  # packed keys without any: cu_seqlens_k as given
            seqused_k = None
        else:
            cu_seqlens_k = None
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        return _fp8_attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, return_attn_probs, descales, names,
                              packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                              block_table=block_table, seqused_k=seqused_k, num_splits=num_splits, out=out,
                              sinks=sinks)
    if any(d is not None for d in descales):
        raise ValueError("q_descale, k_descale and v_descale apply to float8_e4m3fn inputs only")
    _check_tensor(q, names[0], 3)
    batch = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None, q)
    if block_table is None:
        for t, n in zip((k, v), names[1:]):
            _check_tensor(t, n, 3)
        # (q, k and v passed _check_tensor: the rest of _check_attention_inputs, without two views)
        _check_attention_match(q.unsqueeze(0), k, v, (1, *k.shape), (1, *v.shape), names)
        total_k = k.shape[0]
    else:
        _check_block_table(block_table, k, v, batch, q.device)
        _check_attention_inputs(q.unsqueeze(0), k[:1], v[:1], names)  # one page stands for the pool
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise NotImplementedError("flashtile: no backward through a paged KV cache (block_table); "
                                      "call it under torch.no_grad()")
        total_k = None  # paged keys have no packed extent; _check_pages bounds the lengths
    if seqused_k is None:
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch, q)
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale(softmax_scale, q.shape[-1])
    left, right = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, q.shape[1], q.device) if alibi_slopes is not None else None
    _check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], total_k, max_seqlen_q, max_seqlen_k)
    if block_table is not None:
        _check_pages(block_table, k.shape[0], block_table.shape[1] * k.shape[1], max_seqlen_k)
    if _varlen_decode_wanted(q, max_seqlen_q, dropout_p, block_table, k.shape[2] if block_table is not None else 1):
        # the sinks inside the decode, as flash_attn_with_kvcache takes them (after it only for a gradient)
        sinks_after = sinks is not None and torch.is_grad_enabled() and sinks.requires_grad
        need_lse = return_attn_probs or sinks_after
        out, lse = _varlen_decode(q, k, v, cu_seqlens_q, _key_counts(cu_seqlens_k, seqused_k), max_seqlen_q,
                                  scale, left, right, softcap, alibi, block_table, need_lse=need_lse,
                                  num_splits=num_splits, into=_decode_into(out, q, need_lse),
                                  sinks=None if sinks_after else sinks)
        if sinks_after:
            return _sinks_applied((out, lse, None), sinks, return_attn_probs, packed=True)
        return (out, lse, None) if return_attn_probs else out

    def prefill(key_offsets, keyed_sequences=0, sinks=None):
        return ops.forward(q, k, v, scale, left, right, True, softcap, alibi, cu_seqlens_q, key_offsets,
                           max_seqlen_q, max_seqlen_k, dropout_p,
                           ops.new_dropout_seed(dropout_p, q.device) if dropout_p > 0 else None, block_table,
                           _check_deterministic(deterministic), keyed_sequences, sinks=sinks)
    if _mixed_batch_wanted(q, max_seqlen_q, dropout_p, block_table, batch):  # (no gradients: page pools)
        # the sinks inside both parts' kernels (after them only for a gradient)
        sinks_after = sinks is not None and torch.is_grad_enabled() and sinks.requires_grad
        out, lse = _mixed_batch(q, k, v, cu_seqlens_q, _key_counts(cu_seqlens_k, seqused_k), scale, left, right,
                                softcap, alibi, block_table, prefill, num_splits=num_splits,
                                sinks=None if sinks_after else sinks)
        if sinks_after:
            return _sinks_applied((out, lse, None), sinks, return_attn_probs, packed=True)
        return (out, lse, None) if return_attn_probs else out
    out, lse = prefill(_key_offsets(cu_seqlens_k, seqused_k), sinks=sinks)
    return (out, lse, None) if return_attn_probs else out


def _check_probs_without_dropout(return_attn_probs, dropout_p) -> None:
    """The varlen functions return no S_dmask: return_attn_probs with dropout is flash_attn_func's only
    (the LSE alone, as return_softmax_lse asks, is there with dropout too)."""
    if return_attn_probs and _check_dropout(dropout_p) > 0:
        raise NotImplementedError("flashtile: return_attn_probs with dropout is only available in "
                                  "flash_attn_func, not in the varlen functions")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, q_descale=None, k_descale=None,
                           v_descale=None, seqused_k=None, *, out=None, num_splits=0, scheduler_metadata=None,
                           return_softmax_lse=False, s_aux=None):
    """Packed sequences without padding: q (total_q, H, D), k/v (total_k, Hk, D).

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against k/v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]
    (int32 offsets, batch + 1 of them), each aligned bottom-right for ``causal``/``window_size`` on its
    own; ``max_seqlen_q``/``max_seqlen_k`` bound the lengths. Returns out (total_q, H, D), or with
    ``return_attn_probs`` (out, softmax_lse (H, total_q), None). Work is the sum of the sequences'
    own costs, not batch x the longest.

    With ``block_table`` (B, max_pages) int32, k and v are page pools (num_pages, page_size, Hk, D)
    with any page size: sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] slots
    of pages block_table[b, 0], block_table[b, 1], ... (forward only).

    ``seqused_k`` (B,) int32 (FlashAttention-3's and vLLM's): sequence b attends to only its first
    seqused_k[b] keys, read on the device. With ``block_table`` it gives the key counts and
    ``cu_seqlens_k`` may be None (as vLLM calls it); without, sequence b's keys are
    k/v[cu_seqlens_k[b]:cu_seqlens_k[b] + seqused_k[b]] (forward only).

    FP8 (forward only): float8_e4m3fn q, k, v with float32 ``q_descale``/``k_descale``/``v_descale``
    (B, Hk), one per sequence and KV head (None: 1.0), as in FlashAttention-3; bfloat16 output. With
    ``block_table`` the page pools are e4m3 too (vLLM's FP8 KV cache with FlashAttention-3).

    vLLM's keywords (forward only): ``out`` (total_q, H, D) in the output's dtype receives the output
    and is returned (decode steps' rows are moved there straight from the decode; the other routes'
    results are copied there);
    ``num_splits`` for the split-KV decode that takes decode steps on page pools (as in
    flash_attn_with_kvcache: 0 = heuristic, 1 = none); ``scheduler_metadata`` is accepted and not
    used; ``return_softmax_lse`` returns (out, softmax_lse (H, total_q)); ``s_aux`` (H,) are attention
    sinks, as in flash_attn_func.
    """
    _check_num_splits(num_splits)
    _check_probs_without_dropout(return_attn_probs, dropout_p)
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be a torch.Tensor or None, got {type(scheduler_metadata).__name__}")
    if out is not None:
        _check_out(out, q, k, v)
    need_lse = bool(return_attn_probs or return_softmax_lse)
    result = _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               need_lse, block_table, deterministic,
                               descales=(q_descale, k_descale, v_descale), seqused_k=seqused_k,
                               num_splits=num_splits, s_aux=s_aux, out=out)
    attended = result[0] if need_lse else result
    if out is not None and attended is not out:  # (the decode route wrote its rows there itself)
        attended = out.copy_(attended)
    if return_attn_probs:
        return attended, result[1], None
    return (attended, result[1]) if return_softmax_lse else attended


def _check_out(out, q, k, v) -> None:
    """vLLM's ``out`` for packed q (total_q, H, D): the output's shape, dtype (bf16 for e4m3 q) and
    device; forward only."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if not isinstance(q, torch.Tensor):
        return  # (q's own check names it)
    dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (the output's), got {out.dtype}")
    if tuple(out.shape) != tuple(q.shape) or out.device != q.device:
        raise ValueError(f"out must have shape {tuple(q.shape)} on {q.device} as q, got {tuple(out.shape)} on "
                         f"{out.device}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("flashtile: out= is forward-only; call it under torch.no_grad()")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, s_aux=None):
    """``flash_attn_varlen_func`` with kv packed as (total_k, 2, Hk, D)."""
    _check_probs_without_dropout(return_attn_probs, dropout_p)
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, heads_k, head_dim), got {tuple(kv.shape)}")
    return _varlen_attention(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, return_attn_probs, None, deterministic,
                             names=("q", "kv[:, 0]", "kv[:, 1]"), s_aux=s_aux)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                     s_aux=None):
    """``flash_attn_varlen_func`` with q, k, v packed as (total, 3, H, D) and one set of offsets."""
    _check_probs_without_dropout(return_attn_probs, dropout_p)
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, heads, head_dim), got {tuple(qkv.shape)}")
    return _varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                             max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, return_attn_probs, None, deterministic,
                             names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"), s_aux=s_aux)


def _check_cache_append(cache_seqlens, lengths, new_tokens: int, capacity: int,
                        what: str = "the cache holds"):
    """That cache_seqlens plus the new tokens stay within ``capacity`` positions (an int is checked
    on the host; a tensor's values once per tensor version)."""
    key = (new_tokens, capacity)
    if isinstance(cache_seqlens, torch.Tensor):
        if not _values_to_check(f"lengths: {what}", lengths, key):
            return
        low, high = torch.stack([lengths.min(), lengths.max()]).tolist()
    else:
        low = high = cache_seqlens
    if low < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {low}")
    if high + new_tokens > capacity:
        raise ValueError(f"{what} {capacity} positions per sequence but cache_seqlens reaches {high} "
                         f"and {new_tokens} new tokens follow")
    if isinstance(cache_seqlens, torch.Tensor):
        _remember_checked(f"lengths: {what}", lengths, key)


def _check_leftpad(cache_leftpad: torch.Tensor, lengths: torch.Tensor) -> None:
    """0 <= cache_leftpad <= cache_seqlens per sequence (its keys are slots [leftpad, cache_seqlens)),
    read on the host once per version of both; unchecked under capture or torch.compile, where the
    kernels clamp leftpad into [0, cache_seqlens] (an empty sequence)."""
    key = (lengths,)
    if not cache_leftpad.numel() or not _values_to_check("leftpad", cache_leftpad, key):
        return
    bad = ((cache_leftpad < 0) | (cache_leftpad > lengths)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"cache_leftpad must be in [0, cache_seqlens] for every sequence, got "
                         f"{int(cache_leftpad[b])} with cache_seqlens {int(lengths[b])} (sequence {b})")
    _remember_checked("leftpad", cache_leftpad, key)


def _check_rotary(rotary_cos, rotary_sin, head_dim: int, device: torch.device) -> None:
    for t, n in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.device != device:
            raise ValueError(f"{n} must be (seqlen_ro, rotary_dim / 2) on {device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got "
                         f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary dim {2 * rotary_cos.shape[1]} exceeds the head dim {head_dim}")


# The last (batch,) lengths tensor made from an int cache_seqlens, with its key: every layer of a
# decode step passes the same length, which would otherwise cost an allocation and a fill kernel per
# layer. One tuple, swapped whole, so a reader never pairs a key with another key's tensor.
_REUSED: dict = {}


def _full_lengths(batch: int, value: int, device: torch.device) -> torch.Tensor:
    """torch.full((batch,), value, int32) on ``device``; the kernels only read it. Reused per
    (batch, value, device and, on CUDA, current stream); made fresh under torch.compile and CUDA
    graph capture."""
    return _reused("lengths", batch, value, device)


def _rows_table(batch: int, device: torch.device, cache_batch_idx=None) -> torch.Tensor:
    """A (batch, 1) int32 block table whose row b is cache row b (or cache_batch_idx[b], a checked
    (batch,) int32 tensor): a contiguous cache seen as a pool of one page a row. The same tensor for
    the same rows (the arange reused as _full_lengths is, a view of cache_batch_idx kept while it is
    the one given), so that checks cached by tensor identity are not repeated every layer."""
    if cache_batch_idx is None:
        return _reused("rows", batch, None, device)
    global _ROWS_VIEW
    ref, view = _ROWS_VIEW
    if ref is None or ref() is not cache_batch_idx:
        view = cache_batch_idx.view(batch, 1)
        _ROWS_VIEW = (weakref.ref(cache_batch_idx), view)
    return view


_ROWS_VIEW: tuple = (None, None)


def _reused(kind: str, batch: int, value, device: torch.device) -> torch.Tensor:
    """_full_lengths' tensor (value: the length) or _rows_table's arange (kind "rows"), one held per
    kind and reused per (batch, value, device and, on CUDA, current stream); made fresh under
    torch.compile and CUDA graph capture."""
    def make():
        if kind == "rows":
            return torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if torch.compiler.is_compiling():
        return make()
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return make()
        # The raw handle: torch.cuda.current_stream builds a Stream object, microseconds per layer.
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    key = (batch, value, device, stream)
    held_key, held = _REUSED.get(kind, (None, None))
    if held_key != key:
        held = make()
        _REUSED[kind] = (key, held)
    return held


def _cache_descales(k_descale, v_descale, k_cache, batch: int, paged: bool, batch_idx: bool):
    """k/v descales of an e4m3 cache as per-key views shaped like the cache without its head dim
    (B_cache or pages, S_max or page_size, Hk), sharing one layout: (B, Hk) and None become views
    with a token stride of 0. Returns (k view, v view, per_sequence): per_sequence when (B, Hk)
    descales go with pages or cache_batch_idx, whose cache rows are not the sequences: the views
    are then (B, page_size or S_max, Hk), indexed by the sequence (FlashAttention-3's semantics)."""
    rows, slots, heads_k = k_cache.shape[:3]
    per_sequence = (paged or batch_idx) and any(
        isinstance(d, torch.Tensor) and tuple(d.shape) == (batch, heads_k) for d in (k_descale, v_descale))
    if per_sequence:
        rows = batch
    views = []
    for d, n in ((k_descale, "k_descale"), (v_descale, "v_descale")):
        if d is None:  # the layout of a fixed (B, Hk) descale, so the two can be mixed
            d = torch.ones(rows, 1, heads_k, dtype=torch.float32, device=k_cache.device).expand(
                rows, slots, heads_k)
        elif not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            raise TypeError(f"{n} must be a float32 tensor")
        elif d.device != k_cache.device:
            raise ValueError(f"{n} is on {d.device} but the cache is on {k_cache.device}")
        elif tuple(d.shape) == k_cache.shape[:3] and not per_sequence:
            pass
        elif tuple(d.shape) == (batch, heads_k):
            d = d[:, None, :].expand(batch, slots, heads_k)
        else:
            raise ValueError(f"{n} must have shape {tuple(k_cache.shape[:3])} (one per key and KV "
                             f"head) or ({batch}, {heads_k}) (one per sequence; both descales alike), "
                             f"got {tuple(d.shape)}")
        views.append(d)
    # One set of strides serves both in the kernel; a copy would also lose the descales an append
    # writes, so differing layouts are an error rather than copied.
    if views[0].stride() != views[1].stride():
        raise ValueError("k_descale and v_descale must have the same layout: both one per key "
                         f"(same strides), or both fixed (batch, heads_k) / None; got strides "
                         f"{views[0].stride()} and {views[1].stride()}")
    return views[0], views[1], per_sequence


def _quantize_appended(k, v, k_descale, v_descale, lengths, cache_batch_idx, block_table, slots: int,
                       per_sequence: bool = False):
    """New keys/values (B, Sn, Hk, D) in e4m3 for an e4m3 cache. Per-key descales (token stride != 0)
    are computed from each token's largest magnitude per head and written where the tokens go; fixed
    ones are used as they are (``per_sequence``: rows of the descales are the sequences). Positions
    come from ``lengths`` on the device (no host sync)."""
    batch, new, heads_k, _ = k.shape
    pos = lengths.long()[:, None] + torch.arange(new, device=k.device)  # (B, Sn)
    if per_sequence:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
        pos = pos % slots  # (the descales' token stride is 0)
    elif block_table is not None:
        rows = block_table.long().gather(1, pos // slots)
        pos = pos % slots
    elif cache_batch_idx is not None:
        rows = cache_batch_idx.long()[:, None].expand(batch, new)
    else:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
    from .fp8 import quantize_per_key
    out = []
    for x, d in ((k, k_descale), (v, v_descale)):
        if d.stride(1) != 0:  # per key: this token's own scale, written where the token goes
            x8, scale = quantize_per_key(x)
            d[rows, pos] = scale
        else:
            x8, _ = quantize_per_key(x, d[rows, pos])
        out.append(x8)
    return out


def _check_q_descale(q_descale, batch: int, heads_k: int, device) -> torch.Tensor | None:
    if q_descale is None:
        return None
    if not isinstance(q_descale, torch.Tensor) or q_descale.dtype != torch.float32:
        raise TypeError("q_descale must be a float32 tensor")
    if tuple(q_descale.shape) != (batch, heads_k) or q_descale.device != device:
        raise ValueError(f"q_descale must have shape ({batch}, {heads_k}) on {device}, got "
                         f"{tuple(q_descale.shape)} on {q_descale.device}")
    return q_descale


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None, *,
                            page_table=None, cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None,
                            rotary_seqlens=None, qv=None, attention_chunk=0, scheduler_metadata=None,
                            pack_gqa=None, sm_margin=0, s_aux=None):
    """Attention of q (B, Sq, H, D) against a KV cache, with flash_attn 2.8's semantics.

    k_cache/v_cache: (B_cache, S_max, Hk, D), or page pools (num_pages, page_size, Hk, D) with
    ``block_table`` (B, max_pages) int32, any page size. ``cache_seqlens`` (int or (B,) int32) is each
    sequence's cached length (default: the whole cache); new ``k``/``v`` (B, Sn, Hk, D) are written
    in place at those positions first, then attended to. With ``rotary_cos``/``rotary_sin``
    (seqlen_ro, rotary_dim / 2), q and the new k are rotated in the same kernel that appends.
    Causal and windows align bottom-right.
    The KV sequence is split across programs (``num_splits``: 0 = heuristic, 1 = none, at most 128) and merged by
    log-sum-exp; lengths are read on the device, so the call can be captured in a CUDA graph.
    Returns out, or (out, softmax_lse (B, H, Sq)) with ``return_softmax_lse``.

    FP8 cache: float8_e4m3fn k_cache/v_cache read by an fp16/bf16 q, with float32 ``k_descale``/
    ``v_descale`` (multiply to dequantize) either shaped like the cache without its head dim, one per
    key and KV head ((B_cache, S_max, Hk), or (num_pages, page_size, Hk) for pages): new k/v are then
    quantized per token and head and their descales written alongside; or (B, Hk) (FlashAttention-3's
    shape, contiguous or paged caches): fixed per sequence and KV head, new tokens quantized with
    them (saturating at e4m3's largest value). None means 1.0. Rotary embedding turns
    q and the new keys before those are quantized.
    FlashAttention-3's all-FP8 call: q float8_e4m3fn too, with float32 ``q_descale`` (B, Hk) (None:
    1.0); the output is bf16. New k/v may then be e4m3 as well (stored as given: fixed (B, Hk) or
    None descales only, since they carry no per-token ones) or bf16 (quantized as above).

    FlashAttention-3's keywords: ``page_table`` (block_table's name there); ``cu_seqlens_q`` (B + 1)
    int32 with ``max_seqlen_q`` for packed queries q (total_q, H, D), sequence b's against the first
    cache_seqlens[b] keys of its cache row or pages (SGLang's call: new keys already written, counted
    in cache_seqlens; the LSE is then (H, total_q)); ``scheduler_metadata``, ``pack_gqa`` and
    ``sm_margin`` are accepted and not used (flashtile plans its splits on the device and always packs
    a KV head's query heads; it takes every SM). Not supported (NotImplementedError): ``qv``,
    ``attention_chunk``, ``rotary_seqlens``, and with ``cu_seqlens_q`` new k/v (``cu_seqlens_k_new``),
    rotary embedding or ``cache_leftpad``.

    ``s_aux`` (H,) float: attention sinks (vLLM's name, gpt-oss's), as in flash_attn_func; the LSE
    returned counts them.
    """
    block_table = _fa3_kvcache_keywords(block_table, page_table, qv, attention_chunk, rotary_seqlens,
                                        scheduler_metadata, pack_gqa, sm_margin)
    if cu_seqlens_q is not None or cu_seqlens_k_new is not None:
        out, lse = _kvcache_packed(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q, max_seqlen_q,
                                   cu_seqlens_k_new, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   num_splits, bool(return_softmax_lse), (q_descale, k_descale, v_descale),
                                   s_aux)
        return (out, lse) if return_softmax_lse else out
    _check_tensor(q, "q", 4, (*_DTYPES, torch.float8_e4m3fn))
    sinks = _check_sinks(s_aux, q, 4)
    paged = block_table is not None
    fp8_cache = isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn
    fp8_q = q.dtype == torch.float8_e4m3fn
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check_tensor(t, n, 4, (torch.float8_e4m3fn,) if fp8_cache or fp8_q else _DTYPES)
    if not fp8_cache and (k_descale is not None or v_descale is not None):
        raise ValueError("k_descale and v_descale apply to float8_e4m3fn caches only")
    if not fp8_q and q_descale is not None:
        raise ValueError("q_descale applies to a float8_e4m3fn q only")
    batch = q.shape[0]
    if paged:
        _check_block_table(block_table, k_cache, v_cache, batch, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table")
    else:
        capacity = k_cache.shape[1]
    if batch and not (k_cache.shape[0] and v_cache.shape[0]):
        raise ValueError(f"k_cache and v_cache must hold at least one row (or page), got shapes "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    # The cache stands for a (batch, ...) tensor (its rows may differ from q's: a page pool, or
    # cache_batch_idx); all three tensors passed _check_tensor above.
    _check_attention_match(q, k_cache, v_cache, (batch, *k_cache.shape[1:]), (batch, *v_cache.shape[1:]),
                           ("q", "k_cache", "v_cache"), kv_dtype=k_cache.dtype if fp8_cache else None)
    if cache_batch_idx is not None:
        cache_batch_idx = _check_cache_batch_idx(cache_batch_idx, batch, k_cache.shape[0], q.device)
    if cache_seqlens is None:
        if paged:
            raise ValueError("cache_seqlens is required with block_table")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity}], got {cache_seqlens}")
        lengths = _full_lengths(batch, cache_seqlens, q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must have shape ({batch},) on {q.device}, "
                             f"got {tuple(cache_seqlens.shape)} on {cache_seqlens.device}")
        lengths = cache_seqlens
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    new_tokens = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        # An e4m3 cache quantizes 16-bit tokens in q's dtype (bf16 with an e4m3 q) and stores e4m3
        # ones as they are.
        new_dtype = k_cache.dtype
        if fp8_cache:
            new_dtype = k.dtype if k.dtype == torch.float8_e4m3fn else \
                torch.bfloat16 if fp8_q else q.dtype
        for t, n in ((k, "k"), (v, "v")):
            _check_tensor(t, n, 4, (*_DTYPES, torch.float8_e4m3fn) if fp8_cache else _DTYPES)
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:] or t.dtype != new_dtype:
                raise ValueError(f"{n} must have shape ({batch}, new_tokens, {k_cache.shape[2]}, "
                                 f"{k_cache.shape[3]}) and dtype {new_dtype}, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        new_tokens = k.shape[1]
    _check_cache_append(cache_seqlens, lengths, new_tokens, capacity)
    if paged:
        _check_pages(block_table, k_cache.shape[0], capacity, 0)
    if cache_leftpad is not None:
        if paged:
            raise ValueError("cache_leftpad cannot be combined with block_table")
        if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32:
            raise TypeError("cache_leftpad must be an int32 tensor")
        if tuple(cache_leftpad.shape) != (batch,) or cache_leftpad.device != q.device:
            raise ValueError(f"cache_leftpad must have shape ({batch},) on {q.device}")
        _check_leftpad(cache_leftpad, lengths)
    rotary = rotary_cos is not None or rotary_sin is not None
    seq_descales = False  # (B, Hk) descales on pages or through cache_batch_idx
    if fp8_cache:
        if rotary and (fp8_q or (new_tokens and k.dtype == torch.float8_e4m3fn)):
            raise ValueError("rotary embedding needs a 16-bit q and new k (rotated, then quantized): "
                             "with e4m3 ones, rotate before quantizing them")
        k_descale, v_descale, seq_descales = _cache_descales(k_descale, v_descale, k_cache, batch,
                                                             paged, cache_batch_idx is not None)
        if fp8_q:
            q_descale = _check_q_descale(q_descale, batch, k_cache.shape[2], q.device)
        if new_tokens and k.dtype == torch.float8_e4m3fn and k_descale.stride(1) != 0:
            raise ValueError("k and v in float8_e4m3fn carry no descales of their own: append "
                             "them with fixed (batch, heads_k) k_descale/v_descale (or None), "
                             "or give bf16 k and v to be quantized per token")
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, q.shape[-1], q.device)
        _check_cache_append(cache_seqlens, lengths, max(new_tokens, q.shape[1]), rotary_cos.shape[0],
                            what="rotary_cos/rotary_sin have")
    _check_num_splits(num_splits)
    scale = _check_scale(softmax_scale, q.shape[-1])
    left, right = _check_window(window_size, causal)
    softcap = _check_softcap(softcap)
    alibi = _check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    if q.shape[2] and k_cache.shape[2] and q.shape[2] % k_cache.shape[2] == 0:
        # before the append writes; with the tile rows of this GPU and head dim (a decode step's
        # rows fit in one tile of any of them: not looked up)
        rows = q.shape[2] // k_cache.shape[2] * q.shape[1]
        decode.check_grid(batch, q.shape[1], q.shape[2], k_cache.shape[2],
                          decode.tile_rows_for(rows, fp8_cache, q.device, q.shape[-1])
                          if rows > decode.SMALL_SHARED_MEMORY_TILE_ROWS else None)
    if fp8_cache:  # every argument checked: from here on the cache's descales may be written
        if rotary and new_tokens:  # the new keys are rotated before they are quantized
            q, k = rotate_new_keys(q, k, rotary_cos, rotary_sin, lengths, cache_leftpad,
                                   bool(rotary_interleaved), causal or left >= 0 or right >= 0)
            rotary_cos = rotary_sin = None
            rotary = False
        if new_tokens and k.dtype != torch.float8_e4m3fn:
            k, v = _quantize_appended(k, v, k_descale, v_descale, lengths, cache_batch_idx,
                                      block_table, k_cache.shape[1], seq_descales)
    if rotary or new_tokens:
        # One kernel rotates q and the new keys and writes the new keys/values into the cache; it
        # reads the lengths on the device. Queries take consecutive positions only under causal or
        # local attention, as in flash_attn.
        q = rotate_and_append(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, lengths,
                              cache_batch_idx, cache_leftpad, block_table, bool(rotary_interleaved),
                              q_consecutive=causal or left >= 0 or right >= 0)
        if new_tokens:
            lengths = lengths + new_tokens
    # Sinks go into the decode (its merge or epilogue: one rounding, no launch more) unless their
    # gradient is asked for, which the torch ops on the result give.
    sinks_after = sinks is not None and torch.is_grad_enabled() and sinks.requires_grad
    out, lse = ops.kvcache(q, k_cache, v_cache, lengths, block_table, cache_batch_idx, alibi,
                           scale, left, right, softcap, num_splits, cache_leftpad,
                           k_descale if fp8_cache else None, v_descale if fp8_cache else None,
                           need_lse=bool(return_softmax_lse) or sinks_after,
                           q_descale=q_descale if fp8_q else None, seq_descales=fp8_cache and seq_descales,
                           sinks=None if sinks_after else sinks)
    if sinks_after:
        out, lse, _ = _with_sinks(out, lse, sinks, packed=False)
    return (out, lse) if return_softmax_lse else out


def _check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic), got {num_splits!r}")


def _fa3_kvcache_keywords(block_table, page_table, qv, attention_chunk, rotary_seqlens, scheduler_metadata,
                          pack_gqa, sm_margin):
    """FlashAttention-3's flash_attn_with_kvcache keywords beyond flash_attn 2.8's, checked; returns
    the block table (``page_table`` is its FlashAttention-3 name)."""
    if page_table is not None:
        if block_table is not None:
            raise ValueError("give block_table or page_table (FlashAttention-3's name for it), not both")
        block_table = page_table
    if qv is not None:
        raise NotImplementedError("flashtile: qv (FlashAttention-3's second query part, for MLA) is not supported")
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
    if attention_chunk:
        raise NotImplementedError("flashtile: attention_chunk (chunked local attention) is not supported")
    if rotary_seqlens is not None:
        raise NotImplementedError("flashtile: rotary_seqlens is not supported (the rotary positions are "
                                  "cache_seqlens, as in flash_attn 2.8)")
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be a torch.Tensor or None, got {type(scheduler_metadata).__name__}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be a bool or None, got {type(pack_gqa).__name__}")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"sm_margin must be an int >= 0, got {sm_margin!r}")
    return block_table


def _kvcache_packed(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, num_splits, return_lse, descales, s_aux=None):
    """flash_attn_with_kvcache with FlashAttention-3's cu_seqlens_q: packed queries (total_q, H, D)
    against each sequence's first cache_seqlens[b] keys, as flash_attn_varlen_func with those as
    seqused_k on the pools (a contiguous cache: a pool of one page a cache row, whose table is the
    rows). Returns (out, lse (H, total_q) or None)."""
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_k_new goes with cu_seqlens_q (packed queries)")
    if k is not None or v is not None or cu_seqlens_k_new is not None:
        raise NotImplementedError("flashtile: new k/v with cu_seqlens_q are not supported; write them into "
                                  "the cache first and count them in cache_seqlens")
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("flashtile: rotary embedding with cu_seqlens_q is not supported; rotate q "
                                  "and the keys before the call")
    if cache_leftpad is not None:
        raise NotImplementedError("flashtile: cache_leftpad with cu_seqlens_q is not supported")
    if max_seqlen_q is None:
        raise ValueError("max_seqlen_q is required with cu_seqlens_q")
    _check_tensor(q, "q", 3, (*_DTYPES, torch.float8_e4m3fn))
    batch = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None, q)
    fp8 = q.dtype == torch.float8_e4m3fn
    if not fp8 and isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn:
        raise TypeError("with cu_seqlens_q an e4m3 cache takes an e4m3 q (FlashAttention-3's all-FP8 call, with "
                        "q_descale), got q of dtype " + str(q.dtype))
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check_tensor(t, n, 4, (torch.float8_e4m3fn,) if fp8 else _DTYPES)
    _check_num_splits(num_splits)
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table")
        _check_block_table(block_table, k_cache, v_cache, batch, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            cache_batch_idx = _check_cache_batch_idx(cache_batch_idx, batch, k_cache.shape[0], q.device)
        elif k_cache.shape[0] < batch:
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows for {batch} sequences (cu_seqlens_q); "
                             "give cache_batch_idx or a larger cache")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        block_table = _rows_table(batch, q.device, cache_batch_idx)
        capacity = k_cache.shape[1]
        if cache_seqlens is None:
            cache_seqlens = capacity
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with block_table")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity}], got {cache_seqlens}")
        cache_seqlens = _full_lengths(batch, cache_seqlens, q.device)
    elif not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    else:  # (named here; _check_seqused_k finds its values checked under the same key)
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must have shape ({batch},) on {q.device}, got "
                             f"{tuple(cache_seqlens.shape)} on {cache_seqlens.device}")
        if cache_seqlens.numel() and _values_to_check("seqused_k", cache_seqlens, (None, capacity)):
            low, high = torch.stack([cache_seqlens.min(), cache_seqlens.max()]).tolist()
            if low < 0 or high > capacity:
                raise ValueError(f"cache_seqlens entries must be in [0, {capacity}] (the keys a sequence's cache "
                                 f"holds), got [{low}, {high}]")
            _remember_checked("seqused_k", cache_seqlens, (None, capacity))
    result = _varlen_attention(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, capacity, 0.0,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, block_table,
                               names=("q", "k_cache", "v_cache"), descales=descales, seqused_k=cache_seqlens,
                               num_splits=num_splits, s_aux=s_aux)
    return (result[0], result[1]) if return_lse else (result, None)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge attention computed over disjoint key sets (FlashAttention-3's combine).

    out_partial (num_splits, B, Sq, H, D) holds each part's normalized output, lse_partial
    (num_splits, B, H, Sq) float32 its natural-log LSE (-inf for a part that saw no key). Returns
    (out (B, Sq, H, D) in ``out_dtype`` (default out_partial's), lse (B, H, Sq)); rows no part saw get
    0 and -inf. Use it for cascade / shared-prefix attention.
    """
    from .kernels.decode import combine

    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial and lse_partial must be tensors")
    if out_partial.dim() != 5:
        raise ValueError(f"out_partial must be (num_splits, batch, seqlen, heads, head_dim), got "
                         f"{tuple(out_partial.shape)}")
    splits, batch, seqlen, heads, head_dim = out_partial.shape
    if tuple(lse_partial.shape) != (splits, batch, heads, seqlen):
        raise ValueError(f"lse_partial must have shape {(splits, batch, heads, seqlen)}, got "
                         f"{tuple(lse_partial.shape)}")
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial must be float32, got {lse_partial.dtype}")
    if out_partial.stride(-1) != 1:
        out_partial = out_partial.contiguous()
    if torch.compiler.is_compiling():  # the registered op (Dynamo cannot trace the launch)
        if out is not None and tuple(out.shape) != (batch, seqlen, heads, head_dim):
            raise ValueError(f"out must have shape {(batch, seqlen, heads, head_dim)}, got {tuple(out.shape)}")
        merged, lse = ops.attn_combine(out_partial, lse_partial,
                                       out.dtype if out is not None else out_dtype or out_partial.dtype)
        return (merged, lse) if out is None else (out.copy_(merged), lse)
    if out is None:
        out = torch.empty(batch, seqlen, heads, head_dim, device=out_partial.device,
                          dtype=out_dtype or out_partial.dtype)
    elif tuple(out.shape) != (batch, seqlen, heads, head_dim):
        raise ValueError(f"out must have shape {(batch, seqlen, heads, head_dim)}, got {tuple(out.shape)}")
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=out_partial.device)
    combine(out_partial, lse_partial, out, lse)
    return out, lse


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` on flashtile's kernel.

    Layout (B, H, L, E) or (H, L, E); ``is_causal`` is aligned to the top left as in SDPA (query i sees
    keys j <= i). ``attn_mask`` cannot be honoured by the kernel and raises; use ``is_causal`` or
    ``flash_attn_func``'s ``window_size``/``alibi_slopes`` instead.
    """
    if attn_mask is not None:
        raise NotImplementedError("flashtile.scaled_dot_product_attention does not take attn_mask; "
                                  "use is_causal=True, or flash_attn_func with window_size/alibi_slopes")
    dropout_p = _check_dropout(dropout_p)
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4):
            raise ValueError(f"{n} must have shape (batch, heads, seqlen, head_dim) or "
                             f"(heads, seqlen, head_dim), got {tuple(t.shape)}")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError("query, key and value must have the same number of dimensions")
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"value head dim {value.shape[-1]} must equal query head dim {query.shape[-1]}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: "
                         "pass enable_gqa=True for grouped-query attention")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    _check_attention_inputs(q, k, v, names=("query", "key", "value"))
    softmax_scale = _check_scale(scale, q.shape[-1], name="scale")
    right = 0 if is_causal else -1
    out, _ = ops.forward(q, k, v, softmax_scale, -1, right, False, 0.0, None, None, None, 0, 0,
                         dropout_p, ops.new_dropout_seed(dropout_p, q.device), None,
                         torch.are_deterministic_algorithms_enabled())
    out = out.transpose(1, 2)
    return out.squeeze(0) if unbatched else out
