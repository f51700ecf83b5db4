"""Checkpoint folders: crash-safe writes, RNG state."""

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

from gptforge.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gptforge.cli import main
from gptforge.model.gpt import GPT


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path):
    writer = f"""
import torch
from gptforge.checkpoint import save_checkpoint
from gptforge.config import Config
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer
cfg = Config(model=GPTConfig(block_size=64, vocab_size=50257, n_layer=4, n_head=4, n_embd=256))
model, tok = GPT(cfg.model), load_tokenizer("gpt2")
opt = torch.optim.AdamW(model.parameters())
model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
opt.step()
step = 0
while True:
    step += 1
    save_checkpoint({str(tmp_path)!r}, step, model, opt, cfg, tok, {{"tokens": 0, "max_steps": 0, "loader": {{}}}})
    print(step, flush=True)
"""
    for delay in (0.03, 0.11, 0.27, 0.5):  # staggered so the kills land in different phases of a write
        proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # the first checkpoint is complete
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=60)
        ckpt = latest_checkpoint(tmp_path)
        assert ckpt is not None
        model, _, _, meta = load_checkpoint(ckpt)
        torch.load(ckpt / "optimizer.pt", weights_only=True)
        assert meta["step"] >= 1 and model.config.n_embd == 256


def test_checkpoint_holds_rng_state(tmp_path):
    from gptforge.config import Config
    from gptforge.model.gpt import GPTConfig
    from gptforge.tokens.tokenizer import load_tokenizer

    cfg = Config(model=GPTConfig(block_size=8, vocab_size=50257, n_layer=1, n_head=1, n_embd=8))
    torch.manual_seed(123)
    ckpt = save_checkpoint(tmp_path, 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"))
    expected = torch.rand(3)
    state = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
    torch.manual_seed(0)
    from gptforge.checkpoint import set_rng_state

    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("library", [False, True])
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_previous_checkpoint(
    data_dir, tmp_path, monkeypatch, capsys, library
):
    import gptforge.checkpoint.save

    real_save, saves = gptforge.checkpoint.save.save_model, []

    def fills_the_disk(model, path):
        saves.append(path)
        if len(saves) == 2:
            with open(path, "wb") as f:
                f.write(b"partial")
            if library:  # safetensors' own error type and words for it
                raise RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save(model, path)

    monkeypatch.setattr(gptforge.checkpoint.save, "save_model", fills_the_disk)
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--data", str(data_dir), "--out", str(run), "--set", "train.max_steps=4"]
    assert main([*args, "--set", "checkpoint.every=2", "--set", "eval.every=0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptforge train: error: cannot write ") and "No space left on device" in err
    assert len(err.splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]  # the partial one is gone
    assert load_checkpoint(run)[3]["step"] == 2
    assert main([*args, "--resume", "auto"]) == 0  # space freed: the run continues from step 2


@pytest.mark.parametrize("library", ["safetensors", "torch"])
def test_a_checkpoint_file_past_the_largest_allowed_is_one_line_and_keeps_the_previous_checkpoint(
    data_dir, tmp_path, monkeypatch, capsys, library
):
    import resource

    import gptforge.checkpoint.save

    real_save, saves = gptforge.checkpoint.save.save_model, []
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def capped(model, path):  # the second checkpoint meets a real cap on a file's size, as `ulimit -f` sets one
        saves.append(path)
        if len(saves) == 2:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            # Below the weights: safetensors fails; between them and AdamW's state (twice them): torch.save does.
            cap = weights // 4 if library == "safetensors" else weights * 3 // 2
            resource.setrlimit(resource.RLIMIT_FSIZE, (cap, hard))
        real_save(model, path)

    monkeypatch.setattr(gptforge.checkpoint.save, "save_model", capped)
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--data", str(data_dir), "--out", str(run), "--set", "train.max_steps=4"]
    try:
        assert main([*args, "--set", "checkpoint.every=2", "--set", "eval.every=0"]) == 1
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert err.startswith(f"gptforge train: error: cannot write {run / 'checkpoints' / 'step_000004'}: File too large")
    assert err.endswith(" bytes (ulimit -f): raise that limit\n") and len(err.splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]  # no temp folder left
    assert not [p for p in run.rglob("*") if ".tmp." in p.name or "gptforge-tmp" in p.name]
    assert load_checkpoint(run)[3]["step"] == 2
    assert main([*args, "--resume", "auto"]) == 0  # the limit raised: the run continues from step 2


def test_checkpoint_files_get_the_usual_permissions(tmp_path):
    from gptforge.config import Config
    from gptforge.model.gpt import GPTConfig
    from gptforge.tokens.tokenizer import load_tokenizer

    cfg = Config(model=GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
    ckpt = save_checkpoint(
        tmp_path, 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"), {"tokens": 0, "max_steps": 1}
    )
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in ckpt.iterdir()}["model.safetensors"] == 0o666 & ~umask


@pytest.mark.parametrize("tokenizer", [5, "absolute", "../../tok.json"])
@pytest.mark.parametrize("command", [["sample", "--max-new-tokens", "1"], ["eval", "--text", "TEXT"]])
def test_a_tokenizer_that_is_not_a_file_of_the_checkpoint_is_one_line(tmp_path, capsys, command, tokenizer):
    import json

    from gptforge.config import Config
    from gptforge.model.gpt import GPTConfig
    from gptforge.tokens.tokenizer import load_tokenizer, train_bpe

    cfg = Config(model=GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
    ckpt = save_checkpoint(tmp_path, 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"), {"tokens": 0})
    train_bpe(["def add(a, b):\n    return a + b\n"] * 20, 300, tmp_path / "tok.json")  # outside: one that loads
    name = str(tmp_path / "tok.json") if tokenizer == "absolute" else tokenizer
    (ckpt / "meta.json").write_text(json.dumps({**json.loads((ckpt / "meta.json").read_text()), "tokenizer": name}))
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 4)
    args = [str(tmp_path / "text.txt") if a == "TEXT" else a for a in command]
    assert main([command[0], str(ckpt), *args[1:]]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"gptforge {command[0]}: error: {ckpt}: damaged checkpoint: meta.json names tokenizer {name!r}: "
        "expected 'gpt2' or the name of a tokenizer file in the checkpoint\n"
    )


def test_every_file_of_a_sharded_checkpoint_is_sealed_and_a_flipped_byte_is_named(tmp_path):
    import json

    from gptforge.checkpoint.integrity import checksum_problem, seal

    ckpt = tmp_path / "step_000001"
    (ckpt / "shards").mkdir(parents=True)
    files = {"shards/__0_0.distcp": 4096, "shards/__1_0.distcp": 4096, "shards/.metadata": 64, "rng_rank0.pt": 64}
    for name, size in files.items():
        (ckpt / name).write_bytes(bytes(size))
    (ckpt / "meta.json").write_text('{"step": 1}')
    seal(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert sorted(meta["sha256"]) == sorted(files) and meta["step"] == 1
    assert checksum_problem(ckpt, meta, for_training=True) is None
    (ckpt / "shards/__1_0.distcp").write_bytes(bytes(2000) + b"\xff" * 96 + bytes(2000))  # same size
    problem = "shards/__1_0.distcp does not match the sha256 its meta.json records (damaged since it was saved)"
    assert checksum_problem(ckpt, meta, for_training=False) == problem
    (ckpt / "shards/__1_0.distcp").write_bytes(bytes(4096))
    (ckpt / "rng_rank0.pt").write_bytes(b"\xff" * 64)
    assert checksum_problem(ckpt, meta, for_training=False) is None  # weights alone: a resume's files unread
    assert checksum_problem(ckpt, meta, for_training=True).startswith("rng_rank0.pt does not match")
    meta["sha256"]["../outside"] = meta["sha256"].pop("rng_rank0.pt")
    assert "names '../outside', which is not a file of the checkpoint" in checksum_problem(ckpt, meta, True)


@pytest.mark.parametrize("name", ["model.safetensors", "meta.json"])
def test_a_fifo_in_a_checkpoint_is_named_and_never_opened(tmp_path, name):
    import threading

    from gptforge.checkpoint import checkpoint_problem
    from gptforge.config import Config
    from gptforge.model.gpt import GPTConfig
    from gptforge.tokens.tokenizer import load_tokenizer

    cfg = Config(model=GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
    ckpt = save_checkpoint(tmp_path, 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"), {"tokens": 0})
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    found = []
    check = threading.Thread(target=lambda: found.append(checkpoint_problem(ckpt)), daemon=True)
    check.start()
    check.join(timeout=10)
    if check.is_alive():  # opening the FIFO blocks until a writer comes: be the writer, so the test ends
        os.close(os.open(ckpt / name, os.O_WRONLY))
    assert found == [f"{name} is not a regular file (a FIFO, device, socket, dead link)"]
