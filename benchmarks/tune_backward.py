"""Sweep backward tile configs on the GPU against SDPA's flash and cudnn backends, in one run.

    PYTHONPATH=src python benchmarks/tune_backward.py --out $OUT [--dims 64,128,256] [--seqlens 4096]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/tune_backward.py --dry   # CPU smoke run

Compiles every candidate in parallel worker processes first (Triton's on-disk cache then serves the
timed process), checks each candidate's gradients against the float64 reference on a small problem
(3x the textbook error in bf16), then times forward + backward (FA2 counting, 3.5x forward FLOPs)
with the default forward and the candidate backward, next to SDPA flash and cudnn forward + backward
measured in the same run. ``atomic`` candidates add dQ atomically from the dK/dV pass (the default,
deterministic=False); the others run the separate dQ pass. Writes tune-backward.json under --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

HIDDEN = 2048
TOKENS = 16384

# dK/dV kernel (block_m, block_n, warps, stages) and dQ kernel (block_m, block_n, warps, stages):
# every pair runs with the separate dQ pass; ATOMIC dK/dV configs add dQ atomically instead.
DKDV = {
    64: [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 4, 3)],
    128: [(64, 64, 4, 2), (64, 128, 8, 2)],
    256: [(32, 64, 8, 2), (64, 64, 8, 1), (32, 32, 4, 2)],
}
DQ = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 3)],
    128: [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2)],
}
ATOMIC = {
    64: [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2)],
    128: [(64, 128, 8, 2)],
    256: [(32, 64, 8, 2), (64, 64, 8, 1)],
}
TMA = (False, True)


def candidates(d):
    """(BackwardConfig fields, deterministic) for head dim d."""
    out = [((m, n, 64, 64, w, st, 0, 0, True, tma), False) for m, n, w, st in ATOMIC.get(d, [])
           for tma in TMA]
    for m1, n1, w1, s1 in DKDV.get(d, []):
        for m2, n2, w2, s2 in DQ.get(d, []):
            for tma in TMA:
                out.append(((m1, n1, m2, n2, w1, s1, w2, s2, False, tma), True))
    return out


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _shape(d: int, n: int, dry: bool):
    if dry:
        return 1, n, 2, d
    return TOKENS // n, n, HIDDEN // d, d  # batch, seqlen, heads, head_dim


def _inputs(b, s, h, d, dtype=torch.bfloat16):
    dev = _device()
    return [torch.randn(b, s, h, d, device=dev, dtype=dtype) for _ in range(4)]  # q, k, v, dout


def _config(cfg):
    from flashtile.kernels.backward import BackwardConfig
    return BackwardConfig(*cfg)


def _fwd(q, k, v, causal):
    from flashtile.kernels.forward import attention_forward
    return attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                             window_right=0 if causal else -1, diag_offset=k.shape[1] - q.shape[1])


def _bwd(dout, q, k, v, out, lse, causal, cfg, deterministic):
    from flashtile.kernels.backward import attention_backward
    return attention_backward(dout, q, k, v, out, lse, softmax_scale=q.shape[-1] ** -0.5,
                              window_left=-1, window_right=0 if causal else -1,
                              diag_offset=k.shape[1] - q.shape[1], config=_config(cfg),
                              deterministic=deterministic)


def _check(d, causal, cfg, deterministic, n=512):
    """Max error of each gradient over 3x textbook bf16's error, against float64 (<= 1 passes)."""
    from flashtile.reference import attention
    q, k, v, dout = _inputs(1, n, 2, d)
    out, lse = _fwd(q, k, v, causal)
    grads = _bwd(dout, q, k, v, out, lse, causal, cfg, deterministic)

    def ref(dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        o, _ = attention(*leaves, causal=causal)
        return torch.autograd.grad(o, leaves, dout.to(dtype))

    exact, low = ref(torch.float64), ref(torch.bfloat16)
    worst = 0.0
    for g, e, lo in zip(grads, exact, low):
        err = (g.double() - e).abs().max().item()
        budget = max(3 * (lo.double() - e).abs().max().item(), 1e-6)
        worst = max(worst, err / budget)
    return worst


def _warm(job):
    d, cfg, deterministic = job
    try:
        for causal in (False, True):
            q, k, v, dout = _inputs(1, 256, 2, d)
            out, lse = _fwd(q, k, v, causal)
            _bwd(dout, q, k, v, out, lse, causal, cfg, deterministic)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return job, None
    except Exception as exc:
        return job, f"{type(exc).__name__}: {exc}"[:300]


def _flops(b, s, h, d, causal):
    return 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)


def _sdpa_step(backend, qt, kt, vt, dout_t, causal):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    leaves = [t.requires_grad_(True) for t in (qt, kt, vt)]

    def step():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return torch.autograd.grad(o, leaves, dout_t)
    return step


def _label(c):
    m1, n1, m2, n2, w1, s1, w2, s2, _, tma = c["cfg"]
    t = "T" if tma else ""
    if not c["deterministic"]:
        return f"A{t}{m1},{n1},{w1},{s1}"
    return f"D{t}{m1},{n1}|{m2},{n2}|{w1},{s1}|{w2},{s2}"


def main():
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--dry", action="store_true", help="tiny shapes, no timing (CPU smoke run)")
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")] if not args.dry else [64]
    if args.dry:
        for d in dims:  # the interpreter's tiles are small; one candidate per kind is enough
            ATOMIC[d], DKDV[d], DQ[d] = [(32, 32, 4, 1)], [(32, 32, 4, 1)], [(32, 32, 4, 1)]

    jobs = [(d, cfg, det) for d in dims for cfg, det in candidates(d)]
    t0 = time.time()
    if args.dry:
        warm_errors = dict(_warm(j) for j in jobs)
    else:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            warm_errors = dict(pool.map(_warm, jobs))
    print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)

    if args.dry:
        def timer(fn):
            fn()
            return 1.0
    else:
        def timer(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    from torch.nn.attention import SDPBackend
    rows = []
    for d in dims:
        for n in seqlens:
            b, s, h, _ = _shape(d, n, args.dry)
            q, k, v, dout = _inputs(b, s, h, d)
            qt, kt, vt, dout_t = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
            for causal in (False, True):
                fl = _flops(b, s, h, d, causal)
                point = {"d": d, "n": n, "batch": b, "heads": h, "causal": causal, "anchors": {},
                         "configs": []}
                if not args.dry:
                    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            point["anchors"][name] = fl / timer(
                                _sdpa_step(backend, qt, kt, vt, dout_t, causal)) / 1e9
                        except Exception as exc:
                            point["anchors"][name] = None
                            print(name, "failed:", exc)
                out, lse = _fwd(q, k, v, causal)
                fwd_ms = timer(lambda: _fwd(q, k, v, causal))
                point["fwd_ms"] = fwd_ms
                for cfg, det in candidates(d):
                    rec = {"cfg": list(cfg), "deterministic": det}
                    if warm_errors.get((d, cfg, det)):
                        rec["error"] = warm_errors[(d, cfg, det)]
                    else:
                        try:
                            rec["err_over_budget"] = _check(d, causal, cfg, det, 64 if args.dry else 512)
                            bwd_ms = timer(lambda: _bwd(dout, q, k, v, out, lse, causal, cfg, det))
                            rec["bwd_ms"] = bwd_ms
                            rec["tflops"] = fl / (fwd_ms + bwd_ms) / 1e9
                        except Exception as exc:
                            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    point["configs"].append(rec)
                rows.append(point)
                print(json.dumps(point), flush=True)

    info = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
            "method": "fwd+bwd TFLOP/s = 3.5 * forward FLOPs / (flashtile forward ms + candidate "
                      "backward ms); anchors: SDPA forward + autograd.grad; do_bench medians"}
    with open(os.path.join(args.out, "tune-backward.json"), "w") as f:
        json.dump({"info": info, "points": rows}, f, indent=1)

    print("\n d     n  causal | flash  cudnn | best fwd+bwd TFLOP/s: A = atomic dQ (m,n,w,s); "
          "D = dQ pass (dkdv m,n | dq m,n | w,s dkdv | w,s dq)")
    for p in rows:
        ok = sorted((c for c in p["configs"] if "tflops" in c), key=lambda c: -c["tflops"])
        best = "  ".join(f"{_label(c)}={c['tflops']:.0f}"
                         f"{'' if c['err_over_budget'] <= 1 else '!BAD'}" for c in ok[:4])
        fa, cu = p["anchors"].get("sdpa-flash"), p["anchors"].get("sdpa-cudnn")
        print(f"{p['d']:3d} {p['n']:6d} {str(p['causal']):5s} | {fa or 0:5.0f} {cu or 0:5.0f} | {best}")
    for p in rows:
        for c in p["configs"]:
            if "error" in c:
                print("error:", p["d"], p["causal"], c)


if __name__ == "__main__":
    main()
