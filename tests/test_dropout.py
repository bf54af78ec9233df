"""Dropout: Philox draws from torch's generator, regenerated exactly by the backward."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.kernels.dropout import dropout_mask
from flashtile.reference import attention, probabilities
from helpers import assert_grads_match_reference, assert_matches_reference, make_qkv

F16, BF16 = torch.float16, torch.bfloat16


def seed_for(generator_seed: int) -> torch.Tensor:
    """The seed flashtile draws right after torch.manual_seed(generator_seed)."""
    torch.manual_seed(generator_seed)
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    keep = dropout_mask(seed_for(3), 2, 4, 256, 256, p)  # 524k draws: 0.01 is 14 sigma at p 0.5
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    # Per (batch, head) streams differ: no two heads draw the same mask.
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window_size=(9, 4), softcap=5.0),
                                dict(causal=True, alibi_slopes="per-batch"),
                                dict(causal=True, deterministic=True)],
                         ids=["causal", "full", "window-softcap", "alibi", "deterministic"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_matches_reference_with_the_same_mask(kw, dtype):
    kw = dict(kw)
    batch, heads, heads_k, sq, sk, p = 2, 4, 2, 45, 70, 0.3
    q, k, v = make_qkv(batch, sq, sk, heads, heads_k, 32, dtype)
    if kw.get("alibi_slopes") == "per-batch":
        kw["alibi_slopes"] = torch.rand(batch, heads)
    keep = dropout_mask(seed_for(11), batch, heads, sq, sk, p)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(11)
    out = flashtile.flash_attn_func(qq, kk, vv, dropout_p=p, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    kw.pop("deterministic", None)
    ref_kw = dict(kw, dropout_p=p, dropout_mask=keep)
    assert_matches_reference(out.detach(), None, q, k, v, **ref_kw)
    assert_grads_match_reference((qq.grad, kk.grad, vv.grad), q, k, v, dout, out=out, **ref_kw)


def test_reproducible_from_torch_manual_seed():
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, F16)
    torch.manual_seed(7)
    first = flashtile.flash_attn_func(q, k, v, dropout_p=0.2)
    torch.manual_seed(7)
    again = flashtile.flash_attn_func(q, k, v, dropout_p=0.2)
    other = flashtile.flash_attn_func(q, k, v, dropout_p=0.2)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_return_attn_probs_negates_dropped_entries():
    q, k, v = make_qkv(1, 30, 50, 4, 2, 32, F16)
    torch.manual_seed(5)
    _, _, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
    keep = dropout_mask(seed_for(5), 1, 4, 30, 50, 0.4)
    probs = probabilities(q, k, causal=True)
    assert s_dmask.shape == (1, 4, 30, 50)
    torch.testing.assert_close(s_dmask.float().abs(), probs, atol=1e-3, rtol=1e-3)
    positive = probs > 1e-3
    assert torch.equal((s_dmask > 0)[positive], keep[positive])
    assert flashtile.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_varlen_dropout_uses_each_sequences_own_positions():
    lengths_q, lengths_k, heads, p = [20, 0, 33], [25, 5, 33], 4, 0.25
    cu_q = torch.tensor([0, 20, 20, 53], dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 30, 63], dtype=torch.int32)
    q = torch.randn(53, heads, 32, dtype=F16)
    k, v = torch.randn(63, 2, 32, dtype=F16), torch.randn(63, 2, 32, dtype=F16)
    seed = seed_for(9)
    torch.manual_seed(9)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, dropout_p=p, causal=True)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # Sequence b draws with key (seed, b, head) at offsets row * its own Sk + key.
        mask = dropout_mask(seed, b + 1, heads, lengths_q[b], lengths_k[b], p)[b:]
        args = (q[sq][None], k[sk][None], v[sk][None])
        assert_matches_reference(out[sq][None], None, *args, causal=True, dropout_p=p, dropout_mask=mask)


def test_sdpa_dropout_runs_and_is_seeded():
    q, k, v = (torch.randn(1, 2, 20, 16, dtype=F16) for _ in range(3))
    torch.manual_seed(1)
    a = flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    assert torch.equal(a, flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    ref, _ = attention(*(t.transpose(1, 2) for t in (q, k, v)), bottom_right=False)
    assert not torch.allclose(a.transpose(1, 2).float(), ref.float(), atol=1e-2)
