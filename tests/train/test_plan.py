"""`gptforge plan`: the memory model against the peaks measured on an H100, the strategies' arithmetic, the largest
micro-batch, the time, and `train`'s refusal of what cannot fit."""

import json
import subprocess

import pytest
from tests.helpers import cli

from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.train.plan import GIB, Hardware, check_fits, hours, memory, plan

# benchmarks/RESULTS.md: `gptforge bench` on one H100 SXM, bf16, compiled, 64 x 1024 tokens a micro-step.
MEASURED = [("gpt2-124m", [], 26.7), ("gpt2-124m", ["model.fused_loss=false"], 29.6), ("speedrun-124m", [], 29.3)]


@pytest.mark.parametrize(("preset", "settings", "gib"), MEASURED)
def test_the_plan_is_within_15_percent_of_the_peaks_measured_on_an_h100(preset, settings, gib):
    planned = plan(load_config(preset, ["train.dtype=bfloat16", *settings]), "ddp", Hardware()).memory.total / GIB
    assert abs(planned / gib - 1) <= 0.15, (preset, settings, planned, gib)


def test_zero_and_fsdp_shard_what_they_promise_and_checkpointing_saves_activations():
    cfg = load_config("gpt2-124m", ["train.micro_batch=16", "train.dtype=bfloat16"])
    ddp, zero, fsdp = (memory(cfg, s, 8, 16, checkpointed=False) for s in ("ddp", "zero", "fsdp"))
    assert zero.optimizer == ddp.optimizer / 8 and zero.params == ddp.params and zero.grads == ddp.grads
    assert fsdp.optimizer == ddp.optimizer / 8 and fsdp.params < ddp.params / 2 and fsdp.grads < ddp.grads
    assert ddp.activations == zero.activations == fsdp.activations  # activations are each GPU's own batch
    assert memory(cfg, "ddp", 8, 16, checkpointed=True).activations < ddp.activations / 2
    assert memory(cfg, "ddp", 1, 16, checkpointed=False).grads == ddp.grads / 2  # no DDP buckets on one GPU


def test_the_largest_micro_batch_fits_divides_the_batch_and_the_next_size_does_not_fit():
    cfg = load_config("gpt2-124m", ["train.dtype=bfloat16"])
    hardware = Hardware(gpus=2, memory_gib=40)
    p = plan(cfg, "ddp", hardware)
    b, T = p.largest_micro_batch, cfg.model.block_size
    assert b > 0 and cfg.train.batch_tokens % (b * T * 2) == 0
    assert memory(cfg, "ddp", 2, b, checkpointed=False).total <= 40 * GIB
    assert memory(cfg, "ddp", 2, 2 * b, checkpointed=False).total > 40 * GIB


def test_the_time_is_the_tokens_flops_at_the_stated_mfu():
    cfg = load_config("gpt2-124m")
    wall, gpu_hours = hours(cfg, Hardware(gpus=8, mfu=0.382))
    measured = cfg.train.max_steps * cfg.train.batch_tokens / 473_805 / 3600  # one H100's tokens/s at 38.2% MFU
    assert abs(wall * 8 / measured - 1) < 0.01 and gpu_hours == pytest.approx(wall * 8)


def test_train_refuses_a_micro_batch_its_gpu_cannot_hold_in_one_line():
    cfg = load_config("gpt2-124m", ["train.dtype=bfloat16"])
    check_fits(cfg, 1, 80)  # 26.7 GiB planned
    check_fits(cfg, 1, 24)  # within the plan's 15%: let it try
    with pytest.raises(GptforgeError, match=r"train.micro_batch=64: the plan needs 26.\d GiB .* 16.0 GiB; "
                                            r"train.micro_batch=32 fits") as e:  # fmt: skip
        check_fits(cfg, 1, 16)
    assert "\n" not in str(e.value)


def test_fsdp_counts_fp32_accumulated_gradients_and_every_block_gathered_without_resharding():
    cfg = load_config("gpt2-124m", ["train.micro_batch=16", "train.dtype=bfloat16"])  # accumulation 4 on 8 GPUs
    P = cfg.model.num_weights
    fsdp = memory(cfg, "fsdp", 8, 16, checkpointed=False)
    assert fsdp.grads == 4 * P / 8 + 4 * P
    kept = load_config(
        "gpt2-124m", ["train.micro_batch=16", "train.dtype=bfloat16", "train.reshard_after_forward=false"]
    )
    assert memory(kept, "fsdp", 8, 16, checkpointed=False).params == pytest.approx(4 * P / 8 + 2 * P)


def test_the_plan_refuses_a_step_train_would_refuse_and_marks_strategies_the_config_cannot_use():
    for settings, gpus in ((["train.micro_batch=48"], 1), ([], 100_000)):
        with pytest.raises(GptforgeError, match="must be a positive multiple of train.micro_batch"):
            plan(load_config("gpt2-124m", settings), "ddp", Hardware(gpus=gpus))
    muon = load_config("gpt2-124m", ["optim.optimizer=muon"])
    refused = {s: plan(muon, s, Hardware(gpus=8)).refused for s in ("ddp", "zero", "fsdp")}
    assert refused["ddp"] is None and "train.zero" in refused["zero"] and "train.parallel=fsdp" in refused["fsdp"]
    huge = load_config("gpt2-124m", [f"train.batch_tokens={2**40}"])  # its divisors, not a scan of 2**30 sizes
    assert plan(huge, "ddp", Hardware()).largest_micro_batch == 128


def test_the_plan_command_prints_a_table_or_json_and_refuses_bad_flags_in_one_line():
    out = subprocess.run(cli("plan", "--gpus", "8", "--json"), capture_output=True, text=True, timeout=60)
    r = json.loads(out.stdout)
    assert [p["strategy"] for p in r["plans"]] == ["ddp", "zero", "fsdp"] and r["hardware"]["gpus"] == 8
    table = subprocess.run(cli("plan"), capture_output=True, text=True, timeout=60).stdout
    assert "ddp" in table and "GPU-hours" in table
    bad_flags = (["--gpus", "0"], ["--mfu", "2"], ["--set", "train.micro_batch=x"], ["--gpu-memory", "lots"])
    for bad in (*bad_flags, ["--nodes", "9" * 400], ["--set", f"train.max_steps={10**300}"]):
        done = subprocess.run(cli("plan", *bad), capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, (bad, done.stderr)
