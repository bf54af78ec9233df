"""Correctness check run before a benchmark: flashtile against a float64 reference.

Rule, as in flash_attn's own tests: on the sampled query rows, flashtile's largest output error must be
at most twice the largest error of textbook attention computed in the input dtype, both measured
against the float64 textbook. That budget scales with what the dtype can represent for each shape, so
one rule serves d64 and d256, 128 and 16k tokens. The LSE is float32 in every implementation, so it is
held to a fixed float32-level tolerance instead.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import reference

LSE_RTOL = 1e-3
OUT_BUDGET_FACTOR = 2.0
# GPU cases are too long to compare every row in float64; random rows plus the last ones (which see
# the most keys under a causal mask) keep the check to seconds.
RANDOM_ROWS = 256
TAIL_ROWS = 32


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    batch: int
    heads: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False

    @property
    def dtype_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def shape_text(self) -> str:
        return (f"{self.dtype_name} B{self.batch} H{self.heads}/{self.heads_k} "
                f"Sq{self.seqlen_q} Sk{self.seqlen_k} d{self.head_dim}")

    def features_text(self) -> str:
        parts = ["causal" if self.causal else "full"]
        if self.window != (-1, -1):
            parts.append(f"window({self.window[0]},{self.window[1]})")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi" + ("(B,H)" if self.batch > 1 else "(H)"))
        return " ".join(parts)

    def label(self) -> str:
        return f"{self.shape_text()} {self.features_text()}"

    def as_dict(self) -> dict:
        return {"dtype": self.dtype_name, "batch": self.batch, "heads": self.heads,
                "heads_k": self.heads_k, "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
                "head_dim": self.head_dim, "causal": self.causal, "window": list(self.window),
                "softcap": self.softcap, "alibi": self.alibi}


def check_cases(on_gpu: bool) -> list[Case]:
    """Every feature the prefill kernel has, in both dtypes, at real sizes on a GPU and tiny ones on CPU.

    CPU lengths stay <= 128 and avoid multiples of the 32-wide interpreter tile where it matters, so
    ragged edges and partially visible blocks are still exercised.
    """
    def n(gpu: int, cpu: int) -> int:
        return gpu if on_gpu else cpu

    bf, fp = torch.bfloat16, torch.float16
    return [
        Case(bf, 1, n(16, 2), n(16, 2), n(16384, 128), n(16384, 128), 128, causal=True),
        Case(fp, 1, n(16, 2), n(16, 2), n(16384, 128), n(16384, 128), 128),
        # The seed model's heads (Qwen2.5-1.5B): GQA 12/2.
        Case(bf, 1, 12, 2, n(8192, 64), n(8192, 64), 128, causal=True),
        Case(fp, 2, 12, 2, n(4096, 48), n(4096, 48), 128),
        # MQA
        Case(bf, 2, n(16, 4), 1, n(4096, 96), n(4096, 96), 64, causal=True),
        Case(fp, 2, n(16, 4), 1, n(2000, 77), n(2000, 77), 64),
        # Head dims that are not powers of two, and the largest one.
        Case(fp, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 80, causal=True),
        Case(bf, 2, n(8, 2), n(8, 2), n(2000, 70), n(2000, 70), 111),
        Case(bf, 1, n(8, 2), n(8, 2), n(4096, 64), n(4096, 64), 256, causal=True),
        Case(fp, 2, n(8, 2), n(8, 2), n(2048, 50), n(2048, 50), 256),
        # Sq < Sk (chunked prefill against a cache) and Sq > Sk, where causal rows above the
        # bottom-right diagonal see no key at all.
        Case(bf, 2, 8, 2, n(1000, 40), n(3000, 100), 128, causal=True),
        Case(fp, 2, 8, 2, n(500, 30), n(4096, 128), 64),
        Case(bf, 2, n(8, 2), n(8, 2), n(3000, 100), n(1000, 40), 128, causal=True),
        Case(fp, 2, n(8, 2), n(8, 2), n(2048, 64), n(600, 20), 80),
        # Sliding window: causal (Mistral-style) and two-sided.
        Case(bf, 2, 8, 2, n(4096, 128), n(4096, 128), 128, causal=True, window=(n(256, 24), 0)),
        Case(fp, 1, n(8, 2), n(8, 2), n(4000, 100), n(4000, 100), 64, window=(n(128, 16), n(64, 8))),
        # Softcap: one tight enough to change the scores a lot, one at Gemma 2's value.
        Case(bf, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 128, causal=True, softcap=3.0),
        Case(fp, 1, 8, 2, n(2000, 70), n(2000, 70), 256, softcap=50.0),
        # ALiBi with per-batch slopes (B, H) and shared slopes (H,).
        Case(bf, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 128, causal=True, alibi=True),
        Case(fp, 1, n(8, 2), n(8, 2), n(2000, 90), n(2000, 90), 64, alibi=True),
        # Everything at once.
        Case(bf, 2, 12, 2, n(1500, 50), n(2500, 90), 111, causal=True, window=(n(512, 20), 0),
             softcap=30.0, alibi=True),
    ]


def make_inputs(case: Case, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(seqlen: int, heads: int) -> torch.Tensor:
        return torch.randn(case.batch, seqlen, heads, case.head_dim, generator=gen, device=device,
                           dtype=case.dtype)

    q = randn(case.seqlen_q, case.heads)
    k, v = randn(case.seqlen_k, case.heads_k), randn(case.seqlen_k, case.heads_k)
    slopes = alibi_slopes(case.batch, case.heads, device) if case.alibi else None
    return q, k, v, slopes


def alibi_slopes(batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """The ALiBi paper's geometric slopes; (B, H) with a per-batch factor when batch > 1, so that
    both layouts flash_attn accepts get checked."""
    base = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)
    if batch > 1:
        base = base * (1.0 + 0.5 * torch.arange(batch, dtype=torch.float32)).view(-1, 1)
    return base.to(device)


def sample_rows(seqlen_q: int, on_gpu: bool, seed: int) -> torch.Tensor:
    if not on_gpu or seqlen_q <= RANDOM_ROWS + TAIL_ROWS:
        return torch.arange(seqlen_q)
    gen = torch.Generator().manual_seed(seed)
    random = torch.randperm(seqlen_q - TAIL_ROWS, generator=gen)[:RANDOM_ROWS]
    tail = torch.arange(seqlen_q - TAIL_ROWS, seqlen_q)
    return torch.cat([random, tail]).sort().values


def _max_abs_error(x: torch.Tensor, exact: torch.Tensor) -> float:
    return (x.double() - exact.double()).abs().max().item()


def lse_error(lse: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |lse - exact| / max(1, |exact|); inf when a row that sees no key (+inf in the
    reference) is finite in ``lse`` or the other way round, NaN if ``lse`` has NaN."""
    lse, exact = lse.double(), exact.double()
    empty = torch.isinf(exact)
    if not torch.equal(lse[empty], exact[empty]) or torch.isinf(lse[~empty]).any():
        return float("inf")
    if not (~empty).any():
        return 0.0
    diff = (lse - exact).abs() / exact.abs().clamp(min=1.0)
    return diff[~empty].max().item()


def nan_poisoned_attention(q, k, v, return_attn_probs=True, **kwargs):
    """flash_attn_func's arguments, checked by it, computed into NaN-filled buffers, so an element the
    kernel never writes shows up as an error instead of as leftover memory."""
    import flashtile
    from ..kernels.forward import attention_forward

    flashtile.flash_attn_func(q[:, :1], k, v, **kwargs)  # argument checks only; result unused
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads, seqlen_q), math.nan, dtype=torch.float32, device=q.device)
    left, right = kwargs["window_size"]
    attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_left=left,
                      window_right=0 if kwargs["causal"] else right,
                      diag_offset=k.shape[1] - seqlen_q, softcap=kwargs["softcap"],
                      alibi_slopes=kwargs["alibi_slopes"], out=out, lse=lse)
    return out, lse, None


def run_case(case: Case, device: torch.device, seed: int = 0,
             attn: Callable | None = None) -> dict:
    """Check one case; ``attn`` (default: the kernel on NaN-poisoned outputs) is replaceable for
    testing the rule."""
    if attn is None:
        attn = nan_poisoned_attention
    start = time.perf_counter()
    q, k, v, slopes = make_inputs(case, device, seed)
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
                  alibi_slopes=slopes)
    out, lse, _ = attn(q, k, v, return_attn_probs=True, **kwargs)

    rows = sample_rows(case.seqlen_q, device.type == "cuda", seed).to(device)
    exact_out, exact_lse = reference.attention(q.double(), k.double(), v.double(), query_rows=rows,
                                               **kwargs)
    low_out, _ = reference.attention(q, k, v, query_rows=rows, **kwargs)

    finite = bool(torch.isfinite(out).all())
    out_err = _max_abs_error(out[:, rows], exact_out)
    budget = OUT_BUDGET_FACTOR * _max_abs_error(low_out, exact_out)
    lse_err = lse_error(lse[:, :, rows], exact_lse)
    passed = finite and out_err <= budget and lse_err <= LSE_RTOL
    return {**case.as_dict(), "label": case.label(), "passed": passed, "finite": finite,
            "out_err": out_err, "budget": budget, "lse_err": lse_err, "rows_checked": rows.numel(),
            "seconds": round(time.perf_counter() - start, 3), "error": None}


def format_result(r: dict) -> str:
    status = "PASS" if r["passed"] else "FAIL"
    if r.get("error"):
        return f"{status}  {r['label']:<58}  error: {r['error']}"
    nonfinite = "" if r["finite"] else "  NaN/inf in output!"
    within = "<=" if r["out_err"] <= r["budget"] else "> "
    return (f"{status}  {r['label']:<58}  out err {r['out_err']:.2e} {within} {r['budget']:.2e}  "
            f"lse err {r['lse_err']:.1e}  ({r['rows_checked']} rows){nonfinite}")


def run_check(device: torch.device, cases: list[Case] | None = None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Run every case, log one line each, and return the records for the result JSON."""
    cases = check_cases(device.type == "cuda") if cases is None else cases
    log(f"Correctness check: {len(cases)} cases on {device.type}; rule: max|out - fp64| <= "
        f"{OUT_BUDGET_FACTOR:g} x max|textbook(dtype) - fp64|, LSE within {LSE_RTOL:g} relative")
    results = []
    base_seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; recorded to replay
    for i, case in enumerate(cases):
        try:
            result = run_case(case, device, seed=base_seed + i)
            result["seed"] = base_seed + i
        except Exception as exc:  # a crash is a failed case, not a crashed check
            result = {**case.as_dict(), "label": case.label(), "passed": False,
                      "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"}
        log(format_result(result))
        results.append(result)
    n_pass = sum(r["passed"] for r in results)
    log(f"Correctness check: {n_pass}/{len(results)} passed")
    return results


def all_passed(results: list[dict]) -> bool:
    return all(r["passed"] for r in results)


# ----------------------------------------------------------------------------------------- backward
#
# Gradients against the float64 textbook, through torch autograd. Unlike the forward check, no rows can
# be sampled (every query row contributes to dK and dV), so the GPU sizes are bounded by what the float64
# autograd graph holds: about GRAD_REF_BYTES_PER_SCORE bytes per score element at its peak.

GRAD_BUDGET_FACTOR = 3.0
GRAD_FLOOR_ULPS = 1 / 16  # of eps(dtype) x max|exact gradient|: single-key rows have exact dQ = 0
GRAD_REF_BYTES_PER_SCORE = 64  # float64 scores, softmax, probabilities and their gradients at once
GRAD_REF_MAX_BYTES = 20e9


@dataclass(frozen=True)
class BackwardCase(Case):
    """A forward case plus dropout and packed sequences. With ``lengths`` the case is
    flash_attn_varlen_func self-attention over those sequences (batch = len(lengths),
    seqlen_q = seqlen_k = max(lengths))."""
    dropout_p: float = 0.0
    lengths: tuple[int, ...] | None = None

    def shape_text(self) -> str:
        if self.lengths is None:
            return super().shape_text()
        return (f"{self.dtype_name} varlen B{len(self.lengths)} H{self.heads}/{self.heads_k} "
                f"L{min(self.lengths)}..{max(self.lengths)} (T{sum(self.lengths)}) d{self.head_dim}")

    def features_text(self) -> str:
        text = super().features_text()
        return f"{text} dropout{self.dropout_p:g}" if self.dropout_p else text

    def as_dict(self) -> dict:
        return {**super().as_dict(), "dropout_p": self.dropout_p,
                "lengths": None if self.lengths is None else list(self.lengths)}

    def score_elements(self) -> int:
        """Score elements the reference materialises (all sequences, all heads)."""
        if self.lengths is not None:
            return self.heads * sum(n * n for n in self.lengths)
        return self.batch * self.heads * self.seqlen_q * self.seqlen_k


def varlen_case(dtype: torch.dtype, lengths, heads: int, heads_k: int, head_dim: int,
                **features) -> BackwardCase:
    lengths = tuple(lengths)
    return BackwardCase(dtype, len(lengths), heads, heads_k, max(lengths), max(lengths), head_dim,
                        lengths=lengths, **features)


def backward_cases(on_gpu: bool) -> list[BackwardCase]:
    """The backward of every feature, in both dtypes: real sizes on a GPU (float64 reference graph
    under GRAD_REF_MAX_BYTES), tiny ones on CPU (<= 96 tokens, ragged against the 32-wide
    interpreter tiles)."""
    def n(gpu: int, cpu: int) -> int:
        return gpu if on_gpu else cpu

    bf, fp = torch.bfloat16, torch.float16
    C = BackwardCase
    return [
        C(bf, 1, n(8, 2), n(8, 2), n(4096, 96), n(4096, 96), 128, causal=True),
        C(fp, 1, n(8, 2), n(8, 2), n(4096, 80), n(4096, 80), 128),
        # The seed model's heads (Qwen2.5-1.5B): GQA 12/2, dK/dV summed over the group of 6.
        C(bf, 1, 12, 2, n(4096, 48), n(4096, 48), 128, causal=True),
        C(fp, n(2, 1), 12, 2, n(2048, 40), n(2048, 40), 128),
        # MQA
        C(bf, 2, n(8, 4), 1, n(2048, 64), n(2048, 64), 64, causal=True),
        C(fp, 2, n(8, 4), 1, n(2000, 77), n(2000, 77), 64),
        # Head dims 80 (padded to 128 in registers) and 256.
        C(fp, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 80, causal=True),
        C(bf, 1, n(8, 2), n(8, 2), n(2000, 70), n(2000, 70), 80),
        C(bf, 1, n(8, 2), n(8, 2), n(4096, 64), n(4096, 64), 256, causal=True),
        C(fp, 2, n(4, 2), n(4, 2), n(2000, 50), n(2000, 50), 256),
        # Sq < Sk, and Sq > Sk where causal rows above the bottom-right diagonal see no key.
        C(bf, 2, n(8, 4), 2, n(1000, 40), n(3000, 96), 128, causal=True),
        C(fp, 2, n(8, 4), 2, n(3000, 96), n(1000, 40), 64, causal=True),
        C(fp, 1, n(8, 2), n(8, 2), n(2048, 64), n(600, 20), 80),
        # Sliding window: causal (Mistral-style) and two-sided.
        C(bf, 1, n(8, 4), 2, n(4096, 96), n(4096, 96), 128, causal=True, window=(n(256, 24), 0)),
        C(fp, 1, n(8, 2), n(8, 2), n(4000, 90), n(4000, 90), 64, window=(n(128, 16), n(64, 8))),
        # Softcap: tight (changes the scores a lot) and Gemma 2's 50.
        C(bf, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 128, causal=True, softcap=3.0),
        C(fp, 1, n(8, 4), 2, n(2000, 70), n(2000, 70), 256, softcap=50.0),
        # ALiBi, per-batch slopes (B, H) and shared (H,).
        C(bf, 2, n(8, 2), n(8, 2), n(2048, 64), n(2048, 64), 128, causal=True, alibi=True),
        C(fp, 1, n(8, 2), n(8, 2), n(2000, 90), n(2000, 90), 64, alibi=True),
        # Everything at once.
        C(bf, 2, 12, 2, n(1500, 50), n(2500, 90), 128, causal=True, window=(n(512, 20), 0),
          softcap=30.0, alibi=True),
        # Dropout, compared with the reference under the same regenerated mask.
        C(bf, 2, n(8, 4), 2, n(2048, 60), n(2048, 70), 128, causal=True, dropout_p=0.17),
        C(fp, 1, n(8, 2), n(8, 2), n(1000, 50), n(1000, 50), 64, window=(n(100, 9), n(50, 5)),
          dropout_p=0.3),
        # Packed sequences (flash_attn_varlen_func), single-token ones included.
        varlen_case(bf, (1000, 3000, 96, 1, 517, 2048, 333, 1100) if on_gpu else (37, 1, 70, 96, 5),
                    n(8, 4), 2, 128, causal=True),
        varlen_case(fp, (700, 1, 2500, 64, 1999) if on_gpu else (20, 64, 1, 45), n(8, 2), n(8, 2), 64,
                    window=(n(300, 12), n(100, 6)), alibi=True),
    ]


def make_backward_inputs(case: BackwardCase, device: torch.device, seed: int):
    """q, k, v, dout (BSHD, or packed (total, H, D) for varlen), ALiBi slopes, cu_seqlens or None."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=case.dtype)

    if case.lengths is None:
        q = randn(case.batch, case.seqlen_q, case.heads, case.head_dim)
        k = randn(case.batch, case.seqlen_k, case.heads_k, case.head_dim)
        v = randn(case.batch, case.seqlen_k, case.heads_k, case.head_dim)
        cu_seqlens = None
    else:
        total = sum(case.lengths)
        q = randn(total, case.heads, case.head_dim)
        k, v = randn(total, case.heads_k, case.head_dim), randn(total, case.heads_k, case.head_dim)
        offsets = [0]
        for length in case.lengths:
            offsets.append(offsets[-1] + length)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    dout = randn(*q.shape)
    slopes = alibi_slopes(case.batch, case.heads, device) if case.alibi else None
    return q, k, v, dout, slopes, cu_seqlens


def flashtile_out_grads(q, k, v, dout, cu_seqlens=None, max_seqlen=0, **kwargs):
    """flashtile's output and (dq, dk, dv): flash_attn_func, or flash_attn_varlen_func with
    ``cu_seqlens`` (self-attention: the same offsets for queries and keys)."""
    import flashtile

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if cu_seqlens is None:
        out = flashtile.flash_attn_func(q, k, v, **kwargs)
    else:
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                               **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), grads


def reference_out_grads(q, k, v, dout, cu_seqlens=None, max_seqlen=0, **kwargs):
    """Textbook attention in q's dtype, and its gradients through torch autograd; packed sequences
    are computed one at a time. ``dropout_p``/``dropout_mask`` pass through to reference.attention."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if cu_seqlens is None:
        out, _ = reference.attention(q, k, v, **kwargs)
    else:
        slopes = kwargs.pop("alibi_slopes", None)
        bounds = cu_seqlens.tolist()
        outs = []
        for b in range(len(bounds) - 1):
            s = slice(bounds[b], bounds[b + 1])
            one, _ = reference.attention(q[s][None], k[s][None], v[s][None],
                                         alibi_slopes=None if slopes is None else slopes[b:b + 1],
                                         **kwargs)
            outs.append(one[0])
        out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype), allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    return out.detach(), grads


def _regenerated_dropout_mask(case: BackwardCase, device: torch.device, seed: int) -> torch.Tensor:
    """The keep mask flashtile draws right after torch.manual_seed(seed)."""
    from ..kernels.dropout import dropout_mask

    torch.manual_seed(seed)
    rng_seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    return dropout_mask(rng_seed, case.batch, case.heads, case.seqlen_q, case.seqlen_k,
                        case.dropout_p)


def run_backward_case(case: BackwardCase, device: torch.device, seed: int = 0,
                      out_grads: Callable | None = None) -> dict:
    """Check one case's output (2x rule) and dq, dk, dv (3x rule, with a floor of
    eps(dtype)/16 x max|exact gradient|); ``out_grads`` (default flashtile_out_grads) is replaceable
    for testing the rule."""
    out_grads = out_grads or flashtile_out_grads
    start = time.perf_counter()
    q, k, v, dout, slopes, cu_seqlens = make_backward_inputs(case, device, seed)
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
                  alibi_slopes=slopes)
    if cu_seqlens is not None:
        kwargs.update(cu_seqlens=cu_seqlens, max_seqlen=max(case.lengths))
    ref_kwargs = dict(kwargs)
    # fork_rng: the seeding that reproduces flashtile's dropout draw leaves the caller's RNG alone.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if case.dropout_p:
            if cu_seqlens is not None:
                raise ValueError("dropout is checked on padded batches only")
            keep = _regenerated_dropout_mask(case, device, seed)
            ref_kwargs.update(dropout_p=case.dropout_p, dropout_mask=keep)
            torch.manual_seed(seed)  # flashtile draws the same Philox seed again
            out, grads = out_grads(q, k, v, dout, dropout_p=case.dropout_p, **kwargs)
        else:
            out, grads = out_grads(q, k, v, dout, **kwargs)

    exact_out, exact = reference_out_grads(q.double(), k.double(), v.double(), dout.double(),
                                           **ref_kwargs)
    low_out, low = reference_out_grads(q, k, v, dout, **ref_kwargs)

    eps = torch.finfo(case.dtype).eps
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    out_err = _max_abs_error(out, exact_out) if out.numel() else 0.0
    out_floor = GRAD_FLOOR_ULPS * eps * (exact_out.abs().max().item() if out.numel() else 0.0)
    out_budget = max(OUT_BUDGET_FACTOR * (_max_abs_error(low_out, exact_out) if out.numel() else 0.0),
                     out_floor)
    scale = max((e.abs().max().item() if e.numel() else 0.0) for e in exact)
    floor = GRAD_FLOOR_ULPS * eps * scale
    errors, budgets, textbook = {}, {}, {}
    for name, g, e, lo in zip(("dq", "dk", "dv"), grads, exact, low):
        if g.shape != e.shape or g.dtype != case.dtype:
            raise ValueError(f"{name} has shape {tuple(g.shape)} and dtype {g.dtype}, expected "
                             f"{tuple(e.shape)} and {case.dtype}")
        errors[name] = _max_abs_error(g, e) if g.numel() else 0.0
        textbook[name] = _max_abs_error(lo, e) if g.numel() else 0.0
        budgets[name] = max(GRAD_BUDGET_FACTOR * textbook[name], floor)
    passed = (finite and out_err <= out_budget
              and all(errors[n] <= budgets[n] for n in errors))
    return {**case.as_dict(), "label": case.label(), "passed": passed, "finite": finite,
            "out_err": out_err, "out_budget": out_budget, "grad_err": errors, "grad_budget": budgets,
            "textbook_grad_err": textbook, "grad_floor": floor,
            "seconds": round(time.perf_counter() - start, 3), "error": None}


def format_backward_result(r: dict) -> str:
    status = "PASS" if r["passed"] else "FAIL"
    if r.get("error"):
        return f"{status}  {r['label']:<62}  error: {r['error']}"

    def part(name: str, err: float, budget: float) -> str:
        return f"{name} {err:.2e}{'<=' if err <= budget else '> '}{budget:.2e}"

    parts = [part("out", r["out_err"], r["out_budget"])]
    parts += [part(n, r["grad_err"][n], r["grad_budget"][n]) for n in ("dq", "dk", "dv")]
    nonfinite = "" if r["finite"] else "  NaN/inf!"
    return f"{status}  {r['label']:<62}  " + "  ".join(parts) + nonfinite


def run_backward_check(device: torch.device, cases: list[BackwardCase] | None = None,
                       log: Callable[[str], None] = print) -> list[dict]:
    """Run every backward case, log one line each, and return the records for the result JSON."""
    cases = backward_cases(device.type == "cuda") if cases is None else cases
    log(f"Backward check: {len(cases)} cases on {device.type}; rule: max|grad - fp64| <= "
        f"{GRAD_BUDGET_FACTOR:g} x max|textbook(dtype) grad - fp64| (floor eps/16 x max|grad|) for "
        f"dq, dk, dv; out within {OUT_BUDGET_FACTOR:g} x")
    results = []
    base_seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; recorded to replay
    for i, case in enumerate(cases):
        error = None
        try:
            result = run_backward_case(case, device, seed=base_seed + i)
        except Exception as exc:  # a crash is a failed case, not a crashed check
            error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        if error is not None:  # outside the except block: the traceback no longer pins tensors
            result = {**case.as_dict(), "label": case.label(), "passed": False, "error": error}
        result["seed"] = base_seed + i
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float64 graphs are the largest allocations of the run
        log(format_backward_result(result))
        results.append(result)
    n_pass = sum(r["passed"] for r in results)
    log(f"Backward check: {n_pass}/{len(results)} passed")
    return results


# ----------------------------------------------------------------------------------------- extras
#
# What the gradient check cannot see: bitwise determinism of repeated backward passes, dropout's kept
# fraction, torch.compile against eager, and the custom ops' registrations (opcheck).

def run_training_extras(device: torch.device, log: Callable[[str], None] = print) -> list[dict]:
    """Determinism, dropout's kept fraction, torch.compile(fullgraph=True) and opcheck, on real sizes
    on a GPU and small ones on CPU; one record each, with ``passed``."""
    import flashtile
    from ..kernels.dropout import dropout_mask
    from ..ops import new_dropout_seed

    on_gpu = device.type == "cuda"
    seqlen, heads, heads_k, head_dim = (2048, 8, 2, 128) if on_gpu else (80, 4, 2, 32)
    dtype = torch.bfloat16
    results = []

    def record(name: str, passed: bool, detail: str):
        results.append({"label": name, "passed": bool(passed), "detail": detail})
        log(f"{'PASS' if passed else 'FAIL'}  {name:<44s}{detail}")

    def run(name, fn):
        try:
            fn()
        except Exception as exc:  # a crash is a failed check, not a crashed benchmark
            record(name, False, f"{type(exc).__name__}: {str(exc).strip()[:300]}")

    gen = torch.Generator(device="cpu").manual_seed(random.SystemRandom().randrange(2**31))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = randn(2, seqlen, heads, head_dim), randn(2, seqlen, heads_k, head_dim), \
        randn(2, seqlen, heads_k, head_dim)
    dout = randn(2, seqlen, heads, head_dim)

    def grads(**kw):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = flashtile.flash_attn_func(*leaves, causal=True, **kw)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))

    def determinism():
        first, second = grads(deterministic=True), grads(deterministic=True)
        same = all(torch.equal(a, b) for a, b in zip(first, second))
        record(f"deterministic=True, two runs, B2 S{seqlen} H{heads}/{heads_k}", same,
               "out, dq, dk, dv bitwise equal" if same else "runs differ")

    def kept_fraction():
        p = 0.17
        shape = (2, 8, 2048, 2048) if on_gpu else (1, 2, 300, 300)
        seed = new_dropout_seed(p, device)
        keep = dropout_mask(seed, shape[0], shape[1], shape[2], shape[3], p)
        frac = keep.float().mean().item()
        record(f"dropout p={p} kept fraction over {keep.numel():.2e}", abs(frac - (1 - p)) < 0.01,
               f"{frac:.4f} vs {1 - p:.4f} (tolerance 0.01)")

    def compiled():
        cu = torch.tensor([0, seqlen // 3, seqlen], dtype=torch.int32, device=device)
        cache_k, cache_v = randn(2, seqlen, heads_k, head_dim), randn(2, seqlen, heads_k, head_dim)
        lengths = torch.tensor([seqlen // 2, seqlen - 1], dtype=torch.int32, device=device)

        def layer(q, k, v):
            # deterministic: the default backward may add dQ by atomic reductions (the Gluon one on
            # sm_90), whose order differs run to run; bitwise equality needs the reproducible one.
            a = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
            b = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, seqlen, seqlen, causal=True,
                                                 deterministic=True)
            c = flashtile.flash_attn_with_kvcache(q[:, -1:].detach(), cache_k, cache_v,
                                                  cache_seqlens=lengths)  # inference only
            return a, b, c

        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        got = torch.compile(layer, fullgraph=True)(*leaves)
        got_grads = torch.autograd.grad(got[0].float().sum() + got[1].float().sum(), leaves)
        leaves_e = [t.clone().requires_grad_(True) for t in (q, k, v)]
        expected = layer(*leaves_e)
        exp_grads = torch.autograd.grad(expected[0].float().sum() + expected[1].float().sum(), leaves_e)
        same = (all(torch.equal(a, b) for a, b in zip(got, expected))
                and all(torch.equal(a, b) for a, b in zip(got_grads, exp_grads)))
        record("torch.compile(fullgraph=True) vs eager", same,
               "flash_attn_func + varlen + kvcache outputs and gradients bitwise equal" if same
               else "compiled and eager differ")

    def opcheck():
        small = [t[:1, :64].contiguous() for t in (q, k, v)]
        small[0].requires_grad_(True)
        torch.library.opcheck(torch.ops.flashtile.attn_fwd.default,
                              (*small, head_dim ** -0.5, -1, 0, True, 0.0, None),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        record("opcheck flashtile::attn_fwd", True, "schema, autograd registration, fake tensor")

    for name, fn in (("determinism", determinism), ("kept fraction", kept_fraction),
                     ("torch.compile", compiled), ("opcheck", opcheck)):
        run(name, fn)
    log(f"Training extras: {sum(r['passed'] for r in results)}/{len(results)} passed")
    return results
