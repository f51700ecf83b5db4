"""Code quality beyond bits per byte, on a prepared folder's held-out code: single-line and multi-line infilling
exact match (HumanEval-infilling's protocol applied to the validation split: hide a line or a span of lines, give
the prefix and the suffix, compare the generated middle) against the same model given the prefix alone, and the
share of sampled function bodies that parse (`ast.parse`), which moves long before HumanEval's pass@k leaves zero
for a small model."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptforge.data.shards import read_manifest, read_shard
from gptforge.model.generate import Generation, Sampling, generate_batch
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum
from gptforge.tasks.reply import parsed
from gptforge.tokens.fim import FIMTokenizer, end_ids
from gptforge.tokens.tokenizer import Tokenizer

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
    """The validation split's first documents, as text (EOT comes before each), reading only the shards they are
    in: shards end at document boundaries."""
    manifest = read_manifest(data_dir)
    vocab = manifest["tokenizer"]["vocab_size"]
    documents: list[str] = []
    for shard in (s for s in manifest["shards"] if s["split"] == "val"):
        tokens = read_shard(Path(data_dir) / shard["file"], vocab)
        for piece in np.split(tokens, np.flatnonzero(tokens == tokenizer.eot)):
            piece = piece[piece != tokenizer.eot]
            if len(piece) and len(documents) < max_documents:
                documents.append(tokenizer.decode(piece))
        if len(documents) >= max_documents:
            break
    return documents


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


@dataclass
class Middle:
    """One greedy continuation to read lines from: with `newline`, the lines written after starting a new one."""

    item: Generation
    newline: bool
    count: int

    def done(self, tok: Tokenizer) -> bool:
        text = tok.decode(self.item.new)
        return (self.newline and not text.startswith("\n")) or text[int(self.newline) :].count("\n") >= self.count

    def lines(self, tok: Tokenizer) -> str | None:
        """Its first `count` lines, trailing spaces dropped (None: with `newline`, it did not start a line)."""
        text = tok.decode(self.item.new)
        if self.newline and not text.startswith("\n"):
            return None
        return _trimmed(text[int(self.newline) :], self.count)


def _middle(model: GPT, ids: list[int], newline: bool, count: int) -> Middle:
    """A greedy continuation of `ids` that stops where the context does: an infill's window keeps its sentinels."""
    ids = ids[-model.config.block_size :]
    budget = min(_middle_tokens(model, count), model.config.block_size - len(ids) + 1)
    return Middle(Generation(ids, budget), newline, count)


def _written(model: GPT, tok: Tokenizer, middles: list[Middle], device, dtype) -> list[str | None]:
    """The lines of every middle, generated together."""
    by_item = {id(m.item): m for m in middles}
    with autocast(device, dtype):
        generate_batch(model, [m.item for m in middles], end_ids(tok), done=lambda item: by_item[id(item)].done(tok))
    return [m.lines(tok) for m in middles]


def _trimmed(text: str, count: int) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n")[:count])


def _middle_tokens(model: GPT, count: int) -> int:
    """Tokens a hidden middle of `count` lines may take: LINE_TOKENS a line, at most half a small model's context
    (a longer middle counts as missed)."""
    return max(1, min(count * LINE_TOKENS, model.config.block_size // 2))


def _fit(tok: Tokenizer, prefix: str, suffix: str, room: int) -> tuple[list[int], list[int]]:
    """The prefix's last and the suffix's first tokens, within `room` tokens together (the prefix gets 3/4)."""
    p, s = tok.encode(prefix), tok.encode(suffix)
    room = max(0, room)
    keep_s = min(len(s), room // 4)
    keep_p = min(len(p), room - keep_s)
    return p[len(p) - keep_p :], s[:keep_s]


def span_exact_match(model: GPT, tok: Tokenizer, cases: list[HiddenSpan], device, dtype) -> tuple[int, int]:
    """(with prefix and suffix, with the prefix alone): how many hidden middles the model wrote exactly (trailing
    spaces aside); the first is 0 for a model trained without FIM. Each prompt is cut as the model saw text in
    training: left to right, the prefix stops before its newline (a byte-level BPE joins it to the indentation
    after it), so the model must start the line; an infill's prefix, suffix and middle are encoded apart, so the
    prefix ends with its newline and the middle is the lines alone."""
    fim = isinstance(tok, FIMTokenizer)
    prefixed, infilled, targets = [], [], []
    for case in cases:
        count = case.middle.count("\n") + 1
        room = model.config.block_size - _middle_tokens(model, count) - 3
        targets.append(_trimmed(case.middle, count))
        p, _ = _fit(tok, case.prefix, "", room)
        prefixed.append(_middle(model, p or [tok.eot], newline=True, count=count))
        if fim:
            p, s = _fit(tok, case.prefix + "\n", case.suffix, room)
            ids = [tok.sentinels.prefix, *p, tok.sentinels.suffix, *s, tok.sentinels.middle]
            infilled.append(_middle(model, ids, newline=False, count=count))
    written = _written(model, tok, prefixed + infilled, device, dtype)
    prefix_only, with_suffix = written[: len(prefixed)], written[len(prefixed) :]
    return _hits(with_suffix, targets), _hits(prefix_only, targets)


def _hits(written: list[str | None], targets: list[str]) -> int:
    """How many were written exactly (none were, when nothing was asked: a model without FIM)."""
    return sum(line == target for line, target in zip(written, targets, strict=False))


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


def parsed_bodies(model: GPT, tok: Tokenizer, prompts: list[tuple[int, str, str]], device, dtype, seed: int = 0) -> int:
    """How many sampled bodies (temperature 0.8, top-k 50) complete their `def` line into Python that parses;
    each prompt (index, context, def line) draws from a generator seeded by `seed` and its index, whoever scores
    it. All are generated together."""
    block = model.config.block_size
    body_tokens = min(BODY_TOKENS, block // 2)
    room = block - body_tokens
    items = []
    for index, context, signature in prompts:
        head = tok.encode(signature)
        ids = ((tok.encode(context)[-max(0, room - len(head)) :] if room > len(head) else []) + head)[-block:]
        g = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
        items.append(Generation(ids, min(body_tokens, block - len(ids) + 1), Sampling(0.8, top_k=50), g))
    with autocast(device, dtype):
        generate_batch(model, items, {tok.eot})
    count = 0
    for item, (_, _, signature) in zip(items, prompts, strict=True):
        count += parsed(textwrap.dedent(signature + body_of(tok.decode(item.new)))) is not None
    return count


def evaluate_code(
    model: GPT,
    tok: Tokenizer,
    data_dir: str,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    env: DistEnv = SINGLE,
) -> CodeScores:
    """Every measure on the first held-out documents of `data_dir`: `n` hidden lines, `n` hidden spans of
    SPAN_LINES lines and up to `n` functions; each rank scores cases rank, rank + world, ..., counts all-reduced
    (the same scores for any number of processes)."""
    documents = held_out_documents(data_dir, tok, max_documents=4 * n)
    lines, spans = hidden_spans(documents, n, seed), hidden_spans(documents, n, seed, lines=SPAN_LINES)
    functions = [(i, *f) for i, f in enumerate(function_prompts(documents, n))]
    mine = slice(env.rank, None, env.world_size)
    counts = torch.tensor(
        [
            *span_exact_match(model, tok, lines[mine], device, dtype),
            *span_exact_match(model, tok, spans[mine], device, dtype),
            parsed_bodies(model, tok, functions[mine], device, dtype, seed),
        ],
        dtype=torch.long,
        device=device,
    )
    infilled, prefixed, span_infilled, span_prefixed, parsed = all_reduce_sum(counts, env).tolist()
    fim = isinstance(tok, FIMTokenizer)

    def share(count: float, total: int, available: bool = True) -> float | None:
        return count / total if total and available else None

    return CodeScores(
        cases=len(lines),
        infill_exact=share(infilled, len(lines), fim),
        prefix_exact=share(prefixed, len(lines)),
        spans=len(spans),
        span_infill_exact=share(span_infilled, len(spans), fim),
        span_prefix_exact=share(span_prefixed, len(spans)),
        functions=len(functions),
        parse_rate=share(parsed, len(functions)),
    )


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
