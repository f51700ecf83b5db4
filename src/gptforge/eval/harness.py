"""The lm-evaluation-harness bridge: a checkpoint exported to a temporary Hugging Face folder, scored in-process by
`lm_eval.simple_evaluate(model="hf", ...)` on any of its tasks or local YAML tasks (`include_path`).

lm-eval's `acc_norm` divides an ending's log-likelihood by its length in characters, where our HellaSwag's
`acc_norm_token` divides by its tokens: the two differ (GPT-2 124M: 31.14% vs 29.55%), hence the names.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptforge.errors import GptforgeError
from gptforge.hub.convert import export_hf
from gptforge.model.gpt import GPT
from gptforge.tokens.tokenizer import Tokenizer

INSTALL = "pip install 'gptforge[lmeval]' (lm_eval[hf])"


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager over its own tasks and `include_path`'s, once every name in `tasks` is known to it."""
    if not tasks:  # `--lm-eval ,,` or an empty string
        raise GptforgeError("--lm-eval: no task named (expected comma-separated lm-eval task names, e.g. hellaswag)")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise GptforgeError(f"--lm-eval needs lm-evaluation-harness: {INSTALL}") from None
    if include_path and not Path(include_path).is_dir():
        raise GptforgeError(f"--include-path {include_path}: no such folder (expected a folder of lm-eval task YAML)")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = " or --include-path's YAML" if include_path else " (--include-path DIR adds local YAML tasks)"
        raise GptforgeError(f"--lm-eval {','.join(tasks)}: unknown task(s) {unknown} for lm-eval{where}")
    return manager


def evaluate_lm_eval(
    model: GPT,
    tok: Tokenizer,
    tasks: list[str],
    manager: Any,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 8,
    limit: int = 0,
) -> dict[str, dict[str, float]]:
    """lm-eval's metrics per task for `model` (exported with its tokenizer), as {task: {metric: value, "n": N}}."""
    import lm_eval

    with tempfile.TemporaryDirectory(prefix="gptforge-lm-eval-") as tmp:
        hf_dir = export_hf(model, tok, Path(tmp) / "model")
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(hf_dir), "dtype": str(dtype).removeprefix("torch.")},
            tasks=tasks,
            task_manager=manager,
            device=str(device),
            batch_size=batch_size,
            limit=limit or None,
            log_samples=False,
        )
    return {task: _metrics(values) for task, values in out["results"].items()}


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's 'acc,none' / 'acc_stderr,none' keys as 'acc' / 'acc_stderr' (another filter stays: 'em,strict');
    its non-numbers ('N/A' stderr, names) left out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key.removesuffix(",none")] = value
    if "sample_len" in values:
        out["n"] = out.pop("sample_len")
    return out


def format_lm_eval(task: str, metrics: dict[str, float]) -> str:
    """'tiny_mc: acc 0.2500 ± 0.1637 | acc_norm 0.6250 ± 0.1830 over 8 examples' (lm-eval's names)."""
    shown = [
        f"{name} {value:.4f}" + (f" ± {metrics[f'{name}_stderr']:.4f}" if f"{name}_stderr" in metrics else "")
        for name, value in metrics.items()
        if name != "n" and not name.endswith("_stderr")
    ]
    n = f" over {metrics['n']} examples" if "n" in metrics else ""
    return f"{task}: {' | '.join(shown)}{n}"
