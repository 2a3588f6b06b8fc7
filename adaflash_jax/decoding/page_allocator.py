"""Pages of one KV pool, handed to decode slots as their sequences grow.

A contiguous cache reserves `max_prompt_len + max_new_tokens` positions per slot,
and every step attends over all of them. A paged cache keeps one pool of fixed-size
pages (`page_size` positions each) and a page table per slot: position `p` of slot
`s` lives at page `table[s, p // page_size]`, offset `p % page_size`. A slot holds
only the pages its committed and in-flight tokens need, so memory and attention
follow the live lengths, not the longest request the server could get.

This is the host-side bookkeeping (numpy, no device work): the engine reads
`table` into its step programs, and the scheduler admits by `free_pages`.

- `grow(slot, n)` makes positions `[0, n)` of a slot writable, taking pages from
  the pool, all or none (`OutOfPages`: the caller queues the request).
- `truncate(slot, n)` returns the pages past position `n`: a rejected speculative
  suffix, rolled back whole pages at a time.
- `release(slot)` returns all of a slot's pages when its request ends.
- `share_prefix(src, dst, n)` gives an empty slot the full pages of another slot's
  first `n` positions (a shared system prompt), reference-counted: a page returns
  to the pool when its last holder lets go. Shared pages are read-only for the
  sharer (`writable_from`), so only full pages are ever shared.

Unused table entries hold `NO_PAGE` (= `num_pages`, one past the pool): a gather
from it is out of range and a scatter to it is dropped (`mode="drop"`), so a step
never touches a page it does not own.
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request asked for (it should wait, not fail)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, slots: int, max_pages_per_slot: int):
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("slots", slots),
                            ("max_pages_per_slot", max_pages_per_slot)):
            if int(value) < 1:
                raise ValueError(f"PageAllocator: {name} must be >= 1, got {value}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.max_pages_per_slot = int(max_pages_per_slot)
        self.no_page = self.num_pages
        self.refcount = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: low page ids go first
        self.table = np.full((int(slots), self.max_pages_per_slot), self.no_page, np.int32)
        self.held = np.zeros(int(slots), np.int32)  # pages in each slot's table
        self.shared = np.zeros(int(slots), np.int32)  # leading pages another slot also holds

    @property
    def slots(self) -> int:
        return self.table.shape[0]

    @property
    def max_len(self) -> int:
        """The most positions one slot can hold."""
        return self.max_pages_per_slot * self.page_size

    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, positions: int) -> int:
        """Pages that `positions` positions take (a partly used last page counts whole)."""
        return -(-int(positions) // self.page_size)

    def capacity(self, slot: int) -> int:
        """Positions the slot can write without growing."""
        return int(self.held[slot]) * self.page_size

    def writable_from(self, slot: int) -> int:
        """The first position the slot may write: positions before it are on shared pages."""
        return int(self.shared[slot]) * self.page_size

    def can_grow(self, slot: int, positions: int) -> bool:
        need = self.pages_for(positions)
        return need <= self.max_pages_per_slot and need - int(self.held[slot]) <= self.free_pages()

    def grow(self, slot: int, positions: int) -> None:
        """Makes positions [0, positions) of the slot writable: all the pages it needs, or none."""
        need = self.pages_for(positions)
        if need > self.max_pages_per_slot:
            raise ValueError(f"slot {slot}: {positions} positions need {need} pages, more than the "
                             f"{self.max_pages_per_slot} a slot may hold ({self.max_len} positions)")
        have = int(self.held[slot])
        if need - have > self.free_pages():
            raise OutOfPages(f"slot {slot} needs {need - have} more pages; {self.free_pages()} are free")
        for i in range(have, need):
            page = self._free.pop()
            self.refcount[page] = 1
            self.table[slot, i] = page
        self.held[slot] = max(have, need)

    def truncate(self, slot: int, positions: int) -> None:
        """Returns the slot's pages past position `positions` (a rejected suffix): the pages that
        hold positions [0, positions) stay."""
        keep = self.pages_for(positions)
        if 0 < positions < self.writable_from(slot):  # it would write into a shared page next
            raise ValueError(f"slot {slot}: cannot roll back to {positions} positions, inside its "
                             f"shared prefix of {self.writable_from(slot)}")
        for i in range(keep, int(self.held[slot])):
            self._drop(int(self.table[slot, i]))
            self.table[slot, i] = self.no_page
        self.held[slot] = min(int(self.held[slot]), keep)
        self.shared[slot] = min(int(self.shared[slot]), keep)

    def release(self, slot: int) -> None:
        """Returns every page of the slot (its request ended)."""
        self.truncate(slot, 0)

    def share_prefix(self, src: int, dst: int, positions: int) -> int:
        """Gives the empty slot `dst` the full pages of `src`'s first `positions` positions, and
        returns how many positions it got (a multiple of `page_size`: a partly filled page
        stays `src`'s own, since both would write it)."""
        if src == dst:
            raise ValueError(f"slot {src} cannot share a prefix with itself")
        if self.held[dst]:
            raise ValueError(f"slot {dst} holds pages already: a prefix is shared into an empty slot")
        full = min(int(positions) // self.page_size, int(self.held[src]))
        pages = self.table[src, :full]
        self.refcount[pages] += 1
        self.table[dst, :full] = pages
        self.held[dst] = full
        self.shared[dst] = full
        if full:
            self.shared[src] = max(int(self.shared[src]), full)
        return full * self.page_size

    def _drop(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def check(self) -> None:
        """Asserts the bookkeeping's invariants (tests call it after every operation)."""
        cols = np.arange(self.max_pages_per_slot)[None]
        held = cols < self.held[:, None]
        assert np.all((self.table < self.num_pages) == held), "a held entry is NO_PAGE, or a page past the held ones"
        pages = np.sort(np.where(held, self.table, -1 - cols), axis=1)  # unheld entries: distinct negatives
        assert np.all(pages[:, 1:] != pages[:, :-1]), "a slot holds a page twice"
        assert np.all((0 <= self.shared) & (self.shared <= self.held))
        counts = np.bincount(self.table[held], minlength=self.num_pages)
        assert np.array_equal(counts, self.refcount), "a page's refcount differs from its holders"
        free = np.asarray(self._free, np.int64)
        assert len(np.unique(free)) == len(free), "a page is free twice"
        assert np.array_equal(np.sort(free), np.flatnonzero(counts == 0)), "the free list differs from the unheld pages"
