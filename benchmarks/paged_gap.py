"""Where paged decode loses to the contiguous cache, split into its parts: the kernel (the shipped
paged kernel, Gluon's TMA one, reading the contiguous cache), the page gather (the same kernel
through an in-order block table: the contiguous bytes exactly), and the scattered pages (a shuffled
table, as bench paged), with the Triton paged kernel for reference.

    PYTHONPATH=src python benchmarks/paged_gap.py --out $OUT [--points 'B,H,Hk,ctx;...']

Every variant of a point runs as a CUDA graph over L layers with their own caches (>= 1 GiB, as
bench paged), all of them timed in balanced rounds (bench.common.time_in_rounds; each in every
position and right after every other one equally often), the median of the rounds' do_bench
medians. Writes paged-gap.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import sys

import torch

from flashtile.bench import decode as bench
from flashtile.bench.common import source_digest
from flashtile.kernels import decode as dec

PAGE = 16
TRANSPOSED: list = []  # --transposed plans (block_n, stages, programs per SM)
BASELINE = None  # --baseline: an older kernels/gluon_decode.py, loaded as a module
POINTS = "16,12,2,32768;64,12,2,16384;16,12,2,16384;1,12,2,32768;16,32,8,65536;64,32,8,16384"


def forced(call, wanted, **settings):
    """``call`` with the Gluon-or-Triton choice forced while it plans (and captures), and any other
    ``settings`` of kernels.decode (e.g. a plan's config) in place; plans made meanwhile are
    dropped."""
    if wanted is None:
        return call

    def run(layer):
        saved = {name: getattr(dec, name) for name in ["gluon_wanted", *settings]}
        dec.gluon_wanted = lambda *a, **k: wanted
        for name, value in settings.items():
            setattr(dec, name, value)
        dec._PLANS.clear()
        try:
            return call(layer)
        finally:
            for name, value in saved.items():
                setattr(dec, name, value)
            dec._PLANS.clear()
    return run


@contextlib.contextmanager
def swapped(gluon_module=None, no_merge=False):
    """decode.py's Gluon kernel module replaced by ``gluon_module`` (its plans still come from the
    shipped decode.py), and/or the merge of split partials skipped (the split kernel alone)."""
    import flashtile.kernels as package
    name = "flashtile.kernels.gluon_decode"
    saved_module, saved_merge = importlib.import_module(name), dec._launch_combine
    if gluon_module is not None:
        sys.modules[name] = gluon_module
        package.gluon_decode = gluon_module
    if no_merge:
        dec._launch_combine = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sys.modules[name] = saved_module
        package.gluon_decode = saved_module
        dec._launch_combine = saved_merge


def load_baseline(path: str):
    """An older kernels/gluon_decode.py as a module of the flashtile.kernels package."""
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"flashtile.kernels.baseline_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def run_points(points: str, probe, out: str, name: str, **meta) -> None:
    """``probe(point, device, ceiling)`` at each 'B,H,Hk,ctx' of ``points``; JSON after each."""
    device = torch.device("cuda")
    ceiling = bench.ceiling_rate(bench.measure_ceiling(device))
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    results = []
    for item in points.split(";"):
        b, h, hk, ctx = (int(x) for x in item.split(","))
        print(f"B{b} {h}/{hk} ctx{ctx}", flush=True)
        with torch.no_grad():
            results.append(probe(bench.Point("probe", b, h, hk, ctx), device, ceiling))
        torch.cuda.empty_cache()
        with open(os.path.join(out, name), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "source_digest": source_digest(), **meta,
                       "points": results}, f, indent=1, default=str)


def in_order_table(batch: int, pages_per_seq: int, device) -> torch.Tensor:
    return torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, pages_per_seq)


def probe(point: bench.Point, device, ceiling: float, rounds: int) -> dict:
    layers = bench.layers_for(point)
    caches = bench.LayerCaches.allocate(point, layers, device)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, bench.DTYPE)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    pages = point.context // PAGE
    shuffled = {PAGE: bench.shuffled_block_table(point.batch, pages, device, gen)}
    ordered = {PAGE: in_order_table(point.batch, pages, device)}
    paged = bench.paged_name(PAGE)

    def step(name, tables, wanted, module=None, no_merge=False, **settings):
        def swap(call):
            def run(layer):
                with swapped(module, no_merge):
                    return call(layer)
            return run
        s = swap(forced(lambda _: bench.make_step(name, caches, q, lengths, tables), wanted,
                        **settings))(0)  # its info too
        return bench.Step(swap(forced(s.call, wanted, **settings)), s.backend, dict(s.info))

    if BASELINE is not None:  # the working tree's Gluon kernel against an older one (--baseline)
        steps = {"contiguous (shipped)": step(bench.CONTIGUOUS, {}, None),
                 "contiguous, split kernel only": step(bench.CONTIGUOUS, {}, None, no_merge=True),
                 "paged16 shuffled (shipped)": step(paged, shuffled, None),
                 "paged16 shuffled (baseline kernel)": step(paged, shuffled, None, module=BASELINE),
                 "paged16 shuffled, split kernel only": step(paged, shuffled, None, no_merge=True),
                 "contiguous, Gluon kernel, 6 stages": step(
                     bench.CONTIGUOUS, {}, True,
                     GLUON_T16_LONG=dataclasses.replace(dec.GLUON_T16_LONG, num_stages=6))}
    elif TRANSPOSED:  # the shipped plans against the transposed 16-bit consumer's (--transposed)
        # (run before GLUON_T16 was the default: "shipped" is the 64-row consumer there)
        steps = {"contiguous (shipped)": step(bench.CONTIGUOUS, {}, None),
                 "paged16 shuffled (shipped)": step(paged, shuffled, None)}
        for block_n, stages, per_sm in TRANSPOSED:
            cfg = dataclasses.replace(dec.GLUON_T16_LONG, block_n=block_n, num_stages=stages,
                                      programs_per_sm=per_sm)
            for label, name, tables in (("paged16", paged, shuffled),
                                        ("contiguous", bench.CONTIGUOUS, {})):
                steps[f"{label} transposed n{block_n} s{stages} {per_sm}/SM"] = step(
                    name, tables, True, GLUON_T16=True, GLUON_T16_LONG=cfg, GLUON_T16_SHORT=cfg)
    else:
        steps = {"contiguous (shipped)": step(bench.CONTIGUOUS, {}, None),
                 "contiguous, Gluon kernel": step(bench.CONTIGUOUS, {}, True),
                 "paged16 shuffled (shipped)": step(paged, shuffled, None),
                 "paged16 in order": step(paged, ordered, None),
                 "paged16 shuffled, Triton kernel": step(paged, shuffled, False)}
    nbytes = bench.point_bytes(point)
    results = bench.measure_providers(list(steps), caches, q, lengths, {}, bench.gpu_timer, nbytes,
                                      ceiling, rounds=rounds, steps=steps)
    base = results["contiguous (shipped)"]
    for name, r in results.items():
        ratio = (base["ms_per_layer"] / r["ms_per_layer"]
                 if r.get("available") and base.get("available") else None)
        r["vs_contiguous"] = ratio
        if r.get("available"):
            spread = (max(r["replay_ms_rounds"]) - min(r["replay_ms_rounds"])) / r["replay_ms"]
            print(f"  {name:34s} {r['us_per_layer']:8.1f} us {r['pct_ceiling']:5.1f}%  "
                  f"{ratio:.3f}x contiguous  {r.get('kernel', '?'):9s} splits {r.get('num_splits')}  "
                  f"spread {100 * spread:.1f}%", flush=True)
        else:
            print(f"  {name:34s} unavailable: {r.get('error')}", flush=True)
    return {"point": point.__dict__, "layers": layers, "results": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--transposed", default="",
                        help="time the transposed 16-bit consumer's plans 'block_n,stages,programs per "
                             "SM;...' against the shipped ones instead")
    parser.add_argument("--baseline", default=None,
                        help="an older kernels/gluon_decode.py to time the shipped plans with")
    args = parser.parse_args()
    global TRANSPOSED, BASELINE
    if args.baseline:
        BASELINE = load_baseline(args.baseline)
    TRANSPOSED = [tuple(int(x) for x in c.split(",")) for c in args.transposed.split(";") if c]
    run_points(args.points, lambda point, device, ceiling: probe(point, device, ceiling, args.rounds),
               args.out, "paged-gap.json", page_size=PAGE, rounds=args.rounds)


if __name__ == "__main__":
    main()
