"""What the server reads, in-process: nothing outside PATH whatever is a link, a checkpoint's tokenizer only from
its own folder, and every route answering cleanly while the served folder is gone."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import threading
import time

import pytest

from gptforge.tokens.tokenizer import train_bpe

testclient = pytest.importorskip("starlette.testclient")
OUTSIDE = "leads outside the served folder"


@pytest.fixture
def served(runs_dir, tmp_path):
    """PATH = tmp/served holding run/ (a copy of alpha: checkpoints at steps 2 and 4), and tmp/elsewhere beside it."""
    shutil.copytree(runs_dir / "alpha", tmp_path / "served" / "run")
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "served"


def client(root):
    from gptforge.serve.app import build_app

    return testclient.TestClient(build_app(root), base_url="http://127.0.0.1")


def complete(http, model="run"):
    return http.post("/v1/completions", json={"model": model, "prompt": "def", "max_tokens": 2, "temperature": 0})


def link_out(path, elsewhere):
    """Move `path` to `elsewhere` and leave a link to it in its place."""
    shutil.move(path, elsewhere / path.name)
    path.symlink_to(elsewhere / path.name)


TRAIN = {"kind": "train", "step": 9, "lr": 0.1, "grad_norm": 1.0, "tokens": 8, "tokens_per_s": 1.0, "time": 1.0}


@pytest.mark.parametrize(
    ("name", "route", "content"),
    [
        ("config.toml", "config", "[secret]\nkey = 4242.5\n"),
        ("samples.jsonl", "samples", json.dumps({"step": 9, "text": "4242.5"}) + "\n"),
        ("metrics.jsonl", "metrics", json.dumps({**TRAIN, "loss": 4242.5}) + "\n"),
    ],
)
def test_a_run_file_linked_outside_path_is_absent_to_the_page(served, name, route, content):
    outside = served.parent / "elsewhere" / name
    outside.write_text(content)
    (served / "run" / name).unlink()
    (served / "run" / name).symlink_to(outside)
    http = client(served)
    with pytest.warns(UserWarning, match=OUTSIDE):  # the server's log says why the file is not shown
        answer = http.get(f"/api/runs/run/{route}")
        assert answer.status_code == 200 and "4242.5" not in answer.text
        no_metrics = {"version": None, **dict.fromkeys(("train", "val", "code", "rl", "tasks"), {})}
        assert answer.json() in ({"toml": ""}, {"samples": []}, no_metrics)
        assert http.get("/api/runs").json()["runs"][0]["has_metrics"] is (name != "metrics.jsonl")


def bpe(path):
    """A small trained tokenizer file (what a run prepared with --train-tokenizer keeps in its checkpoints)."""
    train_bpe(["def add(a, b):\n    return a + b\n"] * 20, 300, path)


def set_tokenizer(ckpt, name):
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "tokenizer": name}))


@pytest.mark.parametrize("linked", ["model.safetensors", "meta.json", "optimizer.pt", "tok.json", "step_000004"])
def test_a_checkpoint_with_a_file_or_folder_linked_outside_path_is_skipped(served, linked):
    step = served / "run" / "checkpoints" / "step_000004"
    bpe(step / "tok.json")
    set_tokenizer(step, "tok.json")
    http = client(served)
    assert complete(http).json()["system_fingerprint"] == "step_000004"  # its verdict is known: it must be made again
    link_out(step if linked == "step_000004" else step / linked, served.parent / "elsewhere")
    with pytest.warns(UserWarning, match=OUTSIDE):
        assert [m["checkpoint"] for m in http.get("/v1/models").json()["data"]] == ["step_000002"]
        answer = complete(http)
        assert answer.status_code == 200 and answer.json()["system_fingerprint"] == "step_000002"


def test_a_checkpoint_damaged_after_it_was_served_is_skipped_at_the_next_request(served):
    http = client(served)
    assert complete(http).json()["system_fingerprint"] == "step_000004"
    weights = served / "run" / "checkpoints" / "step_000004" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)  # what a full disk leaves
    with pytest.warns(UserWarning, match="step_000004: damaged checkpoint"):
        assert complete(http).json()["system_fingerprint"] == "step_000002"


def test_a_checkpoint_failing_its_checksums_is_skipped_and_not_read_again(served, monkeypatch):
    """As `--resume auto` skips it; it was a 503 to every request, each hashing its weights again first."""
    import gptforge.serve.engine as engine

    loads = []
    load = engine.load_for_inference
    monkeypatch.setattr(engine, "load_for_inference", lambda ckpt, *a: (loads.append(ckpt.name), load(ckpt, *a))[1])
    weights = served / "run" / "checkpoints" / "step_000004" / "model.safetensors"
    flip(weights)
    http = client(served)
    with pytest.warns(UserWarning, match=r"step_000004: damaged checkpoint \(.*sha256"):
        assert complete(http).json()["system_fingerprint"] == "step_000002"
    assert complete(http).json()["system_fingerprint"] == "step_000002"
    assert [m["checkpoint"] for m in http.get("/v1/models").json()["data"]] == ["step_000002"]
    assert loads == ["step_000004", "step_000002"]


def test_a_checkpoint_through_a_link_failing_its_checksums_is_skipped(served):
    """A checkpoint holding a link is checked at every request (its verdict is not kept): its failed load must
    still leave it behind, not be tried again for ever."""

    (served / "store").mkdir()
    link_out(served / "run" / "checkpoints" / "step_000004", served / "store")
    flip(served / "store" / "step_000004" / "model.safetensors")
    answers = []
    asking = threading.Thread(target=lambda: answers.append(complete(client(served))), daemon=True)
    with pytest.warns(UserWarning, match="step_000004: damaged checkpoint"):
        asking.start()
        asking.join(60)
    assert answers and answers[0].json()["system_fingerprint"] == "step_000002"


def flip(weights):
    """Ten bytes inside a tensor turned over: the size and the header unchanged, the sha256 not."""
    data = bytearray(weights.read_bytes())
    data[-50:-40] = bytes(b ^ 0xFF for b in data[-50:-40])
    weights.write_bytes(bytes(data))


def test_a_checkpoints_folder_linked_outside_path_serves_no_model(served):
    link_out(served / "run" / "checkpoints", served.parent / "elsewhere")
    http = client(served)
    with pytest.warns(UserWarning, match=OUTSIDE):
        assert http.get("/v1/models").json()["data"] == []
        assert http.get("/api/runs").json()["runs"][0]["checkpoint"] is None
        answer = complete(http)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_links_that_stay_inside_path_still_work(served):
    run = served / "run"
    (served / "store").mkdir()
    link_out(run / "config.toml", served / "store")
    link_out(run / "checkpoints" / "step_000004", served / "store")
    http = client(served)
    assert "[model]" in http.get("/api/runs/run/config").json()["toml"]
    assert complete(http).json()["system_fingerprint"] == "step_000004"


@pytest.mark.parametrize("linked", ["model.safetensors", "step_000004"])
def test_a_link_in_a_served_checkpoint_led_outside_path_later_is_skipped(served, linked):
    """The checkpoint's own entries are unchanged: only where its link leads changed, and that must be seen."""
    step = served / "run" / "checkpoints" / "step_000004"
    (served / "store").mkdir()
    link_out(step if linked == "step_000004" else step / linked, served / "store")
    http = client(served)
    assert complete(http).json()["system_fingerprint"] == "step_000004"
    link_out(served / "store" / linked, served.parent / "elsewhere")
    with pytest.warns(UserWarning, match=OUTSIDE):
        assert [m["checkpoint"] for m in http.get("/v1/models").json()["data"]] == ["step_000002"]
        assert complete(http).json()["system_fingerprint"] == "step_000002"


@pytest.mark.parametrize("tokenizer", ["absolute", "../../../../elsewhere/tok.json", 5, None])
def test_a_tokenizer_that_is_not_a_file_of_the_checkpoint_is_never_read(served, tokenizer):
    ckpt = served / "run" / "checkpoints" / "step_000004"  # served alone: nothing to fall back to
    bpe(served.parent / "elsewhere" / "tok.json")  # one that would load
    set_tokenizer(ckpt, str(served.parent / "elsewhere" / "tok.json") if tokenizer == "absolute" else tokenizer)
    with pytest.warns(UserWarning, match="damaged checkpoint"):
        answer = complete(client(ckpt), model="step_000004")
        error = answer.json()["error"]
        assert answer.status_code == 503 and error["code"] == "model_unavailable", error
        assert "tokenizer" in error["message"] and "\n" not in error["message"]


def test_every_route_answers_cleanly_while_the_served_folder_is_gone_and_recovers(served):
    http = client(served)
    assert complete(http).status_code == 200  # the model is loaded: it is not answered from memory once gone
    served.rename(served.parent / "moved")
    for route in ("/api/runs", "/api/runs/run/metrics", "/api/runs/run/samples", "/api/runs/run/config"):
        answer = http.get(route)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (503, "served_folder_gone"), route
        assert "the served folder is gone" in error["message"], route
    for answer in (http.get("/v1/models"), complete(http)):
        assert answer.status_code == 503 and "the served folder is gone" in answer.json()["error"]["message"]
    assert http.get("/").status_code == 200  # the page itself, which then shows the message
    (served.parent / "moved").rename(served)
    assert http.get("/api/runs").json()["runs"][0]["id"] == "run"
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["run"]
    assert complete(http).status_code == 200


@pytest.mark.parametrize(
    ("route", "status", "code"),
    [("/api/runs/nope/samples", 404, "run_not_found"), ("/api/runs/run/metrics", 422, "unreadable_run_file")],
)
def test_the_page_routes_answer_their_errors_in_openai_form_as_the_api_does(tmp_path, route, status, code):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{not json\n")
    answer = client(tmp_path).get(route)
    error = answer.json()["error"]
    assert (answer.status_code, answer.headers["content-type"], error["code"]) == (status, "application/json", code)
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["message"], error


def test_a_link_loop_is_an_absent_file_not_a_crash(served):
    run = served / "run"
    for path in (run / "config.toml", run / "checkpoints" / "step_000004" / "model.safetensors"):
        path.unlink()
        path.symlink_to(path.name)  # itself
    http = client(served)
    assert http.get("/api/runs/run/config").json() == {"toml": ""}
    assert complete(http).json()["system_fingerprint"] == "step_000002"


def test_a_checkpoint_file_that_never_opens_holds_up_no_other_client(served):
    """GET /v1/models reads the checkpoints' files: on the event loop, a FIFO there (or a stalled disk) hung every
    client of the server until it opened; a FIFO is now named as damage and never opened."""
    fifo = served / "run" / "checkpoints" / "step_000004" / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    with client(served) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        listing = pool.submit(http.get, "/v1/models")
        time.sleep(0.5)  # a reader would wait in open() now
        try:
            assert pool.submit(http.get, "/").result(timeout=10).status_code == 200
        finally:  # were a reader waiting, a writer lets its open() return (no reader: ENXIO, nothing to do)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        assert listing.result(timeout=10).json()["data"][0]["checkpoint"] == "step_000002"


def test_verdicts_on_checkpoints_are_kept_for_a_bounded_number(served, monkeypatch):
    """A server following a long training run sees a new checkpoint at every save."""
    from gptforge.serve import runs

    monkeypatch.setattr(runs, "VERDICTS_KEPT", 1)
    monkeypatch.setattr(runs, "_VERDICTS", {})
    source = runs.find_sources(served.resolve())["run"]
    assert [ckpt.name for ckpt in source.checkpoints()] == ["step_000004", "step_000002"]
    assert len(runs._VERDICTS) == 1
