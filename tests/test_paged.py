"""PagedKVCache: page allocation, copy-on-write forks, reference counts, and the tensors the kernels read."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.paged import OutOfPagesError, PagedKVCache

BF16 = torch.bfloat16
HK, D = 2, 8


def make_cache(num_blocks=32, page_size=4, **kw):
    return PagedKVCache(num_blocks, page_size, HK, D, device="cpu", **kw)


def tokens(n, heads=HK, dim=D, dtype=BF16):
    return torch.randn(n, heads, dim, dtype=dtype), torch.randn(n, heads, dim, dtype=dtype)


def append(cache, seq_id, n, store):
    """Append n random tokens to seq_id and remember them in store[seq_id] = (k_list, v_list)."""
    k, v = tokens(n)
    cache.append(seq_id, k, v)
    ks, vs = store.setdefault(seq_id, ([], []))
    ks.append(k), vs.append(v)
    return k, v


def expected(store, seq_id):
    ks, vs = store.get(seq_id, ([], []))
    return torch.cat(ks + [torch.empty(0, HK, D, dtype=BF16)]), torch.cat(vs + [torch.empty(0, HK, D, dtype=BF16)])


def snapshot(cache):
    return (cache.k_pool.clone(), cache.v_pool.clone(), list(cache._free), list(cache._refs),
            {i: (cache.pages(i), cache.seq_len(i)) for i in cache.seq_ids})


def assert_same_state(cache, snap):
    k_pool, v_pool, free, refs, seqs = snap
    assert torch.equal(cache.k_pool, k_pool) and torch.equal(cache.v_pool, v_pool)
    assert cache._free == free and cache._refs == refs
    assert {i: (cache.pages(i), cache.seq_len(i)) for i in cache.seq_ids} == seqs


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_append_across_pages_gathers_the_same_tokens(page_size):
    cache = make_cache(num_blocks=64, page_size=page_size)
    a, b = cache.add_sequence(), cache.add_sequence()
    store = {}
    # Interleaved appends of odd sizes scatter both sequences' pages through the pool.
    for n_a, n_b in [(1, 5), (5, 0), (2, 16), (17, 1), (0, 3), (9, 2)]:
        append(cache, a, n_a, store), append(cache, b, n_b, store)
    for seq_id in (a, b):
        k_ref, v_ref = expected(store, seq_id)
        k, v = cache.gather(seq_id)
        assert k.shape == (len(k_ref), HK, D) and k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert cache.seq_len(seq_id) == len(k_ref)
        pages = cache.pages(seq_id)
        assert len(pages) == -(-len(k_ref) // page_size)
        # The layout the kernels read: token t in page pages[t // P], slot t % P.
        for t in range(len(k_ref)):
            assert torch.equal(cache.k_pool[pages[t // page_size], t % page_size], k_ref[t])
            assert torch.equal(cache.v_pool[pages[t // page_size], t % page_size], v_ref[t])
    assert not set(cache.pages(a)) & set(cache.pages(b))
    used = len(cache.pages(a)) + len(cache.pages(b))
    assert cache.num_free_pages == 64 - used


def test_new_page_only_when_the_last_one_fills():
    cache = make_cache(num_blocks=8, page_size=4)
    s, store = cache.add_sequence(), {}
    assert cache.pages(s) == [] and cache.num_free_pages == 8
    append(cache, s, 3, store)
    assert len(cache.pages(s)) == 1
    append(cache, s, 1, store)
    assert len(cache.pages(s)) == 1 and cache.num_free_pages == 7
    append(cache, s, 1, store)
    assert len(cache.pages(s)) == 2 and cache.num_free_pages == 6
    k, v = cache.gather(s)
    assert torch.equal(k, expected(store, s)[0]) and torch.equal(v, expected(store, s)[1])


def test_large_append_and_gradients_stay_out_of_the_pool():
    cache = make_cache(num_blocks=80, page_size=16)
    s = cache.add_sequence()
    k, v = tokens(1000)
    k.requires_grad_(True)
    cache.append(s, k, v)
    assert not cache.k_pool.requires_grad and cache.k_pool.grad_fn is None
    got_k, got_v = cache.gather(s)
    assert torch.equal(got_k, k.detach()) and torch.equal(got_v, v)


def test_empty_sequence_gathers_nothing():
    cache = make_cache()
    s = cache.add_sequence()
    cache.append(s, *tokens(0))
    k, v = cache.gather(s)
    assert k.shape == (0, HK, D) and v.shape == (0, HK, D) and cache.pages(s) == []


def test_fork_copies_only_the_shared_partial_page():
    cache = make_cache(num_blocks=16, page_size=4)
    parent, store = cache.add_sequence(), {}
    append(cache, parent, 10, store)  # pages: full, full, partial (2 of 4)
    full_a, full_b, partial = cache.pages(parent)
    child = cache.fork(parent)
    store[child] = tuple(list(x) for x in store[parent])
    assert cache.pages(child) == [full_a, full_b, partial] and cache.seq_len(child) == 10
    assert [cache.ref_count(p) for p in (full_a, full_b, partial)] == [2, 2, 2]
    free_before = cache.num_free_pages

    append(cache, child, 3, store)  # into the shared partial page: the child copies it first
    child_pages = cache.pages(child)
    assert child_pages[:2] == [full_a, full_b]  # full pages stay shared, never copied
    assert child_pages[2] not in (full_a, full_b, partial) and len(child_pages) == 4
    assert cache.pages(parent) == [full_a, full_b, partial]
    assert [cache.ref_count(p) for p in (full_a, full_b, partial)] == [2, 2, 1]
    assert cache.num_free_pages == free_before - 2  # the copy + one page for token 12

    append(cache, parent, 1, store)  # the parent is now the partial page's only holder: it writes in place
    assert cache.pages(parent) == [full_a, full_b, partial]
    assert cache.num_free_pages == free_before - 2

    for seq_id in (parent, child):
        k, v = cache.gather(seq_id)
        k_ref, v_ref = expected(store, seq_id)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert cache.seq_len(parent) == 11 and cache.seq_len(child) == 13
    assert not torch.equal(cache.gather(parent)[0][10], cache.gather(child)[0][10])


def test_parent_appending_first_gets_the_copy():
    cache = make_cache(num_blocks=16, page_size=3)
    parent, store = cache.add_sequence(), {}
    append(cache, parent, 4, store)
    child = cache.fork(parent)
    store[child] = tuple(list(x) for x in store[parent])
    shared = cache.pages(parent)
    append(cache, parent, 1, store)
    assert cache.pages(parent)[0] == shared[0] and cache.pages(parent)[1] != shared[1]
    assert cache.pages(child) == shared
    append(cache, child, 2, store)
    assert cache.pages(child) == shared  # sole holder now: no copy
    for seq_id in (parent, child):
        assert torch.equal(cache.gather(seq_id)[0], expected(store, seq_id)[0])
        assert torch.equal(cache.gather(seq_id)[1], expected(store, seq_id)[1])


def test_fork_on_a_page_boundary_copies_nothing():
    cache = make_cache(num_blocks=16, page_size=4)
    parent, store = cache.add_sequence(), {}
    append(cache, parent, 8, store)
    child = cache.fork(parent)
    store[child] = tuple(list(x) for x in store[parent])
    shared = cache.pages(parent)
    append(cache, parent, 2, store), append(cache, child, 5, store)
    assert cache.pages(parent)[:2] == shared and cache.pages(child)[:2] == shared
    assert len(set(cache.pages(parent)[2:]) | set(cache.pages(child)[2:])) == 3
    assert cache.num_free_pages == 16 - 5
    for seq_id in (parent, child):
        assert torch.equal(cache.gather(seq_id)[0], expected(store, seq_id)[0])


def test_free_returns_pages_when_the_last_holder_goes():
    cache = make_cache(num_blocks=16, page_size=4)
    a, store = cache.add_sequence(), {}
    append(cache, a, 9, store)  # 3 pages
    b = cache.fork(a)
    c = cache.fork(b)
    shared = cache.pages(a)
    assert [cache.ref_count(p) for p in shared] == [3, 3, 3]
    append(cache, c, 4, store)  # c: copy of the partial page + 1 new page
    c_own = cache.pages(c)[2:]
    assert cache.num_free_pages == 16 - 5

    cache.free(a)
    assert [cache.ref_count(p) for p in shared] == [2, 2, 1]
    assert cache.num_free_pages == 16 - 5 and a not in cache
    cache.free(b)
    assert [cache.ref_count(p) for p in shared] == [1, 1, 0]
    assert cache.num_free_pages == 16 - 4 and shared[2] in cache._free
    cache.free(c)
    assert all(cache.ref_count(p) == 0 for p in shared + c_own)
    assert cache.num_free_pages == 16 and sorted(cache._free) == list(range(16))
    with pytest.raises(ValueError, match="seq_id"):
        cache.gather(c)
    d = cache.add_sequence()  # freed pages are reused
    cache.append(d, *tokens(64))
    assert cache.num_free_pages == 0 and sorted(cache.pages(d)) == list(range(16))


def test_out_of_pages_leaves_the_cache_unchanged():
    cache = make_cache(num_blocks=4, page_size=3)
    a, store = cache.add_sequence(), {}
    append(cache, a, 7, store)  # 3 pages, the last one partial
    b = cache.fork(a)
    store[b] = tuple(list(x) for x in store[a])
    before = snapshot(cache)
    # 5 more tokens take b to 12 = 4 pages: 1 new page + a copy of the shared partial page; 1 is free.
    with pytest.raises(OutOfPagesError, match=r"needs 2 new pages.*only 1 of 4 are free") as info:
        cache.append(b, *tokens(5))
    assert isinstance(info.value, RuntimeError) and (info.value.needed, info.value.free) == (2, 1)
    assert_same_state(cache, before)
    with pytest.raises(OutOfPagesError, match="needs 2 new pages"):
        cache.append(cache.add_sequence(), *tokens(4))
    assert cache.pages(a) == before[4][a][0]

    append(cache, b, 2, store)  # only the copy is needed now: fits
    assert cache.num_free_pages == 0
    for seq_id in (a, b):
        assert torch.equal(cache.gather(seq_id)[0], expected(store, seq_id)[0])
        assert torch.equal(cache.gather(seq_id)[1], expected(store, seq_id)[1])


def test_max_pages_per_seq_is_enforced_and_fixes_the_table_width():
    cache = make_cache(num_blocks=16, page_size=4, max_pages_per_seq=3)
    s, store = cache.add_sequence(), {}
    append(cache, s, 10, store)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_pages_per_seq=3"):
        cache.append(s, *tokens(3))
    assert_same_state(cache, before)
    append(cache, s, 2, store)
    table = cache.block_table([s, cache.add_sequence()])
    assert table.shape == (2, 3) and table[1].tolist() == [0, 0, 0]


def test_block_table_seq_lens_and_cu_seqlens():
    cache = make_cache(num_blocks=32, page_size=3)
    a, b, c, store = cache.add_sequence(), cache.add_sequence(), cache.add_sequence(), {}
    append(cache, a, 5, store), append(cache, b, 1, store), append(cache, a, 4, store)
    empty = cache.add_sequence()
    d = cache.fork(a)
    ids = [a, b, c, empty, d]
    table = cache.block_table(ids)
    assert table.dtype == torch.int32 and table.device == cache.k_pool.device and table.is_contiguous()
    assert table.shape == (5, 3)
    assert table[0].tolist() == cache.pages(a) and table[4].tolist() == cache.pages(a)
    assert table[1].tolist() == cache.pages(b) + [0, 0]
    assert table[2].tolist() == [0, 0, 0] and table[3].tolist() == [0, 0, 0]
    assert 0 <= table.min() and table.max() < cache.num_blocks
    lens = cache.seq_lens(ids)
    assert lens.dtype == torch.int32 and lens.tolist() == [9, 1, 0, 0, 9]
    cu = cache.cu_seqlens(ids)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 10, 10, 10, 19]
    assert cache.max_seqlen(ids) == 9
    assert cache.block_table([b, b]).tolist() == [cache.pages(b)] * 2  # width follows the longest listed
    assert cache.block_table([]).shape == (0, 1) and cache.cu_seqlens([]).tolist() == [0]


def _bad_calls():
    def cache_with_seq():
        cache = make_cache()
        return cache, cache.add_sequence()

    def append_call(k, v, seq=None):
        def call():
            cache, s = cache_with_seq()
            cache.append(s if seq is None else seq, k(), v())
        return call

    good = lambda: torch.randn(2, HK, D, dtype=BF16)  # noqa: E731
    return [
        pytest.param(lambda: PagedKVCache(0, 4, HK, D), ValueError, "num_blocks", id="num-blocks-0"),
        pytest.param(lambda: PagedKVCache(8, 2.0, HK, D), TypeError, "page_size", id="page-size-float"),
        pytest.param(lambda: PagedKVCache(8, 4, -1, D), ValueError, "num_kv_heads", id="heads-negative"),
        pytest.param(lambda: PagedKVCache(8, 4, HK, D, dtype="bf16"), TypeError, "dtype", id="dtype-str"),
        pytest.param(lambda: PagedKVCache(8, 4, HK, D, device="cpu", max_pages_per_seq=0), ValueError,
                     "max_pages_per_seq", id="max-pages-0"),
        pytest.param(append_call(lambda: torch.randn(2, HK, D), good), TypeError, "k has dtype", id="k-dtype"),
        pytest.param(append_call(good, lambda: torch.randn(2, HK + 1, D, dtype=BF16)), ValueError,
                     r"v must have shape \(n_tokens, 2, 8\)", id="v-heads"),
        pytest.param(append_call(lambda: torch.randn(2, HK * D, dtype=BF16), good), ValueError,
                     "k must have shape", id="k-2d"),
        pytest.param(append_call(good, lambda: torch.randn(3, HK, D, dtype=BF16)), ValueError,
                     "same number of tokens", id="token-count"),
        pytest.param(append_call(lambda: good().tolist(), good), TypeError, "k must be a torch.Tensor", id="k-list"),
        pytest.param(append_call(good, good, seq=7), ValueError, "seq_id 7 is not a live sequence", id="unknown"),
        pytest.param(append_call(good, good, seq="0"), TypeError, "seq_id must be an int", id="seq-str"),
        pytest.param(lambda: make_cache().fork(3), ValueError, "seq_id 3", id="fork-unknown"),
        pytest.param(lambda: make_cache().free(0), ValueError, "seq_id 0", id="free-unknown"),
        pytest.param(lambda: make_cache().block_table(0), TypeError, "seq_ids", id="table-int"),
        pytest.param(lambda: make_cache().ref_count(32), ValueError, "page", id="page-out-of-range"),
    ]


@pytest.mark.parametrize("call,exc,message", _bad_calls())
def test_bad_arguments_are_named(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_free_twice_is_an_error():
    cache = make_cache()
    s = cache.add_sequence()
    cache.append(s, *tokens(5))
    cache.free(s)
    with pytest.raises(ValueError, match="already freed"):
        cache.free(s)
    assert cache.num_free_pages == 32


def test_varlen_attention_through_the_cache_matches_packed_keys():
    page_size = 3
    cache = PagedKVCache(24, page_size, HK, 32, dtype=BF16, device="cpu")
    cache.k_pool.normal_(), cache.v_pool.normal_()  # noise in unused slots: reading one would show
    store = {}

    def add(seq_id, n):
        k, v = torch.randn(n, HK, 32, dtype=BF16), torch.randn(n, HK, 32, dtype=BF16)
        cache.append(seq_id, k, v)
        ks, vs = store.setdefault(seq_id, ([], []))
        ks.append(k), vs.append(v)

    a, b = cache.add_sequence(), cache.add_sequence()
    add(a, 5), add(b, 2), add(a, 3)
    c = cache.fork(a)  # shares a's pages; a's last page is partial (8 = 2 * 3 + 2)
    store[c] = tuple(list(x) for x in store[a])
    add(c, 5), add(b, 2), add(a, 3)
    ids = [a, b, c]
    assert [cache.seq_len(i) for i in ids] == [11, 4, 13]
    assert cache.pages(a)[:2] == cache.pages(c)[:2]

    k_packed = torch.cat([cache.gather(i)[0] for i in ids])
    v_packed = torch.cat([cache.gather(i)[1] for i in ids])
    assert torch.equal(k_packed, torch.cat([torch.cat(store[i][0]) for i in ids]))
    assert torch.equal(v_packed, torch.cat([torch.cat(store[i][1]) for i in ids]))

    lengths_q = [3, 1, 5]
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 32, dtype=BF16)
    cu_k, max_k = cache.cu_seqlens(ids), cache.max_seqlen(ids)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, cache.k_pool, cache.v_pool, cu_q, cu_k, max(lengths_q), max_k,
                                                   block_table=cache.block_table(ids), causal=True,
                                                   return_attn_probs=True)
    ref, ref_lse, _ = flashtile.flash_attn_varlen_func(q, k_packed, v_packed, cu_q, cu_k, max(lengths_q), max_k,
                                                       causal=True, return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
