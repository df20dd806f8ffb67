"""`vattn serve` of several models on one KV pool, as a separate process driven by the real `openai`
client: routing by name, the pool's metrics and admin call, and what it refuses."""
import re

import httpx
import openai
import pytest

from serving import Served, save_tiny
from vattn import LLM, SamplingParams

KEY = "sesame"
MiB = 1 << 20
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    """Models a and b (the same checkpoint) on one pool of 96 MiB (three chunks), a with a floor of one."""
    server = Served(None, "--model", f"a={checkpoint}", "--model", f"b={checkpoint}",
                    "--kv-cache-memory-bytes", "96MiB", "--kv-floor", "a=32MiB", "--api-key", KEY,
                    "--shutdown-timeout", "1", log=tmp_path_factory.mktemp("pair") / "server.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(pair):
    return openai.OpenAI(base_url=pair.base, api_key=KEY, max_retries=0)


def admin(pair, method="GET", key=KEY, **body):
    return httpx.request(method, pair.base + "/kv_pool", json=body or None,
                         headers={"Authorization": f"Bearer {key}"} if key else {})


def test_each_name_answers_as_the_model_alone(pair, client, checkpoint):
    llm = LLM(checkpoint)
    try:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.close()
    assert sorted(m.id for m in client.models.list().data) == ["a", "b"]
    for name in ("a", "b"):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.model == name and got.choices[0].text == want


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="The model `c` does not exist"):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)


def test_metrics_are_per_model_and_show_the_pool(pair, client):
    before = {m: pair.metric("generation_tokens_total", model_name=m) for m in "ab"}
    client.completions.create(model="b", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert pair.metric("generation_tokens_total", model_name="b") == before["b"] + 5
    assert pair.metric("generation_tokens_total", model_name="a") == before["a"]
    assert pair.metric("kv_pool_bytes", kind="total") == 96 * MiB
    split = {m: {k: pair.metric("kv_pool_model_bytes", model_name=m, kind=k) for k in ("held", "floor", "cap")}
             for m in "ab"}
    assert split["a"]["floor"] == 32 * MiB and split["b"]["floor"] == 0 and split["a"]["cap"] == 96 * MiB
    assert split["b"]["held"] >= 32 * MiB  # b's request took a chunk, and its idle pages keep it
    assert pair.metric("kv_pool_bytes", kind="free") == 96 * MiB - split["a"]["held"] - split["b"]["held"]


def test_the_admin_call_sets_limits_behind_the_key(pair):
    assert admin(pair, key=None).status_code == 401
    answer = admin(pair, "POST", model="b", floor="32MiB", cap=64 * MiB)
    assert answer.status_code == 200, answer.text
    b = answer.json()["models"]["b"]
    assert (b["floor"], b["cap"]) == (32 * MiB, 64 * MiB)
    assert admin(pair).json() == answer.json()
    assert pair.metric("kv_pool_model_bytes", model_name="b", kind="cap") == 64 * MiB


@pytest.mark.parametrize("body, status, says", [
    (dict(model="b", floor="96MiB"), 400, "floors would add up to 4 chunks"),
    (dict(model="a", cap="16MiB"), 400, r"a's cap \(0 chunks\) is below its floor \(1 chunks\)"),
    (dict(model="a", floor="lots"), 400, "is not a size"),
    (dict(model="c", cap="32MiB"), 404, "The model `c` does not exist"),
])
def test_the_admin_call_refuses_bad_limits_and_changes_nothing(pair, body, status, says):
    before = admin(pair).json()
    answer = admin(pair, "POST", **body)
    assert answer.status_code == status
    assert re.search(says, answer.json()["error"]["message"]), answer.text
    assert admin(pair).json() == before


def test_a_server_of_one_model_has_no_pool(tmp_path, checkpoint):
    server = Served(checkpoint, "--served-model-name", "tiny", log=tmp_path / "server.log")
    try:
        assert admin(server, key=None).status_code == 404
    finally:
        server.close()


@pytest.mark.parametrize("flags, says", [
    (["--model", "a=X", "--model", "b=X"], "need its size: --kv-cache-memory-bytes"),
    (["--model", "a=X", "--kv-cache-memory-bytes", "96MiB", "--kv-floor", "z=32MiB"], "--kv-floor names 'z'"),
    (["--model", "a=X", "--model", "b=X", "--kv-cache-memory-bytes", "64MiB", "--kv-floor", "a=64MiB",
      "--kv-floor", "b=32MiB"], "floors would add up to 3 chunks"),
    (["--model", "a=X", "--model", "b=X", "--kv-cache-memory-bytes", "96MiB", "--kv-cap", "a=0x"], "is not a size"),
    (["--model", "a=X", "--model", "a=Y", "--kv-cache-memory-bytes", "96MiB"], "the same name"),
    (["--model", "a", "--kv-cache-memory-bytes", "96MiB"], "is not NAME=VALUE"),
])
def test_bad_flags_stop_the_server_before_it_loads_anything(flags, says, capsys):
    from vattn.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", *flags])  # "X" and "Y" name no model: a check that loaded one would fail otherwise
    assert stopped.value.code != 0 and says in f"{stopped.value.code} {capsys.readouterr().err}"
