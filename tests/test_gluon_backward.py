"""The Gluon backward kernels (sm_90): ``supported`` turns away what they do not handle, the backward
keeps the portable kernels off sm_90 and for deterministic calls, and a fused-dQ variant refuses
shapes it has no code for. Its variants' sm_90 compilation is tested in
test_gluon_compile.py; its numerics on the GPU by benchmarks/gluon_bwd_check.py and, with a softcap,
benchmarks/softcap_train.py (the interpreter cannot run Gluon)."""

import pytest
import torch

from flashtile.kernels import backward, gluon_backward


def test_supported_is_false_off_gpu():
    q = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 80, 2, 128, dtype=torch.bfloat16)
    assert not gluon_backward.supported(q, k, torch.randn_like(k), torch.randn_like(q))


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_keeps_the_portable_kernels_off_gpu(deterministic):
    flags = dict(HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False, ALIBI=False, DROPOUT=False,
                 VARLEN=False, UPCAST=False)
    q = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    assert backward.gluon_backward_mode(q, k, k, q, flags, 0, 0, False, deterministic) is None


def test_fused_dq_variants_exist_for_every_dispatched_head_dim():
    for d in gluon_backward.FUSED_HEAD_DIMS:
        for causal in (False, True):
            variant = gluon_backward.default_variant(d, "bf16", causal, True)
            assert variant.fused_dq and variant.block_m == 64 and not variant.overlap
            assert variant in gluon_backward.GLUON_BACKWARD_VARIANTS
    for bad in (dict(head_dim=256), dict(block_m=32), dict(overlap=True)):
        args = {"head_dim": 128, "fused_dq": True, **bad}
        with pytest.raises(ValueError, match="fused_dq"):
            gluon_backward.GluonBackwardVariant(**args)


def test_lse_rows_are_copied_to_tma_aligned_rows_only_when_needed():
    """TMA wants 16-byte row strides: LSE/Delta of Sq not a multiple of 4 go to a padded copy."""
    aligned = torch.randn(2, 3, 64)
    assert gluon_backward._tma_rows(aligned) is aligned
    odd = torch.randn(2, 3, 257)
    rows = gluon_backward._tma_rows(odd)
    assert rows is not odd and torch.equal(rows, odd)
    assert rows.stride() == (3 * 260, 260, 1) and gluon_backward._tma_ok(rows)


def test_programs_counts_one_cta_per_128_keys_per_kv_head():
    q = torch.empty(3, 100, 12, 64)
    k = torch.empty(3, 300, 2, 64)
    assert gluon_backward.programs(q, k) == 3 * 2 * 3


def test_varlen_variants_are_compiled_for_every_dispatched_schedule():
    """flash_attn_varlen_func's backward dispatches the fused kernel's packed variants: each is in
    the compile list (test_gluon_compile compiles them), with and without a window."""
    import dataclasses
    names = {v.name for v in gluon_backward.GLUON_BACKWARD_VARIANTS}
    for d in gluon_backward.FUSED_HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                packed = dataclasses.replace(gluon_backward.default_variant(d, dtype, causal, True), varlen=True)
                assert packed.name.endswith("-dq-varlen") and packed.name in names
                if d in gluon_backward.WINDOW_HEAD_DIMS:
                    assert dataclasses.replace(packed, window=True).name.endswith("-dq-win-varlen")
                    assert dataclasses.replace(packed, window=True).name in names


def _packed_call(d=128, heads=8, heads_k=2, dtype=torch.bfloat16):
    cu_q = torch.tensor([0, 300, 301, 431, 431], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 340, 740, 804], dtype=torch.int32)
    q = torch.randn(1, 431, heads, d, dtype=dtype)
    k = torch.randn(1, 804, heads_k, d, dtype=dtype)
    v = torch.randn_like(k)
    lse = torch.randn(1, heads, gluon_backward.packed_row_width(431, 4))  # packed_row_copy's layout
    return q, k, v, lse, cu_q, cu_k


@pytest.mark.parametrize("d, causal, window", [(128, True, (-1, 0)), (64, False, (-1, -1)),
                                               (128, False, (700, 300)), (128, True, (600, 0))])
def test_varlen_launch_takes_the_packed_variant(monkeypatch, d, causal, window):
    """gluon_dkdv with cu_seqlens: the packed variant (its window variant for a window), a grid of the
    longest sequence's key blocks x KV heads x sequences, the offsets and dK/dV as its pointer
    arguments (dK/dV for the masked stores of a sequence's last key block). Without them, the
    plain variant with no offsets. The GPU parts stubbed."""
    import dataclasses
    q, k, v, lse, cu_q, cu_k = _packed_call(d)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_accum = torch.zeros(q.shape)
    launches = []
    monkeypatch.setattr(gluon_backward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    gluon_backward.gluon_dkdv(q, k, v, torch.randn_like(q), lse, torch.randn_like(lse), dk, dv, softmax_scale=0.1,
                              causal=causal, dq_accum=dq_accum, window_size=window, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_k=400)
    (jit, grid, tensors, scalars, options, descriptors), = launches
    variant = dataclasses.replace(gluon_backward.default_variant(d, "bf16", causal, True), varlen=True)
    windowed = window[0] >= 0 or (not causal and window[1] >= 0)
    if windowed:
        variant = dataclasses.replace(variant, window=True)
    assert variant in gluon_backward.GLUON_BACKWARD_VARIANTS
    assert options is gluon_backward._launch_options(variant) and options["VARLEN"]
    assert grid == (4, 2, 4)  # 400 keys in blocks of 128, Hk, sequences
    assert tensors[0] is cu_q and tensors[1] is cu_k and tensors[2] is dk and tensors[3] is dv
    lse = torch.randn(1, 8, 431)
    gluon_backward.gluon_dkdv(q, k, v, torch.randn_like(q), lse, torch.randn_like(lse), dk, dv, softmax_scale=0.1,
                              causal=causal, dq_accum=dq_accum, window_size=window)
    (_, grid, tensors, _, options, _) = launches[1]
    assert not options["VARLEN"] and grid == (7, 2, 1) and tensors[:2] == (None, None)


def test_varlen_launch_refuses_what_it_cannot_address():
    """int64 offsets, offsets of two lengths, a packed batch of more than one entry and dK/dV that
    are not contiguous are refused before any launch."""
    q, k, v, lse, cu_q, cu_k = _packed_call()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, torch.randn_like(q), lse, torch.randn_like(lse))
    bad = [dict(cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k.long()), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k[:-1]),
           dict(cu_seqlens_q=cu_q, cu_seqlens_k=None)]
    for kwargs in bad:
        with pytest.raises(ValueError, match="cu_seqlens"):
            gluon_backward.gluon_dkdv(*args, dk, dv, softmax_scale=0.1, causal=True, max_seqlen_k=400, **kwargs)
    strided = torch.empty(1, 804, 2, 256, dtype=k.dtype)[..., :128]
    with pytest.raises(ValueError, match="contiguous"):
        gluon_backward.gluon_dkdv(*args, strided, dv, softmax_scale=0.1, causal=True, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_k=400)
    with pytest.raises(ValueError, match="packed_row_copy"):
        gluon_backward.gluon_dkdv(*args[:4], lse[..., :431], lse[..., :431], dk, dv, softmax_scale=0.1,
                                  causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=400)
    two = [t.expand(2, *t.shape[1:]) for t in args]
    with pytest.raises(ValueError, match="packed batch entry"):
        gluon_backward.gluon_dkdv(*two, dk, dv, softmax_scale=0.1, causal=True,
                                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=400)


@pytest.mark.parametrize("lengths", [[300, 1, 130, 0, 517], [4, 4, 4], [0, 0], [7], [1, 2, 3, 5, 8, 13, 21]])
def test_packed_row_starts_are_aligned_and_keep_sequences_apart(lengths):
    """Every sequence's LSE/Delta rows start at a multiple of 4 (TMA's innermost coordinates), after
    the previous sequence's last row plus at least one row of zeros, within packed_row_width."""
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    starts = gluon_backward.packed_row_starts(cu).tolist()
    width = gluon_backward.packed_row_width(sum(lengths), len(lengths))
    assert all(s % 4 == 0 for s in starts) and width % 4 == 0
    ends = [s + n for s, n in zip(starts, lengths)]
    assert all(e < s for e, s in zip(ends, starts[1:])) and ends[-1] < width
    rows = torch.randn(3, sum(lengths))
    copy = gluon_backward.packed_row_copy(rows, cu)
    assert copy.shape == (1, 3, width)
    seen = torch.zeros(width, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        assert torch.equal(copy[0, :, s:s + n], rows[:, int(cu[b]):int(cu[b]) + n])
        seen[s:s + n] = True
    assert not copy[0, :, ~seen].any()  # zeros everywhere else


def test_preprocess_writes_the_aligned_rows_the_gluon_kernel_reads():
    """backward._attn_bwd_preprocess with ALIGNED (through the interpreter): Delta = rowsum(dO * O)
    and the LSE in packed_row_copy's layout, nothing else written there."""
    from flashtile.kernels.forward import head_dim_padded
    lengths = [300, 1, 130, 0, 67]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total, heads, d = sum(lengths), 3, 40
    out, dout = torch.randn(1, total, heads, d), torch.randn(1, total, heads, d)
    lse = torch.randn(1, heads, total)
    delta = torch.full_like(lse, float("nan"))
    width = gluon_backward.packed_row_width(total, len(lengths))
    aligned = torch.zeros(2, 1, heads, width)
    so, sd, sl = out.stride(), dout.stride(), lse.stride()
    backward._attn_bwd_preprocess[(-(-max(lengths) // 64), heads, len(lengths))](
        out, dout, None, delta, cu, lse, aligned[0], aligned[1], 0, so[1], so[2], 0, sd[1], sd[2], 0, sl[1],
        aligned.stride(2), total, BLOCK_M=64, HEAD_DIM=d, HEAD_DIM_PAD=head_dim_padded(d), HAS_DLSE=False,
        VARLEN=True, ALIGNED=True)
    want_delta = (out[0] * dout[0]).sum(-1).t()
    assert torch.equal(aligned[0], gluon_backward.packed_row_copy(lse[0], cu))
    torch.testing.assert_close(aligned[1], gluon_backward.packed_row_copy(want_delta, cu), rtol=1e-5, atol=1e-5)
    assert torch.isnan(delta).all()  # the plain Delta rows are not written then


def _stub_gpu_answers(monkeypatch, case: dict, q_shape: tuple, k_shape: tuple):
    """Stand-ins for q and k (shapes without the head dim, case["d"] or 128) on a GPU the rule
    takes, with ``case``'s SM count and switches; returns (q, k)."""
    from types import SimpleNamespace
    from flashtile.kernels import forward, gluon_forward
    d = case.get("d", 128)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    monkeypatch.setattr(forward, "GLUON_ENABLED", True)
    monkeypatch.setattr(forward, "GLUON_WINDOW", True)
    monkeypatch.setattr(gluon_backward, "supported", lambda *args, **kw: True)
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: case.get("sms", 132))
    for name, key, default in (("GLUON_VARLEN", "varlen_switch", True), ("GLUON_FUSED_DQ", "fused_switch", True),
                               ("GLUON_DKDV", "dkdv_switch", False), ("GLUON_SOFTCAP", "softcap_switch", True)):
        monkeypatch.setattr(backward, name, case.get(key, default))
    return (SimpleNamespace(is_cuda=True, shape=(*q_shape, d), device=None),
            SimpleNamespace(is_cuda=True, shape=(*k_shape, d), device=None))


@pytest.mark.parametrize("case, expected", [
    (dict(), "fused"), (dict(deterministic=True), None), (dict(varlen_switch=False), None),
    (dict(fused_switch=False, dkdv_switch=True), None), (dict(sms=10_000), None),
    (dict(window=(600, 0)), "fused"), (dict(window=(300, 0)), None), (dict(window=(600, 0), d=64), None),
    (dict(flag="SOFTCAP"), "fused"), (dict(flag="SOFTCAP", softcap_switch=False), None),
    (dict(flag="SOFTCAP", window=(600, 0)), "fused"), (dict(flag="DROPOUT"), None),
    (dict(sms=300, max_k=3584), "fused"), (dict(sms=300, max_k=3583), None), (dict(sms=300), None),
    (dict(sms=329, max_k=4000), None), (dict(sms=300, max_k=4000, d=64), None),
    (dict(sms=300, max_k=4000, deterministic=True), None), (dict(sms=300, max_k=4000, window=(600, 0)), None)])
def test_backward_rule_for_packed_sequences(monkeypatch, case, expected):
    """backward.gluon_backward_mode with VARLEN: the fused Gluon kernel under the plain calls' rule
    (deterministic=False, no ALiBi/dropout, a softcap with GLUON_SOFTCAP, windows of 512+ keys at
    d128, programs >= SMs,
    counted from the packed keys; or from 0.78 of the SMs at d128 without a window where the longest
    sequence has 3584+ keys), never the dK/dV-only opt-in; diag_offset (0 for packed calls,
    whose sequences are each bottom-right) is not compared with the packed lengths. The GPU's
    answers stubbed."""
    q, k = _stub_gpu_answers(monkeypatch, case, (1, 5000, 16), (1, 4000, 8))  # 32 x 8 = 256 programs
    left, right = case.get("window", (-1, 0))
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=False, ALIBI=False, DROPOUT=False,
                 VARLEN=True, UPCAST=False)
    if "flag" in case:
        flags[case["flag"]] = True
    mode = backward.gluon_backward_mode(q, k, k, q, flags, 0, right, False, case.get("deterministic", False), left,
                                        max_seqlen_k=case.get("max_k", 0))
    assert mode == expected


@pytest.mark.parametrize("case, expected", [
    (dict(), "fused"), (dict(softcap_switch=False), None), (dict(deterministic=True), None),
    (dict(deterministic=True, dkdv_switch=True), None), (dict(fused_switch=False, dkdv_switch=True), None),
    (dict(d=64), "fused"), (dict(window=(600, 0)), "fused"), (dict(window=(600, 0), d=64), None),
    (dict(sms=10_000), None)])
def test_backward_rule_with_a_softcap(monkeypatch, case, expected):
    """backward.gluon_backward_mode with SOFTCAP on plain calls: the fused kernel's softcap variants
    under the same rule as without (GLUON_SOFTCAP on), never the dK/dV-only kernel, which has none.
    The GPU's answers stubbed."""
    q, k = _stub_gpu_answers(monkeypatch, case, (2, 4000, 16), (2, 4000, 8))  # 32 x 8 x 2 = 512 programs
    left, right = case.get("window", (-1, 0))
    flags = dict(HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=True, ALIBI=False, DROPOUT=False,
                 VARLEN=False, UPCAST=False)
    mode = backward.gluon_backward_mode(q, k, k, q, flags, 0, right, False, case.get("deterministic", False), left)
    assert mode == expected


def test_softcap_variants_are_compiled_for_every_dispatched_schedule():
    """Every fused variant has its softcap twins in the compile list (test_gluon_compile compiles them),
    by exp2's formula and by tanh.approx, and only those: the dK/dV-only kernel has none."""
    variants = gluon_backward.GLUON_BACKWARD_VARIANTS
    fused = [v for v in variants if v.fused_dq and not v.softcap]
    capped = [v for v in variants if v.softcap and not v.softcap_approx]
    approx = [v for v in variants if v.softcap_approx]
    assert capped and len(capped) == len(fused) == len(approx) and all(v.fused_dq for v in capped + approx)
    assert {gluon_backward.with_softcap(v) for v in fused} == set(capped)
    assert {gluon_backward.with_softcap(v, approx=True) for v in fused} == set(approx)
    assert all(v.name.endswith("-softcap") for v in capped)
    assert all(v.name.endswith("-softcap-approx") and v.softcap for v in approx)
    assert all(gluon_backward._launch_options(v)["SOFTCAP"] == 2 for v in approx)
    assert all(gluon_backward._launch_options(v)["SOFTCAP"] is True for v in capped)


@pytest.mark.parametrize("window, varlen", [((-1, 0), False), ((-1, -1), False), ((600, 0), False),
                                            ((-1, 0), True), ((700, 300), True)])
def test_softcap_launch_takes_the_softcap_variant_and_the_forwards_scalars(monkeypatch, window, varlen):
    """gluon_dkdv with ``softcap``: the softcap twin of the variant it would take without, and the
    forward's score scalars (gluon_forward.score_scalars: qk_scale = softcap log2(e), softcap_in =
    scale / softcap); a softcap variant given for a call without one is refused. The GPU parts
    stubbed."""
    import dataclasses
    from flashtile.kernels.gluon_forward import score_scalars
    q, k, v, lse, cu_q, cu_k = _packed_call(128)
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=400) if varlen else {}
    if not varlen:
        lse = torch.randn(1, 8, 431)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    causal = window == (-1, 0)
    launches = []
    monkeypatch.setattr(gluon_backward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    args = (q, k, v, torch.randn_like(q), lse, torch.randn_like(lse), dk, dv)
    gluon_backward.gluon_dkdv(*args, softmax_scale=0.1, causal=causal, dq_accum=torch.zeros(q.shape),
                              window_size=window, softcap=30.0, **packed)
    (_, _, _, scalars, options, _), = launches
    plain = gluon_backward.default_variant(128, "bf16", causal, True)
    plain = dataclasses.replace(plain, window=window[0] >= 0 or (not causal and window[1] >= 0), varlen=varlen)
    variant = gluon_backward.with_softcap(plain)
    assert variant in gluon_backward.GLUON_BACKWARD_VARIANTS
    assert options is gluon_backward._launch_options(variant) and options["SOFTCAP"]
    qk_scale, softcap_in = score_scalars(0.1, 30.0)
    assert scalars[3] == qk_scale and scalars[4] == 0.1 and scalars[-1] == softcap_in
    gluon_backward.gluon_dkdv(*args, softmax_scale=0.1, causal=causal, dq_accum=torch.zeros(q.shape),
                              window_size=window, **packed)
    assert not launches[1][4]["SOFTCAP"] and launches[1][3][3] == 0.1 * gluon_backward.LOG2E
    gluon_backward.gluon_dkdv(*args, softmax_scale=0.1, causal=causal, dq_accum=torch.zeros(q.shape),
                              window_size=window, softcap=30.0, variant=plain, **packed)
    assert launches[2][4] is options  # a variant given without the softcap gets it, as a window
    with pytest.raises(ValueError, match="softcap"):
        gluon_backward.gluon_dkdv(*args, softmax_scale=0.1, causal=causal, dq_accum=torch.zeros(q.shape),
                                  window_size=window, variant=variant, **packed)


def test_backward_hands_the_softcap_to_the_fused_kernel(monkeypatch):
    """flash_attn_func's backward with a softcap, the fused mode forced: the Gluon launch gets the
    softcap variant and the scalars of the call's softcap and scale (the launch stubbed; the
    interpreter runs the preprocess)."""
    from flashtile.kernels.gluon_forward import score_scalars
    import flashtile
    launches = []
    monkeypatch.setattr(backward, "gluon_backward_mode", lambda *args, **kw: "fused")
    monkeypatch.setattr(gluon_backward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    q = torch.randn(1, 70, 4, 64, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 90, 2, 64, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 90, 2, 64, dtype=torch.float16, requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True, softcap=20.0, softmax_scale=0.2)
    out.sum().backward()
    (_, grid, _, scalars, options, _), = launches
    assert options["SOFTCAP"] and options["CAUSAL"] and options["FUSED_DQ"] and grid == (1, 2, 1)
    assert scalars[3:5] == (score_scalars(0.2, 20.0)[0], 0.2) and scalars[-1] == score_scalars(0.2, 20.0)[1]
    assert options["SOFTCAP"] is True  # exp2's formula: the forward on a CPU never takes tanh.approx


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_told_of_tanh_approx_takes_the_approx_variant(monkeypatch, varlen):
    """attention_backward with ``softcap_approx`` (a training forward that took tanh.approx): the
    fused launch gets the tanh.approx twin of the variant it takes with the formula (SOFTCAP 2), with
    the same scalars; without a softcap the flag changes nothing. The launch stubbed; the
    interpreter runs the preprocess."""
    launches = []
    monkeypatch.setattr(backward, "gluon_backward_mode", lambda *args, **kw: "fused")
    monkeypatch.setattr(gluon_backward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    if varlen:
        q, k, v, _, cu_q, cu_k = (t[0] if t.dim() == 4 else t for t in _packed_call(64))
        lse = torch.randn(8, q.shape[0])
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=400)
    else:
        q, k, v = (torch.randn(1, n, h, 64, dtype=torch.bfloat16) for n, h in ((70, 4), (90, 2), (90, 2)))
        lse, packed = torch.randn(1, 4, 70), {}
    args = (torch.randn_like(q), q, k, v, torch.randn_like(q), lse)
    kw = dict(softmax_scale=0.2, window_left=-1, window_right=0, diag_offset=0 if varlen else 20,
              deterministic=False, **packed)
    for approx in (False, True):
        backward.attention_backward(*args, softcap=20.0, softcap_approx=approx, **kw)
    backward.attention_backward(*args, softcap_approx=True, **kw)
    (_, _, _, formula_scalars, formula, _), (_, _, _, scalars, options, _), (_, _, _, _, plain, _) = launches
    assert formula["SOFTCAP"] is True and options["SOFTCAP"] == 2 and not plain["SOFTCAP"]
    assert scalars == formula_scalars
    variant = next(v for v in gluon_backward.GLUON_BACKWARD_VARIANTS if gluon_backward._launch_options(v) is options)
    assert variant.softcap_approx and variant.varlen == varlen and variant.causal


@pytest.mark.parametrize("approx, deterministic", [(False, True), (True, True), (True, False)])
def test_portable_backward_told_of_tanh_approx_takes_it_too(monkeypatch, approx, deterministic):
    """attention_backward with ``softcap_approx`` where the fused kernel does not run (no Gluon mode, as
    on deterministic=True or too few programs): the portable kernels get SOFTCAP 2 (their tanh by
    tanh.approx, common.softcap_tanh), else True; the launches recorded, not run."""
    given = []
    monkeypatch.setattr(backward, "gluon_backward_mode", lambda *args, **kw: None)
    monkeypatch.setattr(backward, "_launch_kernels",
                        lambda *args: given.append((args[18]["SOFTCAP"], args[-1], args[-2])))
    q, k, v = (torch.randn(1, n, h, 64, dtype=torch.float16) for n, h in ((40, 4), (50, 2), (50, 2)))
    backward.attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(1, 4, 40),
                                softmax_scale=0.2, window_left=-1, window_right=0, diag_offset=10, softcap=20.0,
                                deterministic=deterministic, softcap_approx=approx)
    backward.attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(1, 4, 40),
                                softmax_scale=0.2, window_left=-1, window_right=0, diag_offset=10,
                                deterministic=deterministic, softcap_approx=approx)
    assert given[0] == ((2 if approx else True), approx, 20.0)
    assert given[1][0] is False and given[1][1] is False  # no softcap: the flag changes nothing
