"""Checkpoint cadence and pruning, resuming (damaged checkpoints, changed settings) and run-folder ownership."""

import json
import shutil
import warnings

import pytest
import torch
from tests.conftest import write_corpus
from tests.helpers import lock_held_elsewhere

from gptforge.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, resolve_checkpoint
from gptforge.cli import main
from gptforge.config import load_config
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.errors import GptforgeError
from gptforge.rundir import CONFIG, read_metrics
from gptforge.train.trainer import train


def test_keep_last_checkpoints_and_milestones(data_dir, tmp_path):
    cfg = load_config(
        "tiny",
        [
            f"data.path={data_dir}",
            "train.max_steps=10",
            "checkpoint.every=1",
            "checkpoint.keep_last=2",
            "checkpoint.milestone_every=4",
            "eval.every=0",
        ],
    )
    train(cfg, tmp_path / "r")
    kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000008", "step_000009", "step_000010"]


def tiny(data_dir, *overrides):
    return load_config("tiny", [f"data.path={data_dir}", "eval.every=0", "eval.sample_tokens=0", *overrides])


@pytest.fixture(scope="module")
def saved_run(data_dir, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, copied by each test that changes it."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(tiny(data_dir, "train.max_steps=4", "checkpoint.every=2"), run)
    return run


def damage_truncate(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def damage_random_bytes(ckpt):
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 4000)


def damage_list_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")


def damage_no_optimizer(ckpt):
    (ckpt / "optimizer.pt").unlink()


def damage_meta(ckpt):
    (ckpt / "meta.json").write_text('{"step": 4, "conf')


def damage_flip(ckpt):
    """2,000 bytes flipped inside the weights, the size kept: only a checksum tells."""
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 2000] = bytes(b ^ 0xFF for b in data[middle : middle + 2000])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", [damage_truncate, damage_random_bytes, damage_list_header, damage_no_optimizer, damage_meta, damage_flip]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved_run, data_dir, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damage(run / "checkpoints" / "step_000004")
    with pytest.warns(UserWarning, match=r"step_000004: damaged checkpoint \(.*\); falling back to the previous"):
        result = train(tiny(data_dir, "train.max_steps=4", "checkpoint.every=2"), run, resume="auto")
    assert result.steps == 4
    assert_same_weights(result.checkpoint, saved_run / "checkpoints" / "step_000004")  # redone exactly
    with pytest.raises(GptforgeError, match="step_000002: damaged checkpoint"):  # a named one is not replaced
        damage(run / "checkpoints" / "step_000002")
        train(tiny(data_dir, "train.max_steps=4"), tmp_path / "new", resume=str(run / "checkpoints" / "step_000002"))


def test_under_torchrun_rank_0_alone_warns_of_a_damaged_checkpoint(saved_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damage_truncate(run / "checkpoints" / "step_000004")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert resolve_checkpoint(run, for_training=True).name == "step_000002"  # every rank falls back
        expected = [] if rank == "1" else [f"{run}/checkpoints/step_000004: damaged checkpoint"]
        assert [str(w.message).partition(" (")[0] for w in said] == expected


DAMAGED_INSIDE = (
    "damaged checkpoint: model.safetensors does not match the sha256 its meta.json records (damaged since it was saved)"
)


@pytest.mark.parametrize(
    "command",
    [["eval", "--text", "TEXT"], ["sample", "--max-new-tokens", "1"], ["export", "--out", "OUT"]],
)
def test_a_checkpoint_damaged_inside_its_size_is_refused_in_one_line(saved_run, tmp_path, capsys, command):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run / "checkpoints" / "step_000004", ckpt)
    damage_flip(ckpt)
    (tmp_path / "text.txt").write_text("def add(a, b):\n    return a + b\n" * 4)
    args = [{"TEXT": str(tmp_path / "text.txt"), "OUT": str(tmp_path / "out")}.get(a, a) for a in command[1:]]
    assert main([command[0], str(ckpt), *args]) == 1
    assert capsys.readouterr().err == f"gptforge {command[0]}: error: {ckpt}: {DAMAGED_INSIDE}\n"
    assert not (tmp_path / "out").exists()


def test_checkpoints_record_each_file_s_sha256_and_older_ones_without_still_load(saved_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run / "checkpoints" / "step_000004", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert sorted(meta["sha256"]) == ["model.safetensors", "optimizer.pt", "rng_rank0.pt"]
    del meta["sha256"]  # as gptforge wrote them before checksums
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert_same_weights(ckpt, saved_run / "checkpoints" / "step_000004")


def test_weights_gone_non_finite_are_never_saved_and_never_prune_the_last_good_one(saved_run, data_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from gptforge.checkpoint.integrity import seal

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    ckpt = run / "checkpoints" / "step_000004"
    weights = load_file(ckpt / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    seal(ckpt)  # as if the run had saved them so: every later step is skipped
    cfg = tiny(data_dir, "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=1")
    with pytest.raises(GptforgeError, match=r"^step 6: the model's weights are not finite \(NaN or inf\): not saved"):
        train(cfg, run, resume="auto")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_checkpoints_saved_amid_skipped_steps_never_prune_the_last_good_one(data_dir, tmp_path, monkeypatch):
    from gptforge.model.gpt import GPT

    original, calls = GPT.forward, []

    def poisoned_after_step_1(self, idx, targets=None, cache=None):
        logits, loss = original(self, idx, targets, cache)
        if self.training and loss is not None:
            calls.append(1)
            loss = loss * float("nan") if len(calls) > 2 else loss  # step 1's two micro-batches are fine
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned_after_step_1)
    train(tiny(data_dir, "train.max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=1"), tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001", "step_000003"]


def assert_same_weights(a, b):
    wa, wb = load_checkpoint(a)[0].state_dict(), load_checkpoint(b)[0].state_dict()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_a_new_max_steps_on_resume_is_honoured_and_said(saved_run, data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    result = train(tiny(data_dir, "train.max_steps=6", "checkpoint.every=2"), run, resume="auto")
    assert result.steps == 6
    assert "changed since that checkpoint: train.max_steps: 4 -> 6" in capsys.readouterr().out
    assert "max_steps = 6" in (run / CONFIG).read_text()  # config.toml says what ran
    metrics = read_metrics(run, kinds=("train", "resume"))
    assert [r["step"] for r in metrics["train"]] == [1, 2, 3, 4, 5, 6]
    assert metrics["resume"][0]["changes"] == ["train.max_steps: 4 -> 6"]
    with pytest.raises(GptforgeError, match=r"train.max_steps=3: .*step_000006 is already at step 6"):
        train(tiny(data_dir, "train.max_steps=3"), run, resume="auto")


def test_a_resume_cannot_change_the_model_shape(saved_run, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    with pytest.raises(GptforgeError, match=r"the checkpoint's model has model.n_layer=2 \(now 3\); a resume cannot"):
        train(tiny(data_dir, "train.max_steps=4", "model.n_layer=3"), run, resume="auto")


@pytest.mark.parametrize(
    "change,keys,tensors",
    [
        ("model.qk_norm=true", "model.qk_norm=False (now True)", "missing transformer.h.*.attn.q_norm.weight, "),
        ("model.position=rotary", "model.position='learned' (now 'rotary')", "unexpected transformer.wpe.weight"),
        ("model.tie_embeddings=false", "model.tie_embeddings=True (now False)", "missing transformer.wte.weight"),
        ("model.mlp=swiglu", "model.mlp='gelu' (now 'swiglu')", "shape of transformer.h.*.mlp.c_fc.weight [128, 32] "),
    ],
)
def test_a_resume_that_changes_the_blocks_structure_names_the_keys_and_tensors(
    saved_run, data_dir, tmp_path, change, keys, tensors
):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(GptforgeError) as caught:
        train(tiny(data_dir, "train.max_steps=4", change), run, resume="auto")
    message = str(caught.value)
    assert message.startswith(f"the checkpoint's model has {keys}; a resume cannot change the model's structure")
    assert f"(its weights against the new model: {tensors}" in message and "\n" not in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # config.toml still the run's


def test_a_resume_that_changes_what_same_shaped_weights_compute_is_refused(saved_run, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    with pytest.raises(GptforgeError, match=r"model.mlp='gelu' \(now 'relu2'\); a resume cannot change the model's s"):
        train(tiny(data_dir, "train.max_steps=4", "model.mlp=relu2"), run, resume="auto")


def test_a_resume_that_turns_fim_on_names_the_setting(saved_run, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    with pytest.raises(GptforgeError, match=r"data.fim_rate=0.5: the checkpoint trained with data.fim_rate=0.0, and"):
        train(tiny(data_dir, "train.max_steps=4", "data.fim_rate=0.5"), run, resume="auto")


def test_a_resume_that_switches_the_optimizer_is_one_line_either_way(saved_run, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    with pytest.raises(GptforgeError, match=r"optim.optimizer=muon: the checkpoint trained with adamw, and a"):
        train(tiny(data_dir, "train.max_steps=4", "optim.optimizer=muon"), run, resume="auto")
    train(tiny(data_dir, "train.max_steps=1", "optim.optimizer=muon"), tmp_path / "muon")
    with pytest.raises(GptforgeError, match=r"optim.optimizer=adamw: the checkpoint trained with muon, and a"):
        train(tiny(data_dir, "train.max_steps=2", "optim.optimizer=adamw"), tmp_path / "muon", resume="auto")


def test_weights_that_do_not_fit_their_config_name_the_tensors_in_eval_and_init_from(saved_run, data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run / "checkpoints" / "step_000004", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"]["qk_norm"] = True  # a hand edit: the weights have no QK-norm gains
    (ckpt / "meta.json").write_text(json.dumps(meta))
    message = r"model.safetensors: does not fit the model \(missing transformer.h.\*.attn.q_norm.weight, .*k_norm"
    with pytest.raises(GptforgeError, match=message):
        load_checkpoint(ckpt)
    with pytest.raises(GptforgeError, match=message):
        train(tiny(data_dir, "train.max_steps=1", f"train.init_from={ckpt}"), tmp_path / "run")


def test_init_from_a_path_that_is_not_utf8_trains_and_resumes(saved_run, data_dir, tmp_path):
    """safetensors opens UTF-8 paths only, and TOML holds no lone surrogate (how Python reads the byte 0xe9)."""
    import os

    import tomllib

    ckpt = tmp_path / os.fsdecode(b"caf\xe9") / "step_000004"
    shutil.copytree(saved_run / "checkpoints" / "step_000004", ckpt)
    run = tmp_path / "run"
    train(tiny(data_dir, "train.max_steps=1", f"train.init_from={ckpt}"), run)
    saved = tomllib.loads((run / CONFIG).read_text(encoding="utf-8"))
    assert saved["train"]["init_from"] == f"{tmp_path}/caf\\xe9/step_000004"
    train(tiny(data_dir, "train.max_steps=2", f"train.init_from={ckpt}"), run, resume="auto")  # meta.json's own
    assert latest_checkpoint(run).name == "step_000002"


def test_an_existing_run_is_never_overwritten(saved_run, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(GptforgeError, match="already holds a run; continue it with --resume auto"):
        train(tiny(data_dir, "train.max_steps=4"), run)
    other = tmp_path / "other"
    shutil.copytree(saved_run, other)
    with pytest.raises(GptforgeError, match="already holds a run; resume .* into an empty or new folder"):
        train(tiny(data_dir, "train.max_steps=4"), other, resume=str(run / "checkpoints" / "step_000002"))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_a_second_train_into_the_same_folder_names_the_first(data_dir, tmp_path):
    with (
        lock_held_elsewhere(tmp_path) as pid,
        pytest.raises(GptforgeError, match=rf"another gptforge train \(pid {pid}\)"),
    ):
        train(tiny(data_dir, "train.max_steps=1"), tmp_path)


def test_checkpoints_are_ordered_by_step_past_999999(tmp_path):
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step_1000001"
    assert [p.name for p in prune_checkpoints(tmp_path, keep_last=2, milestone_every=0)] == [
        "step_999998",
        "step_999999",
    ]
    with pytest.raises(GptforgeError, match="keep_last=0: pruning keeps at least the newest"):
        prune_checkpoints(tmp_path, keep_last=0, milestone_every=0)


@pytest.mark.parametrize(
    ("steps", "deleted"),
    [(1, []), (2, []), (3, []), (4, ["step_000001"]), (6, ["step_000001", "step_000003"])],
)
def test_pruning_keeps_the_newest_keep_last_and_milestones_at_every_count(tmp_path, steps, deleted):
    """Fewer checkpoints than keep_last=3, exactly 3, or one more: only older non-milestones (odd steps) go."""
    for step in range(1, steps + 1):
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text("{}")
    assert [p.name for p in prune_checkpoints(tmp_path, keep_last=3, milestone_every=2)] == deleted
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == [f"step_{s:06d}" for s in range(1, steps + 1) if f"step_{s:06d}" not in deleted]


def test_the_cli_names_a_skipped_damaged_checkpoint_in_one_warning_line(saved_run, data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damage_truncate(run / "checkpoints" / "step_000004")
    assert main(["eval", str(run), "--data", str(data_dir), "--tokens", "256", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 2
    assert (
        err.startswith("gptforge eval: warning: ")
        and "step_000004: damaged checkpoint (model.safetensors is truncated" in err
    )
    assert len(err.strip().splitlines()) == 1


def test_a_run_never_starts_in_the_data_or_among_other_files_but_retries_a_failed_start(data_dir, tmp_path):
    with pytest.raises(GptforgeError, match="which this command reads"):
        train(tiny(data_dir, "train.max_steps=1"), data_dir, resume="auto")
    with pytest.raises(GptforgeError, match="which this command reads"):
        train(tiny(data_dir, "train.max_steps=1"), data_dir.parent, resume="auto")
    with pytest.raises(GptforgeError, match=r"myrun: inside .*, which this command reads"):  # prepare --force ate it
        train(tiny(data_dir, "train.max_steps=1"), data_dir / "myrun")
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    mix = load_config("tiny", [f"data.mix={data_dir}=1,{other}=1", "eval.every=0", "train.max_steps=1"])
    with pytest.raises(GptforgeError, match=rf"--out {other / 'myrun'}: inside {other}, which this command reads"):
        train(mix, other / "myrun")
    assert not (data_dir / "myrun").exists() and not (other / "myrun").exists()
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(GptforgeError, match=r"holds files that are not a run's \(notes.txt...\); pick a new folder"):
        train(tiny(data_dir, "train.max_steps=1"), home, resume="auto")
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]  # not even a lock file was left

    failed = tmp_path / "failed"  # what a start that failed in setup leaves: config, an empty log, the lock
    with pytest.raises(GptforgeError, match="nonexistent.jsonl"):
        train(tiny(data_dir, "train.max_steps=1", f"eval.hellaswag={tmp_path / 'nonexistent.jsonl'}"), failed)
    assert train(tiny(data_dir, "train.max_steps=2"), failed).steps == 2  # the corrected command just works
    assert [r["step"] for r in read_metrics(failed)["train"]] == [1, 2]


def test_resuming_on_data_whose_content_changed_says_so(corpus_dir, tmp_path):
    data = tmp_path / "data"
    prepare(PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), data, workers=1)
    run = tmp_path / "run"
    train(tiny(data, "train.max_steps=2"), run)
    other = write_corpus(tmp_path / "other", n_files=30)
    (other / "extra.py").write_text("print('different text')\n" * 50)
    prepare(PrepareSettings.from_flags(str(other), val_fraction=0.1, shard_tokens=2000), data, workers=1, force=True)
    with pytest.warns(UserWarning, match=r"is not what .*step_000002 trained on \(its shards differ\)"):
        train(tiny(data, "train.max_steps=3"), run, resume="auto")
