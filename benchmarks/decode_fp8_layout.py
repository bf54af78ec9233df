"""Is the e4m3-cache decode held back by where its bytes lie? Same points, same kernel, timed in
balanced rounds over the same number of layers:

- ``e4m3``: the cache as bench decode-fp8 has it: K/V (B, S, Hk, D), descales (B, S, Hk) float32
  (a 64-key tile of one KV head reads 64 descales 4 * Hk bytes apart: one 32-byte sector each);
- ``e4m3 head-major ds``: the same K/V, the descales stored (B, Hk, S) and passed as the (B, S, Hk)
  view of that storage (strides (Hk S, 1, S)): a tile's descales are 256 contiguous bytes;
- ``e4m3 Hk=1``: the same bytes and (sequence, KV head) pairs as B x Hk sequences of one KV head,
  so each pair's K/V rows are contiguous (128 bytes a key) and so are its descales;
- ``bf16`` (and ``bf16 Hk=1``): the 16-bit cache for scale.

    PYTHONPATH=src python benchmarks/decode_fp8_layout.py --out $OUT

Checks first that the head-major descales give the same output as the standard layout.
"""

from __future__ import annotations

import argparse

import torch
from decode_fp8_rounds import point_inputs, rate, start, write_points  # this directory: run as a script

from flashtile.bench.common import time_in_rounds
from flashtile.bench.decode import LayerCaches, Point, gpu_timer, point_bytes, prepare_replay
from flashtile.bench.decode_fp8 import FP8Caches, fp8_point_bytes, fp8_step

POINTS = ((64, 32, 8, 16384), (16, 32, 8, 32768), (16, 12, 2, 16384), (1, 32, 8, 32768))


def head_major(caches: FP8Caches) -> FP8Caches:
    """The same K/V; descales stored (L, B, Hk, S), passed as (L, B, S, Hk) views."""
    def relayout(ds):
        return ds.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    return FP8Caches(caches.layers, caches.k, caches.v, relayout(caches.k_descale),
                     relayout(caches.v_descale))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    args, device, ceiling = start(parser)
    rows = []
    for batch, heads, heads_k, context in POINTS:
        point, layers, q, lengths = point_inputs(batch, heads, heads_k, context, device)
        flat = Point("p1", batch * heads_k, heads // heads_k, 1, context)
        q1 = q.view(batch, 1, heads_k, heads // heads_k, 128).transpose(1, 2).reshape(
            batch * heads_k, 1, heads // heads_k, 128).contiguous()
        lengths1 = torch.full((batch * heads_k,), context, dtype=torch.int32, device=device)
        caches8 = FP8Caches.allocate(point, layers, device)
        caches8h = head_major(caches8)
        out_a = fp8_step(caches8, q, lengths).call(0)
        out_b = fp8_step(caches8h, q, lengths).call(0)
        same = torch.equal(out_a, out_b)
        print(f"B{batch} {heads}/{heads_k} {context}: head-major descales give the same output: {same}")
        assert same, (out_a - out_b).abs().max().item()
        caches81 = FP8Caches.allocate(flat, layers, device)
        caches16 = LayerCaches.allocate(point, layers, device)
        caches161 = LayerCaches.allocate(flat, layers, device)
        replays, nbytes = {}, {}
        for name, r in (
                ("e4m3", prepare_replay("flashtile-fp8", caches16, q, lengths, {},
                                        fp8_step(caches8, q, lengths))),
                ("e4m3 head-major ds", prepare_replay("flashtile-fp8", caches16, q, lengths, {},
                                                      fp8_step(caches8h, q, lengths))),
                ("e4m3 Hk=1", prepare_replay("flashtile-fp8", caches161, q1, lengths1, {},
                                             fp8_step(caches81, q1, lengths1))),
                ("bf16", prepare_replay("flashtile", caches16, q, lengths, {})),
                ("bf16 Hk=1", prepare_replay("flashtile", caches161, q1, lengths1, {}))):
            replay, _, err = r
            assert err is None, (name, err)
            replays[name] = replay
            nbytes[name] = layers * (fp8_point_bytes(point) if name.startswith("e4m3")
                                     else point_bytes(point))
        calls = {name: (lambda r=r: gpu_timer(r)) for name, r in replays.items()}
        times, errors = time_in_rounds(calls, args.rounds)
        assert not errors, errors
        result = {"point": [batch, heads, heads_k, context], "layers": layers}
        for name, ms in times.items():
            med, pct, spread = rate(nbytes[name], ms, ceiling)
            result[name] = {"ms": ms, "pct_ceiling": pct, "us_per_layer": 1e3 * med / layers}
            print(f"B{batch} {heads}/{heads_k} {context:>6} {name:20s} {pct:6.1f}%  "
                  f"{1e3 * med / layers:8.2f} us/layer  spread {spread:4.1f}%", flush=True)
        rows.append(result)
        del caches8, caches8h, caches81, caches16, caches161, replays, calls
        torch.cuda.empty_cache()
    write_points(args.out, "decode-fp8-layout.json", ceiling, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
