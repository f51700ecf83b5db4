"""Code measures: hidden lines and spans cut documents exactly, the scorer counts a middle only when the model
starts a new line and writes every line of it exactly, function bodies are cut where they dedent, `gptforge eval
--code` reports them, and training logs them at each evaluation for the plot and the report."""

import pytest
import torch

from gptforge.cli import main
from gptforge.config import load_config
from gptforge.eval import code
from gptforge.eval.code import HiddenSpan, body_of, hidden_spans, span_exact_match
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.fim import FIMTokenizer
from gptforge.tokens.tokenizer import load_tokenizer
from gptforge.train.trainer import train

DOCS = [
    "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n",
    "class A:\n    x = 1\n\n    def f(self):\n        return self.x + 1\n",
]


def test_hidden_lines_and_spans_cut_each_document_exactly_and_are_seeded():
    cases = hidden_spans(DOCS, 4, seed=1)
    assert len(cases) == 4 and cases == hidden_spans(DOCS, 4, seed=1)
    for c in cases:
        assert c.prefix + "\n" + c.middle + c.suffix in DOCS and len(c.middle.strip()) >= 8
    assert len(hidden_spans(DOCS, 100, seed=1)) == 5  # every line with 8+ characters but the first and last
    spans = hidden_spans(DOCS, 100, seed=1, lines=2)
    assert [c.middle for c in spans] == [
        "def walk(root):\n    for name in os.listdir(root):",
        "    for name in os.listdir(root):\n        yield name",
        "    def f(self):\n        return self.x + 1",
    ]
    assert all(c.prefix + "\n" + c.middle + c.suffix in DOCS for c in spans)


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
def test_a_middle_counts_only_when_written_exactly(monkeypatch, fim):
    tok = FIMTokenizer(load_tokenizer("gpt2")) if fim else load_tokenizer("gpt2")
    cases = [
        HiddenSpan("def f(x):", "    return x + 1", "\n"),
        HiddenSpan("def g(y):", "    y += 1\n    return y * 2", "\n"),
        HiddenSpan("def h(z):", "    return z", "\n"),
    ]
    answers = {  # what the stub model writes: the right middle with a suffix, a near miss or no newline without,
        # and h's line without its indentation (Python's meaning changes: not exact)
        True: ["    return x + 1\n    ", "    y += 1 \n    return y * 2  \nmore", "return z\n"],
        False: ["\n    return x + 2\n", "    y += 1\n    return y * 2\n", "\nreturn z\n"],
    }

    def fake_generate(model, items, ends, done=lambda item: False):  # writes the answer up to where done() says
        for item in items:
            with_suffix = fim and tok.sentinels.middle in item.prompt
            prompt = tok.decode([i for i in item.prompt if i < 50257])
            text = answers[with_suffix][next(k for k, name in enumerate("fgh") if f"{name}(" in prompt)]
            for token in tok.encode(text):
                item.new.append(token)
                if done(item):
                    break
        return items

    monkeypatch.setattr(code, "generate_batch", fake_generate)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=1, n_embd=8))
    infilled, prefixed = span_exact_match(model, tok, cases, torch.device("cpu"), torch.float32)
    assert (infilled, prefixed) == ((2 if fim else 0), 0)


def test_eval_code_reports_both_measures_and_needs_data(data_dir, tmp_path, capsys):
    train(load_config("tiny", [f"data.path={data_dir}", "train.max_steps=2", "eval.every=0"]), tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--data", str(data_dir), "--code", "3", "--tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "code: infilling exact match, one line n/a (trained without FIM), prefix only" in out
    assert "over 3; 3 lines n/a (trained without FIM), prefix only" in out and "function bodies that parse" in out
    assert main(["eval", str(tmp_path / "run"), "--code", "3"]) == 1
    assert "--code 3: needs --data" in capsys.readouterr().err


def test_training_scores_code_at_each_evaluation_and_the_plot_and_report_show_it(data_dir, tmp_path):
    from gptforge.report.plot import CODE, plot_runs
    from gptforge.report.summary import run_report
    from gptforge.rundir import read_metrics

    run = tmp_path / "run"
    overrides = ["train.max_steps=2", "eval.every=1", "eval.code=2", "data.fim_rate=0.5"]
    train(load_config("tiny", [f"data.path={data_dir}", *overrides]), run)
    records = read_metrics(run)["code"]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert (r["cases"], r["spans"]) == (2, 2) and r["functions"] >= 1
        assert all(0 <= r[k] <= 1 for k in ("infill_exact", "prefix_exact", "span_infill_exact", "parse_rate"))
    plot = plot_runs([run])
    assert CODE in plot.panels and any(a.startswith(f"{CODE}: run bodies that parse") for a in plot.annotations)
    report = run_report(run)
    assert "| code infilling exact match, one line (step 2, 2 held-out cases) |" in report
    assert "| code: sampled function bodies that parse |" in report


def test_the_processes_share_the_cases_each_scored_once_and_the_counts_add_up(data_dir, monkeypatch):
    from gptforge.data.tokenizer import data_tokenizer
    from gptforge.runtime.distributed import DistEnv

    scored, summed = [], []

    def every_middle_infilled(model, tok, cases, *args):
        scored.extend(c.middle for c in cases)
        return len(cases), min(1, len(cases))  # (infilled, prefix only)

    def every_body_parses(model, tok, prompts, *args):
        scored.extend(signature for _, _, signature in prompts)
        return len(prompts)

    def reduce(counts, env):  # what each rank contributes (the sum itself is torch.distributed's)
        summed.append(counts.clone())
        return counts

    monkeypatch.setattr(code, "span_exact_match", every_middle_infilled)
    monkeypatch.setattr(code, "parsed_bodies", every_body_parses)
    monkeypatch.setattr(code, "all_reduce_sum", reduce)
    tok, model = FIMTokenizer(data_tokenizer(data_dir)), GPT(GPTConfig(block_size=64, n_layer=1, n_head=1, n_embd=8))
    alone = code.evaluate_code(model, tok, str(data_dir), 5, torch.device("cpu"), torch.float32)
    everything = list(scored)
    scored.clear()
    for rank in (0, 1):
        code.evaluate_code(model, tok, str(data_dir), 5, torch.device("cpu"), torch.float32, env=DistEnv(rank, rank, 2))
    assert sorted(scored) == sorted(everything) and len(everything) == 5 + 5 + alone.functions > 10
    assert (summed[1][[0, 2, 4]] + summed[2][[0, 2, 4]]).tolist() == summed[0][[0, 2, 4]].tolist()
    assert (alone.infill_exact, alone.prefix_exact, alone.span_infill_exact, alone.parse_rate) == (1.0, 0.2, 1.0, 1.0)
