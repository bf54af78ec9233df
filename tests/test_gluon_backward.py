"""The Gluon backward kernels (sm_90): ``supported`` turns away what they do not handle, the backward
keeps the portable kernels off sm_90 and for deterministic calls, and a fused-dQ variant refuses
shapes it has no code for. Its variants' sm_90 compilation is tested in
test_gluon_compile.py; its numerics on the H200 by benchmarks/gluon_bwd_check.py (the interpreter
cannot run Gluon)."""

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
