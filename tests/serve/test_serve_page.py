"""The web page in a real headless Chromium (the system's, driven by Playwright): no console errors, the curves
of both runs, live updates while metrics.jsonl grows, a typed prompt streaming a completion, and a conversation
in chat mode."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from tests.serve.server import serving

from gptforge.checkpoint import latest_checkpoint
from gptforge.config import load_config
from gptforge.data.chat.prepare import ChatSettings, prepare_chat
from gptforge.train.trainer import train

pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs it)")
WAIT_MS = 60_000  # generous: a bound for a busy CI machine, not a measurement


@pytest.fixture(scope="module")
def runs(runs_dir, tmp_path_factory):
    """A copy of the runs, which these tests grow as training would."""
    return shutil.copytree(runs_dir, tmp_path_factory.mktemp("page") / "runs")


@pytest.fixture(scope="module")
def chat_run(runs, runs_dir):
    """runs/chat: `alpha` fine-tuned for 2 steps on conversations (as in test_serve_chat.py), a model that chats;
    module-scoped, so it is in place before a test's page loads."""
    work = runs.parent
    rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(40)]  # fmt: skip
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_chat(str(work / "rows.jsonl"), work / "chat-data", ChatSettings(val_fraction=0.2))
    settings = [f"data.path={work / 'chat-data'}", f"train.init_from={latest_checkpoint(runs_dir / 'alpha')}"]
    train(load_config("tiny", [*settings, "train.max_steps=2", "eval.every=0", "eval.sample_tokens=0"]), runs / "chat")
    return "chat"


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    with serving(runs, log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    """The page loaded and drawn; fails the test if the browser logged an error or warning meanwhile."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = []
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"exception: {e}"))
    page.goto(server)
    page.wait_for_selector("#chart-tps .u-legend", timeout=WAIT_MS)
    page.problems = problems  # a test expecting an error response takes its line out
    yield page
    page.close()
    assert problems == []


def test_the_page_shows_both_runs_curves_and_updates_them_as_training_logs(page, runs):
    for chart in ("loss", "bpb", "lr", "tps"):
        assert page.locator(f"#chart-{chart} canvas").count() == 1
    legend = page.inner_text("#chart-loss .u-legend")
    for label in ("alpha train", "alpha val", "beta train", "beta val"):
        assert label in legend
    assert page.inner_text("#status").startswith("step 4")
    # the samples and the config come by their own requests, which can answer after the charts' (CI: "none yet")
    page.wait_for_function("document.querySelector('#samples').innerText.includes('step 4')", timeout=WAIT_MS)
    page.wait_for_function("document.querySelector('#config').textContent.includes('[model]')", timeout=WAIT_MS)

    record = {"kind": "train", "step": 5, "time": 9.0, "loss": 9.5, "lr": 1e-3, "grad_norm": 1.0, "ms": 1.0}
    record |= {"tokens": 1280, "tokens_per_s": 1000.0, "mfu": 0.0, "skipped": False}
    with open(runs / "alpha" / "metrics.jsonl", "a") as f:  # what `gptforge train` does each step
        f.write(json.dumps(record) + "\n")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('step 5')", timeout=WAIT_MS)

    assert page.locator("#figure-code").is_hidden()  # no code measures yet
    code = {"kind": "code", "step": 5, "time": 9.5, "cases": 3, "infill_exact": None, "prefix_exact": 0.25}
    code |= {"spans": 3, "span_infill_exact": None, "span_prefix_exact": 0.0, "functions": 2, "parse_rate": 0.5}
    with open(runs / "alpha" / "metrics.jsonl", "a") as f:  # an evaluation with eval.code
        f.write(json.dumps(code) + "\n")
    page.wait_for_selector("#chart-code .u-legend", timeout=WAIT_MS)
    legend = page.inner_text("#chart-code .u-legend")
    assert "alpha prefix only, 1 line" in legend and "alpha bodies that parse" in legend
    assert "infill" not in legend  # trained without FIM: no infilling curves

    assert page.locator("#figure-rl").is_hidden()  # no RL yet
    step = {"kind": "rl", "step": 6, "time": 10.0, "reward": 0.5, "pass_rate": 0.25, "reply_tokens": 20.0, "kl": 0.0}
    held_out = {"kind": "tasks", "step": 6, "time": 10.5, "pass@1": 0.3, "tasks": 70, "parses": 0.9}
    with open(runs / "alpha" / "metrics.jsonl", "a") as f:  # what `gptforge rl` logs
        f.write(json.dumps(step) + "\n" + json.dumps(held_out) + "\n")
    page.wait_for_selector("#chart-rl .u-legend", timeout=WAIT_MS)
    legend = page.inner_text("#chart-rl .u-legend")
    assert "alpha reward" in legend and "alpha held-out pass@1" in legend


def test_a_typed_prompt_streams_a_completion_from_the_newest_checkpoint(page, server, runs):
    checkpoints = runs / "alpha" / "checkpoints"
    shutil.copytree(checkpoints / "step_000004", checkpoints / "step_000006")  # training writes a newer one
    page.wait_for_function("document.getElementById('checkpoint').textContent.includes('step_000006')", timeout=WAIT_MS)
    page.fill("#prompt", "def add_all")
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.evaluate(  # count the pieces the page appends: a stream adds the text chunk by chunk
        "window.pieces = 0; new MutationObserver((ms) => { window.pieces += ms.length; })"
        ".observe(document.getElementById('out-text'), {childList: true, characterData: true, subtree: true})"
    )
    page.click("#generate")
    page.wait_for_timeout(3000)
    print("DEBUG", page.inner_text("#out-info"), page.locator("#conversation").inner_text())
    page.wait_for_function("document.getElementById('out-info').textContent.includes('finished')", timeout=WAIT_MS)
    body = {"model": "alpha", "prompt": "def add_all", "max_tokens": 12, "temperature": 0}
    expected = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert page.inner_text("#out-prompt") == "def add_all"
    assert page.text_content("#out-text") == expected
    assert page.inner_text("#out-info").startswith("step_000006 · finished: ")
    assert page.evaluate("window.pieces") > 2


def test_a_suffix_in_the_playground_asks_for_an_infill(page):
    page.fill("#prompt", "def add_all(")
    page.fill("#suffix", ")\n")
    page.click("#generate")
    page.wait_for_function("document.getElementById('out-info').textContent.includes('error')", timeout=WAIT_MS)
    assert "trained without fill-in-the-middle" in page.inner_text("#out-info")  # the suffix reached the server
    assert page.text_content("#out-suffix") == ")\n"
    expected = [p for p in page.problems if "400 (Bad Request)" in p]
    assert len(expected) == 1
    page.problems.remove(expected[0])


def chat_turn(page, server, message: str, messages: list[dict]) -> list[str]:
    """Sends `message` from the page, checks that the page sent the whole conversation (`messages`, which grows by
    both turns) to stream, and asks the API the same greedily; returns the texts the conversation view shows."""
    page.fill("#message", message)
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#message", "Enter")
    page.wait_for_function("document.getElementById('out-info').textContent.includes('finished')", timeout=WAIT_MS)
    messages.append({"role": "user", "content": message})
    body = {"model": "chat", "messages": messages, "max_tokens": 3, "temperature": 0}
    assert request.value.post_data_json == {**body, "stream": True}
    messages.append(httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"])
    return page.locator("#conversation .message").all_text_contents()


def test_chat_mode_streams_each_reply_into_the_conversation_and_shows_a_base_model_s_refusal(page, server, chat_run):
    page.check("input[name=mode][value=chat]")
    assert page.locator("#prompt").is_hidden() and page.locator("#output").is_hidden()
    assert page.inner_text("#generate") == "Send"
    page.fill("#max-tokens", "3")  # the tiny model's context is 32 tokens: room for two short turns
    page.fill("#temperature", "0")
    page.fill("#message", "hi")
    page.click("#generate")  # the selected run is `alpha`, a base model
    page.wait_for_function("document.getElementById('out-info').textContent.includes('error')", timeout=WAIT_MS)
    assert "is a base model without a chat template" in page.inner_text("#out-info")
    assert page.locator("#conversation .message").count() == 0  # the turn is taken back, the message kept
    assert page.input_value("#message") == "hi"
    refused = [p for p in page.problems if "400 (Bad Request)" in p]
    assert len(refused) == 1
    page.problems.remove(refused[0])

    page.wait_for_selector(f"#run option[value={chat_run}]", state="attached", timeout=WAIT_MS)
    page.select_option("#run", chat_run)
    page.fill("#system", "Be brief.")
    system = [{"role": "system", "content": "Be brief."}]
    assert chat_turn(page, server, "hi", system) == ["hi", system[2]["content"]] and system[2]["content"]
    page.click("#reset")
    assert page.locator("#conversation .message").count() == 0 and page.inner_text("#out-info") == ""

    page.fill("#system", "")
    plain: list[dict] = []
    chat_turn(page, server, "hi", plain)
    assert chat_turn(page, server, "say 3", plain) == [m["content"] for m in plain]
