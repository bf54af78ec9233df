"""Sweep forward tile configs on the GPU against SDPA's flash and cudnn backends, in one run.

    PYTHONPATH=src python benchmarks/tune_forward.py --out $OUT [--dims 64,128,256] [--seqlens 8192]

Compiles every candidate in parallel worker processes first (Triton's on-disk cache then serves the
timed process), checks each candidate's output on sampled rows against the float64 reference, and
prints TFLOP/s per config with the anchors measured in the same run. Writes tune.json under --out.
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

CANDIDATES = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 16, 3), (128, 64, 8, 2),
         (256, 128, 16, 2)],
    # 4-warp configs that leave room for two CTAs per SM (one's softmax overlaps the other's MMA)
    128: [(128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2), (128, 32, 4, 3), (128, 32, 4, 4),
          (64, 64, 4, 2), (64, 32, 4, 4), (128, 64, 8, 2)],
    256: [(128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 1), (256, 32, 16, 2), (128, 32, 8, 2),
          (64, 32, 4, 3)],
}


def _shape(d: int, n: int):
    return TOKENS // n, n, HIDDEN // d, d  # batch, seqlen, heads, head_dim


def _inputs(d, n, dtype=torch.bfloat16, heads_k=None):
    b, s, h, _ = _shape(d, n)
    hk = heads_k or h
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
    return q, k, v


def _run(q, k, v, causal, cfg):
    from flashtile.kernels.forward import TileConfig, attention_forward
    return attention_forward(q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                             window_right=0 if causal else -1, diag_offset=k.shape[1] - q.shape[1],
                             config=TileConfig(*cfg))


def _warm(job):
    """Compile one (d, cfg, tma) for both causal modes on small inputs of the same specialization."""
    d, cfg, tma = job
    try:
        q, k, v = _inputs(d, 256)
        for causal in (False, True):
            _run(q[:1], k[:1], v[:1], causal, (*cfg, tma))
        torch.cuda.synchronize()
        return job, None
    except Exception as exc:  # keep sweeping; the timed pass reports it
        return job, f"{type(exc).__name__}: {exc}"[:300]


def _flops(b, s, h, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def _sdpa(backend):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def fn(qt, kt, vt, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return fn


def _check(out, q, k, v, causal, rows=64):
    from flashtile.reference import attention
    idx = torch.randperm(q.shape[1], device=q.device)[:rows]
    idx = torch.cat([idx, torch.tensor([q.shape[1] - 1], device=q.device)])
    ref, _ = attention(q[:1].double(), k[:1].double(), v[:1].double(), causal=causal, query_rows=idx)
    low, _ = attention(q[:1], k[:1], v[:1], causal=causal, query_rows=idx)
    err = (out[:1, idx].double() - ref).abs().max().item()
    budget = 2 * (low.double() - ref).abs().max().item()
    return err, budget


def main():
    import triton
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--tma", default="0,1")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    tmas = [bool(int(x)) for x in args.tma.split(",")]

    jobs = [(d, cfg, tma) for d in dims for cfg in CANDIDATES[d] for tma in tmas]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        warm_errors = dict(pool.map(_warm, jobs))
    print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)

    anchors = {"sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    rows = []
    for d in dims:
        for n in seqlens:
            b, s, h, _ = _shape(d, n)
            q, k, v = _inputs(d, n)
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            for causal in (False, True):
                fl = _flops(b, s, h, d, causal)
                point = {"d": d, "n": n, "batch": b, "heads": h, "causal": causal, "anchors": {}, "configs": []}
                for name, fn in anchors.items():
                    try:
                        ms = triton.testing.do_bench(lambda: fn(qt, kt, vt, causal), warmup=25, rep=100,
                                                     return_mode="median")
                        point["anchors"][name] = fl / ms / 1e9
                    except Exception as exc:
                        point["anchors"][name] = None
                        print(name, "failed:", exc)
                for cfg in CANDIDATES[d]:
                    for tma in tmas:
                        rec = {"cfg": list(cfg), "tma": tma}
                        if warm_errors.get((d, cfg, tma)):
                            rec["error"] = warm_errors[(d, cfg, tma)]
                        else:
                            try:
                                out, _ = _run(q, k, v, causal, (*cfg, tma))
                                rec["err"], rec["budget"] = _check(out, q, k, v, causal)
                                ms = triton.testing.do_bench(lambda: _run(q, k, v, causal, (*cfg, tma)),
                                                             warmup=25, rep=100, return_mode="median")
                                rec["tflops"] = fl / ms / 1e9
                            except Exception as exc:
                                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        point["configs"].append(rec)
                rows.append(point)
                print(json.dumps(point), flush=True)

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump({"info": info, "points": rows}, f, indent=1)

    print("\n d     n  causal | flash  cudnn | best config (TFLOP/s, ok) ... top 4")
    for p in rows:
        ok = [c for c in p["configs"] if "tflops" in c]
        ok.sort(key=lambda c: -c["tflops"])
        best = "  ".join(f"{tuple(c['cfg'])}{'T' if c['tma'] else ''}={c['tflops']:.0f}"
                         f"{'' if c['err'] <= c['budget'] else '!BAD'}" for c in ok[:4])
        fa, cu = p["anchors"].get("sdpa-flash"), p["anchors"].get("sdpa-cudnn")
        print(f"{p['d']:3d} {p['n']:6d} {str(p['causal']):5s} | {fa or 0:5.0f} {cu or 0:5.0f} | {best}")
    bad = [(p["d"], p["causal"], c) for p in rows for c in p["configs"] if "error" in c]
    for b in bad:
        print("error:", b)


if __name__ == "__main__":
    main()
