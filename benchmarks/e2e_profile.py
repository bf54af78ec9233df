"""Where the time of an end-to-end decode step goes: flashtile against transformers' sdpa.

    PYTHONPATH=src python benchmarks/e2e_profile.py [--batch 16] [--prompt 512] [--tokens 16]

Builds the ``bench e2e`` model (Qwen2.5-1.5B shape, random weights), generates a few tokens with each
attention implementation under torch.profiler, and prints the operators with the most host time, the
device synchronizations and the total of each side; then a cProfile of flashtile's attention function.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from flashtile.bench.e2e import build_model, qwen_config, use


def generate(model, ids, tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = build_model(qwen_config(args.layers), device)
    for batch in args.batch:
        ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt), device=device)
        for impl in ("flashtile", "sdpa"):
            use(model, impl)
            generate(model, ids, 4)  # compile / warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(model, ids, args.tokens)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                generate(model, ids, args.tokens)
                torch.cuda.synchronize()
            print(f"\n##### batch {batch}, {impl}: {args.tokens} tokens in {1e3 * wall:.1f} ms "
                  f"({1e3 * wall / args.tokens:.2f} ms/token)")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                              max_name_column_width=60)
            print(table)
            syncs = [e for e in prof.key_averages()
                     if any(s in e.key for s in ("Synchronize", "item", "nonzero", "Memcpy", "local_scalar"))]
            for e in syncs:
                print(f"  sync-ish {e.key:<50s} count {e.count:6d} self cpu {e.self_cpu_time_total / 1e3:8.2f} ms")
        use(model, "flashtile")
        profiler = cProfile.Profile()
        profiler.enable()
        generate(model, ids, args.tokens)
        torch.cuda.synchronize()
        profiler.disable()
        print(f"\n##### cProfile, batch {batch}, flashtile (cumulative, flashtile's frames)")
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats("flashtile", 25)


if __name__ == "__main__":
    main()
