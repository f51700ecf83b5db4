"""The CLI end to end on a tiny config, and its promised one-line errors."""

import errno
import json
import subprocess
import sys

import pytest
import torch

from gptforge.cli import main
from gptforge.errors import GptforgeError


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "gptforge", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_pipeline_end_to_end(corpus_dir, tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", str(corpus_dir), "--out", str(data), "--val-fraction", "0.1", "--workers", "1"]) == 0
    args = ["train", "--config", "tiny", "--data", str(data), "--out", str(run), "--set", "train.max_steps=4"]
    assert main(args) == 0
    assert (run / "checkpoints" / "step_000004" / "model.safetensors").is_file()
    capsys.readouterr()
    hellaswag = tmp_path / "hellaswag.jsonl"
    hellaswag.write_text(json.dumps({"ctx": "def add", "endings": ["(a, b):", "x", "y", "z"], "label": 0}) + "\n")
    args = [
        "eval",
        str(run),
        "--data",
        str(data),
        "--text",
        str(corpus_dir / "mod_001.py"),
        "--hellaswag",
        str(hellaswag),
        "--tokens",
        "256",
        "--batch-size",
        "2",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 4 and result["val"]["ppl"] > 1 and result["val"]["tokens"] == 256
    assert result["text"]["bpb"] > 0 and result["hellaswag"]["n"] == 1
    args = ["eval", str(run), "--humaneval", "--limit", "1", "--samples", "2", "--k", "1,2", "--json"]
    assert main(args) == 0
    humaneval = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["humaneval"]
    assert humaneval["problems"] == 1 and humaneval["n"] == 2 and set(humaneval) >= {"pass@1", "pass@2"}
    threads = torch.get_num_threads()
    try:
        sample = ["sample", str(run), "--prompt", "def add", "-n", "2", "--max-new-tokens", "5"]
        assert main([*sample, "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and "def add" in out
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "gptforge", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "prepare" in proc.stdout and "demo" in proc.stdout


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["prepare", "{tmp}/missing", "--out", "{tmp}/o"], 1, "missing: no such file or directory"),
        (["prepare", "{tmp}/empty", "--out", "{tmp}/o"], 1, "no files in it"),
        (["prepare", "stdlib", "--out", "{tmp}/o", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["train", "--data", "{tmp}/missing"], 1, "no manifest.json"),
        (["train", "--data", "{tmp}", "--set", "optim.nope=1"], 1, "unknown key 'optim.nope'"),
        (["train", "--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
        (["sample", "{tmp}/missing"], 1, "not a checkpoint"),
        (["sample", "{tmp}", "--top-k", "-3"], 2, "argument --top-k: expected an integer >= 0, got '-3'"),
        (["sample", "{tmp}", "--top-p", "-1"], 2, "argument --top-p: expected a number in (0, 1], got '-1'"),
        (["sample", "{tmp}", "--temperature", "nan"], 2, "argument --temperature: expected a number >= 0.0"),
        (["eval", "{tmp}", "--k", "1,x"], 2, "argument --k: expected comma-separated positive integers"),
        (["eval", "{tmp}", "--batch-size", "0"], 2, "argument --batch-size: expected an integer >= 1, got '0'"),
        (["eval", "{tmp}", "--threads", "0"], 2, "argument --threads: expected an integer >= 1, got '0'"),
        (["bench", "--steps", "0"], 2, "argument --steps: expected an integer >= 1, got '0'"),
        (["sample", "{tmp}", "--seed", "9" * 24], 2, "argument --seed: expected an integer in [0, 2**63)"),
        (["train", "--data", "{tmp}", "--set", "model.n_head=3"], 1, "model.n_head=3 must divide model.n_embd"),
        (["train", "--set", "checkpoint.keep_last=-1"], 1, "checkpoint.keep_last=-1 (expected >= 0)"),
        (["plot", "{tmp}"], 1, "no metrics.jsonl"),
        (["train", "--resume", "auto", "--out", "{tmp}/none"], 1, "has no checkpoint yet; give --config"),
    ],
)
def test_bad_input_gives_one_line_error(tmp_path, args, code, message):
    (tmp_path / "empty").mkdir()
    proc = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == code
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_out_of_memory_is_a_one_line_error_with_the_remedy(monkeypatch, capsys):
    import torch

    import gptforge.bench

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monkeypatch.setattr(gptforge.bench, "run_bench", out_of_memory)
    assert main(["bench", "--config", "tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out of GPU memory" in err and "train.micro_batch" in err


def test_os_errors_are_one_line_and_bugs_say_so(monkeypatch, capsys):
    import gptforge.report.summary

    def disk_full(run_dir):
        raise OSError(errno.ENOSPC, "No space left on device", f"{run_dir}/report.md")

    monkeypatch.setattr(gptforge.report.summary, "run_report", disk_full)
    assert main(["report", "runs/x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "gptforge report: error: runs/x/report.md: No space left on device (check the disk space and permissions there)"
    )

    def bug(run_dir):
        return {}["missing"]

    monkeypatch.setattr(gptforge.report.summary, "run_report", bug)
    assert main(["report", "runs/x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err
    assert err.strip().splitlines()[-1].startswith("gptforge report: error: unexpected failure: a bug in gptforge")


def test_an_error_mid_sample_starts_on_its_own_line(monkeypatch, capsys):
    import gptforge.sample

    def fails_midway(*args, **kwargs):
        yield "--- sample 0\nhi"
        raise GptforgeError("the model's next-token probabilities are not finite (its weights have diverged)")

    monkeypatch.setattr(gptforge.sample, "sample_texts", fails_midway)
    assert main(["sample", "ckpt"]) == 1
    out, err = capsys.readouterr()
    assert out == "--- sample 0\nhi\n" and err.startswith("gptforge sample: error: the model's next-token")


def test_a_reader_that_goes_away_ends_quietly(monkeypatch, capsys):
    import gptforge.report.summary

    def pipe_closed(run_dir):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(gptforge.report.summary, "run_report", pipe_closed)
    assert main(["report", "runs/x"]) == 141
    assert capsys.readouterr().err == ""
