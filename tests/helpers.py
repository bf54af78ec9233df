"""Shared checks: the accuracy rule against the float64 reference."""

from __future__ import annotations

import torch

from flashtile.reference import attention


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    return q, k, v


def _score_terms(q, k, softmax_scale=None):
    """(B, H, Sq): max over keys of softmax_scale * sum_d |q_d| |k_d|, query head h on KV head h // group."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    kk = k.abs().double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.abs().double(), kk).amax(-1) * scale


def assert_matches_reference(out, lse, q, k, v, *, rounded_twice=False, **kw):
    """out within 2x the error of textbook attention in the input dtype; lse to fp32 rounding.

    Both errors are max-abs against the float64 reference with the same masks; rows that see no key
    must give out == 0 and lse == +inf. ``rounded_twice``: an output scaled after the kernel stored
    it (attention sinks) is rounded to the dtype a second time; half an ulp at the output's largest
    magnitude is added to the budget for it.
    """
    assert not torch.isnan(out).any(), "output has NaN (unwritten or fully-masked rows)"
    ref_out, ref_lse = attention(q.double(), k.double(), v.double(), **kw)
    low_out, _ = attention(q, k, v, **kw)
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    budget = 2 * (low_out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    if rounded_twice and out.numel():
        budget += torch.finfo(out.dtype).eps / 2 * ref_out.abs().max().item()
    assert err <= budget, f"max error {err:.3g} > 2x textbook {q.dtype} error ({budget:.3g})"
    if lse is not None:
        assert not torch.isnan(lse).any(), "LSE has NaN (unwritten rows?)"
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse > 0), empty), "rows without keys must have LSE +inf"
        if (~empty).any():
            lse_err = (lse.double() - ref_lse)[~empty].abs()
            # fp32 rounding of the scores: relative to the row's LSE, or to its largest sum of
            # |q_d k_d| terms when those are larger (big scores that cancel to a small LSE).
            terms = _score_terms(q, k, kw.get("softmax_scale"))[~empty]
            tol = 1e-5 * torch.maximum(ref_lse[~empty].abs(), terms).clamp(min=1.0) + 1e-5
            assert (lse_err <= tol).all(), f"LSE error {lse_err.max().item():.3g}"
        assert torch.all(out[:, :].transpose(1, 2)[empty] == 0), "rows without keys must output 0"
    return err, budget


def reference_grads(q, k, v, dout, dlse=None, **kw):
    """Autograd through textbook attention in q's dtype: (dq, dk, dv)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention(q, k, v, **kw)
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(torch.isinf(lse), 0).to(dlse.dtype) * dlse).sum()
    loss.backward()
    return q.grad, k.grad, v.grad


def assert_grads_match_reference(grads, q, k, v, dout, dlse=None, out=None, **kw):
    """Each gradient within 3x the error of textbook attention's gradient in the input dtype, or, where
    it is larger, 2x the error FlashAttention's own backward has in exact arithmetic from D =
    rowsum(dO * O) taken from the output as stored (rounded to the input dtype).

    The second is the algorithm's, not an implementation's: D's rounding error dD moves dS by
    -P dD, which is exactly the gradient of -dD * LSE, so it is computed as a float64 backward with
    dlse - dD. Textbook attention has no such term, and on rows that see one or two keys (a dQ of
    0 or nearly) its own error can be several times smaller, even exactly 0. ``out``: the output
    the backward took D from (the forward's); without it the exact output rounded to the dtype
    stands in, which misses an element the kernel rounded the other way (one fp16 ulp of O moves D
    by |dO| ulp). The budget never drops below 1/16 ulp of the dtype at the gradients' scale either.
    """
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    dlse64 = None if dlse is None else dlse.double()
    exact = reference_grads(q64, k64, v64, dout64, dlse64, **kw)
    low = reference_grads(q, k, v, dout, dlse, **kw)
    out64, _ = attention(q64, k64, v64, **kw)
    stored = out64.to(q.dtype) if out is None else out.detach()
    rounding = ((stored.double() - out64) * dout64).sum(-1).transpose(1, 2)  # (B, H, Sq)
    stored_d = reference_grads(q64, k64, v64, dout64, -rounding if dlse64 is None else dlse64 - rounding,
                               **kw)
    scale = max((e.abs().max().item() if e.numel() else 0.0) for e in exact)
    floor = torch.finfo(q.dtype).eps / 16 * scale
    for name, g, e, lo, sd in zip(("dq", "dk", "dv"), grads, exact, low, stored_d):
        assert g.shape == e.shape and g.dtype == q.dtype, name
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten elements?)"
        if not g.numel():
            continue
        err = (g.double() - e).abs().max().item()
        low_err = (lo.double() - e).abs().max().item()
        stored_d_err = (sd - e).abs().max().item()
        budget = max(3 * low_err, 2 * stored_d_err, floor)
        assert err <= budget, (f"{name}: max error {err:.3g} > max(3x textbook {q.dtype} error {low_err:.3g}, "
                               f"2x D from the stored output {stored_d_err:.3g})")


def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding written with complex numbers: an independent check of flashtile's. The factor
    is the table's own cos + i sin (as flash_attn applies it), not a unit phasor rebuilt from the angle:
    fp16 tables are off the unit circle by ~1e-3, which would move the reference's q by about an ulp."""
    half = cos.shape[1]
    turn = torch.complex(cos[positions].double(), sin[positions].double()).unsqueeze(2)  # (B, S, 1, half)
    rot = x[..., :2 * half].double()
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2]) * turn
        rotated = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        z = torch.complex(rot[..., :half], rot[..., half:]) * turn
        rotated = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rotated, x[..., 2 * half:].double()], dim=-1).to(x.dtype)


def record_gluon_launches(monkeypatch) -> list:
    """gluon_forward's launches recorded instead of run (their arguments, a tuple each), its plan
    caches emptied, on a stand-in current device with 132 SMs: a CPU test of what a launch carries."""
    from flashtile.kernels import gluon_forward
    monkeypatch.setattr(gluon_forward, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # q.device.index on a CPU
    for cache in ("_PLAIN", "_PACKED", "_FP8"):
        monkeypatch.setattr(gluon_forward, cache, {})
    recorded = []
    monkeypatch.setattr(gluon_forward, "launch", lambda *args: recorded.append(args))
    return recorded
