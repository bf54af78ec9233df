"""The rotary + cache-append kernel (kernels/rotary.py) on its own, against a plain torch reference.

The reference does the rotary math the way the kernel promises to (float32 products and sums, one
rounding to the dtype), so results must match bit for bit. Caches live inside larger buffers whose
margins (extra rows/pages, extra columns past the head dim) hold a sentinel: the whole buffer is
compared, so any stray or out-of-bounds write shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.kernels.rotary import rotate_and_append

F16, BF16 = torch.float16, torch.bfloat16
SENTINEL = -77.0


def guarded_cache(rows, slots, heads_k, head_dim, dtype):
    """A random cache (rows, slots, Hk, D) inside a sentinel-filled buffer with a spare row on each
    side and 8 spare columns; returns (buffer, cache view)."""
    buffer = torch.full((rows + 2, slots, heads_k, head_dim + 8), SENTINEL, dtype=dtype)
    cache = buffer[1:-1, :, :, :head_dim]
    cache.copy_(torch.randn(cache.shape, dtype=dtype))
    return buffer, cache


def rotary_tables(seqlen_ro, rotary_dim, dtype):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate_rows(x, cos, sin, positions, interleaved):
    """x (S, H, D) with its first 2 * cos.shape[1] dims turned by the angles at ``positions`` (S,)."""
    half = cos.shape[1]
    first = torch.arange(half) * 2 if interleaved else torch.arange(half)
    second = first + 1 if interleaved else first + half
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]
    a, b = x[..., first].float(), x[..., second].float()
    out = x.clone()
    out[..., first] = (a * c - b * s).to(x.dtype)
    out[..., second] = (a * s + b * c).to(x.dtype)
    return out


def reference(q, k_new, v_new, k_cache, v_cache, cos, sin, lengths, batch_idx=None, leftpad=None,
              table=None, interleaved=False, q_consecutive=True):
    """What rotate_and_append must return, and write into k_cache/v_cache (done here in place)."""
    q_out = q.clone()
    for b in range(q.shape[0]):
        n = int(lengths[b])
        start = n - (int(leftpad[b]) if leftpad is not None else 0)
        if cos is not None:
            q_pos = start + torch.arange(q.shape[1]) if q_consecutive else torch.full((q.shape[1],), start)
            q_out[b] = rotate_rows(q[b], cos, sin, q_pos, interleaved)
        if k_new is None:
            continue
        new = k_new.shape[1]
        keys = k_new[b] if cos is None else rotate_rows(k_new[b], cos, sin, start + torch.arange(new),
                                                        interleaved)
        capacity = table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]
        for j in range(new):
            slot = n + j
            if slot >= capacity:  # the kernel skips slots past the cache
                continue
            if table is not None:
                page_size = k_cache.shape[1]
                where = (int(table[b, slot // page_size]), slot % page_size)
            else:
                where = (int(batch_idx[b]) if batch_idx is not None else b, slot)
            k_cache[where] = keys[j]
            v_cache[where] = v_new[b, j]
    return q_out


def make_case(layout, batch, seqlen_q, seqlen_new, heads, heads_k, head_dim, rotary_dim, dtype,
              capacity=40, cos_dtype=None):
    """Inputs for one call, caches in guarded buffers. ``layout``: contiguous, batch_idx, leftpad, or
    paged<page size>."""
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k_new = torch.randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype) if seqlen_new else None
    v_new = torch.randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype) if seqlen_new else None
    case = dict(q=q, k_new=k_new, v_new=v_new, cos=None, sin=None)
    if layout.startswith("paged"):
        page_size = int(layout[5:])
        per_seq = -(-capacity // page_size)
        num_pages = batch * per_seq + 3  # pages no sequence owns must stay untouched
        case["table"] = torch.randperm(num_pages)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
        rows, slots, capacity = num_pages, page_size, per_seq * page_size
    else:
        rows, slots = (batch + 2, capacity) if layout == "batch_idx" else (batch, capacity)
    if layout == "batch_idx":
        case["batch_idx"] = torch.randperm(rows)[:batch].to(torch.int32)
    k_buffer, case["k_cache"] = guarded_cache(rows, slots, heads_k, head_dim, dtype)
    v_buffer, case["v_cache"] = guarded_cache(rows, slots, heads_k, head_dim, dtype)
    room = capacity - max(seqlen_q, seqlen_new)
    lengths = torch.randint(0, room + 1, (batch,), dtype=torch.int32)
    lengths[0], lengths[-1] = 0, room  # an empty sequence and one filled to the end
    case["lengths"] = lengths
    if layout == "leftpad":
        case["leftpad"] = (torch.rand(batch) * (lengths + 1)).floor().to(torch.int32)
    if rotary_dim:
        case["cos"], case["sin"] = rotary_tables(capacity, rotary_dim, cos_dtype or dtype)
    return case, k_buffer, v_buffer


def run_and_compare(case, k_buffer, v_buffer, interleaved, q_consecutive=True):
    q_before = case["q"].clone()
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    views = {"k_cache": expected_k[1:-1, ..., :case["k_cache"].shape[-1]],
             "v_cache": expected_v[1:-1, ..., :case["v_cache"].shape[-1]]}
    expected_q = reference(**{**case, **views}, interleaved=interleaved, q_consecutive=q_consecutive)
    q_out = rotate_and_append(case["q"], case["k_new"], case["v_new"], case["k_cache"], case["v_cache"],
                              case["cos"], case["sin"], case["lengths"], case.get("batch_idx"),
                              case.get("leftpad"), case.get("table"), interleaved,
                              q_consecutive=q_consecutive)
    assert torch.equal(case["q"], q_before), "q was modified"
    assert q_out.shape == q_before.shape and q_out.dtype == q_before.dtype
    assert torch.equal(q_out, expected_q), f"q: max diff {(q_out.float() - expected_q.float()).abs().max()}"
    assert torch.equal(k_buffer, expected_k), "k cache differs (wrong slot, stray write or rounding)"
    assert torch.equal(v_buffer, expected_v), "v cache differs (wrong slot or stray write)"
    return q_out


@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(40, 40), (80, 32), (128, 128), (128, 64)])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "leftpad", "paged1", "paged3", "paged16"])
def test_matches_torch_reference(layout, interleaved, head_dim, rotary_dim, dtype, seqlen_q):
    case, k_buffer, v_buffer = make_case(layout, 3, seqlen_q, seqlen_q, 4, 2, head_dim, rotary_dim, dtype)
    run_and_compare(case, k_buffer, v_buffer, interleaved)


@pytest.mark.parametrize("layout", ["contiguous", "paged3"])
def test_append_without_rotary(layout):
    case, k_buffer, v_buffer = make_case(layout, 3, 2, 2, 8, 2, 80, 0, BF16)
    q_out = run_and_compare(case, k_buffer, v_buffer, False)
    assert q_out is case["q"]  # nothing to rotate: no copy


@pytest.mark.parametrize("q_consecutive", [True, False], ids=["causal", "same-position"])
@pytest.mark.parametrize("layout", ["leftpad", "paged16"])
def test_rotary_without_new_keys(layout, q_consecutive):
    case, k_buffer, v_buffer = make_case(layout, 3, 3, 0, 4, 2, 64, 32, F16)
    before = k_buffer.clone(), v_buffer.clone()
    run_and_compare(case, k_buffer, v_buffer, True, q_consecutive)
    assert torch.equal(k_buffer, before[0]) and torch.equal(v_buffer, before[1])


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 4), (4, 1), (5, 5)])
def test_query_and_new_token_counts_differ(seqlen_q, seqlen_new):
    case, k_buffer, v_buffer = make_case("paged3", 2, seqlen_q, seqlen_new, 4, 4, 40, 40, BF16)
    run_and_compare(case, k_buffer, v_buffer, False, q_consecutive=seqlen_q != 5)


@pytest.mark.parametrize("heads,heads_k,head_dim", [(40, 8, 128), (6, 1, 256), (3, 3, 8)])
def test_head_blocks_and_grouping(heads, heads_k, head_dim):
    """More heads than one program takes (several head blocks, a ragged last one), MQA, tiny dims."""
    case, k_buffer, v_buffer = make_case("batch_idx", 2, 2, 2, heads, heads_k, head_dim, head_dim // 2, F16)
    run_and_compare(case, k_buffer, v_buffer, True)


@pytest.mark.parametrize("layout", ["contiguous", "paged3"])
def test_slots_past_the_cache_are_skipped(layout):
    """Without the host checks (as in a replayed CUDA graph), lengths that run past the cache write
    nothing outside it."""
    case, k_buffer, v_buffer = make_case(layout, 3, 3, 3, 4, 2, 32, 32, F16)
    capacity = case["table"].shape[1] * 3 if layout == "paged3" else case["k_cache"].shape[1]
    case["lengths"] = torch.tensor([capacity - 1, capacity, capacity + 5], dtype=torch.int32)
    case["cos"], case["sin"] = rotary_tables(capacity + 8, 32, F16)
    run_and_compare(case, k_buffer, v_buffer, False)


def test_strided_inputs_and_float32_tables():
    """q/k/v taken from packed tensors, cos/sin with a non-unit inner stride, float32 tables."""
    case, k_buffer, v_buffer = make_case("leftpad", 3, 2, 2, 4, 2, 64, 48, BF16, cos_dtype=torch.float32)
    qkv = torch.randn(3, 2, 8, 64, dtype=BF16)
    case["q"], case["k_new"], case["v_new"] = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    for name in ("cos", "sin"):
        wide = torch.randn(case[name].shape[0], 48, dtype=torch.float32)
        wide[:, ::2] = case[name]
        case[name] = wide[:, ::2]
    run_and_compare(case, k_buffer, v_buffer, False)


def test_close_to_exact_rotation():
    """Independent of the reference's formula: within a rounding of the float64 rotation."""
    case, k_buffer, v_buffer = make_case("contiguous", 2, 3, 3, 4, 2, 64, 64, F16)
    q_out = run_and_compare(case, k_buffer, v_buffer, False)
    q, cos, sin = case["q"].double(), case["cos"].double(), case["sin"].double()
    for b in range(2):
        pos = int(case["lengths"][b]) + torch.arange(3)
        a, c = q[b, ..., :32], q[b, ..., 32:]
        exact = torch.cat([a * cos[pos][:, None] - c * sin[pos][:, None],
                           a * sin[pos][:, None] + c * cos[pos][:, None]], dim=-1)
        torch.testing.assert_close(q_out[b].double(), exact, atol=4e-3, rtol=2e-3)


def test_under_torch_compile():
    """The launch is a custom op that mutates the caches: torch.compile(fullgraph=True) keeps it."""
    case, k_buffer, v_buffer = make_case("paged3", 2, 2, 2, 4, 2, 32, 32, F16)
    eager_k, eager_v = k_buffer.clone(), v_buffer.clone()
    eager_q = rotate_and_append(case["q"], case["k_new"], case["v_new"], eager_k[1:-1, ..., :32],
                                eager_v[1:-1, ..., :32], case["cos"], case["sin"], case["lengths"],
                                block_table=case["table"], interleaved=True)

    def step(q, k_new, v_new, k_cache, v_cache, cos, sin, lengths, table):
        return rotate_and_append(q, k_new, v_new, k_cache, v_cache, cos, sin, lengths, block_table=table,
                                 interleaved=True)

    compiled_q = torch.compile(step, fullgraph=True)(
        case["q"], case["k_new"], case["v_new"], case["k_cache"], case["v_cache"], case["cos"], case["sin"],
        case["lengths"], case["table"])
    assert torch.equal(compiled_q, eager_q)
    assert torch.equal(k_buffer, eager_k) and torch.equal(v_buffer, eager_v)


def test_decode_step_with_rotary_compiles():
    q = torch.randn(2, 1, 4, 32, dtype=F16)
    k_cache, v_cache = torch.randn(2, 20, 2, 32, dtype=F16), torch.randn(2, 20, 2, 32, dtype=F16)
    k_new, v_new = torch.randn(2, 1, 2, 32, dtype=F16), torch.randn(2, 1, 2, 32, dtype=F16)
    cos, sin = rotary_tables(20, 32, F16)
    lengths = torch.tensor([3, 17], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new, lengths):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                                 rotary_sin=sin, cache_seqlens=lengths, causal=True)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    expected = step(q, eager_k, eager_v, k_new, v_new, lengths)
    out = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
