"""The CLI end to end on a tiny config, and its promised one-line errors."""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptforge.cli import main
from gptforge.demo import next_commands
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
    # as the demo's: the curves, a summary and what goes on from the run (a plain train ended without them)
    printed = capsys.readouterr().out
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["checkpoint"] == str(run / "checkpoints" / "step_000004")
    assert summary["after"]["loss"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    assert printed.rstrip().endswith("\n".join(next_commands(run, data)))
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
        (["eval", "{tmp}", "--threads", "0"], 2, "argument --threads: expected an integer in [1, 1024], got '0'"),
        (["serve", "{tmp}", "--threads", "100000"], 2, "argument --threads: expected an integer in [1, 1024], got '1"),
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


@pytest.mark.parametrize(
    "given",
    [
        ["--a=SECRETKEY"],  # ambiguous between --api-key and --allow-host: argparse echoed the option as given
        ["--api=SECRETKEY"],  # an abbreviation argparse took for --api-key: one letter less would have echoed it
        ["--apikey", "SECRETKEY"],
        ["--apikey=SECRETKEY"],
        ["--api_key", "SECRETKEY", "--port", "1", "-k", "SECRETKEY"],
    ],
)
def test_a_mistyped_api_key_flag_is_named_but_the_key_never_shown(capsys, given):
    """`serve RUN --apikey KEY` said "unrecognized arguments: --apikey KEY": the key landed in terminals and logs."""
    from gptforge.cli.parser import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["serve", "RUN", *given])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and "SECRETKEY" not in out + err and err.count("\n") == 1, err
    flag = given[0].partition("=")[0]
    assert f"unrecognized arguments: {flag} (its value not shown)" in err, err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "RUN", "extra", "--port", "1"])
    assert "unrecognized arguments: extra (see gptforge --help)" in capsys.readouterr().err


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


def test_under_torchrun_only_rank_0_prints_an_error_and_each_rank_files_it(tmp_path, monkeypatch, capsys):
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error_{rank}.json"))
        assert main(["sample", str(tmp_path / "missing")]) == 1
        line = f"gptforge sample: error: {tmp_path / 'missing'}: not a checkpoint"
        assert capsys.readouterr().err.startswith(line) == (rank == "0")  # the others stay quiet
        assert json.loads((tmp_path / f"error_{rank}.json").read_text())["message"].startswith(line)  # for torchrun
    import gptforge.report.summary

    def peer_gone(run_dir):
        raise GptforgeError("rank 1: all_reduce in stop_vote timed out: a peer rank did not respond")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(gptforge.report.summary, "run_report", peer_gone)
    assert main(["report", "runs/x"]) == 1  # a failure of this rank's own, which rank 0 may never see
    assert capsys.readouterr().err.startswith("gptforge report: error: rank 1: all_reduce in stop_vote timed out")


def tiny_run(folder):
    """A run folder as plot reads it: one train record."""
    folder.mkdir()
    record = {"step": 1, "kind": "train", "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens": 8}
    (folder / "metrics.jsonl").write_text(json.dumps({**record, "tokens_per_s": 8.0, "time": 0.1}) + "\n")
    return folder


@pytest.mark.parametrize("kind", ["device", "fifo", "socket"])
def test_every_command_refuses_an_out_that_is_a_device_fifo_or_socket(data_dir, corpus_dir, tmp_path, capsys, kind):
    from tests.test_files import special_file

    from gptforge.checkpoint import save_checkpoint
    from gptforge.config import Config
    from gptforge.model.gpt import GPT, GPTConfig
    from gptforge.tokens.tokenizer import load_tokenizer

    special = special_file(kind, tmp_path)
    before = os.stat(special)
    cfg = Config(model=GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
    ckpt = save_checkpoint(tmp_path / "run", 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"), {"tokens": 0})
    commands = {
        "export": [str(ckpt), "--force"],
        "import": [str(tmp_path / "hf"), "--force"],
        "prepare": [str(corpus_dir), "--force"],
        "train": ["--config", "tiny", "--data", str(data_dir)],
        "demo": ["--data", str(data_dir), "--force"],
        "plot": [str(tiny_run(tmp_path / "plotted"))],
        "rl": ["--set", f"train.init_from={ckpt}"],
    }
    for command, args in commands.items():
        assert main([command, *args, "--out", str(special)]) == 1, command
        err = capsys.readouterr().err
        assert err.startswith(f"gptforge {command}: error: ") and str(special) in err and err.count("\n") == 1, err
    assert (os.stat(special).st_ino, os.stat(special).st_mode) == (before.st_ino, before.st_mode)


def test_a_file_out_ending_in_a_slash_is_one_line_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plot", str(tiny_run(tmp_path / "run")), "--out", f"{tmp_path}/newdir/"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --out: expected a file name, got " in err and "ends in a slash" in err
    assert not (tmp_path / "newdir").exists()


@pytest.mark.parametrize("command", [["train"], ["bench"], ["plan"], ["demo"]])
def test_an_empty_config_is_one_line_not_the_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--config", ""])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --config: expected a preset name or a .toml path, got ''" in err


def test_prepare_force_never_replaces_a_data_folder_holding_a_run(data_dir, corpus_dir, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    (data / "myrun" / "checkpoints").mkdir(parents=True)  # what train --out DATA/myrun made before it was refused
    assert main(["prepare", str(corpus_dir), "--out", str(data), "--force", "--val-fraction", "0.2"]) == 1
    assert capsys.readouterr().err == (
        f"gptforge prepare: error: --out {data}: holds a gptforge run or checkpoint ({data / 'myrun'}), which "
        "replacing the folder would delete; move it out first\n"
    )
    assert (data / "myrun" / "checkpoints").is_dir()


@pytest.mark.parametrize("mark", ["metrics.jsonl", "checkpoints"])
def test_prepare_force_never_replaces_a_folder_that_is_a_run(corpus_dir, tmp_path, capsys, mark):
    run = tiny_run(tmp_path / "run")
    (run / "checkpoints").mkdir()
    (run / ("checkpoints" if mark == "metrics.jsonl" else "metrics.jsonl")).rename(run / "kept")  # only `mark` left
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"instruction": "Say hi.", "output": "Hi."}) + "\n")
    for source in ([str(corpus_dir)], [str(chats), "--chat"]):
        assert main(["prepare", *source, "--out", str(run), "--force", "--val-fraction", "0"]) == 1
        assert capsys.readouterr().err == (
            f"gptforge prepare: error: --out {run}: is a gptforge run or checkpoint, which replacing the folder "
            "would delete; write elsewhere\n"
        )
        assert sorted(p.name for p in run.iterdir()) == sorted([mark, "kept"])


def test_prepare_force_never_replaces_a_checkpoint_a_run_s_checkpoints_or_a_deeper_run(corpus_dir, tmp_path, capsys):
    ckpt = tmp_path / "best"  # a checkpoint copied out of its run
    ckpt.mkdir()
    (ckpt / "meta.json").write_text("{}")
    run = tiny_run(tmp_path / "run")
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    deep = tmp_path / "deep"
    tiny_run((deep / "a" / "b").mkdir(parents=True) or deep / "a" / "b" / "run")
    for out, said in [
        (ckpt, "is a gptforge run or checkpoint"),
        (run / "checkpoints", f"holds a gptforge run or checkpoint ({run / 'checkpoints' / 'step_000002'})"),
        (deep, f"holds a gptforge run or checkpoint ({deep / 'a' / 'b' / 'run'})"),  # three levels down
    ]:
        assert main(["prepare", str(corpus_dir), "--out", str(out), "--force", "--val-fraction", "0"]) == 1
        assert capsys.readouterr().err.startswith(f"gptforge prepare: error: --out {out}: {said}")
    assert (ckpt / "meta.json").is_file() and (run / "checkpoints" / "step_000002" / "meta.json").is_file()
    assert (deep / "a" / "b" / "run" / "metrics.jsonl").is_file()
    (tmp_path / "afile.txt").write_text("mine")
    assert main(["prepare", str(corpus_dir), "--out", str(tmp_path / "afile.txt"), "--force"]) == 1
    assert capsys.readouterr().err.startswith(f"gptforge prepare: error: --out {tmp_path / 'afile.txt'}: exists and")


def test_a_warning_naming_a_path_with_a_newline_stays_one_line(monkeypatch, capsys):
    """serve's "leads outside the served folder" names a path; a run folder named 'a\\nb' split the log line."""
    import warnings

    import gptforge.report.summary
    from gptforge.cli import PACKAGE

    def warns(run_dir):  # as if from gptforge's serve/runs.py
        message = "runs/a\nb\x1b[2J: leads outside the served folder"
        warnings.warn_explicit(message, UserWarning, filename=f"{PACKAGE}/serve/runs.py", lineno=1)

    monkeypatch.setattr(gptforge.report.summary, "run_report", warns)
    assert main(["report", "runs/x"]) == 0
    assert capsys.readouterr().err == "gptforge report: warning: runs/a\\nb\\x1b[2J: leads outside the served folder\n"


def test_out_dot_writes_into_the_current_folder_as_into_any_empty_one(tmp_path, data_dir, monkeypatch, capsys):
    """export (hf and peft), import and prepare of conversations raised "PosixPath('.') has an empty name" and left
    a .lock behind; train and text prepare wrote there. Every command now does."""
    run, lora = tmp_path / "run", tmp_path / "lora"
    tiny = ["--config", "tiny", "--data", str(data_dir), "--set", "train.max_steps=1"]
    assert main(["train", *tiny, "--out", str(run)]) == 0
    adapters = ["--set", f"train.init_from={run}", "--set", "train.lora_rank=2"]
    assert main(["train", *tiny, "--out", str(lora), *adapters]) == 0
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n" for i in range(20)))
    commands = {
        "hf": (["export", str(run), "--out", "."], "config.json"),
        "peft": (["export", str(lora), "--format", "peft", "--out", "."], "adapter_config.json"),
        "import": (["import", str(tmp_path / "hf"), "--out", "."], "meta.json"),
        "chats": (["prepare", str(chats), "--out", ".", "--val-fraction", "0.2"], "manifest.json"),
        "text": (["prepare", str(tmp_path / "hf"), "--out", ".", "--ext", "json"], "manifest.json"),
        "train": (["train", *tiny, "--out", "."], "metrics.jsonl"),
    }
    for name, (args, made) in commands.items():
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        assert main(args) == 0, capsys.readouterr().err
        assert (tmp_path / name / made).is_file(), name
        if name not in ("text", "train"):  # which reuse an unchanged folder, or resume a run
            assert main(args) == 1  # a second time it is not empty: refused, as for any folder
            refusal = "is a gptforge run or checkpoint" if name == "import" else "exists and is not empty"
            assert f"--out .: {refusal}" in capsys.readouterr().err
        if name not in ("import", "train"):  # --force replaces its entries; the folder stays the current one
            assert main([*args, "--force"]) == 0 and (tmp_path / name / made).is_file()
            assert Path.cwd() == tmp_path / name and (Path(".") / made).is_file()
            assert name not in ("chats", "text") or (Path(".") / ".lock").is_file()  # the lock held stays there
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left beside
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    assert main(["demo", "--chat", "--data", ".", "--base", str(run), "--out", str(tmp_path / "chat")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gptforge demo: error: --data .: no tokenizer.json") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "row, found",
    [
        ("[1, 2]", "found a JSON array"),  # said Python's 'list indices must be integers or slices, not str'
        ('"x"', "found a JSON string"),
        ('{"messages": "oops"}', "found an object without it (its keys: 'messages'); conversations? use --chat"),
    ],
)
def test_a_jsonl_row_that_is_not_a_text_object_says_what_it_found(tmp_path, capsys, row, found):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(row + "\n" + json.dumps({"text": "fine"}) + "\n")
    assert main(["prepare", str(rows), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == f"gptforge prepare: error: {rows}:1: expected a JSON object with a string field 'text', {found}\n"
    assert not (tmp_path / "out").exists()


def test_a_lora_run_counts_its_parameters_alike_in_both_header_lines(tmp_path, data_dir, capsys):
    """The header said '5,377,280 parameters', then '131,072 trainable of 5,393,152' (padding rows counted)."""
    tiny = ["--config", "tiny", "--data", str(data_dir), "--set", "train.max_steps=1"]
    assert main(["train", *tiny, "--out", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    lora = ["--set", f"train.init_from={tmp_path / 'base'}", "--set", "train.lora_rank=2"]
    assert main(["train", *tiny, "--out", str(tmp_path / "lora"), *lora]) == 0
    out = capsys.readouterr().out
    model = int(re.search(r"^model: ([\d,]+) parameters", out, re.M)[1].replace(",", ""))
    trainable, total = (
        int(n.replace(",", "")) for n in re.search(r"([\d,]+) trainable parameters of ([\d,]+)", out).groups()
    )
    assert total == model and 0 < trainable < total


def test_a_chat_run_says_its_evaluation_scores_the_replies_alone(tmp_path, data_dir, capsys):
    """It announced 512 validation tokens and then scored 99 without a word on why."""
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n" for i in range(30)))
    assert main(["prepare", str(rows), "--out", str(tmp_path / "chats"), "--val-fraction", "0.3"]) == 0
    tiny = ["--config", "tiny", "--set", "train.max_steps=1"]
    assert main(["train", *tiny, "--data", str(data_dir), "--out", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    chat = ["--data", str(tmp_path / "chats"), "--set", f"train.init_from={tmp_path / 'base'}"]
    assert main(["train", *tiny, *chat, "--out", str(tmp_path / "chat")]) == 0
    out = capsys.readouterr().out
    announced = int(re.search(r"evaluating: ([\d,]+) validation tokens \(conversations: the loss scores", out)[1])
    scored = int(re.search(r"val loss .* over ([\d,]+) tokens", out)[1].replace(",", ""))
    assert 0 < scored < announced


def test_an_out_that_is_empty_a_link_to_the_current_folder_or_holds_it_never_loses_a_file(
    tmp_path, monkeypatch, capsys
):
    """`prepare --chat --out '' --force` emptied the current folder; `--out self --force` (self -> .) left it
    half-swapped; `--out .. --force` deleted the folder the shell was in."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n" for i in range(20)))
    here = tmp_path / "parent" / "here"
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    (tmp_path / "parent" / "sibling.txt").write_text("mine too")
    monkeypatch.chdir(here)
    prepare = ["prepare", str(chats), "--val-fraction", "0.2", "--force", "--out"]
    train = ["train", "--config", "tiny", "--data", str(tmp_path / "none"), "--out"]
    for command, out, says in (
        (prepare, "", "--out '': empty"),
        (train, "", "--out '': empty"),
        (prepare, "..", "--out ..: holds the current folder"),
    ):
        assert main([*command, out]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert (here / "notes.txt").read_text() == "mine" and (tmp_path / "parent" / "sibling.txt").is_file()
    (here / "self").symlink_to(".")
    assert main([*prepare, "self"]) == 0  # its entries replaced, as for '.', the folder kept
    assert (here / "manifest.json").is_file() and not (here / "notes.txt").exists()
    assert sorted(p.name for p in (tmp_path / "parent").iterdir()) == ["here", "sibling.txt"]  # nothing left aside


def test_a_run_or_a_source_whose_name_is_not_utf8_trains_reports_plots_and_exports(tmp_path, data_dir):
    """train's plot, report, plot and export --format gguf raised on such a name (matplotlib, report.md, GGUF's
    UTF-8 strings), as did prepare --chat's report.md for such a source; the name is printed as its bytes."""
    pytest.importorskip("gguf")
    run, chats = os.path.join(os.fsencode(tmp_path), b"r\xff"), tmp_path / os.fsdecode(b"c\xff.jsonl")
    chats.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n" for i in range(20)))
    tiny = ["--config", "tiny", "--data", str(data_dir), "--set", "train.max_steps=2"]
    for args in (
        ["train", *tiny, "--out", run],
        ["report", run],
        ["plot", run],
        ["export", run, "--format", "gguf", "--out", tmp_path / "x.gguf"],
        ["export", run, "--out", os.path.join(os.fsencode(tmp_path), b"h\xff")],
        ["import", os.path.join(os.fsencode(tmp_path), b"h\xff"), "--out", tmp_path / "imported"],
        ["prepare", chats, "--out", tmp_path / "chats", "--val-fraction", "0.2"],
    ):
        done = subprocess.run([sys.executable, "-m", "gptforge", *args], capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        if args[0] == "report":
            assert b"# Run `r\\xff`" in done.stdout
        if args[0] == "train":
            assert run + b"/loss.png" in done.stdout  # as the bytes they are
    assert os.path.isfile(os.path.join(run, b"summary.json"))
    assert "c\\xff.jsonl" in (tmp_path / "chats" / "report.md").read_text()


def test_speedrun_and_demo_refuse_an_empty_out(tmp_path, monkeypatch, capsys):
    """`speedrun --out '' --force` emptied the current folder; `demo --out ''` trained into runs/demo instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    for command in (["speedrun", "--budget", "1", "--seeds", "1"], ["demo"]):
        assert main([*command, "--out", "", "--force"]) == 1
        assert "--out '': empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    "args", [["--data", ""], ["--chat", "--data", ""], ["--chat", "--base", ""], ["--chat", "--data", "  "]]
)
def test_the_demo_names_an_empty_data_or_base_as_itself(tmp_path, monkeypatch, capsys, args):
    """`demo --data ''` said "--out runs/demo: inside ., which this command reads": the wrong flag, no fix."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *args]) == 1
    err = capsys.readouterr().err
    assert err == f"gptforge demo: error: {args[-2]} {args[-1]!r}: empty (expected a folder name)\n", err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_midway_through_an_export_cleans_up_as_ctrl_c_does(tmp_path, data_dir, capsys):
    """SIGTERM killed the process where it stood: a half-built export stayed in its hidden temporary folder."""
    import signal
    import subprocess

    run = tmp_path / "run"
    tiny = ["--config", "tiny", "--data", str(data_dir), "--set", "train.max_steps=1"]
    assert main(["train", *tiny, "--out", str(run)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    program = (  # `timeout`, systemd or a scheduler stopping the job once the tokenizer files are written
        "import os, signal, sys\n"
        "import gptforge.hub.convert as c\n"
        "from gptforge.cli import main\n"
        "real = c.write_tokenizer_files\n"
        "c.write_tokenizer_files = lambda *a: (real(*a), os.kill(os.getpid(), signal.SIGTERM))\n"
        f"code = main(['export', {str(run)!r}, '--out', {str(out)!r}, '--force'])\n"
        "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, 'not given back'\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (128 + signal.SIGTERM, "terminated\n"), done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"] and [p.name for p in out.iterdir()] == [
        "mine.txt"
    ]
