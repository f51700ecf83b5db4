"""Continuous batching in-process: a request's output does not depend on what else is in the batch, rows join and
leave at token boundaries, and a request that leaves frees its row for one that waits."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tests.helpers import randomize

from gptforge.checkpoint import load_for_inference
from gptforge.model.generate import generate
from gptforge.serve.batcher import Batcher, Task
from gptforge.serve.jobs import Done, Finish, Job, Started, Text
from gptforge.serve.protocol import Limits, parse_completion
from gptforge.tokens.fim import FIMTokenizer, infill_prompt


@pytest.fixture(scope="module")
def run(runs_dir):
    """The tiny run with random weights of a wide spread: 4 steps of training leave its next token all but
    independent of the context, and a batch that mixed up its rows' contexts must show."""
    loaded = load_for_inference(runs_dir / "alpha" / "checkpoints" / "step_000004", "cpu")
    torch.manual_seed(0)
    randomize(loaded.model, matrix_std=0.3)
    return loaded


class Request:
    """One submitted request and the events it reported."""

    def __init__(self, batcher: Batcher, run, **body) -> None:
        self.events: list = []
        req = parse_completion({"model": "alpha", **body}, Limits(max_tokens=1000))
        self.job = Job(req, self.events.append, time.monotonic() + 600)
        if req.suffix is None:
            prompts = [run.tokenizer.encode(p) for p in req.prompts]
        else:
            prompts = [infill_prompt(run.tokenizer, p, req.suffix) for p in req.prompts]
        self.ends: list = []  # what the batcher told the request's end callback, once
        self.task: Task = batcher.submit(self.job, run, prompts, Started("step_000004", "alpha"), end=self.ends.append)

    def text(self, index: int = 0) -> str:
        return "".join(e.piece for e in self.events if isinstance(e, Text) and e.index == index)


def drain(batcher: Batcher, *requests: Request) -> None:
    for _ in range(10_000):
        if all(r.task.ended.is_set() for r in requests):
            return
        batcher.step()
    pytest.fail("the batcher did not finish its requests")


GREEDY = {"prompt": "def add_all", "max_tokens": 45, "temperature": 0}  # past the tiny model's 32-token context
OTHERS = [
    {"prompt": "class Adder:\n    def", "max_tokens": 20, "temperature": 0.9, "seed": 1, "n": 2},
    {"prompt": "x", "max_tokens": 30, "temperature": 1.2, "top_k": 5, "seed": 2},
    {"prompt": ["import os\nimport sys\n", "y = ["], "max_tokens": 12, "temperature": 0.7, "top_p": 0.8, "seed": 3},
]


def test_a_requests_output_does_not_depend_on_the_rest_of_the_batch(run):
    alone = [Request(b := Batcher(8, threading.Event()), run, **GREEDY)]
    drain(b, *alone)
    sampled_alone = [Request(b := Batcher(8, threading.Event()), run, **body) for body in OTHERS[:1]]
    drain(b, *sampled_alone)

    batcher = Batcher(8, threading.Event())
    mixed = [Request(batcher, run, **body) for body in OTHERS[1:]]
    batcher.step()  # these are generating when the two below arrive: they join at a token boundary
    assert batcher.generating == 3
    together = [Request(batcher, run, **GREEDY), Request(batcher, run, **OTHERS[0])]
    batcher.step()
    assert batcher.generating == 6  # all in one batch, at different lengths
    drain(batcher, *mixed, *together)

    ids = run.tokenizer.encode(GREEDY["prompt"])
    expected = run.tokenizer.decode(generate(run.model, ids, 45, temperature=0, eot=run.tokenizer.eot)[0])
    assert alone[0].text() == together[0].text() == expected and len(expected) > 20
    assert [sampled_alone[0].text(i) for i in (0, 1)] == [together[1].text(i) for i in (0, 1)]
    assert together[1].text(0) != together[1].text(1)  # each choice its own random stream
    assert all(isinstance(r.ends[0], Done) for r in (*mixed, *together)) and batcher.generating == 0
    for request, body in zip([*mixed, *together], [*OTHERS[1:], GREEDY, OTHERS[0]], strict=True):
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = len(prompts) * body.get("n", 1)
        assert [e.reason for e in request.events if isinstance(e, Finish)] == ["length"] * choices
        assert request.ends[0].usage == {  # every choice of every prompt counted (not the last choice's alone)
            "prompt_tokens": sum(len(run.tokenizer.encode(p)) for p in prompts),
            "completion_tokens": choices * body["max_tokens"],
            "total_tokens": sum(len(run.tokenizer.encode(p)) for p in prompts) + choices * body["max_tokens"],
        }


def test_choices_beyond_the_capacity_wait_and_a_request_that_leaves_frees_its_rows(run):
    batcher = Batcher(2, threading.Event())
    first = Request(batcher, run, prompt="def", max_tokens=500, temperature=0.8, seed=0, n=2)
    second = Request(batcher, run, prompt="import", max_tokens=3, temperature=0)
    for _ in range(3):
        batcher.step()
    assert batcher.generating == 2 and second.events == []  # it waits: both rows are the first request's
    first.job.cancel.set()  # its client went away
    batcher.step()
    assert first.task.ended.is_set() and first.ends[0] is None
    drain(batcher, second)
    assert isinstance(second.ends[0], Done) and second.events[0] == Started("step_000004", "alpha")
    assert second.ends[0].usage["completion_tokens"] <= 3 and batcher.generating == 0
    assert first.ends == [None] and len(second.ends) == 1  # each end told once, as it ended


def test_a_request_past_its_time_ends_as_length_and_one_never_let_in_is_429(run):
    batcher = Batcher(2, threading.Event())
    busy = Request(batcher, run, prompt="def", max_tokens=500, temperature=0.8, seed=0, n=3, echo=True)
    batcher.step()  # two of its choices generate, the third waits for a row
    late = Request(batcher, run, prompt="x", max_tokens=5)
    late.job.deadline = busy.job.deadline = time.monotonic()
    batcher.step()
    assert late.ends[0].error.status == 429 and late.events == [] and len(late.ends) == 1
    assert isinstance(busy.ends[0], Done) and [busy.text(i).startswith("def") for i in range(3)] == [True] * 3
    assert {e for e in busy.events if isinstance(e, Finish)} == {Finish(i, "length") for i in range(3)}
    assert busy.text(2) == "def"  # never generated: its echo alone


def test_at_shutdown_a_request_not_yet_begun_is_503_even_with_a_row_free(run):
    stopping = threading.Event()
    batcher = Batcher(4, stopping)
    waiting = Request(batcher, run, prompt="def", max_tokens=5)
    stopping.set()
    batcher.step()
    assert waiting.ends[0].error.status == 503 and waiting.events == []


def test_a_failure_while_generating_fails_those_requests_and_the_next_are_served(run, monkeypatch, capsys):
    import gptforge.model.engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a forward pass")

    batcher = Batcher(4, threading.Event())
    with monkeypatch.context() as patched:
        patched.setattr(engine_module, "forward_logits", broken)
        failed = Request(batcher, run, prompt="def", max_tokens=5, n=2)
        batcher.step()
    assert failed.task.ended.is_set() and failed.ends[0].error.status == 500 and len(failed.ends) == 1
    assert "a bug in a forward pass" in capsys.readouterr().err  # the traceback goes to the server's log
    served = Request(batcher, run, prompt="def", max_tokens=5, temperature=0)
    drain(batcher, served)
    assert isinstance(served.ends[0], Done) and served.text()


def test_an_infill_ends_where_the_context_does_and_a_completion_goes_on(run):
    fim = dataclasses.replace(run, tokenizer=FIMTokenizer(run.tokenizer))  # sentinels in GPT-2's padded ids
    batcher = Batcher(4, threading.Event())
    infill = Request(batcher, fim, prompt="def f(x):\n", suffix="\n    return y\n", max_tokens=100, temperature=0)
    plain = Request(batcher, fim, prompt="def f(x):\n", max_tokens=100, temperature=0)
    drain(batcher, infill, plain)
    room = run.model.config.block_size - len(infill_prompt(fim.tokenizer, "def f(x):\n", "\n    return y\n")) + 1
    assert infill.ends[0].usage["completion_tokens"] == room and infill.events[-1] == Finish(0, "length")
    assert plain.ends[0].usage["completion_tokens"] == 100  # past the context: its window slides


def forcing(monkeypatch, token: int) -> None:
    """Every forward pass of the engine makes `token` the most likely next one by far (widening the logits to
    reach it: this tiny model was trained without FIM, so its logits stop short of the sentinels)."""
    import gptforge.model.engine as engine_module

    real = engine_module.forward_logits

    def forced(*args, **kwargs):
        logits = real(*args, **kwargs)
        wider = logits.new_full((*logits.shape[:-1], max(logits.size(-1), token + 1)), -1e4)
        wider[..., : logits.size(-1)] = logits
        wider[..., token] = logits.amax() + 100
        return wider

    monkeypatch.setattr(engine_module, "forward_logits", forced)


def test_a_generation_ends_at_every_token_the_engine_stops_on_eot_and_each_fim_sentinel(run, monkeypatch):
    fim = dataclasses.replace(run, tokenizer=FIMTokenizer(run.tokenizer))
    stops = vars(fim.tokenizer.sentinels) | {"eot": fim.tokenizer.eot}
    assert len(set(stops.values())) == 4
    for name, token in stops.items():
        with monkeypatch.context() as patched:
            forcing(patched, token)
            batcher = Batcher(4, threading.Event())
            infill = Request(batcher, fim, prompt="def f(x):\n", suffix="\n    y\n", max_tokens=20, temperature=0)
            plain = Request(batcher, fim, prompt="import", max_tokens=20, temperature=0.8, seed=0)
            drain(batcher, infill, plain)
        for request in (infill, plain):
            assert request.events[-1] == Finish(0, "stop"), name
            assert request.ends[0].usage["completion_tokens"] == 0 and request.text() == "", name


def test_choices_and_requests_each_draw_their_own_stream_and_a_seed_repeats_its_request(run):
    """At temperature 2 over 24 tokens the tiny random model writes texts that cannot match by chance."""
    body = {"prompt": "def", "max_tokens": 24, "temperature": 2.0, "n": 2}
    batcher = Batcher(8, threading.Event())
    seeded = [Request(batcher, run, **body, seed=7) for _ in range(2)]
    unseeded = [Request(batcher, run, **body) for _ in range(2)]
    drain(batcher, *seeded, *unseeded)
    texts = [(r.text(0), r.text(1)) for r in (*seeded, *unseeded)]
    assert all(len(t) > 24 for pair in texts for t in pair), texts
    assert texts[0] == texts[1]  # the same seed, the same choices, even in one batch
    assert len({t for pair in texts[1:] for t in pair}) == 6, texts  # every other choice its own


def test_one_forward_and_one_draw_a_step_take_every_choice_the_rows_and_those_past_the_context(run, monkeypatch):
    """Sampling a row at a time cost its fixed overhead per row, and so did a forward for each choice past the
    context; each such choice still writes what it writes alone."""
    import gptforge.model.engine as engine_module

    past = [  # 36 tokens and more: past the 32-token context
        {"prompt": "x = 1\n" * 12, "max_tokens": 6, "temperature": 0.9, "seed": 5},
        {"prompt": "def f(a):\n    return a\n" * 4, "max_tokens": 6, "temperature": 1.1, "seed": 6},
    ]
    alone = []
    for body in past:
        alone.append(Request(b := Batcher(8, threading.Event()), run, **body))
        drain(b, alone[-1])
    draws, forwards = [], []
    sample, forward = engine_module.sample_rows, engine_module.forward_logits
    monkeypatch.setattr(engine_module, "sample_rows", lambda x, *a: draws.append(len(x)) or sample(x, *a))
    monkeypatch.setattr(engine_module, "forward_logits", lambda m, x, c: forwards.append(len(x)) or forward(m, x, c))
    batcher = Batcher(8, threading.Event())
    greedy = Request(batcher, run, prompt="def", max_tokens=6, temperature=0, n=2)
    requests = [Request(batcher, run, **body) for body in past]
    batcher.step()  # each choice's first token, from its prefill
    draws.clear()
    forwards.clear()
    drain(batcher, greedy, *requests)
    assert draws == [4] * 5 and forwards == [2, 2] * 5
    assert [r.text() for r in requests] == [r.text() for r in alone] and all(r.text() for r in alone)


def test_the_decode_step_benchmark_runs_on_the_batcher(runs_dir):
    """benchmarks/serve.py --decode-step drives the batcher directly (README's batching figures): it must keep up
    with the batcher's interface."""
    script = Path(__file__).parents[2] / "benchmarks" / "serve.py"
    ckpt = runs_dir / "alpha" / "checkpoints" / "step_000004"
    args = ["--decode-step", "--clients", "1,2", "--max-tokens", "4", "--threads", "1"]
    done = subprocess.run([sys.executable, script, ckpt, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 rows against 1:" in done.stdout, done.stderr[-2000:]


def test_the_decode_benchmark_runs_on_the_engine(runs_dir, tmp_path):
    """benchmarks/decode.py (README's decode figures) must keep up with the engine's interface."""
    script = Path(__file__).parents[2] / "benchmarks" / "decode.py"
    ckpt = runs_dir / "alpha" / "checkpoints" / "step_000004"
    args = ["--no-llama", "--no-hf", "--rounds", "1", "--new-tokens", "4", "--batches", "1,2", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, script, ckpt, *args, "--json", tmp_path / "d.json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(json.loads((tmp_path / "d.json").read_text())["results"]["gptforge"]) == {
        "prompt 14, batch 1",
        "prompt 14, batch 2",
        "prompt 16, batch 1",
    }


def test_the_gpu_script_s_decode_runs_pass_the_decode_benchmark_s_flags(tmp_path):
    """benchmarks/gpu.sh runs only where a GPU is lent: a flag the benchmark no longer takes would waste that turn."""
    import re
    import shlex

    bench = _decode_bench()
    script = (Path(__file__).parents[2] / "benchmarks" / "gpu.sh").read_text().replace("\\\n", " ")
    calls = re.findall(r"benchmarks/decode\.py (.*?) 2>&1", script)
    assert calls
    for call in calls:
        args = bench.parse_args(shlex.split(call.replace("$out", str(tmp_path))))
        assert args.ours and args.device == "cuda"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--batches", "0"], "at least 1"),
        (["--batches", "1,x"], "'x': expected a whole number"),
        (["--rounds", "0"], "at least 1"),
        (["--threads", "0"], "at least 1"),
        (["--new-tokens", "1"], "at least 2"),
        (["--ours", "int9:compiled"], "weights='int9'"),
        (["--serve", "float:xyz"], "decode='xyz'"),
        (["--ours", ","], "expected WEIGHTS:STEP"),
        (["--serve", "int8:compiled:x"], "expected WEIGHTS:STEP"),
        (["--json", "/nonexistent/dir/x.json"], "in a folder that does not exist"),
        (["--json", "/"], "a folder"),
        (["--threads", "x"], "expected a whole number"),
        (["--batches", "1,1"], "a batch size twice"),
        (["--ours", "float:rows,float:rows"], "a variant twice"),
    ],
)
def test_the_decode_benchmark_refuses_bad_flags_in_one_line(flags, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _decode_bench().parse_args(["runs/demo", *flags])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and said in error, error


def _decode_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "decode_bench", Path(__file__).parents[2] / "benchmarks" / "decode.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("stop", ["im_end", "im_start"])
def test_a_chat_reply_ends_at_its_turns_end_or_where_the_model_opens_another(run, monkeypatch, stop):
    """A reply ran on past a generated <|im_start|>, whose text came back as the reply's."""
    from gptforge.tokens.chat import with_chat

    chat = dataclasses.replace(run, tokenizer=with_chat(run.tokenizer))
    forcing(monkeypatch, getattr(chat.tokenizer, stop))
    batcher = Batcher(2, threading.Event())
    reply = Request(batcher, chat, prompt="hello", max_tokens=20, temperature=0)
    drain(batcher, reply)
    assert reply.events[-1] == Finish(0, "stop") and reply.text() == ""
