"""Generate text with flashtile's attention inside Hugging Face transformers.

    python examples/generate.py                                   # tiny random model, no download
    python examples/generate.py --model Qwen/Qwen2.5-1.5B-Instruct --prompt "Why is the sky blue?"

Needs `pip install 'flashtile[transformers]'`. Without a CUDA GPU the kernels run through Triton's
interpreter (slow: only the tiny model is practical there).
"""

import argparse
import os

import torch

if not torch.cuda.is_available():  # must be decided before flashtile's kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashtile.integrations.transformers import register  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config  # noqa: E402

register()  # attn_implementation="flashtile" (importing the module already did; calling it is harmless)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model name or path (default: tiny random model)")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="flashtile",
                                                     dtype=torch.bfloat16).to(device)
        inputs = tokenizer(args.prompt, return_tensors="pt").to(device)
    else:
        tokenizer = None
        config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtile",
                                                 dtype=torch.bfloat16).to(device)
        ids = torch.tensor([list(args.prompt.encode("utf-8"))], device=device)  # bytes as token ids
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=0)
    new = out[0, inputs["input_ids"].shape[1]:]
    print(tokenizer.decode(new, skip_special_tokens=True) if tokenizer else new.tolist())


if __name__ == "__main__":
    main()
