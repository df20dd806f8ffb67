"""Which slots hold which prompt prefixes, found by a chained hash of blocks.

A block is `block_tokens` consecutive tokens.  Block i's hash covers the
cache salt and every token up to the end of block i, so one lookup per block
finds the slots that hold the whole prefix; the token ids are compared too, so
a hash collision never shares the wrong tokens.  Requests with different
salts never match.  The engine tells the index what each slot holds
(`register`, `keep`) and, at lookup, how many tokens a slot can still give
(its pages may have been reclaimed since)."""
from collections.abc import Callable


class PrefixCache:
    def __init__(self, block_tokens: int):
        if block_tokens < 1:
            raise ValueError(f"a prefix block needs at least one token, got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}  # slot -> hash of each block it holds
        self._tokens: dict[int, list[int]] = {}  # slot -> the token ids of those blocks
        self._salt: dict[int, str | None] = {}
        self._where: dict[int, set[int]] = {}  # block hash -> slots holding it
        self.queried_tokens = self.hit_tokens = 0

    def register(self, slot: int, token_ids: list[int], num_tokens: int, salt: str | None) -> None:
        """The slot holds the KV of `token_ids[:num_tokens]`."""
        B = self.block_tokens
        blocks = self._blocks.setdefault(slot, [])
        tokens = self._tokens.setdefault(slot, [])
        assert self._salt.setdefault(slot, salt) == salt, "a slot holds one salt's tokens"
        for i in range(len(blocks), num_tokens // B):
            block = token_ids[i * B:(i + 1) * B]
            blocks.append(hash((blocks[-1] if blocks else hash(salt), *block)))
            tokens += block
            self._where.setdefault(blocks[-1], set()).add(slot)

    def keep(self, slot: int, num_tokens: int) -> None:
        """The slot now holds only its first `num_tokens` registered tokens."""
        blocks = self._blocks.get(slot, [])
        n = num_tokens // self.block_tokens
        for h in blocks[n:]:
            holders = self._where[h]
            holders.discard(slot)
            if not holders:
                del self._where[h]
        del blocks[n:]
        if slot in self._tokens:
            del self._tokens[slot][n * self.block_tokens:]
        if not n:
            self._blocks.pop(slot, None)
            self._tokens.pop(slot, None)
            self._salt.pop(slot, None)

    def lookup(self, token_ids: list[int], salt: str | None, max_tokens: int,
               usable: Callable[[int], int]) -> tuple[int, int] | None:
        """(slot, tokens) for the slot holding the longest block-aligned prefix
        of `token_ids`, at most `max_tokens`; `usable(slot)` says how many
        tokens the slot can still give."""
        B = self.block_tokens
        h, found, alive = hash(salt), None, None
        for i in range(min(max_tokens, len(token_ids)) // B):
            block = token_ids[i * B:(i + 1) * B]
            h = hash((h, *block))
            end = (i + 1) * B
            holders = self._where.get(h, set()) if alive is None else alive & self._where.get(h, set())
            alive = {s for s in holders if self._salt[s] == salt and self._tokens[s][i * B:end] == block
                     and usable(s) >= end}
            if not alive:
                break
            found = (min(alive), end)
        return found

    def count(self, queried: int, hit: int) -> None:
        """A prompt of `queried` tokens was served with `hit` of them from the cache."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        """Tokens served from the cache / tokens of the prompts that were given slots."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
