"""`gptforge plan`: the memory model against the peaks measured on an H100, the strategies' arithmetic, the largest
micro-batch, the time, and `train`'s refusal of what cannot fit."""

import dataclasses
import json
import subprocess

import pytest
from tests.helpers import cli

from gptforge.cli import main
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.runtime.flops import GPU_PEAK_TFLOPS
from gptforge.train.plan import GIB, Hardware, Memory, check_fits, format_report, hours, memory, plan, report

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


def test_each_term_of_a_small_config_is_the_hand_computed_one_on_1_and_8_gpus():
    cfg = load_config("tiny", ["model.vocab_size=1000", "train.dtype=bfloat16", "train.batch_tokens=2048"])
    # C=32, 2 layers, T=32, MLP 128, vocabulary padded to 1024, tied. Weights: table 1024·32 = 32,768, positions
    # 32·32 = 1,024, a layer 2 norms 2·64 + attention 4·32² + 4·32 + MLP 2·128·32 + 128 + 32 = 12,704, final norm 64.
    P = 32_768 + 1_024 + 2 * 12_704 + 64
    assert cfg.model.num_weights == P == 59_264
    # Bytes a token keeps, bf16 (2 bytes): a block's attention 4·32 + 2·(32 + 3·32 + 32) = 448, the MLP's input
    # 4·32 + 2·32 = 192 and inner 2·2·128 = 512: 1,152; edges 4·32 + 6·32 = 320; the fused loss 4·32 a token.
    # A micro-batch of 4 x 32 = 128 tokens, times the allocator's 1.18.
    activations = 1.18 * ((2 * 1_152 + 320) * 128 + 4 * 32 * 128)
    checkpointed = 1.18 * ((2 * 4 * 32 + 1_152 + 320) * 128 + 4 * 32 * 128)  # block inputs, one block recomputed
    adamw = 8 * P
    alone = Memory(4 * P, 4 * P, adamw, activations)  # one GPU: no buckets, nothing sharded
    # 8 GPUs: DDP's buckets double the gradients; zero shards the optimizer; fsdp shards everything and holds the
    # root (32,768 + 1,024 + 64 = 33,856 weights) and two blocks (12,704 each) gathered in bf16, and, accumulating
    # 2 micro-steps (2,048 / (4 x 32 x 8)), the unsharded fp32 gradients.
    gathered = 2 * (33_856 + 2 * 12_704)
    expected = {
        "ddp": Memory(4 * P, 8 * P, adamw, activations),
        "zero": Memory(4 * P, 8 * P, adamw / 8, activations),
        "fsdp": Memory(4 * P / 8 + gathered, 4 * P / 8 + 4 * P, adamw / 8, activations),
    }
    terms = lambda m: pytest.approx(dataclasses.asdict(m), rel=1e-12)  # noqa: E731
    for strategy, eight in expected.items():
        assert dataclasses.asdict(memory(cfg, strategy, 1, 4, checkpointed=False)) == terms(alone)
        assert dataclasses.asdict(memory(cfg, strategy, 8, 4, checkpointed=False)) == terms(eight)
        p = plan(cfg, strategy, Hardware(gpus=4, nodes=2))  # world = GPUs x nodes
        assert dataclasses.asdict(p.memory) == terms(eight) and p.accumulation == 2
        assert p.checkpointed.activations == pytest.approx(checkpointed, rel=1e-12)


def test_8_gpus_taking_the_whole_step_at_once_and_a_rotary_block_by_hand():
    # 1,024 tokens a step on 8 GPUs of 4 x 32: one micro-step, so fsdp keeps no unsharded gradients, and the
    # largest micro-batch is each GPU's whole share (4), not a size of the step on one GPU.
    cfg = load_config("tiny", ["model.vocab_size=1000", "train.dtype=bfloat16", "train.batch_tokens=1024"])
    P = cfg.model.num_weights
    p = plan(cfg, "fsdp", Hardware(gpus=8))
    assert (p.accumulation, p.largest_micro_batch, p.memory.grads) == (1, 4, 4 * P / 8)
    assert plan(cfg, "ddp", Hardware(gpus=8)).largest_micro_batch == 4
    # Rotary with QK-norm and SwiGLU (MLP 128 a branch): attention 448 + q and k again 2·2·32 = 576, the MLP's
    # input 192 and inner 2·3·128 = 768: 1,536 a block.
    modern = ["model.position=rotary", "model.qk_norm=true", "model.norm=rmsnorm", "model.mlp=swiglu"]
    rotary = load_config("tiny", ["model.vocab_size=1000", "train.dtype=bfloat16", *modern])
    assert rotary.model.hidden_size == 128
    activations = 1.18 * ((2 * 1_536 + 320) * 128 + 4 * 32 * 128)
    assert memory(rotary, "ddp", 1, 4, checkpointed=False).activations == pytest.approx(activations, rel=1e-12)


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


def test_a_time_budget_that_ends_the_run_first_is_its_time_and_tokens():
    cfg = load_config("gpt2-124m", ["train.time_budget=60"])  # max_steps alone: 5.9 h
    r = report(cfg, "gpt2-124m", Hardware(gpus=2))
    assert r["hours"] == pytest.approx(60 / 3600) and r["gpu_hours"] == pytest.approx(120 / 3600)
    full = hours(load_config("gpt2-124m"), Hardware(gpus=2))[0] * 3600
    assert r["tokens"] == cfg.train.batch_tokens * int(cfg.train.max_steps * 60 / full)
    assert "GPU-hours), train.time_budget ends it at" in format_report(r)
    longer = load_config("gpt2-124m", ["train.time_budget=1e9"])  # max_steps ends it first
    assert hours(longer, Hardware()) == hours(load_config("gpt2-124m"), Hardware())


def test_an_absurd_time_prints_a_short_figure():
    cfg = load_config("gpt2-124m")
    time = lambda mfu: format_report(report(cfg, "gpt2-124m", Hardware(mfu=mfu))).splitlines()[-2]  # noqa: E731
    assert time(0.382).startswith("time: 5.9 h (5.9 GPU-hours) at 38.2% MFU of 989.4 TFLOP/s;")
    assert time(0.001).startswith("time: 2,240.4 h (2,240.4 GPU-hours) at 0.1% MFU")
    assert time(1e-300).startswith("time: 2.24e+300 h (2.24e+300 GPU-hours) at 1e-298% MFU")  # not 301 digits
    one = load_config("gpt2-124m", ["train.micro_batch=1"])
    wide = report(one, "gpt2-124m", Hardware(gpus=8, nodes=64))  # 41 s of wall-clock: not "0.0 h"
    assert format_report(wide).splitlines()[-2].startswith("time: 0.0115 h (5.9 GPU-hours)")


@pytest.mark.parametrize("flag", [["--mfu", "5e-324"], ["--mfu", "1e-9"], ["--peak-tflops", "1e308"]])
def test_the_plan_refuses_a_peak_or_mfu_whose_time_would_not_be_finite(flag, capsys):
    with pytest.raises(SystemExit) as exit:  # 5e-324: "inf h" (and null in --json); 1e308 TFLOP/s: "0.0 h"
        main(["plan", *flag])
    assert exit.value.code == 2 and f"argument {flag[0]}: expected a number in" in capsys.readouterr().err


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


def test_a_float32_run_is_timed_against_the_h100_s_tf32_peak_unless_one_is_given(capsys):
    bf16, fp32 = (load_config("gpt2-124m", [f"train.dtype={d}"]) for d in ("bfloat16", "float32"))
    half, tf32 = GPU_PEAK_TFLOPS["H100"]
    assert hours(fp32, Hardware())[0] / hours(bf16, Hardware())[0] == pytest.approx(half / tf32)
    assert f"MFU of {tf32:g} TFLOP/s" in format_report(report(fp32, "gpt2-124m", Hardware()))
    assert hours(fp32, Hardware(peak_tflops=100.0)) == hours(bf16, Hardware(peak_tflops=100.0))  # a stated peak
    main(["plan", "--set", "train.dtype=float32"])
    assert f"MFU of {tf32:g} TFLOP/s" in capsys.readouterr().out
