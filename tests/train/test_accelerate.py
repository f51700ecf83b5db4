"""`accelerate launch -m gptforge train`: the guide's CPU forms (--multi_gpu, and --cpu under mpirun) give 2 gloo
ranks equal to 1 process with double accumulation, the plain launcher's lone process is refused when more were
asked for, and --mixed_precision is honoured (an explicit --set train.dtype still wins)."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.rundir import CONFIG
from gptforge.runtime.distributed import DistEnv, check_single_process, init, launch_env, launcher_overrides

pytest.importorskip("accelerate")

COMMON = ["--config", "tiny", "--set", "train.max_steps=4", "--set", "eval.every=2", "--set", "eval.sample_tokens=0"]
TIMEOUT = 300  # seconds for any one run: a hang fails the test instead of the suite


def accelerate(launch_args, data_dir, out, *settings, tmp_path):
    """`accelerate launch LAUNCH_ARGS -m gptforge train` (tiny config, 512 tokens a step), accelerate's own config
    folder empty so a user's default_config.yaml cannot change what is tested."""
    args = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, "-m", "gptforge", "train", *COMMON]
    args += ["--data", str(data_dir), "--out", str(out), "--set", "train.batch_tokens=512"]
    for setting in settings:
        args += ["--set", setting]
    # Open MPI refuses root unless told; the machines tests run on are often containers run as root.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=TIMEOUT)


def free_port():
    """A free port, not accelerate's default 29500 that another job may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ["--main_process_port", str(s.getsockname()[1])]


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """The reference: 1 process x 4 micro-batches of 4 x 32 (run folder)."""
    out = tmp_path_factory.mktemp("one") / "run"
    one = subprocess.run(
        cli("train", *COMMON, "--data", data_dir, "--out", out, "--set", "train.batch_tokens=512"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0 and "1 process x 4 accumulation" in one.stdout, one.stderr
    return out


def assert_same_run(one, two):
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys() == set(range(1, 5))
    assert all(abs(a[step] - b[step]) <= 1e-5 for step in a), (a, b)
    for (name, x), y in zip(weights(one).items(), weights(two).values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_accelerate_multi_gpu_form_on_cpu_matches_one_process_with_double_accumulation(data_dir, tmp_path, one_process):
    two = accelerate(
        ["--multi_gpu", "--num_processes", "2", *free_port()], data_dir, tmp_path / "two", tmp_path=tmp_path
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 processes x 2 accumulation" in two.stdout
    assert_same_run(one_process, tmp_path / "two")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt-get install openmpi-bin)")
def test_accelerate_cpu_form_under_mpirun_matches_one_process_with_double_accumulation(data_dir, tmp_path, one_process):
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    launch = ["--cpu", "--num_processes", "2", "--mpirun_hostfile", str(tmp_path / "hostfile"), *free_port()]
    two = accelerate(launch, data_dir, tmp_path / "two", tmp_path=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 processes x 2 accumulation" in two.stdout
    assert_same_run(one_process, tmp_path / "two")


@pytest.mark.slow
def test_accelerate_cpu_launcher_asked_for_two_processes_is_refused_in_one_line(data_dir, tmp_path):
    run = accelerate(["--cpu", "--num_processes", "2"], data_dir, tmp_path / "run", tmp_path=tmp_path)
    assert run.returncode != 0, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("gptforge train: error:")]
    assert len(errors) == 1 and "accelerate launch --multi_gpu --num_processes N" in errors[0], run.stderr[-3000:]
    # gptforge's process says one line; the traceback after it is accelerate's own (CalledProcessError).
    assert "Traceback" not in run.stderr.split(errors[0])[0], run.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_accelerate_mixed_precision_sets_train_dtype_and_an_explicit_set_wins(data_dir, tmp_path):
    # The tiny preset says float32: accelerate's bf16 replaces it, in the header and in the saved config.
    bf16 = accelerate(["--cpu", "--mixed_precision", "bf16"], data_dir, tmp_path / "bf16", tmp_path=tmp_path)
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert "accelerate launch --mixed_precision bf16: train.dtype=bfloat16" in bf16.stdout
    assert "1 x cpu bfloat16, 1 thread each" in bf16.stdout  # the OMP_NUM_THREADS accelerate passed on, said
    assert load_config(str(tmp_path / "bf16" / CONFIG)).train.dtype == "bfloat16"
    explicit = accelerate(
        ["--cpu", "--mixed_precision", "bf16"], data_dir, tmp_path / "fp32", "train.dtype=float32", tmp_path=tmp_path
    )
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    assert "--set train.dtype=float32 takes precedence" in explicit.stdout and "1 x cpu float32" in explicit.stdout


def test_launcher_overrides_map_every_accelerate_precision_and_refuse_fp8():
    for precision, dtype in (("no", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        overrides, note = launcher_overrides(["train.seed=1"], {"ACCELERATE_MIXED_PRECISION": precision})
        assert overrides == [f"train.dtype={dtype}", "train.seed=1"] and note.endswith(f"train.dtype={dtype}")
        assert load_config("tiny", overrides).train.dtype == dtype
    assert launcher_overrides(["train.seed=1"], {}) == (["train.seed=1"], "")  # torchrun or a plain run: nothing added
    rank1 = {"ACCELERATE_MIXED_PRECISION": "bf16", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert launcher_overrides([], rank1) == (["train.dtype=bfloat16"], "")  # said once, by rank 0
    with pytest.raises(GptforgeError, match="--mixed_precision fp8: gptforge trains in no, bf16 or fp16"):
        launcher_overrides([], {"ACCELERATE_MIXED_PRECISION": "fp8"})


def test_only_accelerates_plain_launcher_asked_for_more_processes_is_refused():
    check_single_process({})  # a plain run
    check_single_process({"ACCELERATE_USE_CPU": "True"})  # accelerate launch --cpu, one process asked for
    check_single_process({"MASTER_ADDR": "127.0.0.1"})  # not accelerate
    with pytest.raises(GptforgeError, match="started 1 process"):
        check_single_process({"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_mpi_ranks_are_read_as_accelerate_reads_them_and_need_a_rendezvous_address(monkeypatch):
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert launch_env(ompi) == DistEnv(rank=1, local_rank=1, world_size=2)
    assert launch_env({**ompi, "RANK": "0", "WORLD_SIZE": "2"}).rank == 0  # torchrun's names first
    assert launch_env({"PMI_RANK": "3", "PMI_SIZE": "4"}) == DistEnv(rank=3, local_rank=0, world_size=4)
    assert launch_env({"OMPI_COMM_WORLD_SIZE": "1"}) == DistEnv()
    for name, value in ompi.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(GptforgeError, match="rank 1 of 2: MASTER_ADDR and MASTER_PORT must name"):
        init("cpu", 5)
