"""train.parallel=fsdp (FSDP2 over gloo): 2 and 4 processes equal one process with the same global batch, each holds
about 1/N of the parameters and optimizer state, and its checkpoints resume under fsdp and ddp."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from tests.helpers import cli, losses, weights
from tests.train.test_distributed import COMMON, ENV, TIMEOUT, torchrun

from gptforge.checkpoint import checkpoint_problem, resolve_checkpoint
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.runtime.fsdp import state_by_index, state_by_name
from gptforge.serve.runs import Source

MODERN = ["model.position=rotary", "model.norm=rmsnorm", "model.mlp=swiglu", "model.qk_norm=true",
          "model.tie_embeddings=false", "model.bias=false"]  # fmt: skip


def run(args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def one_process(data_dir, out, *settings):
    sets = [a for s in ("train.batch_tokens=512", *settings) for a in ("--set", s)]
    return run(cli("train", *COMMON, "--data", data_dir, "--out", out, *sets))


def fsdp(data_dir, out, processes, *settings):
    launcher = ["--standalone", "--nproc-per-node", str(processes)]
    return run(torchrun(launcher, data_dir, out, "train.parallel=fsdp", *settings), env=ENV)


def assert_same_run(a, b):
    """Losses within 1e-5 at every step and weights within 1e-5: reduction order is all that differs (measured
    equal to the printed digits)."""
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys() == set(range(1, 7))
    assert all(abs(la[s] - lb[s]) <= 1e-5 for s in la), (la, lb)
    for (name, x), y in zip(weights(a).items(), weights(b).values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)
    va, vb = losses(a, "val"), losses(b, "val")  # evaluated on the weights gathered from the shards
    assert va.keys() == vb.keys() == {0, 3, 6} and all(abs(va[s] - vb[s]) <= 1e-5 for s in va)


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """One process, and fsdp over 2 and over 4, each checkpointing at step 3: {processes: run folder}."""
    root, settings = tmp_path_factory.mktemp("fsdp"), ("eval.sample_tokens=4", "checkpoint.every=3")
    one_process(data_dir, root / "one", *settings)
    for processes in (2, 4):
        stdout = fsdp(data_dir, root / f"fsdp{processes}", processes, *settings)
        assert f"{processes} processes x {4 // processes} accumulation" in stdout and " float32 fsdp" in stdout
    return {1: root / "one", 2: root / "fsdp2", 4: root / "fsdp4"}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_fsdp_processes_match_one_process_with_the_same_global_batch(runs, processes):
    assert_same_run(runs[1], runs[processes])
    samples = [(runs[n] / "samples.jsonl").read_text() for n in (1, processes)]
    assert samples[0] == samples[1]  # rank 0 samples from the gathered weights while the others wait


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 4), (2, 1)])
def test_a_run_resumes_on_another_number_of_processes_as_if_never_stopped(runs, data_dir, tmp_path, saved, resumed):
    """The same global batches follow (epochs hold whole steps for any number of processes), so the losses are the
    uninterrupted run's within 1e-5 (reduction order)."""
    ckpt, out = runs[saved] / "checkpoints" / "step_000003", tmp_path / "resumed"
    if resumed == 1:
        stdout = run([*cli("train", *COMMON, "--data", data_dir, "--out", out, "--resume", ckpt),
                      "--set", "train.batch_tokens=512"])  # fmt: skip
    else:
        stdout = run([*torchrun(["--standalone", "--nproc-per-node", str(resumed)], data_dir, out,
                                "train.parallel=fsdp"), "--resume", str(ckpt)], env=ENV)  # fmt: skip
    assert f"the data position carries over from {saved} process(es) x 4 sequences to {resumed} x 4" in stdout
    before, after = losses(runs[saved]), losses(out)
    assert after.keys() == {4, 5, 6} and all(abs(before[s] - after[s]) <= 1e-5 for s in after), (before, after)


@pytest.mark.slow
def test_fsdp_trains_the_modern_block_as_one_process_does(data_dir, tmp_path):
    alone = one_process(data_dir, tmp_path / "one", "train.parallel=fsdp", "checkpoint.async_save=true", *MODERN)
    # Said once, then it trains as usual.
    assert "nothing to shard, it trains as one process would (checkpoint.async_save too: each checkpoint" in alone
    fsdp(data_dir, tmp_path / "fsdp", 2, *MODERN)
    assert_same_run(tmp_path / "one", tmp_path / "fsdp")


@pytest.mark.slow
def test_fsdp_and_ddp_checkpoints_resume_under_either_as_if_never_stopped(runs, data_dir, tmp_path):
    """An fsdp checkpoint (each process's shards of the weights and optimizer state) resumes under fsdp or ddp, and
    a ddp checkpoint (whole files, the optimizer's state keyed by position) under fsdp."""
    two = ["--standalone", "--nproc-per-node", "2"]
    run(torchrun(two, data_dir, tmp_path / "ddp", "checkpoint.every=3"), env=ENV)
    sources = {"fsdp": runs[2], "ddp": tmp_path / "ddp"}
    shards = runs[2] / "checkpoints" / "step_000003" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one a rank
    for source, parallel in (("fsdp", "fsdp"), ("fsdp", "ddp"), ("ddp", "fsdp")):
        out, ckpt = tmp_path / f"{source}-{parallel}", sources[source] / "checkpoints" / "step_000003"
        stdout = run([*torchrun(two, data_dir, out, f"train.parallel={parallel}"), "--resume", str(ckpt)], env=ENV)
        assert f"resumed from {ckpt} at step 3" in stdout
        before, after = losses(sources[source]), losses(out)
        assert after.keys() == {4, 5, 6} and all(abs(before[s] - after[s]) <= 1e-5 for s in after), (before, after)


def test_optimizer_state_converts_between_positions_and_names_both_ways():
    names = ["a.weight", "b.weight", "b.bias"]
    by_index = {
        "state": {0: {"step": torch.tensor(3.0)}, 2: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
    }
    by_name = state_by_name(by_index, names)
    assert set(by_name["state"]) == {"a.weight", "b.bias"}
    assert [g["params"] for g in by_name["param_groups"]] == [["a.weight", "b.weight"], ["b.bias"]]
    assert state_by_index(by_name, names) == by_index
    assert state_by_name(by_name, names) is by_name and state_by_index(by_index, names) is by_index
    muon = {"muon": {}, "adamw": {}}
    assert state_by_index(muon, names) is muon


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["train.parallel=fsdp", "train.zero=true"], "FSDP already shards the optimizer's state; drop train.zero"),
        (["train.parallel=fsdp", "optim.optimizer=muon"], "optim.optimizer=muon with train.parallel=fsdp"),
        (["train.parallel=zero3"], "train.parallel"),
        (["checkpoint.async_save=true"], r"^checkpoint.async_save=true needs train.parallel=fsdp: only sharded "),
        (["checkpoint.async_save=true", "train.parallel=ddp", "train.zero=true"], "async_save=true needs"),
    ],
)
def test_fsdp_refuses_what_it_cannot_combine_in_one_line(settings, message):
    with pytest.raises(GptforgeError, match=message) as e:
        load_config("tiny", settings)
    assert "\n" not in str(e.value)


SHARE = """
import json, torch
from gptforge.checkpoint import checkpoint_problem, resolve_checkpoint
from gptforge.config import load_config
from gptforge.runtime.distributed import init
from gptforge.train.setup import build
from gptforge.train.step import train_step
env, device = init("cpu", 60)
cfg = load_config("tiny", ["train.parallel=fsdp", "train.batch_tokens=512", "train.dtype=float32"])
s = build(cfg, env, torch.device("cpu"))
x = torch.randint(0, 50257, (4, 32))
train_step(s.train_model, s.model, s.optimizer, s.scaler, lambda: (x, x), s.grad_accum, 1.0, s.dtype, env)
local = lambda t: t.to_local() if hasattr(t, "to_local") else t
params = sum(local(p).numel() for p in s.model.parameters())
state = sum(local(v).numel() for st in s.optimizer.state.values() for v in st.values() if v.dim() > 0)
print(json.dumps({"rank": env.rank, "params": params, "state": state}))
"""


@pytest.mark.slow
def test_each_fsdp_process_holds_about_a_share_of_the_parameters_and_optimizer_state(tmp_path):
    script = tmp_path / "share.py"
    script.write_text(SHARE)
    alone = json.loads(run([sys.executable, str(script)]).splitlines()[-1])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = run([*launcher, str(script)], env=ENV)  # the two ranks' lines can land on one line of the shared pipe
    shares = [json.loads(found) for found in re.findall(r'\{"rank"[^{}]*\}', out)]
    assert len(shares) == 2
    for share in shares:  # 1/2 each, up to the padding of a row count that does not split evenly
        assert abs(share["params"] / alone["params"] - 0.5) < 0.01, (share, alone)
        assert abs(share["state"] / alone["state"] - 0.5) < 0.01, (share, alone)


@pytest.mark.slow
def test_export_reads_a_sharded_checkpoint_and_resume_skips_one_missing_a_rank_s_file(runs, tmp_path):
    run(cli("export", runs[2], "--out", tmp_path / "hf"))  # the newest: step 6, read from its shards
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    mine = weights(runs[2] / "checkpoints" / "step_000006")
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"):  # HF's names too
        rows = exported[name].shape[0]  # the export drops the padded vocabulary rows
        assert torch.equal(exported[name].float(), mine[name][:rows].float()), name
    copy = tmp_path / "run"
    shutil.copytree(runs[2], copy)
    (copy / "checkpoints" / "step_000006" / "shards" / "__1_0.distcp").unlink()  # a rank's write never landed
    problem = checkpoint_problem(copy / "checkpoints" / "step_000006", for_training=True)
    assert problem == "shards/__1_0.distcp, one process's shards, is missing"
    with pytest.warns(UserWarning, match="step_000006: damaged checkpoint .*__1_0.distcp.*falling back"):
        assert resolve_checkpoint(copy, for_training=True).name == "step_000003"
    assert Source("run", copy, tmp_path).newest_checkpoint().name == "step_000003"  # what serve answers with


@pytest.mark.slow
def test_a_damaged_shard_or_a_zero_resume_of_shards_is_one_line(runs, data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs[2] / "checkpoints" / "step_000006", ckpt)
    shard = ckpt / "shards" / "__1_0.distcp"
    shard.write_bytes(b"\xff" * shard.stat().st_size)  # the same size: only its checksum finds the damage
    done = subprocess.run(cli("sample", ckpt, "--prompt", "def", "--max-new-tokens", "2"),
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    damaged = f"gptforge sample: error: {ckpt}: damaged checkpoint: shards/__1_0.distcp does not match the sha256"
    assert done.returncode == 1 and done.stderr.startswith(damaged)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    middle = runs[2] / "checkpoints" / "step_000003"
    zero = subprocess.run(
        [*torchrun(["--standalone", "--nproc-per-node", "2"], data_dir, tmp_path / "zero", "train.zero=true"),
         "--resume", str(middle)], capture_output=True, text=True, env=ENV, timeout=TIMEOUT,
    )  # fmt: skip
    assert zero.returncode != 0 and "resumes under train.parallel=fsdp, or ddp without train.zero" in zero.stderr


def test_a_process_s_failure_inside_distributed_checkpoint_is_its_own_error():
    from torch.distributed.checkpoint.api import CheckpointException

    from gptforge.runtime.fsdp import wait_writes

    class Failed:
        def result(self):
            raise CheckpointException("save failed", {1: (OSError(28, "No space left on device"), None)})

    with pytest.raises(OSError, match="No space left on device"):  # which `writing` turns into one line
        wait_writes(Failed())


@pytest.mark.slow
def test_async_saving_trains_the_same_run_and_each_checkpoint_lands_whole(data_dir, tmp_path):
    """checkpoint.async_save writes the shards on a thread: the same losses and checkpoints, each put in place
    (and pruned) by the next save, and a resume from one equals the run."""
    settings = ("checkpoint.every=2", "checkpoint.keep_last=2", "eval.every=0", "train.max_steps=6")
    fsdp(data_dir, tmp_path / "sync", 2, *settings)
    fsdp(data_dir, tmp_path / "async", 2, *settings, "checkpoint.async_save=true")
    assert losses(tmp_path / "sync") == losses(tmp_path / "async")
    kept = [p.name for p in sorted((tmp_path / "async" / "checkpoints").iterdir())]
    assert kept == ["step_000004", "step_000006"]  # nothing half-written or left hidden
    for step in ("step_000004", "step_000006"):
        ckpt = tmp_path / "async" / "checkpoints" / step
        assert checkpoint_problem(ckpt, for_training=True) is None
        same = weights(tmp_path / "sync" / "checkpoints" / step)
        assert all(torch.equal(x, same[name]) for name, x in weights(ckpt).items())
