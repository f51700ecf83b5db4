"""Infilling served: OpenAI's `suffix` (through the `openai` client, plain and streamed) and llama.cpp's /infill
(raw HTTP) give what `gptforge sample --suffix` gives greedily; a model trained without FIM answers 400."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import httpx
import pytest
from tests.serve.server import serving

from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.config import load_config
from gptforge.tokens.fim import infill_prompt
from gptforge.train.trainer import train

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

PREFIX, SUFFIX = "def add(a, b):\n", "\n    return c\n"


@pytest.fixture(scope="module")
def root(runs_dir, data_dir, tmp_path_factory):
    """fim: a tiny run trained with data.fim_rate=0.5; plain: one without."""
    root = tmp_path_factory.mktemp("infill")
    overrides = [f"data.path={data_dir}", "train.max_steps=4", "eval.every=0", "data.fim_rate=0.5"]
    train(load_config("tiny", overrides), root / "fim")
    shutil.copytree(runs_dir / "alpha", root / "plain")
    return root


@pytest.fixture(scope="module")
def server(root):
    with serving(root) as url:
        yield url


@pytest.fixture(scope="module")
def expected(root):
    """What `gptforge sample --suffix` infills greedily in 8 tokens."""
    args = ["sample", str(root / "fim"), "--prompt", PREFIX, "--suffix", SUFFIX, "--temperature", "0"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--max-new-tokens", "8"]) == 0
    return out.getvalue().removeprefix(f"--- sample 0\n{PREFIX}").removesuffix(f"{SUFFIX}\n")


def test_openai_suffix_infills_as_sample_does_plain_and_streamed(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    args = {"model": "fim", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    assert client.completions.create(**args).choices[0].text == expected
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_llama_cpp_infill_route_answers_as_llama_server(server, expected):
    body = {
        "model": "fim",
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "n_predict": 8,
        "temperature": 0,
        "cache_prompt": True,
        "samplers": ["top_k"],
    }  # fmt: skip  (llama.cpp options we ignore)
    r = httpx.post(f"{server}/infill", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["content"] == expected and r.json()["stop"] is True
    assert r.json()["tokens_predicted"] <= 8 and r.json()["stop_type"] in ("eos", "limit")
    with httpx.stream("POST", f"{server}/infill", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert len(expected) >= 4
    word = expected[2:4]  # a stop string: the text ends before it, and llama.cpp's names say so
    r = httpx.post(f"{server}/infill", json={**body, "stop": [word]}, timeout=120).json()
    assert (r["content"], r["stop_type"], r["stopping_word"]) == (expected[: expected.find(word)], "word", word)


def test_a_typed_middle_and_extra_context_are_taken(server, root):
    extra = [{"filename": "util.py", "text": "import os"}]
    body = {"model": "fim", "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    c = a"}
    r = httpx.post(f"{server}/infill", json={**body, "input_extra": extra, "n_predict": 4}, timeout=120)
    tok = load_checkpoint(root / "fim")[1]
    prompt = infill_prompt(tok, "import os\n" + PREFIX, SUFFIX) + tok.encode("    c = a")
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == len(prompt)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "plain", "prompt": PREFIX, "suffix": SUFFIX}, "suffix"),
        ("/infill", {"model": "plain", "input_prefix": PREFIX, "input_suffix": SUFFIX}, "suffix"),
        ("/infill", {"input_prefix": PREFIX}, "model"),  # two runs served: which one?
        ("/v1/completions", {"model": "fim", "prompt": [1, 2], "suffix": SUFFIX}, "suffix"),
        ("/v1/completions", {"model": "fim", "prompt": PREFIX, "suffix": 3}, "suffix"),
        ("/infill", {"model": "fim", "input_extra": ["text"]}, "input_extra"),
        ("/infill", {"model": "fim", "input_extra": {}}, "input_extra"),
        ("/infill", {"model": "fim", "n_predict": "3"}, "n_predict"),
        ("/infill", {"model": "fim", "n_predict": 0}, "n_predict"),
    ],
)
def test_infill_a_model_cannot_give_or_a_bad_body_is_400(server, path, body, param):
    r = httpx.post(f"{server}{path}", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_lone_surrogate_in_an_extra_file_is_400(server):
    body = b'{"model": "fim", "input_extra": [{"filename": "a", "text": "\\ud800"}]}'  # JSON's own escape
    r = httpx.post(f"{server}/infill", content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra", r.text
