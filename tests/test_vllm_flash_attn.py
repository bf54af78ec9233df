"""flashtile.vllm_flash_attn: vLLM's FlashAttention interface (its positional order, fa_version,
window_size=None, out=) over flashtile's functions, checked bit for bit against them and against
the float64 reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile import vllm_flash_attn as vfa
from helpers import assert_matches_reference
from test_varlen import offsets, paged_copy

BF16, F16 = torch.bfloat16, torch.float16


def test_packed_call_in_vllms_order():
    lengths_q, lengths_k = [5, 1, 17], [9, 30, 17]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = torch.randn(sum(lengths_q), 6, 40, dtype=F16)
    k, v = torch.randn(sum(lengths_k), 2, 40, dtype=F16), torch.randn(sum(lengths_k), 2, 40, dtype=F16)
    out, lse = vfa.flash_attn_varlen_func(q, k, v, max(lengths_q), cu_q, max(lengths_k), cu_k, causal=True,
                                          window_size=[12, 0], return_softmax_lse=True, return_attn_probs=True)
    want_out, want_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                             causal=True, window_size=(12, 0), return_attn_probs=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for b in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert_matches_reference(out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0), q[rq].unsqueeze(0),
                                 k[rk].unsqueeze(0), v[rk].unsqueeze(0), causal=True, window_size=(12, 0))
    # return_attn_probs alone changes nothing, as in vLLM's build
    alone = vfa.flash_attn_varlen_func(q, k, v, max(lengths_q), cu_q, max(lengths_k), cu_k, causal=True,
                                       window_size=None, return_attn_probs=True)
    assert isinstance(alone, torch.Tensor)


@pytest.mark.parametrize("lengths_q", [[1, 1, 2], [1, 24, 3]], ids=["decode-steps", "mixed"])
def test_paged_call_as_vllms_backend_makes_it(lengths_q):
    """vLLM's FlashAttention backend: cu_seqlens_k None, seqused_k, block_table, out=, fa_version 3,
    scheduler_metadata from get_scheduler_metadata, sinks."""
    used = [33, 7, 40]
    cu_q = offsets(lengths_q)
    q = torch.randn(sum(lengths_q), 8, 64, dtype=BF16)
    k, v = torch.randn(sum(used), 2, 64, dtype=BF16), torch.randn(sum(used), 2, 64, dtype=BF16)
    k_pool, v_pool, table = paged_copy(k, v, offsets(used), 16)
    seqused = torch.tensor(used, dtype=torch.int32)
    sinks = torch.randn(8) * 2
    metadata = vfa.get_scheduler_metadata(3, max(lengths_q), max(used), 8, 2, 64, seqused, causal=True)
    assert metadata is None
    out = torch.full_like(q, float("nan"))
    got, lse = vfa.flash_attn_varlen_func(q, k_pool, v_pool, max(lengths_q), cu_q, max(used), seqused_k=seqused,
                                          causal=True, block_table=table, return_softmax_lse=True, out=out,
                                          scheduler_metadata=metadata, fa_version=3, s_aux=sinks)
    assert got is out and not torch.isnan(out).any()
    want, want_lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lengths_q), max(used),
                                                      causal=True, block_table=table, seqused_k=seqused,
                                                      return_softmax_lse=True, s_aux=sinks)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_kvcache_call_with_out_and_fa_version():
    batch, heads, heads_k, d = 2, 4, 2, 32
    q = torch.randn(batch, 1, heads, d, dtype=BF16)
    k_new, v_new = torch.randn(batch, 1, heads_k, d, dtype=BF16), torch.randn(batch, 1, heads_k, d, dtype=BF16)
    k_cache, v_cache = torch.randn(batch, 40, heads_k, d, dtype=BF16), torch.randn(batch, 40, heads_k, d, dtype=BF16)
    lengths = torch.tensor([11, 30], dtype=torch.int32)
    caches = (k_cache.clone(), v_cache.clone())
    out = torch.full_like(q, float("nan"))
    got = vfa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                      window_size=None, out=out, fa_version=3)
    assert got is out and not torch.isnan(out).any()
    want = flashtile.flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=lengths, causal=True)
    assert torch.equal(out, want)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])  # both appended alike
    # a wrong out is named before the cache is written
    k_before = k_cache.clone()
    with pytest.raises(TypeError, match="out must have dtype"):
        vfa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths + 1, causal=True,
                                    out=torch.empty(q.shape, dtype=F16))
    assert torch.equal(k_cache, k_before)
    got, lse = vfa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_softmax_lse=True,
                                           out=torch.empty_like(q))
    assert lse.shape == (batch, heads, 1)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fa_version=4), ValueError, "fa_version must be one of"),
    (dict(fa_version=True), ValueError, "fa_version must be one of"),
    (dict(q_v=torch.zeros(1)), NotImplementedError, "q_v"),
    (dict(cp_world_size=2), NotImplementedError, "context parallelism"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k or seqused_k"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "seqused_k must be given"),
    (dict(window_size=(3,)), ValueError, "window_size must be None"),
])
def test_bad_calls_are_named(kwargs, error, match):
    q = torch.randn(4, 2, 16, dtype=BF16)
    k = v = torch.randn(4, 2, 16, dtype=BF16)
    args = dict(cu_seqlens_k=offsets([4]))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        vfa.flash_attn_varlen_func(q, k, v, 4, offsets([4]), 4, **args)
    if "fa_version" in kwargs:
        with pytest.raises(error, match=match):
            vfa.flash_attn_with_kvcache(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), fa_version=kwargs["fa_version"])


def test_version_queries():
    assert vfa.DEFAULT_FA_VERSION == 2
    assert not vfa.is_fa_version_supported(4)
    assert "not 4" in vfa.fa_version_unsupported_reason(4)
    if not torch.cuda.is_available():
        assert not vfa.is_fa_version_supported(3)
        assert vfa.fa_version_unsupported_reason(3) == "no CUDA device"
    else:
        major = torch.cuda.get_device_capability()[0]
        assert vfa.is_fa_version_supported(3) == (major >= 8)


def test_import_compiles_nothing():
    code = "import sys, flashtile.vllm_flash_attn; assert 'flashtile.interface' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
