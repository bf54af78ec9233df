"""The forward kernel against the float64 reference, feature by feature, with NaN-poisoned outputs."""

from __future__ import annotations

import math

import pytest
import torch

from flashtile.kernels.forward import TileConfig, attention_forward
from helpers import assert_matches_reference, make_qkv

F16, BF16 = torch.float16, torch.bfloat16


def run_kernel(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               softmax_scale=None, bottom_right=True, config=None):
    """Launch on NaN-filled output buffers so an element the kernel forgets to write fails the check."""
    batch, seqlen_q, heads, head_dim = q.shape
    left, right = window_size
    if causal:
        right = 0
    out = torch.full((batch, seqlen_q, heads, head_dim), math.nan, dtype=q.dtype)
    lse = torch.full((batch, heads, seqlen_q), math.nan, dtype=torch.float32)
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    diag = k.shape[1] - seqlen_q if bottom_right else 0
    attention_forward(q, k, v, softmax_scale=scale, window_left=left, window_right=right,
                      diag_offset=diag, softcap=softcap, alibi_slopes=alibi_slopes, out=out, lse=lse,
                      config=config)
    return out, lse


def check(q, k, v, config=None, **kw):
    out, lse = run_kernel(q, k, v, config=config, **kw)
    return assert_matches_reference(out, lse, q, k, v, **kw)


SEQLENS = [(1, 1), (1, 77), (17, 17), (64, 64), (50, 113), (113, 50), (128, 96)]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_seqlens(seqlen_q, seqlen_k, causal, dtype):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [1, 8, 16, 40, 64, 80, 96, 111, 128, 192, 256])
def test_head_dims(head_dim, dtype):
    q, k, v = make_qkv(1, 70, 70, 2, 1, head_dim, dtype)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,heads_k", [(1, 1), (4, 1), (6, 2), (8, 8), (12, 2)])
def test_gqa_mqa(heads, heads_k, causal):
    q, k, v = make_qkv(2, 45, 90, heads, heads_k, 32, F16)
    check(q, k, v, causal=causal)


WINDOWS = [(0, 0), (5, -1), (-1, 5), (16, 16), (3, 9), (100, 0), (0, -1), (40, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (40, 100), (100, 40)])
def test_sliding_window(seqlen_q, seqlen_k, window, causal):
    dtype = BF16 if sum(window) % 2 else F16
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, dtype)
    check(q, k, v, causal=causal, window_size=window)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(softcap, causal, dtype):
    q, k, v = make_qkv(2, 60, 75, 4, 2, 64, dtype)
    q = q * 3  # push scores into tanh's curved range
    check(q, k, v, causal=causal, softcap=softcap)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BxH"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (30, 90), (90, 30)])
def test_alibi(seqlen_q, seqlen_k, per_batch, causal):
    batch, heads = 2, 4
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, 2, 32, F16)
    slopes = torch.rand(batch, heads) if per_batch else torch.rand(heads)
    check(q, k, v, causal=causal, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_everything_at_once(dtype):
    q, k, v = make_qkv(3, 77, 100, 6, 2, 80, dtype)
    check(q, k, v, causal=True, window_size=(20, -1), softcap=10.0, alibi_slopes=torch.rand(3, 6),
          softmax_scale=0.3)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32), (32, 64), (16, 64), (64, 16)])
@pytest.mark.parametrize("case", ["causal", "window", "ragged"])
def test_tile_shapes(block_m, block_n, case):
    """Loop bounds must hold for any tile shape, including BLOCK_N > BLOCK_M as on the GPU."""
    kw = {"causal": dict(causal=True), "window": dict(window_size=(19, 7)),
          "ragged": dict(causal=True)}[case]
    sq, sk = (130, 130) if case != "ragged" else (75, 139)
    q, k, v = make_qkv(1, sq, sk, 2, 1, 32, F16)
    check(q, k, v, config=TileConfig(block_m, block_n, 4, 1), **kw)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_tensor_descriptor_path(head_dim, tma):
    """The Hopper path (K/V through tensor descriptors) computes the same thing as pointer loads."""
    q, k, v = make_qkv(2, 70, 99, 4, 2, head_dim, F16)
    check(q, k, v, causal=True, window_size=(50, -1), config=TileConfig(32, 64, 4, 1, use_tma=tma))


def test_top_left_causal():
    q, k, v = make_qkv(1, 50, 80, 2, 2, 32, F16)
    check(q, k, v, causal=True, bottom_right=False)
    q, k, v = make_qkv(1, 80, 50, 2, 2, 32, F16)
    check(q, k, v, causal=True, bottom_right=False)


def test_rows_without_keys_are_zero():
    """Sq > Sk causal (bottom-right): the first Sq - Sk rows see nothing; a window can empty rows too."""
    q, k, v = make_qkv(1, 90, 30, 2, 1, 32, F16)
    out, lse = run_kernel(q, k, v, causal=True)
    assert torch.all(out[:, :60] == 0) and torch.all(torch.isposinf(lse[:, :, :60]))
    assert torch.isfinite(lse[:, :, 60:]).all()
    # Sq > Sk with a window on both sides: rows whose band lies before key 0 see nothing.
    q, k, v = make_qkv(1, 100, 40, 2, 1, 32, F16)
    out, lse = run_kernel(q, k, v, window_size=(3, 2))
    assert torch.isposinf(lse).any()
    assert_matches_reference(out, lse, q, k, v, window_size=(3, 2))


def test_no_keys_at_all():
    q, k, v = make_qkv(2, 10, 0, 2, 1, 32, F16)
    out, lse = run_kernel(q, k, v)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


def test_strided_inputs():
    """BHSD tensors viewed as BSHD, and slices along the sequence, need no copy."""
    q = torch.randn(2, 4, 70, 64, dtype=F16).transpose(1, 2)
    kv = torch.randn(2, 2, 120, 2, 64, dtype=F16)
    k, v = kv[:, :, 10:110, 0].transpose(1, 2), kv[:, :, 10:110, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = run_kernel(q, k, v, causal=True)
    assert_matches_reference(out, lse, q, k, v, causal=True)
    out_c, lse_c = run_kernel(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_large_scores_stay_finite():
    """Scores far beyond exp's range: the online softmax must rescale, never overflow."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, F16)
    q, k = q * 20, k * 20
    check(q, k, v, causal=True)


def test_longer_sequence():
    q, k, v = make_qkv(1, 300, 300, 2, 1, 128, BF16)
    check(q, k, v, causal=True)


def test_only_plain_calls_take_the_cached_gluon_plan(monkeypatch):
    """attention_forward hands flash_attn_func's plain call (fresh out/LSE, full or bottom-right
    causal, a softcap with SOFTCAP_IN_KERNEL, nothing else) to gluon_forward.plain_forward and takes
    the general path when that declines (None) or when the call is not plain."""
    from flashtile.kernels import forward, gluon_forward
    seen = []

    def plain(q, k, v, softmax_scale, causal, sinks=None, softcap=0.0, softcap_approx=False):
        seen.append((causal, softcap) if softcap else causal)
        return None  # declined: the portable kernel runs
    monkeypatch.setattr(forward, "_PLAIN_GLUON", True)
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", True)
    monkeypatch.setattr(gluon_forward, "plain_forward", plain)
    q, k, v = (torch.randn(1, 70, 2, 64) for _ in range(3))
    base = dict(softmax_scale=0.125, window_left=-1, diag_offset=0)
    out, _ = attention_forward(q, k, v, window_right=0, **base)
    assert seen == [True]
    with monkeypatch.context() as m:
        m.setattr(forward, "_PLAIN_GLUON", False)
        ref, _ = attention_forward(q, k, v, window_right=0, **base)
    assert torch.equal(out, ref) and seen == [True]
    attention_forward(q, k, v, window_right=-1, **base)
    assert seen == [True, False]
    attention_forward(q, k, v, window_right=0, softcap=5.0, **base)
    assert seen == [True, False, (True, 5.0)]
    monkeypatch.setattr(gluon_forward, "SOFTCAP_IN_KERNEL", False)
    for extra in (dict(window_right=0, softcap=5.0), dict(window_right=4),
                  dict(window_right=-1, out=torch.empty_like(q)),
                  dict(window_right=-1, config=TileConfig(64, 64, 4, 1))):
        attention_forward(q, k, v, **base, **extra)
    attention_forward(q, k, v, softmax_scale=0.125, window_left=8, window_right=0, diag_offset=0)
    attention_forward(q[:, :30], k, v, softmax_scale=0.125, window_left=-1, window_right=0,
                      diag_offset=0)  # top-left causal with Sq != Sk: not flash_attn's mask
    assert seen == [True, False, (True, 5.0)]


def test_short_windows_take_64_row_tiles_on_sm90_only(monkeypatch):
    # (the rule's arithmetic; the tiles' speed and results are the H200's, window-tiles-h200-20261204)
    from flashtile.kernels import forward
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(forward, "interpreting", lambda: False)
    monkeypatch.setattr(forward, "_arch", lambda index: 90)
    for d, tiles, most in ((64, (64, 64, 2), 2049), (40, (64, 64, 2), 2049), (128, (64, 32, 2), 513),
                           (96, (64, 32, 2), 513)):
        for left, right in ((128, 0), (most - 1, 0), (0, 0), (200, most - 201), (300, 0)):
            cfg = forward.short_window_config(d, cuda, left, right)
            assert (cfg.block_m, cfg.block_n, cfg.num_stages) == tiles and cfg.use_tma, (d, left, right)
        for left, right in ((most, 0), (-1, 0), (-1, -1), (100, -1), (-1, 100), (most // 2, most // 2 + 1)):
            assert forward.short_window_config(d, cuda, left, right) is None, (d, left, right)
    assert forward.short_window_config(256, cuda, 128, 0) is None
    assert forward.short_window_config(64, torch.device("cpu"), 128, 0) is None
    monkeypatch.setattr(forward, "_arch", lambda index: 80)
    assert forward.short_window_config(64, cuda, 128, 0) is None


@pytest.mark.parametrize("d, window, causal, seqlen_q, seqlen_k", [
    (64, (70, 0), True, 150, 150), (40, (20, 30), False, 90, 170), (128, (45, 0), True, 170, 100),
    (96, (0, 0), True, 130, 130)])
def test_short_window_tiles_match_the_reference(d, window, causal, seqlen_q, seqlen_k):
    """The kernel on short_window_config's tile shapes (64 x 64 / 64 x 32, 2 stages; pointer loads
    here), windows spanning several key tiles with edges mid-tile, output and LSE NaN-filled first."""
    from flashtile.kernels import forward
    cfg = forward.SHORT_WINDOW_CONFIGS[forward.head_dim_padded(d)]
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, d, BF16 if d % 64 else F16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, seqlen_q), float("nan"))
    right = 0 if causal else window[1]
    forward.attention_forward(q, k, v, softmax_scale=d ** -0.5, window_left=window[0], window_right=right,
                              diag_offset=seqlen_k - seqlen_q, out=out, lse=lse,
                              config=forward.TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages))
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window)


def test_tiles_past_head_dim_128_fit_gpus_with_99_kb_of_shared_memory():
    # 64 x 64 tiles took 104 KB at head dim 256 on sm_89 (L4, L40S, RTX 40), where a CTA may have 99 KB
    from flashtile.kernels.forward import TileConfig, config_for_arch
    for arch in (86, 89, 120):
        assert config_for_arch(256, arch) == TileConfig(64, 32, 4, 2)
        assert config_for_arch(128, arch) == config_for_arch(128, 80)
    assert config_for_arch(256, 80) == TileConfig(64, 64, 4, 2)
