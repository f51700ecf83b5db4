"""prepare on datatrove: N tasks on its local executor write the local engine's shards byte for byte, resume, and
refuse what cannot work in one line."""

import os
import shutil
import subprocess
import sys

import pytest

from gptforge.cli import main
from gptforge.data.engine import EngineSettings
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.errors import GptforgeError

pytest.importorskip("datatrove")


@pytest.fixture(scope="module")
def planted(corpus_dir, tmp_path_factory):
    """The test corpus with an exact copy, a near copy and a minified file that --clean code removes."""
    src = tmp_path_factory.mktemp("planted") / "src"
    shutil.copytree(corpus_dir, src)
    files = sorted(src.glob("*.py"))
    shutil.copy(files[3], src / "zz_exact.py")
    lines = files[5].read_text().splitlines()
    (src / "zz_near.py").write_text("\n".join([*lines[:-1], lines[-1] + "  # edited"]))
    (src / "zz_minified.py").write_text("x=[" + ",".join(f"v{i}" for i in range(900)) + "]\n")
    (src / "zz_blob.py").write_bytes(b"\x00\x01binary\x00" * 50)  # skipped: the report must count it alike
    (src / "zz_latin1.py").write_bytes("s = 'café'\n".encode("latin-1"))
    return src


def _result(m):
    return [s["sha256"] for s in m["shards"]], m["report"], m["splits"]


@pytest.mark.slow
def test_datatrove_tasks_write_the_local_engine_s_shards_byte_for_byte(planted, tmp_path):
    settings = PrepareSettings.from_flags(str(planted), val_fraction=0.2, shard_tokens=2000, clean="code")
    local = prepare(settings, tmp_path / "local", workers=1)
    stages = local["report"]["stages"]
    assert stages["exact duplicates"]["docs"] == 1 and stages["near duplicates"]["docs"] == 1
    assert stages["filtered"]["docs"] == 1 and len(local["shards"]) > 2
    assert stages["binary skipped"]["docs"] == 1 and stages["undecodable skipped"]["docs"] == 1
    for tasks in (1, 3):
        m = prepare(settings, tmp_path / f"dt{tasks}", workers=1, engine=EngineSettings("datatrove", tasks))
        assert _result(m) == _result(local), tasks
        assert sorted(p.name for p in (tmp_path / f"dt{tasks}").iterdir()) == sorted(
            p.name for p in (tmp_path / "local").iterdir()
        )  # the work folder is gone once the manifest is written
        for name in [s["file"] for s in m["shards"]] + ["removed.jsonl"]:  # the near copy verified on its shingles
            assert (tmp_path / f"dt{tasks}" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


@pytest.mark.slow
def test_a_datatrove_run_stopped_midway_reruns_only_its_unfinished_tasks(planted, tmp_path, monkeypatch):
    import gptforge.data.engine as engine

    out, real, seen = tmp_path / "out", engine.datatrove_outcomes, []
    work = out / ".datatrove"

    def killed_after_the_tasks(*args):
        yield next(real(*args))
        raise KeyboardInterrupt

    def watched(*args):
        batches = real(*args)
        first = next(batches)  # the executor has run the unfinished tasks by now
        seen.append({p.name: p.stat().st_mtime_ns for p in work.glob("0000*.jsonl")})
        yield first
        yield from batches

    dt = EngineSettings("datatrove", 2)
    monkeypatch.setattr("gptforge.data.prepare.datatrove_outcomes", killed_after_the_tasks)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), out, workers=1, engine=dt)
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("0000*.jsonl")}
    assert sorted(before) == ["00000.jsonl", "00001.jsonl"]
    (work / "00001.jsonl").unlink()  # as if task 1 had died before finishing
    (work / "logs" / "completions" / "00001").unlink()
    monkeypatch.setattr("gptforge.data.prepare.datatrove_outcomes", watched)
    m = prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), out, workers=1, engine=dt)
    assert seen[0]["00000.jsonl"] == before["00000.jsonl"] and "00001.jsonl" in seen[0]  # only task 1 ran again
    assert not work.exists()
    local = prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), tmp_path / "local", workers=1)
    assert _result(m) == _result(local)


@pytest.mark.slow
def test_a_rerun_with_another_task_count_starts_the_tasks_over(planted, tmp_path, monkeypatch):
    """Task i encodes the documents whose index modulo the task count is i: the finished tasks of a 4-task run,
    kept by a 2-task rerun, covered shares 0 and 1 of 4, and half the documents went missing without a word."""
    import gptforge.data.engine as engine

    out, real = tmp_path / "out", engine.datatrove_outcomes

    def killed_after_the_tasks(*args):
        yield next(real(*args))
        raise KeyboardInterrupt

    settings = PrepareSettings.from_flags(str(planted), val_fraction=0.2)
    monkeypatch.setattr("gptforge.data.prepare.datatrove_outcomes", killed_after_the_tasks)
    with pytest.raises(KeyboardInterrupt):
        prepare(settings, out, workers=1, engine=EngineSettings("datatrove", 4))
    for rank in ("00002", "00003"):  # as if tasks 2 and 3 had died
        (out / ".datatrove" / f"{rank}.jsonl").unlink()
        (out / ".datatrove" / "logs" / "completions" / rank).unlink()
    monkeypatch.setattr("gptforge.data.prepare.datatrove_outcomes", real)
    m = prepare(settings, out, workers=1, engine=EngineSettings("datatrove", 2))
    assert _result(m) == _result(prepare(settings, tmp_path / "local", workers=1))


def test_engine_flags_that_cannot_work_are_one_line(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f():\n    return 1\n")
    for flags, says in (
        (["--engine", "spark"], "--engine 'spark': expected one of local, datatrove"),
        (["--engine", "datatrove", "--tasks", "0"], "--tasks must be positive, got 0"),
        (["--engine", "datatrove", "--executor", "spark"], "--executor 'spark': expected one of local, ray, slurm"),
        (["--engine", "datatrove", "--executor", "slurm"], "--executor slurm needs --slurm-partition NAME"),
        (["--tasks", "4"], "--tasks 4: applies to --engine datatrove only"),  # the local engine would ignore them
        (["--executor", "ray"], "--executor ray: applies to --engine datatrove only"),
        (["--slurm-partition", "cpu"], "--slurm-partition cpu: applies to --engine datatrove only"),
    ):
        assert main(["prepare", str(src), "--out", str(tmp_path / "out"), *flags]) == 1
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datatrove" else real(name, *a))
    with pytest.raises(GptforgeError, match=r"--engine datatrove needs datatrove: pip install 'gptforge\[datatrove\]'"):
        prepare(PrepareSettings.from_flags(str(src)), tmp_path / "out", engine=EngineSettings("datatrove"))


def test_on_slurm_the_tasks_are_submitted_and_a_second_command_writes_the_shards(planted, tmp_path, monkeypatch):
    """A fake `sbatch` takes the job; the tasks then run as Slurm would run them (launch_pickled_pipeline with the
    array index), and the same command again merges their outputs into the local engine's shards."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command, says in (("sbatch", "Submitted batch job 7"), ("scontrol", "node1")):  # Slurm's, as far as used
        (bin_dir / command).write_text(f'#!/bin/sh\necho "{says}"\n')
        (bin_dir / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out, slurm = tmp_path / "out", EngineSettings("datatrove", 2, "slurm", "cpu", "01:00:00")
    with pytest.raises(GptforgeError, match=r"2 of 2 datatrove tasks are with Slurm \(job 7; .*run the same command"):
        prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), out, workers=1, engine=slurm)
    script = (out / ".datatrove" / "logs" / "launch_script.slurm").read_text()
    assert "#SBATCH --partition=cpu" in script and "#SBATCH --time=01:00:00" in script and "--array=0-1" in script
    pickled = out / ".datatrove" / "logs" / "executor.pik"
    for task in ("0", "1"):  # what srun runs on each node of the array
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": task, "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "7"}
        done = subprocess.run([sys.executable, "-m", "datatrove.tools.launch_pickled_pipeline", str(pickled)],
                              env=env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    m = prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), out, workers=1, engine=slurm)
    local = prepare(PrepareSettings.from_flags(str(planted), val_fraction=0.2), tmp_path / "local", workers=1)
    assert _result(m) == _result(local)
