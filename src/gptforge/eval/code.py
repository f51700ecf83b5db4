"""Code quality beyond bits per byte, on a prepared folder's held-out code: single-line and multi-line infilling
exact match (HumanEval-infilling's protocol applied to the validation split: hide a line or a span of lines, give
the prefix and the suffix, compare the generated middle) against the same model given the prefix alone, and the
share of sampled function bodies that parse (`ast.parse`), which moves long before HumanEval's pass@k leaves zero
for a small model."""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptforge.data.fim import FIMTokenizer, end_ids
from gptforge.data.shards import read_manifest, read_shard
from gptforge.data.tokenizer import Tokenizer
from gptforge.model.generate import stream
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast

LINE_TOKENS = 48  # a hidden line longer than this counts as missed
BODY_TOKENS = 160
SPAN_LINES = 3  # the lines a multi-line case hides


@dataclass
class HiddenSpan:
    prefix: str
    middle: str
    """One line, or several joined by newlines."""
    suffix: str


@dataclass
class CodeScores:
    cases: int
    infill_exact: float | None
    """Share of hidden lines the model wrote exactly given prefix and suffix (None: trained without FIM, or no
    line to hide)."""
    prefix_exact: float | None
    """The same lines written given the prefix alone (None: no line to hide)."""
    spans: int
    span_infill_exact: float | None
    """As infill_exact, for spans of SPAN_LINES lines."""
    span_prefix_exact: float | None
    functions: int
    parse_rate: float | None
    """Share of sampled function bodies that parse (None: no function in the held-out code)."""


def held_out_documents(data_dir: str, tokenizer: Tokenizer, max_documents: int) -> list[str]:
    """The validation split's first documents, as text (EOT separates documents)."""
    manifest = read_manifest(data_dir)
    vocab = manifest["tokenizer"]["vocab_size"]
    shards = [Path(data_dir) / s["file"] for s in manifest["shards"] if s["split"] == "val"]
    tokens = np.concatenate([read_shard(path, vocab) for path in shards]) if shards else np.zeros(0, np.int64)
    pieces = np.split(tokens, np.flatnonzero(tokens == tokenizer.eot))  # prepare puts EOT before each document
    return [tokenizer.decode(p[p != tokenizer.eot]) for p in pieces if (p != tokenizer.eot).any()][:max_documents]


def hidden_spans(documents: list[str], n: int, seed: int, lines: int = 1) -> list[HiddenSpan]:
    """`n` spans of `lines` consecutive lines (each with at least 8 non-blank characters; never a document's first
    or last line), drawn with `seed` across documents."""
    candidates = []
    for d, doc in enumerate(documents):
        text = doc.split("\n")
        starts = range(1, len(text) - lines)
        candidates += [(d, i) for i in starts if all(len(line.strip()) >= 8 for line in text[i : i + lines])]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(candidates), size=min(n, len(candidates)), replace=False) if candidates else []
    out = []
    for k in sorted(int(p) for p in picks):
        d, i = candidates[k]
        text = documents[d].split("\n")
        middle = "\n".join(text[i : i + lines])
        out.append(HiddenSpan("\n".join(text[:i]), middle, "\n" + "\n".join(text[i + lines :])))
    return out


def _lines(model: GPT, tok: Tokenizer, ids: list[int], ends: set[int], device, dtype, newline: bool, count: int):
    """The first `count` lines of the greedy continuation of `ids`, trailing spaces dropped; with `newline`, the
    lines it writes after starting a new one (None: it did not start one)."""
    new: list[int] = []
    steps = stream(model, ids, count * _line_tokens(model), 1, temperature=0.0, eot=tok.eot)
    while True:
        with autocast(device, dtype):
            nxt = next(steps, None)
        if nxt is None or int(nxt) in ends:
            break
        new.append(int(nxt))
        text = tok.decode(new)
        if (newline and not text.startswith("\n")) or text[int(newline) :].count("\n") >= count:
            break
    text = tok.decode(new)
    if newline and not text.startswith("\n"):
        return None
    return _trimmed(text[int(newline) :], count)


def _trimmed(text: str, count: int) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n")[:count])


def _line_tokens(model: GPT) -> int:
    """Tokens a generated line may take: LINE_TOKENS, or a quarter of a small model's context."""
    return min(LINE_TOKENS, model.config.block_size // 4)


def _fit(tok: Tokenizer, prefix: str, suffix: str, room: int) -> tuple[list[int], list[int]]:
    """The prefix's last and the suffix's first tokens, within `room` tokens together (the prefix gets 3/4)."""
    p, s = tok.encode(prefix), tok.encode(suffix)
    keep_s = min(len(s), room // 4)
    keep_p = min(len(p), room - keep_s)
    return p[len(p) - keep_p :], s[:keep_s]


@torch.no_grad()
def span_exact_match(model: GPT, tok: Tokenizer, cases: list[HiddenSpan], device, dtype) -> tuple[float | None, float]:
    """(with prefix and suffix, with the prefix alone): the share of hidden middles written exactly (trailing
    spaces aside). The first is None for a model trained without FIM. Each prompt is cut as the model saw text in
    training: left to right, the prefix stops before its newline (a byte-level BPE joins it to the indentation
    after it), so the model must start the line; an infill's prefix, suffix and middle are encoded apart, so the
    prefix ends with its newline and the middle is the lines alone."""
    if not cases:
        return None, None
    fim = isinstance(tok, FIMTokenizer)
    ends = end_ids(tok)
    infilled = prefixed = 0
    for case in cases:
        count = case.middle.count("\n") + 1
        room = model.config.block_size - count * _line_tokens(model) - 3
        target = _trimmed(case.middle, count)
        p, _ = _fit(tok, case.prefix, "", room)
        prefixed += _lines(model, tok, p or [tok.eot], ends, device, dtype, newline=True, count=count) == target
        if fim:
            p, s = _fit(tok, case.prefix + "\n", case.suffix, room)
            ids = [tok.sentinels.prefix, *p, tok.sentinels.suffix, *s, tok.sentinels.middle]
            infilled += _lines(model, tok, ids, ends, device, dtype, newline=False, count=count) == target
    return (infilled / len(cases) if fim else None), prefixed / len(cases)


def function_prompts(documents: list[str], n: int) -> list[tuple[str, str]]:
    """Up to `n` (context, def line) pairs: each top-level `def` line of the documents (without its newline, for
    the reason `span_exact_match` gives) with the text before it."""
    out = []
    for doc in documents:
        lines = doc.split("\n")
        for i, line in enumerate(lines):
            if line.startswith("def ") and line.rstrip().endswith(":") and len(out) < n:
                out.append(("\n".join(lines[:i]) + "\n", line.rstrip()))
    return out


def body_of(text: str) -> str:
    """A sampled function body: what follows the `def` line, up to the first non-blank line not indented."""
    lines = text.split("\n")
    end = next((i for i, line in enumerate(lines) if i and line.strip() and not line[0].isspace()), len(lines))
    return "\n".join(lines[:end])


@torch.no_grad()
def parse_rate(model: GPT, tok: Tokenizer, prompts: list[tuple[str, str]], device, dtype, seed: int = 0) -> float:
    """The share of sampled bodies (temperature 0.8) that complete their `def` line into Python that parses."""
    g = torch.Generator(device=device).manual_seed(seed)
    body_tokens = min(BODY_TOKENS, model.config.block_size // 2)
    room = model.config.block_size - body_tokens
    parsed = 0
    for context, signature in prompts:
        head = tok.encode(signature)
        ids = (tok.encode(context)[-max(0, room - len(head)) :] if room > len(head) else []) + head
        with autocast(device, dtype):
            new = [int(t) for t in stream(model, ids, body_tokens, 1, temperature=0.8, eot=tok.eot, generator=g)]
        new = new[: new.index(tok.eot)] if tok.eot in new else new
        try:
            ast.parse(textwrap.dedent(signature + body_of(tok.decode(new))))
            parsed += 1
        except (SyntaxError, ValueError):
            pass
    return parsed / max(1, len(prompts))


def evaluate_code(
    model: GPT, tok: Tokenizer, data_dir: str, n: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> CodeScores:
    """Every measure on the first held-out documents of `data_dir`: `n` hidden lines, `n` hidden spans of
    SPAN_LINES lines and up to `n` functions."""
    documents = held_out_documents(data_dir, tok, max_documents=4 * n)
    lines, spans = hidden_spans(documents, n, seed), hidden_spans(documents, n, seed, lines=SPAN_LINES)
    infill, prefix = span_exact_match(model, tok, lines, device, dtype)
    span_infill, span_prefix = span_exact_match(model, tok, spans, device, dtype)
    functions = function_prompts(documents, n)
    rate = parse_rate(model, tok, functions, device, dtype, seed) if functions else None
    return CodeScores(len(lines), infill, prefix, len(spans), span_infill, span_prefix, len(functions), rate)


def format_code(scores: CodeScores) -> str:
    def exact(infill: float | None, prefix: float | None, what: str) -> str:
        if prefix is None:
            return f"n/a (no held-out {what} to hide)"
        shown = "n/a (trained without FIM)" if infill is None else f"{infill:.1%}"
        return f"{shown}, prefix only {prefix:.1%}"

    parse = "n/a (no functions)" if scores.parse_rate is None else f"{scores.parse_rate:.1%}"
    return (
        f"code: infilling exact match, one line {exact(scores.infill_exact, scores.prefix_exact, 'line')} over "
        f"{scores.cases}; {SPAN_LINES} lines "
        f"{exact(scores.span_infill_exact, scores.span_prefix_exact, 'span')} over {scores.spans} | "
        f"sampled function bodies that parse {parse} of {scores.functions}"
    )
