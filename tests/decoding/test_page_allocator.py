"""The paged KV cache's bookkeeping: pages never leak, never serve two owners, and shared
prefix pages are never written by a sharer, over random insert / step / evict / rollback /
share sequences drawn by hypothesis, checked against a model of every slot's contents."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash_jax.decoding.page_allocator import OutOfPages, PageAllocator

SLOTS, PAGES, PAGE, MAX_PAGES = 4, 12, 4, 6

OPS = st.lists(st.tuples(st.sampled_from(["append", "rollback", "release", "share"]),
                         st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1), st.integers(0, 3 * PAGE)),
               max_size=60)


class Pool:
    """The allocator beside a simulated pool: every written position holds a unique value, and
    each slot's expected contents are kept apart, so a read through the page table that sees
    another slot's write, or a sharer's write into a shared page, shows up."""

    def __init__(self):
        self.alloc = PageAllocator(PAGES, PAGE, SLOTS, MAX_PAGES)
        self.pool = np.full((PAGES + 1, PAGE), -1)  # the last row: NO_PAGE, where writes go nowhere
        self.contents = [[] for _ in range(SLOTS)]
        self.next_value = 0

    def write(self, slot: int, start: int, count: int) -> None:
        assert start >= self.alloc.writable_from(slot), "a write into a shared prefix page"
        for pos in range(start, start + count):
            page = self.alloc.table[slot, pos // PAGE]
            assert page != self.alloc.no_page, f"slot {slot} writes position {pos} without a page"
            self.pool[page, pos % PAGE] = self.next_value
            self.contents[slot].append(self.next_value)
            self.next_value += 1

    def read(self, slot: int) -> list[int]:
        n = len(self.contents[slot])
        pages = self.alloc.table[slot, np.arange(n) // PAGE]
        return self.pool[pages, np.arange(n) % PAGE].tolist()

    def apply(self, op: str, slot: int, other: int, count: int) -> None:
        a, length = self.alloc, len(self.contents[slot])
        if op == "append":  # a prefill or a verify step's tokens
            need = a.pages_for(length + count)
            fits = need <= MAX_PAGES and need - a.held[slot] <= a.free_pages()
            assert a.can_grow(slot, length + count) == fits
            if not fits:
                with pytest.raises((OutOfPages, ValueError)):
                    a.grow(slot, length + count)
                return
            a.grow(slot, length + count)
            self.write(slot, length, count)
        elif op == "rollback":  # a rejected speculative suffix, never into the shared prefix
            keep = max(a.writable_from(slot), length - count)
            a.truncate(slot, keep)
            del self.contents[slot][keep:]
            assert a.capacity(slot) == a.pages_for(keep) * PAGE
        elif op == "release":
            a.release(slot)
            self.contents[slot] = []
        elif op == "share" and slot != other and a.held[other] == 0:
            got = a.share_prefix(slot, other, min(count, length))
            assert got % PAGE == 0 and got <= min(count, length)
            self.contents[other] = self.contents[slot][:got]


@settings(max_examples=10_000, deadline=None)
@given(OPS)
def test_random_sequences_never_leak_or_mix_pages(ops):
    pool = Pool()
    for op in ops:
        pool.apply(*op)
        pool.alloc.check()
        for slot in range(SLOTS):
            assert pool.read(slot) == pool.contents[slot], f"slot {slot} reads another's data after {op}"
    for slot in range(SLOTS):
        pool.alloc.release(slot)
    pool.alloc.check()
    assert pool.alloc.free_pages() == PAGES


def test_a_full_pool_refuses_all_or_nothing():
    a = PageAllocator(num_pages=3, page_size=4, slots=2, max_pages_per_slot=3)
    a.grow(0, 9)  # 3 pages
    with pytest.raises(OutOfPages, match="slot 1 needs 1 more pages; 0 are free"):
        a.grow(1, 1)
    assert a.held[1] == 0 and a.free_pages() == 0  # nothing half-taken
    a.truncate(0, 4)
    a.grow(1, 8)
    a.check()


def test_bad_requests_are_refused_by_name():
    a = PageAllocator(num_pages=8, page_size=4, slots=2, max_pages_per_slot=2)
    with pytest.raises(ValueError, match="9 positions need 3 pages, more than the 2 a slot may hold"):
        a.grow(0, 9)
    a.grow(0, 8)
    assert a.share_prefix(0, 1, 7) == 4  # only the full page is shared
    with pytest.raises(ValueError, match="inside its shared prefix"):
        a.truncate(1, 2)
    with pytest.raises(ValueError, match="holds pages already"):
        a.share_prefix(0, 1, 4)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PageAllocator(0, 4, 1, 1)
