"""vLLM's ``vllm.vllm_flash_attn`` interface on flashtile's kernels: code written against vLLM's
FlashAttention build switches by changing the import.

vLLM's build takes its own positional order for the packed call (``max_seqlen_q`` before
``cu_seqlens_q``, then ``max_seqlen_k``), a ``fa_version`` selector (2 or 3: which of its compiled
libraries runs; flashtile serves both with the same kernels, sinks (``s_aux``) and e4m3 inputs
included), ``window_size=None`` for no window and ``out=``. ``return_attn_probs`` is accepted and
does not change the return, as in vLLM's build: (out, softmax_lse) with ``return_softmax_lse``, else
out. ``scheduler_metadata`` is accepted and unused (flashtile plans its launches itself), so
``get_scheduler_metadata`` returns None. Not served: ``q_v`` (MLA's), context parallelism
(``cp_world_size`` > 1), and the sparse and tree attention functions.

    from flashtile.vllm_flash_attn import flash_attn_varlen_func  # was: from vllm.vllm_flash_attn import ...
"""

from __future__ import annotations

import importlib

FA_VERSIONS = (2, 3)
DEFAULT_FA_VERSION = 2


def _interface():
    # (loaded on first use, as flashtile's own functions are: importing this module compiles nothing)
    return importlib.import_module(".interface", __package__)


def _check_fa_version(fa_version) -> None:
    if isinstance(fa_version, bool) or fa_version not in FA_VERSIONS:
        raise ValueError(f"fa_version must be one of {FA_VERSIONS} (flashtile serves both alike), got {fa_version!r}")


def _window(window_size):
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be None or (left, right), got {window_size!r}")
    return tuple(window_size)


def is_fa_version_supported(fa_version: int, device=None) -> bool:
    """Whether ``fa_version`` can run on ``device`` (default: the current CUDA device): flashtile
    serves 2 and 3 on any CUDA GPU of compute capability 8.0 or newer."""
    return fa_version in FA_VERSIONS and fa_version_unsupported_reason(fa_version, device) is None


def fa_version_unsupported_reason(fa_version: int, device=None) -> str | None:
    """Why ``fa_version`` cannot run on ``device``, or None."""
    import torch

    if fa_version not in FA_VERSIONS:
        return f"flashtile serves fa_version {FA_VERSIONS}, not {fa_version!r}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flashtile's kernels need compute capability 8.0 or newer, this device has {major}.{minor}"
    return None


def get_scheduler_metadata(*args, **kwargs):
    """vLLM's FlashAttention-3 ahead-of-time schedule: flashtile plans its launches itself, so there
    is none (None, which flash_attn_varlen_func takes as ``scheduler_metadata``)."""
    return None


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, num_splits=0, fa_version=DEFAULT_FA_VERSION, s_aux=None,
                           cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None):
    """vLLM's flash_attn_varlen_func: packed q (total_q, H, D) against packed k/v (total_k, Hk, D) with
    ``cu_seqlens_k``, or page pools (num_pages, page_size, Hk, D) with ``block_table`` and
    ``seqused_k``; see flashtile.flash_attn_varlen_func for the semantics. Returns out, or (out,
    softmax_lse (H, total_q)) with ``return_softmax_lse``."""
    _check_fa_version(fa_version)
    if q_v is not None:
        raise NotImplementedError("flashtile: q_v (MLA's separate value-head query) is not supported")
    if cp_world_size != 1 or cp_tot_seqused_k is not None:
        raise NotImplementedError("flashtile: context parallelism (cp_world_size > 1) is not supported")
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("cu_seqlens_k or seqused_k must be given")
    if block_table is not None and seqused_k is None:
        raise ValueError("seqused_k must be given with block_table (each sequence's keys in its pages)")
    result = _interface().flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size), softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, block_table=block_table, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, seqused_k=seqused_k, out=out, num_splits=num_splits,
        scheduler_metadata=scheduler_metadata, return_softmax_lse=return_softmax_lse, s_aux=s_aux)
    return result


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=None, softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None,
                            fa_version=DEFAULT_FA_VERSION, q_descale=None, k_descale=None, v_descale=None,
                            scheduler_metadata=None, s_aux=None):
    """vLLM's flash_attn_with_kvcache: flashtile.flash_attn_with_kvcache (flash_attn's order) with
    ``out`` (the output's shape and dtype: bf16 for e4m3 q; checked before the cache is written,
    the result copied into it) and ``fa_version``."""
    _check_fa_version(fa_version)
    interface = _interface()
    if out is not None:
        interface._check_out(out, q, k, v)
    result = interface.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, _window(window_size), softcap, rotary_interleaved, alibi_slopes,
        num_splits, return_softmax_lse, q_descale, k_descale, v_descale, scheduler_metadata=scheduler_metadata,
        s_aux=s_aux)
    if out is None:
        return result
    attended = out.copy_(result[0] if return_softmax_lse else result)
    return (attended, result[1]) if return_softmax_lse else attended
