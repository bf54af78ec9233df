"""Decode steps in transformers (batch 1 unless given), flashtile against sdpa, in more alternated rounds
than bench e2e.

    PYTHONPATH=src python benchmarks/e2e_decode_ab.py [ROUNDS] [NEW_TOKENS] [BATCH]
"""
import sys

import torch

from flashtile.bench.e2e import build_model, decode_rates, qwen_config

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
batches = (int(sys.argv[3]),) if len(sys.argv) > 3 else (1,)
device = torch.device("cuda")
model = build_model(qwen_config(), device)
for batch in batches:
    result = decode_rates(model, device, batch, impls=("flashtile", "sdpa"), new_tokens=new_tokens,
                          reps=rounds)
    for impl, r in result.items():
        print(batch, impl, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})
