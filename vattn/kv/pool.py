"""The budget of physical pages: a free list, reference counts, and the
prefix hash each full page may carry.

Knows nothing about addresses.  The lowest free page is handed out first, so
pages taken together are usually consecutive, which lets the backend map them
with one call (and the host kernel merge them into one mapping entry).

A page's hash (as nano-vllm keeps it on the block) names the tokens it holds
and every token before them, so a prefix-cache lookup finds pages by hash.
The hash goes when the page is freed or `forget` is told its tokens changed.

A pool over a shared budget (`vattn.kv.shared`) holds only some of its pages
at a time: `add` puts pages it comes to hold on the free list, `remove` takes
free pages it gives up off it; the pages it does not hold are neither free
nor in use.
"""
import heapq
from collections import Counter


class PagePool:
    def __init__(self, num_pages: int, held: bool = True):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free = list(range(num_pages)) if held else []
        self._held = [held] * num_pages
        self.num_held = num_pages if held else 0
        self.num_shared = 0  # pages with more than one reference
        self._hash: dict[int, tuple[int, tuple]] = {}  # page -> (hash, (salt, tokens)) of the prefix it ends
        self._by_hash: dict[int, set[int]] = {}  # hash -> pages carrying it

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_held - len(self._free)

    def free_pages(self) -> list[int]:
        return sorted(self._free)

    def is_held(self, page: int) -> bool:
        return self._held[page]

    def add(self, pages: list[int]) -> None:
        """Come to hold `pages`, free."""
        if any(self._held[p] for p in pages):
            raise ValueError("a page added to the pool is held already")
        for p in pages:
            self._held[p] = True
            heapq.heappush(self._free, p)
        self.num_held += len(pages)

    def remove(self, pages: list[int]) -> None:
        """Stop holding free `pages`."""
        gone = set(pages)
        if len(gone) != len(pages) or not gone.issubset(self._free):
            raise ValueError("only free pages, each once, can leave the pool")
        self._free = [p for p in self._free if p not in gone]
        heapq.heapify(self._free)
        for p in pages:
            self._held[p] = False
        self.num_held -= len(pages)

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages with one reference each, or None (and nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

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
                heapq.heappush(self._free, p)
                freed.append(p)
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
