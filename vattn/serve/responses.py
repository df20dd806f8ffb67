"""OpenAI's response bodies, whole or as stream chunks, from the engine's
outputs: one `Choices` per HTTP request, fed every `RequestOutput` of its
prompts, gives each choice's new text, logprobs and finish reason."""
import json
import time
import uuid
from dataclasses import dataclass, field

from vattn.engine.request import CompletionOutput, RequestOutput

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM's floor)


class Detokenizer:
    """The text of a sample's growing token ids, decoding only the tokens
    since the last read (and the ones before them, which may share its
    characters) rather than all of them each step: `decoded` is what whole
    characters they make so far."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, ""
        self._start = self._read = 0  # decode from `_start`; text of tokens before `_read` is in `decoded`

    def update(self, ids: list[int]) -> str:
        before = self._decode(ids[self._start:self._read])
        now = self._decode(ids[self._start:])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # no partial character at the end
            self.decoded += now[len(before):]
            self._start, self._read = self._read, len(ids)
        return self.decoded

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""  # sent so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    detokenizer: Detokenizer | None = None


class Choices:
    def __init__(self, kind: str, model: str, tokenizer, n: int, prompt_lens: list[int], logprobs: bool,
                 stops: list[str]):
        """`kind`: "text_completion" or "chat.completion"; a request of
        `len(prompt_lens)` prompts, `n` samples each (choice i·n + j)."""
        self.kind, self.model, self.tokenizer, self.n = kind, model, tokenizer, n
        self.id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_lens, self.want_logprobs = prompt_lens, logprobs
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string's start is not sent early
        self.choices = [Choice(i, detokenizer=Detokenizer(tokenizer)) for i in range(len(prompt_lens) * n)]

    def update(self, prompt: int, output: RequestOutput) -> list[tuple[Choice, str, list[dict[int, float]]]]:
        """Each choice of `prompt` with something new: (choice, new text, new logprobs)."""
        news = []
        for c in output.outputs:
            choice = self.choices[prompt * self.n + c.index]
            text = self._visible(choice, c)
            if len(text) < len(choice.text):  # never take back what was sent
                text = choice.text
            new_text, new_lps = text[len(choice.text):], (c.logprobs or [])[len(choice.logprobs):]
            choice.token_ids = c.token_ids
            if new_text or new_lps or (c.finish_reason and not choice.finish_reason):
                choice.text, choice.finish_reason = text, c.finish_reason
                choice.logprobs.extend(new_lps)
                news.append((choice, new_text, new_lps))
        return news

    def _visible(self, choice: Choice, c: CompletionOutput) -> str:
        """The text of `c` that may be sent: all of it once finished (decoded whole: a stop string cuts it);
        before, not a trailing partial character, nor the last `hold` characters (they may start a stop
        string)."""
        if c.finish_reason:
            return c.text
        text = choice.detokenizer.update(c.token_ids)
        return text[:len(text) - self.hold] if self.hold else text

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------ bodies

    def whole(self) -> dict:
        """The non-streamed response."""
        return self._body(self.kind, [self._choice(c, c.text, c.logprobs, whole=True) for c in self.choices],
                          usage=self.usage())

    def chunk(self, choice: Choice, text: str, logprobs: list[dict[int, float]], first: bool = False) -> str:
        """One streamed event for `choice`'s new `text` and `logprobs`."""
        return event(self._body(self._chunk_kind, [self._choice(choice, text, logprobs, first=first)]))

    def usage_chunk(self) -> str:
        return event(self._body(self._chunk_kind, [], usage=self.usage()))

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else self.kind

    def _body(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, c: Choice, text: str, logprobs: list[dict[int, float]], whole=False, first=False) -> dict:
        lps = self._logprobs(logprobs, len(c.text) - len(text)) if self.want_logprobs else None
        if self.kind == "text_completion":
            return {"index": c.index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                    "stop_reason": None}
        content = {"role": "assistant", "content": text} if whole or first else {"content": text}
        return {"index": c.index, "message" if whole else "delta": content, "logprobs": lps,
                "finish_reason": c.finish_reason}

    def _logprobs(self, entries: list[dict[int, float]], offset: int) -> dict:
        def token(t: int) -> str:
            return self.tokenizer.decode([t])

        if self.kind == "text_completion":
            tokens, offsets = [], []
            for e in entries:
                tokens.append(token(next(iter(e))))
                offsets.append(offset)
                offset += len(tokens[-1])
            return {"tokens": tokens, "token_logprobs": [_floor(next(iter(e.values()))) for e in entries],
                    "top_logprobs": [{token(t): _floor(v) for t, v in e.items()} for e in entries],
                    "text_offset": offsets}

        def entry(t: int, v: float) -> dict:
            s = token(t)
            return {"token": s, "logprob": _floor(v), "bytes": list(s.encode())}

        return {"content": [entry(*next(iter(e.items()))) | {"top_logprobs": [entry(t, v) for t, v in e.items()]}
                            for e in entries]}


def event(body: dict | str) -> str:
    """A server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


def _floor(v: float) -> float:
    return max(v, LOGPROB_FLOOR)
