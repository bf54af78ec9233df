"""flashtile as a Hugging Face transformers attention implementation.

    import flashtile.integrations.transformers  # registers "flashtile"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtile", dtype=torch.bfloat16)

Decoder models that route attention through transformers' ``AttentionInterface`` (Llama, Qwen2,
Mistral with its sliding window, Gemma2 with its softcap, ...) then run flashtile's kernels in training
(forward and backward), prefill and ``generate``. Padding never becomes a dense mask: the 2-D padding
mask transformers builds for FlashAttention selects the real tokens, which run packed through
``flash_attn_varlen_func``; packed batches (``position_ids`` restarting at 0, or ``cu_seq_lens_*``
from a flattening collator) run the same way. Decode steps without padding take the split-KV kernel.
gpt-oss's attention sinks (``s_aux``) go to the kernels' calls. What flashtile cannot honour
(attention weights as output, head masks, padding that is not one contiguous run of real tokens per
row) raises an error instead of computing something else.

transformers is an optional dependency (``pip install flashtile[transformers]``); importing this
module without it raises ImportError.
"""

from __future__ import annotations

import torch

from .. import interface
from ..kernels import decode

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


# Every layer of one forward gets the same mask / position_ids tensor; what is read from it on the host
# (lengths, whether it is packed) costs a device sync, so it is read once and reused by the other layers.
_LAYOUT_CACHE: list = [None, None, None, None]  # tensor, its _version, extra key, layout


def _cached_layout(tensor: torch.Tensor, extra, compute):
    if torch.compiler.is_compiling():
        return compute()
    held, version, key, layout = _LAYOUT_CACHE
    if held is tensor and version == tensor._version and key == extra:
        return layout
    layout = compute()
    _LAYOUT_CACHE[:] = [tensor, tensor._version, extra, layout]
    return layout


def _packed_offsets(position_ids: torch.Tensor, length: int):
    """(cu_seqlens int32, max length) when position_ids (1, length) restart at 0 inside the row
    (packed sequences), else None."""
    starts = (position_ids.reshape(-1) == 0).nonzero().reshape(-1).tolist()
    if starts in ([], [0]):
        return None
    bounds = ([] if starts[0] == 0 else [0]) + starts + [length]
    cu = torch.tensor(bounds, dtype=torch.int32).to(position_ids.device)
    return cu, max(b - a for a, b in zip(bounds, bounds[1:]))


def _padding_layout(attention_mask: torch.Tensor, q_len: int, k_len: int) -> dict:
    """Where the real tokens of a 2-D padding mask are, for the packed (varlen) call and for the
    decode kernel's left padding."""
    mask = attention_mask[:, -k_len:].to(torch.bool)
    q_mask = mask[:, k_len - q_len:]
    len_k, len_q = mask.sum(1, dtype=torch.int32), q_mask.sum(1, dtype=torch.int32)
    m = mask.to(torch.int8)
    runs = (m[:, 1:] > m[:, :-1]).sum(1) + m[:, 0]  # 0 -> 1 transitions, a leading 1 included
    holes = (runs > 1).sum(dtype=torch.int32)
    # Left padding only: every row's real tokens (if any) end at the last position.
    right_padded = ((len_k > 0) & ~mask[:, -1]).sum(dtype=torch.int32)
    max_q, max_k, holes, right_padded = (int(x) for x in torch.stack(
        [len_q.max(), len_k.max(), holes, right_padded]).tolist())
    return dict(len_q=len_q, len_k=len_k, max_q=max(max_q, 1), max_k=max(max_k, 1), holes=holes,
                left_padded=right_padded == 0, leftpad=(k_len - len_k).to(torch.int32),
                idx_q=q_mask.reshape(-1).nonzero().reshape(-1),
                idx_k=mask.reshape(-1).nonzero().reshape(-1))


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    return interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


# Decode calls flash_attn_with_kvcache has validated, by signature -> the decode prepared for them.
# generate calls every layer with the same shapes at each step, and the host time of a decode step is
# the time per token (transformers' loop is host-bound at small batch): a call whose shapes, strides,
# dtypes, devices and options were checked already goes straight to the decode kernel's launch.
_PREPARED_DECODE: dict = {}
_MAX_PREPARED = 256
_HALF = (torch.float16, torch.bfloat16)


def _decode_signature(module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs):
    """The key of a call that may take the prepared decode, or None."""
    if (query.shape[2] > DECODE_MAX_QUERY or torch.is_grad_enabled() or query.dtype not in _HALF
            or torch.compiler.is_compiling() or kwargs.get("cu_seq_lens_q") is not None
            or kwargs.get("position_ids") is not None and query.shape[0] == 1 and query.shape[2] > 1):
        return None
    is_causal = kwargs.get("is_causal")
    sinks = kwargs.get("s_aux")  # a layer's own tensor at every call: its shape, dtype and device key
    if sinks is not None and not sinks.is_contiguous():  # (the kernels read sinks[h] at offset h)
        return None
    # Under CUDA graph capture a decode plans differently (split for the GPU, not the host).
    return (query.shape, query.stride(), query.dtype, key.shape, key.stride(), key.dtype, value.shape,
            value.stride(), value.dtype, query.get_device(), key.get_device(), value.get_device(),
            scaling, bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
            sliding_window, softcap, float(dropout) if module.training else 0.0,
            query.is_cuda and torch.cuda.is_current_stream_capturing(),
            None if sinks is None else (sinks.shape, sinks.dtype, sinks.get_device()))


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
    signature = None
    if attention_mask is None:
        signature = _decode_signature(module, query, key, value, dropout, scaling, sliding_window,
                                      softcap, kwargs)
        prepared = _PREPARED_DECODE.get(signature) if signature is not None else None
        if prepared is not None:
            # The launch reads only the data pointers of query/key/value (the same as their
            # (B, S, H, D) views'); the strides are in the plan, taken from those views.
            lengths = interface._full_lengths(query.shape[0], key.shape[2], query.device)
            out, _ = decode.run_decode(prepared, query, key, value, lengths, sinks=kwargs.get("s_aux"))
            return out, None
    elif attention_mask.dim() != 2:
        raise ValueError("flashtile attention takes transformers' 2-D padding mask; got a "
                         f"{attention_mask.dim()}-D mask (is the model's mask function registered?)")
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    dtype = _target_dtype(module, query.dtype)
    # flash_attn's layout (B, S, H, D): transposed views, no copies. (.to only when the dtype
    # differs: even a no-op .to costs microseconds, per layer and decode step.)
    if query.dtype == key.dtype == value.dtype == dtype:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    else:
        q, k, v = (t.to(dtype).transpose(1, 2) for t in (query, key, value))
    kw = dict(softmax_scale=scaling, causal=bool(is_causal), window_size=_window(sliding_window),
              softcap=float(softcap or 0.0))
    if kwargs.get("s_aux") is not None:  # gpt-oss's attention sinks, one logit per query head
        kw["s_aux"] = kwargs["s_aux"]
    dropout_p = float(dropout) if module.training else 0.0
    decode_step = (q_len <= DECODE_MAX_QUERY and dropout_p == 0.0 and not torch.is_grad_enabled()
                   and k_len >= q_len)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and cu_q is None and position_ids is not None and batch == 1 \
            and q_len == k_len and q_len > 1:
        packed = _cached_layout(position_ids, q_len, lambda: _packed_offsets(position_ids, q_len))
        if packed is not None:
            cu_q = cu_k = packed[0]
            max_q = max_k = packed[1]
    if cu_q is not None:  # packed batch: (1, total, H, D) with offsets
        cu_q, cu_k = cu_q.to(torch.int32), (cu_q if cu_k is None else cu_k).to(torch.int32)
        max_q = int(max_q or (cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k or (cu_k[1:] - cu_k[:-1]).max())
        out = _varlen(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, **kw)
        return out.unsqueeze(0), None

    if attention_mask is None:
        if decode_step:
            # A decode step: split-KV over the cache (any strides of the last dim 1 are fine).
            out = interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=k_len, **kw)  # checks all
            if signature is not None and query.dtype == key.dtype == value.dtype == dtype:
                # The same resolution of scale and window as the validated call's.
                left, right = interface._check_window(kw["window_size"], kw["causal"])
                if len(_PREPARED_DECODE) >= _MAX_PREPARED:
                    _PREPARED_DECODE.clear()
                _PREPARED_DECODE[signature] = decode.prepare_decode(
                    q, k, v, softmax_scale=interface._check_scale(scaling, head_dim),
                    window_left=left, window_right=right, softcap=kw["softcap"], need_lse=False, sinks="s_aux" in kw)
        else:
            out = interface.flash_attn_func(q, k, v, dropout_p=dropout_p, **kw)
        return out, None

    # Padding: keep the real tokens. Query i sits at key position k_len - q_len + i.
    if k_len < q_len:
        raise ValueError(f"flashtile attention: {q_len} queries against {k_len} keys with a padding mask")
    layout = _cached_layout(attention_mask, (q_len, k_len),
                            lambda: _padding_layout(attention_mask, q_len, k_len))
    if layout["holes"]:
        raise ValueError("flashtile attention: the attention mask has padding between real tokens in a "
                         "row; only left or right padding (one run of real tokens per row) is supported")
    if decode_step and layout["left_padded"]:
        # Generation pads on the left: the decode kernel skips each row's first leftpad keys in
        # place, without gathering the cache.
        out = interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=k_len,
                                                cache_leftpad=layout["leftpad"], **kw)
        return out, None
    q_packed = q.reshape(batch * q_len, heads, head_dim).index_select(0, layout["idx_q"])
    k_packed = k.reshape(batch * k_len, k.shape[2], head_dim).index_select(0, layout["idx_k"])
    v_packed = v.reshape(batch * k_len, v.shape[2], head_dim).index_select(0, layout["idx_k"])
    out_packed = _varlen(q_packed, k_packed, v_packed, _offsets(layout["len_q"]),
                         _offsets(layout["len_k"]), layout["max_q"], layout["max_k"],
                         dropout_p=dropout_p, **kw)
    out = out_packed.new_zeros(batch * q_len, heads, head_dim).index_copy(0, layout["idx_q"], out_packed)
    return out.view(batch, q_len, heads, head_dim), None


def _serve_flash_imports() -> None:
    """transformers 5 takes every implementation whose name contains "flash" for a FlashAttention
    build and, when a model is created, imports that build's functions by name (flash_attn, or a hub
    kernel), which fails for "flashtile". Answer that import with flashtile's own functions; every
    other name still goes to transformers. transformers 4 has no such import."""
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return
    load_by_name = getattr(fa_utils, "_lazy_imports", None)
    if load_by_name is None or getattr(load_by_name, "serves_flashtile", False):
        return

    def lazy_imports(implementation, *args, **kwargs):
        if implementation in (NAME, f"paged|{NAME}"):
            return (interface.flash_attn_func, interface.flash_attn_varlen_func,
                    interface.flash_attn_with_kvcache, fa_utils._pad_input, fa_utils._unpad_input)
        return load_by_name(implementation, *args, **kwargs)

    lazy_imports.serves_flashtile = True
    fa_utils._lazy_imports = lazy_imports


def _keep_flashtile_chosen() -> None:
    """transformers 5 replaces a requested implementation whose name contains "flash" by the first
    FlashAttention build a model lists as compatible (gpt-oss lists Hub kernels), so "flashtile" would
    turn into a download of another kernel. flashtile serves any model that calls attention through
    AttentionInterface (sinks included): count it as listed on the model being checked."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "keeps_flashtile", False):
        return

    def checked(self, attn_implementation, *args, **kwargs):
        listed = getattr(self, "_compatible_flash_implementations", None)
        if listed is not None and attn_implementation in (NAME, f"paged|{NAME}") \
                and attn_implementation not in listed:
            self._compatible_flash_implementations = [*listed, attn_implementation]
        return check(self, attn_implementation, *args, **kwargs)

    checked.keeps_flashtile = True
    PreTrainedModel._check_and_adjust_attn_implementation = checked


def register() -> None:
    """Make ``attn_implementation="flashtile"`` available (done on import; idempotent)."""
    AttentionInterface.register(NAME, flashtile_attention_forward)
    # The mask transformers builds for FlashAttention: None, or the 2-D padding mask.
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    _serve_flash_imports()
    _keep_flashtile_chosen()


register()
