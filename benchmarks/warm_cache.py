"""Compile the kernels a benchmark will launch, in parallel worker processes, before it runs.

    PYTHONPATH=src python benchmarks/warm_cache.py train [--quick] [--workers 15]

Triton compiles on first launch, one kernel after another; ``bench train`` launches a few dozen
specializations (every sweep point's forward and backward, every feature of the correctness check).
Running each of those launches once, on the same shapes, in a pool of processes fills Triton's
on-disk cache, which the benchmark then reads. Timings are unaffected: the benchmark warms up anyway.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _train_point(point):
    import torch

    import flashtile
    from flashtile.bench.train import make_inputs
    x = make_inputs(point, torch.bfloat16, torch.device("cuda"))
    out = flashtile.flash_attn_func(x.q, x.k, x.v, causal=point.causal)
    torch.autograd.grad(out, (x.q, x.k, x.v), torch.randn_like(out))
    torch.cuda.synchronize()


def _check_case(index):
    """flashtile's side of one backward check case (the float64 reference is the slow part, and
    compiles nothing)."""
    import torch

    from flashtile.bench import check
    case = check.backward_cases(True)[index]
    q, k, v, dout, slopes, cu_seqlens = check.make_backward_inputs(case, torch.device("cuda"), index)
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
                  alibi_slopes=slopes)
    if cu_seqlens is not None:
        kwargs.update(cu_seqlens=cu_seqlens, max_seqlen=max(case.lengths))
    if case.dropout_p:
        kwargs.update(dropout_p=case.dropout_p)
    check.flashtile_out_grads(q, k, v, dout, **kwargs)
    torch.cuda.synchronize()


def _varlen(_):
    import torch

    import flashtile
    from flashtile.bench.train import VARLEN_HEAD_DIM, VARLEN_HEADS, cu_seqlens_of, varlen_lengths
    lengths = varlen_lengths()
    cu = cu_seqlens_of(lengths, torch.device("cuda"))
    q, k, v = (torch.randn(sum(lengths), VARLEN_HEADS, VARLEN_HEAD_DIM, dtype=torch.bfloat16,
                           device="cuda", requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()


def _run(job):
    kind, arg = job
    try:
        {"point": _train_point, "check": _check_case, "varlen": _varlen}[kind](arg)
        return None
    except Exception as exc:  # the benchmark reports failures itself; only say which warm-up failed
        return f"{kind} {arg}: {type(exc).__name__}: {str(exc)[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=15)
    args = ap.parse_args()
    from flashtile.bench import check
    from flashtile.bench.prefill import sweep_points

    jobs = [("check", i) for i in range(len(check.backward_cases(True)))]
    jobs += [("point", p) for p in sweep_points(args.quick)] + [("varlen", None)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(_run, jobs, chunksize=1) if e]
    print(f"warmed {len(jobs)} launches in {time.time() - t0:.0f} s; {len(errors)} failed")
    for e in errors:
        print("  ", e)


if __name__ == "__main__":
    main()
