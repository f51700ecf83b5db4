"""Code measures: hidden lines cut documents exactly, the scorer counts a line only when the model starts a new
line and writes it exactly, function bodies are cut where they dedent, and `gptforge eval --code` reports both."""

import pytest
import torch

from gptforge.cli import main
from gptforge.config import load_config
from gptforge.data.fim import FIMTokenizer
from gptforge.data.tokenizer import load_tokenizer
from gptforge.eval import code
from gptforge.eval.code import HiddenLine, body_of, hidden_lines, line_exact_match
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.train.trainer import train

DOCS = [
    "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n",
    "class A:\n    x = 1\n\n    def f(self):\n        return self.x + 1\n",
]


def test_hidden_lines_cut_each_document_exactly_and_are_seeded():
    cases = hidden_lines(DOCS, 4, seed=1)
    assert len(cases) == 4 and cases == hidden_lines(DOCS, 4, seed=1)
    for c in cases:
        assert c.prefix + "\n" + c.line + c.suffix in DOCS and len(c.line.strip()) >= 8
    assert len(hidden_lines(DOCS, 100, seed=1)) == 5  # every line with 8+ characters but the first and last


def test_every_held_out_document_is_read_whole(data_dir):
    from gptforge.data.shards import read_manifest
    from gptforge.data.tokenizer import data_tokenizer
    from gptforge.eval.code import held_out_documents

    docs = held_out_documents(str(data_dir), data_tokenizer(data_dir), max_documents=1000)
    assert len(docs) == read_manifest(data_dir)["splits"]["val"]["docs"] and all(d.strip() for d in docs)
    assert all(d.startswith(('"""', "import", "def", "class", "#")) for d in docs)  # whole files, from their start


def test_a_body_ends_where_the_code_dedents():
    assert body_of("\n    return 1\n\n    # done\nprint(2)\n") == "\n    return 1\n\n    # done"
    assert body_of("  # same line\n    pass") == "  # same line\n    pass"


@pytest.mark.parametrize("fim", [False, True])
def test_a_line_counts_only_when_written_exactly(monkeypatch, fim):
    tok = FIMTokenizer(load_tokenizer("gpt2")) if fim else load_tokenizer("gpt2")
    cases = [HiddenLine("def f(x):", "    return x + 1", "\n"), HiddenLine("def g(y):", "    return y * 2", "\n")]
    answers = {  # what the stub model writes: the right middle with a suffix, a near miss or no newline without
        True: ["    return x + 1\n    ", "    return y * 2  \n"],
        False: ["\n    return x + 2\n", "    return y * 2\n"],
    }

    def fake_stream(model, ids, *args, **kwargs):
        with_suffix = fim and tok.sentinels.middle in ids
        text = answers[with_suffix][int("g(" in tok.decode([i for i in ids if i < 50257]))]
        yield from (torch.tensor([t]) for t in tok.encode(text))

    monkeypatch.setattr(code, "stream", fake_stream)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=1, n_embd=8))
    infill, prefix = line_exact_match(model, tok, cases, torch.device("cpu"), torch.float32)
    assert prefix == 0.0 and infill == (1.0 if fim else None)


def test_eval_code_reports_both_measures_and_needs_data(data_dir, tmp_path, capsys):
    train(load_config("tiny", [f"data.path={data_dir}", "train.max_steps=2", "eval.every=0"]), tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--data", str(data_dir), "--code", "3", "--tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "single-line infilling exact match n/a (trained without FIM), prefix only" in out
    assert "over 3 held-out lines | sampled function bodies that parse" in out
    assert main(["eval", str(tmp_path / "run"), "--code", "3"]) == 1
    assert "--code 3: needs --data" in capsys.readouterr().err
