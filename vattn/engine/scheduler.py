"""Iteration-level scheduling over a KV cache (virtual or paged).

Every step: running requests first, oldest first, each given its next tokens
(one per decoding sequence, a chunk of the prompt otherwise) and the pages
they need; when pages run short, the most recently arrived running request is
preempted (all its sequences, by recompute or swap) until the older one fits.
Then, if nothing was preempted, swapped requests come back, then waiting ones
are admitted (FCFS) while slots, the token budget and the memory watermark
allow.  The sequences of one request are scheduled together or not at all.
"""
import bisect
import time
from collections.abc import Callable

from vattn.backends import MapLimitError
from vattn.kv.slots import SlotCache
from vattn.engine.config import EngineConfig
from vattn.engine.prefix_cache import PrefixCache
from vattn.engine.request import Request, Sequence, Status

Work = list[tuple[Request, Sequence, int]]  # (request, sequence, tokens to compute)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: SlotCache, prefix: PrefixCache | None):
        self.config, self.cache, self.prefix = config, cache, prefix
        self.waiting: list[Request] = []  # each list in arrival order
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.watermark_pages = int(config.watermark * cache.pool.num_pages)
        self.preemptions = 0
        self.map_seconds = 0.0  # spent in cache calls that map pages
        self.map_limit_hits = 0  # cache calls refused by the process's limit on mappings
        self.new_slots: list[int] = []  # slots given to sequences in the last schedule()

    def add(self, req: Request) -> None:
        _insert(self.waiting, req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------ a step

    def schedule(self) -> Work:
        budget = self.config.max_num_batched_tokens
        work: Work = []
        preempted = False
        self.new_slots = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted for an older request in this loop
            while (got := self._run(req, budget)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if got:
                work += got
                budget -= sum(n for _, _, n in got)
        if preempted:
            return work
        for req in list(self.swapped):
            if not self._swap_in(req):
                return work
            got = self._run(req, budget) or []
            work += got
            budget -= sum(n for _, _, n in got)
        while self.waiting and not self.swapped and self._can_admit(self.waiting[0], budget):
            req = self.waiting[0]
            got = self._run(req, budget)
            if not got:
                break
            self.waiting.pop(0)
            req.status = Status.RUNNING
            _insert(self.running, req)
            work += got
            budget -= sum(n for _, _, n in got)
        return work

    def _run(self, req: Request, budget: int) -> Work | None:
        """The request's next tokens with their pages mapped; [] if the token
        budget cannot take them, None (nothing changed) if memory is short."""
        live = req.live_seqs
        if budget < len(live):
            return []
        acquired = []
        for seq in live:
            if seq.slot is None:
                if not self._acquire(req, seq, budget):
                    self._release(acquired)
                    return None
                acquired.append(seq)
        got, targets = [], {}
        for i, seq in enumerate(live):
            n = min(seq.num_pending_tokens, budget - (len(live) - 1 - i))
            got.append((req, seq, n))
            targets[seq.slot] = seq.num_computed_tokens + n
            budget -= n
        if not self.timed(self.cache.grow_many, targets):
            self._release(acquired)
            return None
        if self.prefix:
            for seq in acquired:  # num_computed_tokens: what the prefix cache gave
                self.prefix.count(len(seq.token_ids), seq.num_computed_tokens)
        return got

    def _acquire(self, req: Request, seq: Sequence, budget: int) -> bool:
        """A slot for a sequence with none, sized for what it may compute this
        step, resuming a cached prefix if any."""
        tokens = seq.token_ids
        hit = self.prefix and self.prefix.lookup(tokens, req.cache_salt, len(tokens) - 1, self._usable)
        slot = None
        if hit:
            src, cached = hit
            size = min(len(tokens), cached + budget)
            if src in self.cache.active_slots:
                slot = self.timed(self.cache.fork, src, cached)
                if slot is not None and not self.timed(self.cache.grow, slot, size):
                    self.cache.free(slot)
                    slot = None
            else:
                slot = self.timed(self.cache.allocate, size, src, cached)
        if slot is None:
            hit = None
            slot = self.timed(self.cache.allocate, min(len(tokens), budget))
            if slot is None:
                return False
        cached = hit[1] if hit else 0
        if self.prefix:
            self.prefix.keep(slot, cached if hit and hit[0] == slot else 0)
            self.prefix.register(slot, tokens, cached, req.cache_salt)
        seq.slot, seq.num_computed_tokens = slot, cached
        self.new_slots.append(slot)
        if seq.index == 0 and len(tokens) == seq.prompt_len:
            req.num_cached_tokens = cached
        return True

    def _usable(self, slot: int) -> int:
        """Tokens a slot can still give a prefix hit."""
        if slot in self.cache.active_slots:
            return self.cache.length(slot)
        return self.cache.retained(slot)

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.cache.free(seq.slot)
            seq.slot, seq.num_computed_tokens = None, 0

    def _can_admit(self, req: Request, budget: int) -> bool:
        seqs = sum(r.params.n - (len(r.seqs) - len(r.live_seqs)) for r in self.running)
        if seqs + req.params.n > self.config.max_num_seqs or budget < len(req.live_seqs):
            return False
        return self._fits(sum(self.cache.config.pages_for(len(s.token_ids)) for s in req.live_seqs))

    def _fits(self, pages: int) -> bool:
        """Whether `pages` more would leave the watermark free (or nothing else runs)."""
        return self.cache.available_pages() - pages >= (self.watermark_pages if self.running else 0)

    # ------------------------------------------------------------ preemption

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.preemptions += 1
        swap = self.config.preemption_mode == "swap"
        for seq in req.live_seqs:
            if seq.slot is None:
                continue
            if swap:
                seq.swapped = self.cache.swap_out(seq.slot)
                if self.prefix:
                    self.prefix.keep(seq.slot, 0)
            else:  # the slot keeps its pages while idle: a prefix hit may resume them
                self.cache.free(seq.slot)
                seq.num_computed_tokens = 0
            seq.slot = None
        req.status = Status.SWAPPED if swap else Status.WAITING
        _insert(self.swapped if swap else self.waiting, req)

    def _swap_in(self, req: Request) -> bool:
        """Bring every swapped sequence of the request back, or none."""
        seqs = [s for s in req.live_seqs if s.swapped is not None]
        need = sum(self.cache.config.pages_for(s.swapped.tokens) for s in seqs)
        idle_slots = self.cache.config.max_batch - len(self.cache.active_slots)
        if idle_slots < len(req.live_seqs) or not self._fits(need):
            return False
        back = []
        for seq in seqs:
            slot = self.timed(self.cache.swap_in, seq.swapped)
            if slot is None:
                for s in back:
                    s.swapped, s.slot = self.cache.swap_out(s.slot), None
                return False
            seq.slot, seq.swapped = slot, None
            back.append(seq)
        for seq in back:
            if self.prefix:
                self.prefix.keep(seq.slot, 0)
                self.prefix.register(seq.slot, seq.token_ids, seq.num_computed_tokens, req.cache_salt)
        self.swapped.remove(req)
        req.status = Status.RUNNING
        _insert(self.running, req)
        return True

    def fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of a request whose prompt is done, each in a slot
        sharing the prompt's pages; a sample that gets no slot now is given
        one (and prefills) when next scheduled."""
        children = []
        for i in range(len(req.seqs), req.params.n):
            child = req.new_sequence(i)
            slot = self.timed(self.cache.fork, parent.slot, parent.prompt_len)
            if slot is not None:
                child.slot, child.num_computed_tokens = slot, parent.prompt_len
                if self.prefix:
                    self.prefix.keep(slot, 0)
                    self.prefix.register(slot, child.token_ids, child.num_computed_tokens, req.cache_salt)
            req.seqs.append(child)
            children.append(child)
        return children

    # ------------------------------------------------------------ ends

    def finish(self, req: Request, seq: Sequence) -> None:
        """A sequence is done: its slot goes idle (pages kept for reuse)."""
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        if req.finished and req.status is Status.RUNNING:
            self.running.remove(req)
            req.status = Status.FINISHED

    def abort(self, req: Request) -> None:
        for seq in req.seqs:
            if seq.swapped is not None:
                self.cache.discard(seq.swapped)
                seq.swapped = None
            if seq.slot is not None:
                self.cache.free(seq.slot)
                seq.slot = None
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        req.status = Status.FINISHED

    def timed(self, call: Callable, *args):
        """A cache call that maps pages, timed.  Running into the process's
        limit on mappings counts as memory being short: the call changed
        nothing, and its falsy result makes the scheduler preempt or wait."""
        start = time.perf_counter()
        try:
            return call(*args)
        except MapLimitError:
            self.map_limit_hits += 1
            return None
        finally:
            self.map_seconds += time.perf_counter() - start


def _insert(queue: list[Request], req: Request) -> None:
    bisect.insort(queue, req, key=lambda r: r.arrival_time)
