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
        # every block's largest magnitude lands on the top of the e4m3 range
        assert torch.isclose(x8.float().abs().amax(dim=-1).amax(dim=1), torch.tensor(fp8.E4M3_MAX)).any()


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
