"""`gptforge bench` runs end to end, and the fast path keeps the fp32 path's numbers."""

import json

import pytest
import torch

from gptforge.cli import main
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.runtime.device import autocast
from gptforge.runtime.flops import peak_flops


def test_bench_prints_ours_reference_and_ratio(capsys):
    pytest.importorskip("transformers")
    args = ["bench", "--config", "tiny", "--steps", "2", "--warmup", "1", "--json", "--set", "model.vocab_size=512"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["settings"]["params"] > 0 and r["ours"]["tokens_per_s"] > 0 and r["reference"]["tokens_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["reference"]["ms"] / r["ours"]["ms"])
    assert r["sampling"]["with_cache"] > 0 and r["tokenization_mb_s"] > 0


def test_bf16_fast_path_matches_fp32_within_its_precision():
    """Same weights, same batches: the bf16-autocast trajectory stays within bf16's tolerance of fp32's."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=2048, n_layer=2, n_head=4, n_embd=128)
    base = GPT(cfg)
    # Arithmetic sequences: the next token follows from the last, so the loss can fall within a few steps.
    batches = [(torch.randint(0, 2048, (8, 1)) + 7 * torch.arange(65)) % 2048 for _ in range(6)]
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT(cfg)
        model.load_state_dict(base.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
        losses[dtype] = []
        for b in batches:
            with autocast(torch.device("cpu"), dtype):
                _, loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[dtype].append(loss.item())
    assert losses[torch.float32][-1] < losses[torch.float32][0] - 0.1  # it trains
    for a, b in zip(losses[torch.float32], losses[torch.bfloat16], strict=True):
        assert abs(a - b) < 0.02 * a  # bf16 keeps ~3 significant digits


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),  # not the SXM part's 989
        ("NVIDIA H100 NVL", torch.float16, 835.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 156.0),  # fp32 matmuls run as tf32
        ("NVIDIA L40S", torch.bfloat16, 362.1),  # not L40's nor L4's
        ("NVIDIA L4", torch.bfloat16, 121.0),
    ],
)
def test_mfu_peak_is_the_variant_and_dtype_of_the_gpu(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = peak_flops(torch.device("cuda"), dtype)
    assert peak == tflops * 1e12, source
    assert peak_flops(torch.device("cuda"), dtype, override=1e12) == (1e12, "train.peak_flops")


def test_unknown_gpu_asks_for_the_override(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU 9000")
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == (
        0.0,
        "unknown GPU 'Imaginary GPU 9000': set train.peak_flops",
    )


def test_reference_that_runs_out_of_memory_is_retried_with_smaller_micro_batches(monkeypatch):
    """Same tokens per step: the reference's micro-batches are halved until its step fits."""
    import gptforge.bench as bench
    from gptforge.config import load_config

    real = bench._reference
    tried = []

    def reference_fitting_two(cfg, batches):
        tried.append((len(batches), batches[0][0].size(0)))
        if batches[0][0].size(0) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(cfg, batches)

    pytest.importorskip("transformers")
    monkeypatch.setattr(bench, "_reference", reference_fitting_two)
    monkeypatch.setattr(bench, "_sampling", lambda *a: {})
    monkeypatch.setattr(bench, "_tokenization", lambda: 0.0)
    cfg = load_config("tiny", ["model.vocab_size=512", "train.micro_batch=8", "train.batch_tokens=512"])
    r = bench.run_bench(cfg, steps=1, warmup=1)
    assert tried == [(2, 8), (4, 4), (8, 2)]  # 2 x 8 x 32 tokens each time
    assert r["reference"]["micro_batch"] == 2 and r["settings"]["micro_batch"] == 8


def test_mfu_over_100_percent_reprobes_a_cpu_peak_and_never_prints_nonsense(monkeypatch):
    from gptforge.runtime import flops

    # The machine was busy at the first probe: the second finds more. A fourth probe would raise StopIteration.
    probes = iter([2e11, 1e11, 1e11])
    monkeypatch.setattr(flops, "cpu_matmul_flops", lambda dtype: next(probes))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the busy floor is per thread
    mfu = flops.Utilisation(5e10, torch.device("cpu"), torch.float32)
    assert mfu(2.5e10) == 0.5  # below the probed peak: no re-probe
    assert mfu(1e11) == 0.5 and mfu.peak == 2e11  # beat it: probed again, the higher peak kept
    assert [mfu(3e11) for _ in range(4)] == [None] * 4 and mfu.reprobes == 3  # over 100% after 3 probes: no number
    assert flops.format_mfu(None) == "n/a" and flops.format_mfu(0.256) == "25.6%"
    assert flops.format_flops(4.2e10) == "42 GFLOP/s" and flops.format_flops(9.894e14) == "989.4 TFLOP/s"
    assert flops.Utilisation(0.0, torch.device("cpu"), torch.float32)(1e9) is None  # unknown peak
    # A peak far below an idle core's was slowed by load: no step is measured against it.
    assert flops.Utilisation(5e9, torch.device("cpu"), torch.float32)(2.5e9) is None
