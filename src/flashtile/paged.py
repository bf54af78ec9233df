"""A page allocator for a paged KV cache, in the layout flashtile's kernels read.

K and V live in two page pools of shape (num_blocks, page_size, num_kv_heads, head_dim). A sequence is an
ordered list of pages: its token t sits in page ``pages[t // page_size]``, slot ``t % page_size``.
``block_table``/``seq_lens``/``cu_seqlens`` turn a batch of sequences into the int32 tensors that
``flash_attn_varlen_func(..., block_table=...)`` takes.

Pages are shared by reference count: ``fork`` gives the child every page of its parent, and a page returns
to the free list only when no sequence holds it. A full page is never written again, so it stays shared
for good; a shared partial page is copied by whichever sequence appends to it first (copy-on-write).

Example::

    cache = PagedKVCache(num_blocks=256, page_size=16, num_kv_heads=8, head_dim=128)
    a = cache.add_sequence()
    cache.append(a, k_prompt, v_prompt)          # (n_tokens, 8, 128) each
    b = cache.fork(a)                            # shares a's pages
    ids = [a, b]
    out = flash_attn_varlen_func(q, cache.k_pool, cache.v_pool, cu_seqlens_q, cache.cu_seqlens(ids),
                                 max_seqlen_q, cache.max_seqlen(ids), block_table=cache.block_table(ids))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["OutOfPagesError", "PagedKVCache"]


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than an append needs; the cache is left as it was."""

    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed = needed
        self.free = free


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


def _check_count(value, name: str) -> int:
    # bool is an int subclass, but PagedKVCache(True, ...) is surely a mistake
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """K/V page pools, a free list of pages and the pages of each live sequence.

    ``device`` defaults to CUDA when it is available, else the CPU. ``max_pages_per_seq`` caps a
    sequence's length at ``max_pages_per_seq * page_size`` tokens and fixes the width of
    ``block_table`` (a constant shape suits CUDA graphs); without it the table is as wide as the
    longest sequence asked for.
    """

    def __init__(self, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_pages_per_seq: int | None = None):
        self.num_blocks = _check_count(num_blocks, "num_blocks")
        self.page_size = _check_count(page_size, "page_size")
        self.num_kv_heads = _check_count(num_kv_heads, "num_kv_heads")
        self.head_dim = _check_count(head_dim, "head_dim")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must name a torch device, got {device!r}") from e
        if max_pages_per_seq is not None:
            _check_count(max_pages_per_seq, "max_pages_per_seq")
        self.max_pages_per_seq = max_pages_per_seq

        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        # Zeros, not torch.empty: slots past a sequence's end are never meant to be read, but if a kernel
        # ever loads one it should meet a finite value rather than leftover NaN/Inf bits.
        self.k_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.device = self.k_pool.device  # "cuda" becomes "cuda:0", which is what tensors report
        # A stack popped from the end: fresh pages come out 0, 1, 2, ... and a freed page is reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0  # ids are never reused, so a stale id fails loudly instead of naming a stranger

    # ---- queries -----------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pool.dtype

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_len(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def pages(self, seq_id: int) -> list[int]:
        """The physical pages of a sequence, in logical order (a copy)."""
        return list(self._get(seq_id).pages)

    def ref_count(self, page: int) -> int:
        """How many sequences hold ``page`` (0 for a free page)."""
        if isinstance(page, bool) or not isinstance(page, int):
            raise TypeError(f"page must be an int, got {type(page).__name__}")
        if not 0 <= page < self.num_blocks:
            raise ValueError(f"page must be in [0, {self.num_blocks}), got {page}")
        return self._refs[page]

    # ---- sequences ---------------------------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new empty sequence; it takes no page until its first append."""
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = _Sequence()
        return seq_id

    new_sequence = add_sequence

    def fork(self, seq_id: int) -> int:
        """A new sequence with the same tokens, sharing every page of ``seq_id`` (no copy now)."""
        parent = self._get(seq_id)
        child = self.add_sequence()
        self._seqs[child] = _Sequence(list(parent.pages), parent.length)
        for page in parent.pages:
            self._refs[page] += 1
        return child

    def free(self, seq_id: int) -> None:
        """Drop a sequence; its pages go back to the pool once no other sequence holds them."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for page in seq.pages:
            self._release(page)

    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k and v, each (n_tokens, num_kv_heads, head_dim), after the sequence's last token.

        Raises OutOfPagesError, with the cache unchanged, when the pool lacks the pages it needs.
        """
        seq = self._get(seq_id)
        n = self._check_kv(k, v)
        if n == 0:
            return
        P = self.page_size
        start = seq.length
        pages_after = _cdiv(start + n, P)
        if self.max_pages_per_seq is not None and pages_after > self.max_pages_per_seq:
            raise ValueError(f"appending {n} tokens to sequence {seq_id} (length {start}) needs {pages_after} "
                             f"pages, more than max_pages_per_seq={self.max_pages_per_seq} "
                             f"({self.max_pages_per_seq * P} tokens)")
        # Only a partial last page can be written into; if another sequence holds it too, this sequence
        # must write into its own copy, which costs one more page.
        fill = start % P
        cow = fill != 0 and self._refs[seq.pages[-1]] > 1
        grow = pages_after - len(seq.pages)
        needed = grow + int(cow)
        # Everything is checked before anything changes, so a failed append leaves the cache intact.
        if needed > len(self._free):
            detail = f" ({grow} for new tokens + 1 copy-on-write copy)" if cow else ""
            raise OutOfPagesError(
                f"PagedKVCache is out of pages: appending {n} tokens to sequence {seq_id} needs {needed} "
                f"new pages{detail} but only {len(self._free)} of {self.num_blocks} are free",
                needed, len(self._free))

        with torch.no_grad():  # the cache is inference state: never let it join an autograd graph
            if cow:
                shared = seq.pages[-1]
                own = self._take()
                self.k_pool[own, :fill] = self.k_pool[shared, :fill]
                self.v_pool[own, :fill] = self.v_pool[shared, :fill]
                seq.pages[-1] = own
                self._release(shared)
            seq.pages.extend(self._take() for _ in range(grow))
            rows = self._rows(seq.pages, start, n)
            self._flat(self.k_pool).index_copy_(0, rows, k)
            self._flat(self.v_pool).index_copy_(0, rows, v)
        seq.length = start + n

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's keys and values as contiguous (length, num_kv_heads, head_dim) tensors."""
        seq = self._get(seq_id)
        rows = self._rows(seq.pages, 0, seq.length)
        return self._flat(self.k_pool).index_select(0, rows), self._flat(self.v_pool).index_select(0, rows)

    # ---- batches for the kernels -------------------------------------------------------------------

    def block_table(self, seq_ids) -> torch.Tensor:
        """int32 (len(seq_ids), max_pages) on the pool's device; row b lists sequence b's pages in order.

        Rows are padded with page 0, a valid page, so nothing past a sequence's length points outside
        the pool. The width is ``max_pages_per_seq`` when set, else the most pages any listed sequence has
        (at least 1).
        """
        seqs = self._get_many(seq_ids)
        width = self.max_pages_per_seq or max([len(s.pages) for s in seqs] + [1])
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(seqs), width)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """int32 (len(seq_ids),): each sequence's token count, on the pool's device."""
        return torch.tensor([s.length for s in self._get_many(seq_ids)], dtype=torch.int32, device=self.device)

    def cu_seqlens(self, seq_ids) -> torch.Tensor:
        """int32 (len(seq_ids) + 1,) offsets [0, len0, len0 + len1, ...], the varlen API's cu_seqlens_k."""
        offsets = [0]
        for s in self._get_many(seq_ids):
            offsets.append(offsets[-1] + s.length)
        return torch.tensor(offsets, dtype=torch.int32, device=self.device)

    def max_seqlen(self, seq_ids) -> int:
        """The longest listed sequence, as a Python int (max_seqlen_k without a device sync)."""
        return max([s.length for s in self._get_many(seq_ids)] + [0])

    # ---- internals ---------------------------------------------------------------------------------

    def _get(self, seq_id) -> _Sequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id} is not a live sequence (never added, or already freed)")
        return seq

    def _get_many(self, seq_ids) -> list[_Sequence]:
        if isinstance(seq_ids, (int, torch.Tensor)):
            raise TypeError(f"seq_ids must be a list or tuple of ints, got {type(seq_ids).__name__}")
        return [self._get(i) for i in seq_ids]

    def _check_kv(self, k, v) -> int:
        expected = (self.num_kv_heads, self.head_dim)
        for t, name in ((k, "k"), (v, "v")):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}")
            if t.dim() != 3 or tuple(t.shape[1:]) != expected:
                raise ValueError(f"{name} must have shape (n_tokens, {expected[0]}, {expected[1]}), "
                                 f"got {tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
        return k.shape[0]

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        # The pools are contiguous (allocated here), so (page, slot) flattens to row page * P + slot.
        return pool.view(self.num_blocks * self.page_size, self.num_kv_heads, self.head_dim)

    def _rows(self, pages: list[int], start: int, n: int) -> torch.Tensor:
        """Flat pool rows of tokens [start, start + n) of a sequence with these pages, on the device.

        Only the pages that hold those tokens cross to the device, so a one-token decode step sends one
        page number, not the whole table.
        """
        P = self.page_size
        first = start // P
        touched = torch.tensor(pages[first:_cdiv(start + n, P)], dtype=torch.int64, device=self.device)
        offsets = torch.arange(start - first * P, start - first * P + n, device=self.device)
        return touched[offsets // P] * P + offsets % P
