"""A/B of the Gluon forward's softcap tanh: the shipped exp2 formula against tanh.approx.f32
(GluonVariant.softcap_approx), and the same schedule without a softcap, on Gemma 2's prefill shapes.

    PYTHONPATH=src python benchmarks/softcap_ab.py --out $OUT [--rounds N]

Each variant's output on the call's last 256 query rows against float64 (as a share of the budget:
2x textbook bf16's error) and medians of triton.testing.do_bench over rounds that rotate the variants.
tanh.approx differs from the formula the portable backward recomputes P with by up to ~2^-11 of the
cap, so it could serve only calls without gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

CAP = 50.0


def main(argv=None) -> int:
    from helpers import assert_matches_reference
    from triton.testing import do_bench

    from flashtile.kernels import gluon_forward as g
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head-dims", default="128,256", help="which of Gemma 2's head dims (128: 27B, 256: 9B)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    dims = {int(x) for x in args.head_dims.split(",")}
    for heads, heads_k, d in [shape for shape in ((32, 16, 128), (16, 8, 256)) if shape[2] in dims]:
        for causal in (True, False):
            batch, s = 2, 4096
            q = torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16) * 3
            k = torch.randn(batch, s, heads_k, d, device="cuda", dtype=torch.bfloat16) * 3
            v = torch.randn(batch, s, heads_k, d, device="cuda", dtype=torch.bfloat16)
            scale = d ** -0.5
            base = g.dispatch_variant(d, "bf16", causal, s)
            variants = {"nocap": (base, 0.0), "exp2": (g.with_softcap(base), CAP),
                        "approx": (dataclasses.replace(g.with_softcap(base), softcap_approx=True), CAP)}
            row = dict(heads=heads, heads_k=heads_k, head_dim=d, causal=causal, seqlen=s, batch=batch)
            for name, (variant, cap) in variants.items():
                out, lse = g.gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal, variant=variant,
                                                     softcap=cap)
                tail = slice(s - 256, s)
                err, budget = assert_matches_reference(out[:, tail], lse[:, :, tail], q[:, tail], k, v,
                                                       causal=causal, softcap=cap)
                row[f"of_budget_{name}"] = err / budget
            times = {name: [] for name in variants}
            names = list(variants)
            for r in range(args.rounds):
                for i in range(len(names)):
                    name = names[(r + i) % len(names)]
                    variant, cap = variants[name]
                    times[name].append(do_bench(lambda: g.gluon_attention_forward(
                        q, k, v, softmax_scale=scale, causal=causal, variant=variant, softcap=cap)))
            for name in names:
                row[f"ms_{name}"] = sorted(times[name])[len(times[name]) // 2]
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "softcap-ab.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), cap=CAP, rounds=args.rounds, rows=rows), f, indent=1)
    print(f"{'heads':>6} {'d':>4} {'causal':>6} | ms {'nocap':>7} {'exp2':>7} {'approx':>7} | approx/exp2 speedup"
          f" | error of budget exp2 approx")
    for r in rows:
        print(f"{r['heads']:>3}/{r['heads_k']:<2} {r['head_dim']:>4} {str(r['causal']):>6} | "
              f"{r['ms_nocap']:10.3f} {r['ms_exp2']:7.3f} {r['ms_approx']:7.3f} | "
              f"{r['ms_exp2'] / r['ms_approx']:19.2f}x"
              f" | {r['of_budget_exp2']:20.2f} {r['of_budget_approx']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
