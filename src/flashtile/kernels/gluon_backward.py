"""Hopper (sm_90) dK/dV kernel of the backward in Gluon, FlashAttention-3's layout.

One CTA owns 2 x 64 keys of one (batch, KV head): each of two consumer warpgroups keeps its 64 K and
V rows in shared memory and its dK, dV accumulators (64 x head dim, fp32) in registers. A 1-warp
producer streams the (Q, dO) tiles of every query head of the group and every query block that sees
the keys through a ring of shared-memory slots by TMA; both consumers read each slot, then free it.
Per query tile, in each consumer:

    S^T  = K Q^T        (wgmma, both operands in shared memory)
    dP^T = V dO^T       (wgmma, in flight with the first)
    P^T  = exp2(S^T * scale * log2(e) - LSE * log2(e))      (causal mask on the diagonal tiles)
    dS^T = P^T * (dP^T - Delta)
    dV  += P^T dO,  dK += dS^T Q     (wgmma with P^T / dS^T as register A operands)

dQ stays with the portable kernel's separate pass (no atomics: the backward stays deterministic).
Rows past the query sequence come in as zeros (TMA) with LSE +inf, so P is 0 there; keys past the
key sequence give rows of dK/dV that the TMA store clips. The causal diagonal is bottom-right, as
in the forward.

This module imports on machines without a GPU; ``compile_for_sm90`` builds the cubin there.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .gluon_forward import _GLUON, _Descriptor, _smem_layout, _tma_ok, qkv_shapes_ok
from .launch import launch

if _GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class GluonBackwardVariant:
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    block_m: int = 64  # query rows per streamed tile
    stages: int = 2  # (Q, dO) slots in the ring
    consumer_regs: int = 240
    producer_regs: int = 24
    overlap: bool = False  # a tile's dV/dK wgmmas run on under the next tile's S and dP issue
    max_stack: int = 0  # stack bytes (register spills) the compile check accepts

    @property
    def block_n(self) -> int:
        return 128  # 2 consumer warpgroups x 64 keys

    @property
    def name(self) -> str:
        return (f"gluon-bwd-d{self.head_dim}-{self.dtype}-{'causal' if self.causal else 'full'}"
                f"-m{self.block_m}-s{self.stages}{'-overlap' if self.overlap else ''}")


@functools.lru_cache(maxsize=None)
def default_variant(head_dim: int, dtype: str, causal: bool) -> GluonBackwardVariant:
    # d128: dK, dV (64 regs each), S and dP (32 each), LSE and Delta (16 each) per thread leave
    # ptxas a few spills at 240 registers (40-104 stack bytes); 32-row tiles do not spill but ran
    # 6-10% slower (gluon-bwd-check-h200-20261130-a.json).
    if head_dim <= 64:
        return GluonBackwardVariant(head_dim, dtype, causal, stages=3)
    return GluonBackwardVariant(head_dim, dtype, causal, stages=2, max_stack=128)


# Benchmarks may set a variant here for the calls that name none (attention_backward's).
_VARIANT_OVERRIDE: GluonBackwardVariant | None = None

GLUON_BACKWARD_VARIANTS = [default_variant(d, dt, c) for d in HEAD_DIMS for dt in ("bf16", "fp16")
                           for c in (False, True)]


if _GLUON:

    @gluon.constexpr_function
    def _acc_layout(instr_n):
        # Accumulator of an M = 64 wgmma over one warpgroup (4 warps), instruction n = instr_n.
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, instr_n, 16])

    @gluon.jit
    def _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr):
        """Query blocks that see keys [n0, n0 + BLOCK_N): [m_lo, num_m); from m_full on, every row of
        a block sees every one of those keys (causal); before it the diagonal mask applies."""
        num_m = (seqlen_q + BLOCK_M - 1) // BLOCK_M
        if CAUSAL:
            diag = seqlen_k - seqlen_q
            m_lo = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, num_m)
            m_full = gl.minimum((gl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M, num_m)
        else:
            m_lo = num_m * 0
            m_full = m_lo
        return m_lo, m_full, num_m

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, q_bufs, do_bufs, ready, empty, batch, kv_head, group_size,
                      m_lo, num_m, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The 1-warp load partition: (Q, dO) of query block m of query head g, for g over the group
        and m over [m_lo, num_m), in the consumers' order, at most STAGES tiles ahead of them."""
        n_m = num_m - m_lo
        for it in range(group_size * n_m):
            head = kv_head * group_size + it // n_m
            row0 = (m_lo + it % n_m) * BLOCK_M
            slot = it % STAGES
            # Empty barriers start in phase 0: parity 1 passes at once on the first lap.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch, row0, head, 0], ready.index(slot),
                                            q_bufs.index(slot))
            tma.async_copy_global_to_shared(do_desc, [batch, row0, head, 0], ready.index(slot),
                                            do_bufs.index(slot))

    @gluon.jit
    def _bwd_consumer(k_smem, v_smem, kv_bar, shared, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                      OVERLAP: gl.constexpr):
        """Keys [n0 + 64 WG, n0 + 64 WG + 64): load K and V once, accumulate dK and dV over every
        streamed tile, write them (dK times the softmax scale) through K's and V's slots.

        ``OVERLAP``: tile i's dV and dK wgmmas stay in flight while the consumer waits for tile
        i + 1 and issues its S and dP; the wait for S_{i+1} retires them (wgmma groups complete in
        order), and only then is tile i's ring slot freed. Otherwise every tile waits for its own."""
        (k_desc, v_desc, dk_desc, dv_desc, q_bufs, do_bufs, ready, empty, Lse, Delta, stride_lb,
         stride_lh, seqlen_q, seqlen_k, group_size, batch, kv_head, n0, qk_scale, softmax_scale) = shared
        KEYS: gl.constexpr = 64
        dtype: gl.constexpr = k_desc.dtype
        key0 = n0 + WG * KEYS
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, key0, kv_head, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [batch, key0, kv_head, 0], kv_bar, v_smem)

        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        d_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
        keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        qcols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        dk = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, d_layout))
        dv = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, d_layout))
        p_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        ds_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        diag = seqlen_k - seqlen_q
        m_lo, m_full, num_m = _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M, 2 * KEYS, CAUSAL)
        n_m = num_m - m_lo
        total = group_size * n_m
        mbarrier.wait(kv_bar, 0)
        k_tile = k_smem.reshape([KEYS, HEAD_DIM])
        v_tile = v_smem.reshape([KEYS, HEAD_DIM])
        # One loop over (query head of the group, query block), the causal mask a runtime branch
        # (blocks before m_full): with a second copy of the loop for the masked blocks, as the
        # forward has, ptxas spilled.
        for it in range(total):
            head = kv_head * group_size + it // n_m
            m = m_lo + it % n_m
            rows = m * BLOCK_M + qcols
            row_ok = rows < seqlen_q
            at = batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + rows
            # In flight while the tile lands; rows past the sequence: LSE +inf makes P exactly 0.
            lse = gl.load(Lse + at, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = gl.load(Delta + at, mask=row_ok, other=0.0)
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            q_t = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do_t = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            # Zeros made here, not hoisted out of the loop: they become S's and dP's registers
            # instead of holding 32 more per thread through the whole loop.
            s_tok = warpgroup_mma(k_tile, q_t.permute((1, 0)), gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout),
                                  use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v_tile, do_t.permute((1, 0)),
                                   gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout), use_acc=False,
                                   is_async=True)
            s, dk_done, dv_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
                1, deps=(s_tok, dk, dv, p_op, ds_op, k_tile, q_t))
            if OVERLAP:  # the tile before is read no more
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > 0)
            if CAUSAL:
                if m < m_full:  # bottom-right causal: key j is seen by query i when j <= i + Sk - Sq
                    keep = gl.expand_dims(keys, 1) <= gl.expand_dims(rows + diag, 0)
                    s = gl.where(keep, s, float("-inf"))
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 0))
            dp, _, _ = warpgroup_mma_wait(0, deps=(dp_tok, v_tile, do_t))
            ds = p * (dp - gl.expand_dims(delta, 0))
            p_op = gl.convert_layout(p.to(dtype), a_layout)
            ds_op = gl.convert_layout(ds.to(dtype), a_layout)
            dv = warpgroup_mma(p_op, do_t, dv_done, is_async=True)
            dk = warpgroup_mma(ds_op, q_t, dk_done, is_async=True)
            if not OVERLAP:
                dv_done, dk_done, p_op, ds_op, _, _ = warpgroup_mma_wait(
                    0, deps=(dv, dk, p_op, ds_op, do_t, q_t))
                dv = warpgroup_mma_init(dv_done)
                dk = warpgroup_mma_init(dk_done)
                mbarrier.arrive(empty.index(slot))
        dk_done, dv_done, _, _ = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
        # K and V are read no more (every wgmma has retired): their slots stage dK and dV.
        k_tile.store((dk_done * softmax_scale).to(dtype))
        v_tile.store(dv_done.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [batch, key0, kv_head, 0], k_smem)
        tma.async_copy_shared_to_global(dv_desc, [batch, key0, kv_head, 0], v_smem)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "seqlen_q", "seqlen_k", "group_size"])
    def _attn_bwd_dkdv_gluon(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta,
                             stride_lb, stride_lh, seqlen_q, seqlen_k, group_size, qk_scale,
                             softmax_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             OVERLAP: gl.constexpr):
        """Grid (key blocks of 128, KV heads, batch). Lse (natural log) and Delta: (B, H, Sq) fp32
        with strides (stride_lb, stride_lh, 1)."""
        n0 = gl.program_id(0) * 128
        kv_head = gl.program_id(1)
        batch = gl.program_id(2)
        dtype: gl.constexpr = q_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(kv_bars.index(i), count=1)
        m_lo, _, num_m = _query_blocks(n0, seqlen_q, seqlen_k, BLOCK_M, 128, CAUSAL)
        shared = (k_desc, v_desc, dk_desc, dv_desc, q_bufs, do_bufs, ready, empty, Lse, Delta,
                  stride_lb, stride_lh, seqlen_q, seqlen_k, group_size, batch, kv_head, n0, qk_scale,
                  softmax_scale)
        FIRST: gl.constexpr = 0
        SECOND: gl.constexpr = 1
        gl.warp_specialize([
            (_bwd_consumer, (k_smem.index(0), v_smem.index(0), kv_bars.index(0), shared, BLOCK_M,
                             HEAD_DIM, STAGES, CAUSAL, FIRST, OVERLAP)),
            (_bwd_consumer, (k_smem.index(1), v_smem.index(1), kv_bars.index(1), shared, BLOCK_M,
                             HEAD_DIM, STAGES, CAUSAL, SECOND, OVERLAP)),
            (_bwd_producer, (q_desc, do_desc, q_bufs, do_bufs, ready, empty, batch, kv_head, group_size,
                             m_lo, num_m, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def supported(q, k, v, dout, *, head_dims: tuple = HEAD_DIMS) -> bool:
    """Whether ``gluon_dkdv`` takes these (B, S, H, D) tensors: CUDA on compute capability 9.0, one
    16-bit dtype, head dim in HEAD_DIMS, H a multiple of Hk, TMA-addressable rows. The caller
    checks the options (full or causal only: no window, softcap, ALiBi, dropout, packing)."""
    tensors = (q, k, v, dout)
    if not _GLUON or not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 4 for t in tensors):
        return False
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in tensors):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return dout.shape == q.shape and qkv_shapes_ok(q, k, v, head_dims) and all(_tma_ok(t) for t in tensors)


@functools.lru_cache(maxsize=None)
def _layouts(block_m: int, head_dim: int, torch_dtype):
    return (_smem_layout([1, block_m, 1, head_dim], torch_dtype),
            _smem_layout([1, 64, 1, head_dim], torch_dtype))


@functools.lru_cache(maxsize=None)
def _launch_options(variant: GluonBackwardVariant) -> dict:
    # 4 (consumer 0) + 4 (consumer 1) + 1 (producer) warps; maxnreg 168 over 3 warpgroups is the
    # register file the partitions' budgets (240 + 240 + 24) redistribute, as in the forward.
    return {"BLOCK_M": variant.block_m, "HEAD_DIM": variant.head_dim, "STAGES": variant.stages,
            "CAUSAL": variant.causal, "CONSUMER_REGS": variant.consumer_regs,
            "PRODUCER_REGS": variant.producer_regs, "OVERLAP": variant.overlap, "num_warps": 4,
            "maxnreg": 168}


def gluon_dkdv(q, k, v, dout, lse, delta, dk, dv, *, softmax_scale: float, causal: bool,
               variant: GluonBackwardVariant | None = None) -> None:
    """dK, dV of attention into ``dk``/``dv`` (B, Sk, Hk, D, TMA-addressable) for inputs
    ``supported`` takes; ``lse`` (natural log) and ``delta`` = rowsum(dO * O): (B, H, Sq) float32
    with one layout and a contiguous last dim."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_k == 0 or heads_k == 0:
        return
    if seqlen_q == 0:
        dk.zero_()
        dv.zero_()
        return
    dtype = _DTYPES[q.dtype]
    if variant is None:
        variant = _VARIANT_OVERRIDE or default_variant(head_dim, dtype, causal)
    if (variant.head_dim, variant.dtype, variant.causal) != (head_dim, dtype, causal):
        raise ValueError(f"variant {variant.name} does not match d{head_dim} {dtype} causal={causal}")
    same_layout = all(a == b or n == 1 for a, b, n in zip(lse.stride(), delta.stride(), lse.shape))
    if lse.shape != delta.shape or not same_layout or lse.stride(-1) != 1:
        raise ValueError("gluon_dkdv: lse and delta need one layout with a contiguous last dim")
    q_layout, kv_layout = _layouts(variant.block_m, head_dim, q.dtype)
    q_block, kv_block = (1, variant.block_m, 1, head_dim), (1, 64, 1, head_dim)
    descriptors = tuple(_Descriptor(t, t.shape, t.stride(), block, layout) for t, block, layout in (
        (q, q_block, q_layout), (k, kv_block, kv_layout), (v, kv_block, kv_layout),
        (dout, q_block, q_layout), (dk, kv_block, kv_layout), (dv, kv_block, kv_layout)))
    grid = (-(-seqlen_k // 128), heads_k, batch)
    scalars = (lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, heads // heads_k,
               softmax_scale * LOG2E, softmax_scale)
    on_other_device = q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if on_other_device else contextlib.nullcontext():
        launch(_attn_bwd_dkdv_gluon, grid, (lse, delta), scalars, _launch_options(variant), descriptors)


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------------------------

def compile_for_sm90(variant: GluonBackwardVariant):
    """Compile a variant to a cubin for sm_90 the way a launch would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[variant.dtype]
    q_layout, kv_layout = _layouts(variant.block_m, variant.head_dim, torch_dtype)
    d, dt = variant.head_dim, variant.dtype

    def desc(block, layout):
        return f"tensordesc<{dt}[{', '.join(map(str, block))}],{layout!r}>"

    q_sig, kv_sig = desc((1, variant.block_m, 1, d), q_layout), desc((1, 64, 1, d), kv_layout)
    fn = _attn_bwd_dkdv_gluon
    signature = {"q_desc": q_sig, "k_desc": kv_sig, "v_desc": kv_sig, "do_desc": q_sig,
                 "dk_desc": kv_sig, "dv_desc": kv_sig, "Lse": "*fp32", "Delta": "*fp32",
                 "qk_scale": "fp32", "softmax_scale": "fp32"}
    options = _launch_options(variant)
    constexprs = {name: value for name, value in options.items() if name not in ("num_warps", "maxnreg")}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Lse", "Delta"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name not in signature:
            signature[name] = "i32"
    signature = {name: signature[name] for name in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": options["num_warps"], "maxnreg": options["maxnreg"]})


def main(argv=None) -> int:
    """Compile every variant for sm_90 and print registers and spills (no GPU needed)."""
    from .gluon_forward import resource_usage
    failed = 0
    for variant in GLUON_BACKWARD_VARIANTS:
        try:
            compiled = compile_for_sm90(variant)
        except Exception as exc:  # report every variant, then fail
            print(f"{variant.name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
            failed += 1
            continue
        usage = resource_usage(compiled)
        spills = usage.get("local", 0) > 0 or usage.get("stack", 0) > variant.max_stack
        failed += spills
        print(f"{variant.name}: {'SPILLS' if spills else 'ok'}, smem {compiled.metadata.shared} B, "
              f"registers {usage.get('reg', '?')}, local {usage.get('local', '?')} B, "
              f"stack {usage.get('stack', '?')} B")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
