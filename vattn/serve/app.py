"""The HTTP front: OpenAI's endpoints over an `EngineLoop`, on FastAPI.

Requests go to the model their `model` field names (none: the first one
served).  Every request's prompts are tokenized here, checked against the context,
and queued on the loop; its outputs come back on an asyncio queue and go
out whole or as server-sent events.  A client that goes away aborts its
requests at once (a task per HTTP request waits for the disconnect), and
whatever goes wrong answers in OpenAI's error shape.
"""
import asyncio
import dataclasses
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from vattn.kv.shared import KVPool
from vattn.llm import chat_token_ids
from vattn.serve.loop import EngineLoop, Failed
from vattn.serve.metrics import ServerMetrics
from vattn.serve.protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, PoolLimits,
                                  Sampling, TokenizeRequest)
from vattn.serve.responses import Choices, event


@dataclass(slots=True)
class Model:
    tokenizer: object
    max_model_len: int


@dataclass(slots=True)
class Server:
    loop: EngineLoop
    models: dict[str, Model]  # by the name requests use
    metrics: ServerMetrics
    api_key: str | None = None
    max_waiting_requests: int | None = None
    pool: KVPool | None = None  # the KV pool the models share, if they do


class Disconnected(Exception):
    pass


DISCONNECTED = object()  # what a request's queue gets when its client goes away


def make_app(server: Server) -> FastAPI:
    app = FastAPI(title="vattn", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        errors = e.errors()
        where = [".".join(str(part) for part in err["loc"] if part != "body") for err in errors]
        message = "; ".join(f"{w or 'body'}: {err['msg']}" for w, err in zip(where, errors))
        return JSONResponse(ApiError(400, message, where[0] if where else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def authorize(request: Request):
        if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.loop.is_healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vattn", "root": name,
                                            "max_model_len": m.max_model_len} for name, m in server.models.items()]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _, model = _model(server, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt")
        ids = _chat_ids(model, body.messages) if body.messages is not None else \
            model.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _, model = _model(server, body.model)
        vocab = len(model.tokenizer)
        if not all(0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": model.tokenizer.decode(body.tokens)}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw: Request):
        name, model = _checked(server, body)
        prompts = [model.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in body.prompts()]
        return await _serve(server, name, raw, body, prompts, "text_completion")

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, raw: Request):
        name, model = _checked(server, body)
        return await _serve(server, name, raw, body, [_chat_ids(model, body.messages)], "chat.completion")

    @v1.get("/kv_pool")
    async def kv_pool():
        return _split(_pool(server))

    @v1.post("/kv_pool")
    async def set_kv_pool(body: PoolLimits):
        """Set a model's floor and cap in the shared pool (on the engines' thread, between steps)."""
        pool = _pool(server)
        name, _ = _model(server, body.model)
        floor, cap = body.bytes("floor"), body.bytes("cap")
        try:
            await server.loop.call(lambda: pool.set_limits(name, floor, cap))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return _split(pool)

    app.include_router(v1)
    return app


def _pool(server: Server) -> KVPool:
    """The KV pool the models share (404 where they do not)."""
    if server.pool is None:
        raise ApiError(404, "this server's models do not share a KV pool (serve several with --model NAME=MODEL)")
    return server.pool


def _split(pool: KVPool) -> dict:
    return {"total_bytes": pool.memory_budget, "free_bytes": pool.free_chunks * pool.chunk_size,
            "chunk_bytes": pool.chunk_size,
            "models": {name: dataclasses.asdict(split) for name, split in pool.split().items()}}


def _checked(server: Server, body: Sampling) -> tuple[str, Model]:
    """The model a sampling request names, and its body checked."""
    named = _model(server, body.model)
    body.check()
    return named


def _model(server: Server, name: str | None) -> tuple[str, Model]:
    """The model a request names (None: the first one served)."""
    if name is None:
        name = next(iter(server.models))
    if name not in server.models:
        raise ApiError(404, f"The model `{name}` does not exist.", "model")
    return name, server.models[name]


def _chat_ids(model: Model, messages: list[dict]) -> list[int]:
    try:
        return chat_token_ids(model.tokenizer, [_flat(m) for m in messages])
    except Exception as e:
        raise ApiError(400, f"the messages do not fit the chat template: {type(e).__name__}: {e}", "messages")


def _flat(message: dict) -> dict:
    """A message whose content is a list of text parts, as one string."""
    content = message.get("content")
    if isinstance(content, list):
        return message | {"content": "".join(p.get("text", "") for p in content if isinstance(p, dict))}
    return message


async def _serve(server: Server, name: str, raw: Request, body: CompletionRequest | ChatRequest,
                 prompts: list[list[int]], kind: str):
    """Queue the prompts to model `name`, then answer whole or streamed
    (`kind`: the response's object, "text_completion" or "chat.completion")."""
    model = server.models[name]
    limit = model.max_model_len
    for ids in prompts:
        if len(ids) >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                                f"{len(ids)} input tokens: the prompt exceeds the model's maximum context length.",
                           "prompt")
        if len(ids) + (asked := body.max_tokens_for(len(ids), limit)) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} in the completion). "
                                f"Please reduce the length of the prompt or completion.", "max_tokens")
    waiting = server.loop.num_waiting(name)
    if server.max_waiting_requests is not None and waiting >= server.max_waiting_requests:
        raise ApiError(503, f"{waiting} requests to {name} are waiting, the most this server queues "
                            f"(--max-waiting-requests): try again later")
    choices = Choices(kind, name, model.tokenizer, body.n, [len(p) for p in prompts],
                      body.logprob_count is not None, body.stops)
    out: asyncio.Queue = asyncio.Queue()
    ids = [f"{choices.id}-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt in zip(ids, prompts):
            await server.loop.add(name, request_id, prompt, body.params(body.max_tokens_for(len(prompt), limit)), out)
    except ValueError as e:
        _abort(server, ids)
        raise ApiError(400, str(e)) from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(_events(server, raw, ids, out, choices, include_usage),
                                 media_type="text/event-stream")
    try:
        async for prompt, output in _outputs(raw, ids, out):
            choices.update(prompt, output)
    except Disconnected:
        return Response(status_code=499)
    finally:
        _abort(server, ids)
    return choices.whole()


async def _events(server: Server, raw: Request, ids: list[str], out: asyncio.Queue, choices: Choices,
                  include_usage: bool):
    try:
        if choices.kind == "chat.completion":
            for c in choices.choices:
                yield choices.chunk(c, "", [], first=True)
        async for prompt, output in _outputs(raw, ids, out):
            for choice, text, logprobs in choices.update(prompt, output):
                yield choices.chunk(choice, text, logprobs)
        if include_usage:
            yield choices.usage_chunk()
    except ApiError as e:
        yield event(e.body())
    except Disconnected:
        return
    finally:
        _abort(server, ids)
    yield event("[DONE]")


async def _outputs(raw: Request, ids: list[str], out: asyncio.Queue):
    """(prompt index, output) until every prompt's request is finished; an
    `ApiError` (500) for one the engine ended in error; `Disconnected` when
    the client went away."""
    watcher = asyncio.create_task(_watch(raw, out))
    try:
        pending = set(ids)
        while pending:
            item = await out.get()
            if item is DISCONNECTED:
                raise Disconnected
            if isinstance(item, Failed):
                raise ApiError(500, str(item))
            if item.error is not None:
                raise ApiError(500, f"the request failed: {item.error}")
            if item.finished:
                pending.discard(item.request_id)
            yield ids.index(item.request_id), item
    finally:
        watcher.cancel()


async def _watch(raw: Request, out: asyncio.Queue) -> None:
    """Puts `DISCONNECTED` in `out` once the client has gone away (the request's body is read: what the
    server receives next is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    out.put_nowait(DISCONNECTED)


def _abort(server: Server, ids: list[str]) -> None:
    """Abort whatever of these requests is still in the engine (the loop skips finished ones)."""
    for request_id in ids:
        server.loop.abort(request_id)
