"""On a CUDA GPU, what the CPU suite cannot show: flash attention, compiled bf16 training of both recipes and their
resume, export parity, generation and the MFU peak. Run there with `GPTFORGE_GPU_TESTS=1 python -m pytest tests/gpu`."""

import shutil

import pytest
import torch
from tests.helpers import losses
from tests.train.test_trainer import MODERN

from gptforge.bench import run_bench
from gptforge.checkpoint import load_checkpoint
from gptforge.config import load_config
from gptforge.hub.convert import export_hf
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.runtime.flops import peak_flops
from gptforge.tokens.tokenizer import load_tokenizer
from gptforge.train.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (GPTFORGE_GPU_TESTS=1)")

RECIPES = pytest.mark.parametrize("recipe", [[], MODERN], ids=["gpt2", "modern-muon"])


def full_fp32_matmuls():
    """Training turns TF32 on for the process; the comparisons here are in full fp32."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def fp32_matmuls():
    full_fp32_matmuls()


def cuda_cfg(data_dir, *overrides):
    return load_config(
        "tiny",
        [f"data.path={data_dir}", "train.device=cuda", "train.dtype=auto", "train.compile=true", *overrides],
    )


@pytest.mark.parametrize("modern", [False, True], ids=["gpt2", "modern"])
def test_flash_attention_runs_our_bf16_step_and_matches_fp32(modern):
    fields = dict(norm="rmsnorm", position="rotary", qk_norm=True, bias=False, mlp="relu2") if modern else {}
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_embd=256, **fields)).cuda()
    idx = torch.randint(0, 512, (4, 256), device="cuda")
    with torch.no_grad():
        reference = model(idx, idx)[1]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", torch.bfloat16):  # raises if flash can't
        loss = model(idx, idx)[1]
        loss.backward()
    assert abs(loss.item() - reference.item()) < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@RECIPES
def test_compiled_bf16_training_falls_and_resumes_within_run_to_run_noise(data_dir, tmp_path, recipe):
    """GPU kernels (atomics, split reductions) make two uninterrupted runs differ slightly; a resumed run must differ
    from an uninterrupted one no more than that (bitwise where the GPU happens to be deterministic)."""
    cfg = cuda_cfg(data_dir, "train.max_steps=30", "checkpoint.every=15", "eval.every=15", *recipe)
    straight = train(cfg, tmp_path / "a")
    assert straight.last_val["loss"] < straight.first_val["loss"] - 2.0
    assert load_checkpoint(straight.checkpoint)[2].train.dtype == "bfloat16"  # auto, made concrete
    train(cfg, tmp_path / "again")
    train(cfg, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000030")
    train(cfg, tmp_path / "b", resume="auto")

    a, again, b = (losses(tmp_path / run) for run in ("a", "again", "b"))
    noise = max(abs(a[s] - again[s]) for s in range(16, 31))
    drift = max(abs(a[s] - b[s]) for s in range(16, 31))
    print(f"run-to-run noise {noise:.3g}, resume drift {drift:.3g}")
    assert drift <= 10 * noise


@RECIPES
def test_a_gpu_trained_checkpoint_exports_with_parity_on_the_gpu(data_dir, tmp_path, recipe):
    transformers = pytest.importorskip("transformers")
    result = train(cuda_cfg(data_dir, "train.max_steps=10", "train.compile=false", *recipe), tmp_path / "run")
    model, tokenizer, _, _ = load_checkpoint(result.checkpoint)
    full_fp32_matmuls()
    out = export_hf(model, tokenizer, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).cuda().eval()
    ours = model.cuda().eval()
    idx = torch.randint(0, tokenizer.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx, all_logits=True)[0], atol=1e-4, rtol=1e-4)


def test_kv_cache_generation_equals_the_full_forward_on_the_gpu():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=128)).cuda().eval()
    prompt = list(range(10))
    cached = generate(model, prompt, 40, temperature=0, use_cache=True)
    assert cached == generate(model, prompt, 40, temperature=0, use_cache=False)


def test_batched_generation_writes_what_each_prompt_writes_alone_on_the_gpu():
    """Continuous batching (serve, eval --code) on CUDA: rows of different lengths in one forward pass. Greedy and
    fp32: the tokens, not the bits (cuBLAS may pick another kernel for another batch size)."""
    from gptforge.model.generate import Generation, generate_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=128)).cuda().eval()
    prompts = [list(range(n, 3 * n + 1)) for n in (1, 5, 9, 2, 30)]
    items = generate_batch(model, [Generation(p, 40) for p in prompts], ends=set(), rows=3)
    assert [item.new for item in items] == [generate(model, p, 40, temperature=0)[0] for p in prompts]


def test_bf16_generation_stays_off_cudnn_attention():
    """cuDNN attention builds a plan per new sequence length, which generation brings every token."""
    model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=128)).cuda().eval()
    with torch.profiler.profile() as prof, torch.autocast("cuda", torch.bfloat16):
        generate(model, list(range(10)), 8, temperature=0)
    names = {event.key for event in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names and not any("cudnn_attention" in n for n in names)


def test_this_gpu_has_a_peak_and_bench_reports_mfu_under_100_percent():
    peak, source = peak_flops(torch.device("cuda"), torch.bfloat16)
    assert peak > 0, source
    load_tokenizer("gpt2")  # bench's tokenization figure needs the offline GPT-2 BPE
    cfg = load_config("tiny", ["train.device=cuda", "train.dtype=bfloat16", "train.compile=false"])
    result = run_bench(cfg, steps=3, warmup=1, reference=False)
    assert result["settings"]["device"].startswith("cuda") and 0 < result["ours"]["mfu"] < 1
