"""DDP: 2 gloo processes equal 1 process with twice the accumulation, with and without ZeRO, and under two torchrun
agents (the guide's multi-node command); a stalled rank fails the job fast, and a stop signal does not wait on it."""

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.checkpoint import latest_checkpoint
from gptforge.errors import GptforgeError
from gptforge.rundir import read_metrics
from gptforge.runtime.distributed import SINGLE, DistEnv, peer_failures
from gptforge.train.stopping import BLOCKED_SECONDS

COMMON = ["--config", "tiny", "--set", "train.max_steps=6", "--set", "eval.every=3", "--set", "eval.sample_tokens=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT = 300  # seconds for any one run: a hang fails the test instead of the suite


def torchrun(launcher_args, data_dir, out, *settings):
    """`torchrun LAUNCHER_ARGS -m gptforge train` with the tiny config: 512 tokens a step (2 x 2 x 4 x 32)."""
    args = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "gptforge", "train", *COMMON]
    args += ["--data", str(data_dir), "--out", str(out), "--set", "train.batch_tokens=512"]
    for setting in settings:
        args += ["--set", setting]
    return args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(data_dir, tmp_path_factory):
    """2 processes under one torchrun agent: (run folder, stdout)."""
    out = tmp_path_factory.mktemp("two") / "run"
    run = subprocess.run(
        torchrun(["--standalone", "--nproc-per-node", "2"], data_dir, out, "eval.code=3"),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_double_accumulation(data_dir, tmp_path, two_processes):
    # 1 process x 4 micro-batches of 4 x 32  ==  2 processes x 2 micro-batches each.
    one = subprocess.run(
        cli(
            "train",
            *COMMON,
            "--data",
            data_dir,
            "--out",
            tmp_path / "one",
            "--set",
            "train.batch_tokens=512",
            "--set",
            "eval.code=3",
        ),  # fmt: skip
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr
    two, two_stdout = two_processes
    assert "2 processes x 2 accumulation" in two_stdout and "1 process x 4 accumulation" in one.stdout
    a, b = losses(tmp_path / "one"), losses(two)
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    for (name, x), y in zip(weights(tmp_path / "one").items(), weights(two).values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)
    val_one, val_two = losses(tmp_path / "one", "val"), losses(two, "val")
    assert val_one.keys() == val_two.keys() == {0, 3, 6}  # evaluation sharded over ranks gives one process's number
    assert all(abs(val_one[s] - val_two[s]) <= 1e-5 for s in val_one), (val_one, val_two)
    code_one, code_two = (read_metrics(run)["code"] for run in (tmp_path / "one", two))
    assert [r["step"] for r in code_one] == [r["step"] for r in code_two] == [0, 3, 6]  # every rank scored its share
    drop_time = [{k: v for k, v in r.items() if k != "time"} for r in (code_one[0], code_two[0])]
    assert drop_time[0] == drop_time[1]  # at step 0 the weights are the same bits: so are the scores

    # ZeRO: the same run with AdamW's state sharded over the two processes.
    zero = subprocess.run(
        torchrun(["--standalone", "--nproc-per-node", "2"], data_dir, tmp_path / "zero", "train.zero=true"),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert zero.returncode == 0, zero.stderr[-3000:]
    z = losses(tmp_path / "zero")
    assert all(abs(a[s] - z[s]) <= 1e-5 for s in a)
    state = torch.load(latest_checkpoint(tmp_path / "zero") / "optimizer.pt", weights_only=True)
    assert len(state["state"]) == len(list(weights(tmp_path / "zero"))) - 1  # every parameter (tied once)


@pytest.mark.slow
def test_muon_with_two_gloo_processes_matches_one_process(data_dir, tmp_path):
    """Muon orthogonalises the all-reduced gradient: every rank computes the same update as one process would."""
    muon = ["model.tie_embeddings=false", "model.position=rotary", "model.bias=false", "optim.optimizer=muon"]
    one = subprocess.run(
        cli("train", *COMMON, "--data", data_dir, "--out", tmp_path / "one", "--set", "train.batch_tokens=512",
            *[a for s in muon for a in ("--set", s)]),
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        torchrun(["--standalone", "--nproc-per-node", "2"], data_dir, tmp_path / "two", *muon),
        capture_output=True, text=True, env=ENV, timeout=TIMEOUT,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == set(range(1, 7))
    # Muon lifts a gradient's smallest directions to full size, so summation-order differences of ~1e-7 move single
    # weights by up to half an update: losses agree to ~1e-5 relative and each matrix to ~2% of its norm; a rank
    # stepping on its own unsynced gradient is off by far more.
    diffs = {s: abs(a[s] - b[s]) / a[s] for s in a}
    assert max(diffs.values()) <= 2e-5, diffs
    for (name, x), y in zip(weights(tmp_path / "one").items(), weights(tmp_path / "two").values(), strict=True):
        assert (x - y).norm() <= 5e-2 * x.norm(), (name, (x - y).norm() / x.norm())


@pytest.mark.slow
def test_two_torchrun_agents_match_two_processes_under_one_agent(data_dir, tmp_path, two_processes):
    """The guide's multi-node command with both "nodes" on this machine: one process per agent."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-agents"]
    agents = [
        subprocess.Popen(
            torchrun(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), *rdzv], data_dir, tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    assert any("2 processes x 2 accumulation" in out for out, _ in outputs)
    two, _ = two_processes
    assert losses(tmp_path) == losses(two) and losses(tmp_path, "val") == losses(two, "val")


@contextlib.contextmanager
def two_ranks(data_dir, out, *settings):
    """Ranks 0 and 1 started by hand in torchrun's environment, training, so a test can stop or signal either
    (torchrun would add its own 30 s wait for a stopped worker); both are killed on the way out."""
    port, procs = free_port(), []
    args = cli("train", "--config", "tiny", "--data", data_dir, "--out", out, "--set", "train.max_steps=100000")
    for setting in ("eval.every=0", "train.batch_tokens=512", *settings):
        args += ["--set", setting]
    try:
        for rank in (0, 1):
            env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
            with open(out.parent / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
        # Rank 0's first line, the step-0 validation, comes after both ranks joined DDP and evaluated together.
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, (out.parent / "rank0.log").read_text()
            time.sleep(0.05)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_a_stalled_rank_fails_the_job_after_dist_timeout(data_dir, tmp_path):
    with two_ranks(data_dir, tmp_path / "run", "train.dist_timeout=5") as (rank0, rank1):
        rank1.send_signal(signal.SIGSTOP)
        rank0.wait(timeout=120)  # far below PyTorch's 30-minute default; no tighter bound on a loaded machine
    last = (tmp_path / "rank0.log").read_text().splitlines()[-1]
    assert rank0.returncode == 1 and last.startswith("gptforge train: error: rank 0: "), last
    assert "timed out: a peer rank did not respond within train.dist_timeout=5s" in last


@pytest.mark.slow
def test_sigterm_while_blocked_on_a_stalled_rank_exits_promptly(data_dir, tmp_path):
    with two_ranks(data_dir, tmp_path / "run", "train.dist_timeout=300") as (rank0, rank1):
        rank1.send_signal(signal.SIGSTOP)
        time.sleep(2)  # rank 0 reaches its next collective and waits there
        rank0.send_signal(signal.SIGTERM)
        t = time.monotonic()
        rank0.wait(timeout=120)  # well inside train.dist_timeout=300: the signal, not the timeout, ended it
        took = time.monotonic() - t
    last = (tmp_path / "rank0.log").read_text().splitlines()[-1]
    assert rank0.returncode == 128 + signal.SIGTERM, last
    assert last.startswith("gptforge train: error: rank 0: SIGTERM, and ") and "without a checkpoint" in last
    assert took >= BLOCKED_SECONDS, took  # it waited to be sure the rank was blocked
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_collective_that_timed_out_or_lost_its_peer_fails_in_one_line_and_other_errors_pass():
    def collective(message, env):
        with pytest.raises((RuntimeError, GptforgeError)) as caught, peer_failures(env, 5):
            raise RuntimeError(message)
        return caught.value

    rank1 = DistEnv(rank=1, local_rank=1, world_size=2)
    gloo = "[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
    assert str(collective(gloo, rank1)) == (
        "rank 1: collective timed out: a peer rank did not respond within train.dist_timeout=5s (stalled or dead); "
        "see the other ranks' output [Timed out waiting 5000ms for recv operation to complete]"
    )
    lost = collective("[/gloo/transport/tcp/pair.cc:537] Read error [::1]:1: Connection reset by peer. This is", rank1)
    assert isinstance(lost, GptforgeError) and str(lost).endswith(
        "collective failed: a peer rank closed its connection (it exited); see the other ranks' output "
        "[Read error [::1]:1: Connection reset by peer]"
    )
    assert type(collective("CUDA out of memory", rank1)) is RuntimeError
    assert type(collective(gloo, SINGLE)) is RuntimeError


def children(pid):
    """The processes whose parent is `pid` (torchrun's agent: its workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_restarts_a_job_whose_worker_died_and_it_goes_on_from_its_checkpoint(data_dir, tmp_path, parallel):
    settings = ("train.max_steps=80", "checkpoint.every=8", "eval.every=0", f"train.parallel={parallel}")
    launcher = ["--standalone", "--nproc-per-node", "2"]
    calm = subprocess.run(
        torchrun(launcher, data_dir, tmp_path / "calm", *settings), capture_output=True, text=True, env=ENV,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert calm.returncode == 0, calm.stderr[-3000:]
    agent = subprocess.Popen(
        torchrun([*launcher, "--max-restarts", "1"], data_dir, tmp_path / "run", *settings),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "run" / "checkpoints" / "step_000008").is_dir():
            assert time.monotonic() < deadline and agent.poll() is None
            time.sleep(0.02)
        os.kill(max(children(agent.pid)), signal.SIGKILL)  # a worker dies mid-run, as on a lost machine
        out, err = agent.communicate(timeout=TIMEOUT)
    finally:
        agent.kill()
    assert agent.returncode == 0, err[-3000:]
    assert "torchrun restarted the job (restart 1): continuing from the newest checkpoint" in out, err[-3000:]
    run, undisturbed = losses(tmp_path / "run"), losses(tmp_path / "calm")
    assert run.keys() == undisturbed.keys() == set(range(1, 81))
    assert all(abs(run[s] - undisturbed[s]) <= 1e-5 for s in run), [(s, run[s], undisturbed[s]) for s in run]


def test_each_restart_of_a_torchrun_job_has_its_own_keys_in_the_store_torchrun_keeps():
    from gptforge.runtime.distributed import elastic_warning, restart_store

    wait = datetime.timedelta(seconds=10)
    server = torch.distributed.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=wait)
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}
    assert restart_store({**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"}, 2, wait) is None  # torch makes its own
    first = restart_store({**agent, "TORCHELASTIC_RESTART_COUNT": "0"}, 2, wait)
    again = restart_store({**agent, "TORCHELASTIC_RESTART_COUNT": "1"}, 2, wait)
    first.set("rank_1", "a dead worker's address")
    assert not again.check(["rank_1"]) and first.check(["rank_1"])  # the restarted group never reads the old one
    nodes = {**agent, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0", "WORLD_SIZE": "4"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in elastic_warning(nodes)
    assert elastic_warning({**nodes, "GROUP_WORLD_SIZE": "1"}) == elastic_warning({**nodes, "RANK": "1"}) == ""


def test_a_restart_resumes_from_the_runs_newest_checkpoint_or_else_from_the_one_given():
    from gptforge.runtime.distributed import elastic_resume

    restarted = {"TORCHELASTIC_RESTART_COUNT": "1"}
    assert elastic_resume(None, {}, saved=False) == (None, "") and elastic_resume("c", {}, saved=True) == ("c", "")
    assert elastic_resume(None, restarted, saved=False)[0] == "auto"  # died before its first checkpoint: starts
    assert elastic_resume("other/step_000100", restarted, saved=False) == ("other/step_000100", "")
    resume, line = elastic_resume("other/step_000100", restarted, saved=True)  # it went on past the one given
    assert resume == "auto" and line.startswith("torchrun restarted the job (restart 1)")
