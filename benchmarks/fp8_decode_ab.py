"""The e4m3-cache decode: the portable Triton kernel (forced) against what dispatch picks (the Gluon
TMA kernel's transposed e4m3 form) and any --configs of the Gluon plan, and with --pages the same
caches read as page pools, timed in balanced rounds.

    PYTHONPATH=src python benchmarks/fp8_decode_ab.py --out $OUT [--points 'B,H,Hk,ctx;...']

Each variant runs as a CUDA graph over L layers with their own e4m3 caches (>= 1 GiB, as bench
decode-fp8), timed in ``--rounds`` balanced rounds (bench.common.time_in_rounds), the median of the
rounds' do_bench medians; GB/s count the e4m3 bytes and the float32 descales read. Writes
fp8-decode-ab.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

from flashtile.bench import decode as bench
from flashtile.bench.decode_fp8 import FP8Caches, fp8_paged_step, fp8_point_bytes, fp8_step
from flashtile.kernels import decode as dec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import forced, load_baseline, run_points, swapped  # noqa: E402

BASELINE: list = []  # --baseline: (path, older kernels/gluon_decode.py loaded as a module)
PAGES: list = []  # --pages: the caches also read as page pools of these sizes
SEQLEN_Q = 1  # --seqlen-q: query positions a step (speculative steps: group x Sq query rows)
LEAN = False  # --lean: only the dispatched call and the --baseline ones
CAUSAL_BASELINE = False  # --causal-baseline: each baseline also with decode.ONE_ROW_AS_FULL off
CONFIGS: list = []  # more Gluon e4m3 plans (block_n, stages, programs per SM[, splits]), --configs
POINTS = ("16,32,8,32768;64,12,2,16384;16,32,8,4096;64,32,8,16384;16,12,2,32768;1,32,8,32768;"
          "1,12,2,32768;16,32,8,1024")


def gluon_config(block_n: int, stages: int, per_sm: int):
    return dataclasses.replace(dec.GLUON_E4M3, block_n=block_n, num_stages=stages,
                               programs_per_sm=per_sm)


def probe(point: bench.Point, device, ceiling: float, rounds: int) -> dict:
    nbytes = fp8_point_bytes(point)
    layers = max(1, math.ceil(bench.MIN_TOTAL_BYTES / nbytes))
    caches = FP8Caches.allocate(point, layers, device)
    holder = bench.LayerCaches(point, layers, caches.k, caches.v)  # measure_providers reads .layers
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, SEQLEN_Q, point.heads, point.head_dim, generator=gen).to(device, torch.bfloat16)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)

    def step(wanted, config=None, splits=0, v_regs=True, module=None, no_merge=False,
             one_row_as_full=True):
        s = fp8_step(caches, q, lengths)
        if module is not None or no_merge:
            inner = s.call

            def run(layer):
                with swapped(module, no_merge):
                    return inner(layer)
            s = bench.Step(run, s.backend, dict(s.info))
        # the config for every pair count (both e4m3 plans), and the split count if given
        settings = ({"GLUON_E4M3": config, "GLUON_E4M3_FOUR": config, "GLUON_E4M3_WIDE": config}
                    if config else {})
        if config or not v_regs:
            settings["E4M3_V_REGS"] = v_regs
        if splits:
            settings["split_heuristic"] = lambda *args, **kwargs: splits
        if not one_row_as_full:  # the causal kernels, as dispatched until 2026-12-03
            settings["ONE_ROW_AS_FULL"] = False
        call = forced(s.call, wanted, **settings)
        return bench.Step(call, s.backend, dict(s.info))

    def paged_step(page, wanted):
        """The same layer caches read as page pools (pages in a shuffled order, descales alike)."""
        table = bench.shuffled_block_table(point.batch, point.context // page, device)
        s = fp8_paged_step(caches, q, lengths, page, table)
        return bench.Step(forced(s.call, wanted), s.backend, dict(s.info))

    steps = {"e4m3 dispatched": step(None)} if LEAN else {"e4m3 Triton": step(False),
                                                          "e4m3 dispatched": step(None)}
    if not PAGES and not LEAN:
        # the plans and kernel before V^T went to registers (decode.E4M3_V_REGS)
        steps["e4m3 V in shared memory"] = step(True, None, 0, False)
    for page in PAGES:
        steps[f"e4m3 P{page} Triton"] = paged_step(page, False)
        steps[f"e4m3 P{page} dispatched"] = paged_step(page, None)
    for path, module in BASELINE:  # the working tree's kernel against older gluon_decode.py files
        steps[f"e4m3 {os.path.basename(path)}"] = step(None, module=module)
        if CAUSAL_BASELINE:
            steps[f"e4m3 {os.path.basename(path)} causal"] = step(True, module=module,
                                                                  one_row_as_full=False)
    if BASELINE and not LEAN:
        steps["e4m3 split kernel only"] = step(None, no_merge=True)
    for block_n, stages, per_sm, *rest in CONFIGS:
        splits, v_regs = (rest + [0, 0])[:2]
        name = (f"e4m3 Gluon n{block_n} s{stages} {per_sm}/SM" + (f" {splits} splits" if splits else "")
                + (" V regs" if v_regs else ""))
        steps[name] = step(True, gluon_config(block_n, stages, per_sm), splits, bool(v_regs))
    results = bench.measure_providers(list(steps), holder, q, lengths, {}, bench.gpu_timer, nbytes,
                                      ceiling, rounds=rounds, steps=steps)
    base = results.get("e4m3 Triton", {})
    for name, r in results.items():
        if r.get("available"):
            r["vs_triton"] = base["ms_per_layer"] / r["ms_per_layer"] if base.get("available") else None
            spread = (max(r["replay_ms_rounds"]) - min(r["replay_ms_rounds"])) / r["replay_ms"]
            print(f"  {name:28s} {r['us_per_layer']:8.1f} us {r['gbps']:6.0f} GB/s {r['pct_ceiling']:5.1f}%  "
                  f"{r['vs_triton'] or float('nan'):.3f}x Triton  spread {100 * spread:.1f}%", flush=True)
        else:
            print(f"  {name:28s} unavailable: {r.get('error')}", flush=True)
    return {"point": point.__dict__, "layers": layers, "bytes_per_layer": nbytes, "results": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--configs", default="",
                        help="more Gluon e4m3 plans to time: 'block_n,stages,programs per SM[,splits[,V in "
                             "registers 0/1]];...' (splits 0: the plan's)")
    parser.add_argument("--baseline", default=None,
                        help="older kernels/gluon_decode.py files to time against (same plans), "
                             "comma-separated")
    parser.add_argument("--pages", default="",
                        help="page sizes, comma-separated: the same caches also as page pools, through "
                             "the Triton kernel (forced) and as dispatched")
    parser.add_argument("--seqlen-q", type=int, default=1,
                        help="query positions a step (causal; > 1: speculative steps)")
    parser.add_argument("--lean", action="store_true",
                        help="time only the dispatched call and the --baseline ones")
    parser.add_argument("--causal-baseline", action="store_true",
                        help="each --baseline also with decode.ONE_ROW_AS_FULL off (one query row "
                             "planned as causal, as until 2026-12-03)")
    args = parser.parse_args()
    global CONFIGS, BASELINE, PAGES, SEQLEN_Q, LEAN, CAUSAL_BASELINE
    SEQLEN_Q = args.seqlen_q
    LEAN, CAUSAL_BASELINE = args.lean, args.causal_baseline
    PAGES = [int(p) for p in args.pages.split(",") if p]
    if args.baseline:
        BASELINE = [(path, load_baseline(path)) for path in args.baseline.split(",")]
    CONFIGS = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    run_points(args.points, lambda point, device, ceiling: probe(point, device, ceiling, args.rounds),
               args.out, "fp8-decode-ab.json", rounds=args.rounds)


if __name__ == "__main__":
    main()
