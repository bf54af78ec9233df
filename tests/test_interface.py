"""The public flash_attn-compatible functions: layouts, packing, return values and argument checks."""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.reference import attention
from helpers import assert_matches_reference, make_qkv

F16, BF16 = torch.float16, torch.bfloat16


def test_flash_attn_func_matches_reference():
    q, k, v = make_qkv(2, 50, 70, 6, 2, 64, BF16)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches_reference(out, None, q, k, v, causal=True)


def test_return_attn_probs():
    q, k, v = make_qkv(1, 33, 33, 2, 2, 32, F16)
    res = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    out, lse, _ = res
    assert lse.shape == (1, 2, 33) and lse.dtype == torch.float32
    assert_matches_reference(out, lse, q, k, v)


def test_all_features_through_api():
    q, k, v = make_qkv(2, 40, 64, 4, 1, 48, F16)
    slopes = torch.rand(2, 4)
    kw = dict(softmax_scale=0.2, causal=True, window_size=(10, 3), softcap=8.0, alibi_slopes=slopes)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True, **kw)
    assert_matches_reference(out, lse, q, k, v, **kw)


def test_kvpacked_and_qkvpacked_match_unpacked():
    qkv = torch.randn(2, 40, 3, 4, 64, dtype=F16)
    q, k, v = qkv.unbind(2)
    expected = flashtile.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    packed3 = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    packed2 = flashtile.flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=True)
    assert torch.equal(packed3, expected) and torch.equal(packed2, expected)


def test_kvpacked_gqa():
    q = torch.randn(1, 30, 8, 32, dtype=BF16)
    kv = torch.randn(1, 45, 2, 2, 32, dtype=BF16)
    out = flashtile.flash_attn_kvpacked_func(q, kv, causal=True)
    assert_matches_reference(out, None, q, kv[:, :, 0], kv[:, :, 1], causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 40), (30, 70), (70, 30)])
def test_sdpa_semantics(seqlen_q, seqlen_k, causal):
    """SDPA's layout (B, H, L, E) and its top-left causal mask, against torch's own in float64."""
    q = torch.randn(2, 6, seqlen_q, 32, dtype=F16)
    k = torch.randn(2, 2, seqlen_k, 32, dtype=F16)
    v = torch.randn(2, 2, seqlen_k, 32, dtype=F16)
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == q.shape
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    low = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True).to(F16)
    # torch's float64 SDPA gives NaN on rows without keys; flashtile (like flash_attn) gives 0.
    seen = ~torch.isnan(ref)
    err = (out.double() - ref)[seen].abs().max()
    assert err <= 2 * (low.double() - ref)[seen].abs().max() + 2 ** -11
    assert torch.all(out[~seen] == 0)


def test_sdpa_unbatched_and_scale():
    q, k, v = (torch.randn(4, 25, 16, dtype=F16) for _ in range(3))
    out = flashtile.scaled_dot_product_attention(q, k, v, scale=0.5)
    ref, _ = attention(*(t.transpose(0, 1).unsqueeze(0).double() for t in (q, k, v)), softmax_scale=0.5)
    assert out.shape == q.shape
    assert (out.double() - ref[0].transpose(0, 1)).abs().max() < 2e-3


def test_sdpa_refuses_what_it_cannot_honour():
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=F16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k[:, :1], v[:, :1])


def _bad_inputs():
    good = lambda: make_qkv(1, 8, 8, 4, 2, 16, F16)  # noqa: E731
    q, k, v = good()
    cases = [
        ("q as list", dict(q=q.tolist()), TypeError, "q must be a torch.Tensor"),
        ("float32", dict(q=q.float(), k=k.float(), v=v.float()), TypeError, "q must be float16"),
        ("mixed dtypes", dict(k=k.bfloat16()), TypeError, "k has dtype"),
        ("3-d q", dict(q=q[0]), ValueError, "q must have 4 dimensions"),
        ("k/v shapes", dict(v=v[:, :4]), ValueError, "k and v must have the same shape"),
        ("batch", dict(k=torch.cat([k, k]), v=torch.cat([v, v])), ValueError, "batch size"),
        ("head dim", dict(k=k[..., :8].contiguous(), v=v[..., :8].contiguous()), ValueError, "head dim"),
        ("heads not multiple", dict(k=torch.randn(1, 8, 3, 16, dtype=F16),
                                    v=torch.randn(1, 8, 3, 16, dtype=F16)), ValueError, "multiple"),
        ("head dim > 256", dict(q=torch.randn(1, 8, 4, 264, dtype=F16), k=torch.randn(1, 8, 2, 264, dtype=F16),
                                v=torch.randn(1, 8, 2, 264, dtype=F16)), ValueError, "head dim of q"),
        ("strided last dim", dict(q=torch.randn(1, 8, 4, 32, dtype=F16)[..., ::2]), ValueError, "contiguous last"),
        ("window type", dict(window_size=(1.5, -1)), TypeError, "window_size"),
        ("window value", dict(window_size=(-2, 0)), ValueError, "window_size"),
        ("window shape", dict(window_size=(1, 2, 3)), ValueError, "window_size"),
        ("softcap", dict(softcap=-1.0), ValueError, "softcap"),
        ("scale", dict(softmax_scale=0.0), ValueError, "softmax_scale"),
        ("scale nan", dict(softmax_scale=math.nan), ValueError, "softmax_scale"),
        ("alibi dtype", dict(alibi_slopes=torch.ones(4, dtype=F16)), TypeError, "alibi_slopes"),
        ("alibi shape", dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
        ("dropout range", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ]
    return [pytest.param(kw, exc, msg, id=name) for name, kw, exc, msg in cases]


@pytest.mark.parametrize("overrides,exc,message", _bad_inputs())
def test_bad_input_is_named(overrides, exc, message):
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16, F16)
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    with pytest.raises(exc, match=message):
        flashtile.flash_attn_func(**args)


def test_packed_shape_errors():
    with pytest.raises(ValueError, match="qkv must have shape"):
        flashtile.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 4, 16, dtype=F16))
    with pytest.raises(ValueError, match="kv must have shape"):
        flashtile.flash_attn_kvpacked_func(torch.randn(1, 8, 4, 16, dtype=F16),
                                           torch.randn(1, 8, 3, 4, 16, dtype=F16))


def test_custom_op_passes_opcheck():
    q, k, v = make_qkv(1, 20, 24, 4, 2, 32, F16)
    torch.library.opcheck(torch.ops.flashtile.attn_fwd.default,
                          (q, k, v, 32 ** -0.5, -1, 0, True, 0.0, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiles_without_graph_breaks():
    def layer(q, k, v, qkv):
        a = flashtile.flash_attn_func(q, k, v, causal=True)
        b = flashtile.flash_attn_qkvpacked_func(qkv)
        c = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return a, b, c

    q, k, v = make_qkv(1, 16, 16, 4, 4, 16, F16)
    qkv = torch.randn(1, 16, 3, 8, 16, dtype=F16)
    compiled = torch.compile(layer, fullgraph=True)
    for got, expected in zip(compiled(q, k, v, qkv), layer(q, k, v, qkv)):
        assert torch.equal(got, expected)
