"""Locate a wrong Gluon forward variant: run schedules that differ in one thing each (key tile, ring
depth, head dim, specialization, ping-pong) on small inputs and print where the output is wrong.

    PYTHONPATH=src python benchmarks/gluon_debug.py --out $OUT

Each variant runs in its own process (a protocol error can hang): non-causal, B=1, H=2, Sq=Sk=256,
bf16. Prints the max error against float64 per 64-row x 64-column block of the output, the LSE error,
and NaN counts; writes gluon-debug.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (head_dim, block_n, stages, warp_specialize, pingpong, persistent)
VARIANTS = [(256, 64, 2, True, True, False), (256, 64, 2, True, False, False),
            (256, 64, 2, False, False, False), (256, 128, 1, True, True, False),
            (256, 32, 2, True, True, False), (128, 64, 2, True, True, False),
            (128, 128, 1, True, True, False), (128, 128, 2, True, True, False),
            (64, 64, 2, True, True, False)]


def run_one(spec, seqlen):
    import torch

    from flashtile.kernels.gluon_forward import GluonVariant, gluon_attention_forward
    from flashtile.reference import attention

    d, block_n, stages, ws, pp, persistent = spec
    variant = GluonVariant(d, "bf16", False, block_n=block_n, stages=stages, warp_specialize=ws,
                           pingpong=pp and ws, persistent=persistent)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, seqlen), float("nan"), device="cuda")
    gluon_attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=False, variant=variant, out=out,
                            lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = attention(q.double(), k.double(), v.double())
    low, _ = attention(q, k, v)
    err = (out.double() - ref).abs()  # (1, S, H, D)
    grid = err[0].amax(dim=1)  # (S, D)
    blocks = [[round(grid[r:r + 64, c:c + 64].max().item(), 4) for c in range(0, d, 64)]
              for r in range(0, seqlen, 64)]
    return {"variant": variant.name, "nan_out": int(torch.isnan(out).sum()),
            "nan_lse": int(torch.isnan(lse).sum()), "err": err.max().item(),
            "budget": 2 * (low.double() - ref).abs().max().item(),
            "lse_err": (lse.double() - ref_lse).abs().max().item(), "blocks": blocks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--seqlen", type=int, default=256)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(tuple(json.loads(args.one)), args.seqlen)))
        return
    results = []
    for spec in VARIANTS:
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec), "--seqlen",
                                   str(args.seqlen)], capture_output=True, text=True, timeout=90)
            line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            rec = json.loads(line) if line.startswith("{") else {
                "spec": spec, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        except subprocess.TimeoutExpired:
            rec = {"spec": spec, "error": "timed out (hang?)"}
        rec["spec"] = spec
        results.append(rec)
        if "error" in rec:
            print(f"{spec}: {rec['error']}", flush=True)
        else:
            ok = rec["err"] <= rec["budget"] and not rec["nan_out"]
            print(f"{rec['variant']}: {'PASS' if ok else 'FAIL'} err {rec['err']:.3g} budget "
                  f"{rec['budget']:.3g} lse {rec['lse_err']:.3g} nan {rec['nan_out']}/{rec['nan_lse']}",
                  flush=True)
            if not ok:
                for r, row in enumerate(rec["blocks"]):
                    print(f"    rows {64 * r:4d}+: " + " ".join(f"{x:7.4f}" for x in row), flush=True)
        with open(os.path.join(args.out, "gluon-debug.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
