"""Packed sequences (flash_attn_varlen_*): each sequence must come out as if it ran alone."""

from __future__ import annotations

import pytest
import torch

import flashtile

F16, BF16 = torch.float16, torch.bfloat16


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def run_alone(q, k, v, cu_q, cu_k, dout, **kw):
    """flash_attn_func on each sequence by itself: outputs, LSEs and gradients, packed back."""
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    alibi = kw.pop("alibi_slopes", None)
    for b in range(cu_q.numel() - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qs, ks, vs = (t.detach()[s].unsqueeze(0).requires_grad_(True) for t, s in ((q, sq), (k, sk), (v, sk)))
        slopes = None if alibi is None else alibi[b:b + 1]
        out, lse, _ = flashtile.flash_attn_func(qs, ks, vs, alibi_slopes=slopes, return_attn_probs=True, **kw)
        out.backward(dout[sq].unsqueeze(0))
        outs.append(out[0].detach()), lses.append(lse[0].detach())
        dqs.append(qs.grad[0]), dks.append(ks.grad[0]), dvs.append(vs.grad[0])
    return (torch.cat(outs), torch.cat(lses, dim=1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs))


def run_packed(q, k, v, cu_q, cu_k, max_q, max_k, dout, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   return_attn_probs=True, **kw)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


LENGTHS = [([5, 70, 0, 33, 1], [9, 50, 4, 33, 64]), ([64, 64], [64, 64]), ([1], [100]), ([40, 17, 90], [40, 17, 90])]


@pytest.mark.parametrize("lengths_q,lengths_k", LENGTHS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window_size=(20, 0)),
                                dict(window_size=(7, 12), softcap=5.0), dict(causal=True, alibi=True),
                                dict(causal=True, deterministic=True)],
                         ids=["full", "causal", "sliding", "window-softcap", "alibi", "deterministic"])
def test_each_sequence_as_if_alone(lengths_q, lengths_k, kw):
    kw = dict(kw)
    heads, heads_k, head_dim = 4, 2, 40
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    dtype = BF16 if kw.get("causal") else F16
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype)
    k = torch.randn(sum(lengths_k), heads_k, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lengths_q), heads)
    packed = run_packed(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout, **kw)
    alone = run_alone(q, k, v, cu_q, cu_k, dout, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), packed, alone):
        assert not torch.isnan(a).any(), name
        assert torch.equal(a, b), f"{name} differs from running each sequence alone"


def test_packed_variants():
    lengths = [30, 7, 50]
    cu = offsets(lengths)
    qkv = torch.randn(sum(lengths), 3, 4, 32, dtype=F16)
    expected = flashtile.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 50, 50, causal=True)
    assert torch.equal(flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 50, causal=True), expected)
    assert torch.equal(flashtile.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 50, 50,
                                                                 causal=True), expected)


def _bad_offsets():
    good = offsets([10, 20])
    return [
        pytest.param(dict(cu_seqlens_q=good.long()), TypeError, "cu_seqlens_q must be int32", id="int64"),
        pytest.param(dict(cu_seqlens_k=offsets([10, 5, 15])), ValueError, "cu_seqlens_k has 4 offsets",
                     id="length"),
        pytest.param(dict(cu_seqlens_q=torch.tensor([0, 20, 10], dtype=torch.int32)), ValueError,
                     "non-decreasing", id="not-monotone"),
        pytest.param(dict(cu_seqlens_k=torch.tensor([1, 10, 30], dtype=torch.int32)), ValueError,
                     "start at 0", id="not-from-0"),
        pytest.param(dict(cu_seqlens_q=torch.tensor([0, 10, 31], dtype=torch.int32)), ValueError,
                     "past the 30", id="past-end"),
        pytest.param(dict(max_seqlen_q=19), ValueError, "max_seqlen_q is 19", id="max-too-small"),
        pytest.param(dict(max_seqlen_k=-1), ValueError, "max_seqlen_k", id="max-negative"),
        pytest.param(dict(cu_seqlens_q=good.view(1, -1)), ValueError, "1-D", id="2-d"),
        pytest.param(dict(dropout_p=1.5), ValueError, "dropout_p", id="dropout"),
        pytest.param(dict(alibi_slopes=torch.rand(3, 4)), ValueError, "alibi_slopes", id="alibi-batch"),
    ]


@pytest.mark.parametrize("overrides,exc,message", _bad_offsets())
def test_bad_offsets_are_named(overrides, exc, message):
    q = torch.randn(30, 4, 16, dtype=F16)
    k = torch.randn(30, 2, 16, dtype=F16)
    args = dict(q=q, k=k, v=k, cu_seqlens_q=offsets([10, 20]), cu_seqlens_k=offsets([10, 20]),
                max_seqlen_q=20, max_seqlen_k=20)
    args.update(overrides)
    with pytest.raises(exc, match=message):
        flashtile.flash_attn_varlen_func(**args)


def test_varlen_compiles_and_passes_opcheck():
    import flashtile.ops  # noqa: F401 (registers torch.ops.flashtile: the package loads lazily)
    cu = offsets([12, 20])
    q, k, v = (torch.randn(32, 4, 16, dtype=F16) for _ in range(3))
    torch.library.opcheck(torch.ops.flashtile.attn_fwd.default,
                          (q.requires_grad_(True), k, v, 0.25, -1, 0, True, 0.0, None, cu, cu, 20, 20),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def fn(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True)

    q = q.detach()
    assert torch.equal(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v))


def paged_copy(k, v, cu_k, page_size, spare_pages=3, fill=None):
    """The same keys in a page pool with scattered pages, and the block table that finds them; the
    unused slots hold noise, or ``fill``."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    pages_per_seq = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages).tolist()
    k_pool = torch.randn(num_pages, page_size, *k.shape[1:], dtype=k.dtype)  # unused slots: noise
    v_pool = torch.randn_like(k_pool)
    if fill is not None:
        k_pool.fill_(fill), v_pool.fill_(fill)
    table = torch.zeros(len(lengths), max(max(pages_per_seq), 1), dtype=torch.int32)
    for b, n in enumerate(lengths):
        for j in range(pages_per_seq[b]):
            page = order.pop()
            table[b, j] = page
            rows = slice(int(cu_k[b]) + j * page_size, int(cu_k[b]) + min((j + 1) * page_size, n))
            used = rows.stop - rows.start
            k_pool[page, :used], v_pool[page, :used] = k[rows], v[rows]
    return k_pool, v_pool, table


@pytest.mark.parametrize("page_size", [1, 3, 7])
def test_16bit_pools_gather_into_packed_rows_with_zeros_after(page_size):
    """The gather that brings 16-bit pools of pages no TMA box fits to the Gluon forward (on the
    H200): sequence b's keys from row cu_seqlens_k[b], read through its shuffled table row, and with
    ``zeros`` every row past the last sequence zero (the last key tile's P V reads them; the pools'
    unused slots are NaN here)."""
    from flashtile.kernels import forward
    lens = [9, 0, 31, 20]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    k, v = torch.randn(sum(lens), 2, 24, dtype=BF16), torch.randn(sum(lens), 2, 24, dtype=BF16)
    k_pool, v_pool, table = paged_copy(k, v, cu, page_size, fill=float("nan"))
    rows = forward._paged_rows(v_pool, table, cu, max(lens), zeros=True)
    assert rows.shape == (len(lens) * max(lens), 2, 24)
    assert torch.equal(rows[:sum(lens)], v) and (rows[sum(lens):] == 0).all()
    assert torch.equal(forward._paged_rows(k_pool, table, cu, max(lens))[:sum(lens)], k)


def test_16bit_pools_gather_room_for_the_sequences_with_keys():
    """A mixed batch's prefill part (keyed_sequences: at most that many sequences have keys, the
    decode steps' counts are 0) gathers into room for that many sequences' keys, not the batch's,
    and the rows past the keys are still zeros."""
    from flashtile.kernels import forward
    lens = [0, 31, 0, 0, 20, 0]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    k, v = torch.randn(sum(lens), 2, 24, dtype=BF16), torch.randn(sum(lens), 2, 24, dtype=BF16)
    k_pool, v_pool, table = paged_copy(k, v, cu, 1, fill=float("nan"))
    rows = forward._paged_rows(v_pool, table, cu, max(lens), zeros=True, sequences=2)
    assert rows.shape == (2 * max(lens), 2, 24)
    assert torch.equal(rows[:sum(lens)], v) and (rows[sum(lens):] == 0).all()
    assert torch.equal(forward._paged_rows(k_pool, table, cu, max(lens), sequences=2)[:sum(lens)], k)


def test_gathering_pays_by_query_rows_a_sequence(monkeypatch):
    """Pools are gathered only where the query rows a sequence (times the GQA group), on average,
    reach GATHER_MIN_ROWS, however many keys the sequences have, and the two copies stay within
    GATHER_BYTES."""
    from flashtile.kernels import forward
    pool = torch.empty(40, 1, 2, 16, dtype=BF16)
    table = torch.zeros(4, 10, dtype=torch.int32)  # 4 sequences of up to 10 keys: 40 keys gathered
    monkeypatch.setattr(forward, "GATHER_MIN_ROWS", 10)
    assert forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table, 10)  # 10 x 4 >= 4 x 10
    assert not forward._gathering_pays(torch.empty(9, 8, 16, dtype=BF16), pool, table, 10)
    assert forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table, 1)  # not the keys
    assert not forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table, 0)
    assert not forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table[:0], 10)
    monkeypatch.setattr(forward, "GATHER_BYTES", 2 * 40 * 2 * 16 * 2 - 1)  # two copies over the bound
    assert not forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table, 1000)
    monkeypatch.setattr(forward, "GATHER_BYTES", 2 * 40 * 2 * 16 * 2)
    assert forward._gathering_pays(torch.empty(10, 8, 16, dtype=BF16), pool, table, 1000)


def test_gathering_pays_for_a_mixed_batch_by_its_longest_chunk(monkeypatch):
    """A mixed batch's prefill part (keyed_sequences > 0): the decode steps' rows do not count
    against the gather (their keys are not copied); the longest chunk's rows (max_seqlen_q, within
    the rows there are) times the group decide, and the copies are sized by the keyed sequences."""
    from flashtile.kernels import forward
    pool = torch.empty(40, 1, 2, 16, dtype=BF16)
    table = torch.zeros(8, 10, dtype=torch.int32)
    monkeypatch.setattr(forward, "GATHER_MIN_ROWS", 20)
    q = torch.empty(12, 8, 16, dtype=BF16)  # 12 rows over 8 sequences: 12 x 4 < 20 x 8 on average
    assert not forward._gathering_pays(q, pool, table, 10)
    assert forward._gathering_pays(q, pool, table, 10, 5, 2)  # the chunk: 5 x 4 >= 20
    assert not forward._gathering_pays(q, pool, table, 10, 4, 2)
    assert not forward._gathering_pays(q[:4], pool, table, 10, 5, 2)  # max_seqlen_q past the rows
    monkeypatch.setattr(forward, "GATHER_BYTES", 2 * 20 * 2 * 16 * 2)  # room for 2 sequences' keys only
    assert forward._gathering_pays(q, pool, table, 10, 5, 2)
    assert not forward._gathering_pays(q, pool, table, 10, 5, 3)


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(10, 5), softcap=4.0)], ids=["causal", "window"])
def test_paged_kv_matches_contiguous(page_size, kw, monkeypatch):
    """The prefill kernels on page pools: bit for bit the contiguous packed call (40 queries would
    take the decode route, tested against float64 on its own)."""
    from flashtile import interface
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    lengths_q, lengths_k = [3, 40, 1, 0], [70, 40, 300, 5]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = torch.randn(sum(lengths_q), 6, 64, dtype=BF16)
    k, v = torch.randn(sum(lengths_k), 2, 64, dtype=BF16), torch.randn(sum(lengths_k), 2, 64, dtype=BF16)
    expected, expected_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 300,
                                                                 return_attn_probs=True, **kw)
    k_pool, v_pool, table = paged_copy(k, v, cu_k, page_size)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 40, 300, block_table=table,
                                                   return_attn_probs=True, **kw)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def _count_decode_calls(monkeypatch):
    from flashtile import interface
    calls = []
    real = interface.ops.kvcache
    monkeypatch.setattr(interface.ops, "kvcache", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window_size=(6, 2), softcap=4.0),
                                dict(causal=True, alibi=True)], ids=["causal", "full", "window-softcap", "alibi"])
def test_few_queries_a_sequence_on_pools_run_the_decode(page_size, kw, monkeypatch, nan_empty):
    """Decode and speculative steps through flash_attn_varlen_func (vLLM batches them so): page
    pools with at most VARLEN_DECODE_MAX_QUERIES queries a sequence go to flash_attn_with_kvcache's
    split-KV decode, each sequence's queries in the last rows of a padded block; every sequence
    as if alone (against float64), sequences without queries or keys among them."""
    calls = _count_decode_calls(monkeypatch)
    case = _ragged_on_pools([1, 0, 3, 2, 3], [5, 17, 0, 40, 2], 64, page_size, kw)
    q, cu_q, cu_k, k_pool, v_pool, table, kw = case[0], case[3], case[4], *case[5:]
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 3, 40, block_table=table,
                                                   return_attn_probs=True, **kw)
    assert calls == [(5, 3, 6, 64)] and out.shape == q.shape and lse.shape == (6, q.shape[0])
    _each_sequence_as_if_alone(out, lse, *case[:5], kw)


def _ragged_on_pools(lengths_q, lengths_k, head_dim, page_size, kw, heads=6, heads_k=2):
    """Fresh packed bf16 q, k, v (6/2 heads), their offsets, the keys on shuffled pools whose unused
    slots hold NaN, and ``kw`` with ALiBi slopes drawn where it asks for them."""
    kw = dict(kw)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=BF16)
    k, v = (torch.randn(sum(lengths_k), heads_k, head_dim, dtype=BF16) for _ in range(2))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(len(lengths_q), heads)
    return (q, k, v, cu_q, cu_k, *paged_copy(k, v, cu_k, page_size, fill=float("nan")), kw)


def _each_sequence_as_if_alone(out, lse, q, k, v, cu_q, cu_k, kw):
    from helpers import assert_matches_reference
    kw = dict(kw)
    alibi = kw.pop("alibi_slopes", None)
    for b in range(cu_q.numel() - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if sq.stop > sq.start:
            assert_matches_reference(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), q[sq].unsqueeze(0),
                                     k[sk].unsqueeze(0), v[sk].unsqueeze(0),
                                     alibi_slopes=None if alibi is None else alibi[b:b + 1], **kw)


@pytest.mark.parametrize("dtype", [BF16, F16, torch.float8_e4m3fn], ids=["bf16", "fp16", "e4m3"])
def test_packed_rows_move_to_a_block_and_back(dtype, nan_empty):
    """The varlen decode route's two moves: sequence b's packed rows into the last rows of its
    (B, Sq, H, D) block with zeros before them, and the block's outputs and LSEs back to the packed
    rows; sequences without rows among them and rows past cu_seqlens[-1] (padding) in q."""
    from flashtile.kernels import decode
    lengths, seqlen, heads, head_dim = [2, 0, 4, 1, 4], 4, 3, 40
    cu = offsets(lengths)
    total = sum(lengths) + 2
    packed = torch.randn(total, heads, head_dim).to(dtype)
    blocked = decode.block_packed_rows(packed, cu, seqlen)
    assert blocked.shape == (len(lengths), seqlen, heads, head_dim) and blocked.dtype == dtype
    want = torch.zeros(len(lengths), seqlen, heads, head_dim)
    for b, n in enumerate(lengths):
        want[b, seqlen - n:] = packed[cu[b]:cu[b + 1]].float()
    assert torch.equal(blocked.float(), want)
    out_blocked = torch.randn(len(lengths), seqlen, heads, head_dim).to(dtype)
    lse_blocked = torch.randn(len(lengths), heads, seqlen)
    out, lse = decode.unblock_rows(out_blocked, lse_blocked, cu, total)
    assert out.shape == packed.shape and lse.shape == (heads, total)
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(out[rows].float(), out_blocked[b, seqlen - n:].float())
        assert torch.equal(lse[:, rows], lse_blocked[b, :, seqlen - n:])
    out_only, none = decode.unblock_rows(out_blocked, None, cu, total)
    assert none is None and torch.equal(out_only[:cu[-1]].float(), out[:cu[-1]].float())


def test_row_moves_pass_opcheck():
    from flashtile import ops
    cu = offsets([2, 0, 3])
    torch.library.opcheck(ops.attn_block_rows, (torch.randn(6, 2, 8), cu, 3))
    torch.library.opcheck(ops.attn_unblock_rows, (torch.randn(3, 3, 2, 8), torch.randn(3, 2, 3), cu, 5))


@pytest.mark.parametrize("with_lse", [False, True])
def test_decode_route_compiles_with_fullgraph(with_lse):
    """The decode route (row moves as registered ops, the split-KV decode) under
    torch.compile(fullgraph=True), with seqused_k and without cu_seqlens_k, as vLLM calls it."""
    cu_q = offsets([2, 0, 3])
    q = torch.randn(5, 4, 16, dtype=BF16)
    k_pool, v_pool, table = paged_copy(torch.randn(60, 2, 16, dtype=BF16), torch.randn(60, 2, 16, dtype=BF16),
                                       offsets([20, 10, 30]), 4)
    seqused = torch.tensor([20, 9, 30], dtype=torch.int32)

    def fn(q):
        result = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 3, 30, causal=True,
                                                  block_table=table, seqused_k=seqused,
                                                  return_attn_probs=with_lse)
        return result[:2] if with_lse else result
    torch._dynamo.reset()
    eager = fn(q)
    compiled = torch.compile(fn, fullgraph=True)(q)
    for e, c in zip(*((x if isinstance(x, tuple) else (x,)) for x in (eager, compiled))):
        assert torch.equal(c, e)


@pytest.mark.parametrize("padded_rows", [64, 0], ids=["one-decode", "two-decodes"])
def test_mixed_batch_compiles_with_fullgraph(padded_rows, monkeypatch):
    """The mixed batch's split (the decode rows written into the prefill kernels' outputs by a
    registered op that mutates them, once or twice) under torch.compile(fullgraph=True)."""
    from flashtile import interface
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    monkeypatch.setattr(interface, "MIXED_PADDED_ROWS", padded_rows)
    cu_q = offsets([1, 20, 1, 0, 2, 1])
    q = torch.randn(25, 4, 16, dtype=BF16)
    k_pool, v_pool, table = paged_copy(torch.randn(90, 2, 16, dtype=BF16), torch.randn(90, 2, 16, dtype=BF16),
                                       offsets([20, 30, 10, 5, 20, 5]), 4)
    seqused = torch.tensor([20, 30, 10, 5, 20, 5], dtype=torch.int32)

    def fn(q):
        return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 20, 30, causal=True,
                                                block_table=table, seqused_k=seqused, return_attn_probs=True)[:2]
    torch._dynamo.reset()
    eager = fn(q)
    compiled = torch.compile(fn, fullgraph=True)(q)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def _pools_with_unused_keys(lengths_q, used, stored, page_size, heads=6, heads_k=2, head_dim=64, dtype=BF16):
    """Fresh packed q and page pools holding ``stored`` keys a sequence, of which the call uses
    ``used``: the keys past them are finite noise, so reading one changes the result."""
    cu_stored = offsets(stored)
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype)
    k = torch.randn(sum(stored), heads_k, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    k_pool, v_pool, table = paged_copy(k, v, cu_stored, page_size)
    return q, k, v, cu_stored, k_pool, v_pool, table


def _check_used_keys(out, lse, q, k, v, cu_q, cu_stored, used, **kw):
    from helpers import assert_matches_reference
    for b in range(len(used)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_stored[b]), int(cu_stored[b]) + used[b])
        if sq.stop > sq.start:
            assert_matches_reference(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), q[sq].unsqueeze(0),
                                     k[sk].unsqueeze(0), v[sk].unsqueeze(0), **kw)


@pytest.mark.parametrize("lengths_q", [[1, 3, 0, 2], [20, 3, 0, 9]], ids=["decode-route", "prefill-route"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_seqused_k_on_page_pools_without_key_offsets(lengths_q, page_size, nan_empty):
    """vLLM's call: flash_attn_varlen_func(..., cu_seqlens_k=None, seqused_k=..., block_table=...):
    sequence b reads only the first seqused_k[b] slots of its pages (the pools hold more)."""
    used, stored = [40, 5, 17, 0], [50, 9, 17, 3]
    q, k, v, cu_stored, k_pool, v_pool, table = _pools_with_unused_keys(lengths_q, used, stored, page_size)
    cu_q, seqused = offsets(lengths_q), torch.tensor(used, dtype=torch.int32)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_seqlens_q=cu_q, max_seqlen_q=max(lengths_q),
                                                   seqused_k=seqused, max_seqlen_k=max(stored), causal=True,
                                                   block_table=table, return_attn_probs=True)
    _check_used_keys(out, lse, q, k, v, cu_q, cu_stored, used, causal=True)
    # given too, cu_seqlens_k is not read with a block table
    again = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_stored, max(lengths_q), max(stored),
                                             causal=True, block_table=table, seqused_k=seqused)
    assert torch.equal(again[:int(cu_q[-1])], out[:int(cu_q[-1])])


@pytest.mark.parametrize("lengths_q", [[1, 3, 0, 2], [20, 3, 0, 9]], ids=["decode-route", "prefill-route"])
def test_seqused_k_on_packed_keys(lengths_q, nan_empty):
    """FlashAttention-3's seqused_k without a block table: sequence b's keys are
    k[cu_seqlens_k[b]:cu_seqlens_k[b] + seqused_k[b]]."""
    used, stored = [40, 5, 17, 0], [50, 9, 17, 3]
    q = torch.randn(sum(lengths_q), 4, 40, dtype=F16)
    k, v = torch.randn(sum(stored), 1, 40, dtype=F16), torch.randn(sum(stored), 1, 40, dtype=F16)
    cu_q, cu_k = offsets(lengths_q), offsets(stored)
    kw = dict(window_size=(9, 0), softcap=3.0)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(stored),
                                                   seqused_k=torch.tensor(used, dtype=torch.int32),
                                                   return_attn_probs=True, **kw)
    _check_used_keys(out, lse, q, k, v, cu_q, cu_k, used, **kw)


def _bad_seqused():
    return [
        pytest.param(dict(seqused_k=[3, 3]), TypeError, "seqused_k must be a torch.Tensor", id="list"),
        pytest.param(dict(seqused_k=torch.tensor([3, 3])), TypeError, "seqused_k must be int32", id="int64"),
        pytest.param(dict(seqused_k=torch.tensor([3], dtype=torch.int32)), ValueError, "seqused_k must have shape",
                     id="shape"),
        pytest.param(dict(seqused_k=torch.tensor([3, 31], dtype=torch.int32)), ValueError,
                     r"seqused_k entries must be in \[0, max_seqlen_k = 30\]", id="past-max"),
        pytest.param(dict(seqused_k=torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
                     "seqused_k entries must be in", id="negative"),
        pytest.param(dict(seqused_k=torch.tensor([21, 3], dtype=torch.int32), block_table=None), ValueError,
                     "seqused_k exceeds a sequence's keys", id="past-offsets"),
        pytest.param(dict(seqused_k=torch.tensor([3, 3], dtype=torch.int32), block_table=None, cu_seqlens_k=None),
                     ValueError, "needs cu_seqlens_k", id="no-offsets"),
    ]


@pytest.mark.parametrize("change,exc,message", _bad_seqused())
def test_bad_seqused_k_is_named(change, exc, message):
    cu = offsets([20, 30])
    q, k, v = torch.randn(50, 4, 16, dtype=F16), torch.randn(50, 2, 16, dtype=F16), torch.randn(50, 2, 16, dtype=F16)
    k_pool, v_pool, table = paged_copy(k, v, cu, 8)
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=None, max_seqlen_q=30, max_seqlen_k=30, block_table=table)
    call.update(change)
    pools = (k, v) if call["block_table"] is None else (k_pool, v_pool)
    if call["block_table"] is None and "cu_seqlens_k" not in change:
        call["cu_seqlens_k"] = cu
    with pytest.raises(exc, match=message):
        flashtile.flash_attn_varlen_func(q, *pools, **call)


def test_seqused_k_on_no_keys_at_all(nan_empty):
    q = torch.randn(3, 4, 16, dtype=BF16)
    none = torch.randn(0, 2, 16, dtype=BF16)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, none, none, offsets([1, 2]), offsets([0, 0]), 2, 0,
                                                   seqused_k=torch.zeros(2, dtype=torch.int32), return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()


def test_seqused_k_checked_once_per_tensor_version(monkeypatch):
    """Every layer of a decode step passes the same seqused_k, cu_seqlens_q and block table: their
    values are read on the host (a device sync) at the first layer only, and again after an
    in-place change."""
    cu_q = offsets([1, 1])
    q = torch.randn(2, 4, 16, dtype=F16)
    k_pool, v_pool, table = paged_copy(torch.randn(50, 2, 16, dtype=F16), torch.randn(50, 2, 16, dtype=F16),
                                       offsets([20, 30]), 8)
    seqused = torch.tensor([20, 30], dtype=torch.int32)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))

    def call():
        return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 1, 30, block_table=table,
                                                seqused_k=seqused)
    call()
    first = len(reads)
    assert first > 0
    call(), call()
    assert len(reads) == first
    seqused[0] = 31
    with pytest.raises(ValueError, match="seqused_k entries must be in"):
        call()


def test_seqused_k_on_packed_keys_refuses_gradients():
    cu = offsets([10])
    q = torch.randn(10, 2, 16, dtype=F16, requires_grad=True)
    k = torch.randn(10, 2, 16, dtype=F16)
    with pytest.raises(NotImplementedError, match="seqused_k is forward-only"):
        flashtile.flash_attn_varlen_func(q, k, k, cu, cu, 10, 10, seqused_k=torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("queries,heads,routed", [(17, 4, True), (64, 4, True), (65, 4, False), (32, 16, True),
                                                   (33, 16, False), (16, 64, True)])
def test_the_decode_route_by_queries_and_rows(queries, heads, routed, monkeypatch):
    """Up to VARLEN_DECODE_MAX_QUERIES queries a sequence the decode route is taken; past that up to
    VARLEN_DECODE_WIDE_QUERIES while a KV head's rows (queries x group) stay within
    VARLEN_DECODE_MAX_ROWS (here 2 KV heads: groups 2, 8 and 32)."""
    calls = _count_decode_calls(monkeypatch)
    cu = offsets([queries, 3])
    q = torch.randn(queries + 3, heads, 16, dtype=F16)
    k_pool, v_pool, table = paged_copy(torch.randn(queries + 3, 2, 16, dtype=F16),
                                       torch.randn(queries + 3, 2, 16, dtype=F16), cu, 4)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, queries, queries, block_table=table)
    assert calls == ([(2, queries, heads, 16)] if routed else [])


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(6, 2), softcap=4.0),
                                dict(causal=True, alibi=True)], ids=["causal", "window-softcap", "alibi"])
def test_mixed_batches_split_between_prefill_and_decode(page_size, kw, monkeypatch, nan_empty):
    """vLLM's chunked prefill: long query chunks among decode steps. The prefill kernels take the
    chunks, the split-KV decode the steps (each sequence against float64), and the calls show it:
    one decode of (B, VARLEN_DECODE_MAX_QUERIES) rows, one prefill forward whose key counts are 0
    for the short sequences."""
    from flashtile import interface
    decodes = _count_decode_calls(monkeypatch)
    forwards = []
    real_forward = interface.ops.forward
    monkeypatch.setattr(interface.ops, "forward",
                        lambda *a, **k: forwards.append((a[9].clone(), a[10].clone(), a[17])) or real_forward(*a, **k))
    case = _ragged_on_pools([1, 40, 0, 3, 1, 17, 1, 16], [30, 60, 5, 3, 0, 17, 90, 20], 32, page_size, kw)
    q, cu_q, cu_k, k_pool, v_pool, table, kw = case[0], case[3], case[4], *case[5:]
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)  # 40 x group 3 would take the decode route
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 40, 90, block_table=table,
                                                   return_attn_probs=True, **kw)
    assert decodes == [(8, interface.VARLEN_DECODE_MAX_QUERIES, 6, 32)] and len(forwards) == 1  # (16 x 3 rows)
    assert torch.equal(forwards[0][0], cu_q)
    assert forwards[0][2] == q.shape[0] // (interface.VARLEN_DECODE_MAX_QUERIES + 1)  # keyed_sequences
    assert (forwards[0][1][1:] - forwards[0][1][:-1]).tolist() == [0, 60, 0, 0, 0, 17, 0, 0]
    _each_sequence_as_if_alone(out, lse, *case[:5], kw)


@pytest.mark.parametrize("heads,heads_k,first_rows,padded_rows,rows", [
    (6, 2, 16, 64, [16]), (6, 2, 16, 32, [16, 5]), (6, 2, 0, 32, [16]), (4, 4, 16, 0, [16]), (32, 1, 16, 64, [16, 1]),
    (8, 2, 8, 0, [16, 2])])
def test_mixed_batches_decode_the_steps_in_two_launches(heads, heads_k, first_rows, padded_rows, rows, monkeypatch,
                                                        nan_empty):
    """A mixed batch's decode steps, where VARLEN_DECODE_MAX_QUERIES x group rows pass
    MIXED_PADDED_ROWS: the sequences of at most MIXED_FIRST_ROWS // group queries (at least 1) in a
    launch of that many rows, after one of VARLEN_DECODE_MAX_QUERIES rows for the other short ones
    (one launch where that bound reaches it, or with MIXED_FIRST_ROWS 0); each sequence against
    float64."""
    from flashtile import interface
    decodes = _count_decode_calls(monkeypatch)
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    monkeypatch.setattr(interface, "MIXED_FIRST_ROWS", first_rows)
    monkeypatch.setattr(interface, "MIXED_PADDED_ROWS", padded_rows)
    case = _ragged_on_pools([1, 20, 2, 7, 1, 0, 1, 3], [30, 25, 5, 40, 0, 3, 60, 16], 16, 3, dict(causal=True),
                            heads=heads, heads_k=heads_k)
    q, cu_q, cu_k, k_pool, v_pool, table, kw = case[0], case[3], case[4], *case[5:]
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 20, 60, block_table=table,
                                                   return_attn_probs=True, **kw)
    assert decodes == [(8, r, heads, 16) for r in rows]
    _each_sequence_as_if_alone(out, lse, *case[:5], kw)


def test_dense_batches_keep_one_prefill_call(monkeypatch):
    """Queries filling more than 1 / MIXED_BATCH_FILL of batch x max_seqlen_q: no split."""
    from flashtile import interface
    decodes = _count_decode_calls(monkeypatch)
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    cu = offsets([20, 1, 30, 25])
    q, k = torch.randn(76, 4, 16, dtype=F16), torch.randn(76, 2, 16, dtype=F16)
    k_pool, v_pool, table = paged_copy(k, k, cu, 4)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 30, 30, block_table=table)
    assert decodes == []
    monkeypatch.setattr(interface, "MIXED_BATCH_FILL", 1)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 30, 30, block_table=table)
    assert decodes == [(4, 16, 4, 16)]


def test_calls_without_pools_or_with_dropout_keep_the_prefill_kernels(monkeypatch):
    from flashtile import interface
    calls = _count_decode_calls(monkeypatch)
    cu = offsets([17, 3])
    q, k = torch.randn(20, 4, 32, dtype=F16), torch.randn(20, 2, 32, dtype=F16)
    k_pool, v_pool, table = paged_copy(k, k, cu, 4)
    flashtile.flash_attn_varlen_func(q, k, k, cu, cu, 17, 17)  # contiguous keys: no cache to decode from
    flashtile.flash_attn_varlen_func(q[:6], k, k, offsets([3, 3]), cu, 3, 17)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 17, 17, block_table=table, dropout_p=0.1)
    monkeypatch.setattr(interface, "VARLEN_DECODE_WIDE_QUERIES", 0)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 17, 17, block_table=table)
    assert calls == []
    monkeypatch.setattr(interface, "VARLEN_DECODE_MAX_QUERIES", 17)
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 17, 17, block_table=table)
    assert calls == [(2, 17, 4, 32)]


def _bad_pages():
    return [
        pytest.param(lambda t: t.long(), TypeError, "block_table must be int32", id="int64"),
        pytest.param(lambda t: t[:1], ValueError, "block_table must have shape", id="rows"),
        pytest.param(lambda t: t + 100, ValueError, "block_table entries must be in", id="out-of-range"),
        pytest.param(lambda t: t[:, :1], ValueError, "holds only", id="capacity"),
    ]


@pytest.mark.parametrize("mutate,exc,message", _bad_pages())
def test_bad_block_table_is_named(mutate, exc, message):
    cu = offsets([20, 30])
    q, k, v = torch.randn(50, 4, 16, dtype=F16), torch.randn(50, 2, 16, dtype=F16), torch.randn(50, 2, 16, dtype=F16)
    k_pool, v_pool, table = paged_copy(k, v, cu, 8)
    with pytest.raises(exc, match=message):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 30, 30, block_table=mutate(table))


def test_paged_refuses_gradients():
    cu = offsets([10])
    q = torch.randn(10, 2, 16, dtype=F16, requires_grad=True)
    k_pool, v_pool, table = paged_copy(torch.randn(10, 2, 16, dtype=F16), torch.randn(10, 2, 16, dtype=F16), cu, 4)
    with pytest.raises(NotImplementedError, match="paged"):
        flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, 10, 10, block_table=table)


def test_offsets_checked_once_per_tensor_version():
    cu = offsets([10, 20])
    q, k = torch.randn(30, 4, 16, dtype=F16), torch.randn(30, 2, 16, dtype=F16)
    flashtile.flash_attn_varlen_func(q, k, k, cu, cu, 20, 20)
    cu[1] = 25  # an in-place change bumps the version: checked again, and refused
    with pytest.raises(ValueError, match="max_seqlen_q is 20 but a sequence has 25"):
        flashtile.flash_attn_varlen_func(q, k, k, cu, cu, 20, 20)


def test_new_key_offsets_are_checked_whatever_their_id():
    """cu_seqlens_q kept, cu_seqlens_k made anew: the new offsets are checked even when the new
    tensor gets the freed one's id (CPython reuses them) and version (0 for both)."""
    import gc

    cu_q = offsets([10, 20])
    q, k = torch.randn(30, 4, 16, dtype=F16), torch.randn(30, 2, 16, dtype=F16)
    cu_k = offsets([10, 20])
    flashtile.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 20, 20)
    old_id = id(cu_k)
    del cu_k
    gc.collect()
    for _ in range(1000):  # look for the recycled id, so the check below meets the case it is for
        bad_k = torch.tensor([0, 5, 30], dtype=torch.int32)  # a sequence of 25 keys
        if id(bad_k) == old_id:
            break
    assert bad_k._version == 0
    with pytest.raises(ValueError, match="max_seqlen_k is 20 but a sequence has 25"):
        flashtile.flash_attn_varlen_func(q, k, k, cu_q, bad_k, 20, 20)


def test_tensor_descriptor_path_with_empty_sequences():
    """The Hopper (TMA) path builds a descriptor per sequence: empty ones, last one included, too."""
    from flashtile.kernels.forward import TileConfig, attention_forward

    lengths_q, lengths_k = [0, 37, 5, 0], [3, 50, 0, 0]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = torch.randn(sum(lengths_q), 4, 64, dtype=F16)
    k, v = torch.randn(sum(lengths_k), 2, 64, dtype=F16), torch.randn(sum(lengths_k), 2, 64, dtype=F16)
    args = dict(softmax_scale=0.125, window_left=-1, window_right=0, diag_offset=0, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=37)
    pointers = attention_forward(q, k, v, config=TileConfig(32, 32, 4, 1), **args)
    descriptors = attention_forward(q, k, v, config=TileConfig(32, 32, 4, 1, use_tma=True), **args)
    assert torch.equal(pointers[0], descriptors[0]) and torch.equal(pointers[1], descriptors[1])
    assert torch.all(descriptors[0][37:] == 0)  # sequence 2 sees no key


def test_vllm_keywords_out_num_splits_and_lse(monkeypatch):
    """vLLM's flash_attn_varlen_func keywords: ``out`` receives the output and is what is returned,
    ``return_softmax_lse`` gives (out, lse) as return_attn_probs does without its third item,
    ``num_splits`` reaches the split-KV decode of decode steps on page pools, ``scheduler_metadata`` is
    taken and unused."""
    from flashtile import interface
    splits = []
    real = interface.ops.kvcache
    monkeypatch.setattr(interface.ops, "kvcache", lambda *a, **kw: splits.append(a[11]) or real(*a, **kw))
    lens_q, lens_k = [1, 2, 0, 1], [40, 9, 3, 70]
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = torch.randn(sum(lens_q), 8, 32, dtype=BF16)
    k, v = torch.randn(sum(lens_k), 2, 32, dtype=BF16), torch.randn(sum(lens_k), 2, 32, dtype=BF16)
    k_pool, v_pool, table = paged_copy(k, v, cu_k, 8)
    used = cu_k[1:] - cu_k[:-1]
    kw = dict(block_table=table, seqused_k=used, causal=True)
    expected, expected_lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70,
                                                                 return_attn_probs=True, **kw)
    out = torch.full_like(q, float("nan"))
    given, lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70, out=out,
                                                  return_softmax_lse=True, scheduler_metadata=torch.zeros(3), **kw)
    assert given is out and torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70, out=out, **kw) is out
    flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70, num_splits=3, **kw)
    assert splits == [0, 0, 0, 3]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_vllm_out_takes_the_decode_rows_without_a_copy(fp8, monkeypatch):
    """On the decode route the row move writes into ``out`` itself (no copy after the call), with the
    LSE and the sinks too; an ``out`` whose head dim is strided gets a copy. Bit for bit the call
    without ``out``."""
    from flashtile import interface
    moved_into = []
    real_unblock = interface.ops.unblock
    monkeypatch.setattr(interface.ops, "unblock",
                        lambda *a, **k: moved_into.append(a[4] if len(a) > 4 else None) or real_unblock(*a, **k))
    copies = []
    lens_q, lens_k = [1, 2, 0, 1], [40, 9, 3, 70]
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = torch.randn(sum(lens_q), 8, 32, dtype=BF16)
    k, v = torch.randn(sum(lens_k), 2, 32, dtype=BF16), torch.randn(sum(lens_k), 2, 32, dtype=BF16)
    k_pool, v_pool, table = paged_copy(k, v, cu_k, 8)
    kw = dict(block_table=table, seqused_k=cu_k[1:] - cu_k[:-1], causal=True, s_aux=torch.randn(8))
    if fp8:
        q, k_pool, v_pool = (t.to(torch.float8_e4m3fn) for t in (q, k_pool, v_pool))
    expected, expected_lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70,
                                                              return_softmax_lse=True, **kw)
    for strided in (False, True):
        moved_into.clear()
        base = torch.full((q.shape[0], 8, 64), float("nan"), dtype=BF16)
        out = base[..., ::2] if strided else base[..., :32]
        real_copy = out.copy_
        monkeypatch.setattr(out, "copy_", lambda *a: copies.append(1) or real_copy(*a), raising=False)
        given, lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 2, 70, out=out,
                                                      return_softmax_lse=True, **kw)
        assert given is out and torch.equal(out, expected) and torch.equal(lse, expected_lse)
        assert (moved_into[-1] is None) == strided and len(copies) == int(strided)


@pytest.mark.parametrize("overrides,exc,message", [
    (dict(out=torch.zeros(5, 4, 16, dtype=F16)), TypeError, "out must have dtype torch.bfloat16"),
    (dict(out=torch.zeros(4, 4, 16, dtype=BF16)), ValueError, r"out must have shape \(5, 4, 16\)"),
    (dict(out=[0]), TypeError, "out must be a torch.Tensor"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(scheduler_metadata="plan"), TypeError, "scheduler_metadata"),
], ids=["out-dtype", "out-shape", "out-type", "splits", "scheduler-metadata"])
def test_vllm_keywords_bad_input_is_named(overrides, exc, message):
    q, k = torch.randn(5, 4, 16, dtype=BF16), torch.randn(5, 2, 16, dtype=BF16)
    with pytest.raises(exc, match=message):
        flashtile.flash_attn_varlen_func(q, k, k, offsets([2, 3]), offsets([2, 3]), 3, 3, **overrides)


def test_vllm_out_is_forward_only():
    q = torch.randn(5, 4, 16, dtype=BF16, requires_grad=True)
    k = torch.randn(5, 2, 16, dtype=BF16)
    with pytest.raises(NotImplementedError, match="out= is forward-only"):
        flashtile.flash_attn_varlen_func(q, k, k, offsets([2, 3]), offsets([2, 3]), 3, 3,
                                         out=torch.empty(5, 4, 16, dtype=BF16))


def test_vllm_out_compiles_with_fullgraph():
    cu = offsets([1, 2, 0, 1])
    q = torch.randn(4, 8, 32, dtype=BF16)
    k_pool, v_pool, table = paged_copy(torch.randn(20, 2, 32, dtype=BF16), torch.randn(20, 2, 32, dtype=BF16),
                                       offsets([4, 9, 3, 4]), 8)
    used = torch.tensor([4, 9, 3, 4], dtype=torch.int32)

    def fn(q, out):
        return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu, None, 2, 9, block_table=table, seqused_k=used,
                                                causal=True, out=out, return_softmax_lse=True)
    torch._dynamo.reset()
    eager, eager_lse = fn(q, torch.empty_like(q))
    out = torch.full_like(q, float("nan"))
    compiled, compiled_lse = torch.compile(fn, fullgraph=True)(q, out)
    assert torch.equal(out, eager) and torch.equal(compiled, eager) and torch.equal(compiled_lse, eager_lse)
