"""OpenAI's request bodies as the server reads them, and its error shape.

Fields are vLLM's (OpenAI's, plus `top_k`, `min_tokens`, `ignore_eos`,
`repetition_penalty`, `stop_token_ids`); unknown ones are accepted and
ignored, so other tools' payloads work unchanged.  Fields vattn does not
serve (`best_of` above 1, `echo`, `suffix`) are refused by name.
"""
from typing import Any

from pydantic import BaseModel, ConfigDict

from vattn.sampling_params import SamplingParams
from vattn.serve.sizes import byte_size


class ApiError(Exception):
    """An answer in OpenAI's error shape with its HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What completions and chat completions share; each also says its
    answer's cap (`max_tokens_for`) and its `logprob_count`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def params(self, max_tokens: int) -> SamplingParams:
        """The engine's `SamplingParams` (a `ValueError` names what is wrong);
        each request kind has `logprob_count`, the top tokens asked for or None."""
        try:
            bias = {int(t): b for t, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias must map token ids to numbers") from None
        return SamplingParams(
            max_tokens=max_tokens, n=self.n, seed=self.seed, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            stop=self.stops,
            stop_token_ids=list(self.stop_token_ids or []),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias, logprobs=self.logprob_count)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        for name, unsupported in (("best_of", self.best_of not in (None, 1)), ("echo", bool(self.echo)),
                                  ("suffix", self.suffix is not None)):
            if unsupported:
                raise ApiError(400, f"{name} is not supported by this server", name)

    def max_tokens_for(self, prompt_len: int, context: int) -> int:
        return self.max_tokens if self.max_tokens is not None else context - prompt_len

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt must not be empty", "prompt")
        return list(p)


class ChatRequest(Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # OpenAI's older name for max_completion_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")

    def max_tokens_for(self, prompt_len: int, context: int) -> int:
        asked = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return asked if asked is not None else context - prompt_len

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]



class PoolLimits(BaseModel):
    """`POST /v1/kv_pool`: a model's new floor and cap in the shared KV pool,
    each bytes or a size ("512MiB"); one left out stays as it is."""
    model: str
    floor: int | str | None = None
    cap: int | str | None = None

    def bytes(self, name: str) -> int | None:
        value = getattr(self, name)
        if isinstance(value, str):
            try:
                return byte_size(value)
            except Exception as e:
                raise ApiError(400, str(e), name) from None
        return value
