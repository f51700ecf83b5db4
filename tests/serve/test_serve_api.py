"""The OpenAI-compatible API through the official `openai` client, against `gptforge serve` in a subprocess."""

from __future__ import annotations

import time

import httpx
import pytest
from tests.serve.server import serving

from gptforge.cli import main

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

KEY = "test-key"
CAP = 100_000  # max_tokens cap: high, so that one request can keep the model busy as long as a test needs


@pytest.fixture(scope="module")
def server(runs_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with serving(
        runs_dir, "--api-key", KEY, "--max-tokens", CAP, "--parallel", "1", "--queue", "0", "--max-n", "4", log=log
    ) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_lists_every_run_with_its_newest_checkpoint(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"alpha", "beta"}
    assert models["alpha"].owned_by == "gptforge" and models["alpha"].checkpoint == "step_000004"


def test_greedy_completion_equals_gptforge_sample_at_temperature_0(client, runs_dir, capsys):
    prompt = "def add_all"
    args = ["sample", str(runs_dir / "alpha"), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    assert main(args) == 0
    expected = capsys.readouterr().out.removeprefix(f"--- sample 0\n{prompt}").removesuffix("\n")
    r = client.completions.create(model="alpha", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected and r.system_fingerprint == "step_000004"
    assert r.usage.prompt_tokens >= 1 and r.usage.completion_tokens <= 12


def test_a_streamed_completion_adds_up_to_the_plain_one(client):
    args = {"model": "alpha", "prompt": "class Adder", "max_tokens": 20, "temperature": 1.0, "seed": 3}
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) > 3 and text == plain.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_n_choices_are_seeded_and_count_in_the_usage(client):
    args = {"model": "beta", "prompt": ["def f", "x ="], "max_tokens": 10, "n": 3, "seed": 11}
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # not one sample repeated
    other = client.completions.create(**{**args, "seed": 12})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_stop_sequences_end_the_text_before_them_plain_and_streamed(client):
    args = {"model": "alpha", "prompt": "def mul", "max_tokens": 30, "seed": 5}
    full = client.completions.create(**args).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    stopped = client.completions.create(**args, stop=[stop, "never appears"]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("args", "param", "code"),
    [
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"max_tokens": CAP + 1}, "max_tokens", "invalid_value"),
        ({"n": 5}, "n", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"prompt": "x " * 40}, "prompt", "context_length_exceeded"),  # the tiny model's context is 32 tokens
        ({"prompt": [[1, 2], [10**9]]}, "prompt", "invalid_value"),
        ({"extra_body": {"temperatur": 1}}, "temperatur", None),
        ({"logprobs": 2}, "logprobs", "unsupported"),
    ],
)
def test_bad_requests_are_400_in_openai_form(client, args, param, code):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": "alpha", "prompt": "def", **args})
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_bad_key_an_unknown_model_a_huge_body_and_bad_json(client, server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server}/api/runs", timeout=30).status_code == 401  # the page's data needs the key too
    for header in (f"bearer {KEY}", f"BEARER  {KEY}", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", KEY):
        answer = httpx.get(f"{server}/v1/models", headers={"Authorization": header}, timeout=30)
        assert answer.status_code == (200 if header.lower().startswith("bearer ") and header.endswith(KEY) else 401)
    infill = httpx.post(f"{server}/infill", json={"model": "alpha", "input_prefix": "def"}, timeout=30)
    assert infill.status_code == 401, infill.text  # llama.cpp's route drove the model without the key
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gamma", prompt="x")
    assert caught.value.body["code"] == "model_not_found"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    huge = httpx.post(f"{server}/v1/completions", content=b"x" * (2 << 20), headers=auth, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(f"{server}/v1/completions", content=b"{nope", headers=auth, timeout=30)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def test_a_busy_server_answers_429_and_a_client_that_leaves_frees_it(client):
    # --parallel 1 --queue 0: one request at a time. 4 x CAP tokens keep the tiny model busy for minutes unless
    # stopped.
    long = client.completions.create(model="alpha", prompt="def", max_tokens=CAP, n=4, seed=0, stream=True)
    assert next(iter(long)).choices  # generating now
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="alpha", prompt="def", max_tokens=1)
    assert caught.value.status_code == 429 and caught.value.body["code"] == "server_busy"
    long.close()  # the client goes away: the server stops generating for it
    for _ in range(600):  # up to a minute; the long request alone would take several
        try:
            assert client.completions.create(model="alpha", prompt="def", max_tokens=2).choices
            break
        except openai.RateLimitError:
            time.sleep(0.1)
    else:
        pytest.fail("the server stayed busy after its only client disconnected")
