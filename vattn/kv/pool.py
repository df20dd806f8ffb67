"""The budget of physical pages: which are free, reference counts, and the
prefix hash each full page may carry.

Knows nothing about addresses, but places pages so that a slot's pages stay
consecutive: the host kernel merges a slot's consecutive pages into one
mapping entry per buffer, and a process has only `vm.max_map_count` of them
(with SmolLM2's 180 buffers, a few runs per slot use them all).  A slot grows
into the pages right after its last one while they are free
(`allocate(after=)`); a new run starts in the middle of the widest free run,
leaving its first half to the slot that ends before it.  (Handing out the
lowest free pages instead, slots that decode side by side interleave their
pages one by one.)

A page's hash (as nano-vllm keeps it on the block) names the tokens it holds
and every token before them, so a prefix-cache lookup finds pages by hash.
The hash goes when the page is freed or `forget` is told its tokens changed.

A pool over a shared budget (`vattn.kv.shared`) holds only some of its pages
at a time: `add` frees pages it comes to hold, `remove` takes free pages it
gives up; the pages it does not hold are neither free nor in use.  Such a
pool (`spread=False`) hands out the lowest free pages after a slot's own, so
its pages pack into few chunks and whole chunks can go back.
"""
import re
from collections import Counter

_FREE_RUN = re.compile(rb"\x01+")  # free pages, consecutive, in the map of which pages are free


class PagePool:
    def __init__(self, num_pages: int, held: bool = True, spread: bool = True):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages, self.spread = num_pages, spread
        self.refs = [0] * num_pages
        self._is_free = bytearray([held]) * num_pages  # 1 where the page is free
        self._held = [held] * num_pages
        self.num_held = self.num_free = num_pages if held else 0
        self.num_shared = 0  # pages with more than one reference
        self._hash: dict[int, tuple[int, tuple]] = {}  # page -> (hash, (salt, tokens)) of the prefix it ends
        self._by_hash: dict[int, set[int]] = {}  # hash -> pages carrying it

    @property
    def num_used(self) -> int:
        return self.num_held - self.num_free

    def free_pages(self) -> list[int]:
        return [p for run in _FREE_RUN.finditer(self._is_free) for p in range(*run.span())]

    def is_held(self, page: int) -> bool:
        return self._held[page]

    def add(self, pages: list[int]) -> None:
        """Come to hold `pages`, free."""
        if any(self._held[p] for p in pages):
            raise ValueError("a page added to the pool is held already")
        for p in pages:
            self._held[p] = True
        self._set_free(pages, True)
        self.num_held += len(pages)

    def remove(self, pages: list[int]) -> None:
        """Stop holding free `pages`."""
        if len(set(pages)) != len(pages) or not all(self._is_free[p] for p in pages):
            raise ValueError("only free pages, each once, can leave the pool")
        self._set_free(pages, False)
        for p in pages:
            self._held[p] = False
        self.num_held -= len(pages)

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` pages with one reference each, or None (and nothing taken): the
        free pages right after page `after` first (a slot growing in place),
        then runs placed as the module says."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            return None
        pages = []
        if after is not None:
            p = after + 1
            while len(pages) < n and p < self.num_pages and self._is_free[p]:
                pages.append(p)
                p += 1
            self._set_free(pages, False)
        while len(pages) < n:
            run = self._place(n - len(pages))
            self._set_free(run, False)
            pages += run
        for p in pages:
            self.refs[p] = 1
        return pages

    def _place(self, n: int) -> list[int]:
        """Up to `n` free pages, consecutive: the middle of the widest free run
        (its start where it begins the pool), or the lowest under `spread=False`."""
        if not self.spread:
            start = self._is_free.index(1)
            end = self._is_free.find(0, start, start + n)
            return list(range(start, start + n if end < 0 else end))
        run = max(_FREE_RUN.finditer(self._is_free), key=lambda r: r.end() - r.start())
        start, width = run.start(), run.end() - run.start()
        if width > n and start > 0:
            start += (width - n) // 2
        return list(range(start, start + min(n, width)))

    def _set_free(self, pages: list[int], free: bool) -> None:
        for p in pages:
            self._is_free[p] = free
        self.num_free += len(pages) if free else -len(pages)

    def retain(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (sharing)."""
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} is free: only a page in use can be shared")
        for p in pages:
            self.refs[p] += 1
            self.num_shared += self.refs[p] == 2

    def release(self, pages: list[int]) -> list[int]:
        """Drop a reference from each page; returns the pages that became free."""
        for p, n in Counter(pages).items():
            if self.refs[p] < n:
                raise ValueError(f"page {p} has {self.refs[p]} references, cannot drop {n}")
        freed = []
        for p in pages:
            self.refs[p] -= 1
            self.num_shared -= self.refs[p] == 1
            if self.refs[p] == 0:
                freed.append(p)
        self._set_free(freed, True)
        self.forget(freed)
        return freed

    # ------------------------------------------------------------ prefix hashes

    def set_hash(self, page: int, h: int, content: tuple) -> None:
        """The page in use holds `content` (salt and tokens), ending the prefix hashed `h`."""
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} is free: only a page in use holds tokens")
        self.forget([page])
        self._hash[page] = h, content
        self._by_hash.setdefault(h, set()).add(page)

    def hash_of(self, page: int) -> int | None:
        entry = self._hash.get(page)
        return entry[0] if entry else None

    def holds(self, page: int, h: int, content: tuple) -> bool:
        """Whether the page carries hash `h` for exactly `content` (no collision)."""
        return self._hash.get(page) == (h, content)

    def pages_with(self, h: int) -> set[int]:
        return self._by_hash.get(h, set())

    def forget(self, pages: list[int]) -> None:
        """The pages' tokens changed (or they are free): drop their hashes."""
        for p in pages:
            entry = self._hash.pop(p, None)
            if entry is not None:
                holders = self._by_hash[entry[0]]
                holders.discard(p)
                if not holders:
                    del self._by_hash[entry[0]]
