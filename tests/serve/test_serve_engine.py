"""The server's pieces in-process: stop sequences across tokens, the time limit, picking up a newer checkpoint,
what PATH may be, the binding rule, and CORS only when asked."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time

import pytest

from gptforge.cli import main
from gptforge.serve.engine import Engine
from gptforge.serve.jobs import Done, Event, Failed, Job, Started, Text
from gptforge.serve.protocol import ApiError, Limits, parse_completion
from gptforge.serve.runs import check_root, find_sources
from gptforge.serve.text import Continuation

testclient = pytest.importorskip("starlette.testclient")


class Pieces:
    """A tokenizer whose tokens are byte strings: `decode` replaces a cut UTF-8 character, as GPT-2's does."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def feed(text: Continuation, ids) -> list[str]:
    return [text.add(i) for i in ids if text.finish_reason is None]


def test_a_stop_sequence_split_across_tokens_is_held_back_then_cut():
    tok = Pieces(b"ab", b"c#", b"#d", b"e")
    text = Continuation(tok, ["##", "zz"])
    assert feed(text, [0, 1, 2, 3]) == ["ab", "c", ""]  # '#' is held: it may start '##'
    assert (text.text, text.finish_reason, text.end("length")) == ("abc", "stop", "")


def test_held_text_is_released_when_the_stop_does_not_follow_and_a_cut_character_waits():
    euro = "€".encode()
    tok = Pieces(b"x#", b"y", euro[:2], euro[2:], b"#")
    text = Continuation(tok, ["##"])
    assert feed(text, [0, 1, 2, 3, 4]) == ["x", "#y", "", "€", ""]
    assert text.end("length") == "#" and text.finish_reason == "length" and text.text == "x#y€#"


def test_a_character_cut_at_the_end_ends_the_text_as_a_replacement_character():
    euro = "€".encode()
    text = Continuation(Pieces(b"x", euro[:1], euro[1:2]), [])
    assert feed(text, [0, 1, 2]) == ["x", "", ""]
    assert text.end("length") == "\ufffd" and text.text == "x\ufffd"


def test_a_stop_sequence_completed_by_a_character_cut_at_the_end_still_stops_the_text():
    euro = "€".encode()
    text = Continuation(Pieces(b"ab", euro[:1]), ["b\ufffd"])
    assert feed(text, [0, 1]) == ["a", ""]  # 'b' is held: it may start the stop sequence
    assert text.end("length") == "" and (text.text, text.finish_reason, text.stop_word) == ("a", "stop", "b\ufffd")


def completion(engine: Engine, body: dict, deadline: float | None = None) -> list[Event]:
    """Run one request to its end; its events."""
    events: list[Event] = []
    ended = threading.Event()
    engine.admit()
    req = parse_completion({"model": "run", "prompt": "def", **body}, engine.limits)
    emit = lambda event: (events.append(event), isinstance(event, Done | Failed) and ended.set())  # noqa: E731
    engine.start(Job(req, emit, time.monotonic() + 60 if deadline is None else deadline))
    assert ended.wait(60), events
    return events


def test_a_request_out_of_time_before_it_starts_is_429_and_the_newest_checkpoint_is_used(runs_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs_dir / "alpha", run, ignore=shutil.ignore_patterns("step_000004"))
    engine = Engine(tmp_path, Limits())
    events = completion(engine, {"max_tokens": 5, "n": 2}, deadline=time.monotonic())
    assert [(type(e), e.error.status, e.error.code) for e in events] == [(Failed, 429, "server_busy")]
    events = completion(engine, {"max_tokens": 3, "temperature": 0})
    assert events[0] == Started("step_000002", "run") and isinstance(events[-1], Done)

    shutil.copytree(runs_dir / "alpha" / "checkpoints" / "step_000004", run / "checkpoints" / "step_000004")
    events = completion(engine, {"max_tokens": 3, "temperature": 0})
    assert events[0] == Started("step_000004", "run") and isinstance(events[-1], Done) and engine.in_flight == 0


def test_requests_past_the_queue_are_refused_and_errors_carry_openai_fields(runs_dir):
    engine = Engine(runs_dir, Limits(parallel=1, queue=1))
    engine.admit(), engine.admit()
    with pytest.raises(ApiError) as caught:
        engine.admit()
    assert caught.value.status == 429 and caught.value.body()["error"]["type"] == "rate_limit_error"
    engine.in_flight = 0
    error = completion(engine, {"model": "nope"})[-1].error
    assert (error.status, error.code) == (404, "model_not_found")


def test_serve_path_is_a_run_a_checkpoint_or_a_folder_of_runs_and_nothing_outside(runs_dir, tmp_path):
    assert list(find_sources(check_root(runs_dir))) == ["alpha", "beta"]
    assert list(find_sources(check_root(runs_dir / "alpha"))) == ["alpha"]
    ckpt = find_sources(check_root(runs_dir / "alpha" / "checkpoints" / "step_000002"))["step_000002"]
    assert ckpt.is_checkpoint and ckpt.newest_checkpoint() == ckpt.folder
    (tmp_path / "outside").symlink_to(runs_dir / "alpha")
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "metrics.jsonl").write_text("")
    with pytest.warns(UserWarning, match="outside leads outside the served folder"):
        assert list(find_sources(check_root(tmp_path))) == ["inside"]  # the link leads beyond PATH


def test_a_run_folder_whose_name_is_not_utf8_is_listed_and_served_under_its_escaped_name(runs_dir, tmp_path):
    """Python reads the byte 0xe9 of b'caf\\xe9' as a lone surrogate, which no JSON response can encode: listing
    every run failed with a 500."""
    import os

    from gptforge.serve.app import build_app

    older = shutil.ignore_patterns("step_000004")  # one checkpoint each: less to copy
    shutil.copytree(runs_dir / "alpha", tmp_path / os.fsdecode(b"caf\xe9"), ignore=older)
    shutil.copytree(runs_dir / "beta", tmp_path / "beta", ignore=older)
    client = testclient.TestClient(build_app(tmp_path))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["beta", "caf\\xe9"]
    assert [r["id"] for r in client.get("/api/runs").json()["runs"]] == ["beta", "caf\\xe9"]
    assert client.get("/api/runs/caf%5Cxe9/metrics").json()["version"] is not None
    answer = client.post("/v1/completions", json={"model": "caf\\xe9", "prompt": "def", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "caf\\xe9"
    shutil.copytree(tmp_path / "beta", tmp_path / "caf\\xe9")  # the same name, in its own right
    with pytest.warns(UserWarning, match=r"caf\udce9: not served, as another run is served as caf\\xe9$"):
        assert list(find_sources(check_root(tmp_path))) == ["beta", "caf\\xe9"]


@pytest.mark.parametrize("key", ["", "   ", " KEY", "KEY\n", "clé"])
def test_an_empty_or_unsendable_api_key_is_refused_in_one_line(runs_dir, capsys, monkeypatch, key):
    """An empty key served everyone without a word; spaces at either end or a non-ASCII character started a server
    that no client could authenticate to."""
    from gptforge.cli.parser import build_parser

    with pytest.raises(SystemExit) as stop:  # the parser alone: a key it let through would start a server
        build_parser().parse_args(["serve", str(runs_dir), "--api-key", key])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("gptforge serve: error: argument --api-key: "), err
    assert err.count("\n") == 1 and (not key.strip() or key.strip() not in err.replace("GPTFORGE_API_KEY", ""))
    monkeypatch.setenv("GPTFORGE_API_KEY", key)  # the same key from the environment
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["serve", str(runs_dir)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "GPTFORGE_API_KEY" in err and err.count("\n") == 1, err


def test_binding_another_address_needs_a_key_and_a_busy_port_is_one_line(runs_dir, capsys):
    assert main(["serve", str(runs_dir), "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gptforge serve: error: --host 0.0.0.0 lets anyone who can reach this machine"), err
    assert "--api-key KEY" in err and err.count("\n") == 1
    from gptforge.errors import GptforgeError
    from gptforge.serve.app import check_binding

    with pytest.raises(GptforgeError, match=r"^--allow-host '\*' lets any web page"):  # by DNS rebinding
        check_binding("127.0.0.1", None, ("myhost.lan", "*"))
    check_binding("127.0.0.1", "KEY", ("*",))  # with a key, or naming the hosts, it starts
    check_binding("127.0.0.1", None, ("myhost.lan",))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", str(runs_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gptforge serve: error: --host 127.0.0.1 --port {port}: cannot listen there"), err
    if socket.has_ipv6:  # loopback as a URL writes it: was refused as an address others reach, needing a key
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as busy:
            port = busy.getsockname()[1]
            assert main(["serve", str(runs_dir), "--host", "[::1]", "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"gptforge serve: error: --host ::1 --port {port}: cannot listen there"), err


def test_a_device_this_machine_lacks_is_refused_at_start_in_one_line(runs_dir, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a GPU machine too: as if it had none
    assert main(["serve", str(runs_dir), "--device", "cuda", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "gptforge serve: error: --device='cuda': CUDA is not available on this machine\n", err


@pytest.mark.parametrize(("flag", "value"), [("--parallel", "100000000"), ("--parallel", "1025"), ("--max-n", "129")])
def test_parallel_and_max_n_past_their_caps_are_one_line_usage_errors(runs_dir, capsys, flag, value):
    with pytest.raises(SystemExit) as caught:
        main(["serve", str(runs_dir), flag, value])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {flag}: expected an integer in [1, " in err and repr(value) in err, err


def test_a_missing_path_is_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 1
    assert "nope: not a folder (expected a run folder, a checkpoint or a folder of runs)" in capsys.readouterr().err


def test_no_cors_unless_asked_and_no_path_outside_the_runs(runs_dir):
    from gptforge.serve.app import build_app

    origin = {"Origin": "https://elsewhere.example"}
    plain = testclient.TestClient(build_app(runs_dir))
    assert "access-control-allow-origin" not in plain.get("/api/runs", headers=origin).headers
    for path in (
        "/api/runs/..%2F..%2Fetc/config",
        "/api/runs/../samples",
        "/static/../runs.py",
        "/static/%2e%2e/app.py",
    ):
        assert plain.get(path).status_code == 404, path
    allowed = testclient.TestClient(build_app(runs_dir, cors=("https://elsewhere.example",)))
    assert allowed.get("/api/runs", headers=origin).headers["access-control-allow-origin"] == origin["Origin"]


def test_without_the_serve_extra_the_command_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without .[serve] looks like to `import`
    monkeypatch.delitem(sys.modules, "gptforge.serve.app", raising=False)
    assert main(["serve", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "gptforge serve: error: serve needs its extra: pip install 'gptforge[serve]' (missing uvicorn)\n"
    )


def test_the_page_gets_a_long_log_in_at_most_2000_points_and_only_when_it_changed(tmp_path):
    from gptforge.serve.app import build_app

    run = tmp_path / "long"
    run.mkdir()
    train = {"kind": "train", "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "time": 0.0, "tokens": 8}
    lines = [json.dumps({**train, "step": s, "loss": float(s % 2)}) for s in range(1, 5001)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    client = testclient.TestClient(build_app(tmp_path))
    first = client.get("/api/runs/long/metrics").json()
    steps, losses = first["train"]["step"], first["train"]["loss"]
    assert len(steps) == 1667 and steps[:2] == [3, 6] and steps[-1] == 5000  # buckets of 3 records, averaged
    assert losses[:2] == [2 / 3, 1 / 3] and first["val"] == {"step": [], "loss": [], "bpb": []}
    again = client.get("/api/runs/long/metrics", params={"version": first["version"]}).json()
    assert again == {"version": first["version"], "unchanged": True}
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**train, "step": 5001, "loss": 0.5}) + "\n")
    grown = client.get("/api/runs/long/metrics", params={"version": first["version"]}).json()
    assert grown["train"]["step"][-1] == 5001


def test_a_diverged_checkpoint_is_503_greedy_too_and_a_tiny_temperature_is_greedy(runs_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from gptforge.checkpoint.integrity import seal

    run = tmp_path / "run"
    shutil.copytree(runs_dir / "alpha", run)
    engine = Engine(tmp_path, Limits())
    greedy = completion(engine, {"max_tokens": 6, "temperature": 0, "seed": 1})
    tiny_t = completion(engine, {"max_tokens": 6, "temperature": 1e-40, "seed": 1})
    assert isinstance(greedy[-1], Done) and greedy[1:-1] == tiny_t[1:-1]

    weights = run / "checkpoints" / "step_000004" / "model.safetensors"
    save_file({k: v.fill_(float("nan")) for k, v in load_file(weights).items()}, weights)
    seal(weights.parent)  # as the run would have saved them: intact, and diverged
    engine = Engine(tmp_path, Limits())
    for temperature in (0, 0.8):
        events = completion(engine, {"max_tokens": 4, "temperature": temperature})
        failed = [e for e in events if not isinstance(e, Started)][0]
        assert isinstance(failed, Failed) and failed.error.status == 503 and "diverged" in failed.error.message


def test_a_nan_or_infinity_in_a_log_is_a_gap_in_its_curve_not_an_error(tmp_path):
    from gptforge.serve.app import build_app

    run = tmp_path / "run"
    run.mkdir()
    train = {"kind": "train", "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "time": 0.0, "tokens": 8}
    code = {"kind": "code", "step": 1, "cases": 2, "prefix_exact": float("nan"), "parse_rate": float("inf")}
    lines = [json.dumps({**train, "step": 1, "loss": float("nan")}), json.dumps(code | {"infill_exact": True})]
    lines.append(json.dumps({**train, "step": 2, "loss": 10**400}))  # past a float: math.isfinite overflowed
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # Python writes NaN and Infinity, JSON has neither
    answer = testclient.TestClient(build_app(tmp_path)).get("/api/runs/run/metrics")
    assert answer.status_code == 200
    assert answer.json()["train"]["loss"] == [None, None] and answer.json()["code"]["prefix_exact"] == [None]
    assert answer.json()["code"]["parse_rate"] == [None] and answer.json()["code"]["infill_exact"] == [None]


def test_int8_weights_and_the_static_step_answer_as_the_engine_does_and_load_on_the_batcher_thread(
    runs_dir, tmp_path, monkeypatch
):
    """Every torch call of a model on one thread: OpenMP threads a second thread started (a model's load) made
    each later decode step 2-4x slower on a 2-core host."""
    import gptforge.serve.engine as serve_engine
    from gptforge.checkpoint import load_for_inference
    from gptforge.model.engine import Decoding, Sequence
    from gptforge.model.engine import Engine as Decoder
    from gptforge.model.quantize import Int8Linear

    shutil.copytree(runs_dir / "alpha", tmp_path / "run")
    threads = []
    loading = serve_engine.load_for_inference
    monkeypatch.setattr(
        serve_engine,
        "load_for_inference",
        lambda *a, **k: (threads.append(threading.current_thread().name), loading(*a, **k))[1],
    )
    decoding = Decoding("int8", "static")
    engine = Engine(tmp_path, Limits(), decoding=decoding)
    events = completion(engine, {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0})
    assert threads == ["gptforge-batcher"] and isinstance(events[-1], Done), events

    run = load_for_inference(tmp_path / "run" / "checkpoints" / "step_000004", decoding=decoding)
    assert run.decoding == decoding
    (seq,) = Decoder(run.model, rows=1, dtype=run.dtype).run(
        Sequence([5, 6, 7], 6, ends=frozenset({run.tokenizer.eot}))
    )
    text = "".join(e.piece for e in events if isinstance(e, Text))
    assert text == run.tokenizer.decode([t for t in seq.new if t != run.tokenizer.eot])
    assert isinstance(engine.model("run")[2].model.lm_head, Int8Linear)


def test_serve_passes_its_decoding_flags_on_and_refuses_unknown_ones(runs_dir, capsys, monkeypatch):
    from gptforge.model.engine import Decoding

    seen = {}
    monkeypatch.setattr("gptforge.serve.app.serve", lambda path, **kwargs: seen.update(kwargs))
    assert main(["serve", str(runs_dir), "--weights", "int8", "--decode", "compiled"]) == 0
    assert seen["decoding"] == Decoding("int8", "compiled")
    with pytest.raises(SystemExit) as caught:
        main(["serve", str(runs_dir), "--weights", "int4"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "argument --weights: invalid choice: 'int4'" in err, err
