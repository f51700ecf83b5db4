"""Code quality beyond bits per byte, on a prepared folder's held-out code: single-line infilling exact match
(HumanEval-infilling's protocol applied to the validation split: hide a line, give the prefix and the suffix,
compare the generated line) against the same model given the prefix alone, and the share of sampled function
bodies that parse (`ast.parse`), which moves long before HumanEval's pass@k leaves zero for a small model."""

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


@dataclass
class HiddenLine:
    prefix: str
    line: str
    suffix: str


@dataclass
class CodeScores:
    cases: int
    infill_exact: float | None
    """Share of hidden lines the model wrote exactly given prefix and suffix (None: trained without FIM, or no
    line to hide)."""
    prefix_exact: float | None
    """The same lines written given the prefix alone (None: no line to hide)."""
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


def hidden_lines(documents: list[str], n: int, seed: int) -> list[HiddenLine]:
    """`n` lines (each with at least 8 non-blank characters, not the first), drawn with `seed` across documents."""
    candidates = []
    for d, doc in enumerate(documents):
        lines = doc.split("\n")
        candidates += [(d, i) for i in range(1, len(lines) - 1) if len(lines[i].strip()) >= 8]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(candidates), size=min(n, len(candidates)), replace=False) if candidates else []
    out = []
    for k in sorted(int(p) for p in picks):
        d, i = candidates[k]
        lines = documents[d].split("\n")
        out.append(HiddenLine("\n".join(lines[:i]), lines[i], "\n" + "\n".join(lines[i + 1 :])))
    return out


def _line(model: GPT, tok: Tokenizer, ids: list[int], ends: set[int], device, dtype, newline: bool) -> str | None:
    """The first line of the greedy continuation of `ids`; with `newline`, the line it writes after starting a new
    one (None: it did not start one)."""
    new: list[int] = []
    steps = stream(model, ids, _line_tokens(model), 1, temperature=0.0, eot=tok.eot)
    while True:
        with autocast(device, dtype):
            nxt = next(steps, None)
        if nxt is None or int(nxt) in ends:
            break
        new.append(int(nxt))
        text = tok.decode(new)
        if (newline and not text.startswith("\n")) or "\n" in text[int(newline) :]:
            break
    text = tok.decode(new)
    if newline and not text.startswith("\n"):
        return None
    return text[int(newline) :].split("\n", 1)[0].rstrip()


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
def line_exact_match(model: GPT, tok: Tokenizer, cases: list[HiddenLine], device, dtype) -> tuple[float | None, float]:
    """(with prefix and suffix, with the prefix alone): the share of hidden lines written exactly (trailing
    spaces aside). The first is None for a model trained without FIM. Each prompt is cut as the model saw text in
    training: left to right, the prefix stops before its newline (a byte-level BPE joins it to the indentation
    after it), so the model must start the line; an infill's prefix, suffix and middle are encoded apart, so the
    prefix ends with its newline and the middle is the line alone."""
    room = model.config.block_size - _line_tokens(model) - 3
    fim = isinstance(tok, FIMTokenizer)
    ends = end_ids(tok)
    infilled = prefixed = 0
    for case in cases:
        target = case.line.rstrip()
        p, _ = _fit(tok, case.prefix, "", room)
        prefixed += _line(model, tok, p or [tok.eot], ends, device, dtype, newline=True) == target
        if fim:
            p, s = _fit(tok, case.prefix + "\n", case.suffix, room)
            ids = [tok.sentinels.prefix, *p, tok.sentinels.suffix, *s, tok.sentinels.middle]
            infilled += _line(model, tok, ids, ends, device, dtype, newline=False) == target
    if not cases:
        return None, None
    return (infilled / len(cases) if fim else None), prefixed / len(cases)


def function_prompts(documents: list[str], n: int) -> list[tuple[str, str]]:
    """Up to `n` (context, def line) pairs: each top-level `def` line of the documents (without its newline, for
    the reason `hidden_lines` gives) with the text before it."""
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
    """Both measures on the first held-out documents of `data_dir`: `n` hidden lines and up to `n` functions."""
    documents = held_out_documents(data_dir, tok, max_documents=4 * n)
    cases = hidden_lines(documents, n, seed)
    infill, prefix = line_exact_match(model, tok, cases, device, dtype)
    functions = function_prompts(documents, n)
    rate = parse_rate(model, tok, functions, device, dtype, seed) if functions else None
    return CodeScores(len(cases), infill, prefix, len(functions), rate)


def format_code(scores: CodeScores) -> str:
    if scores.prefix_exact is None:
        infill = prefix = "n/a (no held-out line to hide)"
    else:
        infill = "n/a (trained without FIM)" if scores.infill_exact is None else f"{scores.infill_exact:.1%}"
        prefix = f"{scores.prefix_exact:.1%}"
    parse = "n/a (no functions)" if scores.parse_rate is None else f"{scores.parse_rate:.1%}"
    return (
        f"code: single-line infilling exact match {infill}, prefix only {prefix} over "
        f"{scores.cases} held-out lines | sampled function bodies that parse {parse} of {scores.functions}"
    )
