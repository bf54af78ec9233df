"""Ring attention over torch.distributed (gloo, 2 and 4 processes, kernels through the interpreter):
output, LSE and gradients of the ring against single-process flashtile on the whole sequence."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.distributed import shard, shard_varlen, unshard, unshard_varlen


def _worker(rank, world, init_file, case, result_dir):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import flashtile
        from flashtile.distributed import ring_flash_attn_func
        layout, causal, heads, heads_k, dtype = case
        gen = torch.Generator().manual_seed(1234)  # the same full sequence on every rank
        seqlen, head_dim = 16 * world, 32
        q = torch.randn(2, seqlen, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(2, seqlen, heads_k, head_dim, generator=gen).to(dtype)
        v = torch.randn(2, seqlen, heads_k, head_dim, generator=gen).to(dtype)
        dout = torch.randn(2, seqlen, heads, head_dim, generator=gen).to(dtype)
        local = [shard(t, rank, world, layout).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        out, lse = ring_flash_attn_func(*local[:3], causal=causal, layout=layout, return_lse=True)
        out.backward(local[3])
        torch.save({"out": out.detach(), "lse": lse, "dq": local[0].grad, "dk": local[1].grad,
                    "dv": local[2].grad}, os.path.join(result_dir, f"{rank}.pt"))
        if rank == 0:  # the single-process answer on the whole sequence
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            full_out, full_lse, _ = flashtile.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
            full_out.backward(dout)
            torch.save({"out": full_out.detach(), "lse": full_lse, "dq": leaves[0].grad,
                        "dk": leaves[1].grad, "dv": leaves[2].grad, "inputs": (q, k, v, dout)},
                       os.path.join(result_dir, "full.pt"))
    finally:
        dist.destroy_process_group()


def _varlen_worker(rank, world, init_file, case, result_dir):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import flashtile
        from flashtile.distributed import ring_flash_attn_varlen_func
        layout, causal = case
        gen = torch.Generator().manual_seed(99)
        unit = 2 * world
        lengths = [3 * unit, 1 * unit, 5 * unit]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total, heads, heads_k, head_dim = sum(lengths), 4, 2, 32
        q = torch.randn(total, heads, head_dim, generator=gen).to(torch.bfloat16)
        k = torch.randn(total, heads_k, head_dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(total, heads_k, head_dim, generator=gen).to(torch.bfloat16)
        dout = torch.randn(total, heads, head_dim, generator=gen).to(torch.bfloat16)
        local = []
        for i, t in enumerate((q, k, v, dout)):
            piece, cu_local = shard_varlen(t, cu, rank, world, layout)
            local.append(piece.requires_grad_(i < 3))
        out, lse = ring_flash_attn_varlen_func(*local[:3], cu_local, max(lengths) // world, causal=causal,
                                               layout=layout, return_lse=True)
        out.backward(local[3])
        torch.save({"out": out.detach(), "lse": lse, "dq": local[0].grad, "dk": local[1].grad,
                    "dv": local[2].grad}, os.path.join(result_dir, f"{rank}.pt"))
        if rank == 0:
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            full_out, full_lse, _ = flashtile.flash_attn_varlen_func(
                *leaves, cu, cu, max(lengths), max(lengths), causal=causal, return_attn_probs=True)
            full_out.backward(dout)
            torch.save({"out": full_out.detach(), "lse": full_lse, "dq": leaves[0].grad,
                        "dk": leaves[1].grad, "dv": leaves[2].grad, "cu": cu,
                        "inputs": (q, k, v, dout)},
                       os.path.join(result_dir, "full.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_varlen_ring_matches_whole_batch(world, layout, causal):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_varlen_worker, args=(world, os.path.join(tmp, "init"), (layout, causal), tmp),
                 nprocs=world, join=True)
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
        full = torch.load(os.path.join(tmp, "full.pt"))
    ring = {name: unshard_varlen([p[name] for p in parts], full["cu"], layout, dim=1 if name == "lse" else 0)
            for name in ("out", "lse", "dq", "dk", "dv")}
    torch.testing.assert_close(ring["lse"], full["lse"], atol=1e-4, rtol=1e-5)
    # Each sequence against float64 with the project's rule (2x / 3x the textbook bf16 error).
    from helpers import assert_grads_match_reference, assert_matches_reference
    q, k, v, dout = full["inputs"]
    bounds = full["cu"].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        one = [t[a:b].unsqueeze(0) for t in (q, k, v, dout)]
        assert_matches_reference(ring["out"][a:b].unsqueeze(0), ring["lse"][:, a:b].unsqueeze(0),
                                 *one[:3], causal=causal)
        assert_grads_match_reference(tuple(ring[n][a:b].unsqueeze(0) for n in ("dq", "dk", "dv")),
                                     *one, causal=causal)


CASES = [("zigzag", True, 4, 2, torch.float16), ("zigzag", False, 4, 4, torch.bfloat16),
         ("contiguous", True, 4, 1, torch.bfloat16), ("contiguous", False, 2, 2, torch.float16)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}/{c[3]}")
def test_ring_matches_whole_sequence(world, case):
    from helpers import assert_grads_match_reference, assert_matches_reference
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), case, tmp), nprocs=world, join=True)
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
        full = torch.load(os.path.join(tmp, "full.pt"))
    layout, causal = case[0], case[1]
    ring = {name: unshard([p[name] for p in parts], layout, dim=2 if name == "lse" else 1)
            for name in ("out", "lse", "dq", "dk", "dv")}
    q, k, v, dout = full["inputs"]
    # Against float64 with the project's rule (2x / 3x the textbook error in the input dtype) ...
    assert_matches_reference(ring["out"], ring["lse"], q, k, v, causal=causal)
    assert_grads_match_reference((ring["dq"], ring["dk"], ring["dv"]), q, k, v, dout, causal=causal)
    # ... and close to flashtile on the whole sequence (only the merge order differs).
    torch.testing.assert_close(ring["lse"], full["lse"], atol=1e-4, rtol=1e-5)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(ring[name].float(), full[name].float(), atol=2e-2, rtol=2e-2)


def test_varlen_shard_and_unshard_round_trip():
    cu = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    x = torch.arange(28)
    for layout in ("zigzag", "contiguous"):
        pieces = [shard_varlen(x, cu, r, 2, layout) for r in range(2)]
        assert all(torch.equal(local, torch.tensor([0, 4, 6, 14], dtype=torch.int32)) for _, local in pieces)
        assert torch.equal(unshard_varlen([p for p, _ in pieces], cu, layout), x)


def test_shard_and_unshard_round_trip():
    x = torch.arange(2 * 24).view(2, 24)
    for layout in ("zigzag", "contiguous"):
        shards = [shard(x, r, 3, layout) for r in range(3)]
        assert torch.equal(unshard(shards, layout), x)
    assert shard(x, 0, 3, "zigzag")[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    with pytest.raises(ValueError, match="multiple of 6"):
        shard(torch.zeros(1, 10), 0, 3, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        shard(x, 0, 3, "striped")


def test_needs_an_initialized_process_group():
    from flashtile.distributed import ring_flash_attn_func
    q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, q, q)


def test_bench_ring_cpu_check():
    """`flashtile bench ring` without a GPU: two gloo processes, ring against one process."""
    from flashtile.bench import ring
    check = ring._run_world(2, (), on_gpu=False)["check"]
    assert check["passed"], check


def _sinks_worker(rank, world, init_file, varlen, result_dir):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import flashtile
        from flashtile.distributed import ring_flash_attn_func, ring_flash_attn_varlen_func
        gen = torch.Generator().manual_seed(7)
        heads, heads_k, head_dim, unit = 4, 2, 32, 2 * world
        lengths = [3 * unit, 5 * unit] if varlen else [8 * unit]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        lead = () if varlen else (1,)
        q = torch.randn(*lead, sum(lengths), heads, head_dim, generator=gen).to(torch.bfloat16)
        k = torch.randn(*lead, sum(lengths), heads_k, head_dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(*lead, sum(lengths), heads_k, head_dim, generator=gen).to(torch.bfloat16)
        dout = torch.randn(*lead, sum(lengths), heads, head_dim, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(heads, generator=gen) * 2
        ss = sinks.clone().requires_grad_(True)
        if varlen:
            local = [shard_varlen(t, cu, rank, world, "zigzag")[0].requires_grad_(i < 3)
                     for i, t in enumerate((q, k, v, dout))]
            cu_local = shard_varlen(q, cu, rank, world, "zigzag")[1]
            out, lse = ring_flash_attn_varlen_func(*local[:3], cu_local, max(lengths) // world, causal=True,
                                                   return_lse=True, s_aux=ss)
        else:
            local = [shard(t, rank, world, "zigzag").requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
            out, lse = ring_flash_attn_func(*local[:3], causal=True, return_lse=True, s_aux=ss)
        out.backward(local[3])
        torch.save({"out": out.detach(), "lse": lse, "dq": local[0].grad, "dk": local[1].grad,
                    "dv": local[2].grad, "ds": ss.grad}, os.path.join(result_dir, f"{rank}.pt"))
        if rank == 0:
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
            if varlen:
                full_out, full_lse, _ = flashtile.flash_attn_varlen_func(
                    *leaves[:3], cu, cu, max(lengths), max(lengths), causal=True, return_attn_probs=True,
                    s_aux=leaves[3])
            else:
                full_out, full_lse, _ = flashtile.flash_attn_func(*leaves[:3], causal=True, return_attn_probs=True,
                                                                  s_aux=leaves[3])
            full_out.backward(dout)
            torch.save({"out": full_out.detach(), "lse": full_lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
                        "dv": leaves[2].grad, "ds": leaves[3].grad, "cu": cu, "inputs": (q, k, v, dout, sinks)},
                       os.path.join(result_dir, "full.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_ring_takes_attention_sinks(varlen):
    """s_aux through the ring (2 ranks, zigzag, causal): output and LSE of the softmax with the sinks'
    column, the gradients by the accuracy rule, each rank's ds_aux for its own rows (their sum the
    whole sequence's)."""
    from helpers import assert_grads_match_reference, assert_matches_reference
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sinks_worker, args=(world, os.path.join(tmp, "init"), varlen, tmp), nprocs=world, join=True)
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
        full = torch.load(os.path.join(tmp, "full.pt"))
    if varlen:
        ring = {name: unshard_varlen([p[name] for p in parts], full["cu"], "zigzag", dim=1 if name == "lse" else 0)
                for name in ("out", "lse", "dq", "dk", "dv")}
    else:
        ring = {name: unshard([p[name] for p in parts], "zigzag", dim=2 if name == "lse" else 1)
                for name in ("out", "lse", "dq", "dk", "dv")}
    from flashtile.reference import attention
    q, k, v, dout, sinks = full["inputs"]
    bounds = full["cu"].tolist()
    exact, low, stored = (torch.zeros(sinks.shape[0], dtype=torch.float64) for _ in range(3))
    for a, b in zip(bounds[:-1], bounds[1:]):
        if varlen:
            one = [t[a:b].unsqueeze(0) for t in (q, k, v, dout)]
            got = [ring[n][a:b].unsqueeze(0) for n in ("out", "dq", "dk", "dv")]
            got_lse = ring["lse"][:, a:b].unsqueeze(0)
        else:
            one, got, got_lse = [q, k, v, dout], [ring[n] for n in ("out", "dq", "dk", "dv")], ring["lse"]
        assert_matches_reference(got[0], got_lse, *one[:3], causal=True, sinks=sinks, rounded_twice=True)
        assert_grads_match_reference(tuple(got[1:]), *one, causal=True, sinks=sinks)
        # ds_aux's budget, as test_sinks takes it: textbook attention's error in bf16, and D's rounding
        # (the output as the ring stored it)
        for total, precision in ((exact, torch.float64), (low, torch.bfloat16)):
            s_ = sinks.clone().requires_grad_(True)
            o, _ = attention(*(t.to(precision) for t in one[:3]), causal=True, sinks=s_)
            (o.double() * one[3].double()).sum().backward()
            total += s_.grad.double()
        ref, ref_lse = attention(*(t.double() for t in one[:3]), causal=True, sinks=sinks)
        share = torch.exp(sinks.double().view(1, -1, 1) - ref_lse)
        rounding = ((got[0].double() - ref) * one[3].double()).sum(-1).transpose(1, 2)
        stored += (share * rounding).sum((0, 2))
    torch.testing.assert_close(ring["lse"], full["lse"], atol=1e-4, rtol=1e-5)
    assert all(p["ds"] is not None for p in parts)
    err = (sum(p["ds"] for p in parts).double() - exact).abs().max().item()
    budget = max(3 * (low - exact).abs().max().item(), 2 * stored.abs().max().item())
    assert err <= budget, (err, budget)
