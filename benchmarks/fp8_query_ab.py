"""FlashAttention-3's all-FP8 decode (an e4m3 q with q_descale) against the bf16-query call on the
same e4m3 caches: what the e4m3 query costs a decode step.

    PYTHONPATH=src python benchmarks/fp8_query_ab.py --out $OUT [--points 'B,H,Hk,ctx;...']

Providers per point, each a CUDA graph over L layers with their own e4m3 caches (>= 1 GiB, as bench
decode-fp8), timed in balanced rounds (median of the rounds' do_bench medians), us per layer:
bf16-q (per-key descales, the decode-fp8 bench's call), e4m3-q (the same per-key descales and a
q_descale), bf16-q-fixed and e4m3-q-fixed (FlashAttention-3's (B, Hk) descales). Each provider's
output is first checked against float64 attention on the dequantized inputs (2x the bf16 error).
Writes fp8-query-ab.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from flashtile.bench import decode as bench
from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode_fp8 import FP8Caches, _fp8_query, fp8_point_bytes
from flashtile.reference import attention

POINTS = "1,32,8,4096;1,32,8,32768;16,12,2,16384;16,32,8,4096;64,32,8,16384"


def check(out, q_deq, k8, v8, kd, vd, lengths) -> tuple[float, float]:
    """Largest error against float64 over the first two sequences, and the budget."""
    err = budget = 0.0
    for i in range(min(2, q_deq.shape[0])):
        n = int(lengths[i])
        args = (q_deq[i:i + 1].double(), (k8[i:i + 1, :n].float() * kd[i:i + 1, :n, :, None]).double(),
                (v8[i:i + 1, :n].float() * vd[i:i + 1, :n, :, None]).double())
        ref, _ = attention(*args, causal=True)
        low, _ = attention(*(t.to(torch.bfloat16) for t in args), causal=True)
        err = max(err, (out[i:i + 1].double() - ref).abs().max().item())
        budget = max(budget, 2 * (low.double() - ref).abs().max().item())
    return err, budget


def probe(point: bench.Point, device, rounds: int) -> dict:
    import flashtile
    nbytes = fp8_point_bytes(point)
    layers = max(1, math.ceil(bench.MIN_TOTAL_BYTES / nbytes))
    caches = FP8Caches.allocate(point, layers, device)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, torch.bfloat16)
    q8, qd, q_deq = _fp8_query(q, point.heads_k)
    q_deq16 = q_deq.to(torch.bfloat16)  # the bf16 calls read the same (dequantized) query
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    # FlashAttention-3's fixed descales: one per layer, sequence and KV head
    fixed_k = caches.k_descale[:, :, 0, :].contiguous()
    fixed_v = caches.v_descale[:, :, 0, :].contiguous()

    def call(name):
        fixed = name.endswith("fixed")
        fp8_q = name.startswith("e4m3")

        def run(layer):
            kd = fixed_k[layer] if fixed else caches.k_descale[layer]
            vd = fixed_v[layer] if fixed else caches.v_descale[layer]
            return flashtile.flash_attn_with_kvcache(
                q8 if fp8_q else q_deq16, caches.k[layer], caches.v[layer], cache_seqlens=lengths,
                causal=True, k_descale=kd, v_descale=vd, q_descale=qd if fp8_q else None)
        return run

    names = ["bf16-q", "e4m3-q", "bf16-q-fixed", "e4m3-q-fixed"]
    record = {"batch": point.batch, "heads": point.heads, "heads_k": point.heads_k,
              "context": point.context, "layers": layers, "bytes_per_layer": nbytes, "providers": {}}
    replays = {}
    for name in names:
        run = call(name)
        out = run(0)
        fixed = name.endswith("fixed")
        b = point.batch
        kd = fixed_k[0][:, None, :].expand(b, point.context, point.heads_k) if fixed else caches.k_descale[0]
        vd = fixed_v[0][:, None, :].expand(b, point.context, point.heads_k) if fixed else caches.v_descale[0]
        err, budget = check(out, q_deq if name.startswith("e4m3") else q_deq16.float(), caches.k[0],
                            caches.v[0], kd, vd, point.lengths())
        ok = bool(torch.isfinite(out).all()) and out.dtype == torch.bfloat16 and err <= budget
        record["providers"][name] = {"passed": ok, "out_err": err, "budget": budget}
        replays[name] = bench.build_replay(run, layers, device)
    times, errors = time_in_rounds({n: (lambda r=replays[n]: bench.gpu_timer(r)) for n in names}, rounds)
    for name in names:
        ms = sorted(times[name])[len(times[name]) // 2] if times[name] else None
        p = record["providers"][name]
        p["us_per_layer"] = ms * 1e3 / layers if ms else None
        p["rounds_ms"] = times[name]
        if name in errors:
            p["error"] = repr(errors[name])
    base = record["providers"]
    for name in ("e4m3-q", "e4m3-q-fixed"):
        ref = base["bf16-q" if name == "e4m3-q" else "bf16-q-fixed"]["us_per_layer"]
        if ref and base[name]["us_per_layer"]:
            base[name]["vs_bf16_q"] = base[name]["us_per_layer"] / ref
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    for spec in args.points.split(";"):
        b, h, hk, ctx = (int(x) for x in spec.split(","))
        point = bench.Point("fp8q", b, h, hk, ctx)
        records.append(probe(point, device, args.rounds))
        torch.cuda.empty_cache()  # the point's caches and graphs went with probe's frame
        r = records[-1]
        line = " ".join(f"{n} {p['us_per_layer']:.1f}us{'' if p['passed'] else ' FAIL'}"
                        for n, p in r["providers"].items() if p.get("us_per_layer"))
        print(f"B{b} {h}/{hk} {ctx}: {line}", flush=True)
    with open(os.path.join(args.out, "fp8-query-ab.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)
    print("\npoint               bf16-q  e4m3-q  ratio | fixed: bf16-q  e4m3-q  ratio  | checks")
    for r in records:
        p = r["providers"]
        cells = []
        for a, c in (("bf16-q", "e4m3-q"), ("bf16-q-fixed", "e4m3-q-fixed")):
            ua, uc = p[a].get("us_per_layer"), p[c].get("us_per_layer")
            cells.append(f"{ua or 0:7.1f} {uc or 0:7.1f} {(uc / ua) if ua and uc else 0:6.3f}")
        ok = all(x["passed"] for x in p.values())
        print(f"B{r['batch']} {r['heads']}/{r['heads_k']} {r['context']:>6}  {cells[0]} | {cells[1]} | "
              f"{'all pass' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
