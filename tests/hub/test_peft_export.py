"""A LoRA run exported as a PEFT adapter: peft loads it onto the base beside it with our logits; merged, too."""

import copy

import pytest
import torch

from gptforge.data.chat.template import with_chat
from gptforge.data.tokenizer import GPT2Tokenizer
from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf
from gptforge.hub.peft_export import export_peft
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.lora import LoRASpec, apply_lora, merge_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SPEC = LoRASpec(rank=4, alpha=8, dropout=0.0, targets=("attn.c_attn", "attn.c_proj", "mlp.c_proj"))


def lora_model(**arch):
    torch.manual_seed(0)
    tok = with_chat(GPT2Tokenizer())
    model = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, **arch)).eval()
    apply_lora(model, SPEC)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, tok


def test_peft_loads_the_adapter_onto_its_base_with_our_logits(tmp_path):
    model, tok = lora_model()
    idx = torch.randint(0, tok.vocab_size, (2, 16))
    with torch.no_grad():
        ours = model(idx, all_logits=True)[0]
    out = export_peft(model, tok, SPEC, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    with torch.no_grad():
        plain = base(idx).logits
        theirs = peft.PeftModel.from_pretrained(base, out).eval()(idx).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (plain - ours).abs().max() > 1e-2  # the adapters matter: the base alone computes something else


def test_a_merged_export_computes_what_the_adapted_model_does(tmp_path):
    model, tok = lora_model()
    idx = torch.randint(0, tok.vocab_size, (2, 16))
    with torch.no_grad():
        ours = model(idx, all_logits=True)[0]
    out = export_hf(merge_lora(copy.deepcopy(model)), tok, tmp_path / "merged")
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(idx).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_an_adapter_of_the_modern_block_or_a_run_without_one_is_refused(tmp_path):
    model, tok = lora_model(position="rotary", norm="rmsnorm", bias=False, tie_embeddings=False, mlp="relu2")
    with pytest.raises(GptforgeError, match="only the GPT-2 block exports as an adapter"):
        export_peft(model, tok, SPEC, tmp_path / "a")
    plain = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(GptforgeError, match="no adapters"):
        export_peft(plain, tok, SPEC, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_peft_folder_named_like_a_gguf_file_is_refused(tmp_path, capsys):
    from gptforge.cli import main

    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "a.gguf")]) == 1
    assert "a.gguf: a .gguf name for a Hugging Face folder; add --format gguf" in capsys.readouterr().err
