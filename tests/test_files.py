"""files.py: writes are all-or-nothing, folders are replaced only by complete ones, JSONL errors name file:line."""

import errno
import gzip
import os
import signal
import socket
import stat
from pathlib import Path

import pytest
from tests.helpers import lock_held_elsewhere

from gptforge.errors import GptforgeError
from gptforge.files import LOCK, append_jsonl, atomic_write, building_dir, swap_dir, temp_dir_for
from gptforge.inputs import open_text, read_jsonl
from gptforge.outputs import check_output_dir, check_output_file, locked


def test_atomic_write_replaces_whole_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "a.json"
    atomic_write(target, "old")
    atomic_write(target, [b"new ", memoryview(b"bytes")])
    assert target.read_text() == "new bytes"

    class Boom(Exception):
        pass

    def chunks():
        yield b"partial"
        raise Boom

    with pytest.raises(Boom):
        atomic_write(target, chunks())
    assert target.read_text() == "new bytes"  # the old file survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_swap_dir_puts_the_new_folder_in_place_of_the_old(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp = temp_dir_for(final)
    (tmp / "new.txt").write_text("new")
    swap_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    link = tmp_path / "link"  # export --force onto a link to a folder: rmtree refused the link after the swap
    link.symlink_to(final)
    tmp = temp_dir_for(link)
    (tmp / "newer.txt").write_text("newer")
    swap_dir(tmp, link)
    assert [p.name for p in link.iterdir()] == ["newer.txt"] and not link.is_symlink()
    assert [p.name for p in final.iterdir()] == ["new.txt"]  # the folder it pointed to is left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model"]


def test_building_dir_keeps_the_old_folder_when_building_fails(tmp_path):
    final = tmp_path / "export"
    with building_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (final / "config.json").read_text() == "{}"
    with pytest.raises(RuntimeError), building_dir(final) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("crash mid-export")
    assert (final / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_read_jsonl_skips_blank_lines_reads_gzip_and_names_the_bad_line(tmp_path):
    plain = tmp_path / "a.jsonl"
    append_jsonl(plain, {"x": 1})
    with open(plain, "a") as f:
        f.write("\n")
    append_jsonl(plain, {"x": 2})
    assert [r["x"] for _, r in read_jsonl(plain)] == [1, 2]
    packed = tmp_path / "a.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert [where for where, _ in read_jsonl(packed)] == [f"{packed}:1", f"{packed}:3"]
    with open_text(packed) as f:
        assert f.read() == plain.read_text()
    plain.write_text('{"x": 1}\n{"x": \n')
    with pytest.raises(GptforgeError, match=rf"{plain}:2: not JSON"):
        list(read_jsonl(plain))


def test_a_line_torn_by_a_crash_is_skipped_only_where_asked_and_only_at_the_end(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    assert [r["step"] for _, r in read_jsonl(log, torn_tail_ok=True)] == [1]
    with pytest.raises(GptforgeError, match=":2: not JSON"):
        list(read_jsonl(log))
    log.write_text('{"kind": "tr\n{"kind": "train", "step": 2}')
    with pytest.raises(GptforgeError, match=":1: not JSON"):
        list(read_jsonl(log, torn_tail_ok=True))
    samples = tmp_path / "samples.jsonl"  # a resumed run's next sample goes on a line of its own, the torn one dropped
    samples.write_text('{"step": 1}\n{"step": 2, "text": "' + "x" * 70_000)  # torn past one 64 KiB block
    append_jsonl(samples, {"step": 3})
    assert [r["step"] for _, r in read_jsonl(samples)] == [1, 3]
    samples.write_text('{"step": 1, "te')
    append_jsonl(samples, {"step": 4})
    assert [r["step"] for _, r in read_jsonl(samples)] == [4]


def test_unreadable_jsonl_is_one_clear_error(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(GptforgeError, match="latin.jsonl: expected UTF-8 text"):
        list(read_jsonl(latin))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"a": 1}\n' * 100)[:30])
    with pytest.raises(GptforgeError, match="broken.jsonl.gz: corrupt or truncated gzip file"):
        list(read_jsonl(broken))
    with pytest.raises(GptforgeError, match="missing.jsonl: cannot read"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_a_file_in_the_way_of_a_folder_is_refused_and_kept(tmp_path):
    kept = tmp_path / "manifest.json"
    kept.write_text("{}")
    with pytest.raises(GptforgeError, match="manifest.json: exists and is not a folder"), building_dir(kept):
        pass
    tmp = temp_dir_for(tmp_path / "other")
    with pytest.raises(GptforgeError, match="exists and is not a folder"):
        swap_dir(tmp, kept)
    assert kept.read_text() == "{}"


def test_check_output_dir_refuses_what_would_destroy_data(tmp_path):
    run = tmp_path / "runs" / "a"
    (run / "checkpoints").mkdir(parents=True)
    source = run / "checkpoints"
    for out in (source, run, tmp_path / "runs"):  # the folder read from, or any parent of it: even with --force
        with pytest.raises(GptforgeError, match="which this command reads"):
            check_output_dir(out, force=True, reads=[source])
    with pytest.raises(GptforgeError, match="exists and is not empty; pick another folder, or pass --force"):
        check_output_dir(run, force=False, is_run=True)
    check_output_dir(run, force=True, is_run=True)
    check_output_dir(tmp_path / "new", force=False)
    (tmp_path / "only-lock").mkdir()
    (tmp_path / "only-lock" / LOCK).write_text("1")
    check_output_dir(tmp_path / "only-lock", force=False)  # a lock file alone does not make a folder a run
    check_output_dir(run / "export", force=False, reads=[source])  # inside the run, beside what is read: fine


def test_a_folder_inside_one_read_from_or_holding_a_run_is_never_replaced(tmp_path):
    data = tmp_path / "data"
    (data / "myrun" / "checkpoints").mkdir(parents=True)
    with pytest.raises(GptforgeError, match=r"^--out .*myrun: inside .*data, which this command reads; write some"):
        check_output_dir(data / "myrun", force=True, reads=[data])  # train --out DATA/myrun
    with pytest.raises(GptforgeError, match=rf"^--out {data}: holds a gptforge run or checkpoint \({data / 'myrun'}\)"):
        check_output_dir(data, force=True)  # prepare ... --out DATA --force; its checkpoints/ mark the run
    (data / "myrun" / "checkpoints").rmdir()
    check_output_dir(data, force=True)
    (data / "runs" / "old").mkdir(parents=True)
    (data / "runs" / "old" / "metrics.jsonl").touch()
    with pytest.raises(GptforgeError, match=rf"holds a gptforge run or checkpoint \({data / 'runs' / 'old'}\)"):
        check_output_dir(data, force=True)
    check_output_dir(data, force=True, writes_runs=True)  # speedrun: OUT/NAME-seedS are its own runs
    with pytest.raises(GptforgeError, match=rf"^--out {data / 'runs' / 'old'}: is a gptforge run or checkpoint, which"):
        check_output_dir(data / "runs" / "old", force=True)  # prepare --out RUN --force
    check_output_dir(data / "runs" / "old", force=True, is_run=True)  # demo --force, import --force: a run for a run


def special_file(kind: str, folder: Path) -> Path:
    """A device, FIFO or socket to give as --out. The device is a /dev/null of the test's own where root may make
    one, so a regression replaces nothing of the system's; other users cannot replace /dev/null itself."""
    path = folder / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
    elif os.geteuid() != 0:
        return Path("/dev/null")
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("root without CAP_MKNOD: no device to try that is safe to lose")
    return path


@pytest.mark.parametrize("kind", ["device", "fifo", "socket"])
def test_a_device_fifo_or_socket_is_never_written_over(tmp_path, kind):
    special = special_file(kind, tmp_path)
    before = os.stat(special)
    with pytest.raises(GptforgeError, match=rf"^--out {special}: it is a {'FIFO' if kind == 'fifo' else kind}, not a"):
        check_output_file(special, force=True)
    with pytest.raises(GptforgeError, match=rf"^cannot write {special}: it is a "):
        atomic_write(special, b"x")  # plot --out, and every other file gptforge writes
    with pytest.raises(GptforgeError, match=rf"^--out {special}: exists and is not a folder"):
        check_output_dir(special, force=True)
    assert os.stat(special).st_mode == before.st_mode and os.stat(special).st_ino == before.st_ino


def test_a_file_out_ending_in_a_slash_is_refused_not_written_as_a_file(tmp_path):
    with pytest.raises(GptforgeError, match=r"^--out .*newdir/: ends in a slash, so names a folder \(expected a file"):
        check_output_file(f"{tmp_path}/newdir/", force=True)
    check_output_file(f"{tmp_path}/new.gguf", force=False)


def test_a_locked_folder_names_its_holder_and_is_released_by_kill_9(tmp_path):
    with lock_held_elsewhere(tmp_path) as pid:
        busy = rf"in use by another gptforge train \(pid {pid}\)"  # the holder's job, not the asker's
        with pytest.raises(GptforgeError, match=busy), locked(tmp_path, "prepare"):
            pass
    with locked(tmp_path, "train"):  # nothing stale after a kill -9
        assert (tmp_path / LOCK).read_text() == f"{os.getpid()} train\n"


def test_a_write_into_a_read_only_folder_is_one_gptforge_error(tmp_path, monkeypatch):
    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)  # on a read-only mount even removing the temp file fails
    with pytest.raises(GptforgeError, match=r"cannot write .*a\.json: No such file or directory"):
        atomic_write(tmp_path / "missing" / "a.json", "x")


@pytest.mark.parametrize("how", ["os", "safetensors", "torch"])
def test_a_file_past_the_file_systems_largest_is_one_line_naming_the_cap(tmp_path, monkeypatch, how):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    final = tmp_path / "export"
    with pytest.raises(GptforgeError) as e, building_dir(final) as tmp:
        if how == "os":
            raise OSError(errno.EFBIG, "File too large")
        if how == "safetensors":  # its own error type and words
            raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
        with open(tmp / "optimizer.pt", "wb") as f:  # torch's writer stops at FAT32's cap, and says only this
            f.truncate(2**32 - 1)  # its largest file; sparse: no disk space taken
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4294967295 vs 4294967360")
    assert str(e.value).startswith(f"cannot write {final}: File too large")
    assert str(e.value).endswith(
        "; the file system there caps the size of a file (FAT32 at 4 GiB): "
        "write to a drive with another file system (ext4, NTFS, exFAT)"
    )
    assert list(tmp_path.iterdir()) == []  # no temp folder left


def test_folders_of_the_user_beside_the_target_are_never_taken_for_temp_or_old(tmp_path):
    final = tmp_path / "d8"
    final.mkdir()
    for name in (".d8.old", ".d8.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "b.txt").write_text("mine")
    with building_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d8.old", ".d8.tmp", "d8"]
    assert (tmp_path / ".d8.old" / "b.txt").read_text() == "mine" == (tmp_path / ".d8.tmp" / "b.txt").read_text()


def test_output_folders_that_cannot_be_made_are_one_line(tmp_path):
    loop, dangling, regfile = tmp_path / "L", tmp_path / "dl", tmp_path / "f"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nowhere")
    regfile.write_text("x")
    for out, message in (
        (loop, "L: cannot be followed"),
        (dangling, "dl: a symbolic link to .*nowhere, which does not exist"),
        (regfile / "sub", r"sub: .*f is a file, not a folder"),
    ):
        with pytest.raises(GptforgeError, match=message):
            check_output_dir(out, force=True)


def test_reading_accepts_a_byte_order_mark_and_names_deep_json_and_special_files(tmp_path):
    from gptforge.inputs import require_regular_file

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    assert list(read_jsonl(bom)) == [(f"{bom}:1", {"text": "a"})]
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(GptforgeError, match=r"deep.jsonl:1: JSON nested too deeply"):
        list(read_jsonl(deep))
    os.mkfifo(tmp_path / "ff.jsonl")
    for path in (tmp_path / "ff.jsonl", tmp_path):
        with pytest.raises(GptforgeError, match="--decontaminate .*: not a regular file"):
            require_regular_file(path, "--decontaminate")
    assert require_regular_file(bom, "--decontaminate") == bom


@pytest.mark.parametrize("reader", ["prepare", "decontaminate", "quality-labels", "hellaswag"])
def test_a_json_integer_past_pythons_digits_is_one_line_naming_file_and_line(tmp_path, capsys, reader):
    """Each JSONL reader turned Python's 'Exceeds the limit (4300 digits)' into a traceback."""
    from gptforge.cli import main

    big = tmp_path / "big.jsonl"
    big.write_text('\n{"text": "x", "score": ' + "9" * 5000 + "}\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f():\n    return 1\n" * 20)
    out = tmp_path / "out"
    args = {
        "prepare": ["prepare", str(big), "--out", str(out)],
        "decontaminate": ["prepare", str(corpus), "--out", str(out), "--decontaminate", str(big)],
        "quality-labels": ["prepare", str(corpus), "--out", str(out), "--quality-labels", str(big)],
        "hellaswag": ["eval", str(tmp_path / "nothing"), "--hellaswag", str(big)],
    }[reader]
    if reader == "hellaswag":
        from gptforge.eval.hellaswag import read_examples

        with pytest.raises(GptforgeError, match=rf"^{big}:2: not JSON: an integer of more than 4,300 digits$"):
            read_examples(str(big))
        return
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{big}:2: not JSON: an integer of more than 4,300 digits" in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_an_interrupted_swap_into_the_current_folder_puts_every_entry_back(tmp_path, monkeypatch):
    """Ctrl-C midway through replacing the current folder's entries left them split between it and a hidden
    folder beside it, which no rerun cleaned up."""
    here, new = tmp_path / "here", tmp_path / "new"
    for folder, names in ((here, ["a", "b", "c", LOCK]), (new, ["x", "y"])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(f"{folder.name}/{name}")
    monkeypatch.chdir(here)
    real, calls = Path.rename, []

    def interrupted(self, target):
        calls.append(self)
        if len(calls) == 4:  # the old entries aside, the first new one in: then Ctrl-C
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        swap_dir(new, Path("."))
    monkeypatch.setattr(Path, "rename", real)
    assert {p.name: p.read_text() for p in here.iterdir()} == {n: f"here/{n}" for n in ("a", "b", "c", LOCK)}
    assert {p.name for p in new.iterdir()} == {"x", "y"} and sorted(p.name for p in tmp_path.iterdir()) == [
        "here",
        "new",
    ]
    swap_dir(new, Path("."))  # uninterrupted: the new entries, the lock where it was held
    assert {p.name for p in here.iterdir()} == {"x", "y", LOCK} and Path.cwd() == here


def test_an_empty_file_out_is_named_as_given():
    """export --format gguf --out '' said '--out .: is a folder', a path the user never typed."""
    for out in ("", "  "):
        with pytest.raises(GptforgeError, match=rf"^--out {out!r}: empty \(expected a file name\)$"):
            check_output_file(out, force=True)


@pytest.mark.parametrize("in_place", [True, False])
def test_ctrl_c_between_a_swaps_renames_waits_for_the_swap_to_end(tmp_path, monkeypatch, in_place):
    """A SIGINT landing between a rename and its record stranded an entry in the hidden old folder (in place), or
    left the folder missing with its old contents hidden beside it (a sibling swap)."""
    here, new = tmp_path / "here", tmp_path / "new"
    for folder, names in ((here, ["a", "b"]), (new, ["x", "y"])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(name)
    monkeypatch.chdir(here if in_place else tmp_path)
    real = Path.rename

    def signalled(self, target):
        moved = real(self, target)
        os.kill(os.getpid(), signal.SIGINT)  # delivered right after the rename, before the swap records it
        return moved

    monkeypatch.setattr(Path, "rename", signalled)
    with pytest.raises(KeyboardInterrupt):
        swap_dir(new, Path(".") if in_place else here)
    monkeypatch.setattr(Path, "rename", real)
    assert sorted(p.name for p in here.iterdir()) == ["x", "y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_old_contents_a_kill_left_stop_the_next_write_and_an_empty_one_goes(tmp_path):
    """kill -9 midway through a swap splits the folder; a rerun said nothing of the hidden old contents, and
    replacing the folder again then lost what had stayed in it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "stayed").write_text("mine")
    dead = 2**22 + 12345  # past Linux's largest pid: no such process
    stranded = tmp_path / f".out.gptforge-old-{dead}-0badf00d"
    stranded.mkdir()
    (stranded / "moved").write_text("mine too")
    (tmp_path / f".outer.gptforge-old-{dead}-00000000").mkdir()  # another folder's: not ours to judge
    (tmp_path / f".out.gptforge-old-{os.getpid()}-11111111").mkdir()  # a live process still swapping
    refused = pytest.raises(GptforgeError, match=rf"^{stranded}: old contents of out that a gptforge killed")
    with refused, building_dir(out) as tmp:
        (tmp / "f").write_text("new")
    assert (out / "stayed").read_text() == "mine" and (stranded / "moved").read_text() == "mine too"
    (stranded / "moved").unlink()  # the user sorted it out, leaving the folder empty: it is removed
    with building_dir(out) as tmp:
        (tmp / "f").write_text("new")
    assert not stranded.exists() and [p.name for p in out.iterdir()] == ["f"]
    assert (tmp_path / f".outer.gptforge-old-{dead}-00000000").is_dir()


def test_a_way_to_the_current_folder_through_a_link_inside_it_swaps_in_place(tmp_path, monkeypatch):
    """`uplink/CUR` (uplink -> ..) and `self/sub/..` (self -> .) built the new folder inside the current one and
    moved it aside with the old entries."""
    cur = tmp_path / "CUR"
    cur.mkdir()
    (cur / "uplink").symlink_to("..")
    (cur / "self").symlink_to(".")
    (cur / "sub").mkdir()
    monkeypatch.chdir(cur)
    for out in ("self/sub/..", "uplink/CUR"):
        with building_dir(Path(out)) as tmp:
            (tmp / "made").write_text(out)
        made = sorted(p.name for p in cur.iterdir())
        assert made == ["made"] and sorted(p.name for p in tmp_path.iterdir()) == ["CUR"], made
        (cur / "uplink").symlink_to("..")
        (cur / "self").symlink_to(".")
        (cur / "sub").mkdir()


def test_a_swap_whose_second_rename_fails_puts_the_old_folder_back(tmp_path, monkeypatch):
    """The old folder was moved aside and stayed hidden when the new one could not be renamed into place."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("kept")
    real, calls = Path.rename, []

    def failing(self, target):
        calls.append(self)
        if len(calls) == 2:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(GptforgeError, match="cannot write"), building_dir(out) as tmp:
        (tmp / "new").write_text("new")
    monkeypatch.setattr(Path, "rename", real)
    assert [p.name for p in out.iterdir()] == ["old"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_jsonl_lines_end_at_a_newline_not_at_a_bare_carriage_return(tmp_path):
    """A bare \\r is JSON whitespace, but Python's text files broke lines there: a good row read as two bad ones,
    and a bad row was named by the wrong line."""
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(b'{"x": 1,\r"y": 2}\r\n\n{"x": 3}\n')
    packed = tmp_path / "a.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        assert list(read_jsonl(path)) == [(f"{path}:1", {"x": 1, "y": 2}), (f"{path}:3", {"x": 3})]
    plain.write_bytes(b'{"x":\r1}\n{"x": }\n')
    with pytest.raises(GptforgeError, match=rf"{plain}:2: not JSON"):
        list(read_jsonl(plain))
