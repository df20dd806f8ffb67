"""`vattn serve` as a separate process on a real socket, driven by the real
`openai` client: a tiny model with SmolLM2's tokenizer for the protocol,
errors, disconnects, load and shutdown; SmolLM2 for parity with
`LLM.generate`."""
import asyncio
import json
import math
import threading
import time

import httpx
import openai
import pytest

from serving import Served, save_tiny
from vattn import LLM, SamplingParams, models
from vattn.llm import chat_token_ids

KEY = "sesame"
PROMPTS = ["The capital of France is", "Three rivers of Europe are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    where = tmp_path_factory.mktemp("tiny")
    server = Served(str(save_tiny(where / "model")), "--served-model-name", "tiny", "--api-key", KEY,
                    "--shutdown-timeout", "1", log=where / "server.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=tiny.base, api_key=KEY, max_retries=0)


def greedy_text(client, prompt, **kw):
    return client.completions.create(model="tiny", prompt=prompt, temperature=0, **kw).choices[0]


# ------------------------------------------------------------ parity with the engine (SmolLM2)

def test_smollm2_through_the_server_equals_llm_generate(tmp_path):
    llm = LLM(dtype="float32")
    try:
        tok = llm.tokenizer
        chat = [{"role": "user", "content": "Name three colours."}]
        want = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0),
                                                   use_tqdm=False)]
        want_chat = llm.generate([chat_token_ids(tok, chat)], SamplingParams(max_tokens=12, temperature=0),
                                 use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.close()
    server = Served(models.DEFAULT, "--dtype", "float32", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base, api_key="none", max_retries=0)
        name = models.DEFAULT
        got = client.completions.create(model=name, prompt=PROMPTS, max_tokens=12, temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
        assert got.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
        assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
        for prompt, w in zip(PROMPTS, want):
            stream = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(w.token_ids)
        reply = client.chat.completions.create(model=name, messages=chat, max_completion_tokens=12, temperature=0)
        assert reply.choices[0].message.content == want_chat.text
        assert reply.usage.prompt_tokens == len(chat_token_ids(tok, chat))
        streamed = client.chat.completions.create(model=name, messages=chat, max_completion_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want_chat.text
    finally:
        assert server.terminate(60) == 0


# ------------------------------------------------------------ the protocol (tiny)

def test_models_health_tokenize_and_metrics(tiny, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(tiny.url + "/health").status_code == 200
    ids = httpx.post(tiny.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    assert httpx.post(tiny.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    before = tiny.metric("generation_tokens_total")
    greedy_text(client, "Hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert tiny.metric("generation_tokens_total") == before + 5
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_pages_mapped",
                 "prefix_cache_queries_total", "num_preemptions_total", "kv_map_calls_total",
                 "kv_map_seconds_total"):
        assert tiny.metric(name) >= 0
    text = httpx.get(tiny.url + "/metrics").text
    assert 'vattn:request_success_total{finished_reason="length",model_name="tiny"}' in text
    assert 'vattn:time_to_first_token_seconds_count{model_name="tiny"}' in text


def test_n_samples_each_equal_a_lone_request_with_seed_plus_i(client):
    ask = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9)
    both = client.completions.create(n=3, seed=7, **ask)
    texts = [c.text for c in sorted(both.choices, key=lambda c: c.index)]
    assert texts == [client.completions.create(seed=7 + i, **ask).choices[0].text for i in range(3)]
    assert len(set(texts)) > 1


def test_stop_strings_cut_the_text_streamed_or_not(client):
    full = greedy_text(client, "Once upon a time", max_tokens=24, extra_body={"ignore_eos": True}).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    cut = greedy_text(client, "Once upon a time", max_tokens=24, stop=[stop])
    assert (cut.text, cut.finish_reason) == (want, "stop")
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_logprobs_are_finite_and_greedy_takes_the_top_one(client):
    choice = greedy_text(client, "Hello", max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(value) and value <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(value)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(c.logprob == pytest.approx(max(t.logprob for t in c.top_logprobs)) for c in content)


def test_penalties_bias_and_min_tokens_act_as_vllm_s(tiny, client):
    plain = greedy_text(client, "Hello", max_tokens=16, extra_body={"ignore_eos": True})
    ids = httpx.post(tiny.url + "/tokenize", json={"prompt": plain.text}).json()["tokens"]
    assert len(set(ids)) < len(ids)  # random weights repeat themselves greedily
    fresh = greedy_text(client, "Hello", max_tokens=16, presence_penalty=2.0,
                        extra_body={"ignore_eos": True, "repetition_penalty": 100.0})
    fresh_ids = httpx.post(tiny.url + "/tokenize", json={"prompt": fresh.text}).json()["tokens"]
    assert fresh.text != plain.text and len(set(fresh_ids)) > len(set(ids))
    forced = greedy_text(client, "Hello", max_tokens=4, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert httpx.post(tiny.url + "/detokenize", json={"tokens": [42] * 4}).json()["prompt"] == forced.text
    token = httpx.post(tiny.url + "/tokenize", json={"prompt": "Hello"}).json()["tokens"][0]
    stops = dict(logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]})
    early = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, **stops)
    assert (early.choices[0].finish_reason, early.usage.completion_tokens) == ("stop", 1)
    stops["extra_body"]["min_tokens"] = 5
    held = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, **stops)
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)  # five held, then the stop


# ------------------------------------------------------------ errors (the server answers on after each)

@pytest.mark.parametrize("body, status, says", [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "x " * 3000}, 400, "maximum context length"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 4000}, 400, "maximum context length"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "tiny", "prompt": [10**7]}, 400, "token ids"),
    ({"model": "tiny", "prompt": "x", "n": 1000}, 400, "n=1000"),
    ({"model": "tiny"}, 400, "prompt"),
])
def test_bad_requests_answer_in_openai_s_shape(tiny, client, body, status, says):
    r = httpx.post(tiny.base + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert greedy_text(client, "Hello", max_tokens=2).text is not None


def test_malformed_json_a_missing_key_and_an_unknown_field(tiny, client):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(tiny.base + "/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(tiny.base + "/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"unheard_of": 1})
    assert ok.usage.completion_tokens >= 1


# ------------------------------------------------------------ disconnects, load, shutdown

def running_pages(server: Served) -> float:
    return server.metric("kv_pages_mapped") - server.metric("kv_pages_idle")


def wait_idle(server: Served, seconds: float = 1.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.metric("num_requests_running") == 0 and running_pages(server) == 0:
            return True
        time.sleep(0.05)
    return False


LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}


def test_a_client_that_goes_away_aborts_its_request(tiny):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert wait_idle(tiny, 5)
    with httpx.stream("POST", tiny.base + "/completions", json=LONG | {"stream": True}, headers=headers) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        next(lines)
        assert tiny.metric("num_requests_running") == 1
    assert wait_idle(tiny), "the streamed request was not aborted within a second"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny.base + "/completions", json=LONG, headers=headers, timeout=0.5)
    assert wait_idle(tiny), "the request was not aborted within a second of its client leaving"


def test_64_streaming_clients_of_mixed_lengths_all_complete(tiny):
    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=f"Story number {i}:", max_tokens=1 + i % 40,
                                                 temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=tiny.base, api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(all_of_them()) == [(1 + i % 40, "length") for i in range(64)]
    assert wait_idle(tiny, 5)


FAULT = """
import vattn.engine.sampler as sampler
real = sampler.sample
def sample(logits, params, *rest):
    if params.seed == 666:
        raise RuntimeError("injected sampling fault")
    return real(logits, params, *rest)
sampler.sample = sample
"""


def test_an_engine_error_answers_500_or_an_error_event_and_shutdown_exits_0(tmp_path):
    server = Served(str(save_tiny(tmp_path / "model")), "--served-model-name", "tiny", "--shutdown-timeout", "1",
                    "--max-waiting-requests", "100", log=tmp_path / "server.log", script=FAULT)
    try:
        client = openai.OpenAI(base_url=server.base, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="injected sampling fault"):
            client.completions.create(model="tiny", prompt="x", max_tokens=4, seed=666)
        with httpx.stream("POST", server.base + "/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 4, "seed": 666, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert "injected sampling fault" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
        assert events[-1] == "data: [DONE]"
        assert greedy_text(client, "Hello", max_tokens=3).text is not None

        results = {}

        def ask(i, tokens):
            try:
                with httpx.stream("POST", server.base + "/completions", timeout=30, json={
                        "model": "tiny", "prompt": "Once", "max_tokens": tokens, "ignore_eos": True,
                        "stream": True}) as r:
                    results[i] = [line for line in r.iter_lines() if line]
            except httpx.HTTPError as e:
                results[i] = e

        threads = [threading.Thread(target=ask, args=(i, 4 if i < 2 else 2000)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        assert server.terminate(10) == 0
        assert time.monotonic() - start < 5
        for t in threads:
            t.join()
        for i, lines in results.items():
            assert isinstance(lines, list) and lines[-1] == "data: [DONE]", (i, lines)
            if i < 2:
                assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
            else:
                assert "shutting down" in lines[-2]
    finally:
        server.close()


def test_text_decoded_a_few_tokens_at_a_time_equals_the_whole_decoded():
    """Streamed text comes from `Detokenizer`, which decodes only the newest tokens: it never holds half a
    character, only grows, and ends equal to decoding every token at once."""
    from transformers import AutoTokenizer

    from vattn.serve.responses import Detokenizer

    tok = AutoTokenizer.from_pretrained(str(models.model_dir(models.DEFAULT)))
    text = "Zürich → 東京: 3½ hours? 🚄🚄 Ça va… naïve café, <|im_end|> done.\n\tend"
    ids = tok(text)["input_ids"]
    whole = tok.decode(ids, skip_special_tokens=True)
    detokenizer, seen = Detokenizer(tok), ""
    for n in range(1, len(ids) + 1):
        now = detokenizer.update(ids[:n])
        assert now.startswith(seen) and "\ufffd" not in now
        seen = now
    assert seen == whole and "東京" in whole and "🚄🚄" in whole
