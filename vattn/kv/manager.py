"""The KV cache as a scheduler uses it: the whole API a serving framework needs.

Keyed by the framework's own sequence ids (any hashable); slots and pages stay
inside.  In the vocabulary of vLLM's `KVCacheManager` and nano-vllm's
`BlockManager`:

    allocate(seq, token_ids, num_new_tokens)  admit, resuming a cached prefix  -> tokens cached | None
    allocate_slots({seq: num_tokens})         room for the next tokens, all or nothing -> bool
    fork(parent, child, num_tokens)           a child sharing the parent's pages -> bool
    cache_tokens(seq, token_ids, n)           the first n tokens are computed: hash their full pages
    free(seq)                                 finished, aborted, or preempted by recompute
    drop(seq)                                 ended in error: its pages back to the pool, unhashed
    swap_out(seq) / swap_in(seq, swapped)     preempted by swap, and back -> SwappedSlot / bool
    trim()                                    the memory of idle pages given back
    num_available_pages(), usage, ...         the numbers admission needs; queries never raise

Misuse (an unknown sequence, a count out of range) raises `ValueError` and
changes nothing; "no room" is a falsy answer, never an exception, and that
includes the process's limit on mappings.  Prefix caching works in whole
pages: each full page carries the hash of its tokens and of every token
before them (`PagePool.set_hash`), so a hit is the longest run of pages a slot
holds for the prompt; an active slot's pages are shared with the newcomer, an
idle slot's are resumed in place (deferred reclamation keeps them mapped).
"""
from collections.abc import Hashable, Mapping, Sequence

from vattn.kv.sharing import SwappedSlot
from vattn.kv.slots import SlotCache


class KVCacheManager:
    def __init__(self, cache: SlotCache, enable_prefix_caching: bool = True):
        self.cache, self.config = cache, cache.config
        self.enable_prefix_caching = enable_prefix_caching
        self._slots: dict[Hashable, int] = {}  # sequence -> its slot
        self._salt: dict[Hashable, str | None] = {}
        self._hashed: dict[Hashable, int] = {}  # sequence -> leading pages that carry their hash
        self._new_slots: list[int] = []  # given out since the last `map_ahead`

    # ------------------------------------------------------------ numbers (never raise)

    @property
    def num_pages(self) -> int:
        """Pages the cache could ever hold (in a shared pool: its cap, less the others' floors)."""
        return self.cache.table.most_pages

    def others_hold_memory(self) -> bool:
        """Whether the cache draws on a shared pool whose other members hold chunks (they may let them go)."""
        member = self.cache.table.member
        return member is not None and any(o.held for o in member.pool.members.values() if o is not member)

    def num_available_pages(self) -> int:
        """Pages free or reclaimable now."""
        return self.cache.available_pages()

    @property
    def num_mapped_pages(self) -> int:
        """Pages in use, by running sequences or idle slots."""
        return self.cache.pool.num_used

    @property
    def map_limit_hits(self) -> int:
        """Operations answered "no room" at the process's limit on mappings."""
        return self.cache.map_limit_hits

    @property
    def num_free_slots(self) -> int:
        return self.config.max_num_seqs - len(self._slots)

    @property
    def usage(self) -> float:
        """Live bytes / bytes mapped for running sequences (idle pages left out)."""
        st = self.cache.stats()
        held = st.mapped_bytes - st.pages_idle * self.config.page_bytes
        return st.live_bytes / held if held else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return self.config.pages_for(num_tokens)

    def has_slot(self, seq: Hashable) -> bool:
        try:
            return seq in self._slots
        except TypeError:  # unhashable: no sequence of ours
            return False

    def slot(self, seq: Hashable) -> int:
        """Where the model runner finds the sequence's K/V."""
        return self._slot(seq)

    # ------------------------------------------------------------ admission and growth

    def allocate(self, seq: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                 salt: str | None = None) -> int | None:
        """A slot for `seq` holding the longest cached prefix of `token_ids`
        (never all of it: the last token is computed to sample from) and room
        for `num_new_tokens` more, at most all of them.  Returns the tokens it
        holds already, or None (nothing changed) when no slot or memory is left."""
        self._check_new(seq)
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        if not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        if len(token_ids) > self.config.max_seq_len:
            raise ValueError(f"{len(token_ids)} tokens do not fit max_seq_len={self.config.max_seq_len}")
        hit = self._lookup(token_ids, salt) if self.enable_prefix_caching else None
        slot = None
        if hit is not None:
            src, cached = hit
            size = min(len(token_ids), cached + num_new_tokens)
            if src in self.cache.active_slots:
                slot = self.cache.fork(src, cached)
                if slot is not None and not self.cache.grow(slot, size):
                    self.cache.free(slot)
                    slot = None
            else:
                slot = self.cache.allocate(size, src, resume=cached)
        if slot is None:
            hit = None
            slot = self.cache.allocate(min(len(token_ids), num_new_tokens))
            if slot is None:
                return None
        cached = hit[1] if hit else 0
        self._give(seq, slot, salt, self._full_pages(cached))
        return cached

    def allocate_slots(self, targets: Mapping[Hashable, int]) -> bool:
        """Room for each sequence's first `targets[seq]` tokens, in one batched
        map call; all or nothing."""
        return self.cache.grow_many({self._slot(seq): n for seq, n in targets.items()})

    def fork(self, parent: Hashable, child: Hashable, num_tokens: int) -> bool:
        """Give `child` a slot whose first `num_tokens` share `parent`'s pages."""
        self._check_new(child)
        slot = self.cache.fork(self._slot(parent), num_tokens)
        if slot is None:
            return False
        self._give(child, slot, self._salt[parent], min(self._hashed[parent], self._full_pages(num_tokens)))
        return True

    def map_ahead(self, targets: Mapping[Hashable, int]) -> None:
        """Ready the next step, off its critical path: cut what newly given
        slots hold past their capacity, and grow each sequence in `targets` to
        that many tokens where it is smaller (no room: the next step's
        `allocate_slots` decides)."""
        given, self._new_slots = set(self._new_slots) & set(self._slots.values()), []
        self.cache.shrink([s for s in given if self.cache.mapped_pages(s) > self.pages_for(self.cache.capacity(s))])
        grow = {self._slot(seq): n for seq, n in targets.items() if self.cache.capacity(self._slot(seq)) < n}
        if grow:
            self.cache.grow_many(grow)

    # ------------------------------------------------------------ prefix hashes

    def cache_tokens(self, seq: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of `token_ids` are in the cache: hash the
        pages they fill, so later prompts find them."""
        slot = self._slot(seq)
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(f"num_computed={num_computed!r} must be in [0, {len(token_ids)}]")
        j, tokens_in = self._hashed[seq], self.config.tokens_in
        if not self.enable_prefix_caching or tokens_in(j + 1) > num_computed:
            return
        pool, table, salt = self.cache.pool, self.cache.block_table(slot), self._salt[seq]
        h = pool.hash_of(table[j - 1]) if j else hash(salt)
        while h is not None and j < len(table) and tokens_in(j + 1) <= num_computed:
            content = (salt, tuple(token_ids[tokens_in(j):tokens_in(j + 1)]))
            h = hash((h, *content[1]))
            pool.set_hash(table[j], h, content)
            j += 1
        self._hashed[seq] = j

    def _lookup(self, token_ids: Sequence[int], salt: str | None) -> tuple[int, int] | None:
        """(slot, tokens) of the slot holding the most pages of `token_ids`'s
        prefix, short of its last token."""
        pool, tokens_in = self.cache.pool, self.config.tokens_in
        h, found, tables = hash(salt), None, None
        j = 0
        while tokens_in(j + 1) < len(token_ids):
            content = (salt, tuple(token_ids[tokens_in(j):tokens_in(j + 1)]))
            h = hash((h, *content[1]))
            if tables is None:  # the slots whose first page starts the prompt
                firsts = pool.pages_with(h)
                tables = {s: t for s in range(self.config.max_num_seqs)
                          if firsts and (t := self.cache.block_table(s)) and t[0] in firsts}
            tables = {s: t for s, t in tables.items() if len(t) > j and pool.holds(t[j], h, content)}
            if not tables:
                break
            j += 1
            found = min(tables), tokens_in(j)
        return found

    # ------------------------------------------------------------ ends and preemption

    def free(self, seq: Hashable) -> None:
        """The sequence is done with its slot (finished, aborted, or preempted
        by recompute): its pages stay mapped, idle, for reuse and prefix hits."""
        self.cache.free(self._take(seq))

    def drop(self, seq: Hashable) -> None:
        """The sequence ended in error: its slot is freed and its private
        pages go back to the pool with their prefix hashes, so nothing it
        wrote is resumed."""
        self.cache.free(self._take(seq), keep=False)

    def swap_out(self, seq: Hashable) -> SwappedSlot:
        """Preempt by swap: the sequence's KV to host memory, its pages back."""
        return self.cache.swap_out(self._take(seq))

    def swap_in(self, seq: Hashable, swapped: SwappedSlot, salt: str | None = None) -> bool:
        """Bring a swapped-out sequence back into a slot; False if it does not fit."""
        self._check_new(seq)
        slot = self.cache.swap_in(swapped)
        if slot is None:
            return False
        self._give(seq, slot, salt, 0)
        return True

    def discard(self, swapped: SwappedSlot) -> None:
        """A swapped-out sequence ended without coming back."""
        self.cache.discard(swapped)

    def trim(self) -> None:
        """Give back the memory idle slots hold (every idle page reclaimed)."""
        self.cache.trim()

    def stats(self):
        return self.cache.stats()

    def check(self) -> None:
        """Assert the cache's bookkeeping, and that every sequence holds its own active slot."""
        self.cache.check()
        assert sorted(self._slots.values()) == self.cache.active_slots, "sequences and active slots disagree"

    # ------------------------------------------------------------ inside

    def _slot(self, seq: Hashable) -> int:
        try:
            return self._slots[seq]
        except (KeyError, TypeError):
            raise ValueError(f"sequence {seq!r} has no slot") from None

    def _check_new(self, seq: Hashable) -> None:
        if not isinstance(seq, Hashable):
            raise ValueError(f"a sequence id must be hashable, got {type(seq).__name__}")
        if seq in self._slots:
            raise ValueError(f"sequence {seq!r} already has a slot")

    def _full_pages(self, num_tokens: int) -> int:
        """Pages wholly inside the first `num_tokens` tokens (the ones sharing or resuming keeps as they are)."""
        return num_tokens * self.config.token_bytes // self.config.page_size

    def _give(self, seq: Hashable, slot: int, salt: str | None, hashed: int) -> None:
        self._slots[seq], self._salt[seq], self._hashed[seq] = slot, salt, hashed
        self._new_slots.append(slot)

    def _take(self, seq: Hashable) -> int:
        slot = self._slot(seq)
        del self._slots[seq], self._salt[seq], self._hashed[seq]
        return slot

