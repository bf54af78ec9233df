"""FP8 (e4m3) quantization of Q, K, V with per-block scales and FlashAttention-3's incoherent
processing: a random orthogonal rotation of Q and K (a Hadamard matrix times a random +-1 diagonal),
which leaves every score q.k unchanged and spreads an outlier coordinate over all of them, so one
large entry no longer inflates its block's scale.

``quantize_qkv`` does the rotation (a fast Walsh-Hadamard transform, O(d log d) per row, in a Triton
kernel) and the quantization in one pass per tensor. Scales are per block of ``block`` consecutive
tokens of one (batch, head): the tile an attention kernel loads, so an outlier only costs precision
in its own block. ``dequantize`` inverts the quantization (not the rotation: attention on rotated Q
and K gives the same scores).

``attention`` runs the e4m3 forward on them: the Gluon kernel on sm_90 at head dim 128 (when the
scale blocks are whole tiles of it, see ``kernel_blocks``), the portable Triton kernel otherwise.
Quantization is tested on CPU (rotation and block scales); fp8 rounding itself is checked on a GPU
because Triton's interpreter rounds fp32 -> fp8 wrongly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kernels.forward import interpreting

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def random_signs(head_dim: int, seed: int, device) -> torch.Tensor:
    """The random +-1 diagonal of the rotation, float32 (head_dim,), reproducible from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randint(0, 2, (head_dim,), generator=gen) * 2 - 1).to(device=device, dtype=torch.float32)


def hadamard_matrix(head_dim: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix H / sqrt(d), float32 (d, d); d a power of two."""
    _check_power_of_two(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(head_dim)).to(device=device)


def _check_power_of_two(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {d}")


@triton.jit
def _walsh_hadamard(x, HEAD_DIM: tl.constexpr, LOG2_DIM: tl.constexpr, ROWS: tl.constexpr):
    """x (ROWS, HEAD_DIM) times the unnormalized Sylvester-Hadamard matrix, by log2(d) butterflies:
    the stage of width h pairs columns j and j + h inside blocks of 2h."""
    for stage in tl.static_range(LOG2_DIM):
        y = tl.reshape(x, (ROWS, HEAD_DIM >> (stage + 1), 2, 1 << stage))
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.join(a + b, a - b)
        y = tl.permute(y, (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, HEAD_DIM))
    return x


@triton.jit
def _rotate_quantize(X, Signs, Out, Scale, seqlen, stride_xb, stride_xs, stride_xh,
                     stride_ob, stride_os, stride_oh, stride_od, stride_sb, stride_sh,
                     BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, LOG2_DIM: tl.constexpr,
                     ROTATE: tl.constexpr, QUANTIZE: tl.constexpr, POW2_DESCALE: tl.constexpr = False):
    """One block of BLOCK tokens of one (batch, head): rotate (optional), then scale so the block's
    largest magnitude maps to E4M3_MAX (POW2_DESCALE: into (E4M3_MAX / 2, E4M3_MAX], the descale
    the power of two at or above amax / E4M3_MAX); stores the scaled values and the block's descale."""
    blk = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < seqlen
    x = tl.load(X + batch.to(tl.int64) * stride_xb + head.to(tl.int64) * stride_xh
                + rows[:, None].to(tl.int64) * stride_xs + cols[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    if ROTATE:
        x = x * tl.load(Signs + cols)[None, :]
        x = _walsh_hadamard(x, HEAD_DIM, LOG2_DIM, BLOCK) * (1.0 / tl.sqrt(HEAD_DIM * 1.0))
    descale = 1.0
    if QUANTIZE:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        descale = tl.where(amax > 0, amax / 448.0, 1.0)
        if POW2_DESCALE:  # exponent rounded up: mantissa bits carried into it, then cleared
            bits = descale.to(tl.int32, bitcast=True)
            descale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        x = x * (1.0 / descale)
        tl.store(Scale + batch.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh + blk, descale)
    tl.store(Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
             + rows[:, None].to(tl.int64) * stride_os + cols[None, :] * stride_od, x.to(Out.dtype.element_ty),
             mask=ok)


def _launch(x: torch.Tensor, signs, block: int, rotate: bool, quantize: bool, out_dtype,
            keys_contiguous: bool = False, pow2_descale: bool = False):
    """(out, descales); with ``keys_contiguous`` out is written transposed (see
    kernels.forward.keys_contiguous), the layout the FP8 forward reads V in; ``pow2_descale``: each
    block's descale a power of two (see _rotate_quantize)."""
    from .kernels.forward import empty_keys_contiguous
    batch, seqlen, heads, head_dim = x.shape
    _check_power_of_two(head_dim)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    blocks = -(-seqlen // block)
    # The interpreter rounds fp32 -> fp8 wrongly: store fp32 there and let torch round.
    store_dtype = torch.float32 if interpreting() and out_dtype == torch.float8_e4m3fn else out_dtype
    def empty(dtype):
        if keys_contiguous:
            return empty_keys_contiguous(x.shape, dtype, x.device)
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    out = empty(store_dtype)
    scale = torch.ones(batch, heads, max(blocks, 1), dtype=torch.float32, device=x.device)
    if x.numel():
        _rotate_quantize[(blocks, heads, batch)](
            x, signs, out, scale, seqlen, *x.stride()[:3], *out.stride(), *scale.stride()[:2],
            BLOCK=block, HEAD_DIM=head_dim, LOG2_DIM=head_dim.bit_length() - 1, ROTATE=rotate,
            QUANTIZE=quantize, POW2_DESCALE=pow2_descale)
    if store_dtype != out_dtype:
        out = empty(out_dtype).copy_(out)
    return out, scale


def rotate(x: torch.Tensor, signs: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x (B, S, H, D) times diag(signs) @ H / sqrt(D), in x's dtype: orthogonal, so rotating both Q
    and K leaves every score unchanged."""
    return _launch(x, signs, block, rotate=True, quantize=False, out_dtype=x.dtype)[0]


@dataclass
class FP8QKV:
    """FP8 tensors in flash_attn's layout and their per-block descales (multiply to dequantize):
    q_descale (B, H, ceil(Sq / block_q)), k_descale and v_descale (B, Hk, ceil(Sk / block_k)).
    quantize_qkv makes V's descales powers of two; other V descales work too, but their ratios
    round P's largest entries when the kernels cast P to e4m3 (see quantize_qkv)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    block_q: int
    block_k: int
    signs: torch.Tensor | None  # the rotation's diagonal, None without rotation


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: tuple[int, int] = (128, 128),
                 hadamard: bool = True, seed: int = 0) -> FP8QKV:
    """Quantize q (B, Sq, H, D), k and v (B, Sk, Hk, D) to float8_e4m3fn with one scale per block of
    ``block[0]`` queries / ``block[1]`` keys of each (batch, head); with ``hadamard`` rotate Q and K
    first (V is not rotated: it would rotate the output)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim)")
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape != v.shape:
        raise ValueError(f"q (B, Sq, H, D), k and v (B, Sk, Hk, D) must agree in B and D, k and v in "
                         f"shape: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q's {q.shape[2]} heads must be a multiple of k's {k.shape[2]}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError("q, k and v must be on one device")
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
        raise TypeError(f"block must be a pair of ints (queries, keys) per scale, got {block!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    block_q, block_k = block
    if torch.compiler.is_compiling():  # the registered op: Dynamo cannot trace the seeded draw or the launches
        from .ops import quantize_qkv_op
        *tensors, signs = quantize_qkv_op(q, k, v, block_q, block_k, hadamard, seed)
    else:
        *tensors, signs = _quantize_qkv(q, k, v, block_q, block_k, hadamard, seed)
    return FP8QKV(*tensors, block_q, block_k, signs if hadamard else None)


def _quantize_qkv(q, k, v, block_q: int, block_k: int, hadamard: bool, seed: int):
    """quantize_qkv on checked inputs: (q8, k8, v8, q_descale, k_descale, v_descale, signs)."""
    signs = random_signs(q.shape[-1], seed, q.device) if hadamard else torch.ones(q.shape[-1], device=q.device)
    fp8 = torch.float8_e4m3fn
    q8, q_descale = _launch(q, signs, block_q, hadamard, True, fp8)
    k8, k_descale = _launch(k, signs, block_k, hadamard, True, fp8)
    # V keys-contiguous: the layout the forward's second product reads (its shape stays (B, Sk, Hk, D)).
    # V's descales are powers of two: the kernels fold each block's, relative to the largest, into
    # P before P's cast to e4m3, and a power of two keeps a row's largest probability exact there
    # (0.6 x 1.0 rounds to 0.625; with one dominant key of a V outlier block, the output was off by
    # 4% of that key's value: fuzz-gpu-h200-20261202-seed10-fp8-before.json). In (224, 448] instead
    # of up to 448, the e4m3 values keep their 3 mantissa bits.
    v8, v_descale = _launch(v, signs, block_k, False, True, fp8, keys_contiguous=True, pow2_descale=True)
    return q8, k8, v8, q_descale, k_descale, v_descale, signs


def quantize_per_key(x: torch.Tensor, descale: torch.Tensor | None = None):
    """x (..., D) in e4m3 with one float32 descale per row (per key and head of a KV cache): returns
    (x8, descale (...)), each row's largest magnitude mapped to E4M3_MAX. With ``descale`` given
    (broadcastable to x's rows), x is quantized with it instead, saturating at E4M3_MAX. The layout
    ``flash_attn_with_kvcache`` reads an e4m3 cache in."""
    x = x.float()
    if descale is None:
        amax = x.abs().amax(-1)
        descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (x / descale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values of an FP8 tensor (B, S, H, D) with per-block descales (B, H, blocks)."""
    per_row = descale.repeat_interleave(block, dim=2)[:, :, :x8.shape[1]]  # (B, H, S)
    return x8.float() * per_row.transpose(1, 2).unsqueeze(-1)


def kernel_blocks(head_dim: int, device) -> tuple[int, int]:
    """The finest (query, key) scale blocks with which ``attention`` runs the fastest forward for
    this head dim on ``device`` (any multiple of them works too): the portable kernel's tile, and on
    an sm_90 GPU also the Gluon kernel's where it runs (64 query rows per consumer, 256-key tiles at
    d128 non-causal).
    Finer blocks that are still whole portable tiles are accepted and take the portable kernel."""
    from .kernels import gluon_forward
    from .kernels.forward import GLUON_ENABLED, pick_config
    device = torch.device(device)
    cfg = pick_config(head_dim, device, fp8=True)
    block_q, block_k = cfg.block_m, cfg.block_n
    if (GLUON_ENABLED and gluon_forward._GLUON and device.type == "cuda" and not interpreting()
            and head_dim in gluon_forward.FP8_HEAD_DIMS
            and torch.cuda.get_device_capability(device) == (9, 0)):
        gluon_n = max(gluon_forward.default_variant(head_dim, "fp8", c).block_n
                      for c in (False, True) if (head_dim, c) in gluon_forward.FP8_DISPATCH)
        block_q, block_k = math.lcm(block_q, 64), math.lcm(block_k, gluon_n)
    return block_q, block_k


def attention(x: FP8QKV, causal: bool = False, softmax_scale: float | None = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False, *,
              s_aux=None):
    """Attention on quantized tensors (``quantize_qkv``): scores from e4m3 Q and K, each tile's
    descales applied in fp32, P and V in e4m3 for the second product; bfloat16 output (B, Sq, H, D)
    and, with ``return_lse``, the LSE (B, H, Sq). Causal and windows align bottom-right as in
    flash_attn_func; GQA/MQA as there. The rotation needs no undoing: it leaves the scores as they were.
    ``s_aux`` (H,): attention sinks as in flash_attn_func (in the output and LSE; no gradient)."""
    from . import interface, ops
    q, k, v = x.q, x.k, x.v
    sinks = interface._check_sinks(s_aux, q, 4)
    if q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
    if x.k_descale.stride() != x.v_descale.stride():
        raise ValueError("k_descale and v_descale must share a layout")
    device = q.get_device()
    for name, d, heads, seqlen, block in (("q_descale", x.q_descale, q.shape[2], q.shape[1], x.block_q),
                                          ("k_descale", x.k_descale, k.shape[2], k.shape[1], x.block_k),
                                          ("v_descale", x.v_descale, k.shape[2], k.shape[1], x.block_k)):
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor")
        # (the kernels read the blocks of a row as contiguous, V's largest past its last one)
        want = (q.shape[0], heads, -(-seqlen // block) if block > 0 else -1)
        if d.shape != want or d.get_device() != device or (d.stride(-1) != 1 and d.numel()):
            raise ValueError(f"{name} must be {want} on {q.device} with its last dim contiguous (one "
                             f"descale per {block} tokens of each batch and head), got "
                             f"{tuple(d.shape)} strides {d.stride()} on {d.device}")
    left, right = window_size
    if causal:
        right = 0
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = ops.fp8_forward(q, k, v, x.q_descale, x.k_descale, x.v_descale, scale, int(left), int(right),
                               k.shape[1] - q.shape[1], float(softcap), None, x.block_q, x.block_k,
                               sinks=sinks)
    return (out, lse) if return_lse else out
