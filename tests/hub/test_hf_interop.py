"""Hugging Face interop: logit parity after import and export, round trips, tokenizer files, publishing."""

import dataclasses
import json
import subprocess

import pytest
import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf, import_hf
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")


def hf_model(vocab_size=50257, seed=0, **kw):
    torch.manual_seed(seed)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, **kw}
    cfg = transformers.GPT2Config(vocab_size=vocab_size, bos_token_id=50256, eos_token_id=50256, **shape)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the parity test see every tensor
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def our_logits(model, idx):
    """Full-sequence logits: score every position against dummy targets."""
    with torch.no_grad():
        logits, _ = model(idx, all_logits=True)
    return logits


@pytest.mark.parametrize("safetensors", [True, False])
def test_import_matches_transformers_logits(tmp_path, safetensors):
    ref = hf_model(seed=1)
    if safetensors:
        ref.save_pretrained(tmp_path / "hf")
    else:
        (tmp_path / "hf").mkdir()
        ref.config.to_json_file(tmp_path / "hf" / "config.json")
        state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
        torch.save(state, tmp_path / "hf" / "pytorch_model.bin")
    model, tokenizer, _ = import_hf(tmp_path / "hf")
    assert tokenizer.name == "gpt2" and model.config.padded_vocab_size == 50304
    idx = torch.randint(0, 50257, (2, 40))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(ref, idx), atol=1e-4, rtol=1e-4)


def test_export_loads_in_transformers_with_equal_logits_and_round_trips(tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=64)).eval()
    out = export_hf(ours, load_tokenizer("gpt2"), tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, 50257, (2, 64))
    torch.testing.assert_close(hf_logits(ref, idx), our_logits(ours, idx), atol=1e-4, rtol=1e-4)
    assert ref.config.vocab_size == 50257  # padding dropped
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Hello world")["input_ids"] == [15496, 995] and tok.eos_token_id == 50256

    back, tokenizer, _ = import_hf(out)
    assert tokenizer.name == "gpt2"
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        if name in ("transformer.wte.weight", "lm_head.weight"):
            a, b = a[:50257], b[:50257]
        assert torch.equal(a, b), name


def test_trained_tokenizer_exports_and_imports(tmp_path):
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 30
    tok = train_bpe(texts, 300, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16)).eval()
    out = export_hf(ours, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(texts[0])["input_ids"] == tok.encode(texts[0])
    assert hf_tok.eos_token_id == tok.eot
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.tensor([tok.encode(texts[0] + texts[1])[:32]])
    torch.testing.assert_close(hf_logits(ref, idx), our_logits(ours, idx), atol=1e-4, rtol=1e-4)

    assert main(["import", str(out), "--out", str(tmp_path / "ckpt")]) == 0
    model, ckpt_tok, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert ckpt_tok.encode(texts[1]) == tok.encode(texts[1])
    torch.testing.assert_close(our_logits(model, idx), our_logits(ours, idx))


def test_unsupported_hf_variant_is_refused(tmp_path):
    hf_model(activation_function="relu").save_pretrained(tmp_path / "hf")
    with pytest.raises(GptforgeError, match='activation_function="relu" is not supported'):
        import_hf(tmp_path / "hf")
    with pytest.raises(GptforgeError, match="no config.json"):
        import_hf(tmp_path)


def test_cli_import_then_export_then_sample(tmp_path, capsys):
    hf_model(seed=2).save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "again")]) == 0
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    idx = torch.randint(0, 50257, (1, 30))
    torch.testing.assert_close(hf_logits(a, idx), hf_logits(b, idx), atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "ckpt"), "--prompt", "Hello", "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("--- sample 0\nHello")


def git(*args, cwd=None):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=120).stdout


def test_a_push_remote_that_looks_like_an_option_is_taken_as_a_remote(tmp_path):
    from gptforge.hub.git import push_folder

    (tmp_path / "f").mkdir()
    with pytest.raises(GptforgeError, match="git clone failed: fatal: repository '--upload-pack=touch x' does not"):
        push_folder(tmp_path / "f", "--upload-pack=touch x", "main", "m")


def test_export_push_commits_one_branch_per_run(tmp_path):
    remote = tmp_path / "models.git"
    git("init", "--quiet", "--bare", str(remote))
    torch.manual_seed(0)
    from gptforge.checkpoint import save_checkpoint
    from gptforge.config import Config

    cfg = Config(model=GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=1, n_embd=8))
    model = GPT(cfg.model)
    tok = load_tokenizer("gpt2")
    for step in (1, 2):
        ckpt = save_checkpoint(tmp_path / "run-a", step, model, None, cfg, tok)
        args = ["export", str(ckpt), "--out", str(tmp_path / f"hf{step}"), "--push", str(remote)]
        assert main(args) == 0
    log = git("log", "--format=%s", "run-a", cwd=remote).split()
    assert log == ["step", "2", "step", "1"]
    clone = tmp_path / "clone"
    git("clone", "--quiet", "--branch", "run-a", str(remote), str(clone))
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= {p.name for p in clone.iterdir()}
    assert json.loads((clone / "config.json").read_text())["n_embd"] == 8


@pytest.mark.slow
def test_real_124m_shape_imports_with_parity(tmp_path):
    ref = hf_model(n_layer=12, n_head=12, n_embd=768, n_positions=1024)
    ref.save_pretrained(tmp_path / "hf")
    model, _, _ = import_hf(tmp_path / "hf")
    assert model.num_params() == 124_439_808
    idx = torch.randint(0, 50257, (1, 128))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(ref, idx), atol=1e-4, rtol=1e-4)


def test_training_starts_from_an_imported_model(tmp_path, data_dir):
    from gptforge.config import load_config
    from gptforge.eval.loss import evaluate_loss
    from gptforge.train.trainer import train

    hf_model(seed=3, n_positions=32).save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    imported, _, _, _ = load_checkpoint(tmp_path / "ckpt")
    expected = evaluate_loss(imported, data_dir, 4, 32, 512, torch.device("cpu"), torch.float32)["loss"]
    # model.n_layer=5 must lose: the checkpoint's model section replaces the preset's.
    cfg = load_config(
        "tiny",
        [f"data.path={data_dir}", f"train.init_from={tmp_path / 'ckpt'}", "train.max_steps=2", "model.n_layer=5"],
    )
    result = train(cfg, tmp_path / "run")
    assert result.config.model.n_layer == 2
    assert result.first_val["loss"] == pytest.approx(expected, abs=1e-6)


def test_an_explicit_architecture_set_that_init_from_would_replace_is_refused(tmp_path, data_dir, capsys):
    hf_model(seed=3, n_positions=32).save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    common = ["train", "--config", "tiny", "--data", str(data_dir), "--set", f"train.init_from={tmp_path / 'ckpt'}"]
    capsys.readouterr()
    assert main([*common, "--set", "model.n_layer=5", "--out", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "--set model.n_layer=5" in err and "its n_layer is 2" in err and err.count("\n") == 1
    assert not (tmp_path / "refused").exists()
    # The checkpoint's own value and the run's own options (dropout) are accepted, and dropout is the run's.
    run = ["--set", "model.n_layer=2", "--set", "model.dropout=0.25", "--set", "train.max_steps=1"]
    assert main([*common, *run, "--out", str(tmp_path / "run")]) == 0
    assert "dropout = 0.25" in (tmp_path / "run" / "config.toml").read_text()


def test_init_from_with_another_tokenizer_is_refused(tmp_path, data_dir):
    from gptforge.config import load_config
    from gptforge.train.trainer import train

    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 300, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16))
    export_hf(model, tok, tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    cfg = load_config("tiny", [f"data.path={data_dir}", f"train.init_from={tmp_path / 'ckpt'}"])
    with pytest.raises(GptforgeError) as refused:
        train(cfg, tmp_path / "run")
    assert str(refused.value) == (
        f"{data_dir}: made with tokenizer gpt2 (50,257 tokens), but train.init_from={tmp_path / 'ckpt'} uses "
        f"tokenizer.json ({tok.vocab_size:,} tokens); "
        f"prepare the data with --tokenizer {tmp_path / 'ckpt' / 'tokenizer.json'}"
    )


def test_training_pushes_every_checkpoint(tmp_path, data_dir):
    from gptforge.config import load_config
    from gptforge.train.trainer import train

    remote = tmp_path / "models.git"
    git("init", "--quiet", "--bare", str(remote))
    cfg = load_config(
        "tiny", [f"data.path={data_dir}", "train.max_steps=4", "checkpoint.every=2", f"checkpoint.push={remote}"]
    )
    train(cfg, tmp_path / "run-b")
    assert git("log", "--format=%s", "run-b", cwd=remote).splitlines() == ["step 4", "step 2"]
    shown = git("show", "run-b:config.json", cwd=remote)
    assert json.loads(shown)["n_layer"] == 2


def test_export_and_import_never_destroy_a_folder(tmp_path, capsys):
    hf_model(seed=2).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["import", str(tmp_path / "hf"), "--out", str(run / "checkpoints" / "step_000000")]) == 0
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    refused = [
        (["export", str(run), "--out", str(run), "--force"], "which this command reads"),  # the run read from
        (["export", str(run), "--out", str(tmp_path), "--force"], "which this command reads"),  # a parent of it
        (["import", str(tmp_path / "hf"), "--out", str(tmp_path / "hf"), "--force"], "which this command reads"),
        (["export", str(run), "--out", str(tmp_path / "hf")], "exists and is not empty; pick another folder"),
        (["import", str(tmp_path / "hf"), "--out", str(run)], "is a gptforge run"),
        (["import", str(tmp_path / "hf"), "--out", str(run), "--force"], "is a gptforge run"),  # a checkpoint only
    ]
    for args, message in refused:
        assert main(args) == 1
        assert message in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "stale.txt").write_text("x")
    assert main(["export", str(run), "--out", str(tmp_path / "old"), "--force"]) == 0
    assert (tmp_path / "old" / "config.json").is_file()
    assert not (tmp_path / "old" / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.pop("n_embd"), r"no n_embd \(expected a positive integer\)"),
        (lambda c: c.update(n_head=3), "model.n_head=3 must divide model.n_embd=32"),
        (lambda c: c.update(n_layer=3), "weights do not match config.json"),
        (
            lambda c: c.update(n_positions=128),
            r"weights do not match config.json \(transformer.wpe.weight has shape \(64, 32\), "
            r"config.json makes it \(128, 32\)",
        ),
    ],
)
def test_an_hf_config_that_does_not_describe_the_weights_is_one_line(tmp_path, edit, message):
    hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    edit(config)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(GptforgeError, match=message):
        import_hf(tmp_path / "hf")


def test_greedy_sampling_of_an_import_continues_like_transformers(tmp_path, capsys):
    ref = hf_model(seed=3)
    ref.save_pretrained(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert load_checkpoint(tmp_path / "ckpt")[2].train.dtype == "float32"  # the precision it came in
    prompt = [15496, 995, 11]  # "Hello world,"
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=50256)
    tok = load_tokenizer("gpt2")
    texts = []
    for flags in (["--temperature", "0"], ["--top-k", "1"], ["--top-k", "1", "--seed", "7"]):
        capsys.readouterr()
        args = ["sample", str(tmp_path / "ckpt"), "--prompt", tok.decode(prompt), "--max-new-tokens", "12"]
        assert main([*args, *flags]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2]  # one greedy path, whatever flag asks for it, and no randomness
    new = expected[0, len(prompt) :].tolist()
    eot = new.index(50256) if 50256 in new else len(new)  # our sampler stops at EOT, as generate would with eos
    assert texts[0] == f"--- sample 0\n{tok.decode(prompt)}{tok.decode(new[:eot])}\n"


def test_import_keeps_layer_norm_epsilon_and_knows_gpt2_from_a_tokenizer_json(tmp_path):
    ref = hf_model(seed=4, layer_norm_epsilon=1e-2)
    ref.save_pretrained(tmp_path / "hf")
    gpt2 = transformers.GPT2TokenizerFast.from_pretrained(str(export_tokenizer_folder(tmp_path / "tok")))
    gpt2.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "vocab.json").unlink(missing_ok=True)  # what transformers 5 writes: tokenizer.json only
    (tmp_path / "hf" / "merges.txt").unlink(missing_ok=True)
    model, tokenizer, _ = import_hf(tmp_path / "hf")
    assert tokenizer.name == "gpt2" and model.config.layer_norm_eps == 1e-2
    idx = torch.randint(0, 50257, (1, 20))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(ref, idx), atol=1e-5, rtol=1e-5)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "add_cross_attention": True}))
    with pytest.raises(GptforgeError, match="add_cross_attention=true is not supported"):
        import_hf(tmp_path / "hf")


def export_tokenizer_folder(folder):
    """GPT-2's vocab.json + merges.txt, as our export writes them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=8))
    return export_hf(model, load_tokenizer("gpt2"), folder)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]), "unreadable"),
        (lambda d: (d / "model.safetensors").write_bytes(bytes(range(256)) * 100), "unreadable weights"),
        (lambda d: d.joinpath("model.safetensors").rename(d / "pytorch_model.bin"), "unreadable weights"),
        (
            lambda d: d.joinpath("config.json").write_text(
                d.joinpath("config.json").read_text().replace('"vocab_size": 50257', '"vocab_size": 100')
            ),
            "weights do not match config.json",
        ),
    ],
)
def test_damaged_hf_weights_are_one_line(tmp_path, damage, message):
    hf_model().save_pretrained(tmp_path / "hf")
    damage(tmp_path / "hf")
    with pytest.raises(GptforgeError, match=message):
        import_hf(tmp_path / "hf")


def test_a_fim_export_imports_as_a_fim_model(tmp_path):
    """export -> import keeps a FIM model one (its sentinels declared past the vocabulary; it came back as a model
    `sample --suffix` and serve's infill refused)."""
    from gptforge.hub.publish import import_checkpoint
    from gptforge.model.generate import generate
    from gptforge.tokens.chat import with_chat
    from gptforge.tokens.fim import infill_prompt, with_fim
    from gptforge.tokens.tokenizer import GPT2Tokenizer

    torch.manual_seed(0)
    tok = with_fim(GPT2Tokenizer(), 0.5)
    model = GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)).eval()
    import_checkpoint(export_hf(model, tok, tmp_path / "hf"), tmp_path / "back")
    back, back_tok, cfg, _ = load_checkpoint(tmp_path / "back")
    assert cfg.data.fim_rate > 0 and back_tok.sentinels == tok.sentinels
    prompt = infill_prompt(tok, "def add(a, b):\n", "\n    return c\n")
    assert generate(back, prompt, 8, temperature=0.0) == generate(model, prompt, 8, temperature=0.0)
    both = with_chat(tok)  # a FIM model's chat tokens come after its sentinels: both are found again
    wider = GPT(dataclasses.replace(model.config, vocab_size=both.vocab_size))
    import_checkpoint(export_hf(wider, both, tmp_path / "hf2"), tmp_path / "both")
    cfg = load_checkpoint(tmp_path / "both")[2]
    assert cfg.data.fim_rate > 0 and cfg.data.chat_template == "chatml"
    import_checkpoint(export_hf(model, GPT2Tokenizer(), tmp_path / "plain"), tmp_path / "base")
    assert load_checkpoint(tmp_path / "base")[2].data.fim_rate == 0  # no sentinels declared: no FIM
