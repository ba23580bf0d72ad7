"""A full disk (ENOSPC): training outlives its run directory's writes, every other write ends in one line.

`FullDisk` makes the file system under one directory full, at the lowest level each writer of the
project goes through: `os.write` (the run directory's appended files, `common.atomic.write_file`), Python
file objects opened for writing (torch's distributed checkpoint writer, which `torch.save`s into
them), and safetensors' Rust writer (which reports the OS error in its message, as it does on a
really full file system). Paths elsewhere are untouched. The shapes of the errors are the ones seen
on a full tmpfs (docs/design.md §14).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil

import pytest
import torch

from megatron_dflash.common.atomic import NoSpaceError, as_no_space, temporary_of
from repo_paths import REPO_ROOT
from training_runs import MULTI_RANK_TIMEOUT_S, SHORT, copy_save, run_main, run_training, training_argv

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="FullDisk maps descriptors via /proc")]

_NO_SPACE = "no space left on device writing"


class FullDisk:
    """The file system under `root` is full while `full` is set: a write there raises
    `OSError(ENOSPC)`. `room` bytes may still be written first (a write that straddles them is
    partial, as on a real disk); `mkdir=True`: no new directory fits either. Use as a context
    manager (also inside the rank processes of the pool, which later tests reuse: everything
    patched is restored on exit)."""

    def __init__(self, root, full: bool = True, room: int = 0, mkdir: bool = False):
        self.root = os.path.realpath(str(root))
        self.full, self.room, self.refuse_mkdir = full, room, mkdir
        self.refused = 0  # writes refused so far
        self._saved = []

    def _under(self, path) -> bool:
        path = os.path.realpath(os.fspath(path))
        return path == self.root or path.startswith(self.root + os.sep)

    def _allow(self, size: int) -> int:
        """How many of `size` bytes fit; raises ENOSPC when none does."""
        if not self.full or size == 0:
            return size
        if self.room <= 0:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allowed = min(size, self.room)
        self.room -= allowed
        return allowed

    # ---- the patched primitives

    def _os_write(self, fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = None
        if path is None or not self._under(path):
            return self._real_os_write(fd, data)
        return self._real_os_write(fd, bytes(memoryview(data)[:self._allow(len(data))]))

    def _os_mkdir(self, path, *args, **kwargs):
        if self.full and self.refuse_mkdir and self._under(path):
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return self._real_os_mkdir(path, *args, **kwargs)

    def _open(self, file, mode="r", *args, **kwargs):
        f = self._real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and self._under(file):
            return _FileOnFullDisk(f, self)
        return f

    def _serialize_file(self, tensors, filename, *args, **kwargs):
        if self._under(filename) and self.full:
            from safetensors import SafetensorError

            self.refused += 1
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return self._real_serialize_file(tensors, filename, *args, **kwargs)

    def __enter__(self) -> "FullDisk":
        import safetensors.torch

        self._real_os_write, self._real_os_mkdir, self._real_open = os.write, os.mkdir, io.open
        self._real_serialize_file = safetensors.torch.serialize_file
        for owner, name, value in ((os, "write", self._os_write), (os, "mkdir", self._os_mkdir),
                                   (io, "open", self._open), (builtins, "open", self._open),
                                   (safetensors.torch, "serialize_file", self._serialize_file)):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved = []


class _FileOnFullDisk:
    """A file object opened for writing on the `FullDisk`: its writes take the disk's room."""

    def __init__(self, f, disk: FullDisk):
        self._f, self._disk = f, disk

    def write(self, data):
        size = len(data)
        allowed = self._disk._allow(size)
        if allowed < size:  # a partial write: what fits, then the error (a file object writes all or raises)
            self._f.write(data[:allowed])
            self._disk.room = 0
            self._disk._allow(1)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def _temporaries(directory) -> list:
    return sorted(n for n in os.listdir(directory) if temporary_of(n) is not None)


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and "unexpected pos" not in err, err[-3000:]
    return lines[-1]


# ------------------------------------------------------------------------------------------ the errors


def test_the_shapes_of_a_full_disk_are_recognised(tmp_path):
    """The errno is found wherever the writers leave it: torch's zip writer (in `__context__` of
    "unexpected pos"), torch's CheckpointException (per rank, after pickling), safetensors' Rust
    text; a NoSpaceError pickles whole. Other errors are not mistaken for it."""
    import pickle

    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    class Stream(io.BytesIO):  # room for the first record only: torch's writer then reports "unexpected pos"
        room = 64

        def write(self, data):
            size = len(memoryview(data).cast("B"))
            if size > self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= size
            return super().write(data)

    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        torch.save({"w": torch.zeros(1000)}, Stream())
    assert as_no_space(info.value, "/ckpt/iter_0000003").filename == "/ckpt/iter_0000003"
    translated = pickle.loads(pickle.dumps(NoSpaceError("/ckpt/iter_0000003", "kept")))
    assert str(translated).startswith("no space left on device writing /ckpt/iter_0000003 (kept);")
    gathered = CheckpointException("save", {1: (translated, None)})
    assert as_no_space(gathered).filename == "/ckpt/iter_0000003"
    rust = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert as_no_space(rust, "/out").errno == errno.ENOSPC
    for other in (ValueError("bad config"), OSError(errno.EACCES, "Permission denied"),
                  SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")):
        assert as_no_space(other) is None


def test_a_write_that_loses_its_errno_on_a_full_file_system_is_said_so(tmp_path, monkeypatch):
    """torch.save on a file name (megatron's common.pt) reports a full disk without any errno: a writer
    that knows its path calls it a full disk when that file system has no room left."""
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    lost.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert as_no_space(lost, str(tmp_path)) is None  # room left: a bug, not a full disk

    class Full:
        f_bavail, f_frsize, f_files, f_favail = 3, 4096, 1000, 10

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    assert str(as_no_space(lost, str(tmp_path / "ckpt"))).startswith(f"{_NO_SPACE} {tmp_path / 'ckpt'};")
    assert as_no_space(ValueError("not a write"), str(tmp_path)) is None


# ------------------------------------------------------------------------------------------ the run directory


def test_appended_files_catch_up_or_say_what_was_dropped(tmp_path, capsys):
    from megatron_dflash.training.rundir import AppendedFile, RunDirHealth

    health = RunDirHealth(str(tmp_path))
    log = AppendedFile(str(tmp_path / "console.log"), health, limit=64)
    log.append("line 0\n")
    with FullDisk(tmp_path, room=3) as disk:  # "lin" fits, the rest of line 1 and more do not
        for i in range(1, 5):
            log.append(f"line {i}\n")
        assert disk.refused == 4
        disk.full = False
        log.append("line 5\n")
    assert (tmp_path / "console.log").read_text() == "".join(f"line {i}\n" for i in range(6))
    err = capsys.readouterr().err
    assert err.count("WARNING: cannot write") == 1 and "(no space left on device)" in err
    assert f"[run] {tmp_path} is written again; nothing was lost." in err
    # more than the limit while the disk is full: the oldest whole lines go, and the count is said
    with FullDisk(tmp_path) as disk:
        for i in range(6, 20):
            log.append(f"line {i}\n")
        disk.full = False
        log.append("line 20\n")
    text = (tmp_path / "console.log").read_text().splitlines()
    kept = [int(t.split()[1]) for t in text[6:]]
    assert kept == list(range(kept[0], 21)) and kept[0] > 6
    dropped = sum(len(f"line {i}\n") for i in range(6, kept[0]))
    assert f"dropped while the disk refused them: console.log: {dropped} bytes." in capsys.readouterr().err


def test_training_outlives_a_full_run_directory(tiny_target, tmp_path, capsys):
    """console.log, metrics.jsonl, metrics.png cannot be written for iterations 2-4 of 6: training ends
    normally with one warning; once there is space again every line is written, once, in order."""
    from megatron_dflash.training.loop import run
    from megatron_dflash.training.rundir import ConsoleLog

    run_dir = tmp_path / "run"
    disk = FullDisk(run_dir, full=False)

    def on_step(iteration, values, body):
        disk.full = 2 <= iteration < 4

    argv = training_argv(tiny_target, tmp_path, "--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "4",
                         "--dflash-eval-prompts", "0", "--eval-interval", "2", "--run-dir", str(run_dir))
    console = ConsoleLog.start()
    try:
        with disk:
            result = run(argv, hooks={"on_step": on_step}, console=console)
    finally:
        console.stop()
    assert result.iterations == 6 and disk.refused > 0
    err = capsys.readouterr().err
    assert err.count("[run] WARNING: cannot write") == 1 and "no space left on device" in err
    assert err.count(f"[run] {run_dir} is written again; nothing was lost.") == 1
    log = (run_dir / "console.log").read_text()
    iterations = [line.split("/")[0].split()[-1] for line in log.splitlines() if line.startswith("iteration:")]
    assert iterations == [str(i) for i in range(1, 7)], log
    assert log.count("[eval] iteration 2 validation") == 1 and "[dflash] done: 6 iterations" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["split"] == "train"] == list(range(1, 7))
    assert [r["iteration"] for r in records if r["split"] == "valid"] == [2, 4, 6]
    assert (run_dir / "metrics.png").stat().st_size > 0 and json.loads((run_dir / "summary.json").read_text())
    assert _temporaries(run_dir) == []


def test_tensorboard_writes_that_fail_warn_once(capsys):
    from types import SimpleNamespace

    from megatron_dflash.training.monitor import Monitor

    class Events:
        full = True

        def add_scalar(self, *args):
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        flush = close = lambda self: None

    monitor = Monitor(SimpleNamespace(tensorboard_dir=None, wandb_project=None, no_progress_bar=True), rank=0,
                      total_iters=3)
    monitor.tb = Events()
    monitor.scalars({"loss": 1.0}, 1)
    monitor.scalars({"loss": 1.0}, 2)
    monitor.tb.full = False
    monitor.scalars({"loss": 1.0}, 3)
    monitor.close()
    assert capsys.readouterr().out.count("cannot write TensorBoard events (No space left on device)") == 1


# ------------------------------------------------------------------------------------------ one line each


@pytest.mark.parametrize("mkdir", [False, True], ids=["shards", "staged-directory"])
def test_a_checkpoint_save_on_a_full_disk_ends_in_one_line(tiny_target, tmp_path, trained, capsys, monkeypatch, mkdir):
    """The shards do not fit, or not even the staged directory: one line, the save directory as it was."""
    save = copy_save(trained, tmp_path)
    before = {name: sorted(os.listdir(save / name)) if (save / name).is_dir() else (save / name).read_text()
              for name in os.listdir(save)}
    more = [a if a != "2" else "3" for a in SHORT]
    with FullDisk(save, mkdir=mkdir) as disk:
        status, err = run_main(training_argv(tiny_target, tmp_path, *more, "--load", str(save), "--save", str(save),
                                             "--run-dir", str(tmp_path / "run")), capsys, monkeypatch)
    assert status == 1 and disk.refused > 0
    assert _error_line(err) == (f"pretrain_dflash.py: error: {_NO_SPACE} {save / 'iter_0000003'} (the checkpoints "
                                "saved before are intact); free space on its file system or write somewhere else, "
                                "then run again.")
    after = {name: sorted(os.listdir(save / name)) if (save / name).is_dir() else (save / name).read_text()
             for name in os.listdir(save)}
    assert after == before  # no iter_0000003, no staged directory, the tracker still names iteration 2


def _rank_saving_on_a_full_disk(rank, world_size, target, out_dir, full_rank):
    """One DP rank of a run whose checkpoint writes fail on `full_rank` only (its shards do not fit)."""
    import pathlib

    from megatron_dflash.common.errors import RunError

    torch.set_num_threads(1)
    out = pathlib.Path(out_dir)
    argv = training_argv(target, out, "--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "8",
                         "--dflash-eval-prompts", "0", "--save", str(out / "ckpt"), "--run-dir", str(out / "run"))
    disk = FullDisk(out / "ckpt", full=rank == full_rank)
    try:
        with disk:
            run_training(argv)
    except (NoSpaceError, RunError) as err:
        return type(err).__name__, str(err), disk.refused
    return "ok", None, disk.refused


def test_a_checkpoint_save_failing_on_one_rank_fails_alike_on_every_rank(tp_pool, tiny_target, tmp_path):
    results = tp_pool(2).run(_rank_saving_on_a_full_disk, tiny_target, str(tmp_path), 1, tp=1,
                             timeout=MULTI_RANK_TIMEOUT_S)
    assert results[1][2] > 0 and results[0][2] == 0, results  # only rank 1's writes were refused
    assert results[0][:2] == results[1][:2] and results[0][0] == "NoSpaceError", results
    assert results[0][1].startswith(f"{_NO_SPACE} {tmp_path / 'ckpt' / 'iter_0000002'} "), results
    # nothing saved, nothing staged: the save directory this run created (for its lock) is gone again
    assert not (tmp_path / "ckpt").exists()


def test_the_hf_export_on_a_full_disk_ends_in_one_line(tiny_target, tmp_path, capsys, monkeypatch):
    exports = tmp_path / "exports"
    exports.mkdir()
    argv = training_argv(tiny_target, tmp_path, *SHORT, "--save", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"))
    argv[argv.index("--dflash-export") + 1] = str(exports / "hf")
    with FullDisk(exports) as disk:
        status, err = run_main(argv, capsys, monkeypatch)
    assert status == 1 and disk.refused > 0
    line = _error_line(err)
    assert line.startswith(f"pretrain_dflash.py: error: {_NO_SPACE} {exports / 'hf'} (the checkpoints in "
                           f"{tmp_path / 'ckpt'} are intact;"), line
    assert os.listdir(exports) == []  # no partial export, no staged copy
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_the_converters_on_a_full_disk_end_in_one_line(tmp_path, trained, capsys, monkeypatch):
    from megatron_dflash.checkpoint.convert import main

    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    hf = tmp_path / "hf"
    assert main(["to-hf", "--load", str(trained), "--output", str(hf)]) == 0
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    previous = outputs / "previous"
    shutil.copytree(hf, previous)
    cases = [(["to-hf", "--load", str(trained)], outputs / "new-hf"),
             (["to-hf", "--load", str(trained), "--force"], previous),
             (["to-megatron", "--load", str(hf)], outputs / "new-megatron"),
             (["to-megatron", "--load", str(hf), "--force"], previous)]
    for argv, output in cases:
        capsys.readouterr()
        with FullDisk(outputs) as disk:
            status = main([*argv, "--output", str(output)], prog="convert_checkpoint.py")
        err = capsys.readouterr().err
        assert status == 1 and disk.refused > 0, (argv, err)
        assert _error_line(err) == (f"convert_checkpoint.py: error: {_NO_SPACE} {output}; free space on its file "
                                    "system or write somewhere else, then run again."), argv
        assert sorted(os.listdir(outputs)) == ["previous"], argv  # nothing partial, no staged copy
        assert sorted(os.listdir(previous)) == sorted(os.listdir(hf))  # replaced only once complete
        assert (previous / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_evaluate_acceptance_report_on_a_full_disk(tmp_path, capsys, monkeypatch):
    from tiny_decoding import write_models

    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "tools"))
    import evaluate_acceptance

    _, _, target_dir, draft_dir, prompts = write_models(tmp_path, False)
    reports = tmp_path / "reports"
    reports.mkdir()
    report = reports / "eval.json"
    report.write_text('{"previous": true}\n')
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
            "--device", "cpu", "--dtype", "float32", "--no-baseline", "--limit", "2", "--output", str(report)]
    with FullDisk(reports) as disk:
        code = evaluate_acceptance.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and disk.refused > 0
    assert _error_line(err) == (f"evaluate_acceptance.py: error: {_NO_SPACE} {report}; free space on its file "
                                "system or write somewhere else, then run again.")
    assert report.read_text() == '{"previous": true}\n' and os.listdir(reports) == ["eval.json"]
    assert evaluate_acceptance.main(argv) == 0  # space again: the whole report
    assert json.loads(report.read_text())["summary"]


def test_count_draft_vocab_on_a_full_disk_ends_in_one_line(tiny_target, tmp_path, capsys, monkeypatch):
    from entry_points import tool_module
    from training_runs import STEPS_ARGS

    count_draft_vocab = tool_module("count_draft_vocab")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    vocab = outputs / "vocab.json"
    vocab.write_text('{"previous": true}\n')
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    argv = ["--output", str(vocab), "--target", tiny_target, *STEPS_ARGS, "--dflash-draft-vocab-size", "60"]
    capsys.readouterr()
    with FullDisk(outputs) as disk:
        code = count_draft_vocab.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and disk.refused > 0
    assert _error_line(err) == (f"count_draft_vocab.py: error: {_NO_SPACE} {vocab}; free space on its file system or "
                                "write somewhere else, then run again.")
    assert vocab.read_text() == '{"previous": true}\n' and os.listdir(outputs) == ["vocab.json"]  # nothing partial
    assert count_draft_vocab.main(argv) == 0  # space again: the whole file
    assert len(json.loads(vocab.read_text())["ids"]) == 60


def test_the_target_cache_on_a_full_disk_ends_in_one_line_naming_the_shard(tiny_target, tmp_path, capsys, monkeypatch):
    """`tools/cache_target_states.py` onto a file system that fills after the manifest: one line naming the shard it
    was writing, no partial shard or staged copy, no index (the cache is not complete); with room again the rerun
    finishes it."""
    from entry_points import cache_states_module
    from training_runs import STEPS_ARGS

    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    cache = tmp_path / "cache"
    argv = ["--target", tiny_target, *STEPS_ARGS, "--micro-batch-size", "2", "--global-batch-size", "2",
            "--dflash-target-cache", str(cache), "--dflash-target-cache-shard-size", "16"]
    tool = cache_states_module()
    capsys.readouterr()
    with FullDisk(cache, room=4096) as disk:  # the manifest fits, the first shard does not
        status = tool.main(argv)
    err = capsys.readouterr().err
    assert status == 1 and disk.refused > 0
    assert _error_line(err) == (f"cache_target_states.py: error: {_NO_SPACE} {cache / 'train-00000.safetensors'}; "
                                "free space on its file system or write somewhere else, then run again.")
    assert sorted(os.listdir(cache)) == ["manifest.json"]  # nothing partial, nothing staged, no index
    assert tool.main(argv) == 0 and (cache / "index.json").is_file()


def _rank_caching_on_a_full_disk(rank, world_size, target, out_dir, full_rank):
    """One rank of a DP=2 run writing its target-state cache first, on a file system full for `full_rank` only:
    (error type, message)."""
    import pathlib

    from megatron_dflash.common.errors import RunError

    torch.set_num_threads(1)
    argv = training_argv(target, pathlib.Path(out_dir) / "run", *SHORT, "--global-batch-size", "8",
                         "--dflash-target-cache", os.path.join(out_dir, "cache"), "--dflash-target-cache-mode", "write",
                         "--dflash-target-cache-shard-size", "8")
    try:
        with FullDisk(os.path.join(out_dir, "cache"), full=rank == full_rank):
            run_training(argv)
    except (NoSpaceError, RunError) as err:
        return type(err).__name__, str(err)
    return "ok", None


def test_a_target_cache_write_failing_on_one_rank_stops_every_rank_in_one_line(tp_pool, tiny_target, tmp_path):
    """DP=2: replica 1's shard meets a full disk; it names its shard, replica 0 says another rank failed, no rank
    waits for the other, and no index is written (the cache is incomplete, its whole shards kept)."""
    results = tp_pool(2).run(_rank_caching_on_a_full_disk, tiny_target, str(tmp_path), 1, tp=1,
                             timeout=MULTI_RANK_TIMEOUT_S)
    assert results[1] == ("NoSpaceError", f"{_NO_SPACE} {tmp_path / 'cache' / 'train-00001.safetensors'}; free space "
                                          "on its file system or write somewhere else, then run again."), results
    assert results[0][0] == "StateCacheError" and "failed on another rank" in results[0][1], results
    assert not (tmp_path / "cache" / "index.json").exists() and _temporaries(tmp_path / "cache") == []
