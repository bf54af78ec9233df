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
from .kernels.sinks import apply_sinks_, sink_grad

LAYOUTS = ("zigzag", "contiguous")


def _check_sinks(s_aux, q, ndim):
    from .interface import _check_sinks as check  # (the public functions' check, loaded on first use)
    return check(s_aux, q, ndim)


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

def _blocks(rank: int, src: int, causal: bool, layout: str):
    """What rank ``rank``'s queries compute against the K/V shard of rank ``src``: a list of
    (query part, key part, causal) with parts "all", "first" or "second" (halves of each sequence's
    local shard); empty when nothing is visible."""
    if not causal:
        return [("all", "all", False)]
    if layout == "contiguous":
        if src == rank:
            return [("all", "all", True)]
        return [("all", "all", False)] if src < rank else []
    if src == rank:  # chunks (r, 2W-1-r) against themselves: causal over the concatenation
        return [("all", "all", True)]
    if src < rank:  # chunk src precedes both query chunks; chunk 2W-1-src follows both
        return [("all", "first", False)]
    return [("second", "all", False)]  # both key chunks precede chunk 2W-1-r and follow chunk r


class _Geometry:
    """Where a part of the local shard lives: slices of dim 1 for (B, S, H, D) shards; for packed
    shards (T, H, D) with local offsets ``cu``, index lists (each sequence's first or second half) and
    the offsets and longest length the varlen kernels need."""

    def __init__(self, local_len: int | None = None, cu: torch.Tensor | None = None, max_len: int = 0):
        self.varlen = cu is not None
        if not self.varlen:
            half = local_len // 2
            self.parts = {"all": slice(0, local_len), "first": slice(0, half),
                          "second": slice(half, local_len)}
            return
        lengths = (cu[1:] - cu[:-1]).tolist()
        starts = cu[:-1].tolist()
        first = [i for st, n in zip(starts, lengths) for i in range(st, st + n // 2)]
        second = [i for st, n in zip(starts, lengths) for i in range(st + n // 2, st + n)]
        self.index = {"first": torch.tensor(first, dtype=torch.long, device=cu.device),
                      "second": torch.tensor(second, dtype=torch.long, device=cu.device)}
        self.cu = {"all": cu, "first": cu // 2, "second": cu // 2}
        self.max_len = {"all": max_len, "first": max_len // 2, "second": max_len // 2}

    def take(self, x: torch.Tensor, part: str, lse: bool = False) -> torch.Tensor:
        if not self.varlen:
            return x[:, :, self.parts[part]] if lse else x[:, self.parts[part]]
        if part == "all":
            return x
        return x.index_select(1 if lse else 0, self.index[part])

    def kernel_args(self, q_part: str, kv_part: str) -> dict:
        if not self.varlen:
            return {}
        return {"cu_seqlens_q": self.cu[q_part], "cu_seqlens_k": self.cu[kv_part],
                "max_seqlen_q": self.max_len[q_part], "max_seqlen_k": self.max_len[kv_part]}

    def merge(self, out, lse, part, o_part, l_part) -> None:
        if not self.varlen or part == "all":  # views: merged in place
            _merge(self.take(out, part), self.take(lse, part, lse=True), o_part, l_part)
            return
        o, l = self.take(out, part), self.take(lse, part, lse=True)
        _merge(o, l, o_part, l_part)
        out.index_copy_(0, self.index[part], o)
        lse.index_copy_(1, self.index[part], l)

    def add(self, buf, part, grad) -> None:
        if not self.varlen or part == "all":
            self.take(buf, part).add_(grad.float())
        else:
            buf.index_add_(0, self.index[part], grad.float())


def _no_keys_to_neginf(part_lse: torch.Tensor) -> torch.Tensor:
    """The kernels give rows without keys LSE +inf; in a merge they carry no mass (-inf)."""
    return torch.where(torch.isposinf(part_lse), torch.full_like(part_lse, -math.inf), part_lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out (..., S, H, D) float32 and lse (..., H, S) float32 absorb a partial result in place."""
    part_lse = _no_keys_to_neginf(part_lse)
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).movedim(-2, -1).unsqueeze(-1)
    w_new = torch.exp(part_lse - safe).movedim(-2, -1).unsqueeze(-1)
    out.mul_(w_old).addcmul_(part, w_new)
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
        if self.world == 1:  # a ring of one: the shard stays (NCCL would not send to itself)
            return list(tensors)
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


def _ring_forward(q, k, v, group, causal, scale, softcap, layout, geo: _Geometry):
    ring = _Ring(group)
    # Step 0 (a rank's own shard, every query row) is kept as the kernel wrote it; the float32
    # accumulator appears only when a second partial result arrives, so a ring of one costs nothing
    # over the plain kernel and no step pays for a zero fill.
    out = lse = None
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:
            k_next, v_next = ring.exchange([k_cur, v_cur])
        for q_part, kv_part, blk_causal in _blocks(ring.rank, src, causal, layout):
            left, right = _window(blk_causal)
            kw = geo.kernel_args(q_part, kv_part)
            kw.pop("max_seqlen_k", None)  # the forward launches by the longest query sequence
            part, part_lse = attention_forward(
                geo.take(q, q_part), geo.take(k_cur, kv_part), geo.take(v_cur, kv_part),
                softmax_scale=scale, window_left=left, window_right=right, diag_offset=0,
                softcap=softcap, **kw)
            if out is None:
                if q_part != "all":  # every layout's step 0 is the own shard, all rows
                    raise RuntimeError(f"ring step {step} of rank {ring.rank} starts on part {q_part!r}")
                out, lse = part, _no_keys_to_neginf(part_lse)
                continue
            if out.dtype != torch.float32:
                out = out.float()
            geo.merge(out, lse, q_part, part, part_lse)
        if step + 1 < ring.world:
            ring.wait()
            k_cur, v_cur = k_next, v_next
    empty = torch.isneginf(lse)  # rows that saw no key: output 0, LSE +inf (flashtile's convention)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, softcap, layout, geo: _Geometry):
    ring = _Ring(group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_cur = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_cur = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step + 1 < ring.world:  # K/V move on now; the gradient buffers once this step added to them
            k_next, v_next = ring.exchange([k_cur, v_cur])
        for q_part, kv_part, blk_causal in _blocks(ring.rank, src, causal, layout):
            left, right = _window(blk_causal)
            # With the final out and LSE, each block's P and Delta are the full softmax's.
            g_q, g_k, g_v = attention_backward(
                geo.take(dout, q_part), geo.take(q, q_part), geo.take(k_cur, kv_part),
                geo.take(v_cur, kv_part), geo.take(out, q_part), geo.take(lse, q_part, lse=True),
                softmax_scale=scale, window_left=left, window_right=right, diag_offset=0,
                softcap=softcap, deterministic=True, **geo.kernel_args(q_part, kv_part))
            geo.add(dq, q_part, g_q)
            geo.add(dk_cur, kv_part, g_k)
            geo.add(dv_cur, kv_part, g_v)
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
    def forward(ctx, q, k, v, group, causal, scale, softcap, layout, geo, sinks):
        out, lse = _ring_forward(q, k, v, group, causal, scale, softcap, layout, geo)
        if sinks is not None:
            # in place on the merged rows, which the backward then reads as the softmax's with the
            # sinks' column (as ops.attn_fwd does: kernels/sinks.py)
            apply_sinks_(out, lse, sinks.detach(), packed=geo.varlen)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, scale, softcap, layout, geo)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        ds = None
        if sinks is not None and ctx.needs_input_grad[9]:
            # this rank's rows' share; a replicated sinks parameter's gradient is summed over the
            # ranks with the other parameters' (as each rank's share of any weight's is)
            ds = sink_grad(out, dout, lse, None, sinks, packed=ctx.args[5].varlen)
        return dq, dk, dv, None, None, None, None, None, None, ds


def _check_ring_inputs(caller: str, q, k, v, layout: str, shape: str) -> None:
    """The checks both ring functions share; ``shape`` names the dims, the last two (heads,
    head_dim) and all before them (tokens) must agree between q and k/v except the head count."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed initialized (dist.init_process_group)")
    _check_layout(layout)
    ndim = shape.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-D tensor {shape}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share "
                         "all dims but the head count (k and v identical)")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"query heads ({q.shape[-2]}) must be a multiple of KV heads ({k.shape[-2]})")


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                         softmax_scale: float | None = None, causal: bool = False, softcap: float = 0.0,
                         layout: str = "zigzag", return_lse: bool = False, *, s_aux=None):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    q (B, S_local, H, D), k and v (B, S_local, Hk, D): this rank's shard in ``layout`` (see ``shard``),
    the same S_local on every rank (even for "zigzag"). ``causal`` follows token positions in the
    full sequence. Returns this rank's output (B, S_local, H, D), and with ``return_lse`` the LSE
    (B, H, S_local) float32; differentiable in q, k and v. ``s_aux`` (H,): attention sinks as in
    flash_attn_func (differentiable; each rank's gradient covers its own rows). Every rank must call
    it with the same arguments (it is a collective).
    """
    _check_ring_inputs("ring_flash_attn_func", q, k, v, layout, "(batch, seqlen_local, heads, head_dim)")
    sinks = _check_sinks(s_aux, q, 4)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: local length "
                         f"{q.shape[1]} must be even")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, float(softcap), layout,
                                    _Geometry(local_len=q.shape[1]), sinks)
    return (out, lse) if return_lse else out


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int,
                 layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of every sequence of a packed batch x (total, ...) with offsets
    ``cu_seqlens``: (the shards packed, their offsets), the offsets being the same on every rank.
    Each sequence's length must be a multiple of W ("contiguous") or 2W ("zigzag")."""
    _check_layout(layout)
    bounds = cu_seqlens.tolist()
    pieces = [shard(x[a:b], rank, world_size, layout, dim=0) for a, b in zip(bounds[:-1], bounds[1:])]
    local = (cu_seqlens // world_size).to(torch.int32)
    return torch.cat(pieces, dim=0), local


def unshard_varlen(shards: list[torch.Tensor], cu_seqlens: torch.Tensor, layout: str = "zigzag",
                   dim: int = 0) -> torch.Tensor:
    """The packed batch from every rank's ``shard_varlen`` output (the inverse of it); ``cu_seqlens``
    are the global offsets, ``dim`` the token dimension (1 for an LSE of shape (H, total))."""
    world = len(shards)
    local = (cu_seqlens // world).tolist()
    seqs = []
    for a, b in zip(local[:-1], local[1:]):
        seqs.append(unshard([s.narrow(dim, a, b - a) for s in shards], layout, dim=dim))
    return torch.cat(seqs, dim=dim)


def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens: torch.Tensor, max_seqlen: int, group=None,
                                softmax_scale: float | None = None, causal: bool = False,
                                softcap: float = 0.0, layout: str = "zigzag", return_lse: bool = False, *,
                                s_aux=None):
    """``ring_flash_attn_func`` for packed sequences: q (T_local, H, D), k and v (T_local, Hk, D) hold
    this rank's shard of every sequence (``shard_varlen``), ``cu_seqlens`` (int32, B + 1) the local
    offsets and ``max_seqlen`` the longest local shard, identical on every rank. Returns the output
    (T_local, H, D), and with ``return_lse`` the LSE (H, T_local). ``s_aux``: as there."""
    _check_ring_inputs("ring_flash_attn_varlen_func", q, k, v, layout, "(total_local, heads, head_dim)")
    sinks = _check_sinks(s_aux, q, 3)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError("cu_seqlens must be a 1-D int32 tensor of local offsets")
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to the local token count {q.shape[0]}, got {bounds}")
    if max(lengths, default=0) > max_seqlen:
        raise ValueError(f"max_seqlen ({max_seqlen}) is below the longest local shard ({max(lengths)})")
    if layout == "zigzag" and any(n % 2 for n in lengths):
        raise ValueError("the zigzag layout holds two equal chunks of each sequence per rank: every "
                         "local length must be even")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    geo = _Geometry(cu=cu_seqlens.to(q.device), max_len=int(max_seqlen))
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, float(softcap), layout, geo, sinks)
    return (out, lse) if return_lse else out
