"""The child side of the sandbox for model-written code (HumanEval programs, task replies), run as a script: limit
the process, install an audit hook, run the program.

python -I -B sandbox.py PROGRAM MEMORY_BYTES CPU_SECONDS, from the throwaway working directory. The hook
sees each operation however the code reaches it (builtins, io, pathlib, os, _socket, ...): it refuses processes,
the network and native code, and writes outside the working directory. Reading stays allowed (imports need it).
Audit hooks stop code that uses Python's APIs, not code that attacks the interpreter itself (PEP 578): guards
against model-written code that wanders, not a jail for an adversary.
"""

import ctypes
import os
import re
import resource
import sys
from collections.abc import Callable
from typing import Any

# Refused outright: new processes, signals, the network, native code, raising the limits back, and the two ways
# a path could stop meaning what the lexical check in `_where` reads: a new working directory and symlinks.
REFUSED = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.startfile",
        "pty.spawn",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "resource.setrlimit",
        "resource.prlimit",
        "os.chdir",
        "os.symlink",
        "cpython.PyInterpreterState_New",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "webbrowser.open",
    }
)
# sqlite3 and syslog open files and sockets in C, past the "open" and "socket" events.
REFUSED_PREFIXES = ("socket.", "ctypes.", "sqlite3.", "syslog.")
# Modules that act without raising any audit event: fork+exec, files in /dev/shm, interpreters without this
# hook, raw memory. Refusing their import (an audit event too) keeps them out however they are loaded.
UNAUDITED_MODULES = frozenset(
    {"_posixsubprocess", "_posixshmem", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
)
# Event -> ((index of a path argument, index of its dir_fd argument or None), ...): paths that must be inside.
PATH_ARGS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "shutil.rmtree": ((0, 1),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
UNKNOWN_DIR = object()  # os.open's "open" event leaves out its dir_fd
FD_PATH = re.compile(r"/(proc/[^/]+|dev)/fd(/|$)")  # another way into an open file: a pipe or file of the parent's
HIDDEN = "GPTFORGE_SANDBOX_HIDDEN"  # environment: a folder the program may not open anything in
# Starts the stderr line of each refusal, written before it is raised: code that catches it is still known.
REFUSAL_MARK = "gptforge-sandbox refused:"


def limit(memory_bytes: int, cpu_seconds: int) -> None:
    """Cap memory, CPU time and file size, and enter an empty network namespace where the kernel allows it."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000_000, 10_000_000))
    try:  # root, or unprivileged user namespaces
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
    except OSError:
        pass


def _where(home: str, path: Any, dir_fd: Any) -> str | None:
    """The absolute, normalised path an operation acts on; None where it cannot be told."""
    try:
        if isinstance(path, int):  # an open fd: the kernel's name for it (pipes and sockets have no path)
            path = os.readlink(f"/proc/self/fd/{path}")
        if not isinstance(path, (str, bytes)):
            return None
        path = os.fsdecode(path)
        if not path.startswith("/"):
            if dir_fd is UNKNOWN_DIR:
                return None
            path = (home if dir_fd in (None, -1) else os.readlink(f"/proc/self/fd/{dir_fd}")) + "/" + path
    except OSError:  # no /proc (not Linux), or not an open fd
        return None
    # Lexical, without following links: none can be made (os.symlink refused) and the cwd stays `home`.
    return os.path.normpath(path)


def audit_hook(home: str, hidden: str | None = None) -> Callable[[str, tuple[Any, ...]], None]:
    """The hook that raises PermissionError for what REFUSED, UNAUDITED_MODULES and the path checks forbid; with
    `hidden`, no file under that folder opens at all, nor any open file through /proc/*/fd or /dev/fd (the
    parent's record of what the program said, which only the parent reads)."""

    def inside(path: Any, dir_fd: Any = None, or_home: bool = False) -> bool:
        where = _where(home, path, dir_fd)
        return where is not None and (where.startswith(home + "/") or (or_home and where == home))

    def refuse(message: str) -> None:
        os.write(2, f"{REFUSAL_MARK} {message}\n".encode(errors="backslashreplace"))  # seen even if caught
        raise PermissionError(message)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in REFUSED or event.startswith(REFUSED_PREFIXES):
            refuse(f"{event} is not allowed in the sandbox")
        if event == "import" and args[0] in UNAUDITED_MODULES:
            refuse(f"importing {args[0]} is not allowed in the sandbox")
        if event == "open" and hidden is not None:
            where = _where(home, args[0], None)  # os.open's dir_fd is unknown: read as the working folder's
            if where is None or where == hidden or where.startswith(hidden + "/") or FD_PATH.match(where):
                refuse(f"opening {args[0]!r}: not readable in the sandbox")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(flags, int) and flags & WRITE_FLAGS) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            # os.open (mode None) may be relative to a dir_fd the event does not carry, so it writes only to
            # absolute paths. The working directory itself opens for writing only as O_TMPFILE (TemporaryFile).
            if writes and not inside(path, None if mode is not None else UNKNOWN_DIR, or_home=True):
                refuse(f"writing outside the sandbox: {path!r}")
        for i, fd in PATH_ARGS.get(event, ()):
            if not inside(args[i], None if fd is None or fd >= len(args) else args[fd]):
                refuse(f"{event} outside the sandbox: {args[i]!r}")

    return hook


def main() -> None:
    """Compile the program, limit the process, install the hook, run the program as __main__."""
    program, memory_bytes, cpu_seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(program, encoding="utf-8") as f:
        code = compile(f.read(), program, "exec")
    limit(memory_bytes, cpu_seconds)
    hidden = os.environ.get(HIDDEN)
    sys.addaudithook(audit_hook(os.path.realpath(os.getcwd()), os.path.realpath(hidden) if hidden else None))
    # No audit event guards these; removed from both names they go by.
    for name in ("mkfifo", "mknod", "chroot"):
        for module in (os, sys.modules["posix"]):
            module.__dict__.pop(name, None)
    sys.argv = [program]
    exec(code, {"__name__": "__main__"})


if __name__ == "__main__":
    main()
