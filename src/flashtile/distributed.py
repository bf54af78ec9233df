"""Context-parallel (ring) attention over torch.distributed, on flashtile's kernels.

Each rank holds a shard of the sequence (queries, keys and values alike). K/V shards travel around
the ring; at every step a rank attends its queries to the K/V shard it holds, and the partial
outputs are merged by their log-sum-exp in float32 (the merge of split-KV decode). The backward runs
the ring again: each step's dQ stays home, while dK/dV accumulate (in float32) on buffers that travel
with the K/V shard and arrive back at its owner after the last step. Sends of the next shard are
posted before the current step's kernels run (``batch_isend_irecv``), so communication overlaps
compute on NCCL; gloo works too (CPU tests run the kernels through Triton's interpreter).

Layouts of the sequence over a world of W ranks:
* ``"contiguous"``: rank r holds tokens [r * S / W, (r + 1) * S / W);
* ``"zigzag"`` (the default; balanced for causal attention): the sequence is cut into 2W chunks and
  rank r holds chunks r and 2W - 1 - r, so every rank does the same causal work.
``shard`` and ``unshard`` convert between the full sequence and a rank's shard.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .kernels.backward import attention_backward
from .kernels.forward import attention_forward

LAYOUTS = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------------------- layouts

def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (a copy, contiguous)."""
    _check_layout(layout)
    parts = 2 * world_size if layout == "zigzag" else world_size
    if x.shape[dim] % parts:
        raise ValueError(f"sequence length {x.shape[dim]} must be a multiple of {parts} for the "
                         f"{layout} layout over {world_size} ranks")
    chunks = x.chunk(parts, dim=dim)
    if layout == "zigzag":
        return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim=dim).contiguous()
    return chunks[rank].contiguous()


def unshard(shards: list[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order (the inverse of ``shard``)."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)]
                     + [halves[world - 1 - i][1] for i in range(world)], dim=dim)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ----------------------------------------------------------------------------------------- ring steps

def _blocks(rank: int, src: int, causal: bool, layout: str, local_len: int):
    """What rank ``rank``'s queries compute against the K/V shard of rank ``src``: a list of
    (query rows, key rows, causal) slices of the local shards; empty when nothing is visible."""
    every = slice(0, local_len)
    if not causal:
        return [(every, every, False)]
    if layout == "contiguous":
        if src == rank:
            return [(every, every, True)]
        return [(every, every, False)] if src < rank else []
    half = local_len // 2
    first, second = slice(0, half), slice(half, local_len)
    if src == rank:  # chunks (r, 2W-1-r) against themselves: causal over the concatenation
        return [(every, every, True)]
    if src < rank:  # chunk src precedes both query chunks; chunk 2W-1-src follows both
        return [(every, first, False)]
    return [(second, every, False)]  # both key chunks precede query chunk 2W-1-r, follow chunk r


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out (B, S, H, D) float32 and lse (B, H, S) float32 absorb a partial result in place. The
    kernels give rows without keys LSE +inf; here they carry no mass (-inf)."""
    part_lse = torch.where(torch.isposinf(part_lse), torch.full_like(part_lse, -math.inf), part_lse)
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(part.float() * w_new)
    lse.copy_(new)


class _Ring:
    """Posts the exchange of tensors with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None \
            else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None \
            else (self.rank - 1) % self.world
        self.pending = []

    def exchange(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        self.pending = dist.batch_isend_irecv(ops)
        return received

    def wait(self) -> None:
        for req in self.pending:
            req.wait()
        self.pending = []


def _window(causal: bool):
    return (-1, 0) if causal else (-1, -1)


def _ring_forward(q, k, v, group, causal, scale, softcap, layout):
    ring = _Ring(group)
    batch, local_len, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, local_len), -math.inf, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:
            k_next, v_next = ring.exchange([k_cur, v_cur])
        for rows, cols, blk_causal in _blocks(ring.rank, src, causal, layout, local_len):
            left, right = _window(blk_causal)
            part, part_lse = attention_forward(q[:, rows], k_cur[:, cols], v_cur[:, cols],
                                               softmax_scale=scale, window_left=left, window_right=right,
                                               diag_offset=0, softcap=softcap)
            _merge(out[:, rows], lse[:, :, rows], part, part_lse)  # views: merged in place
        if step + 1 < ring.world:
            ring.wait()
            k_cur, v_cur = k_next, v_next
    empty = torch.isneginf(lse)  # rows that saw no key: output 0, LSE +inf (flashtile's convention)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, softcap, layout):
    ring = _Ring(group)
    local_len = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_cur = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_cur = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:  # K/V move on now; the gradient buffers once this step added to them
            k_next, v_next = ring.exchange([k_cur, v_cur])
        for rows, cols, blk_causal in _blocks(ring.rank, src, causal, layout, local_len):
            left, right = _window(blk_causal)
            # With the final out and LSE, each block's P and Delta are the full softmax's.
            g_q, g_k, g_v = attention_backward(
                dout[:, rows], q[:, rows], k_cur[:, cols], v_cur[:, cols], out[:, rows],
                lse[:, :, rows], softmax_scale=scale, window_left=left, window_right=right,
                diag_offset=0, softcap=softcap, deterministic=True)
            dq[:, rows] += g_q.float()
            dk_cur[:, cols] += g_k.float()
            dv_cur[:, cols] += g_v.float()
        ring.wait()
        # The gradient buffers follow the shard they belong to; after the last step one more move
        # brings each back to its owner.
        dk_cur, dv_cur = ring.exchange([dk_cur, dv_cur])
        ring.wait()
        if step + 1 < ring.world:
            k_cur, v_cur = k_next, v_next
    return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, softcap, layout):
        out, lse = _ring_forward(q, k, v, group, causal, scale, softcap, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, softcap, layout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                         softmax_scale: float | None = None, causal: bool = False, softcap: float = 0.0,
                         layout: str = "zigzag", return_lse: bool = False):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    q (B, S_local, H, D), k and v (B, S_local, Hk, D): this rank's shard in ``layout`` (see ``shard``),
    the same S_local on every rank (even for "zigzag"). ``causal`` follows token positions in the
    full sequence. Returns this rank's output (B, S_local, H, D), and with ``return_lse`` the LSE
    (B, H, S_local) float32; differentiable in q, k and v. Every rank must call it with the same
    arguments (it is a collective).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs torch.distributed initialized "
                           "(dist.init_process_group)")
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen_local, heads, head_dim)")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share "
                         "batch, local length and head dim (k and v identical)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: local length "
                         f"{q.shape[1]} must be even")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, float(softcap), layout)
    return (out, lse) if return_lse else out
