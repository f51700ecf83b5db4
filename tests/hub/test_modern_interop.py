"""The modern block in Hugging Face: export to Llama/Qwen3/Arcee with logit parity, import back, refusals."""

import json

import pytest
import torch
from tests.helpers import randomize

from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf, import_hf
from gptforge.hub.modern import DEFAULT_ROPE, HF_DEFAULTS
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

MODERN = dict(norm="rmsnorm", position="rotary", rope_theta=500.0, layer_norm_eps=1e-5, mlp="swiglu")
VARIANTS = {  # architecture -> our fields
    "Qwen3ForCausalLM": dict(qk_norm=True, bias=False, tie_embeddings=False),
    "Qwen3ForCausalLM-tied": dict(qk_norm=True, bias=False, tie_embeddings=True),
    "LlamaForCausalLM": dict(qk_norm=False, bias=True, tie_embeddings=False),
    "LlamaForCausalLM-tied": dict(qk_norm=False, bias=False, tie_embeddings=True),
    "ArceeForCausalLM": dict(qk_norm=False, bias=True, tie_embeddings=False, mlp="relu2"),
    "ApertusForCausalLM-tied": dict(qk_norm=True, bias=False, tie_embeddings=True, mlp="relu2"),
}


def modern_model(seed=0, **fields):
    """A tiny random modern model whose norm gains and biases are random too, so a swapped one shows in logits."""
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=64, **{**MODERN, **fields})
    return randomize(GPT(cfg))


def our_logits(model, idx):
    with torch.no_grad():
        return model(idx, all_logits=True)[0]


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_modern_export_matches_transformers_logits_generation_and_imports_back(tmp_path, variant):
    ours = modern_model(**VARIANTS[variant])
    out = export_hf(ours, load_tokenizer("gpt2"), tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(ref).__name__ == variant.split("-")[0] and ref.config.vocab_size == 50257
    idx = torch.randint(0, 50257, (2, 64))
    torch.testing.assert_close(hf_logits(ref, idx), our_logits(ours, idx), atol=1e-4, rtol=1e-4)

    prompt = [15496, 995, 11]
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=50256)
    new = theirs[0, len(prompt) :].tolist()
    new = new[: new.index(50256)] if 50256 in new else new
    assert generate(ours, prompt, 16, temperature=0, eot=50256)[0] == new
    assert transformers.AutoTokenizer.from_pretrained(out)("Hello world")["input_ids"] == [15496, 995]

    back, tokenizer, precision = import_hf(out)
    assert (tokenizer.name, precision) == ("gpt2", "float32") and back.config == ours.config
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        rows = 50257 if name in ("transformer.wte.weight", "lm_head.weight") else None
        assert torch.equal(a[:rows], b[:rows]), name
    assert torch.equal(our_logits(back, idx), our_logits(ours, idx))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_transformers_written_llama_or_qwen3_imports_with_parity(tmp_path, kind):
    torch.manual_seed(1)
    shape = dict(vocab_size=50257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=4, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)
    if kind == "llama":
        config = transformers.LlamaConfig(**shape, attention_bias=True, mlp_bias=True, rope_theta=1e4)
    else:
        config = transformers.Qwen3Config(**shape, rope_theta=1e6, tie_word_embeddings=True)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(1 if p.dim() == 1 else 0, 0.1)
    ref.save_pretrained(tmp_path / "hf")
    model, tokenizer, _ = import_hf(tmp_path / "hf")
    assert tokenizer.name == "gpt2" and model.config.qk_norm == (kind == "qwen3") and model.config.hidden_size == 96
    idx = torch.randint(0, 50257, (2, 40))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(ref, idx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(qk_norm=True, bias=True), "model.bias=true with model.qk_norm=true: Qwen3 and Apertus have no MLP"),
        (dict(mlp="relu2", qk_norm=True, bias=True), "model.bias=true with model.qk_norm=true: Qwen3 and Apertus"),
        (dict(norm="layernorm"), "model.norm=layernorm: Llama/Qwen3 use RMSNorm; export supports gpt2 models"),
        (dict(position="learned"), "model.position=learned: Llama/Qwen3 use rotary positions"),
        (dict(mlp="gelu"), "model.mlp=gelu: Llama/Qwen3 gate their MLP"),
        (dict(norm="layernorm", position="learned", mlp="gelu"), "model.bias=false: GPT2LMHeadModel has biases"),
        (
            dict(norm="layernorm", position="learned", mlp="gelu", bias=True, tie_embeddings=False),
            "model.tie_embeddings=false: GPT2LMHeadModel ties",
        ),
    ],
)
def test_export_refuses_an_option_transformers_has_no_counterpart_for_in_one_line(tmp_path, fields, message):
    model = modern_model(**{"qk_norm": False, "bias": False, "tie_embeddings": True, **fields})
    with pytest.raises(GptforgeError, match=message) as refused:
        export_hf(model, load_tokenizer("gpt2"), tmp_path / "hf")
    assert "\n" not in str(refused.value) and not (tmp_path / "hf").exists()


def test_zero_init_and_dropout_do_not_stop_an_export(tmp_path):
    gpt2 = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=8, zero_init=True, dropout=0.1))
    assert json.loads((export_hf(gpt2, load_tokenizer("gpt2"), tmp_path / "a") / "config.json").read_text())[
        "architectures"
    ] == ["GPT2LMHeadModel"]
    modern = modern_model(zero_init=True, dropout=0.1, **VARIANTS["Qwen3ForCausalLM"])
    config = json.loads((export_hf(modern, load_tokenizer("gpt2"), tmp_path / "b") / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["attention_dropout"] == 0.0


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported \\(grouped-query attention"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), 'rope_type="llama3" is not supported'),
        (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), 'rope_type="linear"'),
        (dict(hidden_act="gelu"), 'hidden_act="gelu" is not supported'),
        (dict(head_dim=32), "head_dim=32 is not supported"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
        (
            dict(model_type="mistral"),
            'model_type "mistral" is not supported \\(expected gpt2, llama, qwen3, arcee, apertus\\)',
        ),
    ],
)
def test_import_refuses_a_llama_config_gptforge_cannot_represent_in_one_line(tmp_path, edit, message):
    export_hf(modern_model(**VARIANTS["LlamaForCausalLM-tied"]), load_tokenizer("gpt2"), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(GptforgeError, match=message) as refused:
        import_hf(tmp_path / "hf")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=true is not supported"),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (
            dict(num_hidden_layers=3, layer_types=["full_attention"] * 3),
            "num_hidden_layers=3, but the weights hold 2 layers",
        ),
        (dict(intermediate_size=64), "weights do not match config.json \\(model.layers.0.mlp.gate_proj.weight"),
    ],
)
def test_import_refuses_a_qwen3_config_that_gptforge_cannot_represent_or_the_weights_contradict(
    tmp_path, edit, message
):
    export_hf(modern_model(**VARIANTS["Qwen3ForCausalLM"]), load_tokenizer("gpt2"), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(GptforgeError, match=message) as refused:
        import_hf(tmp_path / "hf")
    assert "\n" not in str(refused.value)


def test_cli_exports_a_trained_modern_checkpoint_and_imports_it_back(tmp_path, data_dir, capsys):
    from gptforge.config import load_config
    from gptforge.train.trainer import train

    fields = "norm=rmsnorm position=rotary qk_norm=true bias=false tie_embeddings=false mlp=swiglu zero_init=true"
    overrides = [f"data.path={data_dir}", "train.max_steps=4", "checkpoint.every=4"]
    train(load_config("tiny", overrides + [f"model.{f}" for f in fields.split()]), tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    ours, tok, _, _ = load_checkpoint(tmp_path / "run")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(ref).__name__ == "Qwen3ForCausalLM"
    idx = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")[:32]])
    torch.testing.assert_close(hf_logits(ref, idx), our_logits(ours, idx), atol=1e-4, rtol=1e-4)
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    torch.testing.assert_close(our_logits(load_checkpoint(tmp_path / "ckpt")[0], idx), our_logits(ours, idx))
    assert main(["sample", str(tmp_path / "ckpt"), "--prompt", "def", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("--- sample 0\ndef") == 1


def test_lm_eval_scores_an_exported_qwen3_folder_as_we_do(tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    ours = modern_model(**VARIANTS["Qwen3ForCausalLM"])
    tok = load_tokenizer("gpt2")
    export_hf(ours, tok, tmp_path / "hf")
    lm = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=1, dtype="float32")
    context, continuation = "The capital of France is", " Paris, of course."
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    (score, _), *_ = lm.loglikelihood([request])
    ctx, cont = tok.encode(context), tok.encode(continuation)
    logprobs = our_logits(ours, torch.tensor([ctx + cont])).log_softmax(-1)[0, len(ctx) - 1 : -1]
    expected = logprobs.gather(-1, torch.tensor(cont)[:, None]).sum().item()
    assert score == pytest.approx(expected, abs=1e-4)


def test_cli_export_of_a_model_without_counterpart_is_one_line_and_writes_nothing(tmp_path, capsys):
    from gptforge.checkpoint import save_checkpoint
    from gptforge.config import Config

    model = modern_model(mlp="relu2", qk_norm=True, bias=True, tie_embeddings=False)
    ckpt = save_checkpoint(tmp_path / "run", 1, model, None, Config(model=model.config), load_tokenizer("gpt2"))
    capsys.readouterr()
    assert main(["export", str(ckpt), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.bias=true with model.qk_norm=true" in err
    assert not (tmp_path / "hf").exists()


def test_every_shipped_preset_exports_to_a_transformers_architecture():
    from gptforge.config import load_config, preset_names
    from gptforge.hub import modern

    for name in preset_names():
        cfg = load_config(name).model
        assert modern.exports_as_gpt2(cfg) or modern.model_type(cfg) in modern.ARCHITECTURES, name
    assert modern.model_type(load_config("modern-cpu").model) == "apertus"


@pytest.mark.parametrize("kind", HF_DEFAULTS)
def test_what_import_assumes_for_a_missing_key_is_what_transformers_assumes(kind):
    """A config.json may leave keys out: the model we build must then be the one transformers builds."""
    config = transformers.AutoConfig.for_model(kind)
    for key, value in {"rope_theta": 10000.0, **HF_DEFAULTS[kind]}.items():
        assert (config.rope_parameters[key] if key == "rope_theta" else getattr(config, key)) == value, key
    assert config.rope_parameters["rope_type"] == DEFAULT_ROPE.get(kind, {}).get("rope_type", "default")
