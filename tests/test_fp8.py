"""FP8 quantization helpers: the Walsh-Hadamard rotation (against the explicit matrix, and scores
unchanged), per-block scales, the e4m3 round trip, and incoherent processing taming outliers."""

from __future__ import annotations

import pytest
import torch

from flashtile import fp8


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_rotation_is_the_hadamard_matrix_times_signs(head_dim):
    x = torch.randn(2, 77, 3, head_dim)
    signs = fp8.random_signs(head_dim, seed=head_dim, device="cpu")
    got = fp8.rotate(x, signs, block=32)
    expected = (x * signs) @ fp8.hadamard_matrix(head_dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_rotation_leaves_scores_unchanged():
    q, k = torch.randn(1, 50, 2, 128), torch.randn(1, 60, 2, 128)
    signs = fp8.random_signs(128, seed=7, device="cpu")
    qr, kr = fp8.rotate(q, signs), fp8.rotate(k, signs)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    rotated = torch.einsum("bqhd,bkhd->bhqk", qr, kr)
    torch.testing.assert_close(rotated, scores, atol=1e-4, rtol=1e-4)
    h = fp8.hadamard_matrix(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("hadamard", [False, True])
def test_round_trip_within_e4m3_precision(hadamard):
    q = torch.randn(2, 100, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 90, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 90, 2, 64, dtype=torch.bfloat16)
    z = fp8.quantize_qkv(q, k, v, block=(32, 16), hadamard=hadamard, seed=3)
    assert z.q.dtype == z.k.dtype == z.v.dtype == torch.float8_e4m3fn
    assert z.q_descale.shape == (2, 4, 4) and z.k_descale.shape == (2, 2, 6) == z.v_descale.shape
    assert (z.signs is not None) == hadamard
    signs = z.signs if hadamard else torch.ones(64)
    for x8, descale, block, original, rotated in ((z.q, z.q_descale, 32, q, hadamard),
                                                  (z.k, z.k_descale, 16, k, hadamard),
                                                  (z.v, z.v_descale, 16, v, False)):
        target = fp8.rotate(original.float(), signs) if rotated else original.float()
        back = fp8.dequantize(x8, descale, block)
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4); below 2^-6 the subnormal spacing 2^-9
        per_row = descale.repeat_interleave(block, dim=2)[:, :, :x8.shape[1]].transpose(1, 2).unsqueeze(-1)
        bound = 2.0 ** -4 * target.abs() + 2.0 ** -10 * per_row + 1e-7
        assert ((back - target).abs() <= bound).all()
        top = x8.float().abs().amax(dim=-1).amax(dim=1)  # each (batch, head)'s largest magnitude
        if x8 is z.v:  # power-of-two descales: the largest lands in the top binade, (224, 448]
            assert ((top > fp8.E4M3_MAX / 2) & (top <= fp8.E4M3_MAX)).all()
        else:  # the largest lands on the top of the e4m3 range
            assert torch.isclose(top, torch.tensor(fp8.E4M3_MAX)).any()


def test_v_block_descales_are_powers_of_two_so_the_kernels_p_stays_exact():
    # The e4m3 kernels fold each V block's descale, relative to the largest (times P_SHIFT), into P
    # before P's cast to e4m3. Powers of two keep P's largest entries (1.0 times that) exact: with
    # 0.6 the largest rounded to 0.625, and a row ruled by one key of a V block holding an outlier
    # was off by 4% of that key's value (fuzz-gpu-h200-20261202-seed10-fp8-before.json).
    from flashtile.kernels.forward import P_SHIFT, fp8_kernel_descales
    q = torch.randn(2, 64, 4, 64)
    k = torch.randn(2, 96, 2, 64)
    v = torch.randn(2, 96, 2, 64) * torch.rand(1, 96, 1, 1) * 5
    # an outlier in one block: its descale (4) is 2^5 or more over any block whose largest |v| is under 56
    # (~25 at most here); with 300 (descale 1) blocks whose largest was over 14 had 2^-4, 1 call in 200
    v[0, 40, 1, 7] = 1000.0
    z = fp8.quantize_qkv(q, k, v, block=(32, 16), hadamard=False)
    mantissa, _ = torch.frexp(z.v_descale)
    assert (mantissa == 0.5).all()
    # each block's largest magnitude in (E4M3_MAX / 2, E4M3_MAX] before rounding, [224, 448] after
    top = z.v.float().abs().unflatten(1, (6, 16)).amax(dim=(2, 4))  # (B, blocks, Hk)
    assert ((top >= fp8.E4M3_MAX / 2) & (top <= fp8.E4M3_MAX)).all()
    _, _, v_kernel = fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale)
    relative, largest = v_kernel[..., :-1], v_kernel[..., -1:]
    assert (relative <= P_SHIFT).all() and (relative > 0).all()
    assert torch.equal(relative.to(torch.float8_e4m3fn).float(), relative)  # 1.0 x relative is exact
    assert torch.equal(relative * largest, z.v_descale)
    assert relative[0, 1].min() < P_SHIFT / 16  # the outlier's block is far above the others


def test_an_outlier_only_moves_its_own_block_scale():
    k = torch.randn(1, 64, 1, 64)
    spiked = k.clone()
    spiked[0, 3, 0, 5] = 1000.0
    plain = fp8.quantize_qkv(k, k, k, block=(16, 16), hadamard=False)
    hit = fp8.quantize_qkv(spiked, spiked, spiked, block=(16, 16), hadamard=False)
    assert hit.k_descale[0, 0, 0] > 10 * plain.k_descale[0, 0, 0]
    torch.testing.assert_close(hit.k_descale[0, 0, 1:], plain.k_descale[0, 0, 1:])


def test_hadamard_tames_outliers():
    """FlashAttention-3's experiment in miniature, with attention in float64 on the dequantized
    tensors: N(0, 1) entries plus N(0, 100) on 0.1% of them. Output RMSE: per-(batch, head) scales
    > block scales, and the rotation improves on either."""
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        x = torch.randn(*shape, generator=gen)
        spikes = torch.rand(*shape, generator=gen) < 0.001
        return x + spikes * 10.0 * torch.randn(*shape, generator=gen)

    def attention(q, k, v):
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())

    q, k, v = (draw(1, 512, 4, 128) for _ in range(3))
    exact = attention(q, k, v)
    rmse = {}
    for block in (512, 64):  # 512: one scale per (batch, head) here
        for hadamard in (False, True):
            z = fp8.quantize_qkv(q, k, v, block=(block, block), hadamard=hadamard, seed=1)
            out = attention(*(fp8.dequantize(x, d, block) for x, d in
                              ((z.q, z.q_descale), (z.k, z.k_descale), (z.v, z.v_descale))))
            rmse[(block, hadamard)] = (out - exact).pow(2).mean().sqrt().item()
    assert rmse[(64, False)] < rmse[(512, False)], rmse
    assert rmse[(512, True)] < 0.8 * rmse[(512, False)], rmse
    assert rmse[(64, True)] < 0.8 * rmse[(64, False)], rmse


def test_bad_input_is_named():
    x = torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        fp8.quantize_qkv(x, x, x)
    with pytest.raises(TypeError, match="q must be"):
        y = torch.randn(1, 8, 2, 64).to(torch.float8_e4m3fn)
        fp8.quantize_qkv(y, y, y)
    with pytest.raises(ValueError, match="block must be a power of two"):
        fp8.quantize_qkv(torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64),
                         block=(48, 64))
    q, k = torch.randn(1, 8, 4, 64), torch.randn(1, 10, 2, 64)
    with pytest.raises(TypeError, match="block must be a pair of ints"):
        fp8.quantize_qkv(q, k, k, block=128)
    with pytest.raises(ValueError, match="k and v in shape"):
        fp8.quantize_qkv(q, k, k[:, :9])
    with pytest.raises(ValueError, match="must agree in B and D"):
        fp8.quantize_qkv(torch.randn(1, 8, 4, 32), k, k)
    with pytest.raises(ValueError, match="multiple of k's 2"):
        fp8.quantize_qkv(torch.randn(1, 8, 3, 64), k, k)
    with pytest.raises(TypeError, match="seed must be an int"):
        fp8.quantize_qkv(q, k, k, seed="1")


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("causal,heads,heads_k,seqlen_q,seqlen_k",
                         [(True, 4, 2, 70, 90), (False, 4, 4, 64, 64), (True, 2, 1, 33, 33)])
def test_fp8_kernel_matches_attention_on_the_dequantized_inputs(hadamard, causal, heads, heads_k,
                                                               seqlen_q, seqlen_k):
    """Through the interpreter P stays fp32 (its fp32 -> fp8 cast is wrong), so this checks the
    scale bookkeeping: per-query-block descale folded into the score scale, K's and V's per tile."""
    from flashtile.reference import attention as textbook
    q = torch.randn(2, seqlen_q, heads, 64, dtype=torch.bfloat16)
    k = torch.randn(2, seqlen_k, heads_k, 64, dtype=torch.bfloat16)
    v = torch.randn(2, seqlen_k, heads_k, 64, dtype=torch.bfloat16)
    k[:, 5:9] *= 20  # one key block far larger than the others: per-block scales must be honoured
    z = fp8.quantize_qkv(q, k, v, block=(32, 64), hadamard=hadamard, seed=5)
    out, lse = fp8.attention(z, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    dq, dk, dv = (fp8.dequantize(t, d, b).double() for t, d, b in
                  ((z.q, z.q_descale, 32), (z.k, z.k_descale, 64), (z.v, z.v_descale, 64)))
    ref, ref_lse = textbook(dq, dk, dv, causal=causal)
    # The project's rule, with bf16 (the output dtype) as the input dtype of the textbook attention.
    low, _ = textbook(dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16), causal=causal)
    err = (out.double() - ref).abs().max().item()
    budget = 2 * (low.double() - ref).abs().max().item()
    assert err <= budget, f"max error {err:.3g} > 2x textbook bf16 error ({budget:.3g})"
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_fp8_scale_blocks_must_be_whole_tiles():
    q = torch.randn(1, 64, 2, 64)
    z = fp8.quantize_qkv(q, q, q, block=(16, 16))
    with pytest.raises(ValueError, match="multiples of the kernel's tiles"):
        fp8.attention(z)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_takes_fp8_with_per_head_descales(causal):
    """FlashAttention-3's calling convention: e4m3 q, k, v and float32 descales (B, Hk)."""
    import flashtile
    from flashtile.reference import attention as textbook
    q = torch.randn(2, 40, 4, 32) * 3
    k, v = torch.randn(2, 50, 2, 32), torch.randn(2, 50, 2, 32) * 0.5
    descales = []
    tensors = []
    for x in (q, k, v):  # one scale per (batch, KV head); query heads share their KV head's scale
        grouped = x.unflatten(2, (2, -1))
        d = grouped.abs().amax(dim=(1, 3, 4)) / fp8.E4M3_MAX
        tensors.append((grouped / d[:, None, :, None, None]).flatten(2, 3).to(torch.float8_e4m3fn))
        descales.append(d.float())
    out, lse, _ = flashtile.flash_attn_func(*tensors, causal=causal, q_descale=descales[0],
                                            k_descale=descales[1], v_descale=descales[2],
                                            return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    deq = [(t.float().unflatten(2, (2, -1)) * d[:, None, :, None, None]).flatten(2, 3).double()
           for t, d in zip(tensors, descales)]
    ref, ref_lse = textbook(*deq, causal=causal)
    low, _ = textbook(*(t.to(torch.bfloat16) for t in deq), causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (low.double() - ref).abs().max().item()
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def _quantize_per_sequence(raw, cus, heads_k):
    """e4m3 packed tensors (total, H, D) with one descale per (sequence, KV head), as
    FlashAttention-3 takes them: (tensors, descales (B, Hk))."""
    tensors, descales = [], []
    for x, cu in zip(raw, cus):
        grouped = x.unflatten(1, (heads_k, -1))  # (total, Hk, group, D)
        d_seq = torch.stack([grouped[a:b].abs().amax(dim=(0, 2, 3)) if b > a else
                             torch.ones(heads_k) for a, b in zip(cu[:-1], cu[1:])])
        d_seq = d_seq.clamp_min(1e-6) / fp8.E4M3_MAX  # (B, Hk)
        rows = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
        tensors.append((grouped / d_seq[rows][:, :, None, None]).flatten(1, 2).to(torch.float8_e4m3fn))
        descales.append(d_seq.float())
    return tensors, descales


def _packed_e4m3(lens_q, lens_k, heads, heads_k, d):
    """Fresh packed sequences quantized per sequence: (cu_q, cu_k, tensors, descales, q's shape)."""
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    raw = [torch.randn(sum(lens_q), heads, d) * 2, torch.randn(sum(lens_k), heads_k, d),
           torch.randn(sum(lens_k), heads_k, d) * 0.5]
    tensors, descales = _quantize_per_sequence(raw, (cu_q, cu_k, cu_k), heads_k)
    return cu_q, cu_k, tensors, descales, raw[0].shape


def _check_per_sequence(out, lse, tensors, descales, cu_q, cu_k, heads_k, **kw):
    """Each packed sequence against the float64 reference on its own dequantized inputs: error
    within 2x textbook bf16's, LSE within 1e-4 where the row sees a key."""
    from flashtile.reference import attention as textbook
    for b in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if sq.stop == sq.start:
            continue
        deq = [(t[s].float().unflatten(1, (heads_k, -1)) * dd[b][None, :, None, None]).flatten(1, 2)
               .unsqueeze(0).double() for t, s, dd in zip(tensors, (sq, sk, sk), descales)]
        ref, ref_lse = textbook(*deq, **kw)
        low, _ = textbook(*(t.to(torch.bfloat16) for t in deq), **kw)
        err = (out[sq].double() - ref[0]).abs().max().item()
        assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-6, f"sequence {b}: {err}"
        seen = torch.isfinite(ref_lse[0])
        assert torch.isinf(lse[:, sq][~seen]).all() and (out[sq].transpose(0, 1)[~seen] == 0).all()
        torch.testing.assert_close(lse[:, sq].double()[seen], ref_lse[0][seen], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("by_sequence", [True, False], ids=["per-sequence", "block-descale"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_takes_fp8_with_per_sequence_descales(causal, by_sequence, monkeypatch, nan_empty):
    """flash_attn_varlen_func on e4m3 packed sequences: each sequence against the reference on its own
    dequantized inputs (descales per sequence and KV head), through the per-sequence kernel and the
    block-descale one (V^T packed from 16-key boundaries)."""
    import flashtile
    from flashtile.kernels import forward
    monkeypatch.setattr(forward, "VARLEN_FP8_BY_SEQUENCE", by_sequence)
    lens_q, lens_k, heads, heads_k = [5, 33, 1, 20], [9, 33, 17, 3], 4, 2
    cu_q, cu_k, tensors, descales, shape = _packed_e4m3(lens_q, lens_k, heads, heads_k, 32)
    out, lse, _ = flashtile.flash_attn_varlen_func(
        *tensors, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, q_descale=descales[0],
        k_descale=descales[1], v_descale=descales[2], return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == shape and lse.shape == (heads, sum(lens_q))
    _check_per_sequence(out, lse, tensors, descales, cu_q, cu_k, heads_k, causal=causal)


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(10, 5), softcap=4.0)],
                         ids=["causal", "window-softcap"])
def test_varlen_fp8_on_page_pools(page_size, kw, nan_empty):
    """e4m3 q with e4m3 page pools through block_table (vLLM's FP8 KV cache on FlashAttention-3):
    per-sequence descales, pages scattered, the pools' unused slots NaN."""
    _e4m3_pools_match_reference([3, 40, 1, 0, 7], [70, 40, 130, 5, 0], 40, page_size, kw)


def _e4m3_pools_match_reference(lens_q, lens_k, head_dim, page_size, kw, heads=6, heads_k=2, seqused=False):
    """flash_attn_varlen_func on fresh e4m3 sequences on shuffled pools (unused slots NaN), each
    sequence against the reference on its dequantized inputs; with ``seqused`` the key counts come
    as seqused_k and cu_seqlens_k is None (vLLM's call)."""
    import flashtile
    from test_varlen import paged_copy
    cu_q, cu_k, tensors, descales, shape = _packed_e4m3(lens_q, lens_k, heads, heads_k, head_dim)
    k_pool, v_pool, table = paged_copy(tensors[1].float(), tensors[2].float(), cu_k, page_size,
                                       fill=float("nan"))
    out, lse, _ = flashtile.flash_attn_varlen_func(
        tensors[0], k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn), cu_q, None if seqused else cu_k,
        max(lens_q), max(lens_k), block_table=table, q_descale=descales[0], k_descale=descales[1],
        v_descale=descales[2], return_attn_probs=True, seqused_k=(cu_k[1:] - cu_k[:-1]) if seqused else None,
        **kw)
    assert out.dtype == torch.bfloat16 and out.shape == shape
    _check_per_sequence(out, lse, tensors, descales, cu_q, cu_k, heads_k, **kw)
    return descales


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 1), softcap=4.0)],
                         ids=["causal", "window-softcap"])
def test_varlen_fp8_decode_steps_on_page_pools(page_size, kw, monkeypatch, nan_empty):
    """A decode step through flash_attn_varlen_func on e4m3 pools (at most VARLEN_DECODE_MAX_QUERIES
    queries a sequence) runs the all-e4m3 decode of flash_attn_with_kvcache with the per-sequence
    descales; each sequence against the reference on its dequantized inputs."""
    from flashtile import interface
    calls = []
    real = interface.ops.kvcache
    monkeypatch.setattr(interface.ops, "kvcache", lambda *a, **k: calls.append(k) or real(*a, **k))
    descales = _e4m3_pools_match_reference([1, 2, 0, 1], [70, 5, 9, 0], 32, page_size, kw)
    assert len(calls) == 1 and calls[0]["seq_descales"] and calls[0]["q_descale"] is descales[0]


@pytest.mark.parametrize("lens_q", [[1, 2, 0, 1], [19, 2, 0, 1]], ids=["decode-route", "prefill-route"])
def test_varlen_fp8_page_pools_with_seqused_k(lens_q, nan_empty):
    """vLLM's FP8 KV cache call: e4m3 pools, seqused_k for the key counts, no cu_seqlens_k."""
    _e4m3_pools_match_reference(lens_q, [70, 5, 9, 0], 32, 16, dict(causal=True), seqused=True)


def test_varlen_fp8_mixed_batches_split(monkeypatch, nan_empty):
    """e4m3 pools, a mixed batch (long chunks among decode steps): the prefill kernel takes the
    chunks, the all-e4m3 decode the steps; each sequence against the reference."""
    from flashtile import interface
    calls = []
    real = interface.ops.kvcache
    monkeypatch.setattr(interface.ops, "kvcache", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    _e4m3_pools_match_reference([1, 40, 0, 2, 1, 9, 17, 1], [70, 50, 9, 3, 0, 30, 20, 5], 32, 16,
                                dict(causal=True), seqused=True)
    # (e4m3 caches: the 9-query step in a launch of VARLEN_DECODE_MAX_QUERIES rows, the others in one
    # of MIXED_FIRST_ROWS // group)
    assert calls == [(8, interface.VARLEN_DECODE_MAX_QUERIES, 6, 32), (8, interface.MIXED_FIRST_ROWS // 3, 6, 32)]


def test_varlen_fp8_mixed_batches_bound_the_sequences_with_keys(monkeypatch, nan_empty):
    """The split's e4m3 prefill part says how many sequences can have keys there (the long ones,
    more than VARLEN_DECODE_MAX_QUERIES queries each: total_q // 17), which sizes the pools' gathers
    for the Gluon kernel; flash_attn_varlen_func's own calls say nothing (0)."""
    from flashtile import interface
    bounds = []
    real = interface.ops.fp8_forward
    monkeypatch.setattr(interface.ops, "fp8_forward",
                        lambda *a, **k: bounds.append(k.get("keyed_sequences", 0)) or real(*a, **k))
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    lens_q = [1, 40, 0, 2, 1, 1, 17, 1]
    _e4m3_pools_match_reference(lens_q, [70, 50, 9, 3, 0, 30, 20, 5], 32, 16, dict(causal=True))
    _e4m3_pools_match_reference([40, 17], [50, 20], 32, 16, dict(causal=True))
    assert bounds == [sum(lens_q) // (interface.VARLEN_DECODE_MAX_QUERIES + 1), 0]


@pytest.mark.parametrize("keyed", [1, 2, 9])
def test_paged_keys_packed_rows_for_the_sequences_with_keys(monkeypatch, keyed):
    """keyed_sequences: room for that many sequences' keys (S x L rows, V^T for them), the same bytes
    where the others have none; at or above the batch, every sequence's room (as 0)."""
    from flashtile.kernels.forward import _gather_fits, paged_keys_packed
    lens, longest, page, heads, d = [0, 33, 0, 0, 40, 0], 40, 8, 2, 16
    batch, width = len(lens), 5
    k = torch.randn(batch * width, page, heads, d).to(torch.float8_e4m3fn)
    v = torch.randn(batch * width, page, heads, d).to(torch.float8_e4m3fn)
    table = torch.randperm(batch * width, dtype=torch.int32).reshape(batch, width)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    _poison_e4m3_empty(monkeypatch)
    full_rows, full_vt = paged_keys_packed(k, v, table, cu, longest)
    rows, vt = paged_keys_packed(k, v, table, cu, longest, keyed)
    monkeypatch.undo()
    sequences = keyed if keyed < batch else batch
    assert rows.shape == (sequences * longest, heads, d) and full_rows.shape == (batch * longest, heads, d)
    stored = sum(lens) if keyed >= 2 else lens[1]  # keyed = 1: room for one (the next is clamped in)
    assert torch.equal(rows[:stored].view(torch.uint8), full_rows[:stored].view(torch.uint8))
    if keyed >= 2:
        columns = min(vt.shape[1], full_vt.shape[1])
        assert torch.equal(vt[0, :columns].view(torch.uint8), full_vt[0, :columns].view(torch.uint8))
    from flashtile.kernels import forward
    monkeypatch.setattr(forward, "FP8_GATHER_BYTES", 3 * 2 * longest * heads * d)  # room for two sequences
    assert not _gather_fits(k, table, longest) and _gather_fits(k, table, longest, 2)
    assert _gather_fits(k, table, longest, 1) and not _gather_fits(k, table, longest, 3)


def test_varlen_fp8_page_pools_are_checked():
    import flashtile
    from test_varlen import paged_copy
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    q = torch.randn(50, 4, 32).to(torch.float8_e4m3fn)
    k_pool, v_pool, table = paged_copy(torch.randn(50, 2, 32), torch.randn(50, 2, 32), cu, 8)
    k_pool, v_pool = k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn)
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30, max_seqlen_k=30, block_table=table)
    with pytest.raises(TypeError, match="v must be float8_e4m3fn"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool.to(torch.bfloat16), **call)
    with pytest.raises(ValueError, match="block_table entries must be in"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, **{**call, "block_table": table + 100})
    with pytest.raises(ValueError, match="block_table must have shape"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, **{**call, "block_table": table[:1]})
    with pytest.raises(ValueError, match="holds only"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, **{**call, "block_table": table[:, :1]})
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, **call, k_descale=torch.ones(3, 2))
    with pytest.raises(ValueError, match="head dim"):
        flashtile.flash_attn_varlen_func(q[..., :16], k_pool, v_pool, **call)


def test_fp8_arguments_are_checked():
    import flashtile
    x = torch.randn(1, 8, 2, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flashtile.flash_attn_func(x, x, x, k_descale=torch.ones(3, 2))
    with pytest.raises(TypeError, match="k must be float8_e4m3fn"):
        flashtile.flash_attn_func(x, torch.randn(1, 8, 2, 32, dtype=torch.bfloat16), x)
    with pytest.raises(NotImplementedError, match="dropout"):
        flashtile.flash_attn_func(x, x, x, dropout_p=0.1)
    y = torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs only"):
        flashtile.flash_attn_func(y, y, y, q_descale=torch.ones(1, 2))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs only"):
        flashtile.flash_attn_varlen_func(y[0], y[0], y[0], cu, cu, 8, 8, v_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flashtile.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, k_descale=torch.ones(2, 2))


def test_accuracy_study_runs_every_method():
    """`flashtile bench fp8-accuracy` on a small problem: every method produces a finite RMSE, bf16
    beats every FP8 method, and the table names each."""
    from flashtile.bench import fp8_accuracy
    gen = torch.Generator().manual_seed(3)
    q, k, v = (fp8_accuracy.draw((1, 64, 2, 64), gen, "cpu") for _ in range(3))
    results = fp8_accuracy.run_methods(q, k, v, causal=True)
    assert set(results) == set(fp8_accuracy.METHODS)
    assert all(0 < r < 0.1 for r in results.values()), results
    assert results["bf16"] < min(r for name, r in results.items() if name != "bf16")
    table = fp8_accuracy.format_table(results, "t")
    assert all(name in table for name in fp8_accuracy.METHODS)


# ----------------------------------------------------------------------------- FP8 KV cache (decode)

def _quantize_per_key(x):
    """(B, S, Hk, D) -> e4m3 tensor and float32 descales (B, S, Hk), one per key and KV head, written
    out here rather than through fp8.quantize_per_key, which the call under test uses for appends."""
    amax = x.float().abs().amax(-1)
    d = torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax))
    return (x.float() / d[..., None]).to(torch.float8_e4m3fn), d


def test_quantize_per_key_round_trips_and_saturates():
    x = torch.randn(2, 9, 3, 32) * torch.logspace(-3, 3, 9)[None, :, None, None]
    x8, d = fp8.quantize_per_key(x)
    assert x8.dtype == torch.float8_e4m3fn and d.shape == (2, 9, 3)
    assert torch.equal(x8.float().abs().amax(-1), torch.full_like(d, fp8.E4M3_MAX))  # rows use the range
    back = x8.float() * d[..., None]
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative); subnormals step by 2^-9 (times the descale)
    assert ((back - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * d[..., None]).all()
    fixed, same = fp8.quantize_per_key(x, torch.full((2, 9, 3), 1e-3))
    assert torch.equal(same, torch.full((2, 9, 3), 1e-3))
    assert fixed.float().abs().max() == fp8.E4M3_MAX  # large rows saturate, never NaN


def _check_decode(out, q, k_deq, v_deq, lengths, causal, dtype=None, softcap=0.0):
    """out (B, Sq, H, D) against float64 attention on each row's first lengths[b] dequantized keys,
    within 2x the error of the same attention in ``dtype`` (default q's)."""
    from flashtile.reference import attention as textbook
    dtype = dtype or q.dtype
    for b, n in enumerate(lengths):
        args = (q[b:b + 1].double(), k_deq[b:b + 1, :n].double(), v_deq[b:b + 1, :n].double())
        ref, _ = textbook(*args, causal=causal, softcap=softcap)
        low, _ = textbook(*(t.to(dtype) for t in args), causal=causal, softcap=softcap)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-6, f"row {b}: {err}"


def _fp8_pages(k8, v8, kd, vd, paged, fill=float("nan")):
    """An e4m3 cache (B, S, Hk, D) with per-key descales (B, S, Hk) as page pools of ``paged`` keys
    in a shuffled order, the descales through the same block table (slots past the cache ``fill``):
    (pool_k, pool_v, pool_kd, pool_vd, block_table)."""
    from flashtile.bench.decode import paginate
    cap = k8.shape[1]
    pool_k, pool_v, table = paginate(k8.view(torch.uint8), v8.view(torch.uint8), paged)
    pool_kd = torch.full(pool_k.shape[:3], fill)
    pool_vd = torch.full(pool_k.shape[:3], fill)
    for b in range(k8.shape[0]):
        for j in range(table.shape[1]):
            rows = slice(j * paged, min((j + 1) * paged, cap))
            pool_kd[table[b, j], :rows.stop - rows.start] = kd[b, rows]
            pool_vd[table[b, j], :rows.stop - rows.start] = vd[b, rows]
    return pool_k.view(torch.float8_e4m3fn), pool_v.view(torch.float8_e4m3fn), pool_kd, pool_vd, table


def _fp8_cache_call(q, k8, v8, kd, vd, paged, **kw):
    """flash_attn_with_kvcache on an e4m3 cache with per-key descales, contiguous or (``paged``)
    as page pools through a block table (_fp8_pages; slots past the cache NaN: never read)."""
    import flashtile
    if not paged:
        return flashtile.flash_attn_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd, **kw)
    pool_k, pool_v, pool_kd, pool_vd, table = _fp8_pages(k8, v8, kd, vd, paged)
    return flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table, k_descale=pool_kd,
                                             v_descale=pool_vd, **kw)


@pytest.mark.parametrize("paged", [None, 1, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_fp8_cache_with_per_key_descales(paged, splits, seqlen_q):
    batch, cap, heads, heads_k, d = 3, 70, 8, 2, 64
    lengths = [70, 1, 37]
    q = torch.randn(batch, seqlen_q, heads, d, dtype=torch.bfloat16)
    k, v = torch.randn(batch, cap, heads_k, d) * 3, torch.randn(batch, cap, heads_k, d)
    k[0, 5] *= 40  # an outlier token only moves its own descale
    (k8, kd), (v8, vd) = _quantize_per_key(k), _quantize_per_key(v)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, causal=True, num_splits=splits)
    out = _fp8_cache_call(q, k8, v8, kd, vd, paged, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    _check_decode(out, q, k8.float() * kd[..., None], v8.float() * vd[..., None], lengths, True)


@pytest.mark.parametrize("paged", [None, 16])
def test_fp8_cache_append_quantizes_each_new_token(paged):
    import flashtile
    batch, cap, heads, heads_k, d = 2, 48, 4, 1, 32
    lengths = [20, 45]
    q = torch.randn(batch, 3, heads, d, dtype=torch.bfloat16)
    k, v = torch.randn(batch, cap, heads_k, d), torch.randn(batch, cap, heads_k, d)
    (k8, kd), (v8, vd) = _quantize_per_key(k), _quantize_per_key(v)
    k_new = torch.randn(batch, 3, heads_k, d, dtype=torch.bfloat16) * 5
    v_new = torch.randn(batch, 3, heads_k, d, dtype=torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if paged:
        pool_k, pool_v, pool_kd, pool_vd, table = _fp8_pages(k8, v8, kd, vd, paged, fill=0.0)
        out = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=seqlens,
                                                block_table=table, k_descale=pool_kd, v_descale=pool_vd,
                                                causal=True)
        got_k = torch.stack([pool_k[table[b].long()].reshape(-1, heads_k, d)[:cap] for b in range(batch)])
        got_kd = torch.stack([pool_kd[table[b].long()].reshape(-1, heads_k)[:cap] for b in range(batch)])
    else:
        out = flashtile.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=seqlens,
                                                k_descale=kd, v_descale=vd, causal=True)
        got_k, got_kd = k8, kd
    want_k, want_kd = _quantize_per_key(k_new)
    for b, n in enumerate(lengths):
        assert torch.equal(got_k[b, n:n + 3].view(torch.uint8), want_k[b].view(torch.uint8))
        torch.testing.assert_close(got_kd[b, n:n + 3], want_kd[b], rtol=0, atol=0)
    # The attention saw the new tokens, dequantized: rebuild the expected cache.
    (vn8, vnd) = _quantize_per_key(v_new)
    k_deq, v_deq = k8.float() * kd[..., None], v8.float() * vd[..., None]
    for b, n in enumerate(lengths):
        k_deq[b, n:n + 3] = want_k[b].float() * want_kd[b][..., None]
        v_deq[b, n:n + 3] = vn8[b].float() * vnd[b][..., None]
    _check_decode(out, q, k_deq, v_deq, [n + 3 for n in lengths], True)


def test_fp8_cache_with_fixed_per_sequence_descales():
    """FlashAttention-3's (B, Hk) descales: fixed, new tokens quantized with them (saturating)."""
    import flashtile
    batch, cap, heads, heads_k, d = 2, 40, 4, 2, 32
    k, v = torch.randn(batch, cap, heads_k, d), torch.randn(batch, cap, heads_k, d)
    kd = k.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX  # (B, Hk)
    vd = v.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX
    k8 = (k / kd[:, None, :, None]).to(torch.float8_e4m3fn)
    v8 = (v / vd[:, None, :, None]).to(torch.float8_e4m3fn)
    q = torch.randn(batch, 1, heads, d, dtype=torch.bfloat16)
    k_new = torch.randn(batch, 1, heads_k, d, dtype=torch.bfloat16) * 100  # beyond the scale: saturates
    v_new = torch.randn(batch, 1, heads_k, d, dtype=torch.bfloat16)
    seqlens = torch.tensor([10, 39], dtype=torch.int32)
    out = flashtile.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, cache_seqlens=seqlens, k_descale=kd,
                                            v_descale=vd)
    for b, n in enumerate([10, 39]):
        expect = (k_new[b, 0].float() / kd[b][:, None]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX)
        assert torch.equal(k8[b, n].view(torch.uint8), expect.to(torch.float8_e4m3fn).view(torch.uint8))
    _check_decode(out, q, k8.float() * kd[:, None, :, None], v8.float() * vd[:, None, :, None], [11, 40],
                  False)


def test_fp8_cache_arguments_are_checked():
    import flashtile
    k8 = torch.randn(2, 16, 2, 32).to(torch.float8_e4m3fn)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flashtile.flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(2, 16))
    with pytest.raises(TypeError, match="k_descale must be a float32"):
        flashtile.flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(2, 16, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        bf = torch.randn(2, 16, 2, 32, dtype=torch.bfloat16)
        flashtile.flash_attn_with_kvcache(q, bf, bf, k_descale=torch.ones(2, 2))
    with pytest.raises(TypeError, match="v_cache must be float8_e4m3fn"):
        flashtile.flash_attn_with_kvcache(q, k8, torch.randn(2, 16, 2, 32).to(torch.float8_e5m2))
    with pytest.raises(TypeError, match="k must be float16 or bfloat16 or float8_e4m3fn"):
        e5 = torch.randn(2, 1, 2, 32).to(torch.float8_e5m2)
        flashtile.flash_attn_with_kvcache(q, k8, k8, e5, e5, cache_seqlens=3)
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):  # ... in q's dtype
        half = torch.randn(2, 1, 2, 32, dtype=torch.float16)
        flashtile.flash_attn_with_kvcache(q, k8, k8, half, half, cache_seqlens=3)
    cos = torch.ones(32, 16)
    with pytest.raises(ValueError, match="rotary embedding needs a 16-bit q and new k"):
        flashtile.flash_attn_with_kvcache(q, k8, k8, k8[:, :1], k8[:, :1], rotary_cos=cos, rotary_sin=cos,
                                          cache_seqlens=3)
    with pytest.raises(ValueError, match="same layout"):  # per key for K, fixed for V
        flashtile.flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(2, 16, 2))
    with pytest.raises(ValueError, match="same layout"):  # a copy would drop the appended descales
        flashtile.flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(2, 16, 2),
                                          v_descale=torch.ones(2, 2, 16).transpose(1, 2))
    with pytest.raises(ValueError, match="one per sequence; both descales alike"):
        pool = torch.randn(4, 16, 2, 32).to(torch.float8_e4m3fn)  # (B, Hk) for K, per key for V
        flashtile.flash_attn_with_kvcache(q, pool, pool, block_table=torch.tensor([[0], [1]], dtype=torch.int32),
                                          cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
                                          k_descale=torch.ones(2, 2), v_descale=torch.ones(4, 16, 2))


def _fixed_quantize(x):
    """(B, S, Hk, D) -> e4m3 and FlashAttention-3's fixed float32 descales (B, Hk)."""
    d = x.float().abs().amax(dim=(1, 3)) / fp8.E4M3_MAX
    return (x.float() / d[:, None, :, None]).to(torch.float8_e4m3fn), d


@pytest.mark.parametrize("cache", ["fixed", "per_key", "paged16", "fixed_no_q_descale"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_fp8_query_with_q_descale(cache, seqlen_q):
    """FlashAttention-3's all-FP8 call: e4m3 q with q_descale (B, Hk) against an e4m3 cache; bf16 out,
    checked against float64 attention on the dequantized q, k and v."""
    import flashtile
    batch, cap, heads, heads_k, d = 3, 50, 6, 2, 64
    lengths = [50, 7, 33]
    q8 = (torch.randn(batch, seqlen_q, heads, d) * 100).to(torch.float8_e4m3fn)
    qd = (torch.rand(batch, heads_k) + 0.5) / 100  # one per sequence and KV head, shared by its group
    k, v = torch.randn(batch, cap, heads_k, d) * 2, torch.randn(batch, cap, heads_k, d)
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True, num_splits=2,
              q_descale=None if cache == "fixed_no_q_descale" else qd)
    if cache.startswith("fixed"):
        (k8, kd), (v8, vd) = _fixed_quantize(k), _fixed_quantize(v)
        out = flashtile.flash_attn_with_kvcache(q8, k8, v8, k_descale=kd, v_descale=vd, **kw)
        kd, vd = kd[:, None, :].expand(batch, cap, heads_k), vd[:, None, :].expand(batch, cap, heads_k)
    else:
        (k8, kd), (v8, vd) = _quantize_per_key(k), _quantize_per_key(v)
        out = _fp8_cache_call(q8, k8, v8, kd, vd, 16 if cache == "paged16" else None, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    q_deq = q8.float()
    if kw["q_descale"] is not None:
        q_deq = q_deq * qd.repeat_interleave(heads // heads_k, dim=1)[:, None, :, None]
    _check_decode(out, q_deq, k8.float() * kd[..., None], v8.float() * vd[..., None], lengths, True,
                  dtype=torch.bfloat16)


def test_fp8_query_appends_e4m3_tokens_as_given():
    """e4m3 new k/v with fixed descales go into the cache bit for bit and are attended to; with
    per-key descales (which they do not carry) the call is refused before anything is written."""
    import flashtile
    batch, cap, heads, heads_k, d = 2, 40, 4, 2, 32
    (k8, kd), (v8, vd) = _fixed_quantize(torch.randn(batch, cap, heads_k, d)), \
        _fixed_quantize(torch.randn(batch, cap, heads_k, d))
    q8 = (torch.randn(batch, 2, heads, d) * 100).to(torch.float8_e4m3fn)
    qd = (torch.rand(batch, heads_k) + 0.5) / 100
    k_new = (torch.randn(batch, 2, heads_k, d) * 30).to(torch.float8_e4m3fn)
    v_new = (torch.randn(batch, 2, heads_k, d) * 30).to(torch.float8_e4m3fn)
    lengths = [5, 38]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    before = k8.clone()
    with pytest.raises(ValueError, match="carry no descales"):
        flashtile.flash_attn_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=seqlens,
                                          q_descale=qd, k_descale=torch.ones(batch, cap, heads_k),
                                          v_descale=torch.ones(batch, cap, heads_k))
    assert torch.equal(k8.view(torch.uint8), before.view(torch.uint8))
    out = flashtile.flash_attn_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                            q_descale=qd, k_descale=kd, v_descale=vd)
    for b, n in enumerate(lengths):
        assert torch.equal(k8[b, n:n + 2].view(torch.uint8), k_new[b].view(torch.uint8))
        assert torch.equal(v8[b, n:n + 2].view(torch.uint8), v_new[b].view(torch.uint8))
    q_deq = q8.float() * qd.repeat_interleave(heads // heads_k, dim=1)[:, None, :, None]
    _check_decode(out, q_deq, k8.float() * kd[:, None, :, None], v8.float() * vd[:, None, :, None],
                  [n + 2 for n in lengths], True, dtype=torch.bfloat16)


def test_fp8_query_descale_any_strides():
    """q_descale as a broadcast or transposed view (the kernels read rows of Hk: such views are
    copied) gives what the contiguous tensor gives."""
    import flashtile
    k8 = torch.randn(2, 30, 3, 32).to(torch.float8_e4m3fn)
    q8 = (torch.randn(2, 1, 6, 32) * 50).to(torch.float8_e4m3fn)
    kw = dict(cache_seqlens=torch.tensor([30, 11], dtype=torch.int32), num_splits=2,
              k_descale=torch.rand(2, 30, 3) + 0.5, v_descale=torch.rand(2, 30, 3) + 0.5)
    plain = torch.rand(3, 2).T / 50  # (2, 3), transposed
    for view, dense in ((torch.full((1, 1), 0.02).expand(2, 3), torch.full((2, 3), 0.02)),
                        (plain, plain.contiguous())):
        got = flashtile.flash_attn_with_kvcache(q8, k8, k8, q_descale=view, **kw)
        want = flashtile.flash_attn_with_kvcache(q8, k8, k8, q_descale=dense, **kw)
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim,paged", [(64, None), (32, None), (64, 16)])
def test_fp8_cache_rotary_before_quantizing(interleaved, rotary_dim, paged):
    """Rotary with an e4m3 cache: q and the new keys turn first (by the positions of the append,
    after any left padding), then the keys are quantized per token and appended."""
    import flashtile
    from helpers import rotary_reference
    batch, cap, heads, heads_k, d, new = 3, 64, 4, 2, 64, 3
    lengths, leftpad = [5, 40, 61], [0, 7, 30]
    q = torch.randn(batch, new, heads, d, dtype=torch.bfloat16)
    (k8, kd), (v8, vd) = _quantize_per_key(torch.randn(batch, cap, heads_k, d)), \
        _quantize_per_key(torch.randn(batch, cap, heads_k, d))
    k_new = torch.randn(batch, new, heads_k, d, dtype=torch.bfloat16) * 3
    v_new = torch.randn(batch, new, heads_k, d, dtype=torch.bfloat16)
    angles = torch.rand(cap, rotary_dim // 2) * 6
    cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
    kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, causal=True,
              cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    if paged:
        leftpad = [0, 0, 0]
        # the cache and its descales as page pools, read back afterwards through the table
        pool_k, pool_v, pool_kd, pool_vd, table = _fp8_pages(k8, v8, kd, vd, paged, fill=0.0)
        out = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, block_table=table,
                                                k_descale=pool_kd, v_descale=pool_vd, **kw)
        pages = table.long()
        k8, v8 = pool_k[pages].flatten(1, 2), pool_v[pages].flatten(1, 2)
        kd, vd = pool_kd[pages].flatten(1, 2), pool_vd[pages].flatten(1, 2)
    else:
        out = flashtile.flash_attn_with_kvcache(q, k8, v8, k_new, v_new, k_descale=kd, v_descale=vd,
                                                cache_leftpad=torch.tensor(leftpad, dtype=torch.int32),
                                                **kw)
    k_deq, v_deq = k8.float() * kd[..., None], v8.float() * vd[..., None]
    from flashtile.reference import attention as textbook
    for b, (n, start) in enumerate(zip(lengths, leftpad)):
        pos = (torch.arange(new) + n - start)[None]
        k_rot = rotary_reference(k_new[b:b + 1], cos, sin, pos, interleaved)[0].float()
        got = k_deq[b, n:n + new]
        # e4m3 keeps 4 significant bits: within half an ulp of the rotated key (and a bf16 ulp of it)
        assert ((got - k_rot).abs() <= 2 ** -4 * k_rot.abs() + 2 ** -7 * k_rot.abs().amax(-1, True)).all()
        q_rot = rotary_reference(q[b:b + 1], cos, sin, pos, interleaved)
        keys = slice(start, n + new)
        args = (q_rot.double(), k_deq[b:b + 1, keys].double(), v_deq[b:b + 1, keys].double())
        ref, _ = textbook(*args, causal=True)
        low, _ = textbook(*(t.to(torch.bfloat16) for t in args), causal=True)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-6, f"row {b}: {err}"


def test_fp8_query_arguments_are_checked():
    import flashtile
    k8 = torch.randn(2, 16, 2, 32).to(torch.float8_e4m3fn)
    q8 = torch.randn(2, 1, 4, 32).to(torch.float8_e4m3fn)
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale applies to a float8_e4m3fn q only"):
        flashtile.flash_attn_with_kvcache(q, k8, k8, q_descale=torch.ones(2, 2))
    with pytest.raises(TypeError, match="k_cache must be float8_e4m3fn"):
        bf = torch.randn(2, 16, 2, 32, dtype=torch.bfloat16)
        flashtile.flash_attn_with_kvcache(q8, bf, bf)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(2, 2\)"):
        flashtile.flash_attn_with_kvcache(q8, k8, k8, q_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="q_descale must be a float32"):
        flashtile.flash_attn_with_kvcache(q8, k8, k8, q_descale=torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):  # 16-bit new tokens are bf16 here
        half = torch.randn(2, 1, 2, 32, dtype=torch.float16)
        flashtile.flash_attn_with_kvcache(q8, k8, k8, half, half, cache_seqlens=3)


def test_bench_decode_fp8_cpu_check_and_table():
    """`flashtile bench decode-fp8` without a GPU: its FP8-cache check passes through the interpreter;
    the table formats a record with and without timings; fp8 bytes count the descales."""
    from flashtile.bench import decode_fp8
    from flashtile.bench.decode import Point
    results = decode_fp8.run_check(torch.device("cpu"), log=lambda line: None)
    assert len(results) == len(decode_fp8.check_cases(on_gpu=False))
    assert all(r["passed"] for r in results), results
    point = Point("m", 2, 8, 2, 1000)
    assert decode_fp8.fp8_point_bytes(point) == 2 * 1000 * 2 * (2 * 128 + 8)
    record = {"batch": 2, "heads": 8, "heads_k": 2, "context": 1000,
              "providers": {"flashtile": {"available": True, "gbps": 3000.0, "pct_ceiling": 72.0},
                            "flashtile-fp8": {"available": False, "error": "x"}},
              "fp8_speedup_per_token": None}
    table = decode_fp8.format_table([record], "t")
    assert "3000" in table and "72%" in table


@pytest.mark.parametrize("fits", [True, False])
def test_bench_decode_fp8_run_point_counts_each_caches_bytes(monkeypatch, fits):
    """`bench decode-fp8` times both caches over the same layers in balanced rounds (or, where both
    do not fit at once, each alone over its own layer count); either way each provider's GB/s
    counts its own cache's bytes. A stub timer stands in for the GPU's (1 ms per replay)."""
    from flashtile.bench import decode_fp8
    from flashtile.bench.decode import Point
    monkeypatch.setattr(decode_fp8, "gpu_timer", lambda replay: (replay(), 1.0)[1])
    point = Point("m", 1, 4, 2, 48, 32)
    nb16, nb8 = 1 * 48 * 2 * 32 * 2 * 2, decode_fp8.fp8_point_bytes(point)
    if not fits:  # room for the e4m3 cache alone: the bf16 one is skipped as too large
        monkeypatch.setattr(decode_fp8, "MAX_TOTAL_BYTES", 2 * nb8 + 1)
    record = decode_fp8.run_point(point, torch.device("cpu"), 1000.0, 2, seed=0)
    bf16, fp8 = record["providers"]["flashtile"], record["providers"]["flashtile-fp8"]
    paged = record["providers"]["flashtile-fp8-paged"]  # the same e4m3 caches as pools of 16 keys
    assert record["layers_bf16"] == record["layers_fp8"] == 2 and record["page_size"] == 16
    for p in (fp8, paged):
        assert p["available"] and p["gbps"] == pytest.approx(nb8 / 0.5e-3 / 1e9)  # 2 layers in 1 ms
        assert p["pct_ceiling"] == pytest.approx(p["gbps"] / 10)
    assert record["fp8_paged_vs_contiguous"] == pytest.approx(1.0)
    table = decode_fp8.format_table([record], "t")
    assert "fp8 P16 GB/s" in table and "1.000x" in table
    if fits:
        assert record["timing"] == "balanced rounds of both"
        assert bf16["available"] and bf16["gbps"] == pytest.approx(nb16 / 0.5e-3 / 1e9)
        assert len(fp8["replay_ms_rounds"]) == len(bf16["replay_ms_rounds"]) >= 5
        assert len(paged["replay_ms_rounds"]) == len(fp8["replay_ms_rounds"])
        assert record["fp8_speedup_per_token"] == pytest.approx(1.0)
    else:
        assert record["timing"] == "one pass each, alone"
        assert not bf16["available"] and bf16["error"] == "too large"
        assert record["fp8_speedup_per_token"] is None
    # contexts that are not a multiple of the page size, or --page-size 0: no paged provider
    for page in (0, 20):
        monkeypatch.setattr(decode_fp8, "MAX_TOTAL_BYTES", 2 * nb8 + 1)  # (the e4m3 cache alone)
        record = decode_fp8.run_point(point, torch.device("cpu"), 1000.0, 2, seed=0, page_size=page)
        assert "flashtile-fp8-paged" not in record["providers"] and record["page_size"] is None
        assert record["fp8_paged_vs_contiguous"] is None
        assert "P16" not in decode_fp8.format_table([record], "t")


@pytest.mark.parametrize("q_scale", [3e4, 1e-3])
def test_fp8_cache_bf16_query_far_from_fp16_range(q_scale):
    """With an e4m3 cache and a bf16 query the kernel computes in fp16 after scaling q by a power of
    two: a query beyond fp16's range (3e4 x N(0,1) reaches 1e5) or far below it still matches the
    reference from the dequantized cache, with the softcap path too."""
    import flashtile
    from flashtile.reference import attention as textbook
    batch, cap, heads, heads_k, d = 2, 50, 4, 2, 64
    lengths = [50, 23]
    q = (torch.randn(batch, 1, heads, d) * q_scale).to(torch.bfloat16)
    k, v = torch.randn(batch, cap, heads_k, d), torch.randn(batch, cap, heads_k, d)
    (k8, kd), (v8, vd) = _quantize_per_key(k), _quantize_per_key(v)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    scale = 1.0 / (q_scale * d)  # keeps the scores O(1)
    out = flashtile.flash_attn_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd, cache_seqlens=seqlens,
                                            causal=True, num_splits=2, softmax_scale=scale)
    assert torch.isfinite(out).all()
    k_deq, v_deq = k8.float() * kd[..., None], v8.float() * vd[..., None]
    for b, n in enumerate(lengths):
        args = (q[b:b + 1].double(), k_deq[b:b + 1, :n].double(), v_deq[b:b + 1, :n].double())
        ref, _ = textbook(*args, causal=True, softmax_scale=scale)
        low, _ = textbook(*(t.to(q.dtype) for t in args), causal=True, softmax_scale=scale)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-6, f"row {b}: {err}"
    capped = flashtile.flash_attn_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd, cache_seqlens=seqlens,
                                               causal=True, softmax_scale=scale, softcap=2.0)
    for b, n in enumerate(lengths):
        args = (q[b:b + 1].double(), k_deq[b:b + 1, :n].double(), v_deq[b:b + 1, :n].double())
        ref, _ = textbook(*args, causal=True, softmax_scale=scale, softcap=2.0)
        low, _ = textbook(*(t.to(q.dtype) for t in args), causal=True, softmax_scale=scale, softcap=2.0)
        err = (capped[b:b + 1].double() - ref).abs().max().item()
        assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-6, f"softcap row {b}: {err}"


@pytest.mark.parametrize("paged", [None, 16])
def test_fp8_cache_query_rows_in_blocks(monkeypatch, paged):
    # 4 query heads a KV head x 5 positions = 20 rows in tiles of at most 16: two row blocks, the
    # first holding three query heads' rows and the start of the fourth's, the second the rest.
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "MAX_TILE_ROWS", 16)
    decode._PLANS.clear()
    try:
        test_fp8_cache_with_per_key_descales(paged, 3, 5)
    finally:
        decode._PLANS.clear()


@pytest.mark.parametrize("paged", [None, 16])
@pytest.mark.parametrize("fp8_q,seqlen_q,softcap", [(False, 1, 0.0), (False, 5, 0.0), (True, 5, 0.0),
                                                    (False, 3, 20.0)])
def test_fp8_cache_split_query_e4m3_dots(monkeypatch, paged, fp8_q, seqlen_q, softcap):
    """The e4m3 cache's plan past 64 query rows on sm_90 (DecodeConfig.fp8_split_q): the query as
    two e4m3 terms, S by e4m3 dots on K as loaded; here with two row blocks of 16 rows (and one),
    against float64 attention on the dequantized tensors."""
    from flashtile.kernels import decode
    monkeypatch.setattr(decode, "MAX_TILE_ROWS", 16)
    decode._PLANS.clear()
    batch, cap, heads, heads_k, d = 3, 70, 8, 2, 64
    lengths = [70, 9, 37]
    q = torch.randn(batch, seqlen_q, heads, d, dtype=torch.bfloat16)
    qd = None
    if fp8_q:
        q8 = (torch.randn(batch, seqlen_q, heads, d) * 80).to(torch.float8_e4m3fn)
        qd = (torch.rand(batch, heads_k) + 0.5) / 80
        q = q8.float() * qd.repeat_interleave(heads // heads_k, dim=1)[:, None, :, None]
    k, v = torch.randn(batch, cap, heads_k, d) * 3, torch.randn(batch, cap, heads_k, d)
    k[0, 5] *= 40
    (k8, kd), (v8, vd) = _quantize_per_key(k), _quantize_per_key(v)
    config = decode.DecodeConfig(32, 4, 1, fp8_split_q=True)
    kw = dict(softmax_scale=d ** -0.5, window_left=-1, window_right=0, softcap=softcap,
              num_splits=2, config=config, q_descale=qd)
    try:
        if paged:
            pool_k, pool_v, pool_kd, pool_vd, table = _fp8_pages(k8, v8, kd, vd, paged)
            out, _ = decode.decode_attention(q8 if fp8_q else q, pool_k, pool_v,
                                             torch.tensor(lengths, dtype=torch.int32), block_table=table,
                                             k_descale=pool_kd, v_descale=pool_vd, **kw)
        else:
            out, _ = decode.decode_attention(q8 if fp8_q else q, k8, v8,
                                             torch.tensor(lengths, dtype=torch.int32),
                                             k_descale=kd, v_descale=vd, **kw)
    finally:
        decode._PLANS.clear()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    _check_decode(out, q, k8.float() * kd[..., None], v8.float() * vd[..., None], lengths, True,
                  dtype=torch.bfloat16, softcap=softcap)


@pytest.mark.parametrize("layout", ["paged3", "paged16", "batch_idx"])
@pytest.mark.parametrize("fp8_q", [False, True])
def test_fp8_cache_per_sequence_descales_on_pages(layout, fp8_q):
    """FlashAttention-3's (B, Hk) descales with a paged cache or through cache_batch_idx: each
    sequence's K and V descale for all of its keys, whichever pages or cache rows hold them; bf16
    tokens appended are quantized with them."""
    import flashtile
    from flashtile.bench.decode import paginate
    batch, cap, heads, heads_k, d = 3, 48, 4, 2, 32
    lengths = [20, 45, 3]
    k, v = torch.randn(batch, cap, heads_k, d), torch.randn(batch, cap, heads_k, d)
    kd, vd = k.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX, v.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX
    k8, v8 = (k / kd[:, None, :, None]).to(torch.float8_e4m3fn), (v / vd[:, None, :, None]).to(torch.float8_e4m3fn)
    q = torch.randn(batch, 2, heads, d, dtype=torch.bfloat16)
    kw = dict(causal=True, num_splits=2, k_descale=kd, v_descale=vd)
    q_call = q
    if fp8_q:
        q_call = (q.float() * 50).to(torch.float8_e4m3fn)
        kw["q_descale"] = torch.full((batch, heads_k), 0.02)
        q = q_call.float() * 0.02
    k_new = torch.randn(batch, 2, heads_k, d, dtype=torch.bfloat16)
    v_new = torch.randn(batch, 2, heads_k, d, dtype=torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if layout.startswith("paged"):
        page = int(layout[5:])
        pool_k, pool_v, table = paginate(k8.view(torch.uint8), v8.view(torch.uint8), page)
        pool_k, pool_v = pool_k.view(torch.float8_e4m3fn), pool_v.view(torch.float8_e4m3fn)
        out = flashtile.flash_attn_with_kvcache(q_call, pool_k, pool_v, k_new, v_new, cache_seqlens=seqlens,
                                                block_table=table, **kw)
        pages = table.long()
        k8, v8 = pool_k[pages].flatten(1, 2)[:, :cap], pool_v[pages].flatten(1, 2)[:, :cap]
    else:
        # the sequences in cache rows 2, 0, 1 of a four-row cache
        rows = torch.tensor([2, 0, 1], dtype=torch.int32)
        big_k = torch.zeros(4, cap, heads_k, d).to(torch.float8_e4m3fn)
        big_v = torch.zeros(4, cap, heads_k, d).to(torch.float8_e4m3fn)
        big_k[rows.long()], big_v[rows.long()] = k8, v8
        out = flashtile.flash_attn_with_kvcache(q_call, big_k, big_v, k_new, v_new, cache_seqlens=seqlens,
                                                cache_batch_idx=rows, **kw)
        k8, v8 = big_k[rows.long()], big_v[rows.long()]
    for b, n in enumerate(lengths):  # the appended tokens, quantized with their sequence's descales
        want = (k_new[b].float() / kd[b][None, :, None]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX)
        assert torch.equal(k8[b, n:n + 2].view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))
    assert out.dtype == torch.bfloat16
    _check_decode(out, q, k8.float() * kd[:, None, :, None], v8.float() * vd[:, None, :, None],
                  [n + 2 for n in lengths], True, dtype=torch.bfloat16)


def _poison_e4m3_empty(monkeypatch):
    """torch.empty gives e4m3 tensors full of NaN bytes (0x7F) until monkeypatch.undo()."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        return t
    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("lens,extra", [([5, 0, 33, 16, 1], 0), ([128, 3, 0], 0), ([0, 0, 200], 0),
                                        ([40, 7], 700)])
def test_packed_keys_transposed_starts_sequences_on_16_key_boundaries(monkeypatch, lens, extra):
    """Every column a reader may touch written by the pack itself: its buffer comes back from
    torch.empty full of e4m3 NaN bytes here, and the gaps must still be zeros, also for a key tile
    (PACKED_TAIL) past the last sequence when x has ``extra`` rows after it (flash_attn_varlen_func
    allows k longer than cu_seqlens_k[-1])."""
    from flashtile.kernels.forward import PACKED_TAIL, packed_keys_transposed
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lens) + extra, 3, 24).to(torch.float8_e4m3fn)
    _poison_e4m3_empty(monkeypatch)
    t = packed_keys_transposed(x, cu, max(lens))
    monkeypatch.undo()
    assert t.shape[0] == 1 and t.shape[2:] == (3, 24) and t.stride(1) == 1 and t.stride(3) % 16 == 0
    used = torch.zeros(t.shape[1], dtype=torch.bool)
    for b, n in enumerate(lens):
        start = (int(cu[b]) + 15) // 16 * 16 + 16 * b  # the kernel's v_start
        assert torch.equal(t[0, start:start + n].float(), x[cu[b]:cu[b + 1]].float())
        used[start:start + n] = True
    end = min(start + n + PACKED_TAIL, t.shape[1])
    assert (t[0, :end][~used[:end]].float() == 0).all()  # the gaps between sequences are zeros
    assert end == t.shape[1] or extra  # (without extra rows the zeros reach the width)


@pytest.mark.parametrize("shape,permuted", [((2, 37, 3, 24), False), ((1, 130, 2, 128), True),
                                            ((3, 16, 1, 40), False)])
def test_keys_contiguous_copies_any_strides(shape, permuted):
    """keys_contiguous through its Triton pass: the (B, S, H, D) values in (B, H, D, S16) storage,
    from contiguous inputs or strided views (here (B, H, S, D) storage seen as (B, S, H, D))."""
    from flashtile.kernels.forward import keys_contiguous
    b, s, h, d = shape
    if permuted:
        x = torch.randn(b, h, s, d).to(torch.float8_e4m3fn).transpose(1, 2)
    else:
        x = torch.randn(shape).to(torch.float8_e4m3fn)
    t = keys_contiguous(x)
    assert t.shape == x.shape and t.stride(1) == 1 and t.stride(3) % 16 == 0
    assert torch.equal(t.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("page,lens", [(1, [5, 0, 33, 17]), (3, [40, 1, 0]), (16, [0, 0, 40])])
def test_paged_keys_packed_gathers_sequences_through_the_table(monkeypatch, page, lens):
    """e4m3 page pools gathered for the Gluon forward: K rows from cu_seqlens[b], V^T as
    packed_keys_transposed lays it out (gaps zero although torch.empty gives NaN bytes here), each
    sequence's keys read through its shuffled table row."""
    from flashtile.kernels import forward
    from flashtile.kernels.forward import paged_keys_packed
    longest, heads, d = 40, 2, 24
    batch, width = len(lens), -(-40 // page)
    k = torch.randn(batch * width + 3, page, heads, d).to(torch.float8_e4m3fn)
    v = torch.randn(batch * width + 3, page, heads, d).to(torch.float8_e4m3fn)
    table = torch.randperm(k.shape[0], dtype=torch.int32)[:batch * width].reshape(batch, width)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    _poison_e4m3_empty(monkeypatch)
    rows, vt = paged_keys_packed(k, v, table, cu, longest)
    monkeypatch.undo()
    assert rows.shape == (batch * longest, heads, d) and rows.is_contiguous()
    assert vt.shape[0] == 1 and vt.shape[2:] == (heads, d) and vt.stride(1) == 1 and vt.stride(3) % 16 == 0
    used = torch.zeros(vt.shape[1], dtype=torch.bool)
    for b, n in enumerate(lens):
        pages = table[b].long()
        k_seq, v_seq = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
        assert torch.equal(rows[cu[b]:cu[b] + n].view(torch.uint8), k_seq.view(torch.uint8))
        start = (int(cu[b]) + 15) // 16 * 16 + 16 * b
        assert torch.equal(vt[0, start:start + n].view(torch.uint8), v_seq.view(torch.uint8))
        used[start:start + n] = True
    # zeros between sequences and for a key tile past the last (its width is laid out for B x 40 keys)
    # (or up to the width: past it the kernel's descriptor reads zeros)
    end = min(start + n + forward.PACKED_TAIL, vt.shape[1])
    assert (vt[0, :end][~used[:end]].float() == 0).all()


def test_packed_keys_transposed_reads_only_rows_of_x(monkeypatch):
    """Offsets past x's rows or below its first (CUDA-graph capture leaves them unchecked) read no
    memory outside x: here x is a slice of a buffer whose other rows are e4m3 NaN bytes, and the
    columns such offsets point at come out zero, not NaN."""
    from flashtile.kernels.forward import packed_keys_transposed
    heads, d = 2, 24
    buffer = torch.randn(48, heads, d).to(torch.float8_e4m3fn)
    buffer[:8].view(torch.uint8).fill_(0x7F)
    buffer[24:].view(torch.uint8).fill_(0x7F)
    x = buffer[8:24]  # 16 rows
    _poison_e4m3_empty(monkeypatch)
    # sequence 0 from row -8 (8 rows before x), sequence 1 claims rows 8:40 of x's 16
    t = packed_keys_transposed(x, torch.tensor([-8, 8, 40], dtype=torch.int32), 32)
    monkeypatch.undo()
    assert t.shape[1] == 64  # 16 rows' columns + 16 a sequence + 16
    assert (t[0, 0:8].float() == 0).all()  # rows -8:0 are not x's: zeros
    assert torch.equal(t[0, 8:16].view(torch.uint8), x[0:8].view(torch.uint8))
    assert torch.equal(t[0, 32:40].view(torch.uint8), x[8:16].view(torch.uint8))  # 16 * 1 + 16
    assert (t[0, 16:32].float() == 0).all() and (t[0, 40:].float() == 0).all()


def test_paged_keys_packed_clamps_unchecked_values(monkeypatch):
    """Values a CUDA-graph capture leaves unchecked stay inside the tensors: table entries outside
    the pool read its first or last page, a length past the table row's capacity is cut there (and
    the columns after it are zeros written by the pack, not torch.empty's NaN bytes)."""
    from flashtile.kernels.forward import paged_keys_packed
    page, heads, d = 4, 1, 16
    k = torch.randn(3, page, heads, d).to(torch.float8_e4m3fn)
    v = torch.randn(3, page, heads, d).to(torch.float8_e4m3fn)
    table = torch.tensor([[-7, 1], [2, 10 ** 6]], dtype=torch.int32)
    cu = torch.tensor([0, 8, 8 + 50], dtype=torch.int32)  # sequence 1 claims 50 keys of 8 slots
    _poison_e4m3_empty(monkeypatch)
    rows, vt = paged_keys_packed(k, v, table, cu, 8)
    monkeypatch.undo()
    assert rows.shape == (16, heads, d)
    assert torch.equal(rows[:8].view(torch.uint8), torch.cat([k[0], k[1]]).view(torch.uint8))
    assert torch.equal(rows[8:16].view(torch.uint8), torch.cat([k[2], k[2]]).view(torch.uint8))
    assert torch.equal(vt[0, :8].view(torch.uint8), torch.cat([v[0], v[1]]).view(torch.uint8))
    assert vt.shape[1] == 64  # 16 keys' columns + 16 a sequence + 16
    assert torch.equal(vt[0, 32:40].view(torch.uint8), torch.cat([v[2], v[2]]).view(torch.uint8))
    assert (vt[0, 8:32].float() == 0).all() and (vt[0, 40:].float() == 0).all()


@pytest.mark.parametrize("batch,heads_k,blocks,transposed", [(2, 3, 5, False), (1, 2, 600, True), (3, 1, 1, False)])
def test_fused_kernel_descales_match_the_torch_formula(batch, heads_k, blocks, transposed):
    # The one-launch form of fp8_kernel_descales (GPU calls) run by the interpreter against the
    # torch formula it replaces, bit for bit: rows longer than the kernel's 256-block steps, descale
    # tensors with other strides, V's largest anywhere in the row.
    from flashtile.kernels.forward import _fused_kernel_descales, fp8_kernel_descales
    shape = (batch, blocks, heads_k) if transposed else (batch, heads_k, blocks)
    k_d = torch.rand(shape) + 0.01
    v_d = torch.exp2(torch.randint(-6, 6, shape).float())
    if transposed:
        k_d, v_d = k_d.transpose(1, 2), v_d.transpose(1, 2)
    q_d = torch.rand(batch, 4, 2)
    k_out, v_out = _fused_kernel_descales(k_d, v_d)
    same_q, k_ref, v_ref = fp8_kernel_descales(q_d, k_d, v_d)  # (the CPU's torch path)
    assert same_q is q_d
    assert k_out.shape == v_out.shape == (batch, heads_k, blocks + 1) and k_out.is_contiguous()
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def test_attention_names_malformed_descales():
    # Descales the kernels would read past or misread: wrong block counts, a strided last dim, other
    # dtypes; each named before any launch.
    import dataclasses
    q, k, v = (torch.randn(1, 64, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    z = fp8.quantize_qkv(q, k, v, block=(32, 16))
    assert z.q_descale.shape == (1, 4, 2) and z.k_descale.shape == (1, 2, 4)
    with pytest.raises(ValueError, match="q_descale must be \\(1, 4, 2\\)"):
        fp8.attention(dataclasses.replace(z, q_descale=torch.ones(1, 4, 3)))
    with pytest.raises(ValueError, match="k_descale must be \\(1, 2, 4\\)"):  # (k and v share a layout)
        fp8.attention(dataclasses.replace(z, k_descale=torch.ones(1, 2, 3), v_descale=torch.ones(1, 2, 3)))
    with pytest.raises(ValueError, match="q_descale.*contiguous"):
        fp8.attention(dataclasses.replace(z, q_descale=torch.ones(1, 4, 4)[:, :, ::2]))
    with pytest.raises(TypeError, match="k_descale must be a float32"):
        fp8.attention(dataclasses.replace(z, v_descale=z.v_descale.double(), k_descale=z.k_descale.double()))
    with pytest.raises(TypeError, match="v_descale must be a float32"):
        fp8.attention(dataclasses.replace(z, v_descale=z.v_descale.half()))


def test_kernel_descales_on_another_device_than_the_current_one_use_torch(monkeypatch):
    # The fused launch goes to the current device: descales living on another GPU (a call made
    # from a different current device) take the torch formula, which follows its tensors.
    from flashtile.kernels import forward
    fused = []
    monkeypatch.setattr(forward, "_INTERPRET", False)
    monkeypatch.setattr(forward, "_fused_kernel_descales", lambda k, v: fused.append(k) or (k, v))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 1)
    q_d, k_d, v_d = torch.rand(1, 4, 2), torch.rand(1, 2, 3), torch.rand(1, 2, 3)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    _, k_out, v_out = forward.fp8_kernel_descales(q_d, k_d, v_d)
    assert not fused and k_out.shape == (1, 2, 4) and torch.allclose(v_out[..., :3] * v_out[..., 3:], v_d)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    forward.fp8_kernel_descales(q_d, k_d, v_d)
    assert fused == [k_d]


def _compiled_equals_eager(fn, *args):
    """fn under torch.compile(fullgraph=True) gives eager's outputs bit for bit."""
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    eager, compiled = (x if isinstance(x, tuple) else (x,) for x in (eager, compiled))
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert c.dtype == e.dtype and torch.equal(c, e)


def test_fp8_calls_compile_with_fullgraph():
    """flash_attn_func on e4m3 (FlashAttention-3's descales, and without them) and fp8.attention
    run the registered op under torch.compile(fullgraph=True): Dynamo has no graph break to make
    (it cannot trace the launch plans), and the compiled call gives eager's output and LSE."""
    import flashtile
    q = torch.randn(2, 40, 4, 32)
    k, v = torch.randn(2, 50, 2, 32), torch.randn(2, 50, 2, 32)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    d = [torch.rand(2, 2) + 0.5 for _ in range(3)]

    def fa3(q8, k8, v8, qd, kd, vd):
        return flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                         v_descale=vd, return_attn_probs=True)[:2]

    _compiled_equals_eager(fa3, q8, k8, v8, *d)
    sinks = torch.randn(4) + 2.0  # attention sinks, taken by the registered op too
    _compiled_equals_eager(lambda q8, k8, v8, s: flashtile.flash_attn_func(q8, k8, v8, causal=True, s_aux=s,
                                                                           return_attn_probs=True)[:2],
                           q8, k8, v8, sinks)
    _compiled_equals_eager(lambda q8, k8, v8: flashtile.flash_attn_func(q8, k8, v8, window_size=(7, 3)),
                           q8, k8, v8)
    z = fp8.quantize_qkv(q, k, v, block=(32, 32), hadamard=False)
    _compiled_equals_eager(lambda z: fp8.attention(z, causal=True, return_lse=True), z)
    _compiled_equals_eager(lambda z, s: fp8.attention(z, causal=True, return_lse=True, s_aux=s), z, sinks)

    def quantized(q, k, v):  # quantize_qkv inside the compiled region too (its own registered op)
        z = fp8.quantize_qkv(q, k, v, block=(32, 64), hadamard=True, seed=5)
        return fp8.attention(z, causal=True, return_lse=True) + (z.k_descale, z.signs)

    _compiled_equals_eager(quantized, q, k, v)


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "page-pools"])
def test_fp8_varlen_compiles_with_fullgraph(paged):
    import flashtile
    from test_varlen import paged_copy
    lens_q, lens_k, heads_k = [5, 17], [9, 30], 2
    cu_q, cu_k, tensors, descales, _ = _packed_e4m3(lens_q, lens_k, 4, heads_k, 32)
    q, k, v = tensors
    table = None
    if paged:
        k, v, table = paged_copy(k.float(), v.float(), cu_k, 8)
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)

    def fn(q, k, v, qd, kd, vd):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                block_table=table, q_descale=qd, k_descale=kd, v_descale=vd,
                                                return_attn_probs=True)[:2]

    _compiled_equals_eager(fn, q, k, v, *descales)


def test_fp8_ops_pass_opcheck():
    from flashtile import ops
    torch.library.opcheck(ops.quantize_qkv_op, (torch.randn(1, 40, 4, 32), torch.randn(2, 33, 2, 32)[:1],
                                                torch.randn(1, 33, 2, 32), 32, 16, True, 3),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    x = fp8.quantize_qkv(torch.randn(1, 40, 4, 32), torch.randn(1, 40, 2, 32), torch.randn(1, 40, 2, 32),
                         block=(64, 64), hadamard=False)
    torch.library.opcheck(ops.attn_fwd_fp8, (x.q, x.k, x.v, x.q_descale, x.k_descale, x.v_descale, 0.2, -1, 0,
                                             0, 0.0, None, 64, 64),
                          # (test_schema multiplies the inputs, which e4m3 tensors do not support on the CPU)
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(ops.attn_fwd_fp8, (x.q, x.k, x.v, x.q_descale, x.k_descale, x.v_descale, 0.2, -1, 0,
                                             0, 0.0, None, 64, 64), {"sinks": torch.randn(4)},
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_fp8_kvcache_compiles_with_fullgraph():
    """flash_attn_with_kvcache on an e4m3 cache, appending bf16 keys (quantized into the cache and
    its per-key descales in place), and FlashAttention-3's all-e4m3 call: compiled as eager, the
    caches and descales mutated alike."""
    import flashtile
    batch, slots, heads_k, dim = 2, 64, 2, 32
    k_cache, v_cache = (torch.randn(batch, slots, heads_k, dim).to(torch.float8_e4m3fn) for _ in range(2))
    k_d, v_d = torch.rand(batch, slots, heads_k) + 0.5, torch.rand(batch, slots, heads_k) + 0.5
    q = torch.randn(batch, 1, 4, dim, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 1, heads_k, dim, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([30, 50], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_d, v_d):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                 k_descale=k_d, v_descale=v_d, causal=True)

    eager_state = [t.clone() for t in (k_cache, v_cache, k_d, v_d)]
    compiled_state = [t.clone() for t in (k_cache, v_cache, k_d, v_d)]
    torch._dynamo.reset()
    eager = step(q, *eager_state)
    compiled = torch.compile(step, fullgraph=True)(q, *compiled_state)
    assert torch.equal(compiled, eager)
    for e, c in zip(eager_state, compiled_state):
        assert torch.equal(c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c,
                           e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)
    assert not torch.equal(eager_state[2], k_d)  # the append wrote descales

    q8 = torch.randn(batch, 1, 4, dim).to(torch.float8_e4m3fn)
    fixed = [torch.rand(batch, heads_k) + 0.5 for _ in range(3)]
    _compiled_equals_eager(lambda q8, kc, vc, qd, kd, vd: flashtile.flash_attn_with_kvcache(
        q8, kc, vc, cache_seqlens=lengths, q_descale=qd, k_descale=kd, v_descale=vd), q8, k_cache, v_cache, *fixed)
