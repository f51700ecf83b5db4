"""/v1/chat/completions: through the `openai` client, plain and streamed, a fine-tuned chat model answers what
`gptforge sample --chat` answers greedily; n, seed and stop work; bad messages and base models are 400s."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import httpx
import pytest
from tests.helpers import chat_checkpoint
from tests.serve.server import serving

from gptforge.checkpoint import latest_checkpoint
from gptforge.cli import main
from gptforge.config import load_config
from gptforge.data.chat.prepare import ChatSettings, prepare_chat
from gptforge.train.trainer import train

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "name a colour"}]


@pytest.fixture(scope="module")
def root(runs_dir, tmp_path_factory):
    """chat: the tiny `alpha` run fine-tuned for 2 steps on conversations; base: `alpha` itself."""
    root = tmp_path_factory.mktemp("chat")
    rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(40)]  # fmt: skip
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_chat(str(root / "rows.jsonl"), root / "data", ChatSettings(val_fraction=0.2))
    settings = [f"data.path={root / 'data'}", f"train.init_from={latest_checkpoint(runs_dir / 'alpha')}"]
    train(
        load_config("tiny", [*settings, "train.max_steps=2", "eval.every=0", "eval.sample_tokens=0"]),
        root / "runs" / "chat",
    )
    shutil.copytree(runs_dir / "alpha", root / "runs" / "base")
    chat_checkpoint(root / "runs" / "stopper" / "checkpoints" / "step_000001", ends_every_reply=True)
    return root / "runs"


@pytest.fixture(scope="module")
def client(root):
    with serving(root) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120), url


def sample_chat(run, prompt: str, tokens: int) -> str:
    out = io.StringIO()
    args = ["sample", str(run), "--chat", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(tokens)]
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    head = f"--- sample 0\nuser> {prompt}\nassistant> "
    assert out.getvalue().startswith(head)
    return out.getvalue().removeprefix(head).removesuffix("\n")


def test_the_chat_route_answers_as_sample_chat_does_plain_and_streamed(client, root):
    api, _ = client
    expected = sample_chat(root / "chat", "name a colour", 8)
    args = {"model": "chat", "messages": ASK[1:], "max_tokens": 8, "temperature": 0}
    answer = api.chat.completions.create(**args)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected
    chunks = list(api.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].choices[0].delta.content is None


def test_n_seed_and_max_tokens_work_and_text_parts_are_read(client):
    api, _ = client
    args = {"model": "chat", "messages": ASK, "max_tokens": 6, "temperature": 1.5, "n": 2, "seed": 7}
    first, again = (api.chat.completions.create(**args) for _ in range(2))
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len(first.choices) == 2 and first.usage.completion_tokens <= 12
    parts = [{"role": "user", "content": [{"type": "text", "text": "name a "}, {"type": "text", "text": "colour"}]}]
    joined = api.chat.completions.create(model="chat", messages=parts, max_tokens=4, temperature=0)
    plain = api.chat.completions.create(model="chat", messages=ASK[1:], max_tokens=4, temperature=0)
    assert joined.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
        (["hi"], "messages[0]"),
    ],
)
def test_bad_messages_are_400s_naming_the_field(client, messages, param):
    _, url = client
    body = {"model": "chat", **({} if messages is None else {"messages": messages})}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_base_model_is_refused_in_openai_s_form(client):
    api, _ = client
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="base", messages=ASK, max_tokens=4)
    assert e.value.code == "model_not_chat" and "without a chat template" in e.value.message


def test_what_sdks_send_is_read_and_a_reply_ends_at_the_context(client):
    _, url = client
    body = {"model": "chat", "messages": ASK[1:], "temperature": 0, "logprobs": False}
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "max_completion_tokens": None, "max_tokens": 3}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 100}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] <= 32  # tiny's context: never slid past
    assert r["choices"][0]["finish_reason"] in ("length", "stop")
    long = [{"role": "user", "content": "word " * 40}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "chat", "messages": long}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b\ud800"}]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=json.dumps({"model": "chat", "messages": bad}),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content"


def test_the_prompt_is_the_templates_with_the_replys_opening_and_a_reply_ends_at_its_turn(client, root):
    """The route's prompt without `<|im_start|>assistant\\n`, or without the stop at `<|im_end|>`, passed the tests
    (a 2-step model's reply ignores its prompt): here a model whose every reply ends at once."""
    from gptforge.checkpoint import load_checkpoint
    from gptforge.tokens.chat import format_chat, parse_messages

    _, url = client
    tok = load_checkpoint(root / "stopper")[1]
    prompt = len(format_chat(tok, parse_messages(ASK), add_generation_prompt=True).ids)
    for stream in (False, True):
        body = {"model": "stopper", "messages": ASK, "n": 3, "temperature": 1.0, "max_tokens": 8, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            usage = chunks[-1]["usage"]
            assert sorted(f for f in finishes if f) == ["stop"] * 3 and text == ""
        else:
            answer = r.json()
            assert [(c["message"]["content"], c["finish_reason"]) for c in answer["choices"]] == [("", "stop")] * 3
            usage = answer["usage"]
        assert usage["prompt_tokens"] == prompt, usage  # the template's ids, the reply's opening included
        assert usage["completion_tokens"] == 0, usage  # the end of the turn is not text


def test_a_chat_request_without_max_tokens_may_run_to_the_servers_limit():
    """OpenAI's chat default is the model's room, not the completions route's 16 (capped at --max-tokens)."""
    from gptforge.serve.protocol import ApiError, Limits, parse_chat, parse_completion

    body = {"model": "chat", "messages": ASK}
    assert parse_chat(body, Limits(max_tokens=77)).max_tokens == 77
    assert parse_chat({**body, "max_completion_tokens": 5, "max_tokens": 9}, Limits(max_tokens=77)).max_tokens == 5
    assert parse_completion({"model": "chat", "prompt": "x"}, Limits(max_tokens=77)).max_tokens == 16
    for bad in ({"max_completion_tokens": 5, "max_tokens": -3}, {"max_completion_tokens": 0, "max_tokens": 5}):
        with pytest.raises(ApiError) as e:  # a bad max_tokens beside max_completion_tokens was ignored
            parse_chat({**body, **bad}, Limits(max_tokens=77))
        assert e.value.param == next(k for k, v in bad.items() if v < 1)


def test_a_tool_call_or_a_tool_message_says_tools_are_not_supported():
    """An assistant's tool-call message was refused as 'content: expected a string'."""
    from gptforge.tokens.chat import ConversationError, parse_messages

    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for message, field in (
        ({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"),
        ({"role": "tool", "content": "1"}, "role"),
    ):
        with pytest.raises(ConversationError, match=rf"^messages\[1\]\.{field}: tool calls are not supported"):
            parse_messages([{"role": "user", "content": "hi"}, message])
