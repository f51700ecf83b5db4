"""`gptforge import` of a folder edited by hand: each bad file, value or tensor is one line naming it, before anything
is allocated, and nothing is written; what it imports computes in the precision its weights are stored in.

The folders come from our own export, so these run without transformers."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.hub.convert import export_hf
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer

SHAPE = dict(block_size=32, n_layer=1, n_head=2, n_embd=16)
QWEN3 = dict(norm="rmsnorm", position="rotary", qk_norm=True, bias=False, tie_embeddings=False, mlp="swiglu")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A GPT-2 and a Qwen3 folder as our export writes them (GPT-2's tokenizer files, float32 weights)."""
    root = tmp_path_factory.mktemp("exported")
    torch.manual_seed(0)
    for name, fields in (("gpt2", {}), ("qwen3", QWEN3)):
        export_hf(GPT(GPTConfig(**SHAPE, **fields)), load_tokenizer("gpt2"), root / name)
    return root


def folder(exported, tmp_path, kind, edit=None):
    hf = shutil.copytree(exported / kind, tmp_path / "hf")
    if edit:
        edit(hf)
    return hf


def config(**changes):
    def edit(hf):
        path = hf / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def write(name, text):
    return lambda hf: (hf / name).write_text(text)


def tensors(change):
    """Rewrite model.safetensors with `change` applied to its dict of tensors."""

    def edit(hf):
        weights = load_file(hf / "model.safetensors")
        change(weights)
        save_file(weights, hf / "model.safetensors")

    return edit


def weights_elsewhere(name_for):
    """Move the weights out of the folder, beside it, and name them there: by an index entry or a link."""

    def edit(hf):
        outside = hf.parent / "elsewhere" / "model.safetensors"
        outside.parent.mkdir()
        (hf / "model.safetensors").rename(outside)
        name = name_for(hf, outside)
        if name is not None:
            (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))

    return edit


def no_vocab(text):
    """Only a tokenizer.json (as transformers 5 writes), holding `text`."""
    return lambda hf: ((hf / "vocab.json").unlink(), (hf / "merges.txt").unlink(), write("tokenizer.json", text)(hf))


def first(weights, change):
    key = sorted(weights)[0]
    weights[key] = change(weights[key])


REFUSED = {  # case -> (folder, edit, what the one line says)
    "hidden_act list": ("qwen3", config(hidden_act=["silu"]), r'hidden_act=\["silu"\] is not supported'),
    "tie_word_embeddings object": ("qwen3", config(tie_word_embeddings={}), "tie_word_embeddings={} is not supported"),
    "head_dim list": ("qwen3", config(head_dim=[16]), r"head_dim=\[16\] is not supported"),
    "layer_types mixed": ("qwen3", config(layer_types=[1, "full_attention"]), r'layer_types=\[1, "full_attention"\]'),
    "rms_norm_eps null": ("qwen3", config(rms_norm_eps=None), r"rms_norm_eps=null \(expected a positive number\)"),
    "rms_norm_eps string": ("qwen3", config(rms_norm_eps="1e-5"), r'rms_norm_eps="1e-5" \(expected a positive number'),
    "context null": ("qwen3", config(max_position_embeddings=None), "max_position_embeddings=null"),
    "context of 4 TB": (
        "qwen3",
        config(max_position_embeddings=10**12),
        r"max_position_embeddings=1000000000000 \(expected an integer in \[1, 1048576\]\)",
    ),
    "context 32.5": ("qwen3", config(max_position_embeddings=32.5), r"max_position_embeddings=32.5 \(expected a pos"),
    "gpt2 context 32.5": ("gpt2", config(n_positions=32.5), r"n_positions=32.5 \(expected a positive integer\)"),
    "gpt2 epsilon string": ("gpt2", config(layer_norm_epsilon="x"), 'layer_norm_epsilon="x"'),
    "gpt2 n_inner list": ("gpt2", config(n_inner=[64]), r"n_inner=\[64\] is not supported"),
    "gpt2 width of 2**40": ("gpt2", config(n_embd=2**40, n_head=1), r"n_embd=1099511627776 \(expected an integer in"),
    "gpt2 16k layers": ("gpt2", config(n_layer=2**14), "n_layer=16384, but the weights hold 1 layers"),
    "vocab_size 0": ("qwen3", config(vocab_size=0), r"vocab_size=0 \(expected a positive integer\)"),
    "bool as a number": ("qwen3", config(hidden_size=True), r"hidden_size=true \(expected a positive integer\)"),
    "heads not dividing": ("qwen3", config(num_attention_heads=3), "num_attention_heads=3 does not divide hidden_size"),
    "rope_theta negative": ("qwen3", config(rope_parameters={"rope_theta": -1.0}), "rope_parameters.rope_theta=-1.0"),
    "rope_theta whose table is NaN": (
        "qwen3",
        config(rope_parameters={"rope_theta": 1e-300}),
        r"rope_parameters.rope_theta=1e-300 \(expected a number >= 1\)",
    ),
    "rope_scaling beside rope_parameters": (
        "qwen3",
        config(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
        'rope_scaling.rope_type="yarn" is not supported',
    ),
    "rope per layer type": (
        "qwen3",
        config(rope_parameters={"full_attention": {"rope_theta": 5.0}}),
        'rope_parameters has "full_attention"',
    ),
    "apertus leaving out its rope": (
        "qwen3",
        config(model_type="apertus", hidden_act="relu2", architectures=["ApertusForCausalLM"], rope_parameters=None),
        'rope_parameters.rope_type="llama3" is not supported',  # transformers' default for apertus: scaled
    ),
    "torch_dtype list": ("qwen3", config(torch_dtype=["float32"]), r'torch_dtype=\["float32"\], but the weights'),
    "model_type list": ("qwen3", config(model_type=["qwen3"]), r'model_type \["qwen3"\] is not supported'),
    "a classifier": ("gpt2", config(architectures=["GPT2ForSequenceClassification"]), "architectures="),
    "config.json a list": ("qwen3", write("config.json", "[]"), r"config.json: a JSON list \(expected an object"),
    "config.json not JSON": ("gpt2", write("config.json", "{"), "config.json: not JSON"),
    "config.json huge integer": ("gpt2", write("config.json", "9" * 5000), "config.json: not JSON"),
    "vocab.json not JSON": ("qwen3", write("vocab.json", "{"), "vocab.json: not JSON"),
    "vocab.json a list": ("gpt2", write("vocab.json", "[1, 2]"), r"vocab.json: a JSON list \(expected an object"),
    "vocab.json of strings": ("gpt2", write("vocab.json", '{"a": "x"}'), "vocab.json: not GPT-2's vocabulary"),
    "merges.txt garbage": ("gpt2", write("merges.txt", "#version: 0.2\n\x00 garbage\n"), "merges.txt: not GPT-2's"),
    "tokenizer.json a list": ("qwen3", no_vocab("[1]"), r"tokenizer.json: a JSON list"),
    "tokenizer.json wrong model": ("qwen3", no_vocab('{"model": [1]}'), "tokenizer.json: not a tokenizer file"),
    "index leaving the folder": (
        "qwen3",
        weights_elsewhere(lambda hf, outside: "../elsewhere/model.safetensors"),
        'weight_map entry "lm_head.weight" names "../elsewhere/model.safetensors", which leads outside',
    ),
    "index naming an absolute path": (
        "gpt2",
        weights_elsewhere(lambda hf, outside: str(outside)),
        "which leads outside",
    ),
    "index naming a link out": (
        "qwen3",
        weights_elsewhere(lambda hf, outside: os.symlink(outside, hf / "shard.safetensors") or "shard.safetensors"),
        'names "shard.safetensors", which leads outside',
    ),
    "weights a link out": (
        "gpt2",
        weights_elsewhere(lambda hf, outside: os.symlink(outside, hf / "model.safetensors")),
        "model.safetensors: a link to .*, outside",
    ),
    "int64 weights": (
        "qwen3",
        tensors(lambda w: first(w, torch.Tensor.long)),
        r"lm_head.weight is int64 \(expected float32, bfloat16 or float16",
    ),
    "bool weights": ("gpt2", tensors(lambda w: first(w, lambda t: t > 0)), "is bool"),
    "bf16 under float32": (
        "qwen3",
        tensors(lambda w: w.update({k: v.bfloat16() for k, v in w.items()})),
        'torch_dtype="float32", but the weights are stored in bfloat16',
    ),
    "gpt2 bf16 under float32": (
        "gpt2",
        tensors(lambda w: w.update({k: v.bfloat16() for k, v in w.items()})),
        'torch_dtype="float32", but the weights are stored in bfloat16',
    ),
    "a missing tensor": ("qwen3", tensors(lambda w: w.pop("model.norm.weight")), r"\(missing model.norm.weight\)"),
    "an extra tensor": ("gpt2", tensors(lambda w: w.update(extra=torch.zeros(2))), r"\(unexpected extra\)"),
    "grouped keys under a config without": (
        "qwen3",
        tensors(lambda w: w.update({k: v[:8] for k, v in w.items() if "k_proj" in k})),
        r"k_proj.weight has shape \(8, 16\), config.json makes it \(16, 16\)",
    ),
    "truncated weights": (
        "gpt2",
        lambda hf: (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-100]),
        "model.safetensors: unreadable weights",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_hand_edited_folder_is_refused_in_one_line_naming_what_and_writing_nothing(exported, tmp_path, capsys, case):
    kind, edit, message = REFUSED[case]
    hf = folder(exported, tmp_path, kind, edit)
    assert main(["import", str(hf), "--out", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gptforge import: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "ckpt").exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    export_hf(GPT(GPTConfig(**SHAPE, vocab_size=100)), load_tokenizer("gpt2"), tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 1
    assert "vocab_size=100, but the tokenizer (gpt2) has 50,257 tokens" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
@pytest.mark.parametrize("declared", [None, "bfloat16"])
def test_bf16_weights_compute_in_bfloat16_with_their_values_kept(exported, tmp_path, kind, declared):
    hf = folder(exported, tmp_path, kind, tensors(lambda w: w.update({k: v.bfloat16() for k, v in w.items()})))
    config(torch_dtype=declared)(hf)
    assert main(["import", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    model, _, cfg, _ = load_checkpoint(tmp_path / "ckpt")
    assert cfg.train.dtype == "bfloat16"
    stored = load_file(hf / "model.safetensors")
    name = "transformer.h.0.ln_1.weight" if kind == "gpt2" else "model.layers.0.input_layernorm.weight"
    ours = model.state_dict()["transformer.h.0.ln_1.weight"]
    assert ours.dtype == torch.float32 and torch.equal(ours, stored[name].float())


def test_nan_weights_import_with_a_warning_naming_them(exported, tmp_path, capsys):
    hf = folder(exported, tmp_path, "qwen3", tensors(lambda w: w["model.norm.weight"].fill_(float("nan"))))
    assert main(["import", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    err = capsys.readouterr().err
    assert "gptforge import: warning: " in err and "NaN or infinite values (the first: model.norm.weight)" in err


def test_shards_inside_the_folder_and_a_hugging_face_cache_snapshot_import(exported, tmp_path):
    """Links are followed where they stay inside: a snapshot's files link to its repo's blobs/."""
    repo = tmp_path / "models--me--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in (exported / "qwen3").iterdir():
        shutil.copyfile(path, repo / "blobs" / f"sha-{path.name}")
        (snapshot / path.name).symlink_to(f"../../blobs/sha-{path.name}")
    assert main(["import", str(snapshot), "--out", str(tmp_path / "from-cache")]) == 0

    hf = folder(exported, tmp_path, "gpt2")
    weights = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    (hf / "shards").mkdir()
    names = {}
    for i, key in enumerate(sorted(weights)):
        names[key] = f"shards/part-{i % 2}.safetensors"
    for shard in set(names.values()):
        save_file({k: v for k, v in weights.items() if names[k] == shard}, hf / shard)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    assert main(["import", str(hf), "--out", str(tmp_path / "sharded")]) == 0
    model = load_checkpoint(tmp_path / "sharded")[0]
    assert torch.equal(
        model.state_dict()["transformer.h.0.attn.c_attn.weight"], weights["transformer.h.0.attn.c_attn.weight"].t()
    )
