"""Textbook attention with flashtile's masks, bias and softcap: the yardstick for tests and benchmarks.

Everything is computed in the dtype of the inputs, the way eager implementations do it (scores and the
final product in that dtype, the softmax in float32), so calling it on float64 inputs gives the exact
reference and calling it on bf16/fp16 inputs gives the error budget a kernel is judged against.
"""

from __future__ import annotations

import math

import torch

# Scores held at once by one chunk of query rows; keeps the float64 reference usable at 16k tokens.
_CHUNK_ELEMENTS = 1 << 27


def visible_keys(rows: torch.Tensor, seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), bottom_right: bool = True) -> torch.Tensor:
    """Boolean (len(rows), seqlen_k) mask of the keys each query row may attend to.

    Query i is aligned with key i + (seqlen_k - seqlen_q) when ``bottom_right`` (flash_attn's
    convention) and with key i otherwise (SDPA's ``is_causal``). ``causal`` bounds the window on the
    right at 0; -1 leaves a side unbounded.
    """
    left, right = window_size
    if causal:
        right = 0
    diag = (seqlen_k - seqlen_q) if bottom_right else 0
    pos = rows.view(-1, 1) + diag
    cols = torch.arange(seqlen_k, device=rows.device).view(1, -1)
    keep = torch.ones(rows.numel(), seqlen_k, dtype=torch.bool, device=rows.device)
    if right >= 0:
        keep &= cols <= pos + right
    if left >= 0:
        keep &= cols >= pos - left
    return keep


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, bottom_right: bool = True,
              query_rows: torch.Tensor | None = None, chunk_rows: int | None = None,
              dropout_p: float = 0.0, dropout_mask: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (batch, seqlen, heads, head_dim) tensors; returns (out, lse).

    ``out`` has q's layout and dtype; ``lse`` is float32 (or float64 for float64 inputs) of shape
    (batch, heads, rows), natural log, +inf for rows that see no key (flash_attn's convention; their
    output is 0). ``query_rows`` restricts the computation to some rows of q (positions are kept), so a
    float64 reference at long sequence lengths costs only the rows a check samples. Rows are computed
    in chunks that bound the score matrix held at once, unless ``chunk_rows`` says how many (pass the
    sequence length for the one-shot textbook computation that a benchmark times).
    ``dropout_mask`` (bool, (batch, heads, seqlen_q, seqlen_k)) keeps probabilities, scaled by
    1 / (1 - dropout_p); the LSE is that of the undropped softmax.
    ``sinks`` (heads,): attention sinks (gpt-oss's, vLLM's ``s_aux``), one more logit per row that
    takes its share of the softmax and adds no value; the LSE counts it, except on rows that see no
    key (those keep output 0 and LSE +inf).
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.arange(seqlen_q, device=q.device) if query_rows is None else query_rows.to(q.device)

    # (B, H, S, D); repeat_interleave copies K/V per query head: fine for a reference.
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=stat_dtype)
        slopes = slopes.expand(batch, heads) if slopes.dim() == 1 else slopes
        slopes = slopes.view(batch, heads, 1, 1)
    diag = (seqlen_k - seqlen_q) if bottom_right else 0

    if rows.numel() == 0:
        return (q.new_empty(batch, 0, heads, head_dim),
                torch.empty(batch, heads, 0, dtype=stat_dtype, device=q.device))
    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // max(1, batch * heads * seqlen_k))
    outs, lses = [], []
    for start in range(0, rows.numel(), chunk):
        r = rows[start:start + chunk]
        qt = q[:, r].transpose(1, 2)
        scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if alibi_slopes is not None:
            dist = (r.view(-1, 1) + diag - torch.arange(seqlen_k, device=q.device).view(1, -1)).abs()
            scores = (scores.to(stat_dtype) - slopes * dist.to(stat_dtype)).to(q.dtype)
        keep = visible_keys(r, seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                            bottom_right=bottom_right)
        scores = scores.to(stat_dtype).masked_fill(~keep, -math.inf)
        if sinks is not None:  # the sink's column, dropped after the softmax
            sink = sinks.to(device=q.device, dtype=stat_dtype).view(1, heads, 1, 1)
            scores = torch.cat([scores, sink.expand(batch, heads, r.numel(), 1)], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)
        seen = keep.any(dim=-1).view(1, 1, -1, 1)
        probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
        if sinks is not None:
            probs = probs[..., :seqlen_k]
        if dropout_mask is not None:
            probs = probs * dropout_mask[:, :, r].to(probs.dtype) / (1.0 - dropout_p)
        probs = probs.to(q.dtype)
        outs.append(torch.matmul(probs, vt).transpose(1, 2))
        lses.append(lse.masked_fill(~seen.view(1, 1, -1), math.inf))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def probabilities(q: torch.Tensor, k: torch.Tensor, *, softmax_scale: float | None = None,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, bottom_right: bool = True) -> torch.Tensor:
    """The softmax probabilities (batch, heads, seqlen_q, seqlen_k) in float32, masks and all; rows
    that see no key are 0."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    kt = k.transpose(1, 2).repeat_interleave(heads // heads_k, dim=1).float()
    scores = torch.matmul(q.transpose(1, 2).float(), kt.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(seqlen_q, device=q.device)
    if alibi_slopes is not None:
        diag = (seqlen_k - seqlen_q) if bottom_right else 0
        dist = (rows.view(-1, 1) + diag - torch.arange(seqlen_k, device=q.device).view(1, -1)).abs()
        slopes = alibi_slopes.float().expand(batch, heads) if alibi_slopes.dim() == 1 else alibi_slopes.float()
        scores = scores - slopes.view(batch, heads, 1, 1) * dist
    keep = visible_keys(rows, seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                        bottom_right=bottom_right)
    scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)
