"""Iteration-level scheduling over the cache API (`vattn.kv.manager`).

Every step: running requests first, oldest first, each given its next tokens
(one per decoding sequence, a chunk of the prompt otherwise) and the pages
they need; when pages run short, the most recently arrived running request is
preempted (all its sequences, by recompute or swap) until the older one fits.
Then, if nothing was preempted, swapped requests come back, then waiting ones
are admitted (FCFS) while slots, the token budget, the running tokens and the
memory watermark allow.  The sequences of one request are scheduled together
or not at all.
"""
import bisect
import time

from vattn.engine.config import EngineConfig
from vattn.engine.plan import StepPlan, Work
from vattn.engine.request import Request, Sequence, Status
from vattn.kv.manager import KVCacheManager


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: list[Request] = []  # each list in arrival order
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.watermark_pages = int(config.watermark * kv.num_pages)
        self.preemptions = 0
        self.map_seconds = 0.0  # spent in cache calls that map pages
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0

    def add(self, req: Request) -> None:
        _insert(self.waiting, req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> StepPlan:
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted for an older request in this loop
            while (got := self._guarded(plan, req, self._run, req, budget)) is None:
                if req.status is Status.FINISHED:
                    break  # ended in error
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            budget -= self._add(plan, got)
        if plan.preempted:
            return plan
        for req in list(self.swapped):
            back = self._guarded(plan, req, self._swap_in, req)
            if req.status is Status.FINISHED:
                continue  # ended in error
            if not back:
                return plan
            budget -= self._add(plan, self._guarded(plan, req, self._run, req, budget))
        while self.waiting and not self.swapped and self._can_admit(self.waiting[0], budget):
            req = self.waiting[0]
            got = self._guarded(plan, req, self._run, req, budget)
            if req.status is Status.FINISHED:
                continue  # ended in error
            if not got:
                break
            self.waiting.pop(0)
            req.status = Status.RUNNING
            req.scheduled_time = req.scheduled_time or time.perf_counter()
            _insert(self.running, req)
            plan.admitted.append(req)
            budget -= self._add(plan, got)
        return plan

    def _guarded(self, plan: StepPlan, req: Request, call, *args):
        """`call(*args)`, on behalf of one request: an exception ends that
        request (freed, and put in `plan.failed`) instead of the step, and
        gives None."""
        try:
            return call(*args)
        except Exception as e:
            self.abort(req, error=True)
            plan.failed.append((req, e))
            return None

    def update(self, req: Request, work: list[Work]) -> list[tuple[Sequence, Work]]:
        """The forward ran `work`, this request's part of the step: count the
        computed tokens, hash the pages they filled, and fork the other
        samples once the prompt is done.  Returns each sequence that samples
        now, with the work whose last token it samples after (a fork, its
        parent's)."""
        sampling = []
        for w in work:
            seq = w.seq
            seq.num_computed_tokens += w.num_tokens
            self.kv.cache_tokens(seq, seq.token_ids, seq.num_computed_tokens)
            if w.samples:  # the first sample to finish the prompt brings the others (parallel sampling)
                sampling += [(s, w) for s in [seq] + self._fork(req, seq)]
        return sampling

    def _add(self, plan: StepPlan, got: list[Work] | None) -> int:
        for w in got or []:
            plan.add(w)
        return sum(w.num_tokens for w in got or [])

    def _run(self, req: Request, budget: int) -> list[Work] | None:
        """The request's next tokens with their pages mapped; [] if the token
        budget cannot take them, None (nothing changed) if memory is short."""
        live = req.live_seqs
        if budget < len(live):
            return []
        admitted = []
        for seq in live:
            if not self.kv.has_slot(seq):
                if not self._admit(req, seq, budget):
                    self._release(admitted)
                    return None
                admitted.append(seq)
        got = []
        for i, seq in enumerate(live):
            n = min(seq.num_pending_tokens, budget - (len(live) - 1 - i))
            got.append(Work(req, seq, self.kv.slot(seq), seq.num_computed_tokens, n))
            budget -= n
        if not self.timed(self.kv.allocate_slots, {w.seq: w.start + w.num_tokens for w in got}):
            self._release(admitted)
            return None
        for seq in admitted:
            self.prefix_queried_tokens += len(seq.token_ids)
            self.prefix_hit_tokens += seq.num_computed_tokens
        return got

    def _admit(self, req: Request, seq: Sequence, budget: int) -> bool:
        """A slot for a sequence with none, resuming a cached prefix if any."""
        cached = self.timed(self.kv.allocate, seq, seq.token_ids, budget, req.cache_salt)
        if cached is None:
            return False
        seq.num_computed_tokens = cached
        if seq.index == 0 and len(seq.token_ids) == seq.prompt_len:
            req.num_cached_tokens = cached
        return True

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0

    def _can_admit(self, req: Request, budget: int) -> bool:
        seqs = sum(r.params.n - (len(r.seqs) - len(r.live_seqs)) for r in self.running)
        if seqs + req.params.n > self.config.max_num_seqs or budget < len(req.live_seqs):
            return False
        limit = self.config.max_running_tokens
        if limit is not None and self.running and sum(map(_tokens, self.running)) + _tokens(req) > limit:
            return False
        return self._fits(sum(self.kv.pages_for(len(s.token_ids)) for s in req.live_seqs))

    def _fits(self, pages: int) -> bool:
        """Whether `pages` more would leave the watermark free (or nothing else runs)."""
        return self.kv.num_available_pages() - pages >= (self.watermark_pages if self.running else 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.preemptions += 1
        swap = self.config.preemption_mode == "swap"
        for seq in req.live_seqs:
            if not self.kv.has_slot(seq):
                continue
            if swap:
                seq.swapped = self.kv.swap_out(seq)
            else:  # the slot keeps its pages while idle: a prefix hit may resume them
                self.kv.free(seq)
                seq.num_computed_tokens = 0
        req.status = Status.SWAPPED if swap else Status.WAITING
        _insert(self.swapped if swap else self.waiting, req)

    def _swap_in(self, req: Request) -> bool:
        """Bring every swapped sequence of the request back, or none."""
        seqs = [s for s in req.live_seqs if s.swapped is not None]
        if self.kv.num_free_slots < len(req.live_seqs) or not self._fits(
                sum(self.kv.pages_for(s.swapped.capacity) for s in seqs)):
            return False
        back = []
        for seq in seqs:
            if not self.timed(self.kv.swap_in, seq, seq.swapped, req.cache_salt):
                for s in back:
                    s.swapped = self.kv.swap_out(s)
                return False
            seq.swapped = None
            back.append(seq)
        self.swapped.remove(req)
        req.status = Status.RUNNING
        _insert(self.running, req)
        return True

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of a request whose prompt is done, each in a slot
        sharing the prompt's pages; a sample that gets no slot now is given
        one (and prefills) when next scheduled."""
        children = []
        for i in range(len(req.seqs), req.params.n):
            child = req.new_sequence(i)
            if self.timed(self.kv.fork, parent, child, parent.prompt_len):
                child.num_computed_tokens = parent.prompt_len
            req.seqs.append(child)
            children.append(child)
        return children

    def finish(self, req: Request, seq: Sequence) -> None:
        """A sequence is done: its slot goes idle (pages kept for reuse)."""
        if self.kv.has_slot(seq):
            self.kv.free(seq)
        if req.finished and req.status is Status.RUNNING:
            self.running.remove(req)
            req.status = Status.FINISHED

    def abort(self, req: Request, error: bool = False) -> None:
        """End the request now, freeing its slots and swapped KV; after an
        `error` its pages go back to the pool, prefix hashes and all, since
        what it computed last may be half done."""
        for seq in req.seqs:
            if seq.swapped is not None:
                self.kv.discard(seq.swapped)
                seq.swapped = None
            if self.kv.has_slot(seq):
                (self.kv.drop if error else self.kv.free)(seq)
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        req.status = Status.FINISHED

    def map_ahead(self, plan: StepPlan) -> None:
        """Map the page each sampling sequence of `plan` needs for the token it
        feeds next step, and unmap what newly given slots hold past their size
        (off the step's critical path where the engine runs it on its worker)."""
        limit = self.config.max_seq_len
        self.kv.map_ahead({w.seq: len(w.seq.token_ids) + 1 for w in plan.work
                           if w.samples and len(w.seq.token_ids) < limit})

    def trim(self) -> None:
        """Give back the memory idle slots hold."""
        self.kv.trim()

    def timed(self, call, *args):
        """A cache call that maps pages, timed."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.map_seconds += time.perf_counter() - start


def _tokens(req: Request) -> int:
    """The tokens of a request's live sequences, a sample not yet forked at the prompt's length."""
    return sum(len(s.token_ids) for s in req.live_seqs) + (req.params.n - len(req.seqs)) * len(req.prompt_token_ids)


def _insert(queue: list[Request], req: Request) -> None:
    bisect.insort(queue, req, key=lambda r: r.arrival_time)
