"""The chat evaluation on verifiable tasks: replies sampled through the chat template on the engine, each scored
against its task's tests in the sandbox; per family and overall, the share of replies that parse and that define
the function asked for, and pass@k (the unbiased estimator over `n` samples a task)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gptforge.data.chat.doctests import DOCTESTS, VAL_FRACTION, doctest_tasks
from gptforge.data.sources import documents
from gptforge.errors import GptforgeError
from gptforge.eval.humaneval import check_ks, pass_at_k, truncate
from gptforge.model.engine import Engine, Sequence
from gptforge.model.gpt import GPT
from gptforge.model.sampling import Sampling
from gptforge.tasks.builtin import Task, builtin_tasks
from gptforge.tasks.read import read_tasks
from gptforge.tasks.score import Score, score_replies
from gptforge.tokens.chat import Message, chat_template, format_chat
from gptforge.tokens.fim import end_ids
from gptforge.tokens.tokenizer import Tokenizer

BUILTIN = "builtin"
BUILTIN_COUNT = 70  # held-out built-in tasks `--tasks builtin` scores by default: 10 of each family


@dataclass(eq=False)
class Reply:
    """One sampled reply: the prompt it continued, its tokens (its end token kept where it ended at one), its text."""

    task: Task
    prompt: list[int]
    ids: list[int]
    text: str


def load_tasks(source: str, limit: int = 0, flag: str = "--tasks", split: str = "val") -> list[Task]:
    """`builtin` (the built-in tasks of `split`, `limit` of them, else BUILTIN_COUNT), `doctests:CORPUS` (the tasks
    mined from the doctests of a `prepare` source's files of `split`) or a JSONL file's tasks."""
    if source == BUILTIN:
        return builtin_tasks(split, limit or BUILTIN_COUNT)
    if source.startswith(DOCTESTS):
        corpus = source.removeprefix(DOCTESTS)
        if not corpus:
            raise GptforgeError(f"{flag} {source}: no corpus named (doctests:stdlib, doctests:FOLDER, doctests:GLOB)")
        tasks = doctest_tasks(documents(corpus), split)
        if not tasks:
            raise GptforgeError(
                f"{flag} {source}: no {split} task (no function of {corpus}'s {split} files, the first file and "
                f"{VAL_FRACTION:.0%} of the rest held out, has doctests of literal calls that it passes alone)"
            )
    else:
        tasks = read_tasks(source, flag)
    return tasks[:limit] if limit else tasks


def task_prompt(tok: Tokenizer, request: str) -> list[int]:
    """A chat model's prompt for `request` (its template's user turn, then the assistant's header); for a base
    model, the request as comment lines for the code to follow."""
    if chat_template(tok) is not None:
        return format_chat(tok, [Message("user", request)], add_generation_prompt=True).ids.tolist()
    return tok.encode("".join(f"# {line}\n" for line in request.splitlines()))


def check_fits(tok: Tokenizer, tasks: list[Task], block: int, flag: str) -> None:
    """Every task's prompt leaves the context room for a reply: one line naming the first that does not."""
    for task in tasks:
        size = len(task_prompt(tok, task.request))
        if size >= block:
            raise GptforgeError(f"{flag}: task {task.name}: its request takes {size:,} tokens, the context {block:,}")


def draw_seed(*parts: object) -> int:
    """A generator seed from `parts` (e.g. the run's seed, a task's name, a sample's index): the same draws
    whatever else is sampled beside them."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def sample_replies(
    model: GPT,
    tok: Tokenizer,
    tasks: list[Task],
    *,
    n: int,
    rule: Sampling,
    seed: object,
    max_new_tokens: int,
    dtype: torch.dtype | None = None,
    rows: int = 32,
) -> list[list[Reply]]:
    """`n` replies to each task's request, the prompt prefilled once for its n; sample j of a task draws from a
    generator seeded by (seed, task name, j). A base model's reply is its code up to the first line of top-level
    code after its function (HumanEval's stop sequences)."""
    device, block = next(model.parameters()).device, model.config.block_size
    ends, prompts, seqs = frozenset(end_ids(tok)), [], []
    check_fits(tok, tasks, block, "tasks")
    for index, task in enumerate(tasks):
        prompt = task_prompt(tok, task.request)
        prompts.append(prompt)
        for j in range(n):
            g = None if rule.greedy else torch.Generator(device).manual_seed(draw_seed(seed, task.name, j))
            # slides=False: a reply ends ("length") where the context does, its prompt never slid out
            seqs.append(Sequence(list(prompt), max_new_tokens, rule, g, ends, slides=False, prompt_key=index))
    Engine(model, rows=rows, dtype=dtype).run(*seqs)
    cut = str if chat_template(tok) is not None else truncate
    out = []
    for index, task in enumerate(tasks):
        group = seqs[index * n : (index + 1) * n]
        texts = [cut(tok.decode([t for t in s.new if t not in ends])) for s in group]
        out.append([Reply(task, prompts[index], s.new, text) for s, text in zip(group, texts, strict=True)])
    return out


def evaluate_tasks(
    model: GPT,
    tok: Tokenizer,
    tasks: list[Task],
    *,
    n: int,
    ks: Iterable[int],
    temperature: float = 0.8,
    max_new_tokens: int = 192,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Per family and overall ("all"): parse and define rates over the replies, pass@k over the tasks; and the
    first reply to each of the first two tasks."""
    ks = list(ks)
    check_ks(ks, n)
    rule = Sampling(temperature, None, 0.95 if temperature > 0 else None)
    groups = sample_replies(model, tok, tasks, n=n, rule=rule, seed=seed, max_new_tokens=max_new_tokens, dtype=dtype)
    replies = [reply for group in groups for reply in group]
    scores = score_replies([r.task for r in replies], [r.text for r in replies])
    by_task = [scores[i * n : (i + 1) * n] for i in range(len(tasks))]
    families = sorted({t.family for t in tasks})
    result: dict[str, Any] = {
        name: summarize([s for t, s in zip(tasks, by_task, strict=True) if name in (t.family, "all")], ks)
        for name in ("all", *families)
    }
    examples = [{"request": g[0].task.request, "reply": g[0].text} for g in groups[:2]]
    return {"n": n, "tasks": len(tasks), "temperature": temperature, "families": result, "examples": examples}


def summarize(by_task: list[list[Score]], ks: list[int]) -> dict[str, float]:
    """Shares over a family's replies and pass@k over its tasks (each task's scores are its n replies')."""
    replies = [s for scores in by_task for s in scores]
    out = {"tasks": len(by_task), "parses": _share(s.parses for s in replies)}
    out["defines"] = _share(s.defines for s in replies)
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(len(s), sum(x.solved for x in s), k) for s in by_task) / len(by_task)
    return out


def _share(flags: Iterable[bool]) -> float:
    flags = list(flags)
    return sum(flags) / len(flags)


def format_tasks(result: dict[str, Any]) -> str:
    """One line overall, then one a family."""
    lines = []
    for name, row in result["families"].items():
        passes = " | ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith("pass@"))
        size = f"{row['tasks']} tasks" + (f" x {result['n']} samples" if name == "all" else "")
        lines.append(f"{name}: {passes} | parses {row['parses']:.2f} | defines {row['defines']:.2f} ({size})")
    return "\n".join(lines)
