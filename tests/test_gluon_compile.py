"""The Gluon Hopper forward: every shipped variant compiles to an sm_90 cubin without spills (no GPU
needed), and ``supported`` turns away what the kernel does not handle.

The compiler runs in a subprocess without TRITON_INTERPRET (conftest sets it for this process).
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from flashtile.kernels import forward, gluon_backward, gluon_decode, gluon_forward


@pytest.mark.parametrize("module,shard", [("gluon_forward", "0/2"), ("gluon_forward", "1/2"),
                                          ("gluon_backward", None), ("gluon_decode", None)])
def test_gluon_variants_compile_for_sm90(module, shard):
    """Also the opt-in dK/dV kernel (kernels.gluon_backward) and the paged decode's variants
    (kernels.gluon_decode), within each variant's spill allowance and without wgmmas serialized
    by ptxas (its C7515 advisory). The forward's variants (gluon_forward.compile_checked: 285 of the
    410 shipped, FLASHTILE_COMPILE_ALL=1 for all) in two shards, so that two test workers share a
    cold compile (~5.5 s a variant on the CI machine's cores)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", f"flashtile.kernels.{module}"]
                          + (["--shard", shard] if shard else []), env=env,
                          capture_output=True, text=True, timeout=1500)
    lines = proc.stdout.splitlines()
    variants = {"gluon_forward": gluon_forward.compile_checked(),
                "gluon_backward": gluon_backward.GLUON_BACKWARD_VARIANTS,
                "gluon_decode": gluon_decode.CHECKED}[module]
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        variants = variants[k::n]
    assert len(lines) == len(variants), proc.stdout + proc.stderr[-2000:]
    failed = [line for line in lines if "FAILED" in line or "SPILLS" in line or "SERIALIZED" in line]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + proc.stderr[-2000:]
    assert all(": ok," in line and "local 0 B" in line for line in lines)


def test_variants_cover_every_default():
    names = {v.name for v in gluon_forward.GLUON_VARIANTS}
    for d in (64, 128, 256):
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                assert gluon_forward.default_variant(d, dtype, causal).name in names
    assert len(names) == len(gluon_forward.GLUON_VARIANTS)


def _qkv(dtype=torch.bfloat16, d=128, heads=4, heads_k=4):
    q = torch.randn(2, 64, heads, d, dtype=dtype)
    k = torch.randn(2, 80, heads_k, d, dtype=dtype)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize("causal", [False, True])
def test_supported_is_false_on_cpu(causal):
    q, k, v = _qkv()
    assert not gluon_forward.supported(q, k, v, causal=causal)


def test_options_supported_accepts_the_plain_call():
    assert gluon_forward.options_supported(softmax_scale=0.125)
    assert gluon_forward.options_supported(softmax_scale=None, return_attn_probs=False)
    # sliding windows: any sides (the window variants, with_window)
    for window in ((128, 0), (-1, 7), (0, 0), (300, 300)):
        assert gluon_forward.options_supported(softmax_scale=0.125, window_size=window)


@pytest.mark.parametrize("options", [
    {"dropout_p": 0.1}, {"softcap": -1.0},
    {"alibi_slopes": torch.ones(4)}, {"cu_seqlens_q": torch.zeros(3, dtype=torch.int32)},
    {"block_table": torch.zeros(2, 4, dtype=torch.int32)}, {"return_attn_probs": True},
    {"softmax_scale": -0.1},
])
def test_options_supported_turns_away(options):
    assert not gluon_forward.options_supported(**options)
    q, k, v = _qkv()
    assert not gluon_forward.supported(q, k, v, causal=True, **options)


def test_softcap_takes_the_kernel_only_with_its_switch(monkeypatch):
    """A positive softcap runs in the kernel (SOFTCAP_IN_KERNEL, on by default); with the switch off
    ``supported`` turns it away and the portable kernel takes the call."""
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    assert gluon_forward.options_supported(softmax_scale=0.125, softcap=30.0)
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", False)
    assert not gluon_forward.options_supported(softmax_scale=0.125, softcap=30.0)


def test_shapes_supported_accepts_gqa_bf16_and_fp16():
    assert gluon_forward.shapes_supported(*_qkv(heads=8, heads_k=2))
    assert gluon_forward.shapes_supported(*_qkv(dtype=torch.float16, d=64))
    assert gluon_forward.shapes_supported(*_qkv(d=256))
    assert not gluon_forward.shapes_supported(*_qkv(d=256), head_dims=(64, 128))


@pytest.mark.parametrize("case", ["float32", "head_dim_96", "mixed_dtypes", "heads_not_multiple", "3d",
                                  "unaligned_stride"])
def test_shapes_supported_turns_away(case):
    q, k, v = _qkv()
    if case == "float32":
        q, k, v = (t.float() for t in (q, k, v))
    elif case == "head_dim_96":
        q, k, v = _qkv(d=96)
    elif case == "mixed_dtypes":
        k = k.half()
    elif case == "heads_not_multiple":
        q, k, v = _qkv(heads=6, heads_k=4)
    elif case == "unaligned_stride":  # rows 2 elements apart: not a 16-byte multiple
        q = torch.randn(2, 64, 4, 130, dtype=torch.bfloat16)[..., :128]
    else:
        q = q[0]
    assert not gluon_forward.shapes_supported(q, k, v)
    assert not gluon_forward.supported(q, k, v, causal=False)


def test_variant_names_are_distinct_and_describe_the_schedule():
    v = gluon_forward.GluonVariant(128, "bf16", True, persistent=True)
    assert v.name == "gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent"
    sync = gluon_forward.GluonVariant(128, "fp16", False, warp_specialize=False, pingpong=False)
    assert sync.name.endswith("-sync")


def test_fp8_variants_cover_both_masks_at_every_head_dim():
    names = {v.name for v in gluon_forward.GLUON_VARIANTS}
    for d in (64, 128, 256):
        for causal in (False, True):
            variant = gluon_forward.default_variant(d, "fp8", causal)
            assert variant.fp8 and variant.name in names
            assert variant.block_n in (64, 128, 256)
    assert {d for d, _ in gluon_forward.FP8_DISPATCH} == set(gluon_forward.FP8_HEAD_DIMS)


def _fp8_qkv(seqlen_k=300, d=128, heads=4, heads_k=2):
    from flashtile.kernels.forward import keys_contiguous
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(2, 200, heads, d).to(e4m3)
    k = torch.randn(2, seqlen_k, heads_k, d).to(e4m3)
    v = keys_contiguous(torch.randn(2, seqlen_k, heads_k, d).to(e4m3))
    return q, k, v


def test_fp8_shapes_supported_accepts_whole_tiles_of_the_variant():
    q, k, v = _fp8_qkv()
    assert gluon_forward.fp8_shapes_supported(q, k, v, (128, 256))
    assert gluon_forward.fp8_shapes_supported(q, k, v, (64, 256))
    # 128-key scale blocks are whole tiles of the causal variant (128 keys), not of the full one (256)
    full = gluon_forward.default_variant(128, "fp8", False)
    causal = gluon_forward.default_variant(128, "fp8", True)
    assert gluon_forward.fp8_shapes_supported(q, k, v, (64, 128), causal=True) == (causal.block_n <= 128)
    assert gluon_forward.fp8_shapes_supported(q, k, v, (64, 128), causal=False) == (full.block_n <= 128)


@pytest.mark.parametrize("case", ["query_block_32", "not_power_of_two", "v_not_transposed", "bf16",
                                  "head_dim_64", "heads_not_multiple"])
def test_fp8_shapes_supported_turns_away(case):
    q, k, v = _fp8_qkv()
    blocks = (128, 256)
    if case == "query_block_32":
        blocks = (32, 256)
    elif case == "not_power_of_two":
        blocks = (192, 256)
    elif case == "v_not_transposed":
        v = v.contiguous()  # flash_attn's layout: the kernel reads V^T through TMA
    elif case == "bf16":
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    elif case == "head_dim_64":
        q, k, v = _fp8_qkv(d=64)
    elif case == "heads_not_multiple":
        q, k, v = _fp8_qkv(heads=3, heads_k=2)
    assert not gluon_forward.fp8_shapes_supported(q, k, v, blocks)


def test_fp8_dispatch_is_off_on_cpu():
    from flashtile.kernels.forward import fp8_forward_kernel_name, gluon_fp8_applies
    q, k, v = _fp8_qkv()
    assert not gluon_fp8_applies(q, k, v, window_left=-1, window_right=-1, diag_offset=100,
                                 scale_blocks=(128, 256))
    assert fp8_forward_kernel_name(q, k, v, causal=True, scale_blocks=(128, 256)) == "triton"


def test_fp8_forward_without_descales_or_with_wrong_blocks_is_refused_before_launch():
    q, k, v = _fp8_qkv()
    with pytest.raises(ValueError, match="descales"):
        gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=0.1, causal=False)
    descales = (torch.ones(2, 4, 2), torch.ones(2, 2, 3), torch.ones(2, 2, 3))
    with pytest.raises(ValueError, match="scale blocks"):  # 32-row query blocks: not a consumer's 64
        gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=0.1, causal=False,
                                              descales=descales, scale_blocks=(32, 256))


def test_fp8_explicit_variant_of_another_head_dim():
    """A benchmark's explicit e4m3 variant may be of any compiled head dim; dispatch (no variant)
    keeps to FP8_DISPATCH, the pairs checked on a GPU."""
    q, k, v = _fp8_qkv(d=64)
    variant = gluon_forward.default_variant(64, "fp8", False)
    assert variant.name in {v.name for v in gluon_forward.GLUON_VARIANTS}
    assert gluon_forward.fp8_shapes_supported(q, k, v, (64, 256), variant=variant)
    assert not gluon_forward.fp8_shapes_supported(q, k, v, (64, 128), variant=variant)  # 256-key tiles
    assert ((64, False) in gluon_forward.FP8_DISPATCH) == gluon_forward.fp8_shapes_supported(
        q, k, v, (64, 256))


def test_dispatch_runs_only_compiled_variants_and_causal_deals_snake_rows():
    shipped = set(gluon_forward.GLUON_VARIANTS)
    assert gluon_forward.DISPATCHED <= shipped
    for variant in gluon_forward.DISPATCHED:
        assert variant.snake == (variant.causal and variant.persistent)
    with pytest.raises(ValueError, match="snake"):
        gluon_forward.GluonVariant(128, causal=True, persistent=False, snake=True)


@pytest.mark.parametrize("head_dim, heads, seqlen, expected", [
    (128, 16, 1024, True), (128, 16, 2048, True), (128, 16, 8192, True),  # many heads, short
    (128, 16, 16384, False), (256, 16, 16384, False),  # 128 query blocks a head: long tiles would end it
    (128, 12, 4096, False),  # 12 heads at batch 1: too few tiles to deal evenly head by head
    (64, 16, 2048, False),  # three consumers: never
])
def test_heads_major_order_where_the_model_balances_it(head_dim, heads, seqlen, expected):
    batch = max(1, 16384 // seqlen) if heads == 16 else 1
    variant = gluon_forward.default_variant(head_dim, "bf16", True)
    group = gluon_forward.head_group_order(variant, seqlen, seqlen, batch * heads, 132)
    assert (group == 1) == expected
    full = gluon_forward.default_variant(head_dim, "bf16", False)
    assert gluon_forward.head_group_order(full, seqlen, seqlen, batch * heads, 132) == batch * heads


def test_three_consumer_groups_follow_the_model():
    """d64 causal (three consumers): groups of ~sm_count / k heads where the model balances them,
    never (batch, head)-major; query-block-major (num_bh) otherwise."""
    variant = gluon_forward.default_variant(64, "bf16", True)
    assert gluon_forward.head_group_order(variant, 4096, 4096, 4 * 32, 132) == 22
    assert gluon_forward.head_group_order(variant, 8192, 8192, 2 * 32, 132) == 64
    for n in (1024, 2048, 4096, 8192, 16384):
        assert gluon_forward.head_group_order(variant, n, n, 16384 // n * 32, 132) > 1
    full = gluon_forward.default_variant(64, "bf16", False)
    assert gluon_forward.head_group_order(full, 4096, 4096, 128, 132) == 128


def test_lazy_rescale_is_for_16_bit_inputs():
    """e4m3 kernels measured slower with FlashAttention-4's lazy rescale: refused there."""
    with pytest.raises(ValueError, match="lazy rescale"):
        gluon_forward.GluonVariant(128, "fp8", lazy_rescale=True)
    lazy = gluon_forward.GluonVariant(128, "bf16", lazy_rescale=True)
    assert lazy.name.endswith("-lazy")
    assert gluon_forward._kernel_constexprs(lazy)["LAZY_RESCALE"] is True


def _emulate_exp2_poly(x: torch.Tensor) -> torch.Tensor:
    """The polynomial half of exp2_ptx step by step in fp32 (each PTX instruction rounds to fp32;
    the FMAs are single-rounding, done here in float64 and rounded once)."""
    c3, c2, c1, c0 = (torch.tensor([int(c[2:], 16)], dtype=torch.int32).view(torch.float32).double()
                      for c in gluon_forward._EXP2_POLY)
    magic = torch.tensor(12582912.0, dtype=torch.float32)
    t = torch.clamp(x, min=-125.0)
    r = t + magic
    n = r - magic
    f = (t - n).double()
    p = (f * c3 + c2).float().double()
    p = (p * f + c1).float().double()
    p = (p * f + c0).float()
    return (p.view(torch.int32) + (r.view(torch.int32) << 23)).view(torch.float32)


def test_exp2_polynomial_matches_exp2_to_1e_4():
    """The FMA-pipe exponential (FlashAttention-4's) within 8e-5 relative of 2^x over the scores a
    softmax tile produces (x <= 8 with the lazy rescale's reference), normal down to the clamp."""
    x = torch.cat([torch.rand(200_000) * 133.0 - 125.0, torch.arange(-125, 9).float(),
                   torch.arange(-125, 9).float() + 0.5, torch.tensor([-0.0, -1e-7, 1e-7])])
    got = _emulate_exp2_poly(x).double()
    want = torch.exp2(x.double())
    assert torch.all((got - want).abs() / want <= 8e-5)
    below = _emulate_exp2_poly(torch.tensor([-126.0, -1000.0, float("-inf")]))
    assert torch.all((below > 0) & (below < 2.0 ** -124))  # clamped, never a wrapped exponent


def test_exp2_ptx_splits_each_group_between_mufu_and_the_polynomial():
    for poly in range(9):
        ptx = gluon_forward.exp2_ptx(8, poly)
        assert ptx.count("ex2.approx") == 8 - poly
        assert ptx.count("0f4B400000") == 2 * poly
        outs = {int(tok[1:].rstrip(",;")) for line in ptx.splitlines() for tok in line.split()[1:2]
                if tok.startswith("$")}
        assert outs == set(range(8))  # every output written once per group
    with pytest.raises(ValueError, match="exp2_poly"):
        gluon_forward.GluonVariant(128, "fp8", exp2_poly=9)
    variant = gluon_forward.GluonVariant(128, "fp8", exp2_poly=2)
    assert variant.name.endswith("-poly2")
    assert gluon_forward._kernel_constexprs(variant)["EXP2_POLY"] == 2


def test_consumers_without_rows_skip_the_key_range_only_with_own_ranges():
    """OWN_RANGE 2: a consumer whose rows all lie past the query length runs tile 0 only (d64 causal
    default); 1: the whole own range regardless (the "-own-allrows" alternate); 0: no own ranges."""
    default = gluon_forward.default_variant(64, "bf16", True)
    assert default.own_range and default.skip_empty_rows
    assert gluon_forward._kernel_constexprs(default)["OWN_RANGE"] == 2
    allrows = [v for v in gluon_forward.GLUON_VARIANTS if "-own-allrows" in v.name]
    assert len(allrows) == 1 and gluon_forward._kernel_constexprs(allrows[0])["OWN_RANGE"] == 1
    plain = gluon_forward.default_variant(128, "bf16", True)
    assert gluon_forward._kernel_constexprs(plain)["OWN_RANGE"] == 0


def test_p_pack_is_the_default_and_its_alternate_is_named():
    """16-bit P packed per pair in PTX by default (the PRMT-free conversion); the old conversion
    stays as a "-prmt" alternate for A/B runs; e4m3 names do not change (P goes through shared
    memory there)."""
    names = {v.name for v in gluon_forward.GLUON_VARIANTS}
    for d in (64, 128, 256):
        for c in (False, True):
            variant = gluon_forward.default_variant(d, "bf16", c)
            assert variant.p_pack_asm and gluon_forward._kernel_constexprs(variant)["P_PACK_ASM"]
            assert variant.name + "-prmt" in names
            # "$" picks the default alone; a plain part picks its "-prmt" alternate too
            assert gluon_forward.variants_named([variant.name + "$"]) == [variant]
            assert variant.name + "-prmt" in {v.name for v in gluon_forward.variants_named([variant.name])}
    fp8 = gluon_forward.GluonVariant(128, "fp8", p_pack_asm=False)
    assert not fp8.name.endswith("-prmt")


def _assert_same_launch(got, general):
    """A cached plan's launch (jit, grid, tensors, scalars, options, descriptors) against the general
    path's: the same kernel, grid, scalars and options object, descriptors of the same geometry over
    the same inputs, the output's over this call's output (the last pointer)."""
    jit, grid, tensors, scalars, options, descriptors = got
    assert (jit, grid, scalars) == general[:2] + general[3:4]
    assert options is general[4]
    assert len(descriptors) == len(general[5]) == 4
    for mine, theirs in zip(descriptors, general[5]):
        assert (tuple(mine.shape), tuple(mine.strides), mine.block_shape, mine.layout) == \
               (tuple(theirs.shape), tuple(theirs.strides), theirs.block_shape, theirs.layout)
    assert [x.base.data_ptr() for x in descriptors[:3]] == [y.base.data_ptr() for y in general[5][:3]]
    assert descriptors[3].base is tensors[7]


@pytest.mark.parametrize("shape", [
    # (B, Sq, Sk, H, Hk, D, causal, dtype)
    (1, 2048, 2048, 12, 2, 128, True, torch.bfloat16),
    (2, 1000, 3000, 8, 8, 64, True, torch.float16),
    (3, 777, 300, 4, 1, 256, False, torch.bfloat16),
    (4, 4096, 4096, 32, 32, 64, True, torch.bfloat16),
    (2, 129, 129, 16, 4, 128, False, torch.float16),
])
def test_plain_forward_launches_what_gluon_attention_forward_launches(monkeypatch, shape):
    """The cached plan of a plain call gives the launch the general path would make (same kernel,
    grid, options, scalars, descriptor geometry), checked on the CPU with the GPU parts stubbed."""
    b, sq, sk, h, hk, d, causal, dtype = shape
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "supported", lambda *a, **kw: gluon_forward.shapes_supported(*a[:3]))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    monkeypatch.setattr(gluon_forward, "_PLAIN", {})
    scale = d ** -0.5
    for _ in range(2):  # the second call takes the cached plan
        out, lse = gluon_forward.plain_forward(q, k, v, scale, causal)
    ref_out, ref_lse = gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal)
    assert len(launches) == 3 and len(gluon_forward._PLAIN) == 1
    plain, cached, general = launches
    for got in (plain, cached):
        _assert_same_launch(got, general)
        tensors, descriptors = got[2], got[5]
        # the lse stands in for every pointer a plain call does not read; Out (read by packed
        # sequences' last blocks only) is the output; the work list (packed sequences') and the
        # sinks (read with SINKS only) the lse again
        assert len(tensors) == 10 and all(t.shape == ref_lse.shape for i, t in enumerate(tensors) if i != 7)
        assert tensors[7].shape == ref_out.shape
        assert [x.base is y for x, y in zip(descriptors[:3], (q, k, v))] == [True] * 3
    assert out.shape == ref_out.shape and out.stride() == ref_out.stride() and out.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.stride() == ref_lse.stride()


def test_plain_forward_declines_what_the_kernel_does_not_take(monkeypatch):
    """None (nothing launched) for a head dim outside HEAD_DIMS, a misaligned base or a
    non-positive scale; the caller then runs the general path."""
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "supported", lambda *a, **kw: gluon_forward.shapes_supported(*a[:3]))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(gluon_forward, "_PLAIN", {})
    q, k, v = _qkv(d=96)
    assert gluon_forward.plain_forward(q, k, v, 0.1, False) is None
    q, k, v = _qkv()
    assert gluon_forward.plain_forward(q, k, v, -0.1, False) is None
    flat = torch.randn(2 * 64 * 4 * 128 + 1, dtype=torch.bfloat16)
    assert gluon_forward.plain_forward(flat[1:].view(2, 64, 4, 128), k, v, 0.1, False) is None
    assert not launches


def test_d256_non_causal_takes_q_from_registers_up_to_4k_keys():
    """dispatch_variant: d256 non-causal calls with at most Q_REGS_MAX_KEYS keys run the variant
    holding Q's first half in registers; longer or causal ones, and other head dims, the default."""
    limit = gluon_forward.Q_REGS_MAX_KEYS
    for dtype in ("bf16", "fp16"):
        short = gluon_forward.dispatch_variant(256, dtype, False, limit)
        assert short.q_regs == 128 and short.name.endswith("-qr128") and short in gluon_forward.DISPATCHED
        assert gluon_forward.dispatch_variant(256, dtype, False, limit + 1) == \
            gluon_forward.default_variant(256, dtype, False)
        assert gluon_forward.dispatch_variant(256, dtype, True, 512).q_regs == 0
    for d in (64, 128):
        default = gluon_forward.default_variant(d, "bf16", False)
        assert gluon_forward.dispatch_variant(d, "bf16", False, 512) == default
    with pytest.raises(ValueError, match="q_regs"):
        gluon_forward.GluonVariant(256, q_regs=64)
    with pytest.raises(ValueError, match="q_regs"):
        gluon_forward.GluonVariant(256, "fp8", q_regs=128)


def test_plain_forward_with_seqused_k_launches_what_the_general_path_does(monkeypatch):
    """Keys per sequence from the device: the seqused_k variant of the dispatched schedule, the
    lengths as the fifth pointer, the same launch from the cached plan and the general path."""
    q = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 5000, 2, 128, dtype=torch.bfloat16)
    lengths = torch.tensor([1000, 4321], dtype=torch.int32)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "supported", lambda *a, **kw: gluon_forward.shapes_supported(*a[:3]))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(gluon_forward, "_PLAIN", {})
    gluon_forward.plain_forward(q, k, k, 0.1, True, seqused_k=lengths)
    gluon_forward.gluon_attention_forward(q, k, k, softmax_scale=0.1, causal=True, seqused_k=lengths)
    plain, general = launches
    assert plain[4] is general[4] and plain[4]["SEQUSED_K"] is True
    assert plain[2][4] is lengths and general[2][4] is lengths
    assert plain[3] == general[3] and plain[1] == general[1]
    gluon_forward.plain_forward(q, k, k, 0.1, True)  # the plain call: its own plan and variant
    assert launches[-1][4]["SEQUSED_K"] is False and len(gluon_forward._PLAIN) == 2


def test_seqused_k_variants():
    """Compiled for every 16-bit schedule dispatch gives (d64 on two consumers: three spill with
    it), refused with e4m3 inputs, named -seqk, and picked by variants_named only when named (the
    packed sequences' page-pool variants, -seqk...-varlen, are test_varlen_variants_are_shipped's)."""
    seqk = [v for v in gluon_forward.GLUON_VARIANTS if v.seqused_k and not v.varlen]
    for d in gluon_forward.HEAD_DIMS:
        for dt in ("bf16", "fp16"):
            for c in (False, True):
                for n in (1, 1 << 20):
                    assert gluon_forward.with_seqused_k(gluon_forward.dispatch_variant(d, dt, c, n)) in seqk
    assert all(v.name.removesuffix("-sinks").endswith(("-seqk", "-seqk-pr16", "-seqk-pr32", "-seqk-pr64"))
               and v.consumers == 2 for v in seqk)
    with pytest.raises(ValueError, match="seqused_k"):
        gluon_forward.GluonVariant(128, "fp8", seqused_k=True)
    assert not any(v.seqused_k for v in gluon_forward.variants_named(["d128", "pq"]))
    assert all(v.seqused_k for v in gluon_forward.variants_named(["seqk"]))
    q = torch.randn(2, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 80, 4, 128, dtype=torch.bfloat16)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="seqused_k"):
            gluon_forward.gluon_attention_forward(q, k, k, softmax_scale=0.1, causal=True, seqused_k=bad)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):  # pages need seqused_k (and a GPU)
        gluon_forward.gluon_attention_forward(q, k, k, softmax_scale=0.1, causal=True, block_table=table)
    assert not gluon_forward.paged_supported(q, k, k, table)  # CPU tensors


def test_page_pools_take_one_box_a_tile_or_the_largest_box_a_page_holds():
    """paged_variant: pages of whole key tiles read as the contiguous cache is (one box a tile),
    others in boxes of the largest of 64/32/16 keys dividing the page (and under the tile); every
    such variant compiled."""
    shipped = set(gluon_forward.GLUON_VARIANTS)
    for d in gluon_forward.HEAD_DIMS:
        base = gluon_forward.dispatch_variant(d, "bf16", True, 1 << 20)
        whole = gluon_forward.paged_variant(base, 256)
        assert whole == gluon_forward.with_seqused_k(base) and whole.page_rows == 0
        assert gluon_forward.paged_variant(base, base.block_n) == whole
        expected = ({16: 16, 48: 16, 32: 32, 96: 32, 64: 64, 192: 64} if base.block_n == 128
                    else {16: 16, 48: 16, 32: 32, 96: 32, 192: 64, 64: 64})
        for page, rows in expected.items():
            variant = gluon_forward.paged_variant(base, page)
            if rows == base.block_n:
                assert variant == whole
                continue
            assert variant.page_rows == rows == gluon_forward.page_box_rows(page, base.block_n)
            assert variant.name.endswith(f"-seqk-pr{rows}") and variant in shipped
        assert whole in shipped
    assert gluon_forward.page_box_rows(8, 128) == 0 and gluon_forward.page_box_rows(24, 64) == 0
    with pytest.raises(ValueError, match="page_rows"):
        gluon_forward.GluonVariant(128, page_rows=16)  # without seqused_k
    with pytest.raises(ValueError, match="page_rows"):
        gluon_forward.GluonVariant(128, seqused_k=True, page_rows=12)


def test_varlen_variants_are_shipped_and_checked():
    """Every schedule a packed call dispatches compiles in the sm_90 check, without the Q prefetch
    (a skipped work tile's Q would be loaded); varlen takes no single-consumer fallback. On page
    pools (seqused_k: keys from the table's pages) bf16 at every box size and fp16 with whole-tile
    pages."""
    names = {v.name for v in gluon_forward.GLUON_VARIANTS}
    for d in gluon_forward.HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                for keys in (1, 1 << 20):
                    variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, dtype, causal, keys))
                    assert variant.name in names and variant.name.endswith("-varlen")
                    assert not variant.prefetch_q
                    for page, rows in ((256, 0), (16, 16), (32, 32), (64, 64)):
                        if dtype == "fp16" and rows:
                            continue
                        base = gluon_forward.default_variant(d, dtype, causal)
                        paged = gluon_forward.varlen_paged_variant(d, dtype, causal, page)
                        assert paged.seqused_k and paged.varlen and not paged.prefetch_q and not paged.q_regs
                        assert paged.page_rows == (rows if rows < base.block_n else 0)
                        assert paged.name in names, paged.name
    for d, causal in gluon_forward.FP8_DISPATCH:
        assert gluon_forward.with_varlen(gluon_forward.default_variant(d, "fp8", causal)).name in names
    base = gluon_forward.default_variant(128, "bf16", False)
    for change in (dict(warp_specialize=False, pingpong=False, prefetch_q=False), dict(prefetch_q=True)):
        with pytest.raises(ValueError, match="varlen"):
            dataclasses.replace(base, varlen=True, **change)


@pytest.mark.parametrize("dtype,d,causal", [(torch.bfloat16, 128, True), (torch.float16, 64, False),
                                            (torch.float8_e4m3fn, 128, False)])
def test_varlen_launch_reads_packed_tensors(monkeypatch, dtype, d, causal):
    """gluon_varlen_forward's launch, checked on the CPU with the GPU parts stubbed: descriptors over
    the packed tensors as one batch entry (e4m3 V^T keys-contiguous), the offsets and the output
    as pointers, the LSE (H, total_q) with no batch stride, a grid over the longest sequence."""
    lens_q, lens_k = [5, 300, 0, 129], [7, 300, 40, 1]
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347, 348], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 8, d).to(dtype)
    k = torch.randn(sum(lens_k), 2, d).to(dtype)
    v = torch.randn(sum(lens_k), 2, d).to(dtype)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    fp8 = dtype == torch.float8_e4m3fn
    descales = None
    if fp8:
        ones = torch.ones(4, 2, 1)
        descales = forward.fp8_kernel_descales(torch.ones(4, 8, 1), ones, ones)
    out, lse = gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.1,
                                                  causal=causal, descales=descales,
                                                  scale_blocks=(512, 512) if fp8 else (0, 0))
    assert out.shape == q.shape and out.dtype == (torch.bfloat16 if fp8 else dtype)
    assert lse.shape == (8, q.shape[0])
    (jit, grid, tensors, scalars, options, descriptors), = launches
    variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, gluon_forward._DTYPES[dtype],
                                                                      causal, 300))
    assert options is gluon_forward._launch_options(variant) and options["VARLEN"]
    blocks = -(-300 // variant.block_m)
    assert scalars[:8] == (0, q.shape[0], 300, 300, 4, 8, blocks, 4)
    assert grid == ((min(blocks * 8 * 4, 132) if variant.persistent else blocks * 8 * 4),)
    assert tensors[4] is cu_k and tensors[6] is cu_q and tensors[7] is out and tensors[0] is lse
    q_desc, k_desc, v_desc, o_desc = descriptors
    assert tuple(q_desc.shape) == (1, *q.shape) and tuple(o_desc.shape) == (1, *q.shape)
    assert tuple(k_desc.shape) == (1, *k.shape)
    if fp8:  # (1, Hk, D, width), keys contiguous, sequence b from column 16 * ceil(start / 16) + 16 * b
        assert v_desc.shape[:3] == (1, 2, d) and v_desc.strides[3] == 1 and v_desc.strides[2] % 16 == 0
        vt = v_desc.base[0].float()
        for b in range(4):
            start, end = int(cu_k[b]), int(cu_k[b + 1])
            column = -(-start // 16) * 16 + 16 * b
            assert torch.equal(vt[:, :, column:column + end - start], v[start:end].float().permute(1, 2, 0))
        assert scalars[9:16] == (8, 1, 4, 2, 9, 9, 1)
    else:
        assert v_desc.base.data_ptr() == v.data_ptr() and tuple(v_desc.shape) == (1, *v.shape)


def _stub_packed_gpu(monkeypatch):
    """The GPU parts packed launches touch, stubbed for the CPU: the launch is recorded, the sm_90
    check answers by the tensors' layout alone."""
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "varlen_supported", lambda q, k, v, cu_q, cu_k, causal=False, *a:
                        gluon_forward._offsets_ok(q, cu_q, cu_k)
                        and gluon_forward.shapes_supported(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    monkeypatch.setattr(gluon_forward, "_PACKED", {})
    return launches


@pytest.mark.parametrize("dtype,d,causal,heads,heads_k,max_k", [
    (torch.bfloat16, 128, True, 8, 2, 300), (torch.float16, 64, False, 4, 4, 300),
    (torch.bfloat16, 256, False, 6, 1, 5000), (torch.bfloat16, 256, True, 4, 2, 300)])
def test_packed_forward_launches_what_gluon_varlen_forward_launches(monkeypatch, dtype, d, causal,
                                                                     heads, heads_k, max_k):
    """The cached plan of a packed call gives the launch gluon_varlen_forward makes (same kernel,
    grid, options, scalars, pointers, descriptor geometry over the same memory), on the first call and
    from the cache; a call with other lengths (max_seqlen) gets its own plan."""
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347, 348], dtype=torch.int32)
    q = torch.randn(434, heads, d).to(dtype)
    k, v = torch.randn(348, heads_k, d).to(dtype), torch.randn(348, heads_k, d).to(dtype)
    launches = _stub_packed_gpu(monkeypatch)
    for _ in range(2):  # the second call takes the cached plan
        out, lse = gluon_forward.packed_forward(q, k, v, cu_q, cu_k, 300, max_k, 0.1, causal)
    ref_out, ref_lse = gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, max_k, softmax_scale=0.1,
                                                          causal=causal)
    assert len(launches) == 3 and len(gluon_forward._PACKED) == 1
    *mine, general = launches
    for got in mine:
        _assert_same_launch(got, general)
        tensors = got[2]
        assert tensors[4] is cu_k and tensors[6] is cu_q and tensors[7].shape == ref_out.shape
        assert all(t.shape == ref_lse.shape for i, t in enumerate(tensors) if i not in (4, 6, 7))
    assert out.shape == ref_out.shape and out.stride() == ref_out.stride() and out.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.stride() == ref_lse.stride()
    gluon_forward.packed_forward(q, k, v, cu_q, cu_k, 299, max_k, 0.1, causal)
    assert len(gluon_forward._PACKED) == 2 and launches[-1][3][2] == 299


@pytest.mark.parametrize("lens", [[2048] * 8, [2048] * 7 + [2047], [1024, 2048] * 4])
def test_equal_length_packed_calls_take_the_plain_calls_tile_order(monkeypatch, lens):
    """Where q and k hold batch x max_seqlen rows (equal lengths), a packed causal launch
    orders its work tiles as the plain call of that batch does (head_group_order's grouping: one
    (sequence, head) pair at a time at 8 x 2048, 16 heads, d128); ragged batches, whose skipped tiles
    the model does not see, stay query-block-major (head_group = every pair), dealt from a work list
    where their empty tiles come to one a CTA."""
    launches = _stub_packed_gpu(monkeypatch)
    heads, d, total, longest = 16, 128, sum(lens), max(lens)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v = (torch.empty(total, heads, d, dtype=torch.bfloat16) for _ in range(3))
    gluon_forward.packed_forward(q, k, v, cu, cu, longest, longest, 0.1, True)
    gluon_forward.gluon_varlen_forward(q, k, v, cu, cu, longest, longest, softmax_scale=0.1, causal=True)
    plain = gluon_forward.head_group_order(gluon_forward.default_variant(d, "bf16", True), longest, longest,
                                           len(lens) * heads, 132)
    expected = plain if total == len(lens) * longest else len(lens) * heads
    kernels = [launch for launch in launches if launch[0] is not gluon_forward._packed_work_list]
    assert plain == 1 and [launch[3][-6] for launch in kernels] == [expected, expected]
    # the ragged batch's empty tiles (4 x 8 blocks x 16 heads) are left out by a work list
    assert len(launches) == (2 if total == len(lens) * longest or lens[-1] == 2047 else 4)


def test_packed_forward_declines_what_the_kernel_does_not_take(monkeypatch):
    """None (nothing launched) for a head dim outside HEAD_DIMS, e4m3 inputs, a misaligned base, a
    non-positive scale, int64 offsets, or max_seqlen 0: the caller then takes the general path."""
    launches = _stub_packed_gpu(monkeypatch)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)

    def qkv(d=128, dtype=torch.bfloat16):
        return [torch.randn(256, 4, d).to(dtype) for _ in range(3)]
    assert gluon_forward.packed_forward(*qkv(96), cu, cu, 156, 156, 0.1, False) is None
    assert gluon_forward.packed_forward(*qkv(dtype=torch.float8_e4m3fn), cu, cu, 156, 156, 0.1, False) is None
    q, k, v = qkv()
    assert gluon_forward.packed_forward(q, k, v, cu, cu, 156, 156, -0.1, False) is None
    assert gluon_forward.packed_forward(q, k, v, cu.long(), cu.long(), 156, 156, 0.1, False) is None
    assert gluon_forward.packed_forward(q, k, v, cu, cu, 0, 156, 0.1, False) is None
    flat = torch.randn(256 * 4 * 128 + 1, dtype=torch.bfloat16)
    assert gluon_forward.packed_forward(flat[1:].view(256, 4, 128), k, v, cu, cu, 156, 156, 0.1, False) is None
    assert not launches


def test_attention_forward_sends_plain_packed_calls_to_the_cached_plan(monkeypatch):
    """attention_forward: a packed 16-bit call without window, ALiBi, dropout, page pools or given
    out/lse (a softcap with SOFTCAP_IN_KERNEL, on by default) goes to packed_forward (max_seqlen_k 0
    standing for all packed keys); any of those options, a softcap with the switch off, or
    packed_forward declining, takes the general path."""
    from flashtile.kernels import forward as fwd
    asked = []
    monkeypatch.setattr(fwd, "_PLAIN_GLUON", True)
    monkeypatch.setattr(gluon_forward, "packed_forward",
                        lambda *a, **k: asked.append(a + (k.get("softcap"),)) or ("out", "lse"))
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    q = torch.randn(30, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    kw = dict(softmax_scale=0.1, window_left=-1, diag_offset=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
              max_seqlen_q=20)
    assert fwd.attention_forward(q, k, k, window_right=0, max_seqlen_k=0, **kw) == ("out", "lse")
    assert asked[-1][5:] == (20, 40, 0.1, True, 0.0)
    assert fwd.attention_forward(q, k, k, window_right=-1, max_seqlen_k=25, **kw) == ("out", "lse")
    assert asked[-1][5:] == (20, 25, 0.1, False, 0.0)
    assert fwd.attention_forward(q, k, k, window_right=0, max_seqlen_k=25, softcap=5.0, **kw) == ("out", "lse")
    assert asked[-1][5:] == (20, 25, 0.1, True, 5.0)
    general = []
    monkeypatch.setattr(fwd, "_gluon_varlen", lambda *a, **k: general.append(k) or ("general", None))
    monkeypatch.setattr(fwd, "gluon_applies", lambda *a, **k: False)
    monkeypatch.setattr(fwd, "_INTERPRET", False)
    monkeypatch.setattr(fwd, "GLUON_ENABLED", True)
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", False)
    for extra in (dict(window_right=5), dict(window_right=0, softcap=5.0), dict(window_right=0, out=q),
                  dict(window_right=0, dropout_seed=cu), dict(window_right=0, alibi_slopes=cu)):
        assert fwd.attention_forward(q, k, k, max_seqlen_k=25, **extra, **kw) == ("general", None)
    assert len(asked) == 3 and len(general) == 5
    monkeypatch.setattr(gluon_forward, "packed_forward", lambda *a, **k: None)
    assert fwd.attention_forward(q, k, k, window_right=0, max_seqlen_k=25, **kw) == ("general", None)


@pytest.mark.parametrize("d,causal,page", [(128, True, 16), (64, False, 256), (256, False, 32)])
def test_varlen_launch_reads_page_pools(monkeypatch, d, causal, page):
    """gluon_varlen_forward with a block table: the K/V descriptors over the page pools as they
    are (boxes of a page piece or a whole key tile), the table and cu_seqlens_k as pointers, the
    capacity a table row gives as the key bound, page size and table stride as scalars."""
    lens_q = [5, 300, 0, 129]  # keys 7, 300, 40, 1
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347, 348], dtype=torch.int32)
    width = -(-300 // page) + 1
    q = torch.randn(sum(lens_q), 8, d, dtype=torch.bfloat16)
    k = torch.randn(4 * width, page, 2, d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(4 * width, dtype=torch.int32).reshape(4, width)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    out, lse = gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.1,
                                                  causal=causal, block_table=table)
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    (jit, grid, tensors, scalars, options, descriptors), = launches
    variant = gluon_forward.varlen_paged_variant(d, "bf16", causal, page)
    assert options is gluon_forward._launch_options(variant) and options["VARLEN"] and options["SEQUSED_K"]
    assert options["PAGE_ROWS"] == (page if page < variant.block_n else 0)
    blocks = -(-300 // variant.block_m)
    assert scalars[:8] == (0, q.shape[0], 300, width * page, 4, 8, blocks, 4)
    assert scalars[-5:] == (page, width, 0, 0, 0.0)  # page size, table stride; no window, no softcap
    assert tensors[4] is cu_k and tensors[5] is table and tensors[6] is cu_q and tensors[7] is out
    q_desc, k_desc, v_desc, o_desc = descriptors
    assert tuple(q_desc.shape) == (1, *q.shape)
    box = min(page, variant.block_n)
    for desc, pool in ((k_desc, k), (v_desc, v)):
        assert desc.base is pool and tuple(desc.shape) == tuple(pool.shape)
        assert tuple(desc.block_shape) == (1, box, 1, d)
    with pytest.raises(ValueError, match="block_table"):
        gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.1, causal=causal,
                                           block_table=table[:3])


@pytest.mark.parametrize("d,causal,page", [(128, True, 16), (128, False, 3), (256, False, 64)])
def test_varlen_launch_gathers_e4m3_page_pools(monkeypatch, d, causal, page):
    """gluon_varlen_forward on e4m3 page pools: the sequences gathered through the table into
    packed K rows and packed V^T (e4m3 wgmma reads V K-major), then the contiguous e4m3 schedule
    over them, as for packed sequences without pages."""
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347, 348], dtype=torch.int32)
    width = -(-300 // page) + 1
    q = torch.randn(434, 8, d).to(torch.float8_e4m3fn)
    k = torch.randn(4 * width, page, 2, d).to(torch.float8_e4m3fn)
    v = torch.randn(4 * width, page, 2, d).to(torch.float8_e4m3fn)
    table = torch.randperm(4 * width, dtype=torch.int32).reshape(4, width)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    ones = torch.ones(4, 2, 1)
    descales = forward.fp8_kernel_descales(torch.ones(4, 8, 1), ones, ones)
    out, lse = gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.1,
                                                  causal=causal, descales=descales, scale_blocks=(512, 512),
                                                  block_table=table)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (8, 434)
    (jit, grid, tensors, scalars, options, descriptors), = launches
    variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, "fp8", causal, 300))
    assert options is gluon_forward._launch_options(variant) and not options["SEQUSED_K"]
    assert scalars[:4] == (0, 434, 300, 300) and scalars[-5:] == (0, 0, 0, 0, 0.0)  # no pages, window, softcap
    assert tensors[4] is cu_k and tensors[6] is cu_q
    _, k_desc, v_desc, _ = descriptors
    assert tuple(k_desc.shape) == (1, 4 * 300, 2, d) and v_desc.strides[3] == 1
    rows, vt = k_desc.base[0], v_desc.base[0]
    for b in range(4):
        start, n = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        pages = table[b].long()
        k_seq, v_seq = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
        assert torch.equal(rows[start:start + n].view(torch.uint8), k_seq.view(torch.uint8))
        column = -(-start // 16) * 16 + 16 * b
        assert torch.equal(vt[:, :, column:column + n].view(torch.uint8),
                           v_seq.permute(1, 2, 0).view(torch.uint8))


def test_e4m3_pool_gather_stays_within_its_memory_bound(monkeypatch):
    """e4m3 page pools go to the Gluon kernel through copies of B x max_seqlen_k keys (K rows, V
    rows, V^T): only while those stay within FP8_GATHER_BYTES, however large the pools are (a
    serving engine's fill most of the GPU)."""
    from flashtile.kernels import forward as fwd
    pool = torch.empty(64, 16, 2, 128, dtype=torch.float8_e4m3fn)  # 1,024 slots, 256 KiB a pool
    table = torch.zeros(4, 64, dtype=torch.int32)
    monkeypatch.setattr(fwd, "FP8_GATHER_BYTES", 3 * 4 * 170 * 256)  # 3 copies of 4 x 170 keys
    assert fwd._gather_fits(pool, table, 170)
    assert not fwd._gather_fits(pool, table, 171)
    monkeypatch.setattr(fwd, "FP8_GATHER_BYTES", 0)
    assert not fwd._gather_fits(pool, table, 1)  # no allowance for the pools' own size
    monkeypatch.setattr(fwd, "FP8_GATHER_BYTES", 1 << 30)
    assert fwd._gather_fits(pool, table, 1024)


def test_varlen_route_stays_off_cpu_and_unsupported_calls():
    from flashtile.kernels import forward as fwd
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    q = torch.randn(30, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(30, 2, 64, dtype=torch.bfloat16)
    assert not gluon_forward.varlen_supported(q, k, k, cu, cu)
    kw = dict(softmax_scale=0.1, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None, out=None,
              lse=None, config=None, dropout_seed=None, descales=None, scale_blocks=(0, 0))
    assert fwd._gluon_varlen(q, k, k, cu, cu, 20, 20, **kw) is None


def _random_window_call(rng):
    """(seqlen_q, seqlen_k, causal, window_size) with at least one side of the window bounded."""
    seqlen_q, seqlen_k = rng.randint(1, 1500), rng.randint(1, 1500)
    causal = rng.random() < 0.5
    window = (rng.choice([-1, rng.randint(0, 600)]), rng.choice([-1, rng.randint(0, 600)]))
    if window == (-1, -1):
        window = (rng.randint(0, 600), -1)
    return seqlen_q, seqlen_k, causal, window


def _tile_span(m0, seqlen_q, seqlen_k, left, right, block_m, block_n):
    """gluon_forward._tile_span's WINDOW arithmetic in Python (the kernel's is a transcription)."""
    diag = seqlen_k - seqlen_q
    first_key = min(max(m0 + diag - left, 0), max(seqlen_k - 1, 0))
    key_end = min(seqlen_k, max(m0 + block_m + diag + right, 0))
    first = first_key // block_n
    num_tiles = max((key_end + block_n - 1) // block_n - first, 1)
    full_start = max(m0 + block_m - 1 + diag - left, 0)
    full_end = min(seqlen_k, max(m0 + diag + right + 1, 0))
    num_left = min(max((full_start + block_n - 1) // block_n - first, 1), num_tiles)
    num_full = min(max(full_end // block_n - first, num_left), num_tiles)
    return first, num_tiles, num_left, num_full


@pytest.mark.parametrize("seed", range(4))
def test_window_tile_span_covers_the_window_and_skips_masks_only_where_every_row_sees_all(seed):
    """For random blocks, lengths and windows (sides without a bound as the kernel takes them): the
    tiles a block runs hold every key its rows see, are inside the keys, and the unmasked ones
    ([num_left, num_full)) hold only keys every row of the block sees."""
    import random
    rng = random.Random(seed)
    big = gluon_forward.UNBOUNDED_WINDOW
    for _ in range(300):
        block_m, block_n = rng.choice([(128, 128), (192, 128), (128, 64)])
        seqlen_q, seqlen_k, causal, window = _random_window_call(rng)
        left, right = gluon_forward.window_arguments(causal, window)
        assert left == (window[0] if window[0] >= 0 else big)
        assert right == (0 if causal else window[1] if window[1] >= 0 else big)
        m0 = block_m * rng.randrange(-(-seqlen_q // block_m))
        first, num_tiles, num_left, num_full = _tile_span(m0, seqlen_q, seqlen_k, left, right, block_m,
                                                          block_n)
        assert 0 <= first and first * block_n < seqlen_k and num_tiles >= 1
        assert 1 <= num_left <= num_full <= num_tiles
        lo, hi = first * block_n, min((first + num_tiles) * block_n, seqlen_k)
        for row in range(m0, min(m0 + block_m, seqlen_q)):
            pos = row + seqlen_k - seqlen_q
            seen = [key for key in range(max(pos - left, 0), min(pos + right, seqlen_k - 1) + 1)]
            assert all(lo <= key < hi for key in seen), (row, window, causal)
        for j in range(num_left, num_full):
            keys = range((first + j) * block_n, (first + j + 1) * block_n)
            assert keys[-1] < seqlen_k
            for row in range(m0, m0 + block_m):  # every row of the block, those past Sq too
                pos = row + seqlen_k - seqlen_q
                assert pos - left <= keys[0] and keys[-1] <= pos + right, (row, j, window, causal)


def test_window_variants_are_compiled_and_dispatchable():
    shipped = set(gluon_forward.GLUON_VARIANTS)
    for d in gluon_forward.HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                for keys in (1, 1 << 20):
                    base = gluon_forward.dispatch_variant(d, dtype, causal, keys)
                    win = gluon_forward.with_window(base)
                    assert win.window and not win.own_range and win.name.endswith("-win")
                    assert win.consumers == (3 if (d, causal) == (64, True) else 2)
                    dispatched = d in gluon_forward.WINDOW_HEAD_DIMS
                    assert (win in shipped) == dispatched and (win in gluon_forward.DISPATCHED) == dispatched
                    packed = gluon_forward.with_window(gluon_forward.with_varlen(base))
                    assert packed.varlen and packed.window and not packed.prefetch_q and not packed.q_regs
                    assert (packed in shipped) == dispatched and packed.name.endswith("-varlen-win")
    assert set(gluon_forward.WINDOW_HEAD_DIMS) == set(forward.GLUON_WINDOW_MIN_KEYS)
    assert forward.window_span(37, 0) == 38 and forward.window_span(-1, 0) == float("inf")
    assert forward.window_span(10, 5) == 16 and forward.window_span(3, -1) == float("inf")
    with pytest.raises(ValueError, match="window"):
        gluon_forward.GluonVariant(128, "fp8", window=True)
    with pytest.raises(ValueError, match="window"):
        dataclasses.replace(gluon_forward.default_variant(64, "bf16", True), window=True)  # own ranges
    with pytest.raises(ValueError, match="window"):  # caches and page pools
        gluon_forward.with_window(gluon_forward.varlen_paged_variant(128, "bf16", True, 256))


def _query_blocks(n0, seqlen_q, seqlen_k, left, right, block_m, block_n):
    """gluon_backward._query_blocks' WINDOW arithmetic in Python (the kernel's is a transcription)."""
    diag = seqlen_k - seqlen_q
    num_m = -(-seqlen_q // block_m)
    m_lo = min(max(n0 - right - diag, 0) // block_m, num_m)
    m_end = min(max(n0 + block_n - 1 + left - diag + 1, 0), seqlen_q)
    m_end = max(-(-m_end // block_m), m_lo)
    m_full = min(-(-max(n0 + block_n - 1 - right - diag, 0) // block_m), m_end)
    m_full_end = max(min(max(n0 + left - diag + 1, 0) // block_m, m_end), m_full)
    return m_lo, m_full, m_full_end, m_end


@pytest.mark.parametrize("seed", range(4))
def test_window_query_blocks_cover_the_window_and_skip_masks_only_where_every_key_is_seen(seed):
    """The Gluon backward's key block [n0, n0 + 128) under a sliding window: the query blocks it runs
    hold every row whose window reaches one of its keys, and those it runs unmasked ([m_full,
    m_full_end)) hold only rows (those past Sq too) that see all of its keys."""
    import random
    rng = random.Random(100 + seed)
    block_m, block_n = 64, 128
    for _ in range(300):
        seqlen_q, seqlen_k, causal, window = _random_window_call(rng)
        left, right = gluon_forward.window_arguments(causal, window)
        n0 = block_n * rng.randrange(-(-seqlen_k // block_n))
        m_lo, m_full, m_full_end, m_end = _query_blocks(n0, seqlen_q, seqlen_k, left, right, block_m, block_n)
        assert 0 <= m_lo <= m_full <= m_full_end <= m_end <= -(-seqlen_q // block_m)
        keys = range(n0, min(n0 + block_n, seqlen_k))
        for row in range(seqlen_q):
            pos = row + seqlen_k - seqlen_q
            if any(pos - left <= key <= pos + right for key in keys):
                assert m_lo * block_m <= row < m_end * block_m, (row, window, causal)
        for m in range(m_full, m_full_end):
            for row in range(m * block_m, (m + 1) * block_m):
                pos = row + seqlen_k - seqlen_q
                assert pos - left <= n0 and n0 + block_n - 1 <= pos + right, (row, m, window, causal)


def test_backward_window_variants_compile_list():
    names = {v.name for v in gluon_backward.GLUON_BACKWARD_VARIANTS}
    for d in gluon_backward.WINDOW_HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                win = dataclasses.replace(gluon_backward.default_variant(d, dtype, causal, True), window=True)
                assert win.name.endswith("-dq-win") and win.name in names
    assert set(gluon_backward.WINDOW_HEAD_DIMS) <= set(gluon_forward.WINDOW_HEAD_DIMS)


@pytest.mark.parametrize("d, causal, window, expected", [
    (128, True, (100, -1), (100, 0)), (128, True, (100, 0), (100, 0)),
    (256, False, (-1, 50), (gluon_forward.UNBOUNDED_WINDOW, 50)), (64, False, (7, 9), (7, 9)),
    (128, False, (-1, -1), (0, 0)), (128, True, (-1, 0), (0, 0))])
def test_windowed_launch_takes_the_window_variant_and_its_sides(monkeypatch, d, causal, window, expected):
    """gluon_attention_forward with window_size launches the window variant of the dispatched schedule
    with the window's sides as its last two scalars (an unbounded side as UNBOUNDED_WINDOW, causal
    bounding the right at 0); without a window, the plain variant and zeros. The GPU parts stubbed."""
    q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
    k = torch.randn(2, 500, 2, d, dtype=torch.bfloat16)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    gluon_forward.gluon_attention_forward(q, k, torch.randn_like(k), softmax_scale=0.1, causal=causal,
                                          window_size=window)
    (jit, grid, tensors, scalars, options, descriptors), = launches
    base = gluon_forward.dispatch_variant(d, "bf16", causal, 500)
    windowed = expected != (0, 0)
    variant = gluon_forward.with_window(base) if windowed else base
    assert options is gluon_forward._launch_options(variant) and options["WINDOW"] == windowed
    assert scalars[-3:-1] == expected and scalars[-1] == 0.0  # (the window's sides; no softcap)


@pytest.mark.parametrize("d, causal, window, expected", [
    (128, True, (600, 0), (600, 0)), (256, False, (-1, 50), (gluon_forward.UNBOUNDED_WINDOW, 50)),
    (256, False, (900, 900), (900, 900)), (128, True, (-1, 0), (0, 0))])
def test_windowed_varlen_launch_takes_the_window_variant_and_its_sides(monkeypatch, d, causal, window,
                                                                       expected):
    """gluon_varlen_forward with window_size: the packed schedule's window variant (all of Q from
    shared memory at d256) with the window's sides as the last two scalars; no window, zeros. A window
    on page pools or e4m3 inputs is refused before launch."""
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 307, 347, 348], dtype=torch.int32)
    q = torch.randn(434, 8, d, dtype=torch.bfloat16)
    k = torch.randn(348, 2, d, dtype=torch.bfloat16)
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    gluon_forward.gluon_varlen_forward(q, k, torch.randn_like(k), cu_q, cu_k, 300, 300, softmax_scale=0.1,
                                       causal=causal, window_size=window)
    (jit, grid, tensors, scalars, options, descriptors), = launches
    variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, "bf16", causal, 300))
    windowed = expected != (0, 0)
    if windowed:
        variant = gluon_forward.with_window(variant)
    assert variant in gluon_forward.GLUON_VARIANTS
    assert options is gluon_forward._launch_options(variant) and options["WINDOW"] == windowed
    assert options["VARLEN"] and scalars[-3:-1] == expected and scalars[-1] == 0.0
    pool = torch.randn(4, 256, 2, d, dtype=torch.bfloat16)
    table = torch.zeros(4, 2, dtype=torch.int32)
    if windowed:
        with pytest.raises(ValueError, match="window"):
            gluon_forward.gluon_varlen_forward(q, pool, pool, cu_q, cu_k, 300, 300, softmax_scale=0.1,
                                               causal=causal, window_size=window, block_table=table)
        e4m3 = [t.to(torch.float8_e4m3fn) for t in (q, k, k)]
        with pytest.raises(ValueError, match="window"):
            gluon_forward.gluon_varlen_forward(*e4m3, cu_q, cu_k, 300, 300, softmax_scale=0.1, causal=causal,
                                               window_size=window, scale_blocks=(512, 512))
    assert len(launches) == 1  # the refused calls launched nothing


@pytest.mark.parametrize("shape", [
    # (B, Sq, Sk, H, Hk, causal)
    (1, 4096, 4096, 12, 2, True),
    (2, 1000, 3000, 8, 8, False),
    (3, 777, 777, 4, 1, True),
])
def test_fp8_forward_launches_what_gluon_attention_forward_launches(monkeypatch, shape):
    """The cached plan of an e4m3 call gives the launch the general path would make (kernel, grid,
    options, scalars, descriptor geometry, descales), on the CPU with the GPU parts stubbed; a call
    the kernel does not take (other scale blocks, V not keys-contiguous) launches nothing."""
    b, sq, sk, h, hk, causal = shape
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(b, sq, h, 128).to(e4m3)
    k = torch.randn(b, sk, hk, 128).to(e4m3)
    v = forward.keys_contiguous(torch.randn(b, sk, hk, 128).to(e4m3))
    block_q, block_k = 128, 256
    q_d = torch.rand(b, h, -(-sq // block_q)) + 0.5
    k_d = torch.rand(b, hk, -(-sk // block_k)) + 0.5
    v_d = torch.exp2(torch.randint(-3, 3, k_d.shape).float())
    launches = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(gluon_forward, "_on_one_sm90", lambda *tensors: True)
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    monkeypatch.setattr(gluon_forward, "_FP8", {})
    scale = 128 ** -0.5
    for _ in range(2):  # the second call takes the cached plan
        out, lse = gluon_forward.fp8_forward(q, k, v, (q_d, k_d, v_d), (block_q, block_k), scale, causal)
    kernel_descales = forward.fp8_kernel_descales(q_d, k_d, v_d)
    ref_out, ref_lse = gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal,
                                                             descales=kernel_descales,
                                                             scale_blocks=(block_q, block_k))
    assert len(launches) == 3 and len(gluon_forward._FP8) == 1
    planned, cached, general = launches
    for got in (planned, cached):
        _assert_same_launch(got, general)
        tensors = got[2]
        assert tensors[1] is q_d and general[2][1] is q_d
        assert torch.equal(tensors[2], general[2][2]) and torch.equal(tensors[3], general[2][3])
        assert tensors[7].shape == ref_out.shape and tensors[0].shape == ref_lse.shape
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape and out.stride() == ref_out.stride()
    assert lse.shape == ref_lse.shape and lse.stride() == ref_lse.stride()
    # refused, nothing launched: scale blocks under the key tile, V as given (not keys-contiguous),
    # descales of another block count
    assert gluon_forward.fp8_forward(q, k, v, (q_d, k_d, v_d), (block_q, 64), scale, causal) is None
    plain_v = torch.randn(b, sk, hk, 128).to(e4m3)
    assert gluon_forward.fp8_forward(q, k, plain_v, (q_d, k_d, v_d), (block_q, block_k), scale, causal) is None
    longer = torch.ones(b, hk, k_d.shape[2] + 1)
    assert gluon_forward.fp8_forward(q, k, v, (q_d, longer, longer), (block_q, block_k), scale, causal) is None
    assert len(launches) == 3


def test_attention_forward_sends_plain_e4m3_calls_to_the_cached_plan(monkeypatch):
    """attention_forward: an e4m3 call without window, softcap, ALiBi, packed sequences or given
    out/lse goes to fp8_forward with its descales as given (causal only bottom-right) and V
    keys-contiguous (copied once when it is not); fp8_forward declining, or any of those options,
    takes the general path."""
    from flashtile.kernels import forward as fwd
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(1, 64, 4, 64).to(e4m3)
    k = torch.randn(1, 96, 2, 64).to(e4m3)
    v = fwd.keys_contiguous(k)
    asked, copied = [], []
    monkeypatch.setattr(fwd, "_PLAIN_GLUON", True)
    monkeypatch.setattr(gluon_forward, "fp8_forward", lambda *a, sinks=None: asked.append(a) or ("out", "lse"))
    monkeypatch.setattr(fwd, "keys_contiguous", lambda x: copied.append(x) or v)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    descales = (torch.ones(1, 4, 1), torch.ones(1, 2, 1), torch.ones(1, 2, 1))
    kw = dict(softmax_scale=0.1, window_left=-1, descales=descales, scale_blocks=(64, 128))
    assert fwd.attention_forward(q, k, v, window_right=0, diag_offset=32, **kw) == ("out", "lse")
    assert asked[-1][2] is v and asked[-1][3] is descales and asked[-1][4:] == ((64, 128), 0.1, True)
    assert fwd.attention_forward(q, k, k, window_right=-1, diag_offset=32, **kw) == ("out", "lse")
    assert asked[-1][2] is v and asked[-1][6] is False and copied == [k]
    general = []
    monkeypatch.setattr(gluon_forward, "fp8_forward", lambda *a, sinks=None: asked.append(a))  # (declines: None)
    monkeypatch.setattr(fwd, "_launch_forward", lambda *a, **k: general.append(a))
    monkeypatch.setattr(fwd, "gluon_fp8_applies", lambda *a, **k: False)
    monkeypatch.setattr(fwd, "pick_config", lambda *a, **k: fwd.TileConfig(64, 64, 4, 2))
    monkeypatch.setattr(fwd, "fp8_kernel_descales", lambda *d: d)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    fwd.attention_forward(q, k, v, window_right=0, diag_offset=32, **kw)  # declined: the general path
    fwd.attention_forward(q, k, v, window_right=0, diag_offset=0, **kw)  # causal, but not bottom-right
    assert len(general) == 2 and len(asked) == 3 and copied == [k]


def _listed(lens, keys, blocks, block_m, causal):
    """The entries packed_work_list should write, in the kernel's deal order: sequences with keys
    first, then those without."""
    n = [min(-(-max(length, 0) // block_m), blocks) for length in lens]
    batch = len(lens)
    entries = []
    for keyed in (True, False):
        part = [b for b in range(batch) if (keys[b] > 0) == keyed]
        if causal:
            entries += [level * batch + b for level in reversed(range(blocks)) for b in part if n[b] > level]
        else:
            entries += [level * batch + b for b in part for level in range(n[b])]
    return entries


def _dealt_tiles(work, heads, batch, causal):
    """(query block, head, sequence) of every listed work tile, as _work_coords maps tile ids."""
    entries = int(work[0])
    tiles = []
    for tile in range(entries * heads):
        entry, head = (divmod(tile, heads) if causal else divmod(tile, entries)[::-1])
        code = int(work[1 + entry])
        tiles.append((code // batch, head, code % batch))
    return tiles


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_work_list_deals_every_tile_with_rows_once(causal, seed):
    """packed_work_list (the interpreter runs it): its entries are the (query block, sequence) pairs
    that hold query rows, every one once, counted first; the kernel's tiles from them cover each
    (block, head, sequence) with rows once, those of sequences with keys first, causal in the unlisted
    deal's order (_tile_coords with every pair in one group: the last query blocks first) with the
    empty tiles left out. Over 512
    sequences (the list kernel's chunk), with sequences of no rows, offsets that run backwards and a
    sequence longer than the grid's blocks (capture leaves offsets unchecked: clamped as the kernel
    clamps them)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, block_m = 600, 3, 128
    lens = torch.randint(1, 4, (batch,), generator=g)
    lens[torch.randperm(batch, generator=g)[:40]] = torch.randint(100, 700, (40,), generator=g)
    lens[torch.randperm(batch, generator=g)[:20]] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    cu[7] = cu[6] - 5  # sequence 6 runs backwards (no rows), sequence 7 gains them
    keys = torch.randint(0, 3, (batch,), generator=g) * torch.randint(1, 900, (batch,), generator=g)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), keys.cumsum(0)]).to(torch.int32)
    blocks = 5  # 640 rows: sequences over that keep their first 5 blocks
    got = gluon_forward.packed_work_list(cu, cu_k, blocks, block_m, causal)
    real = (cu[1:] - cu[:-1]).tolist()
    expected = _listed(real, keys.tolist(), blocks, block_m, causal)
    assert got.dtype == torch.int32 and got.shape == (1 + batch * blocks,)
    assert int(got[0]) == len(expected) and got[1:1 + len(expected)].tolist() == expected
    tiles = _dealt_tiles(got, heads, batch, causal)
    n = [min(-(-max(r, 0) // block_m), blocks) for r in real]
    live = {(m, h, b) for b in range(batch) for m in range(n[b]) for h in range(heads)}
    assert len(tiles) == len(set(tiles)) and set(tiles) == live
    if causal:  # sequences with keys, then those without: each in the unlisted deal's order
        unlisted = []
        for tile in range(blocks * heads * batch):
            pid_m, rest = blocks - 1 - tile // (heads * batch), tile % (heads * batch)
            unlisted.append((pid_m, rest % heads, rest // heads))
        keyed = [t for t in unlisted if t in live and keys[t[2]] > 0]
        assert tiles == keyed + [t for t in unlisted if t in live and keys[t[2]] == 0] and keyed


def test_work_lists_are_for_packed_persistent_variants_and_shipped_bf16():
    """work_list needs packed sequences on persistent CTAs; every dispatched persistent packed bf16
    schedule (plain, e4m3, page pools at every box size, windows) has its listed form in the
    compile check."""
    names = {v.name for v in gluon_forward.GLUON_VARIANTS}
    base = gluon_forward.default_variant(128, "bf16", True)
    with pytest.raises(ValueError, match="work_list"):
        dataclasses.replace(base, work_list=True)
    with pytest.raises(ValueError, match="work_list"):
        dataclasses.replace(gluon_forward.with_varlen(base), persistent=False, snake=False, work_list=True)
    for d in gluon_forward.HEAD_DIMS:
        for causal in (False, True):
            candidates = [gluon_forward.with_varlen(gluon_forward.dispatch_variant(d, "bf16", causal, keys))
                          for keys in (1, 1 << 20)]
            candidates += [gluon_forward.varlen_paged_variant(d, "bf16", causal, page) for page in (256, 16, 32)]
            if d in gluon_forward.WINDOW_HEAD_DIMS:
                candidates.append(gluon_forward.with_window(gluon_forward.with_varlen(
                    gluon_forward.dispatch_variant(d, "bf16", causal, 1))))
            for variant in candidates:
                assert variant.persistent
                listed = gluon_forward.with_work_list(variant)
                assert listed.name == variant.name + "-wl" and listed.name in names
    for d, causal in gluon_forward.FP8_DISPATCH:
        variant = gluon_forward.with_varlen(gluon_forward.default_variant(d, "fp8", causal))
        if variant.persistent:
            assert gluon_forward.with_work_list(variant).name in names


def test_work_list_wanted_counts_the_empty_tiles_a_cta():
    """At least one empty work tile a CTA (of 132) beyond what the rows could fill, one partial block
    a sequence: a decode step's sequences among a prefill chunk's, not a batch of full blocks."""
    variant = gluon_forward.with_varlen(gluon_forward.default_variant(128, "bf16", True))
    wanted = gluon_forward.work_list_wanted
    assert wanted(variant, 65, 64 + 512, 512, 32, 132)  # 64 steps of one query + a 512-query chunk
    assert not wanted(variant, 8, 8 * 2048, 2048, 16, 132)  # full blocks
    assert not wanted(variant, 4, 434, 300, 8, 132)  # 5 empty blocks x 8 heads < 132
    assert wanted(variant, 4, 434, 300, 27, 132)  # x 27 heads >= 132 (well, 135)
    full = gluon_forward.default_variant(128, "fp8", False)
    assert not wanted(gluon_forward.with_varlen(full), 65, 576, 512, 32, 132)  # one CTA a tile


@pytest.mark.parametrize("paged", [False, True])
def test_mixed_batches_launch_with_a_work_list(monkeypatch, paged):
    """A packed causal batch of 64 one-query sequences and a 512-query one (32 heads): the list is
    made first (one program a query block of the grid, from cu_seqlens_q) and the kernel's listed
    schedule reads it; the cached plan does the same; the batch of test_varlen_launch_reads_packed_tensors
    keeps the unlisted deal (the LSE standing in for the list)."""
    launches = _stub_packed_gpu(monkeypatch)
    lens = [1] * 64 + [512]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(lens), 32, 128, dtype=torch.bfloat16)
    if paged:
        k = torch.randn(65 * 4, 16, 8, 128, dtype=torch.bfloat16)
        table = torch.arange(65 * 4, dtype=torch.int32).reshape(65, 4)
        monkeypatch.setattr(gluon_forward, "paged_supported", lambda *a, **kw: True)
        gluon_forward.gluon_varlen_forward(q, k, k, cu, cu, 512, 64, softmax_scale=0.1, causal=True,
                                           block_table=table)
        variant = gluon_forward.varlen_paged_variant(128, "bf16", True, 16)
    else:
        k = torch.randn(sum(lens), 8, 128, dtype=torch.bfloat16)
        gluon_forward.packed_forward(q, k, k, cu, cu, 512, 512, 0.1, True)
        gluon_forward.gluon_varlen_forward(q, k, k, cu, cu, 512, 512, softmax_scale=0.1, causal=True)
        variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(128, "bf16", True, 512))
    listed = gluon_forward._launch_options(gluon_forward.with_work_list(variant))
    assert len(launches) == (2 if paged else 4)
    for made, kernel in zip(launches[::2], launches[1::2]):
        assert made[0] is gluon_forward._packed_work_list and made[1] == (4,) and made[2][0] is cu and made[2][1] is cu
        assert made[3] == (65, 4) and made[4]["BLOCK_M"] == 128 and made[4]["CAUSAL"]
        assert kernel[4] is listed and kernel[4]["WORK_LIST"] and kernel[2][8] is made[2][2]
    launches.clear()
    cu_q = torch.tensor([0, 5, 305, 305, 434], dtype=torch.int32)
    q, k = torch.randn(434, 8, 128, dtype=torch.bfloat16), torch.randn(434, 2, 128, dtype=torch.bfloat16)
    gluon_forward.packed_forward(q, k, k, cu_q, cu_q, 300, 300, 0.1, True)
    (kernel,) = launches
    assert not kernel[4]["WORK_LIST"] and kernel[2][8] is kernel[2][0]


@pytest.mark.parametrize("route", ["plain-bf16", "plain-e4m3", "packed-e4m3", "general-window", "general-seqused"])
def test_sinks_launch_the_sinks_variant_with_their_pointer(monkeypatch, route):
    """With attention sinks (SINKS_IN_EPILOGUE's routes) the Gluon launches run the dispatched
    variant with ``sinks``, one of the compile-checked GLUON_VARIANTS, with the sinks as the last
    pointer; without them, the variant without (the LSE in that slot) from a plan of its own."""
    from helpers import record_gluon_launches
    launches = record_gluon_launches(monkeypatch)
    monkeypatch.setattr(gluon_forward, "supported", lambda *a, **kw: gluon_forward.shapes_supported(*a[:3]))
    monkeypatch.setattr(gluon_forward, "_on_one_sm90", lambda *tensors: True)
    e4m3 = torch.float8_e4m3fn
    sinks = torch.randn(8)
    if route == "plain-bf16":
        q, k, v = (torch.randn(2, n, h, 128, dtype=torch.bfloat16) for n, h in ((300, 8), (500, 2), (500, 2)))
        variant = gluon_forward.dispatch_variant(128, "bf16", True, 500)

        def call(s):
            return gluon_forward.plain_forward(q, k, v, 0.1, True, sinks=s)
    elif route.startswith("general"):  # gluon_attention_forward: a window, or a KV cache's lengths
        q, k, v = (torch.randn(2, n, h, 128, dtype=torch.bfloat16) for n, h in ((300, 8), (500, 2), (500, 2)))
        variant = gluon_forward.dispatch_variant(128, "bf16", True, 500)
        lengths = torch.tensor([500, 321], dtype=torch.int32)
        if route == "general-window":
            variant, extra = gluon_forward.with_window(variant), dict(window_size=(256, 0))
        else:
            variant, extra = gluon_forward.with_seqused_k(variant), dict(seqused_k=lengths)

        def call(s):
            return gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=0.1, causal=True, sinks=s, **extra)
    elif route == "plain-e4m3":
        q = torch.randn(2, 300, 8, 128).to(e4m3)
        k = torch.randn(2, 500, 2, 128).to(e4m3)
        v = forward.keys_contiguous(torch.randn(2, 500, 2, 128).to(e4m3))
        descales = (torch.rand(2, 8, 3) + 0.5, torch.rand(2, 2, 2) + 0.5, torch.ones(2, 2, 2))
        variant = gluon_forward.dispatch_variant(128, "fp8", False, 500)

        def call(s):
            return gluon_forward.fp8_forward(q, k, v, descales, (128, 256), 0.1, False, sinks=s)
    else:
        cu_q = torch.tensor([0, 5, 305], dtype=torch.int32)
        cu_k = torch.tensor([0, 7, 307], dtype=torch.int32)
        q = torch.randn(305, 8, 128).to(e4m3)
        k, v = torch.randn(307, 2, 128).to(e4m3), torch.randn(307, 2, 128).to(e4m3)
        ones = torch.ones(2, 2, 1)
        descales = forward.fp8_kernel_descales(torch.ones(2, 8, 1), ones, ones)
        variant = gluon_forward.with_varlen(gluon_forward.dispatch_variant(128, "fp8", True, 300))

        def call(s):
            return gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, 300, 300, softmax_scale=0.1, causal=True,
                                                      descales=descales, scale_blocks=(512, 512), sinks=s)
    with_sinks = dataclasses.replace(variant, sinks=True)
    assert with_sinks in gluon_forward.GLUON_VARIANTS and with_sinks.name == variant.name + "-sinks"
    out, lse = call(sinks)
    call(None)
    (_, _, tensors, _, options, _), (_, _, plain_tensors, _, plain_options, _) = launches
    assert options is gluon_forward._launch_options(with_sinks) and options["SINKS"]
    assert tensors[9] is sinks and plain_tensors[9] is not sinks and plain_tensors[9].shape == lse.shape
    assert plain_options is gluon_forward._launch_options(variant) and not plain_options["SINKS"]
    if route.startswith("general"):  # read at offset h: (H,) and contiguous, or refused before a launch
        for bad in (torch.randn(4), torch.randn(16)[::2]):
            with pytest.raises(ValueError, match="sinks must be"):
                call(bad)
        assert len(launches) == 2
