"""``flashtile bench ring``: context-parallel (ring) attention across the GPUs of one host, against
flashtile on one GPU over the whole sequence.

One process per GPU (NCCL); for each world size W in 1, 2, 4, 8 that the host has, the sequence is
sharded in the zigzag layout and ``ring_flash_attn_func`` runs forward and forward + backward. Times
are medians over repetitions (CUDA events, ranks synchronized by a barrier before each), taken on
rank 0; scaling efficiency = single-GPU time / (W x ring time). A correctness check first compares
the ring's output, LSE and gradients, unsharded, with single-GPU flashtile. Without a GPU two gloo
processes run the check on a small problem through Triton's interpreter.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from .common import add_common_arguments, choose_device, cuda_event_median, environment, result_path, write_json

SEQLENS = (131072, 262144, 524288)
QUICK_SEQLENS = (16384,)
HEADS, HEADS_K, HEAD_DIM = 32, 8, 128  # Llama-3-8B
CHECK_SEQLEN = 16384
# A ring of one is timed only up to here: beyond, one GPU's run of the ring costs as long as the
# single-GPU baseline it adds nothing to.
WORLD1_RING_MAX = 131072
# NVLink multicast (NVLS) stays off: on shared hosts it can take the GPUs out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _reps(seqlen: int) -> int:
    return 5 if seqlen <= 131072 else 3


def _time(fn, reps: int) -> float:
    """Median ms on this rank; every rank starts each repetition together."""
    import torch.distributed as dist
    return cuda_event_median(fn, reps, before=dist.barrier)


def _inputs(seqlen: int, device, dtype, heads=HEADS, heads_k=HEADS_K, head_dim=HEAD_DIM, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(1, seqlen, heads, head_dim), (1, seqlen, heads_k, head_dim), (1, seqlen, heads_k, head_dim),
              (1, seqlen, heads, head_dim)]
    return [torch.randn(*s, generator=gen).to(device, dtype) for s in shapes]


def _check(rank, world, device, seqlen, dtype, causal=True) -> dict:
    """Ring vs one process over the whole sequence: max |difference| of out, LSE and gradients,
    against a tolerance of a few bf16 ulps of each tensor's scale."""
    import torch.distributed as dist

    import flashtile
    from ..distributed import ring_flash_attn_func, shard, unshard
    small = device.type == "cpu"
    q, k, v, dout = _inputs(seqlen, device, dtype, heads=8 if small else HEADS, heads_k=2 if small else HEADS_K,
                            head_dim=64 if small else HEAD_DIM, seed=1)
    local = [shard(t, rank, world).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    out, lse = ring_flash_attn_func(*local[:3], causal=causal, return_lse=True)
    out.backward(local[3])
    mine = {"out": out.detach(), "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    gathered = {}
    for name, t in mine.items():
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered[name] = unshard(parts, dim=2 if name == "lse" else 1)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    full_out, full_lse, _ = flashtile.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
    full_out.backward(dout)
    full = {"out": full_out.detach(), "lse": full_lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
            "dv": leaves[2].grad}
    eps = torch.finfo(dtype).eps
    errors, ok = {}, True
    for name in full:
        diff = (gathered[name].float() - full[name].float()).abs().max().item()
        tol = (1e-4 if name == "lse" else 4 * eps) * max(full[name].float().abs().max().item(), 1.0)
        errors[name] = {"max_diff": diff, "tolerance": tol}
        ok &= diff <= tol
    return {"world": world, "seqlen": seqlen, "causal": causal, "errors": errors, "passed": bool(ok)}


def _worker(rank, world, init_file, seqlens, out_file, on_gpu):
    import torch.distributed as dist
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    for name, value in NCCL_ENV.items():
        os.environ[name] = value
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        if on_gpu:
            torch.cuda.set_device(device)
        dtype = torch.bfloat16
        result = {"check": _check(rank, world, device, CHECK_SEQLEN if on_gpu else 16 * world, dtype)}
        if on_gpu:
            import flashtile
            from ..distributed import ring_flash_attn_func, shard
            points = []
            for n in seqlens:
                q, k, v, dout = _inputs(n, device, dtype)
                local = [shard(t, rank, world) for t in (q, k, v, dout)]
                leaves = [t.requires_grad_(True) for t in local[:3]]

                def fwd():
                    with torch.no_grad():
                        return ring_flash_attn_func(*local[:3], causal=True)

                def fwd_bwd():
                    out = ring_flash_attn_func(*leaves, causal=True)
                    return torch.autograd.grad(out, leaves, local[3])
                reps = _reps(n)
                point = {"seqlen": n, "reps": reps}
                if world > 1 or n <= WORLD1_RING_MAX:
                    point.update(ring_fwd_ms=_time(fwd, reps), ring_fwd_bwd_ms=_time(fwd_bwd, reps))
                if world == 1:  # the single-GPU baseline on the whole sequence
                    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                    point["single_fwd_ms"] = _time(lambda: flashtile.flash_attn_func(
                        *[t.detach() for t in full], causal=True), reps)
                    point["single_fwd_bwd_ms"] = _time(lambda: torch.autograd.grad(
                        flashtile.flash_attn_func(*full, causal=True), full, dout), reps)
                points.append(point)
                del q, k, v, dout, local, leaves
                torch.cuda.empty_cache()
            result["points"] = points
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


def _run_world(world: int, seqlens, on_gpu: bool) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), seqlens, out_file, on_gpu),
                 nprocs=world, join=True)
        return torch.load(out_file)


def _seqlens(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(","))
    if any(n <= 0 or n % 16 for n in values):
        raise ValueError(f"--seqlens must be positive multiples of 16 (2 chunks per rank, up to 8 ranks), got {text}")
    return values


def add_arguments(parser) -> None:
    add_common_arguments(parser, "16k tokens only", "(the ring check always runs)", with_dtype=False)
    parser.add_argument("--seqlens", type=_seqlens, default=None,
                        help=f"comma-separated total sequence lengths (default {','.join(map(str, SEQLENS))})")
    parser.add_argument("--max-world", type=int, default=8, help="largest world size to run (default 8)")


def run(args) -> int:
    device = choose_device()
    if device.type != "cuda":
        print("flashtile bench ring: no CUDA GPU, so two gloo processes run the ring check through "
              "Triton's interpreter.")
        check = _run_world(2, (), on_gpu=False)["check"]
        print(f"{'PASS' if check['passed'] else 'FAIL'}  ring of 2 vs one process: "
              + ", ".join(f"{n} {e['max_diff']:.2e}<={e['tolerance']:.2e}" for n, e in check["errors"].items()))
        print("Timings need a GPU: skipped the ring benchmark (nothing was written).")
        return 0 if check["passed"] else 1
    env = environment(device)
    gpus = torch.cuda.device_count()
    worlds = [w for w in (1, 2, 4, 8) if w <= min(gpus, args.max_world)]
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    print(f"flashtile bench ring: {gpus} x {env['gpu']}, worlds {worlds}, causal, {HEADS}/{HEADS_K} "
          f"heads, d{HEAD_DIM}, bf16, zigzag layout")
    runs = {}
    for w in worlds:
        runs[w] = _run_world(w, seqlens, on_gpu=True)
        c = runs[w]["check"]
        print(f"{'PASS' if c['passed'] else 'FAIL'}  world {w}: ring vs one GPU, "
              + ", ".join(f"{n} {e['max_diff']:.2e}" for n, e in c["errors"].items()), flush=True)
    base = {p["seqlen"]: p for p in runs[1]["points"]}
    rows = []
    for w in worlds:
        for p in runs[w]["points"]:
            if "ring_fwd_ms" not in p:
                continue
            b = base[p["seqlen"]]
            rows.append({"world": w, **p, "single_fwd_ms": b["single_fwd_ms"],
                         "single_fwd_bwd_ms": b["single_fwd_bwd_ms"],
                         "fwd_scaling": b["single_fwd_ms"] / (w * p["ring_fwd_ms"]),
                         "fwd_bwd_scaling": b["single_fwd_bwd_ms"] / (w * p["ring_fwd_bwd_ms"])})
    payload = {"benchmark": "ring", **env, "gpus": gpus, "heads": HEADS, "heads_k": HEADS_K,
               "head_dim": HEAD_DIM, "causal": True, "layout": "zigzag", "command": " ".join(sys.argv),
               "checks": {w: r["check"] for w, r in runs.items()}, "points": rows}
    path = result_path(args.out, "ring", env["gpu"], "json")
    write_json(path, payload)
    print(f"Wrote {path}\n")
    print("scaling = one GPU's time on the whole sequence / (W x the ring's time)")
    print(f"{'W':>2s} {'seqlen':>8s} {'1-GPU fwd':>10s} {'fwd ms':>9s} {'scaling':>8s} {'1-GPU f+b':>10s} "
          f"{'fwd+bwd ms':>11s} {'scaling':>8s}")
    for r in rows:
        print(f"{r['world']:>2d} {r['seqlen']:>8d} {r['single_fwd_ms']:>10.2f} {r['ring_fwd_ms']:>9.2f} "
              f"{100 * r['fwd_scaling']:>7.1f}% {r['single_fwd_bwd_ms']:>10.2f} {r['ring_fwd_bwd_ms']:>11.2f} "
              f"{100 * r['fwd_bwd_scaling']:>7.1f}%")
    return 0 if all(r["check"]["passed"] for r in runs.values()) else 1
