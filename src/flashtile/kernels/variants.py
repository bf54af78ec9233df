"""The kernel variants flashtile ships, and ahead-of-time compilation of them for a GPU target.

CI has no GPU: ``triton.compile`` with a ``GPUTarget`` still runs the whole pipeline to a cubin, which
catches what the interpreter cannot (tl.dot shape limits, layouts, shared memory over the limit).
Run ``python -m flashtile.kernels.variants --arch 90`` without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from .forward import config_for_arch, head_dim_padded

_DTYPE_NAMES = {"fp16": "*fp16", "bf16": "*bf16"}

@dataclass(frozen=True)
class ForwardVariant:
    head_dim: int
    dtype: str = "bf16"
    has_left: bool = False
    has_right: bool = False
    softcap: bool = False
    alibi: bool = False
    tma: bool = False
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def name(self) -> str:
        flags = [f for f, on in (("left", self.has_left), ("right", self.has_right),
                                 ("softcap", self.softcap), ("alibi", self.alibi), ("tma", self.tma)) if on]
        return f"fwd-d{self.head_dim}-{self.dtype}" + ("-" + "-".join(flags) if flags else "")


def forward_variants() -> list[ForwardVariant]:
    """A representative set: every head-dim class and dtype, and each mask/bias feature.

    ``tma`` variants are the Hopper fast path; compile_forward drops it below sm_90. Odd head dims
    (strides not 16-byte multiples) always take the pointer path.
    """
    out = []
    for d in (16, 32, 64, 80, 111, 128, 192, 256):
        for dtype in ("fp16", "bf16"):
            tma = d % 8 == 0
            out.append(ForwardVariant(d, dtype, tma=tma))
            out.append(ForwardVariant(d, dtype, has_right=True, tma=tma))
            if tma:
                out.append(ForwardVariant(d, dtype, has_right=True))
    for d in (64, 128, 256):
        out += [ForwardVariant(d, "bf16", has_left=True, has_right=True, tma=True),
                ForwardVariant(d, "bf16", has_left=True, tma=True),
                ForwardVariant(d, "bf16", has_right=True, softcap=True, tma=True),
                ForwardVariant(d, "bf16", has_right=True, alibi=True, tma=True),
                ForwardVariant(d, "fp16", has_left=True, has_right=True, softcap=True, alibi=True,
                               tma=True)]
    return out


def compile_forward(variant: ForwardVariant, arch: int):
    """Compile one variant for sm_<arch>; returns the compiled kernel (with .metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .forward import _attn_fwd

    cfg = config_for_arch(variant.head_dim, arch)
    ptr = _DTYPE_NAMES[variant.dtype]
    signature, constexprs, attrs = {}, {}, {}
    values = {
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "HEAD_DIM": variant.head_dim,
        "HEAD_DIM_PAD": head_dim_padded(variant.head_dim), "HAS_LEFT": variant.has_left,
        "HAS_RIGHT": variant.has_right, "SOFTCAP": variant.softcap, "ALIBI": variant.alibi,
        "LONGEST_FIRST": variant.has_right, "UPCAST": False,
        "USE_TMA": variant.tma and arch >= 90,
    }
    for i, name in enumerate(_attn_fwd.arg_names):
        if name in values:
            signature[name] = "constexpr"
            constexprs[name] = values[name]
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = ptr
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("Lse", "Alibi"):
            if name == "Alibi" and not variant.alibi:
                signature[name] = "constexpr"
                constexprs[name] = None
            else:
                signature[name] = "*fp32"
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap_in"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # The JIT marks ints divisible by 16: all strides are, for contiguous tensors whose head
            # dim is a multiple of 16; for odd head dims assume none is (the slow, general case).
            if name.startswith("stride_") and variant.head_dim % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(_attn_fwd, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, action="append", help="e.g. 90 or 80 (repeatable)")
    parser.add_argument("--shard", default="0/1", help="K/N: compile every N-th variant from K")
    args = parser.parse_args(argv)
    shard, shards = (int(x) for x in args.shard.split("/"))
    failed = 0
    for arch in args.arch or [90, 80]:
        for variant in forward_variants()[shard::shards]:
            try:
                kernel = compile_forward(variant, arch)
                print(f"sm_{arch} {variant.name}: ok, shared memory {kernel.metadata.shared} B")
            except Exception as exc:  # report every failing variant, not only the first
                failed += 1
                print(f"sm_{arch} {variant.name}: FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
