"""`accelerate launch -m gptforge train`: the README's CPU form gives 2 gloo ranks equal to 1 process with double
accumulation, the plain launcher's lone process is refused when more were asked for, and --mixed_precision is
honoured (an explicit --set train.dtype still wins)."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.rundir import CONFIG
from gptforge.runtime.distributed import check_single_process, launcher_overrides

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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf-home")}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=TIMEOUT)


@pytest.mark.slow
def test_accelerate_multi_gpu_form_on_cpu_matches_one_process_with_double_accumulation(data_dir, tmp_path):
    with socket.socket() as s:  # a free port, not accelerate's default 29500 that another job may hold
        s.bind(("127.0.0.1", 0))
        port = ["--main_process_port", str(s.getsockname()[1])]
    two = accelerate(["--multi_gpu", "--num_processes", "2", *port], data_dir, tmp_path / "two", tmp_path=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        cli("train", *COMMON, "--data", data_dir, "--out", tmp_path / "one", "--set", "train.batch_tokens=512"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr
    assert "2 processes x 2 accumulation" in two.stdout and "1 process x 4 accumulation" in one.stdout
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == set(range(1, 5))
    assert all(abs(a[step] - b[step]) <= 1e-5 for step in a), (a, b)
    for (name, x), y in zip(weights(tmp_path / "one").items(), weights(tmp_path / "two").values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


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
    assert "1 x cpu bfloat16" in bf16.stdout
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
    with pytest.raises(GptforgeError, match="--mixed_precision fp8: gptforge trains in no, bf16 or fp16"):
        launcher_overrides([], {"ACCELERATE_MIXED_PRECISION": "fp8"})


def test_only_accelerates_plain_launcher_asked_for_more_processes_is_refused():
    check_single_process({})  # a plain run
    check_single_process({"ACCELERATE_USE_CPU": "True"})  # accelerate launch --cpu, one process asked for
    check_single_process({"MASTER_ADDR": "127.0.0.1"})  # not accelerate
    with pytest.raises(GptforgeError, match="started 1 process"):
        check_single_process({"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
