"""Fine-tuning on conversations, fully or with LoRA: the loss on the replies falls, the base stays frozen under
LoRA with optimizer state for the adapters alone, a resume is exact and 2 gloo processes give 1 process's run."""

import json
import shutil
import subprocess

import pytest
import torch
from tests.helpers import losses
from tests.train.test_distributed import ENV, TIMEOUT, torchrun

from gptforge.checkpoint import latest_checkpoint, load_checkpoint
from gptforge.config import config_from_dict, load_config, to_dict
from gptforge.data.chat.prepare import ChatSettings, prepare_chat
from gptforge.errors import GptforgeError
from gptforge.rundir import read_metrics
from gptforge.train.trainer import train

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]


def base_config(data_dir):
    """A 4-step pretraining of the tiny model: a base to fine-tune."""
    return load_config("tiny", [f"data.path={data_dir}", "train.max_steps=4", "eval.every=0", "eval.sample_tokens=0"])


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    """The tiny base on the test corpus (GPT-2 tokens) that every test here fine-tunes."""
    run = tmp_path_factory.mktemp("base") / "run"
    train(base_config(data_dir), run)
    return latest_checkpoint(run)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """Conversations whose replies follow from their requests: repeat the words asked for, in reverse."""
    folder = tmp_path_factory.mktemp("chat")
    rows = []
    for i in range(160):
        asked = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(2 + i % 3)]
        messages = [{"role": "user", "content": "reverse: " + " ".join(asked)}]
        messages.append({"role": "assistant", "content": " ".join(reversed(asked))})
        rows.append(json.dumps({"messages": messages}))
    (folder / "chats.jsonl").write_text("\n".join(rows) + "\n")
    prepare_chat(str(folder / "chats.jsonl"), folder / "data", ChatSettings(val_fraction=0.2, dedup=_no_dedup()))
    return folder / "data"


def _no_dedup():
    from gptforge.data.clean.dedup import DedupSettings

    return DedupSettings(mode="none")


def tune(chat_dir, base, *overrides):
    settings = [f"data.path={chat_dir}", f"train.init_from={base}", "eval.every=3", "eval.sample_tokens=0"]
    return load_config("tiny", [*settings, "train.max_steps=6", "optim.warmup_steps=1", *overrides])


def test_fine_tuning_on_conversations_lowers_the_replies_loss_and_makes_a_chat_model(chat_dir, base, tmp_path):
    train(tune(chat_dir, base), tmp_path / "full")
    model, tok, cfg, _ = load_checkpoint(tmp_path / "full")
    assert cfg.data.chat_template == "chatml" and cfg.model.document_token == tok.eot == 50256
    assert (tok.im_start, tok.im_end, cfg.model.vocab_size) == (50257, 50258, 50259)
    val = losses(tmp_path / "full", "val")
    assert val.keys() == {0, 3, 6} and val[6] < val[0] - 0.5  # the replies follow from the requests: learned


def test_lora_trains_the_adapters_alone_and_its_state_is_theirs(chat_dir, base, tmp_path, capsys):
    train(tune(chat_dir, base, "train.lora_rank=4", "optim.lr=1e-2"), tmp_path / "lora")
    out = capsys.readouterr().out
    assert "LoRA: rank 4 (alpha 16) on 8 layers; 4,096 trainable parameters" in out, out
    ckpt = latest_checkpoint(tmp_path / "lora")
    tuned = load_checkpoint(ckpt, merge=False)[0].state_dict()
    start = load_checkpoint(base)[0].state_dict()
    assert all(torch.equal(tuned[name], start[name]) for name in start)  # the base is frozen
    adapters = [name for name in tuned if ".lora_" in name]
    assert len(adapters) == 16 and all(tuned[n].abs().sum() > 0 for n in adapters if "lora_B" in n)
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(state["state"]) == 16  # AdamW's moments for the adapters alone
    val = losses(tmp_path / "lora", "val")
    assert val[6] < val[0]  # a 4-step base learns little through rank-4 adapters in 6 steps, but it does
    merged = load_checkpoint(ckpt)[0]  # inference: the adapters folded into the weights
    assert not any(".lora_" in n for n in merged.state_dict())


def test_lora_dropout_changes_what_the_adapters_learn_and_nothing_else(chat_dir, base, tmp_path):
    runs = {}
    for p in (0.0, 0.5):
        run, settings = tmp_path / f"p{p}", ("train.lora_rank=4", "optim.lr=1e-2", "train.max_steps=3")
        train(tune(chat_dir, base, *settings, f"train.lora_dropout={p}"), run)
        runs[p] = (losses(run), load_checkpoint(latest_checkpoint(run), merge=False)[0].state_dict())
    (plain, plain_w), (dropped, dropped_w) = runs[0.0], runs[0.5]
    assert plain[1] == dropped[1]  # B starts at zero: the first step's forward is the base's, dropout or not
    assert plain[2] != dropped[2] and plain[3] != dropped[3]  # the first update saw a dropped-out input
    adapters = [n for n in plain_w if ".lora_" in n]
    assert len(adapters) == 16 and not any(torch.equal(plain_w[n], dropped_w[n]) for n in adapters if "lora_B" in n)
    assert all(torch.equal(plain_w[n], dropped_w[n]) for n in plain_w if ".lora_" not in n)  # the base is frozen


def test_new_tokens_past_the_padding_get_fresh_rows_and_a_tied_table_stays_one():
    from gptforge.model.gpt import GPTConfig
    from gptforge.train.finetune import fit_vocabulary

    table = torch.randn(64, 8)
    weights = {"transformer.wte.weight": table, "lm_head.weight": table, "ln_f.weight": torch.ones(8)}
    grown = fit_vocabulary(weights, GPTConfig(vocab_size=66, n_embd=8, vocab_multiple=64))
    assert grown["transformer.wte.weight"] is grown["lm_head.weight"] and grown["lm_head.weight"].shape == (128, 8)
    assert torch.equal(grown["lm_head.weight"][:64], table) and 0.01 < grown["lm_head.weight"][64:].std() < 0.03
    assert fit_vocabulary(weights, GPTConfig(vocab_size=64, n_embd=8, vocab_multiple=64))["lm_head.weight"] is table


def test_a_lora_run_resumes_exactly(chat_dir, base, tmp_path):
    settings = ("train.lora_rank=4", "train.max_steps=4", "checkpoint.every=2", "model.dropout=0.1")
    own_base = shutil.copytree(base, tmp_path / "base")
    train(tune(chat_dir, own_base, *settings, "train.lora_dropout=0.1"), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000004")
    shutil.rmtree(own_base)  # a resume needs its own checkpoint alone: the base may be gone by then
    train(tune(chat_dir, own_base, *settings, "train.lora_dropout=0.1"), tmp_path / "b", resume="auto")
    assert [r["step"] for r in read_metrics(tmp_path / "b", kinds=("resume",))["resume"]] == [2]
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert a[3] == b[3] and a[4] == b[4]
    wa, wb = (load_checkpoint(r, merge=False)[0].state_dict() for r in (tmp_path / "a", tmp_path / "b"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    with pytest.raises(GptforgeError, match=rf"^train.init_from='{base}': the run started from '{own_base}', and a"):
        train(tune(chat_dir, base, *settings, "train.max_steps=6"), tmp_path / "b", resume="auto")  # another base


@pytest.mark.slow
def test_two_gloo_processes_fine_tune_with_lora_as_one_process(chat_dir, base, tmp_path):
    lora = ("train.lora_rank=4", f"train.init_from={base}")
    for launcher, out in ((["--nproc-per-node", "1"], "one"), (["--nproc-per-node", "2"], "two")):
        run = subprocess.run(  # 512 tokens a step: 1 process x 4 micro-batches, or 2 x 2
            torchrun(["--standalone", *launcher], chat_dir, tmp_path / out, *lora),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=TIMEOUT,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == set(range(1, 7))
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)
    wa, wb = (load_checkpoint(r, merge=False)[0].state_dict() for r in (tmp_path / "one", tmp_path / "two"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_chat_run_and_its_base_disagreeing_on_fim_is_refused():
    from gptforge.train.finetune import check_fim

    base = load_config("tiny", ["data.fim_rate=0.5"])
    run = load_config("tiny", ["train.init_from=base"])
    with pytest.raises(GptforgeError, match="train.init_from=base: trained with data.fim_rate=0.5, this run with 0"):
        check_fim(run, base, "chatml")
    check_fim(run, base, "")  # no template: the sentinels are FIM's alone
    check_fim(load_config("tiny", ["data.fim_rate=0.5"]), base, "chatml")


def test_conversations_with_fim_on_either_side_are_refused():
    """A chat folder's template ids are the two past the vocabulary, FIM's first sentinels to a FIM model: trained
    as such they taught <|fim_prefix|> as a turn's start, and serving's prompts used ids never trained."""
    from gptforge.train.finetune import template_name

    chat, plain = [{"chat": {"template": "chatml", "special_tokens": ["<|im_start|>", "<|im_end|>"]}}], [{}]
    fim = load_config("tiny", ["data.fim_rate=0.5"])
    with pytest.raises(GptforgeError, match=r"data.fim_rate=0.5: conversations \(prepare --chat\) are not trained"):
        template_name(fim, [*plain, *chat], None)  # a mix with a chat folder too
    with pytest.raises(GptforgeError, match="train.init_from=base: trained with data.fim_rate=0.5; a FIM model is"):
        template_name(load_config("tiny", ["train.init_from=base"]), chat, fim)
    assert template_name(fim, plain, None) == "" and template_name(load_config("tiny"), chat, None) == "chatml"


def test_a_fine_tuning_computes_in_the_precision_its_base_learned_in(chat_dir, base, monkeypatch):
    import json as json_

    from gptforge.runtime.distributed import SINGLE
    from gptforge.train.setup import resolve_precision

    meta = json_.loads((base / "meta.json").read_text())
    assert meta["config"]["train"]["dtype"] == "float32"  # the tiny preset's
    monkeypatch.setattr("gptforge.train.setup.resolve_dtype", lambda *a: torch.bfloat16)  # this machine would pick bf16
    cfg = tune(chat_dir, base, "train.dtype=auto")
    resolved = resolve_precision(cfg, torch.device("cpu"), SINGLE, None)
    assert resolved.train.dtype == "float32"


def test_a_chat_model_stays_one_on_plain_data_and_lora_values_are_checked():
    from gptforge.errors import GptforgeError
    from gptforge.train.finetune import template_name

    chat_base = load_config("tiny", ["data.chat_template=chatml"])
    plain = load_config("tiny", ["train.init_from=base"])
    assert template_name(plain, [{"tokenizer": {}}], chat_base) == "chatml"  # inherited from the base
    assert template_name(plain, [{"tokenizer": {}}], load_config("tiny")) == ""
    lora = ["train.init_from=base", "train.lora_rank=4"]
    for bad, says in (("train.lora_dropout=1", r"in \[0, 1\)"), ("train.lora_rank=-1", r"in \[0, 4096\]")):
        with pytest.raises(GptforgeError, match=f"{bad.split('=')[0]}=.*{says}"):
            load_config("tiny", [*lora, bad])


def test_a_lora_rank_past_the_layers_width_and_an_overflowing_alpha_are_refused():
    from gptforge.errors import GptforgeError
    from gptforge.model.gpt import GPT
    from gptforge.train.finetune import adapt

    lora = ["train.init_from=base", "train.lora_rank=33"]  # the tiny model is 32 wide
    with pytest.raises(GptforgeError, match=r"train.lora_rank=33: past the width of .*use at most 32"):
        adapt(GPT(load_config("tiny").model), load_config("tiny", lora))
    full = load_config("tiny", [*lora, "train.lora_rank=32"])
    assert adapt(GPT(full.model), full).startswith("LoRA: rank 32 ")
    with pytest.raises(GptforgeError, match=r"train.lora_alpha=1e\+300 \(expected in \(0, 65536\]\)"):
        load_config("tiny", [*lora, "train.lora_alpha=1e300"])  # alpha / rank overflowed: every step skipped


@pytest.mark.parametrize("setting", ["train.lora_alpha=32", "train.lora_dropout=0.1", "train.lora_targets=mlp.c_fc"])
def test_a_lora_setting_without_a_rank_is_refused_naming_it(setting):
    with pytest.raises(GptforgeError, match=rf"^{setting} has no effect without train.lora_rank \(0: every weight"):
        load_config("tiny", [setting])
    saved = to_dict(load_config("tiny", [setting, "train.lora_rank=4", "train.init_from=base"]))
    assert config_from_dict(saved).train.lora_rank == 4  # a LoRA run's saved config resumes
    older = to_dict(load_config("tiny"))
    key = setting.split("=")[0].removeprefix("train.")
    older["train"][key] = saved["train"][key]  # accepted, and ignored, before
    older["checkpoint"]["async_save"] = True
    assert config_from_dict(older).train.lora_rank == 0  # its checkpoints still load (serve, export, eval)
    assert load_config("tiny", ["train.init_from=base"]).train.lora_rank == 0  # a full fine-tune
