"""`gptforge eval --lm-eval`: lm-evaluation-harness scores the checkpoint on local YAML tasks, beside our HellaSwag,
and its acc / acc_norm pick what an independent transformers computation picks (acc_norm: per character)."""

import json

import pytest
import torch
from tests.eval.test_hellaswag import hf_predictions, write_examples

from gptforge.checkpoint import write_checkpoint
from gptforge.cli import main
from gptforge.config import Config
from gptforge.eval.suite import format_results
from gptforge.hub.convert import export_hf
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub at run time, and datasets' cache in the test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)).eval()
    cfg = Config(model=model.config)
    cfg.train.dtype = "float32"
    tok = load_tokenizer("gpt2")
    return model, tok, write_checkpoint(tmp_path / "ckpt", model, None, cfg, tok, {"step": 7, "tokens": 0})


def test_lm_eval_tasks_are_scored_beside_ours_and_agree_with_transformers(tmp_path, offline, capsys):
    model, tok, ckpt = tiny_checkpoint(tmp_path)
    hf_dir = export_hf(model, tok, tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    examples = write_examples(tmp_path / "probe.jsonl")
    by_sum, _, by_char = hf_predictions(ref, transformers.AutoTokenizer.from_pretrained(hf_dir), examples)
    assert by_sum != by_char  # the two criteria disagree somewhere, so each check below means something
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, labels in (("gf_sum", by_sum), ("gf_char", by_char)):
        write_examples(tmp_path / f"{name}.jsonl", labels=labels)
        (tasks / f"{name}.yaml").write_text(TASK.format(name=name, data=tmp_path / f"{name}.jsonl"))

    args = ["eval", str(ckpt), "--hellaswag", str(tmp_path / "gf_char.jsonl"), "--json"]
    assert main([*args, "--lm-eval", "gf_sum,gf_char", "--include-path", str(tasks)]) == 0
    result = json.loads(capsys.readouterr().out)  # lm-eval printed nothing into the JSON
    lm = result["lm_eval"]
    assert lm["gf_sum"]["acc"] == 1.0 and lm["gf_sum"]["acc_norm"] < 1.0 and lm["gf_sum"]["n"] == 12
    assert lm["gf_char"]["acc_norm"] == 1.0 and lm["gf_char"]["acc"] < 1.0
    # Our per-character normalisation is lm-eval's acc_norm; the per-token one is another number.
    hs = result["hellaswag"]
    assert hs["acc_norm_char"] == 1.0 and hs["acc_norm_token"] < 1.0 and hs["acc"] == lm["gf_char"]["acc"]
    lines = format_results(result).splitlines()
    assert lines[0].startswith("step 7 hellaswag: acc ") and "acc_norm_char 1.0000 over 12 examples" in lines[0]
    assert lines[2].startswith("step 7 lm-eval gf_char: acc ") and "| acc_norm 1.0000 ± " in lines[2]


def test_lm_eval_flags_are_checked_before_the_model_loads(tmp_path, offline, capsys):
    _, _, ckpt = tiny_checkpoint(tmp_path)
    cases = [
        (["--lm-eval", "gf_nope", "--include-path", str(tmp_path)], "unknown task(s) ['gf_nope'] for lm-eval"),
        (["--lm-eval", "gf_nope", "--include-path", str(tmp_path / "missing")], "missing: no such folder"),
        (["--include-path", str(tmp_path)], "only used with --lm-eval TASKS"),
        (["--lm-eval", ",,", "--include-path", str(tmp_path)], "--lm-eval: no task named (expected comma-separated"),
        (["--lm-eval", "", "--data", str(tmp_path)], "--lm-eval: no task named"),
    ]
    for flags, message in cases:
        assert main(["eval", str(ckpt), *flags]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gptforge eval: error: --") and message in err[0], err
