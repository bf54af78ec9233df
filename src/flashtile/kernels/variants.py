"""The kernel variants flashtile ships, and ahead-of-time compilation of them for a GPU target.

CI has no GPU: ``triton.compile`` with a ``GPUTarget`` still runs the whole pipeline to a cubin, which
catches what the interpreter cannot (tl.dot shape limits, layouts, shared memory over the limit).
Run ``python -m flashtile.kernels.variants --arch 90`` without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .forward import config_for_arch, head_dim_padded, small_shared_memory

_DTYPE_NAMES = {"fp16": "*fp16", "bf16": "*bf16", "fp8": "*fp8e4nv"}
# The most shared memory one CTA may have (cudaDevAttrMaxSharedMemoryPerBlockOptin): triton.compile
# does not check it; the launch fails with OutOfResources on the GPU. sm_89 stands for the GPUs of
# forward.SMALL_SHARED_MEMORY_ARCHS.
SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912, 89: 101376}
_FP32_POINTERS = ("Lse", "Alibi", "Delta", "dLse")
_FLOATS = ("qk_scale", "softcap_in", "softmax_scale", "dropout_p")


@dataclass(frozen=True)
class Variant:
    """One specialization: ``kind`` "fwd" (the forward), "bwd" (the backward's three kernels),
    "decode" (split-KV decode and combine), "rotary" (rotary + cache append; ``rotary_dim`` 0 is
    a plain append) or "sinks" (attention sinks on a finished output)."""
    head_dim: int
    dtype: str = "bf16"
    has_left: bool = False
    has_right: bool = False
    softcap: bool | int = False  # 2: its tanh by tanh.approx (a training step's, sm_90)
    alibi: bool = False
    tma: bool = False
    kind: str = "fwd"
    varlen: bool = False
    dropout: bool = False
    paged: bool = False
    rotary_dim: int = 0
    interleaved: bool = False
    fp8_cache: bool = False  # decode: e4m3 K/V cache with per-key descales, q in ``dtype``

    @property
    def name(self) -> str:
        flags = [f for f, on in (("left", self.has_left), ("right", self.has_right),
                                 ("softcap-approx" if self.softcap == 2 else "softcap", self.softcap),
                                 ("alibi", self.alibi), ("tma", self.tma),
                                 ("varlen", self.varlen), ("dropout", self.dropout),
                                 ("paged", self.paged), (f"rot{self.rotary_dim}", self.rotary_dim),
                                 ("interleaved", self.interleaved), ("fp8cache", self.fp8_cache)) if on]
        return f"{self.kind}-d{self.head_dim}-{self.dtype}" + ("-" + "-".join(flags) if flags else "")




def forward_variants() -> list[Variant]:
    """A representative set: every head-dim class and dtype, and each mask/bias feature.

    ``tma`` variants are the Hopper fast path; compile_forward drops it below sm_90. Odd head dims
    (strides not 16-byte multiples) always take the pointer path.
    """
    out = []
    for d in (16, 32, 64, 80, 111, 128, 192, 256):
        for dtype in ("fp16", "bf16"):
            tma = d % 8 == 0
            out.append(Variant(d, dtype, tma=tma))
            out.append(Variant(d, dtype, has_right=True, tma=tma))
            if tma:
                out.append(Variant(d, dtype, has_right=True))
    for d in (64, 128, 256):
        out += [Variant(d, "bf16", has_left=True, has_right=True, tma=True),
                Variant(d, "bf16", has_left=True, tma=True),
                Variant(d, "bf16", has_right=True, softcap=True, tma=True),
                Variant(d, "bf16", has_right=True, alibi=True, tma=True),
                Variant(d, "fp16", has_left=True, has_right=True, softcap=True, alibi=True, tma=True)]
        out += [Variant(d, "bf16", has_right=True, tma=True, varlen=True),
                Variant(d, "fp16", varlen=True),
                Variant(d, "bf16", has_right=True, tma=True, dropout=True),
                Variant(d, "bf16", has_right=True, varlen=True, paged=True)]
    out += [Variant(128, "bf16", has_right=True, softcap=2, tma=True), Variant(96, "fp16", softcap=2)]
    return out


def backward_variants() -> list[Variant]:
    out = []
    for d in (32, 64, 80, 128, 256):
        out += [Variant(d, "bf16", kind="bwd"), Variant(d, "fp16", has_right=True, kind="bwd")]
    for d in (64, 128):
        out += [Variant(d, "bf16", has_left=True, has_right=True, kind="bwd"),
                Variant(d, "bf16", has_right=True, softcap=True, alibi=True, kind="bwd")]
    out.append(Variant(111, "fp16", has_left=True, has_right=True, softcap=True, alibi=True, kind="bwd"))
    out += [Variant(128, "bf16", has_right=True, varlen=True, kind="bwd"),
            Variant(64, "fp16", varlen=True, kind="bwd"),
            Variant(128, "bf16", has_right=True, softcap=2, kind="bwd"), Variant(96, "fp16", softcap=2, kind="bwd")]
    return out


def _compile(fn, values: dict, variant: Variant, arch: int, num_warps: int, num_stages: int,
             pointer_types: dict | None = None, **options):
    """triton.compile one kernel with the signature and divisibility hints the JIT would use;
    ``pointer_types`` overrides the element type of named pointers (e.g. {"dQ": "*fp32"}), a pointer
    given as None in ``values`` is one the launch leaves out, and ``options`` go to the compiler
    (e.g. enable_fp_fusion)."""
    pointer_types = pointer_types or {}
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr and name not in values:
            raise KeyError(f"{fn.__name__}: no value for constexpr {name}")
        if name in values:
            signature[name] = "constexpr"
            constexprs[name] = values[name]
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "Alibi" and not variant.alibi:
            signature[name] = "constexpr"
            constexprs[name] = None
        elif name == "stride_vd" and not values.get("FP8"):
            signature[name] = "constexpr"  # 1: the JIT specializes it (V's head dim is contiguous)
            constexprs[name] = 1
        elif name == "stride_vs" and values.get("FP8") == 1:
            signature[name] = "constexpr"  # 1: e4m3 V is stored with the keys contiguous (not a cache)
            constexprs[name] = 1
        elif name in ("QDescale", "KDescale", "VDescale"):
            if values.get("FP8") and not (name == "QDescale" and values.get("Q_DESCALE") is False):
                signature[name] = "*fp32"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name == "Sinks" and "SINKS" in fn.arg_names:  # attention sinks: float32 logits, if taken
            if values.get("SINKS"):
                signature[name] = "*fp32"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name.startswith("CuSeqlens"):
            if variant.varlen:
                signature[name] = "*i32"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name == "BlockTable":
            if variant.paged:
                signature[name] = "*i32"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name == "DropoutSeed":
            if variant.dropout:
                signature[name] = "*i64"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name == "dLse":
            signature[name] = "constexpr"  # the common case: no gradient on the LSE
            constexprs[name] = None
        elif name in ("CacheSeqlens", "CacheBatchIdx", "CacheLeftpad"):
            used = {"CacheSeqlens": True, "CacheBatchIdx": values.get("BATCH_IDX"),
                    "CacheLeftpad": values.get("LEFTPAD")}[name]
            if used:
                signature[name] = "*i32"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name in ("OutPart", "LsePart") or (fn.__name__ in ("_combine", "_combine_stream")
                                                and name == "Lse"):
            signature[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name[0].isupper() or name.startswith("d") and name[1:2].isupper():
            signature[name] = _DTYPE_NAMES[variant.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # The JIT marks ints divisible by 16: all strides are, for contiguous tensors whose head
            # dim is a multiple of 16; for odd head dims assume none is (the slow, general case).
            if name.startswith("stride_") and variant.head_dim % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def _flags(variant: Variant) -> dict:
    return {"HEAD_DIM": variant.head_dim, "HEAD_DIM_PAD": head_dim_padded(variant.head_dim),
            "HAS_LEFT": variant.has_left, "HAS_RIGHT": variant.has_right,
            "SOFTCAP": variant.softcap, "ALIBI": variant.alibi, "UPCAST": False,
            "VARLEN": variant.varlen, "DROPOUT": variant.dropout, "PAGED": variant.paged}


def compile_forward(variant: Variant, arch: int, sinks: bool = False):
    """Compile one forward variant for sm_<arch>; returns the compiled kernel (with .metadata).
    ``sinks``: with the attention sinks' epilogue."""
    from .forward import _attn_fwd

    cfg = config_for_arch(variant.head_dim, arch)
    values = {**_flags(variant), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
              "LONGEST_FIRST": variant.has_right, "USE_TMA": variant.tma and arch >= 90,
              "FP8": False, "SCALE_BLOCK_Q": 1, "SCALE_BLOCK_K": 1, "SINKS": sinks}
    return _compile(_attn_fwd, values, variant, arch, cfg.num_warps, cfg.num_stages)


def compile_backward(variant: Variant, arch: int) -> list:
    """Compile the backward's preprocess, its dK/dV kernel in both modes (atomic dQ into float32,
    the default; and without, for deterministic=True) and the separate dQ kernel."""
    from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, backward_config_for_arch

    cfg = backward_config_for_arch(variant.head_dim, arch)
    flags = _flags(variant)
    # As the launcher decides: descriptors on Hopper when rows are 16-byte multiples.
    tma = {"USE_TMA": cfg.use_tma and arch >= 90 and variant.head_dim % 8 == 0}
    pre = {"BLOCK_M": 64, "HEAD_DIM": flags["HEAD_DIM"], "HEAD_DIM_PAD": flags["HEAD_DIM_PAD"],
           "HAS_DLSE": False, "VARLEN": variant.varlen}
    # Packed sequences on sm_90 also run it with ALIGNED (the LSE/Delta rows the Gluon backward reads)
    aligned = ([_compile(_attn_bwd_preprocess, {**pre, "ALIGNED": True}, variant, arch, 4, 1,
                         {"AlignedLse": "*fp32", "AlignedDelta": "*fp32"})]
               if variant.varlen and arch >= 90 else [])
    return aligned + [
        _compile(_attn_bwd_preprocess, {**pre, "ALIGNED": False, "AlignedLse": None, "AlignedDelta": None},
                 variant, arch, 4, 1),
        _compile(_attn_bwd_dkdv, {**flags, **tma, "BLOCK_M": cfg.dkdv_block_m,
                                  "BLOCK_N": cfg.dkdv_block_n, "ATOMIC_DQ": True},
                 variant, arch, cfg.num_warps, cfg.num_stages, {"dQ": "*fp32"}),
        _compile(_attn_bwd_dkdv, {**flags, **tma, "BLOCK_M": cfg.dkdv_block_m,
                                  "BLOCK_N": cfg.dkdv_block_n, "ATOMIC_DQ": False},
                 variant, arch, cfg.num_warps, cfg.num_stages),
        _compile(_attn_bwd_dq, {**flags, **tma, "BLOCK_M": cfg.dq_block_m, "BLOCK_N": cfg.dq_block_n,
                                "LONGEST_FIRST": variant.has_right},
                 variant, arch, cfg.dq_num_warps or cfg.num_warps,
                 cfg.dq_num_stages or cfg.num_stages),
    ]


def decode_variants() -> list[Variant]:
    out = [Variant(128, "bf16", has_right=True, kind="decode"), Variant(64, "fp16", kind="decode"),
           Variant(128, "bf16", has_right=True, paged=True, kind="decode"),
           Variant(256, "bf16", has_left=True, has_right=True, softcap=True, alibi=True, kind="decode"),
           Variant(80, "fp16", has_right=True, paged=True, kind="decode"),
           Variant(128, "bf16", has_right=True, kind="decode", fp8_cache=True),
           Variant(128, "bf16", has_right=True, paged=True, kind="decode", fp8_cache=True),
           # e4m3 pools past head dim 128: the wide-rows plan's 64-key steps (decode.WIDE_E4M3_PAGED_BLOCK_N)
           Variant(256, "bf16", has_right=True, paged=True, kind="decode", fp8_cache=True)]
    return out


def compile_decode(variant: Variant, arch: int) -> list:
    """Compile the split-KV decode kernel (8 query heads per KV head, one query) writing partials
    and writing the output directly (one split; its LSE on the paged variants only, as a call
    without return_softmax_lse), the combine kernel that merges partials, and the split kernel with
    128-row tiles."""
    from .decode import STREAM_CONFIG, _attn_decode, _combine, _combine_stream, _wide_rows_config

    flags = {k: v for k, v in _flags(variant).items() if k not in ("VARLEN", "DROPOUT")}
    # cache_batch_idx and cache_leftpad ride along on the contiguous variants
    decode = {**flags, "PAGED": 2 if variant.paged else 0, "ROWS": 16, "ROW_BLOCKS": False, "BLOCK_N": 64,
              "PAGE_SHIFT": -1, "BATCH_IDX": not variant.paged,
              "LEFTPAD": not variant.paged, "EMPTY_LSE": float("inf"), "PDL": arch >= 90,
              "FP8": (3 if arch >= 89 else 2) if variant.fp8_cache else 0, "Q_FP16": variant.fp8_cache and variant.dtype == "bf16",
              "Q_DESCALE": False, "SEQ_DS": False, "STREAM": False, "BLOCK_B": 1, "WARPS": 0,
              "SINKS": False}
    cache = {"K": "*fp8e4nv", "V": "*fp8e4nv"} if variant.fp8_cache else None
    comb = {"SPLITS_PAD": 16, "HEAD_DIM": flags["HEAD_DIM"], "HEAD_DIM_PAD": flags["HEAD_DIM_PAD"],
            "EMPTY_LSE": float("inf"), "SINKS": False}
    stages = 3 if variant.paged else 2
    # Hopper plans of contiguous caches run 2-warp split programs up to head dim 128: 64-key steps on
    # e4m3 caches, 32-key steps on 16-bit ones, 3 stages.
    split_tiles = {}
    warps, split_stages = 4, stages
    if arch == 90 and not variant.paged and variant.head_dim <= 128:
        warps, split_stages = 2, 3
        split_tiles = {} if variant.fp8_cache else {"BLOCK_N": 32}
    # Paged: the split kernel with 16-key pages (a table entry per key), the unsplit one with
    # 256-key pages (one entry per tile).
    split_pages = {"PAGE_SHIFT": 4} if variant.paged else {}
    whole_pages = {"PAGED": 3, "PAGE_SHIFT": 8} if variant.paged else {}
    wide = _wide_rows_config(variant.paged, variant.head_dim, variant.fp8_cache)
    fp8_query = []
    if variant.fp8_cache:  # FlashAttention-3's FP8 call: an e4m3 query with its (B, Hk) descales
        fp8_query = [_compile(_attn_decode, {**decode, **split_pages, **split_tiles, "SPLIT": True,
                                             "WRITE_LSE": True, "Q_FP16": True, "Q_DESCALE": True},
                              variant, arch, warps, split_stages, {**cache, "Q": "*fp8e4nv"})]
        if arch >= 89:  # 33-64 query rows on sm_90: 64-row tiles, 128-key steps, one stage, the
            # query as two e4m3 terms (decode.FP8_SPLIT_Q_ROWS64)
            fp8_query.append(_compile(_attn_decode, {**decode, **split_pages, "ROWS": 64, "BLOCK_N": 128,
                                                     "SPLIT": True, "WRITE_LSE": True, "FP8": 4},
                                      variant, arch, 4, 1, cache))
            # FlashAttention-3's (B, Hk) descales on pages or through cache_batch_idx: per sequence
            fp8_query.append(_compile(_attn_decode, {**decode, **split_pages, "ROWS": 64, "BLOCK_N": 128,
                                                     "SPLIT": True, "WRITE_LSE": True, "FP8": 4,
                                                     "SEQ_DS": True},
                                      variant, arch, 4, 1, cache))
    return fp8_query + [
            _compile(_attn_decode, {**decode, **split_pages, **split_tiles, "SPLIT": True, "WRITE_LSE": True},
                     variant, arch, warps, split_stages, cache),
            _compile(_attn_decode, {**decode, **whole_pages, "SPLIT": False, "WRITE_LSE": variant.paged},
                     variant, arch, 4, stages, cache),
            # attention sinks: the unsplit kernel's epilogue, the merge of split plans
            _compile(_attn_decode, {**decode, **whole_pages, "SPLIT": False, "WRITE_LSE": True, "SINKS": True},
                     variant, arch, 4, stages, cache),
            _compile(_combine, {**comb, "PDL": arch >= 90, "LAUNCH_DEPENDENTS": arch >= 90, "SINKS": True},
                     variant, arch, 4, 1),
            _compile(_combine, {**comb, "PDL": arch >= 90, "LAUNCH_DEPENDENTS": False}, variant, arch, 4, 1),
            # (after the 16-bit Gluon plans of one CTA per SM)
            _compile(_combine, {**comb, "PDL": arch >= 90, "LAUNCH_DEPENDENTS": arch >= 90}, variant, arch,
                     4, 1),
            # stream-K (decode.STREAM_CONFIG): each program a share of every pair's key tiles
            # (batches up to 64), its merge
            _compile(_attn_decode, {**decode, **split_pages, "BLOCK_N": STREAM_CONFIG.block_n, "SPLIT": True,
                                    "WRITE_LSE": True, "STREAM": True, "BLOCK_B": 64},
                     variant, arch, STREAM_CONFIG.num_warps, STREAM_CONFIG.num_stages, cache),
            _compile(_combine_stream, {k: decode[k] for k in ("HAS_LEFT", "HAS_RIGHT", "LEFTPAD")}
                     | {"ROWS": 16, "BLOCK_N": 64, "BLOCK_B": 64, "SPLITS_PAD": 16,
                        "HEAD_DIM": flags["HEAD_DIM"], "HEAD_DIM_PAD": flags["HEAD_DIM_PAD"],
                        "EMPTY_LSE": float("inf"), "WRITE_LSE": True, "PDL": arch >= 90, "SINKS": False},
                     variant, arch, 1, 1),
            # ... with attention sinks: the segments that are a whole pair, and the merge
            _compile(_attn_decode, {**decode, **split_pages, "BLOCK_N": STREAM_CONFIG.block_n, "SPLIT": True,
                                    "WRITE_LSE": True, "STREAM": True, "BLOCK_B": 64, "SINKS": True},
                     variant, arch, STREAM_CONFIG.num_warps, STREAM_CONFIG.num_stages, cache),
            _compile(_combine_stream, {k: decode[k] for k in ("HAS_LEFT", "HAS_RIGHT", "LEFTPAD")}
                     | {"ROWS": 16, "BLOCK_N": 64, "BLOCK_B": 64, "SPLITS_PAD": 16,
                        "HEAD_DIM": flags["HEAD_DIM"], "HEAD_DIM_PAD": flags["HEAD_DIM_PAD"],
                        "EMPTY_LSE": float("inf"), "WRITE_LSE": True, "PDL": arch >= 90, "SINKS": True},
                     variant, arch, 1, 1),
            # more than 64 query rows a KV head (decode._wide_rows_config's plan): 128-row tiles, 8
            # warps, blocks of them (chunked prefill)
            _compile(_attn_decode, {**decode, **split_pages, "ROWS": 128, "ROW_BLOCKS": True, "SPLIT": True,
                                    "WRITE_LSE": True,
                                    # e4m3: the query's two e4m3 terms (decode.FP8_SPLIT_Q_WIDE)
                                    **({"FP8": 4} if wide.fp8_split_q and arch >= 89 else {}),
                                    "BLOCK_N": wide.block_n, "PDL": arch >= 90 and wide.pdl},
                     variant, arch, wide.num_warps, wide.num_stages, cache)]


# decode_plan_kernels' grid: the calls whose plans it collects
_PLAN_GRID = dict(batch=(1, 4, 16, 64, 128), heads=((32, 8), (48, 8), (12, 2), (8, 8)), seqlen_q=(1, 4, 8, 16, 40),
                  head_dim=(128, 256), page=(0, 1, 16, 256), fp8_cache=(False, True),
                  capacity=(1024, 131072), one_launch=(False, True))
# the constexprs and options that size the decode kernel's shared memory (PAGED: whether, not how)
_PLAN_SHAPE = ("BLOCK_N", "HEAD_DIM_PAD", "ROWS", "num_stages", "num_warps", "FP8", "PAGED", "STREAM", "WARPS")


def decode_plan_kernels(arch: int, sms: int = 132) -> list[tuple[str, dict]]:
    """The Triton decode kernels decode.decode_config's plans launch on an sm_<arch> GPU of ``sms``
    SMs over a grid of calls (batch, heads, query length, head dim 128/256, contiguous or pages of
    1/16/256, 16-bit or e4m3 caches, short or long caches, eager or captured, with and without the
    stream-K opt-in): one (the call, the constexprs with num_warps/num_stages) per distinct
    shared-memory shape, from decode._plan as a call would run it (the Gluon kernel left out)."""
    import itertools
    from unittest import mock

    import torch

    from . import decode
    g = _PLAN_GRID
    found: dict = {}
    with mock.patch.object(decode, "_arch", lambda index: arch), \
            mock.patch.object(decode, "_sm_count", lambda device: sms), \
            mock.patch.object(decode, "interpreting", lambda: False), \
            mock.patch.object(decode, "STREAM_PLANS", False):
        for stream, b, (h, hk), sq, d, page, fp8, cap, one in itertools.product((False, True), *g.values()):
            decode.STREAM_PLANS = stream  # (FLASHTILE_DECODE_STREAM=1's opt-in plans too)
            if fp8 and arch < 89:
                continue
            kernel = decode._plan(b, sq, h, hk, d, torch.bfloat16, torch.device("cuda", 0), bool(page), cap, 0,
                                  None, False, False, False, False, False, False, fp8, one, False,
                                  page or 1, gluon_ok=False, causal=True)[2]
            key = tuple(bool(kernel[k]) if k == "PAGED" else kernel[k] for k in _PLAN_SHAPE)
            call = f"B{b} {h}/{hk} Sq{sq} d{d} {'page ' + str(page) if page else 'contiguous'}" \
                   f"{' e4m3' if fp8 else ''} {cap} keys{' eager' if one else ''}{' stream-K' if stream else ''}"
            found.setdefault(key, (call, dict(kernel)))
    return list(found.values())


def compile_decode_plan(kernel: dict, arch: int):
    """Compile one of decode_plan_kernels' kernels for sm_<arch>."""
    from .decode import _attn_decode

    values = dict(kernel)
    warps, stages = values.pop("num_warps"), values.pop("num_stages")
    values.pop("launch_pdl", None)
    variant = Variant(values["HEAD_DIM"], "bf16", kind="decode", paged=values["PAGED"] > 0,
                      fp8_cache=values["FP8"] > 0)
    cache = {"K": "*fp8e4nv", "V": "*fp8e4nv"} if values["FP8"] else None
    return _compile(_attn_decode, values, variant, arch, warps, stages, cache)


def rotary_variants() -> list[Variant]:
    """Both rotary styles, full and partial rotary dims, paged and contiguous caches, and a plain append."""
    return [Variant(128, "bf16", kind="rotary", rotary_dim=128),
            Variant(128, "bf16", kind="rotary", rotary_dim=64, interleaved=True, paged=True),
            Variant(64, "fp16", kind="rotary", rotary_dim=64, interleaved=True),
            Variant(80, "fp16", kind="rotary", rotary_dim=64, paged=True),
            Variant(256, "bf16", kind="rotary", rotary_dim=128),
            Variant(40, "fp16", kind="rotary", rotary_dim=40, interleaved=True),
            Variant(128, "bf16", kind="rotary", paged=True)]


def compile_rotary(variant: Variant, arch: int) -> list:
    """Compile the rotary + append kernel as a decode step of 32 query heads launches it."""
    from .rotary import _rotate_and_append, heads_per_program, tile_extents

    rotary = variant.rotary_dim > 0
    values = {"BLOCK_H": heads_per_program(32, variant.head_dim), "HEAD_DIM": variant.head_dim,
              "ROTARY_DIM": variant.rotary_dim, **tile_extents(variant.head_dim, variant.rotary_dim),
              "INTERLEAVED": variant.interleaved, "Q_CONSECUTIVE": True, "ROTATE_Q": rotary,
              "APPEND": True, "PAGED": variant.paged, "BATCH_IDX": not variant.paged,
              "LEFTPAD": not variant.paged, "ROUND_BF16_BY_HAND": False, "KEYS_ONLY": False}
    if not rotary:
        values.update(QOut=None, Cos=None, Sin=None)
    # The launch turns FMA contraction off (each product rounded, as the torch formulation is).
    return [_compile(_rotate_and_append, values, variant, arch, 4, 1, enable_fp_fusion=False)]


def fp8_variants() -> list[Variant]:
    """The rotate-and-quantize kernel of flashtile.fp8 at the head dims the rotation takes, and the
    forward on e4m3 inputs (kind "fp8" with dtype "fp8")."""
    quantize = [Variant(d, dtype, kind="fp8") for d in (64, 128, 256) for dtype in ("bf16", "fp16")]
    forward = [Variant(d, "fp8", has_right=causal, tma=True, kind="fp8")
               for d in (64, 128, 256) for causal in (False, True)]
    # flash_attn_varlen_func on e4m3 (one descale per sequence), contiguous or on page pools
    varlen = [Variant(d, "fp8", has_right=True, varlen=True, paged=paged, kind="fp8")
              for d in (128, 256) for paged in (False, True)]
    varlen.append(Variant(128, "fp8", has_right=True, varlen=True, tma=True, kind="fp8"))
    return quantize + forward + varlen + [
        Variant(128, "fp8", has_left=True, has_right=True, softcap=True, kind="fp8")]


def compile_fp8(variant: Variant, arch: int) -> list:
    from ..fp8 import _rotate_quantize

    d = variant.head_dim
    if variant.dtype == "fp8":  # the forward kernel on e4m3 Q, K, V with per-tile descales
        from .forward import _attn_fwd, sequence_fp8_config_for_arch
        # varlen without TMA: one descale per sequence (forward.sequence_fp8_mode's pick on GPUs
        # with e4m3 tensor cores); otherwise block descales (FP8 == 1; packed V^T with
        # FLASHTILE_VARLEN_FP8_BY_SEQUENCE=0)
        if variant.varlen and not variant.tma:
            cfg = sequence_fp8_config_for_arch(d, arch, variant.paged)
            mode = 4 if head_dim_padded(d) >= 32 else 3
        else:
            cfg, mode = config_for_arch(d, arch, fp8=True), 1
        values = {**_flags(variant), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "LONGEST_FIRST": variant.has_right, "USE_TMA": variant.tma and arch >= 90,
                  "FP8": mode, "SCALE_BLOCK_Q": cfg.block_m, "SCALE_BLOCK_K": cfg.block_n, "SINKS": False}
        return [_compile(_attn_fwd, values, variant, arch, cfg.num_warps, cfg.num_stages,
                         pointer_types={"Out": "*bf16"})]
    if variant.dtype == "bf16":  # e4m3 bytes copied keys-contiguous / gathered from page pools
        kernels = compile_copy_keys(d, arch)
    else:
        kernels = []
    values = {"BLOCK": 128, "HEAD_DIM": d, "LOG2_DIM": d.bit_length() - 1, "QUANTIZE": True}
    # Q and K rotated; V not, with power-of-two descales (quantize_qkv)
    return kernels + [
        _compile(_rotate_quantize, {**values, "ROTATE": rotate, "POW2_DESCALE": not rotate}, variant, arch,
                 4, 1, pointer_types={"Signs": "*fp32", "Out": "*fp8e4nv", "Scale": "*fp32"})
        for rotate in (True, False)]


def compile_copy_keys(head_dim: int, arch: int) -> list:
    """forward._copy_keys in the four forms its launches take (keys_contiguous, packed V^T, rows
    gathered from page pools into packed rows and into a contiguous cache; e4m3 moved as bytes) and
    the packed V^T's _zero_after_last."""
    import triton
    from .forward import _COPY_BLOCK_K, PACKED_TAIL, _copy_keys, _zero_after_last
    variant = Variant(head_dim, "bf16", kind="fp8")
    pointers = {"X": "*u8", "Out": "*u8", "CuSeqlens": "*i32", "BlockTable": "*i32"}
    kernels = []
    for packed, paged, transposed in ((False, False, True), (True, False, True), (True, True, False),
                                      (False, True, False)):
        values = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_K": _COPY_BLOCK_K,
                  "PACKED": packed, "PAGED": paged, "TRANSPOSED": transposed,
                  "stride_xd": 1}  # the JIT specializes unit strides
        values["stride_ot" if transposed else "stride_od"] = 1
        kernels.append(_compile(_copy_keys, values, variant, arch, 4, 3, pointer_types=pointers))
    values = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "TAIL": PACKED_TAIL}
    kernels.append(_compile(_zero_after_last, values, variant, arch, 4, 3, pointer_types=pointers))
    return kernels


def sinks_variants() -> list[Variant]:
    """The in-place attention-sinks pass, the sinks' gradient and the portable forward with the sinks in
    its epilogue (kind "sinks") on 16-bit outputs, odd head dims too."""
    return [Variant(64, "bf16", kind="sinks"), Variant(128, "fp16", kind="sinks"),
            Variant(111, "bf16", kind="sinks")]


def compile_sinks(variant: Variant, arch: int) -> list:
    from .sinks import BLOCK_ROWS, _apply_sinks, _sink_grad

    values = {"BLOCK_ROWS": BLOCK_ROWS, "HEAD_DIM": variant.head_dim,
              "HEAD_DIM_PAD": head_dim_padded(variant.head_dim)}
    return [_compile(_apply_sinks, values, variant, arch, 4, 1),
            _compile(_sink_grad, {**values, "HAS_DLSE": True}, variant, arch, 4, 1,
                     pointer_types={"DLse": "*fp32", "Partial": "*fp32"}),
            compile_forward(Variant(variant.head_dim, variant.dtype, has_right=True, tma=arch >= 90), arch,
                            sinks=True)]


def all_variants() -> list[Variant]:
    return (forward_variants() + backward_variants() + decode_variants() + rotary_variants()
            + fp8_variants() + sinks_variants())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, action="append", help="e.g. 90 or 80 (repeatable)")
    parser.add_argument("--shard", default="0/1", help="K/N: compile every N-th variant from K")
    parser.add_argument("--decode-plans", action="store_true",
                        help="the decode kernels of decode_config's plans over a grid of calls instead")
    parser.add_argument("--min-head-dim", type=int, default=0,
                        help="only variants of at least this head dim (the ones near a GPU's shared memory); "
                             "e4m3 ones at every head dim (sm_80, whose tiles the others share, has none)")
    args = parser.parse_args(argv)
    shard, shards = (int(x) for x in args.shard.split("/"))
    failed = 0
    for arch in args.arch or [90, 80]:
        limit = SHARED_MEMORY_LIMIT.get(arch)
        if args.decode_plans:
            for call, kernel in decode_plan_kernels(arch)[shard::shards]:
                shape = {k: kernel[k] for k in _PLAN_SHAPE}
                try:
                    shared = compile_decode_plan(kernel, arch).metadata.shared
                    state = "ok" if limit is None or shared <= limit else f"FAILED shared memory over {limit} B"
                except Exception as exc:
                    shared, state = "-", f"FAILED {type(exc).__name__}: {exc}"
                failed += state != "ok"
                print(f"sm_{arch} decode plan of {call} {shape}: {state}, shared memory {shared} B")
            continue
        picked = [v for v in all_variants()
                  if v.head_dim >= args.min_head_dim or v.kind == "fp8" or v.fp8_cache]
        for variant in picked[shard::shards]:
            if (variant.kind == "fp8" or variant.fp8_cache) and arch < 89:  # e4m3 needs sm_89+
                continue
            if variant.kind == "decode" and small_shared_memory(arch):
                # compile_decode's set is sm_80/sm_90's; the kernels these GPUs' plans launch are
                # compiled by --decode-plans
                continue
            try:
                if variant.kind == "fwd":
                    kernels = [compile_forward(variant, arch)]
                elif variant.kind == "bwd":
                    kernels = compile_backward(variant, arch)
                elif variant.kind == "rotary":
                    kernels = compile_rotary(variant, arch)
                elif variant.kind == "fp8":
                    kernels = compile_fp8(variant, arch)
                elif variant.kind == "sinks":
                    kernels = compile_sinks(variant, arch)
                else:
                    kernels = compile_decode(variant, arch)
                shared = ", ".join(str(k.metadata.shared) for k in kernels)
                over = [k.metadata.shared for k in kernels if limit and k.metadata.shared > limit]
                if over:
                    failed += 1
                    print(f"sm_{arch} {variant.name}: FAILED shared memory {shared} B, over {limit} B")
                    continue
                print(f"sm_{arch} {variant.name}: ok, shared memory {shared} B")
            except Exception as exc:  # report every failing variant, not only the first
                failed += 1
                print(f"sm_{arch} {variant.name}: FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
