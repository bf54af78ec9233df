"""The Gluon dK/dV kernel (opt-in, sm_90): ``supported`` turns away what it does not handle, and the
backward keeps the portable kernel unless asked. Its variants' sm_90 compilation is tested in
test_gluon_compile.py; its numerics on the H200 by benchmarks/gluon_bwd_check.py (the interpreter
cannot run Gluon)."""

import torch

from flashtile.kernels import backward, gluon_backward


def test_supported_is_false_off_gpu():
    q = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 80, 2, 128, dtype=torch.bfloat16)
    assert not gluon_backward.supported(q, k, torch.randn_like(k), torch.randn_like(q))


def test_backward_keeps_the_portable_kernel_by_default():
    flags = dict(HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False, ALIBI=False, DROPOUT=False,
                 VARLEN=False, UPCAST=False)
    q = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    assert not backward.gluon_dkdv_applies(q, k, k, q, flags, 0, 0, False)
