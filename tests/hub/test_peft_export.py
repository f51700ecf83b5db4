"""A LoRA run exported as a PEFT adapter: peft loads it onto the base beside it with our logits; merged, too."""

import copy
import json
from pathlib import Path

import pytest
import torch

from gptforge.checkpoint import write_checkpoint
from gptforge.config import Config, TrainConfig
from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf
from gptforge.hub.peft_export import export_peft
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.lora import TARGETS, LoRASpec, apply_lora, merge_lora
from gptforge.tokens.chat import with_chat
from gptforge.tokens.tokenizer import GPT2Tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SPEC = LoRASpec(rank=4, alpha=8, dropout=0.0, targets=("attn.c_attn", "attn.c_proj", "mlp.c_proj"))
EVERY = LoRASpec(rank=4, alpha=8, dropout=0.0, targets=TARGETS)  # alpha / r = 2: a wrong scaling shows
MODERN = dict(position="rotary", norm="rmsnorm", bias=False, tie_embeddings=False)
ARCHS = {  # HF architecture -> our fields: relu2's c_fc is one layer there, swiglu's two (gate|up)
    "gpt2": dict(),
    "arcee": dict(MODERN, mlp="relu2"),
    "qwen3": dict(MODERN, mlp="swiglu", qk_norm=True),
}


def lora_model(spec=SPEC, **arch):
    torch.manual_seed(0)
    tok = with_chat(GPT2Tokenizer())
    model = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, **arch)).eval()
    apply_lora(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, tok


def assert_peft_computes(model, out):
    """PEFT's model from the folder `out` gives `model`'s logits; its base alone does not."""
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        ours = model(idx, all_logits=True)[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    with torch.no_grad():
        plain = base(idx).logits
        theirs = peft.PeftModel.from_pretrained(base, out).eval()(idx).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (plain - ours).abs().max() > 1e-2  # the adapters matter: the base alone computes something else


@pytest.mark.parametrize("spec", [SPEC, EVERY], ids=["some", "every"])
@pytest.mark.parametrize("arch", ARCHS.values(), ids=ARCHS.keys())
def test_peft_loads_the_adapter_onto_its_base_with_our_logits(tmp_path, arch, spec):
    model, tok = lora_model(spec, **arch)
    assert_peft_computes(model, export_peft(model, tok, spec, tmp_path / "adapter"))


def test_the_modern_block_s_fused_layers_are_adapted_as_hugging_face_s_pieces(tmp_path):
    model, tok = lora_model(EVERY, **ARCHS["qwen3"])
    config = json.loads((export_peft(model, tok, EVERY, tmp_path / "a") / "adapter_config.json").read_text())
    attn = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    assert config["target_modules"] == [*attn, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert config["fan_in_fan_out"] is False  # nn.Linear, (out, in), unlike GPT-2's Conv1D


def test_a_merged_export_computes_what_the_adapted_model_does(tmp_path):
    model, tok = lora_model()
    idx = torch.randint(0, tok.vocab_size, (2, 16))
    with torch.no_grad():
        ours = model(idx, all_logits=True)[0]
    out = export_hf(merge_lora(copy.deepcopy(model)), tok, tmp_path / "merged")
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(idx).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_a_run_without_adapters_is_refused(tmp_path):
    tok = GPT2Tokenizer()
    plain = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(GptforgeError, match="no adapters"):
        export_peft(plain, tok, SPEC, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_export_format_peft_writes_a_modern_lora_run_s_adapters(tmp_path, capsys):
    from gptforge.cli import main

    model, tok = lora_model(EVERY, **ARCHS["arcee"])
    train = TrainConfig(init_from="base", lora_rank=4, lora_alpha=8, lora_targets=",".join(TARGETS))
    write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001", model, None,
                     Config(model=model.config, train=train), tok, {"step": 1})  # fmt: skip
    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert f"wrote {tmp_path / 'peft'}" in capsys.readouterr().out
    assert_peft_computes(model, tmp_path / "peft")


def test_a_peft_folder_named_like_a_gguf_file_is_refused(tmp_path, capsys):
    from gptforge.cli import main

    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "a.gguf")]) == 1
    assert "a.gguf: a .gguf name for a Hugging Face folder; add --format gguf" in capsys.readouterr().err


def test_the_adapter_names_its_base_by_path_so_auto_peft_loads_it_from_anywhere(tmp_path, monkeypatch):
    """'base_model_name_or_path': 'base' sent AutoPeftModel from any other folder to a Hub repo named base."""
    model, tok = lora_model()
    out = export_peft(model, tok, SPEC, tmp_path / "adapter")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # not the adapter's folder: a relative 'base' would not be found
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, tok.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, model(idx, all_logits=True)[0], rtol=1e-4, atol=1e-4)


def test_the_base_path_is_where_the_base_lands_through_links(tmp_path, monkeypatch):
    """`--out self` (a link to the current folder, replaced by the swap) and `deep/../x` (deep a link elsewhere)
    named a base where there was none."""
    model, tok = lora_model()
    here, away = tmp_path / "here", tmp_path / "away" / "inner"
    here.mkdir()
    away.mkdir(parents=True)
    (here / "self").symlink_to(".")
    (here / "deep").symlink_to(away)
    monkeypatch.chdir(here)
    for out, base in (("deep/../x", tmp_path / "away" / "x" / "base"), ("self", here / "base")):  # self goes
        export_peft(model, tok, SPEC, out)
        named_base = Path(json.loads((base.parent / "adapter_config.json").read_text())["base_model_name_or_path"])
        assert named_base == base and (named_base / "model.safetensors").is_file()
