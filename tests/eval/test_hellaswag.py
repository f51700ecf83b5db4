"""HellaSwag scoring: equal to an independent computation with the exported transformers model."""

import json
import os
import random

import pytest
import torch
from tests.helpers import read_fifo

from gptforge.errors import GptforgeError
from gptforge.eval.hellaswag import evaluate_hellaswag, read_examples
from gptforge.hub.convert import export_hf
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
WORDS = [
    "the",
    "a",
    "man",
    "woman",
    "dog",
    "ball",
    "runs",
    "jumps",
    "over",
    "under",
    "table",
    "kitchen",
    "slowly",
    "quickly",
    "then",
    "and",
]


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize()


def write_examples(path, n=12, labels=None):
    rng = random.Random(0)
    rows = []
    for i in range(n):
        ex = {
            "ctx": sentence(rng, rng.randint(5, 14)),
            "endings": [sentence(rng, rng.randint(2, 9)) for _ in range(4)],
            "label": labels[i] if labels else 0,
        }
        rows.append(ex)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def hf_predictions(model, tok, examples):
    """Independent scoring: per ending, the sum of its tokens' log-loss given the context, per token, per character."""
    by_sum, by_mean, by_char = [], [], []
    for ex in examples:
        ctx = tok(ex["ctx"])["input_ids"]
        sums, means = [], []
        for ending in ex["endings"]:
            end = tok(" " + ending)["input_ids"]
            ids = torch.tensor([ctx + end])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            token_logp = logp[torch.arange(len(ctx) - 1, len(ctx) + len(end) - 1), torch.tensor(end)]
            sums.append(-token_logp.sum().item())
            means.append(-token_logp.mean().item())
        by_sum.append(min(range(4), key=sums.__getitem__))
        by_mean.append(min(range(4), key=means.__getitem__))
        by_char.append(min(range(4), key=lambda j: sums[j] / len(ex["endings"][j])))  # lm-eval's acc_norm
    return by_sum, by_mean, by_char


def test_acc_and_both_normalisations_match_transformers(tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32)).eval()
    tok = load_tokenizer("gpt2")
    hf_dir = export_hf(ours, tok, tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    examples = write_examples(tmp_path / "h.jsonl")
    by_sum, by_mean, by_char = hf_predictions(ref, hf_tok, examples)
    assert (
        len({tuple(by_sum), tuple(by_mean), tuple(by_char)}) == 3
    )  # the criteria disagree: each check means something

    cpu = torch.device("cpu")
    write_examples(tmp_path / "sum.jsonl", labels=by_sum)
    result = evaluate_hellaswag(
        ours, tok, read_examples(str(tmp_path / "sum.jsonl")), cpu, torch.float32, batch_examples=5
    )
    assert result["acc"] == 1.0 and result["acc_norm_token"] < 1.0 and result["n"] == 12
    write_examples(tmp_path / "mean.jsonl", labels=by_mean)
    result = evaluate_hellaswag(ours, tok, read_examples(str(tmp_path / "mean.jsonl"), limit=10), cpu, torch.float32)
    assert result["acc_norm_token"] == 1.0 and result["acc"] < 1.0 and result["n"] == 10
    write_examples(tmp_path / "char.jsonl", labels=by_char)
    result = evaluate_hellaswag(ours, tok, read_examples(str(tmp_path / "char.jsonl")), cpu, torch.float32)
    assert result["acc_norm_char"] == 1.0 and result["acc_norm_token"] < 1.0 and result["acc"] < 1.0


def test_bad_hellaswag_file(tmp_path):
    (tmp_path / "h.jsonl").write_text('{"ctx": "x", "endings": ["a", "b"], "label": 0}\n')
    with pytest.raises(GptforgeError, match=r"h\.jsonl:1: expected a HellaSwag record: .*endings a list of 4"):
        read_examples(str(tmp_path / "h.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(GptforgeError, match=r"empty\.jsonl: no HellaSwag examples"):
        read_examples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(GptforgeError, match="cannot read"):
        read_examples(str(tmp_path / "missing.jsonl"))


def test_training_scores_hellaswag_at_each_evaluation(data_dir, tmp_path):
    from gptforge.config import load_config
    from gptforge.train.trainer import train

    write_examples(tmp_path / "h.jsonl", n=6, labels=[0, 1, 2, 3, 0, 1])
    cfg = load_config(
        "tiny",
        [
            f"data.path={data_dir}",
            "train.max_steps=4",
            "eval.every=2",
            f"eval.hellaswag={tmp_path / 'h.jsonl'}",
            "eval.hellaswag_limit=5",
        ],
    )
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    hs = [r for r in records if r["kind"] == "hellaswag"]
    assert [r["step"] for r in hs] == [0, 2, 4] and all(r["n"] == 5 and 0 <= r["acc_norm_token"] <= 1 for r in hs)


def test_hf_hellaswag_reads_the_validation_split_of_a_local_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "hs" / "data").mkdir(parents=True)
    rows = {"ctx": ["A man", "A dog"], "endings": [["a", "b", "c", "d"]] * 2, "label": ["2", "0"]}
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "hs" / "data" / "validation-00000-of-00001.parquet")
    examples = read_examples(f"hf:{tmp_path / 'hs'}", limit=1)
    assert examples == [{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}]


GOOD = {"ctx": "def add(a, b):", "endings": [" return a + b", " pass", " x", " y"], "label": 0}


@pytest.mark.parametrize(
    "change",
    [
        {"ctx": None},
        {"ctx": 5},
        {"ctx": ["a"]},
        {"ctx": "\ud800"},  # a lone surrogate, as JSON's escape makes it
        {"endings": [1, 2, 3, 4]},
        {"endings": [None, "a", "b", "c"]},
        {"endings": {"a": 1, "b": 2, "c": 3, "d": 4}},  # was read as four endings
        {"endings": "abcd"},  # so was this
        {"endings": ["a", "b", "c", "\ud800"]},
        {"label": 1.9},  # was read as 1
        {"label": True},
        {"label": " 2 "},
        {"label": "\u0663"},  # an Arabic-Indic 3
        {"label": 4},
        {"endings": ["", "", "", ""]},  # four ties scored the first: 100%
        {"endings": ["a", " ", "c", "d"]},
        {"ctx": ""},
    ],
)
def test_a_malformed_hellaswag_row_is_one_line_naming_it(tmp_path, change):
    """Such rows were a TypeError or OverflowError traceback, or read as something else."""
    (tmp_path / "h.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, **change}) + "\n")
    with pytest.raises(GptforgeError, match=r"h\.jsonl:2: expected a HellaSwag record: ctx text, endings a list"):
        read_examples(str(tmp_path / "h.jsonl"))
    (tmp_path / "h.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "label": "1"}) + "\n")
    assert [e["label"] for e in read_examples(str(tmp_path / "h.jsonl"))] == [0, 1]


def test_a_fifo_as_the_examples_file_is_refused_not_waited_on(tmp_path):
    """A named pipe blocked `eval --hellaswag` (and training's eval.hellaswag) forever."""
    fifo = tmp_path / "h.jsonl"
    os.mkfifo(fifo)
    error = read_fifo(read_examples, str(fifo))
    assert isinstance(error, GptforgeError), error
    assert str(error) == f"--hellaswag {fifo}: not a regular file (expected a file to read)"
    error = read_fifo(lambda path: read_examples(path, flag="eval.hellaswag"), str(fifo))
    assert str(error) == f"eval.hellaswag {fifo}: not a regular file (expected a file to read)"
