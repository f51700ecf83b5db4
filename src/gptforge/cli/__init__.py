"""The `gptforge` command: each subcommand parses its flags and calls one library function; failures end in one
line."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from gptforge import __version__
from gptforge.cli.parser import build_parser
from gptforge.errors import GptforgeError, one_line
from gptforge.runtime.allocator import keep_freed_memory

PACKAGE = str(Path(__file__).parent.parent)


def _bytes_as_given() -> None:
    """Names and text that are not UTF-8 pass through the terminal's streams as the bytes they are, as `ls` shows
    them (a strict locale's stdout raised at the first such run folder printed); a caller's own streams (a test's
    capture) are left as they are."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        if type(stream) is io.TextIOWrapper:
            stream.reconfigure(errors="surrogateescape")


class Terminated(KeyboardInterrupt):
    """SIGTERM, met as Ctrl-C is: what a command built so far is cleaned up on the way out (the default action
    killed the process where it stood, leaving a half-built export in its hidden temporary folder)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    _bytes_as_given()
    args = build_parser().parse_args(argv)
    owned = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if owned:  # a caller's own handler (an application running main() in-process) is left alone
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args)
    finally:
        if owned:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(args) -> int:
    try:
        with warnings.catch_warnings():  # restores the previous showwarning for a caller that runs main() in-process
            warnings.showwarning = functools.partial(_show_warning, args.command, warnings.showwarning)
            args.func(args)
    except GptforgeError as e:
        # Bad input, which every process of a torchrun job meets alike (rank 0 says it), or a failure naming its own
        # rank (a peer that stopped answering), which each process says.
        return _fail(args.command, str(e), every_rank=str(e).startswith("rank "))
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        with contextlib.suppress(OSError, ValueError):  # so the interpreter's final flush has nowhere to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except OSError as e:  # disk full, permissions, a vanished file: what to fix is outside gptforge
        where = f"{e.filename}: " if e.filename else ""
        return _fail(args.command, f"{where}{e.strerror or e} (check the disk space and permissions there)")
    except RuntimeError as e:
        torch = sys.modules.get("torch")  # loaded by now if a device ran out of memory
        if torch is None or not isinstance(e, torch.cuda.OutOfMemoryError):
            return _bug(args.command)
        return _fail(
            args.command,
            "out of GPU memory: lower train.micro_batch (accumulation keeps train.batch_tokens) "
            "or set model.activation_checkpointing=true",
        )
    except Exception:
        return _bug(args.command)
    return 0


def _show_warning(command: str, default, message, category, filename, lineno, file=None, line=None) -> None:
    """gptforge's own warnings as one line like its errors (a path's newline or escape sequence written escaped);
    other libraries' in Python's usual form."""
    if not str(filename).startswith(PACKAGE):
        default(message, category, filename, lineno, file, line)
        return
    print(f"gptforge {command}: warning: {one_line(message)}", file=file or sys.stderr, flush=True)


def _fail(command: str, message: str, every_rank: bool = True) -> int:
    """The error in one line; under torchrun, unless `every_rank`, from rank 0 alone (the same line from every
    process says nothing more). Each process also leaves it in torchrun's error file, so the launcher's summary
    names it even where a rank > 0 failed alone."""
    line = f"gptforge {command}: error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    rank = os.environ.get("RANK", "0")
    if every_rank or not (rank.isdigit() and int(rank) > 0):
        print(line, file=sys.stderr)
    return 1


def _bug(command: str) -> int:
    """An exception nobody expected: its traceback, then one line saying so."""
    traceback.print_exc()
    return _fail(command, f"unexpected failure: a bug in gptforge {__version__}; please report it with the above")
