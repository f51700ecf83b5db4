"""Commit a folder to a git model repository, as in the CodeParrot workflow.

One branch per run, one commit per checkpoint; large files go through git-lfs when it is installed
(a Hugging Face model repo is such a repository).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gptforge.errors import GptforgeError

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def _git(*args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "GIT_LFS_SKIP_SMUDGE": "1", "GIT_TERMINAL_PROMPT": "0"}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise GptforgeError(f"git {args[0]} failed: {detail}")
    return proc.stdout


def _has_lfs() -> bool:
    return shutil.which("git-lfs") is not None


def push_folder(folder: str | Path, remote: str, branch: str, message: str) -> str:
    """Make `branch` of `remote` hold exactly `folder`'s files in a new commit; returns its hash."""
    if shutil.which("git") is None:
        raise GptforgeError("--push needs git on PATH")
    with tempfile.TemporaryDirectory(prefix="gptforge-push-") as tmp:
        repo = Path(tmp) / "repo"
        _git("clone", "--quiet", "--", remote, str(repo))  # a remote beginning with '-' is a name, never an option
        if _git("ls-remote", "--heads", "origin", branch, cwd=repo).strip():
            _git("checkout", "--quiet", "-B", branch, f"origin/{branch}", cwd=repo)
        else:
            _git("checkout", "--quiet", "--orphan", branch, cwd=repo)
            _git("rm", "-r", "-q", "-f", "--ignore-unmatch", ".", cwd=repo)
        for old in repo.iterdir():
            if old.name not in (".git", ".gitattributes"):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        for item in Path(folder).iterdir():
            shutil.copy2(item, repo / item.name) if item.is_file() else shutil.copytree(item, repo / item.name)
        if _has_lfs():
            _git("lfs", "install", "--local", cwd=repo)
            _git("lfs", "track", *LFS_PATTERNS, cwd=repo)
        _git("add", "-A", cwd=repo)
        identity = [] if _has_identity(repo) else ["-c", "user.name=gptforge", "-c", "user.email=gptforge@localhost"]
        _git(*identity, "commit", "--quiet", "--allow-empty", "-m", message, cwd=repo)
        _git("push", "--quiet", "origin", f"HEAD:refs/heads/{branch}", cwd=repo)
        return _git("rev-parse", "HEAD", cwd=repo).strip()


def _has_identity(repo: Path) -> bool:
    return subprocess.run(["git", "config", "--get", "user.email"], cwd=repo, capture_output=True).returncode == 0
