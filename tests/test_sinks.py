"""Attention sinks (vLLM's ``s_aux``, gpt-oss's learned sinks): one more logit per query head in every
row's softmax, taking its share and adding no value, checked against a float64 reference that appends
the sink's column to the scores and drops it after the softmax."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.kernels.dropout import dropout_mask
from flashtile.reference import attention
from helpers import assert_grads_match_reference, assert_matches_reference, make_qkv

F16, BF16 = torch.float16, torch.bfloat16


def sinks_for(heads: int) -> torch.Tensor:
    # spread so that some rows give most of their mass to the sink and others almost none
    return torch.randn(heads) * 3.0


def shuffled_pools(k_full, v_full, page_size):
    """Caches (B, capacity, Hk, D) as page pools in a random order with their block table, or as they
    are (table None) when ``page_size`` is None."""
    if page_size is None:
        return k_full, v_full, None
    batch, capacity = k_full.shape[:2]
    pages = capacity // page_size
    order = torch.randperm(batch * pages)
    k_cache, v_cache = torch.empty_like(k_full).view(-1, page_size, *k_full.shape[2:]), torch.empty_like(v_full)
    v_cache = v_cache.view(-1, page_size, *v_full.shape[2:])
    k_cache[order] = k_full.reshape(batch * pages, page_size, *k_full.shape[2:])
    v_cache[order] = v_full.reshape(batch * pages, page_size, *v_full.shape[2:])
    return k_cache, v_cache, order.view(batch, pages).to(torch.int32)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def refuse_after_passes(monkeypatch):
    """Fail the test if the sinks are applied to a finished output (in place or by the torch ops)."""
    import flashtile.interface as interface  # (imported first: its import binds sinks.apply_sinks_)
    import flashtile.kernels.sinks as sinks_module

    def refuse(*args, **kwargs):
        raise AssertionError("the sinks were applied after the kernel")

    for module, name in ((interface, "apply_sinks_"), (interface, "_with_sinks"), (sinks_module, "apply_sinks_")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("shape, kw, dtype", [
    ((2, 37, 53, 6, 2, 40), dict(causal=True), F16),
    ((1, 20, 8, 4, 4, 64), dict(causal=True), BF16),  # rows past the keys see none
    ((2, 64, 64, 8, 1, 111), dict(window_size=(16, 0), softcap=20.0), BF16),
    ((1, 33, 70, 4, 2, 96), dict(alibi_slopes="per-head"), F16),
], ids=["gqa-causal-d40", "empty-rows", "mqa-window-softcap-d111", "alibi-d96"])
def test_forward_matches_reference(shape, kw, dtype, monkeypatch):
    """The portable kernel takes the sink in its epilogue: the output rounded once (no extra half ulp
    in the budget) and no pass after it."""
    refuse_after_passes(monkeypatch)
    batch, sq, sk, heads, heads_k, d = shape
    q, k, v = make_qkv(batch, sq, sk, heads, heads_k, d, dtype)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "per-head":
        kw["alibi_slopes"] = torch.rand(heads)
    sinks = sinks_for(heads)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, s_aux=sinks, **kw)
    alone = flashtile.flash_attn_func(q, k, v, s_aux=sinks, **kw)
    assert torch.equal(out, alone)
    assert_matches_reference(out, lse, q, k, v, sinks=sinks, **kw)
    # the sink moved the output by more than the budget: the check can tell a call without it
    without = flashtile.flash_attn_func(q, k, v, **kw)
    ref, _ = attention(q.double(), k.double(), v.double(), sinks=sinks, **kw)
    assert (without.double() - ref).abs().max() > 10 * (out.double() - ref).abs().max()


def test_lse_counts_the_sink_and_sinks_may_be_minus_infinity():
    """LSE = logaddexp(LSE without the sink, sink); a sink of -inf changes nothing; bf16 sinks work."""
    q, k, v = make_qkv(2, 19, 30, 4, 2, 64, F16)
    out0, lse0, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    sinks = sinks_for(4).to(BF16)
    _, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=sinks)
    torch.testing.assert_close(lse, torch.logaddexp(lse0, sinks.float().view(1, 4, 1)), rtol=0, atol=1e-5)
    none = torch.full((4,), float("-inf"))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=none)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out-and-lse"])
def test_backward_matches_reference(dtype, with_lse):
    """dq, dk, dv by the accuracy rule; ds_aux within 3x textbook attention's error in the input dtype
    or, where larger, 2x the error the algorithm has in exact arithmetic. That one is D's: ds_aux[h] =
    sum over rows of p_i (dlse_i - dO_i . O_i), p_i the sink's probability and O the output as the
    forward stored it (the sinks applied), the same sum FlashAttention's backward takes D from;
    textbook attention has no such term."""
    batch, sq, sk, heads, heads_k, d = 2, 41, 57, 6, 2, 80
    q, k, v = make_qkv(batch, sq, sk, heads, heads_k, d, dtype)
    sinks = sinks_for(heads)
    dout = torch.randn(batch, sq, heads, d, dtype=dtype)
    dlse = torch.randn(batch, heads, sq) if with_lse else None
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ss = sinks.clone().requires_grad_(True)
    out, lse, _ = flashtile.flash_attn_func(qq, kk, vv, causal=True, return_attn_probs=True, s_aux=ss)
    loss = (out.float() * dout.float()).sum() + ((lse * dlse).sum() if with_lse else 0)
    loss.backward()
    assert_grads_match_reference((qq.grad, kk.grad, vv.grad), q, k, v, dout, dlse, causal=True, sinks=sinks)

    def sink_grad(precision):
        tq, tk, tv = (t.to(precision) for t in (q, k, v))
        s = sinks.clone().requires_grad_(True)
        o, l_ = attention(tq, tk, tv, causal=True, sinks=s)
        total = (o.double() * dout.double()).sum()
        if with_lse:
            total = total + (l_.double() * dlse.double()).sum()
        total.backward()
        return s.grad.double()
    exact, low = sink_grad(torch.float64), sink_grad(dtype)
    ref, ref_lse = attention(q.double(), k.double(), v.double(), causal=True, sinks=sinks)
    share = torch.exp(sinks.double().view(1, heads, 1) - ref_lse)
    stored = flashtile.flash_attn_func(q, k, v, causal=True, s_aux=sinks).double()  # what the backward reads
    rounding = ((stored - ref) * dout.double()).sum(-1).transpose(1, 2)  # (B, H, Sq)
    stored_err = (share * rounding).sum((0, 2)).abs().max().item()
    err = (ss.grad.double() - exact).abs().max().item()
    low_err = (low - exact).abs().max().item()
    assert err <= max(3 * low_err, 2 * stored_err), (err, low_err, stored_err)


def test_dropout_keeps_the_sink_share(monkeypatch):
    """Dropout drops the normalized probabilities, the sink's share taken out first (in the kernel's
    epilogue, the S_dmask by the torch formula)."""
    refuse_after_passes(monkeypatch)
    batch, heads, heads_k, sq, sk, p = 2, 4, 2, 45, 70, 0.3
    q, k, v = make_qkv(batch, sq, sk, heads, heads_k, 32, F16)
    sinks = sinks_for(heads)
    torch.manual_seed(11)
    keep = dropout_mask(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64), batch, heads, sq, sk, p)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(11)
    out, lse, s_dmask = flashtile.flash_attn_func(qq, kk, vv, dropout_p=p, causal=True, return_attn_probs=True,
                                                  s_aux=sinks)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_kw = dict(causal=True, dropout_p=p, dropout_mask=keep, sinks=sinks)
    assert_matches_reference(out.detach(), lse.detach(), q, k, v, **ref_kw)
    assert_grads_match_reference((qq.grad, kk.grad, vv.grad), q, k, v, dout, **ref_kw)
    # S_dmask: the probabilities with the sink's share taken, negated where dropped
    _, ref_lse = attention(q.double(), k.double(), v.double(), causal=True, sinks=sinks)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) * 32 ** -0.5
    visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    probs = torch.exp(scores - ref_lse.unsqueeze(-1)).masked_fill(~visible, 0)
    expected = torch.where(keep, probs, -probs)
    assert (s_dmask.double() - expected).abs().max() < 2e-3


def packed(lengths_q, lengths_k, heads, heads_k, d, dtype):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, d, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), heads_k, d, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), heads_k, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


def assert_packed_matches(out, lse, q, k, v, cu_q, cu_k, sinks, rounded_twice=False, **kw):
    for b in range(cu_q.shape[0] - 1):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert_matches_reference(out[rq].unsqueeze(0), None if lse is None else lse[:, rq].unsqueeze(0),
                                 q[rq].unsqueeze(0), k[rk].unsqueeze(0), v[rk].unsqueeze(0), sinks=sinks,
                                 rounded_twice=rounded_twice, **kw)


def test_varlen_forward_backward_and_vllm_keywords(monkeypatch):
    refuse_after_passes(monkeypatch)  # (the portable kernel's epilogue takes them)
    heads, heads_k, d = 6, 3, 64
    q, k, v, cu_q, cu_k = packed([5, 17, 1], [9, 17, 40], heads, heads_k, d, BF16)
    sinks = sinks_for(heads)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ss = sinks.clone().requires_grad_(True)
    out, lse, _ = flashtile.flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, 17, 40, causal=True,
                                                    return_attn_probs=True, s_aux=ss)
    assert_packed_matches(out.detach(), lse.detach(), q, k, v, cu_q, cu_k, sinks, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert ss.grad is not None and torch.isfinite(ss.grad).all()
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        grads = (qq.grad[rq].unsqueeze(0), kk.grad[rk].unsqueeze(0), vv.grad[rk].unsqueeze(0))
        assert_grads_match_reference(grads, q[rq].unsqueeze(0), k[rk].unsqueeze(0), v[rk].unsqueeze(0),
                                     dout[rq].unsqueeze(0), causal=True, sinks=sinks)
    # vLLM's form: out= and return_softmax_lse, forward only
    with torch.no_grad():
        want, want_lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True,
                                                          return_softmax_lse=True, s_aux=sinks)
        into = nan_like(out)
        got, got_lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True, out=into,
                                                        return_softmax_lse=True, s_aux=sinks)
    assert got is into and torch.equal(into, want) and torch.equal(got_lse, want_lse)
    assert_packed_matches(into, got_lse, q, k, v, cu_q, cu_k, sinks, causal=True)


def test_varlen_lse_with_dropout_is_not_refused():
    """return_softmax_lse (no S_dmask) goes with dropout; return_attn_probs with dropout stays refused."""
    q, k, v, cu_q, cu_k = packed([7, 12], [7, 12], 2, 2, 32, F16)
    out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, dropout_p=0.2,
                                                return_softmax_lse=True, s_aux=sinks_for(2))
    assert out.shape == q.shape and lse.shape == (2, 19) and torch.isfinite(lse).all()
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout"):
        flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, dropout_p=0.2, return_attn_probs=True)


@pytest.mark.parametrize("page_size", [None, 3, 16], ids=["contiguous", "page3", "page16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_with_append(page_size, num_splits):
    """A decode/speculative step (2 new tokens, causal) appended to caches of different lengths."""
    batch, heads, heads_k, d, capacity = 3, 8, 2, 64, 48
    lengths = torch.tensor([30, 0, 45], dtype=torch.int32)
    k_full = torch.randn(batch, capacity, heads_k, d, dtype=BF16)
    v_full = torch.randn(batch, capacity, heads_k, d, dtype=BF16)
    q = torch.randn(batch, 2, heads, d, dtype=BF16)
    k_new, v_new = torch.randn(batch, 2, heads_k, d, dtype=BF16), torch.randn(batch, 2, heads_k, d, dtype=BF16)
    sinks = sinks_for(heads)
    kw = dict(cache_seqlens=lengths, k=k_new, v=v_new, causal=True, num_splits=num_splits,
              return_softmax_lse=True, s_aux=sinks)
    k_cache, v_cache, table = shuffled_pools(k_full.clone(), v_full.clone(), page_size)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, **kw)
    for b in range(batch):
        n = int(lengths[b])
        keys = torch.cat([k_full[b, :n], k_new[b]]).unsqueeze(0)
        values = torch.cat([v_full[b, :n], v_new[b]]).unsqueeze(0)
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], keys, values, causal=True, sinks=sinks,
                                 rounded_twice=True)


def test_kvcache_packed_form_equals_varlen():
    """FlashAttention-3's packed kvcache call with sinks: flash_attn_varlen_func's result on the same pools."""
    heads, heads_k, d, page = 4, 1, 64, 16
    lengths_q, lengths_k = [1, 3, 1], [20, 35, 16]
    pool_k = torch.randn(12, page, heads_k, d, dtype=F16)
    pool_v = torch.randn(12, page, heads_k, d, dtype=F16)
    table = torch.randperm(12).view(3, 4).to(torch.int32)
    q = torch.randn(sum(lengths_q), heads, d, dtype=F16)
    cu_q = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    seqlens = torch.tensor(lengths_k, dtype=torch.int32)
    sinks = sinks_for(heads)
    out, lse = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, page_table=table,
                                                 cu_seqlens_q=cu_q, max_seqlen_q=3, causal=True,
                                                 return_softmax_lse=True, s_aux=sinks)
    want, want_lse = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, None, 3, 64, causal=True,
                                                      block_table=table, seqused_k=seqlens,
                                                      return_softmax_lse=True, s_aux=sinks)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    keys = pool_k[table.long()].flatten(1, 2)
    values = pool_v[table.long()].flatten(1, 2)
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        n = lengths_k[b]
        assert_matches_reference(out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0), q[rq].unsqueeze(0),
                                 keys[b:b + 1, :n], values[b:b + 1, :n], causal=True, sinks=sinks, rounded_twice=True)


def assert_e4m3_matches_reference(out, lse, q, k, v, sinks, **kw):
    """out (bfloat16) of e4m3 inputs against float64 attention with the sinks on their dequantized
    values (q, k, v, float): within 2x the error of the same textbook attention in bfloat16 (the
    interpreter keeps P in fp32, so no e4m3 rounding of P is allowed for); LSE within 1e-4."""
    ref, ref_lse = attention(q.double(), k.double(), v.double(), sinks=sinks.double(), **kw)
    low, _ = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks=sinks, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref).abs().max().item()
    budget = 2 * (low.double() - ref).abs().max().item()
    assert err <= budget, f"max error {err:.3g} > 2x textbook bf16 error ({budget:.3g})"
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def assert_packed_e4m3_matches(out, lse, tensors, descales, cu_q, cu_k, sinks):
    """Packed e4m3 sequences (q, k, v (total, heads, D) with per-sequence (B, Hk) descales), each
    against float64 causal attention with the sinks on its own dequantized inputs."""
    heads_k = descales[1].shape[1]
    for b in range(cu_q.shape[0] - 1):
        rows = [slice(int(cu[b]), int(cu[b + 1])) for cu in (cu_q, cu_k, cu_k)]
        deq = [(t[r].float().unflatten(1, (heads_k, -1)) * dd[b].view(1, heads_k, 1, 1)).flatten(1, 2).unsqueeze(0)
               for t, r, dd in zip(tensors, rows, descales)]
        assert_e4m3_matches_reference(out[rows[0]].unsqueeze(0), lse[:, rows[0]].unsqueeze(0), *deq, sinks,
                                      causal=True)


def test_fp8_calls_take_the_sinks_in_the_kernel(monkeypatch):
    """e4m3 inputs and caches: the prefill forward (flash_attn_func's FlashAttention-3 call,
    flashtile.fp8's per-block call) and the decode take the sinks in their epilogues, no pass follows;
    each against float64 attention with the sinks on the dequantized inputs."""
    heads, heads_k, d = 4, 2, 64
    sinks = 2.5 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in bf16
    q, k, v = (t.to(torch.float8_e4m3fn) for t in make_qkv(2, 24, 40, heads, heads_k, d, F16))
    refuse_after_passes(monkeypatch)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=sinks)
    assert_e4m3_matches_reference(out, lse, q.float(), k.float(), v.float(), sinks, causal=True)
    # an e4m3 KV cache read by a bf16 query, (B, Hk) descales
    qb = torch.randn(2, 1, heads, d, dtype=BF16)
    k_descale, v_descale = torch.rand(2, heads_k) + 0.5, torch.rand(2, heads_k) + 0.5
    lengths = [40, 11]
    out, lse = flashtile.flash_attn_with_kvcache(qb, k.clone(), v.clone(), k_descale=k_descale, v_descale=v_descale,
                                                 cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                                 return_softmax_lse=True, s_aux=sinks)
    for b, n in enumerate(lengths):
        assert_e4m3_matches_reference(out[b:b + 1], lse[b:b + 1], qb[b:b + 1].float(),
                                      k[b:b + 1, :n].float() * k_descale[b].view(1, 1, heads_k, 1),
                                      v[b:b + 1, :n].float() * v_descale[b].view(1, 1, heads_k, 1), sinks)
    # flashtile.fp8's per-block call (Hadamard-rotated Q and K)
    from flashtile import fp8
    x = fp8.quantize_qkv(*make_qkv(2, 24, 40, heads, heads_k, d, BF16), block=(32, 64), hadamard=True)
    out, lse = fp8.attention(x, causal=True, return_lse=True, s_aux=sinks)
    dq, dk, dv = (fp8.dequantize(t, scale, block) for t, scale, block in
                  ((x.q, x.q_descale, 32), (x.k, x.k_descale, 64), (x.v, x.v_descale, 64)))
    assert_e4m3_matches_reference(out, lse, dq, dk, dv, sinks, causal=True)
    with pytest.raises(ValueError, match=r"s_aux must have shape \(4,\)"):
        fp8.attention(x, s_aux=torch.zeros(3))


def assert_within_an_ulp(got, exact):
    """got (16-bit) is exact (float32) rounded either way: the interpreter truncates bf16 stores."""
    ulp = torch.finfo(got.dtype).eps * exact.abs().clamp(min=torch.finfo(got.dtype).tiny)
    assert ((got.float() - exact).abs() <= ulp).all(), (got.float() - exact).abs().max()


@pytest.mark.parametrize("dtype, head_dim", [(F16, 40), (BF16, 111), (BF16, 128)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_in_place_kernel_is_the_torch_formula(dtype, head_dim, packed):
    """The one-launch path of eager inference calls against the differentiable torch ops, on strided
    views, rows that saw no key, sinks of -inf and sinks far above the row's LSE."""
    from flashtile.interface import _with_sinks

    heads = 5
    if packed:
        out = torch.randn(heads, 37, head_dim, dtype=dtype).transpose(0, 1)  # (total, H, D), strided
        lse = torch.randn(37, heads).t() * 4  # (H, total), strided
    else:
        out = torch.randn(2, heads, 23, head_dim, dtype=dtype).transpose(1, 2)
        lse = torch.randn(2, 23, heads).transpose(1, 2) * 4
    lse[..., 3] = float("inf")  # rows that saw no key
    (out[3] if packed else out[:, 3]).zero_()
    sinks = torch.tensor([0.5, float("-inf"), 60.0, -2.0, 3.0])
    want_out, want_lse, _ = _with_sinks(out.clone(), lse.clone(), sinks.clone().requires_grad_(True), packed)
    got_out, got_lse = out.clone(), lse.clone()
    got_out, got_lse, factor = _with_sinks(got_out, got_lse, sinks, packed)
    assert factor is None  # the kernel's path, in place
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any()
    assert_within_an_ulp(got_out, out.float() * torch.sigmoid(lse - sinks.view(heads, 1)).mT.unsqueeze(-1)
                         if packed else out.float() * torch.sigmoid(lse - sinks.view(1, heads, 1))
                         .transpose(1, 2).unsqueeze(-1))
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[finite], want_lse.detach()[finite], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out.float(), want_out.detach().float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype, head_dim", [(F16, 40), (BF16, 111)])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out-and-lse"])
def test_sink_gradient_kernel_is_the_formula(dtype, head_dim, with_lse):
    """kernels.sinks.sink_grad against float64 sums of the same stored tensors: ds[h] = sum over rows
    of exp(s[h] - lse_i) (dlse_i - dout_i . out_i); strided dout and lse, rows that saw no key (LSE
    +inf: no share), a sink of -inf (none)."""
    from flashtile.kernels.sinks import sink_grad

    batch, seqlen, heads = 2, 45, 5
    out = torch.randn(batch, seqlen, heads, head_dim, dtype=dtype)
    dout = torch.randn(batch, heads, seqlen, head_dim, dtype=dtype).transpose(1, 2)
    sinks = torch.tensor([0.5, float("-inf"), 3.0, -2.0, 1.0])
    lse = (torch.randn(batch, seqlen, heads) * 2 + 1).transpose(1, 2)
    lse = torch.maximum(lse, sinks.view(1, heads, 1))  # an LSE with the sink's column is at least the sink
    lse[:, :, 7] = float("inf")
    out[:, 7] = 0
    dlse = torch.randn(batch, heads, seqlen) if with_lse else None
    got = sink_grad(out, dout, lse, dlse, sinks)
    share = torch.exp(sinks.double().view(1, heads, 1) - lse.double())
    weight = -(out.double() * dout.double()).sum(-1).transpose(1, 2)
    if with_lse:
        weight = weight + dlse.double()
    want = (share * weight).nan_to_num(0.0).sum((0, 2))
    assert got.dtype == sinks.dtype and not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got[1] == 0


def e4m3_route_inputs(packed_sequences: bool):
    """e4m3 inputs of attention_forward's e4m3 routes: (q, k, v, keywords), descales as the callers
    make them (flashtile.fp8's blocks; for packed sequences, FlashAttention-3's per sequence)."""
    from flashtile import fp8
    if packed_sequences:
        from test_fp8 import _packed_e4m3
        cu_q, cu_k, (q, k, v), (q_d, k_d, v_d), _ = _packed_e4m3([30, 7], [41, 12], 4, 2, 64)
        q_d = q_d[:, :, None].expand(2, 2, 2).reshape(2, 4, 1).contiguous()
        return q, k, v, dict(softmax_scale=0.125, window_left=-1, window_right=0, diag_offset=0, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=41, scale_blocks=(256, 256),
                             descales=(q_d, k_d.unsqueeze(-1), v_d.unsqueeze(-1)))
    x = fp8.quantize_qkv(*make_qkv(2, 30, 41, 4, 2, 64, BF16), hadamard=False)
    return x.q, x.k, x.v, dict(softmax_scale=0.125, window_left=-1, window_right=0, diag_offset=11,
                               descales=(x.q_descale, x.k_descale, x.v_descale), scale_blocks=(x.block_q, x.block_k))


@pytest.mark.parametrize("route, inside", [("plain", False), ("general", False), ("packed", False),
                                           ("packed-general", False), ("plain", True), ("general", True),
                                           ("packed", True),
                                           ("packed-general", True), ("e4m3-plain", False), ("e4m3-plain", True),
                                           ("e4m3-packed-general", False), ("e4m3-packed-general", True),
                                           ("e4m3-general", False), ("e4m3-general", True)])
def test_gluon_routes_take_the_sinks_after_the_kernel_or_in_it(monkeypatch, route, inside):
    """The Gluon forward routes (stood in for by the portable kernel's result without sinks, as a CPU
    runs no Gluon): attention_forward applies the sinks to the route's result in place, or with
    gluon_forward.SINKS_IN_EPILOGUE the plain, general and packed launches, 16-bit and e4m3 (page
    pools and windows included: _gluon_varlen), get them and nothing follows."""
    from flashtile.kernels import forward, gluon_forward, sinks as sinks_module

    sinks = 3.0 + torch.randn(4)  # near the rows' LSE (log of 12-41 keys, + ~0.5): each takes a share
    if route.startswith("e4m3"):
        q, k, v, kw = e4m3_route_inputs(route == "e4m3-packed-general")
        route = "e4m3-general" if route == "e4m3-general" else route[len("e4m3-"):]
    elif route.startswith("packed"):
        q, k, v, cu_q, cu_k = packed([30, 7], [41, 12], 4, 2, 64, BF16)
        kw = dict(softmax_scale=0.125, window_left=-1, window_right=0, diag_offset=0, cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=41)
    else:
        q, k, v = make_qkv(2, 30, 41, 4, 2, 64, BF16)
        kw = dict(softmax_scale=0.125, window_left=-1, window_right=0, diag_offset=11)
    plain = forward.attention_forward(q, k, v, **kw)
    given = []

    def stand_in(*args, **kwargs):
        given.append(kwargs.get("sinks"))
        return plain[0].clone(), plain[1].clone()
    def stand_in_as_cuda(name):
        """gluon_forward.<name> on a route taken for CUDA tensors: q says it is one until the call."""
        def first_call(*args, **kwargs):
            monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "cuda"))
            return stand_in(*args, **kwargs)
        monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(gluon_forward, name, first_call)
    monkeypatch.setattr(gluon_forward, "SINKS_IN_EPILOGUE", inside)
    if route == "plain" and q.dtype == torch.float8_e4m3fn:
        stand_in_as_cuda("fp8_forward")
    elif route == "plain":
        monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
        monkeypatch.setattr(gluon_forward, "plain_forward", stand_in)
    elif route == "general":
        monkeypatch.setattr(forward, "gluon_applies", lambda *args, **kwargs: True)
        monkeypatch.setattr(gluon_forward, "gluon_attention_forward", stand_in)
    elif route == "e4m3-general":  # (writes into the out and lse the route allocated)
        def into_stand_in(*args, out, lse, **kwargs):
            stand_in(**kwargs)
            out.copy_(plain[0])
            lse.copy_(plain[1])
        monkeypatch.setattr(forward, "gluon_fp8_applies", lambda *args, **kwargs: True)
        monkeypatch.setattr(gluon_forward, "_tma_ok", lambda t: True)
        monkeypatch.setattr(gluon_forward, "gluon_attention_forward", into_stand_in)
    elif route == "packed":
        stand_in_as_cuda("packed_forward")
    else:  # (the route is taken where no interpreter runs; the stand-in's result, and the rest, in one)
        def packed_stand_in(*args, **kwargs):
            monkeypatch.setattr(forward, "_INTERPRET", True)
            return stand_in(*args, **kwargs)
        monkeypatch.setattr(forward, "_INTERPRET", False)
        monkeypatch.setattr(forward, "_gluon_varlen", packed_stand_in)
    out, lse = forward.attention_forward(q, k, v, sinks=sinks, **kw)
    want_out, want_lse = plain[0].clone(), plain[1].clone()
    if inside:
        assert given == [sinks]
    else:
        assert given == [None]
        sinks_module.apply_sinks_(want_out, want_lse, sinks, packed=route.startswith("packed"))
        assert not torch.equal(out, plain[0])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_training_calls_apply_the_sinks_inside_the_op(monkeypatch):
    """Calls that need gradients take the sinks in the attention op (applied in place, the backward
    reading the stored output), not the torch ops on the finished output: the same bits as the call
    without gradients, which takes the in-place kernel too."""
    import flashtile.interface as interface

    q, k, v = make_qkv(2, 30, 41, 4, 2, 64, BF16)
    sinks = sinks_for(4)
    plain = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=sinks)
    q_p, k_p, v_p, cu_q, cu_k = packed([30, 7], [41, 12], 4, 2, 64, BF16)
    plain_packed = flashtile.flash_attn_varlen_func(q_p, k_p, v_p, cu_q, cu_k, 30, 41, causal=True,
                                                    return_attn_probs=True, s_aux=sinks)

    def refuse(*args, **kwargs):
        raise AssertionError("the torch ops on the finished output were taken")
    monkeypatch.setattr(interface, "_with_sinks", refuse)
    ss = sinks.clone().requires_grad_(True)
    out, lse, _ = flashtile.flash_attn_func(*(t.clone().requires_grad_(True) for t in (q, k, v)), causal=True,
                                            return_attn_probs=True, s_aux=ss)
    assert torch.equal(out.detach(), plain[0]) and torch.equal(lse.detach(), plain[1])
    out.float().sum().backward()
    assert ss.grad is not None and torch.isfinite(ss.grad).all()
    ss = sinks.clone().requires_grad_(True)
    out, lse, _ = flashtile.flash_attn_varlen_func(q_p, k_p.clone().requires_grad_(True), v_p, cu_q, cu_k, 30, 41,
                                                   causal=True, return_attn_probs=True, s_aux=ss)
    assert torch.equal(out.detach(), plain_packed[0]) and torch.equal(lse.detach(), plain_packed[1])
    (out.float().sum() + lse.sum()).backward()
    assert ss.grad is not None and torch.isfinite(ss.grad).all()


def test_bad_sinks_are_named_before_any_launch():
    q, k, v = make_qkv(1, 8, 8, 4, 2, 32, F16)
    for bad, error, match in [([0.0] * 4, TypeError, "s_aux must be a torch.Tensor"),
                              (torch.zeros(4, dtype=torch.int32), TypeError, "s_aux must be float32"),
                              (torch.zeros(2), ValueError, r"s_aux must have shape \(4,\)"),
                              (torch.zeros(1, 4), ValueError, r"s_aux must have shape \(4,\)")]:
        with pytest.raises(error, match=match):
            flashtile.flash_attn_func(q, k, v, s_aux=bad)
        with pytest.raises(error, match=match):
            flashtile.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32),
                                             torch.tensor([0, 8], dtype=torch.int32), 8, 8, s_aux=bad)
    # the append must not happen when s_aux is wrong
    k_cache, v_cache = torch.zeros(1, 16, 2, 32, dtype=F16), torch.zeros(1, 16, 2, 32, dtype=F16)
    with pytest.raises(ValueError, match="s_aux must have shape"):
        flashtile.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k=k[:, :1], v=v[:, :1], cache_seqlens=3,
                                          s_aux=torch.zeros(3))
    assert not k_cache.any() and not v_cache.any()
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="forward-only"):
        flashtile.flash_attn_func(q8, k8, v8, s_aux=torch.zeros(4, requires_grad=True))


def test_strided_sinks_are_read_as_their_values():
    """A strided (H,) s_aux (a slice of a larger parameter) reaches the kernels, which read sinks[h]
    at offset h, as its values: the calls match the reference with those sinks, and the transformers
    decode plan does not take them."""
    from flashtile.integrations import transformers as integration

    q, k, v = make_qkv(2, 20, 29, 4, 2, 32, BF16)
    sinks = sinks_for(8)[::2]
    assert not sinks.is_contiguous()
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=sinks)
    assert_matches_reference(out, lse, q, k, v, causal=True, sinks=sinks)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 29, 58], dtype=torch.int32)
    packed = flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, 20, 29,
                                              causal=True, s_aux=sinks)
    assert torch.equal(packed.view_as(out), out)
    lengths = torch.tensor([29, 17], dtype=torch.int32)
    step, step_lse = flashtile.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths, num_splits=2,
                                                       s_aux=sinks, return_softmax_lse=True)
    for b, n in enumerate(lengths.tolist()):
        assert_matches_reference(step[b:b + 1], step_lse[b:b + 1], q[b:b + 1, :1], k[b:b + 1, :n], v[b:b + 1, :n],
                                 sinks=sinks)
    query, key = q[:, :1].transpose(1, 2), k.transpose(1, 2)
    module = torch.nn.Module()
    with torch.no_grad():
        assert integration._decode_signature(module, query, key, key, 0.0, 0.2, None, None, {"s_aux": sinks}) is None
        assert integration._decode_signature(module, query, key, key, 0.0, 0.2, None, None,
                                             {"s_aux": sinks.contiguous()}) is not None


def test_compiles_with_fullgraph():
    """Forward and backward with sinks under torch.compile(fullgraph=True): eager's results."""
    q, k, v = make_qkv(2, 20, 20, 4, 2, 32, BF16)
    sinks = sinks_for(4)

    def step(q, k, v, s):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, s_aux=s)
        return out, lse

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        args = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out, lse = fn(*args)
        (out.float().square().sum() + lse.sum()).backward()
        results.append((out.detach(), lse.detach(), *(a.grad for a in args)))
    for eager, compiled in zip(*results):  # the same kernels; the sinks' ops fused or not (float32 sums)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit-epilogue", "split-merge"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_kvcache_takes_the_sinks_inside_the_decode(monkeypatch, page_size, num_splits, dtype):
    """Decode steps: the unsplit kernel's epilogue or the split plan's merge takes the sinks, so the
    output is rounded once (no extra half ulp in the budget) and no launch follows; a sequence
    without keys keeps output 0 and LSE +inf."""
    from flashtile.kernels import decode

    monkeypatch.setattr(decode, "_PLANS", {})
    refuse_after_passes(monkeypatch)
    batch, heads, heads_k, d, capacity = 3, 8, 2, 80, 64
    lengths = torch.tensor([41, 0, 64], dtype=torch.int32)
    k_full = torch.randn(batch, capacity, heads_k, d, dtype=dtype)
    v_full = torch.randn(batch, capacity, heads_k, d, dtype=dtype)
    q = torch.randn(batch, 1, heads, d, dtype=dtype)
    sinks = sinks_for(heads).to(dtype)
    kw = dict(cache_seqlens=lengths, causal=True, num_splits=num_splits, return_softmax_lse=True, s_aux=sinks)
    k_cache, v_cache, table = shuffled_pools(k_full, v_full, page_size)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, **kw)
    prepared = decode.prepare_decode(q, k_cache, v_cache, softmax_scale=d ** -0.5, window_left=-1,
                                     window_right=-1, block_table=table, num_splits=num_splits, sinks=True)
    assert prepared.splits == num_splits and not prepared.sinks_after
    for b in range(batch):
        n = int(lengths[b])
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_full[b:b + 1, :n],
                                 v_full[b:b + 1, :n], causal=True, sinks=sinks.float())
    plain = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                             **dict(kw, s_aux=None, return_softmax_lse=False))
    assert not torch.equal(out[[0, 2]], plain[[0, 2]])  # (the sinks took their share)


@pytest.mark.parametrize("sms", [1, 64], ids=["3-tile-shares", "1-tile-shares"])
def test_kvcache_stream_plans_take_the_sinks_inside(monkeypatch, sms):
    """Stream-K plans (sequences of different lengths; 4 programs an SM): the segments that are a
    whole pair (the 9-key sequence's) fold the sinks into the output they write, the merge into the
    pairs it merges (the 150-key sequence's 5 tiles); no pass follows."""
    from flashtile.kernels import decode

    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(decode, "STREAM_PLANS", True)
    monkeypatch.setattr(decode, "_sm_count", lambda device: sms)  # (the programs' count sets the shares)
    batch, heads, heads_k, d = 3, 4, 2, 64
    lengths = torch.tensor([150, 9, 0], dtype=torch.int32)
    k_cache = torch.randn(batch, 160, heads_k, d, dtype=F16)
    v_cache = torch.randn(batch, 160, heads_k, d, dtype=F16)
    q = torch.randn(batch, 1, heads, d, dtype=F16)
    sinks = 3.0 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in fp16
    prepared = decode.prepare_decode(q, k_cache, v_cache, softmax_scale=d ** -0.5, window_left=-1,
                                     window_right=-1, sinks=True)
    assert prepared.stream is not None and not prepared.sinks_after
    refuse_after_passes(monkeypatch)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True, s_aux=sinks)
    for b in range(batch):
        n = int(lengths[b])
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n],
                                 v_cache[b:b + 1, :n], causal=True, sinks=sinks)


@pytest.mark.parametrize("inside, general", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["after", "epilogue", "general-path-after", "general-path"])
def test_kvcache_chunked_prefill_takes_the_sinks_in_the_gluon_epilogue(monkeypatch, inside, general):
    """flash_attn_with_kvcache's chunked prefill runs the Gluon forward with seqused_k (stood in for
    by float64 attention rounded to bf16, as a CPU runs no Gluon): with SINKS_IN_EPILOGUE its launch,
    on the plan's path or the general one (inputs on another than the current device), gets the
    sinks and nothing follows; without it the sinks are applied to the route's result after it."""
    from flashtile.kernels import decode, gluon_forward, sinks as sinks_module

    heads, heads_k, d = 4, 2, 64
    lengths = torch.tensor([180, 140], dtype=torch.int32)
    q = torch.randn(2, decode.PREFILL_MIN_QUERIES + 2, heads, d, dtype=BF16)
    k_cache, v_cache = torch.randn(2, 200, heads_k, d, dtype=BF16), torch.randn(2, 200, heads_k, d, dtype=BF16)
    sinks = 3.0 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in bf16
    given = []

    def route_result(s):
        parts = [attention(q[b:b + 1].double(), k_cache[b:b + 1, :n].double(), v_cache[b:b + 1, :n].double(),
                           causal=True, sinks=None if s is None else s.double())
                 for b, n in enumerate(lengths.tolist())]
        return torch.cat([o for o, _ in parts]).to(BF16), torch.cat([lse for _, lse in parts]).float()

    def plain_stand_in(q_, k_, v_, scale, causal, seqused_k=None, block_table=None, sinks=None):
        assert causal and torch.equal(seqused_k, lengths)
        given.append(("plain", sinks))
        return None if general else route_result(sinks)

    def general_stand_in(*args, **kwargs):
        given.append(("general", kwargs.get("sinks")))
        return route_result(kwargs.get("sinks"))
    monkeypatch.setattr(decode, "prefill_wanted", lambda *args, **kwargs: True)
    monkeypatch.setattr(decode, "prefill_gathers", lambda *args: False)
    monkeypatch.setattr(gluon_forward, "plain_forward", plain_stand_in)
    monkeypatch.setattr(gluon_forward, "gluon_attention_forward", general_stand_in)
    monkeypatch.setattr(gluon_forward, "SINKS_IN_EPILOGUE", inside)
    want, want_lse = route_result(sinks if inside else None)
    if inside:
        refuse_after_passes(monkeypatch)
    else:
        sinks_module.apply_sinks_(want, want_lse, sinks)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True, s_aux=sinks)
    inside_sinks = sinks if inside else None
    assert given == ([("plain", inside_sinks)] + ([("general", inside_sinks)] if general else []))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for b, n in enumerate(lengths.tolist()):
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                 causal=True, sinks=sinks, rounded_twice=not inside)


def test_kvcache_sinks_gradient_and_compile():
    """Sinks that require grad take the torch formula on the decode's result (a gradient); under
    torch.compile(fullgraph=True) the registered decode op takes them: eager's output."""
    batch, heads, heads_k, d = 2, 4, 2, 32
    lengths = torch.tensor([20, 33], dtype=torch.int32)
    k_cache = torch.randn(batch, 40, heads_k, d, dtype=BF16)
    v_cache = torch.randn(batch, 40, heads_k, d, dtype=BF16)
    q = torch.randn(batch, 1, heads, d, dtype=BF16)
    sinks = sinks_for(heads)

    def step(q, s):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=2,
                                                 return_softmax_lse=True, s_aux=s)

    eager_out, eager_lse = step(q, sinks)
    compiled_out, compiled_lse = torch.compile(step, fullgraph=True)(q, sinks)
    assert torch.equal(compiled_out, eager_out) and torch.equal(compiled_lse, eager_lse)
    s = sinks.clone().requires_grad_(True)
    out, lse = step(q, s)
    lse.sum().backward()
    ref = torch.tensor(0.0, dtype=torch.float64)
    for b in range(batch):  # d lse_i / d s = the sink's probability exp(s - lse_i)
        ref = ref + torch.exp(sinks.double()[:, None] - lse[b].detach().double()).sum(-1)
    ref_lse = torch.stack([attention(q[b:b + 1].double(), k_cache[b:b + 1, :int(lengths[b])].double(),
                                     v_cache[b:b + 1, :int(lengths[b])].double(), sinks=sinks.double())[1][0]
                           for b in range(batch)])
    torch.testing.assert_close(lse.detach().double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.grad.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_out", [False, True], ids=["returned", "vllm-out"])
def test_varlen_decode_route_takes_the_sinks_inside(monkeypatch, with_out):
    """vLLM's decode steps (flash_attn_varlen_func on page pools, seqused_k, s_aux, out=): the decode
    takes the sinks, no pass follows, and the rows are flash_attn_with_kvcache's own bits."""
    heads, heads_k, d, page = 8, 2, 64, 16
    lengths = [37, 64, 5]
    k_full = torch.randn(3, 64, heads_k, d, dtype=BF16)
    v_full = torch.randn(3, 64, heads_k, d, dtype=BF16)
    k_pool, v_pool, table = shuffled_pools(k_full, v_full, page)
    q = torch.randn(3, heads, d, dtype=BF16)
    cu_q = torch.arange(4, dtype=torch.int32)
    seqused = torch.tensor(lengths, dtype=torch.int32)
    sinks = sinks_for(heads)
    want, want_lse = flashtile.flash_attn_with_kvcache(q.unsqueeze(1), k_pool, v_pool, cache_seqlens=seqused,
                                                       block_table=table, causal=True, return_softmax_lse=True,
                                                       s_aux=sinks)
    refuse_after_passes(monkeypatch)
    out = nan_like(q) if with_out else None
    got, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 1, 64, causal=True,
                                                   block_table=table, seqused_k=seqused, s_aux=sinks,
                                                   return_attn_probs=True, out=out)
    assert torch.equal(got, want[:, 0]) and torch.equal(lse, want_lse[:, :, 0].t())
    if with_out:
        assert torch.equal(out, want[:, 0])
    for b, n in enumerate(lengths):
        assert_matches_reference(got[b:b + 1].unsqueeze(0), lse[:, b:b + 1].unsqueeze(0), q[b:b + 1].unsqueeze(0),
                                 k_full[b:b + 1, :n], v_full[b:b + 1, :n], causal=True, sinks=sinks)


def test_mixed_batch_takes_the_sinks_in_both_parts(monkeypatch):
    """vLLM's chunked prefill (query chunks among decode steps on page pools): the prefill kernel and
    the decode each take the sinks in their epilogues, no pass follows; every sequence against
    float64 with no extra rounding in the budget."""
    from flashtile import interface

    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)  # the 40-query chunk to the prefill
    mixed = []
    real_mixed = interface._mixed_batch
    monkeypatch.setattr(interface, "_mixed_batch", lambda *a, **k: mixed.append(k["sinks"]) or real_mixed(*a, **k))
    heads, heads_k, d, capacity = 6, 2, 64, 96
    lengths_q, lengths_k = [1, 40, 3, 1, 1], [30, 90, 5, 0, 64]
    k_full = torch.randn(5, capacity, heads_k, d, dtype=BF16)
    v_full = torch.randn(5, capacity, heads_k, d, dtype=BF16)
    k_pool, v_pool, table = shuffled_pools(k_full, v_full, 16)
    q = torch.randn(sum(lengths_q), heads, d, dtype=BF16)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    sinks = 3.0 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in bf16
    refuse_after_passes(monkeypatch)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 40, capacity, block_table=table,
                                                   seqused_k=torch.tensor(lengths_k, dtype=torch.int32),
                                                   causal=True, s_aux=sinks, return_attn_probs=True)
    assert len(mixed) == 1 and mixed[0] is sinks
    for b, n in enumerate(lengths_k):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert_matches_reference(out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0), q[rq].unsqueeze(0),
                                 k_full[b:b + 1, :n], v_full[b:b + 1, :n], causal=True, sinks=sinks)


@pytest.mark.parametrize("lens_q", [[1, 3, 1, 2], [1, 40, 3, 1]], ids=["decode-steps", "mixed-batch"])
def test_e4m3_varlen_on_pools_takes_the_sinks_in_the_kernels(monkeypatch, lens_q):
    """vLLM's FP8 KV cache on FlashAttention-3's call (e4m3 q, k, v page pools, per-sequence
    descales, seqused_k): the decode launches and a mixed batch's prefill part take the sinks, no pass
    follows; each sequence against float64 attention with the sinks on its dequantized inputs."""
    from flashtile import interface
    from test_fp8 import _packed_e4m3
    from test_varlen import paged_copy

    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)  # the 40-query chunk to the prefill
    heads, heads_k, d = 6, 2, 32
    lens_k = [70, 50, 9, 33]
    cu_q, cu_k, tensors, descales, _ = _packed_e4m3(lens_q, lens_k, heads, heads_k, d)
    k_pool, v_pool, table = paged_copy(tensors[1].float(), tensors[2].float(), cu_k, 16, fill=float("nan"))
    sinks = 4.0 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in bf16
    refuse_after_passes(monkeypatch)
    out, lse, _ = flashtile.flash_attn_varlen_func(
        tensors[0], k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn), cu_q, None, max(lens_q),
        max(lens_k), block_table=table, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
        seqused_k=cu_k[1:] - cu_k[:-1], causal=True, return_attn_probs=True, s_aux=sinks)
    assert_packed_e4m3_matches(out, lse, tensors, descales, cu_q, cu_k, sinks)


@pytest.mark.parametrize("by_sequence", [True, False], ids=["per-sequence", "block-descale"])
def test_e4m3_packed_sequences_take_the_sinks_in_the_kernel(monkeypatch, by_sequence):
    """FlashAttention-3's e4m3 call on packed keys (flash_attn_varlen_func, per-sequence descales),
    through both portable e4m3 modes: the prefill kernel takes the sinks, no pass follows; each
    sequence against float64 attention with the sinks on its dequantized inputs."""
    from flashtile.kernels import forward
    from test_fp8 import _packed_e4m3

    monkeypatch.setattr(forward, "VARLEN_FP8_BY_SEQUENCE", by_sequence)
    heads, heads_k, d = 4, 2, 32
    lens_q, lens_k = [5, 33, 1, 20], [9, 33, 17, 3]
    cu_q, cu_k, tensors, descales, _ = _packed_e4m3(lens_q, lens_k, heads, heads_k, d)
    sinks = 2.0 + torch.randn(heads)  # near the rows' LSE: each takes a share that shows in bf16
    refuse_after_passes(monkeypatch)
    out, lse, _ = flashtile.flash_attn_varlen_func(*tensors, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                   q_descale=descales[0], k_descale=descales[1],
                                                   v_descale=descales[2], return_attn_probs=True, s_aux=sinks)
    assert_packed_e4m3_matches(out, lse, tensors, descales, cu_q, cu_k, sinks)


def test_sinks_cost_script_checks_its_points(tmp_path, capsys):
    """benchmarks/sinks_cost.py (the H200's check and timing of the sinks, after the kernel and in its
    epilogue) runs its float64 checks through the interpreter: every point within the rule."""
    import importlib.util
    from pathlib import Path

    from flashtile.kernels import gluon_forward
    before = gluon_forward.SINKS_IN_EPILOGUE
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sinks_cost.py"
    spec = importlib.util.spec_from_file_location("sinks_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke", "--check-only", "--kinds", "prefill,varlen,decode,prefill-e4m3,chunked,window",
                        "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check ")]
    assert len(lines) == 8  # two decode points, a prefill, packed keys, 16-key pools, e4m3, a chunk, a window
    assert gluon_forward.SINKS_IN_EPILOGUE == before  # (the script restores the switch)
