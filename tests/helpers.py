"""Shared checks: the accuracy rule against the float64 reference."""

from __future__ import annotations

import torch

from flashtile.reference import attention


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    return q, k, v


def assert_matches_reference(out, lse, q, k, v, **kw):
    """out within 2x the error of textbook attention in the input dtype; lse to fp32 rounding.

    Both errors are max-abs against the float64 reference with the same masks; rows that see no key
    must give out == 0 and lse == +inf.
    """
    assert not torch.isnan(out).any(), "output has NaN (unwritten or fully-masked rows)"
    ref_out, ref_lse = attention(q.double(), k.double(), v.double(), **kw)
    low_out, _ = attention(q, k, v, **kw)
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    budget = 2 * (low_out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= budget, f"max error {err:.3g} > 2x textbook {q.dtype} error ({budget:.3g})"
    if lse is not None:
        assert not torch.isnan(lse).any(), "LSE has NaN (unwritten rows?)"
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse > 0), empty), "rows without keys must have LSE +inf"
        if (~empty).any():
            lse_err = (lse.double() - ref_lse)[~empty].abs()
            tol = 1e-5 * ref_lse[~empty].abs().clamp(min=1.0) + 1e-5
            assert (lse_err <= tol).all(), f"LSE error {lse_err.max().item():.3g}"
        assert torch.all(out[:, :].transpose(1, 2)[empty] == 0), "rows without keys must output 0"
    return err, budget
