"""flashtile as a Hugging Face transformers attention implementation.

    import flashtile.integrations.transformers  # registers "flashtile"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtile", dtype=torch.bfloat16)

Decoder models that route attention through transformers' ``AttentionInterface`` (Llama, Qwen2,
Mistral with its sliding window, Gemma2 with its softcap, ...) then run flashtile's kernels in training
(forward and backward), prefill and ``generate``. Padding never becomes a dense mask: the 2-D padding
mask transformers builds for FlashAttention selects the real tokens, which run packed through
``flash_attn_varlen_func``; packed batches (``position_ids`` restarting at 0, or ``cu_seq_lens_*``
from a flattening collator) run the same way. Decode steps without padding take the split-KV kernel.
What flashtile cannot honour (attention weights as output, head masks, attention sinks, padding
that is not one contiguous run of real tokens per row) raises an error instead of computing
something else.

transformers is an optional dependency (``pip install flashtile[transformers]``); importing this
module without it raises ImportError.
"""

from __future__ import annotations

import torch

from .. import interface

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as exc:  # the integration is optional; the kernels never need transformers
    raise ImportError("flashtile.integrations.transformers needs transformers: "
                      "pip install 'flashtile[transformers]'") from exc

NAME = "flashtile"
# Up to this many new tokens per sequence, an unpadded step uses the split-KV decode kernel.
DECODE_MAX_QUERY = 4


def _target_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 for the kernels: fp32 activations (layer norms kept in fp32) go back to the dtype of
    the autocast region or of the module's weights."""
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    for p in module.parameters():
        if p.dtype in (torch.float16, torch.bfloat16):
            return p.dtype
    raise TypeError(f"flashtile attention needs fp16 or bf16 activations, got {dtype}: load the model "
                    "with dtype=torch.bfloat16 (or float16), or run under torch.autocast")


def _window(sliding_window) -> tuple[int, int]:
    # transformers' sliding window W: a query sees itself and the W - 1 keys before it.
    if sliding_window is None:
        return (-1, -1)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return (int(sliding_window) - 1, -1)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _rows_with_holes(mask: torch.Tensor) -> torch.Tensor:
    """Rows whose real tokens are not one run (left or right padding): varlen cannot skip holes.
    Returned on the device, read together with the lengths (one host sync per call)."""
    m = mask.to(torch.int8)
    starts = (m[:, 1:] > m[:, :-1]).sum(1) + m[:, 0]  # 0 -> 1 transitions, a leading 1 included
    return (starts > 1).sum(dtype=torch.int32)


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    return interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def flashtile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None,
                                dropout: float = 0.0, scaling: float | None = None,
                                sliding_window: int | None = None, softcap: float | None = None,
                                **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, Sq, D), key/value (B, Hk, Sk, D), the
    2-D padding mask (B, Sk) of True = real token or None; returns ((B, Sq, H, D), None)."""
    if kwargs.get("output_attentions") or kwargs.get("head_mask") is not None:
        raise NotImplementedError("flashtile attention does not return attention weights or apply "
                                  "head masks; use attn_implementation='eager' for those")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flashtile attention does not support attention sinks (s_aux)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("flashtile attention takes transformers' 2-D padding mask; got a "
                         f"{attention_mask.dim()}-D mask (is the model's mask function registered?)")
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    dtype = _target_dtype(module, query.dtype)
    # flash_attn's layout (B, S, H, D): transposed views, no copies.
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (query, key, value))
    kw = dict(softmax_scale=scaling, causal=bool(is_causal), window_size=_window(sliding_window),
              softcap=float(softcap or 0.0))
    dropout_p = float(dropout) if module.training else 0.0

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and cu_q is None and position_ids is not None and batch == 1 \
            and q_len == k_len and q_len > 1:
        starts = (position_ids.reshape(-1) == 0).nonzero().reshape(-1)
        if starts.numel() > 1 or (starts.numel() == 1 and int(starts[0]) != 0):
            # Packed sequences: each restart of position_ids at 0 opens a sequence.
            bounds = torch.cat([starts, starts.new_tensor([q_len])])
            if int(bounds[0]) != 0:
                bounds = torch.cat([bounds.new_zeros(1), bounds])
            cu_q = cu_k = bounds.to(torch.int32)
    if cu_q is not None:  # packed batch: (1, total, H, D) with offsets
        cu_q, cu_k = cu_q.to(torch.int32), (cu_q if cu_k is None else cu_k).to(torch.int32)
        max_q = int(kwargs.get("max_length_q") or (cu_q[1:] - cu_q[:-1]).max())
        max_k = int(kwargs.get("max_length_k") or (cu_k[1:] - cu_k[:-1]).max())
        out = _varlen(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, **kw)
        return out.unsqueeze(0), None

    if attention_mask is None:
        if (q_len <= DECODE_MAX_QUERY and dropout_p == 0.0 and not torch.is_grad_enabled()
                and k_len >= q_len):
            # A decode step: split-KV over the cache (any strides of the last dim 1 are fine).
            out = interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=k_len, **kw)
        else:
            out = interface.flash_attn_func(q, k, v, dropout_p=dropout_p, **kw)
        return out, None

    # Padding: keep the real tokens. Query i sits at key position k_len - q_len + i.
    mask = attention_mask[:, -k_len:].to(torch.bool)
    q_mask = mask[:, k_len - q_len:] if k_len >= q_len else None
    if q_mask is None:
        raise ValueError(f"flashtile attention: {q_len} queries against {k_len} keys with a padding mask")
    len_k, len_q = mask.sum(1, dtype=torch.int32), q_mask.sum(1, dtype=torch.int32)
    idx_k, idx_q = mask.reshape(-1).nonzero().reshape(-1), q_mask.reshape(-1).nonzero().reshape(-1)
    q_packed = q.reshape(batch * q_len, heads, head_dim).index_select(0, idx_q)
    k_packed = k.reshape(batch * k_len, k.shape[2], head_dim).index_select(0, idx_k)
    v_packed = v.reshape(batch * k_len, v.shape[2], head_dim).index_select(0, idx_k)
    max_q, max_k, holes = (int(x) for x in
                           torch.stack([len_q.max(), len_k.max(), _rows_with_holes(mask)]).tolist())
    if holes:
        raise ValueError("flashtile attention: the attention mask has padding between real tokens in a "
                         "row; only left or right padding (one run of real tokens per row) is supported")
    out_packed = _varlen(q_packed, k_packed, v_packed, _offsets(len_q), _offsets(len_k), max(max_q, 1),
                         max(max_k, 1), dropout_p=dropout_p, **kw)
    out = out_packed.new_zeros(batch * q_len, heads, head_dim).index_copy(0, idx_q, out_packed)
    return out.view(batch, q_len, heads, head_dim), None


def register() -> None:
    """Make ``attn_implementation="flashtile"`` available (done on import; idempotent)."""
    AttentionInterface.register(NAME, flashtile_attention_forward)
    # The mask transformers builds for FlashAttention: None, or the 2-D padding mask.
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
