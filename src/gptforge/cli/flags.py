"""Flags several commands share: compute (device, dtype, threads), --set and --force."""

from __future__ import annotations

import argparse

from gptforge.cli.types import at_least
from gptforge.model.engine import DECODES
from gptforge.model.quantize import WEIGHTS
from gptforge.runtime import DTYPE_NAMES, MAX_THREADS

DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
DTYPE_HELP = "compute precision (default auto: the checkpoint's training dtype; an import's own precision)"
THREADS_HELP = "CPU threads (default: torch's, one per core; fewer can be faster on a busy machine)"
FORCE_HELP = (
    "replace a non-empty --out folder or file (the old one is removed only once the new one is complete); a gptforge "
    "run or checkpoint is never replaced"
)


def add_compute_flags(s: argparse.ArgumentParser, threads_help: str = THREADS_HELP) -> None:
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    s.add_argument("--threads", type=at_least(1, high=MAX_THREADS), help=threads_help)


def add_decoding_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--weights",
        default="float",
        choices=WEIGHTS,
        help="int8: linear weights as int8 (weight-only, per row), a quarter of the bytes to read a token; on CPU "
        "the decode is several times as fast, its tokens near but not always equal to float's (default float)",
    )
    s.add_argument(
        "--decode",
        default="rows",
        choices=DECODES,
        help="the decode step: rows (eager, each row attends to its own length; default), static (fixed shapes) or "
        "compiled (static, with torch.compile: the first step at each batch size compiles for seconds)",
    )


def add_set_flag(s: argparse.ArgumentParser, help: str = "override an option") -> None:
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def add_force_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument("--force", action="store_true", help=FORCE_HELP)
