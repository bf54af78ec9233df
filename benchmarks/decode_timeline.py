"""Where a decode layer's fixed time goes: per-CTA timestamps from the Gluon decode kernel's e4m3
consumer (and its 16-bit transposed one).

bench decode-fp8's per-layer times, fitted against the bytes, leave a fixed part of 7-20 us per
layer that no kernel change so far has moved (NOTES, 2026-12-03). This probe runs the dispatched
plan through an instrumented copy of kernels/gluon_decode.py (made at run time by text patches;
the shipped kernel is untouched) that records, for every CTA of every call in the CUDA graph: the
global timer when the CTA was launched, when its consumer started (after the wait for the previous
kernel, PDL), when its first K/V tile had landed and when it had written its partials, its SM's
clock at the last three points and the SM's id. From those, per call: the CTAs' launch skew, the
ramp to the first tile, the spread of the ends (the tail), the gap to the next call's first CTA
(the merge kernel's launch and run, and the next launch), against the time the call's bytes take
at the read ceiling of the same run. The graph holds max(L, 32) layer calls cycling through the L
caches (bench decode holds up to that many, bench.decode.graph_calls); the per-layer time of a
graph of L calls (each cache once, the bench method until 2026-12-03) is timed beside it, and the
kernel spans of the calls that read a cache again are compared with those of the first reads
(equal if the repeated reads are as cold).

    PYTHONPATH=src python benchmarks/decode_timeline.py --out $OUT [--points 'B,H,Hk,ctx[,bf16];...']

A point ending in ",bf16" times the bf16 cache (bench decode's call) where its plan takes the
16-bit transposed consumer (``_decode_consumer_t``, instrumented the same way), else skips it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import numpy as np
import torch

from flashtile.bench import decode as bench
from flashtile.bench.decode_fp8 import FP8Caches, fp8_point_bytes, fp8_step
from flashtile.kernels import decode as dec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import load_baseline, swapped  # noqa: E402

POINTS = "16,32,8,16384;16,32,8,32768;16,12,2,65536;16,12,2,16384;1,32,8,32768;1,32,8,32768,bf16;1,32,8,131072,bf16"
FIELDS = ("gt_launch", "gt_start", "gt_first", "gt_end", "clk_start", "clk_first", "clk_end", "smid")

# (anchor, replacement) pairs applied to kernels/gluon_decode.py's text, each anchor exactly once
PATCHES = [
    # timer helpers, before the e4m3 consumer
    ("    @gluon.jit\n    def _decode_consumer_fp8(",
     "    @gluon.jit\n    def _now():\n"
     "        return gl.inline_asm_elementwise(\"mov.u64 $0, %globaltimer;\", \"=l\", [], dtype=gl.int64,\n"
     "                                         is_pure=False, pack=1)\n\n"
     "    @gluon.jit\n    def _clock():\n"
     "        return gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l\", [], dtype=gl.int64,\n"
     "                                         is_pure=False, pack=1)\n\n"
     "    @gluon.jit\n    def _smid():\n"
     "        return gl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r\", [], dtype=gl.int32,\n"
     "                                         is_pure=False, pack=1)\n\n"
     "    @gluon.jit\n    def _timeline_store(Timeline, gt_launch, gt_start, gt_first, clk_start, clk_first):\n"
     "        gt_end = _now()\n        clk_end = _clock()\n"
     "        prog = (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0) \\\n"
     "            + gl.program_id(0)\n"
     "        base = Timeline + prog.to(gl.int64) * 8\n"
     "        gl.store(base, gt_launch)\n        gl.store(base + 1, gt_start)\n"
     "        gl.store(base + 2, gt_first)\n        gl.store(base + 3, gt_end)\n"
     "        gl.store(base + 4, clk_start)\n        gl.store(base + 5, clk_first)\n"
     "        gl.store(base + 6, clk_end)\n        gl.store(base + 7, _smid().to(gl.int64))\n\n"
     "    @gluon.jit\n    def _decode_consumer_fp8("),
    # the consumer takes the timeline pointer and the CTA's launch time
    ("SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False):\n        \"\"\"4 warps, e4m3 cache",
     "SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False,\n"
     "                               Timeline=None, gt_launch=0, TIMELINE: gl.constexpr = False):\n"
     "        \"\"\"4 warps, e4m3 cache"),
    ("        split, batch, kv_head, num_splits = _program(HEADS_FIRST)\n"
     "        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)\n"
     "        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)\n"
     "        HEAD_DIM: gl.constexpr = k_bufs.shape[2]\n        N: gl.constexpr = qh_smem.shape[0]\n",
     "        gt_start = _now()\n        clk_start = _clock()\n        gt_first = gt_start\n"
     "        clk_first = clk_start\n"
     "        split, batch, kv_head, num_splits = _program(HEADS_FIRST)\n"
     "        seqlen_k = gl.minimum(gl.maximum(gl.load(CacheSeqlens + batch), 0), capacity)\n"
     "        t_lo, t_hi = _split_tiles(seqlen_k, split, num_splits, BLOCK_N)\n"
     "        HEAD_DIM: gl.constexpr = k_bufs.shape[2]\n        N: gl.constexpr = qh_smem.shape[0]\n"),
    ("            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)\n            k_tile = k_bufs.index(slot)\n"
     "            # S^T as eight",
     "            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)\n"
     "            if i == 0:\n                gt_first = _now()\n                clk_first = _clock()\n"
     "            k_tile = k_bufs.index(slot)\n            # S^T as eight"),
    ("                        stride_lrh, SPLIT, WRITE_LSE, EMPTY_LSE, 1, 2)\n\n    @gluon.jit\n"
     "    def _attn_decode_gluon(",
     "                        stride_lrh, SPLIT, WRITE_LSE, EMPTY_LSE, 1, 2)\n"
     "        if TIMELINE:\n"
     "            _timeline_store(Timeline, gt_launch, gt_start, gt_first, clk_start, clk_first)\n\n"
     "    @gluon.jit\n    def _attn_decode_gluon("),
    # the kernel: a TIMELINE constexpr, the launch time before the PDL wait, passed on
    ("SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False):\n        \"\"\"Grid (splits, B, Hk).",
     "SEQ_DS: gl.constexpr = False, V_PAIRS: gl.constexpr = False,\n"
     "                           TIMELINE: gl.constexpr = False):\n        \"\"\"Grid (splits, B, Hk)."),
    ("        dtype: gl.constexpr = k_desc.dtype\n        if PDL:",
     "        dtype: gl.constexpr = k_desc.dtype\n        gt_launch = _now()\n        if PDL:"),
    ("                                          BATCH_IDX, V_REGS, DS_RING, SEQ_DS, V_PAIRS)),",
     "                                          BATCH_IDX, V_REGS, DS_RING, SEQ_DS, V_PAIRS, QDescale,\n"
     "                                          gt_launch, TIMELINE)),"),
    # the 16-bit transposed consumer (_decode_consumer_t) the same way
    ("HEADS_FIRST: gl.constexpr):\n        \"\"\"4 warps, 16-bit cache, every tile transposed",
     "HEADS_FIRST: gl.constexpr, Timeline=None, gt_launch=0,\n"
     "                           TIMELINE: gl.constexpr = False):\n"
     "        \"\"\"4 warps, 16-bit cache, every tile transposed"),
    ("        N: gl.constexpr = q_smem.shape[0]\n        dtype: gl.constexpr = k_bufs.dtype\n"
     "        st_layout: gl.constexpr = _wgmma_layout(4, N, 16)  # S^T (keys, rows)\n",
     "        N: gl.constexpr = q_smem.shape[0]\n        dtype: gl.constexpr = k_bufs.dtype\n"
     "        st_layout: gl.constexpr = _wgmma_layout(4, N, 16)  # S^T (keys, rows)\n"
     "        gt_start = _now()\n        clk_start = _clock()\n        gt_first = gt_start\n"
     "        clk_first = clk_start\n"),
    ("        if t_hi > t_lo:  # the first tile: no P V before it to overlap\n"
     "            mbarrier.wait(ready.index(0), 0)\n",
     "        if t_hi > t_lo:  # the first tile: no P V before it to overlap\n"
     "            mbarrier.wait(ready.index(0), 0)\n"
     "            gt_first = _now()\n            clk_first = _clock()\n"),
    ("                    SPLIT, WRITE_LSE, EMPTY_LSE, 1)\n\n    @gluon.jit\n    def _s_part(",
     "                    SPLIT, WRITE_LSE, EMPTY_LSE, 1)\n"
     "        if TIMELINE:\n"
     "            _timeline_store(Timeline, gt_launch, gt_start, gt_first, clk_start, clk_first)\n\n"
     "    @gluon.jit\n    def _s_part("),
    ("                                      BLOCK_N, STAGES, CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE,\n"
     "                                      HEADS_FIRST)),",
     "                                      BLOCK_N, STAGES, CAUSAL, SPLIT, WRITE_LSE, EMPTY_LSE,\n"
     "                                      HEADS_FIRST, QDescale, gt_launch, TIMELINE)),"),
    # the host: the timeline buffer in QDescale's place (unread without Q_DESCALE), a slice a launch
    ("    launch(_attn_decode_gluon, grid, tensors, scalars,\n"
     "           _options(variant, split, need_lse), descriptors)",
     "    options = _options(variant, split, need_lse)\n"
     "    if TIMELINE_BUF is not None and (variant.fp8 or variant.rows_n) and not variant.q_descale:\n"
     "        programs = grid[0] * grid[1] * grid[2]\n"
     "        start = TIMELINE_NEXT[0]\n"
     "        if 8 * (start + programs) > TIMELINE_BUF.numel():\n"
     "            raise RuntimeError('the timeline buffer is full')\n"
     "        TIMELINE_NEXT[0] += programs\n"
     "        TIMELINE_CALLS.append({\"first\": start, \"programs\": programs, \"grid\": grid, \"splits\": splits,\n"
     "                               \"variant\": variant.name})\n"
     "        tensors = (*tensors[:-1], TIMELINE_BUF[8 * start:])\n"
     "        options = _TIMELINE_OPTIONS.setdefault(tuple(sorted(options.items())),\n"
     "                                               dict(options, TIMELINE=True))\n"
     "    launch(_attn_decode_gluon, grid, tensors, scalars, options, descriptors)"),
    ("def gluon_decode(q, k_cache, v_cache, cache_seqlens, *,",
     "TIMELINE_BUF = None\nTIMELINE_NEXT = [0]\nTIMELINE_CALLS = []\n_TIMELINE_OPTIONS = {}\n\n\n"
     "def gluon_decode(q, k_cache, v_cache, cache_seqlens, *,"),
]


def instrumented_module():
    """kernels/gluon_decode.py with PATCHES applied, loaded as a module of the package."""
    path = os.path.join(os.path.dirname(dec.__file__), "gluon_decode.py")
    with open(path) as f:
        text = f.read()
    for anchor, replacement in PATCHES:
        count = text.count(anchor)
        if count != 1:
            raise RuntimeError(f"patch anchor found {count} times: {anchor[:80]!r}")
        text = text.replace(anchor, replacement)
    folder = tempfile.mkdtemp()
    patched = os.path.join(folder, "gluon_decode_timeline.py")
    with open(patched, "w") as f:
        f.write(text)
    return load_baseline(patched)


def quantiles(values, qs=(0.0, 0.1, 0.5, 0.9, 1.0)):
    """min, p10, p50, p90, max: each one of the values (the nearest rank)."""
    return [float(x) for x in np.quantile(values, qs, method="nearest")]


def layer_stats(rows, clock_ghz):
    """One layer's CTAs (rows of FIELDS): times in us from the layer's first CTA launch."""
    t0 = min(r[0] for r in rows)
    us = lambda ns: ns / 1e3  # noqa: E731
    start = [us(r[1] - t0) for r in rows]
    launch = [us(r[0] - t0) for r in rows]
    first = [us(r[2] - r[1]) for r in rows]
    end = [us(r[3] - t0) for r in rows]
    ramp_clk = [(r[5] - r[4]) / clock_ghz / 1e3 for r in rows]
    body_clk = [(r[6] - r[5]) / clock_ghz / 1e3 for r in rows]
    per_sm = {}
    for r in rows:
        per_sm.setdefault(r[7], []).append(r)
    return {
        "ctas": len(rows), "sms": len(per_sm),
        "launch_skew_us": quantiles(launch), "start_us": quantiles(start),
        "ramp_us": quantiles(first), "ramp_clock_us": quantiles(ramp_clk),
        "body_clock_us": quantiles(body_clk), "end_us": quantiles(end),
        "span_us": max(end), "t0": t0, "t_end": t0 + max(r[3] - t0 for r in rows),
    }


def probe(point: bench.Point, device, ceiling: float, module, clock_ghz: float, e4m3: bool = True) -> dict:
    """``e4m3``: the e4m3 cache (bench decode-fp8's step), else the bf16 one (bench decode's)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, torch.bfloat16)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    if e4m3:
        nbytes = fp8_point_bytes(point)
        layers = max(1, math.ceil(bench.MIN_TOTAL_BYTES / nbytes))
        caches = FP8Caches.allocate(point, layers, device)
        step = fp8_step(caches, q, lengths)
    else:
        nbytes = bench.point_bytes(point)
        layers = bench.layers_for(point)
        caches = bench.LayerCaches.allocate(point, layers, device)
        step = bench.make_step(bench.CONTIGUOUS, caches, q, lengths, {})

    def run(layer):
        with swapped(module):
            return step.call(layer)

    n_calls = max(layers, bench.GRAPH_CALLS)  # (bench decode-fp8: graph_calls, <= this many)
    shipped = bench.build_replay(step.call, layers, device)
    us_one_pass = 1e3 * bench.gpu_timer(shipped) / layers  # the graph of L calls (until 2026-12-03)
    del shipped
    shipped = bench.build_replay(step.call, layers, device, n_calls)
    us_shipped = 1e3 * bench.gpu_timer(shipped) / n_calls
    del shipped
    dec._PLANS.clear()
    module.TIMELINE_NEXT[0] = 0
    module.TIMELINE_CALLS.clear()
    # (build_replay runs layer 0 twice before capturing the calls: n_calls + 2 launches)
    module.TIMELINE_BUF = torch.zeros(8 * (n_calls + 4) * 1024, dtype=torch.int64, device=device)
    replay = bench.build_replay(run, layers, device, n_calls)
    calls = [c for c in module.TIMELINE_CALLS][-n_calls:]  # the captured launches
    if len(calls) < n_calls:  # the plan took another kernel (the Triton one, or the 64-row consumer)
        print(f"  {len(calls)} instrumented launches in a graph of {n_calls} calls: another kernel; "
              "skipped", flush=True)
        return {"point": point.__dict__, "e4m3": e4m3, "skipped": "not the instrumented kernels"}
    us_timed = 1e3 * bench.gpu_timer(replay) / n_calls
    module.TIMELINE_BUF.zero_()
    replay()
    torch.cuda.synchronize()
    data = module.TIMELINE_BUF.view(-1, 8).cpu().tolist()
    dec._PLANS.clear()
    per_layer = []
    for c in calls:
        rows = data[c["first"]:c["first"] + c["programs"]]
        if any(r[3] == 0 for r in rows):
            raise RuntimeError(f"a CTA wrote no timeline in launch {c}")
        per_layer.append(layer_stats(rows, clock_ghz))
    gaps = [per_layer[i + 1]["t0"] - per_layer[i]["t_end"] for i in range(len(per_layer) - 1)]
    at_ceiling = nbytes / ceiling / 1e3
    med = lambda key, i: statistics.median(p[key][i] for p in per_layer[1:])  # noqa: E731
    # spans of the calls that read a cache the first time in the graph, and of those that read one
    # again (>= 1 GiB of reads later): equal if the second reads are as cold as the first
    first_pass = [p["span_us"] for p in per_layer[1:layers]] or [per_layer[0]["span_us"]]
    again = [p["span_us"] for p in per_layer[layers:]]
    summary = {
        "graph_calls": n_calls, "us_per_layer_one_pass": us_one_pass,
        "span_us_first_reads_median": statistics.median(first_pass),
        "span_us_repeat_reads_median": statistics.median(again) if again else None,
        "us_per_layer_shipped": us_shipped, "us_per_layer_instrumented": us_timed,
        "us_at_ceiling": at_ceiling, "splits": calls[0]["splits"], "programs": calls[0]["programs"],
        "variant": calls[0]["variant"],
        "span_us_median": statistics.median(p["span_us"] for p in per_layer[1:]),
        "gap_to_next_layer_us_median": statistics.median(gaps) / 1e3 if gaps else None,
        "launch_skew_us_max_median": med("launch_skew_us", 4),
        "start_after_pdl_wait_us_p50_median": med("start_us", 2),
        "ramp_us_p10/p50/p90": [med("ramp_us", 1), med("ramp_us", 2), med("ramp_us", 3)],
        "end_us_p10/p50/p90/max": [med("end_us", 1), med("end_us", 2), med("end_us", 3), med("end_us", 4)],
        "body_clock_us_p10/p50/p90": [med("body_clock_us", 1), med("body_clock_us", 2),
                                       med("body_clock_us", 3)],
    }
    print(f"  {nbytes / 1e6:.0f} MB a layer, L {layers}, {summary['programs']} CTAs ({summary['splits']} "
          f"splits), {summary['variant']}", flush=True)
    print(f"  graph of {layers} calls: {us_one_pass:.1f} us a layer; of {n_calls} calls cycling: "
          f"{us_shipped:.1f} us; split kernel spans of first / repeated reads "
          f"{summary['span_us_first_reads_median']:.1f} / {summary['span_us_repeat_reads_median'] or 0:.1f} us",
          flush=True)
    print(f"  per layer: shipped {us_shipped:.1f} us, instrumented {us_timed:.1f} us, at the ceiling "
          f"{at_ceiling:.1f} us; split kernel span {summary['span_us_median']:.1f} us, then "
          f"{summary['gap_to_next_layer_us_median'] or 0:.1f} us to the next layer's first CTA", flush=True)
    print(f"  CTA launch skew (max) {summary['launch_skew_us_max_median']:.2f} us, start after the PDL "
          f"wait p50 {summary['start_after_pdl_wait_us_p50_median']:.2f} us; first tile after start "
          f"p10/p50/p90 {', '.join(f'{x:.2f}' for x in summary['ramp_us_p10/p50/p90'])} us", flush=True)
    print(f"  ends p10/p50/p90/max {', '.join(f'{x:.1f}' for x in summary['end_us_p10/p50/p90/max'])} us; "
          f"streaming (first tile to end, SM clock) p10/p50/p90 "
          f"{', '.join(f'{x:.1f}' for x in summary['body_clock_us_p10/p50/p90'])} us", flush=True)
    middle = calls[len(calls) // 2]  # one call's CTAs as they were, times from its first launch
    rows = data[middle["first"]:middle["first"] + middle["programs"]]
    t0 = min(r[0] for r in rows)
    one_call = [[r[0] - t0, r[1] - t0, r[2] - t0, r[3] - t0, r[4], r[5], r[6], r[7]] for r in rows]
    return {"point": point.__dict__, "e4m3": e4m3, "layers": layers, "bytes_per_layer": nbytes,
            "summary": summary, "per_layer": per_layer, "calls": calls, "ctas_of_one_call": one_call}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = bench.ceiling_rate(bench.measure_ceiling(device))
    try:
        clock_ghz = torch.cuda.clock_rate(device) / 1e3  # (MHz, through NVML)
    except Exception:  # no NVML bindings: the H200's 1980 MHz
        clock_ghz = 1.98
    print(f"read ceiling {ceiling:.0f} GB/s, SM clock {clock_ghz:.2f} GHz (for the clock64 columns)",
          flush=True)
    module = instrumented_module()
    results = []
    for item in args.points.split(";"):
        fields = item.split(",")
        b, h, hk, ctx = (int(x) for x in fields[:4])
        e4m3 = fields[4:] != ["bf16"]
        print(f"B{b} {h}/{hk} ctx{ctx} {'e4m3' if e4m3 else 'bf16'}", flush=True)
        with torch.no_grad():
            results.append(probe(bench.Point("probe", b, h, hk, ctx), device, ceiling, module, clock_ghz,
                                 e4m3))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "decode-timeline.json"), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "clock_ghz": clock_ghz, "fields": FIELDS,
                       "points": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
