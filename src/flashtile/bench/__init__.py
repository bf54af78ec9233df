"""Benchmark commands behind ``python -m flashtile bench <name>``.

Each command is a module of this package with ``add_arguments(parser)`` and ``run(args) -> exit code``;
adding one (``train``, ``decode``) means adding its module and a line to COMMANDS. Modules are imported
only when their command runs, so choosing the Triton interpreter still happens before any kernel loads.
"""

from __future__ import annotations

COMMANDS = {
    "prefill": "forward (prefill) throughput: FlashAttention-2 paper sweep and the seed model's shape, "
               "against SDPA's flash and cuDNN backends and textbook attention",
    "train": "forward + backward (training) throughput: the prefill sweep and packed variable-length "
             "sequences, against SDPA's flash and cuDNN backends; backward correctness check first",
    "decode": "one-token decode against a KV cache as K+V GB/s (CUDA graph over many layers' caches, "
              "against a measured read ceiling), against SDPA's flash and cuDNN backends; decode and "
              "graph-replay checks first",
    "paged": "decode through a block table (page size 16, and 1 and 256 at one context) against the "
             "contiguous cache in the same run; decode and graph-replay checks first",
    "ring": "context-parallel (ring) attention over the host's GPUs (1, 2, 4, 8) against flashtile on one "
            "GPU over the whole sequence, as scaling efficiency; ring check first",
    "decode-fp8": "decode against an e4m3 KV cache (per-key descales) next to the bf16 cache, as GB/s "
                  "of what each reads against the measured read ceiling; FP8-cache check first",
    "fp8-accuracy": "FlashAttention-3's FP8 accuracy study (outliers; per-tensor, block scales, "
                    "Hadamard, both; bf16 for scale): output RMSE against float64",
    "e2e": "a whole decoder model in Hugging Face transformers (random weights): time to first token "
           "and decode tokens/s against transformers' sdpa and eager attention; teacher-forced accuracy "
           "check against fp32 first",
}
