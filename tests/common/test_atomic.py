"""Publishing (`megatron_dflash.common.atomic`): a writer killed at any point leaves the previous version
of a directory or file intact (or nothing, when there was none), never a half-written one.

Each case runs the publish in a child process that kills itself (`os._exit`, no clean-up code
runs) at the k-th step: in the middle of writing the staged content, or at any rename or delete
of the publish itself; k grows until the publish completes. After the crash, the next writer's
clean-up (`remove_stale_siblings`, which every publish runs first) must find the complete
previous version or the complete new one, and no staged or aside copies.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_dflash.common import atomic
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
FILES = ("config.json", "model.safetensors", "notes.txt")

# The child: publish `output` (new content), killing itself at step `crash_at`.
_CHILD = r"""
import os, shutil, sys
from megatron_dflash.common import atomic

output, kind, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = {"n": 0}

def step():
    steps["n"] += 1
    if steps["n"] == crash_at:
        os._exit(9)                      # a kill: no finally blocks, no clean-up

def crashing(fn):
    def wrapped(*args, **kwargs):
        step()
        return fn(*args, **kwargs)
    return wrapped

os.rename, os.replace, shutil.rmtree = crashing(os.rename), crashing(os.replace), crashing(shutil.rmtree)
if kind == "directory":
    with atomic.atomic_directory(output, replace=True) as staged:
        for i, name in enumerate(%(files)r):
            if i == 1:
                step()                   # half of the content written
            with open(os.path.join(staged, name), "w") as f:
                f.write("new " + name)
else:
    atomic.write_file(output, "new content")
"""


def _publish_crashing_at(output: str, kind: str, crash_at: int) -> int:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", _CHILD % {"files": FILES}, output, kind, str(crash_at)],
                           env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode in (0, 9), child.stderr
    return child.returncode


def _read_dir(path) -> dict:
    return {name: (path / name).read_text() for name in sorted(os.listdir(path))}


def _siblings(parent) -> list:
    return sorted(n for n in os.listdir(parent) if atomic.temporary_of(n) is not None)


@pytest.mark.parametrize("previous", [True, False], ids=["replacing", "first-publish"])
def test_a_directory_publish_killed_at_any_step_leaves_the_previous_version(tmp_path, previous):
    old = {name: f"old {name}" for name in FILES}
    new = {name: f"new {name}" for name in FILES}
    missing_before_recovery = []
    for crash_at in range(1, 20):
        case = tmp_path / f"crash{crash_at}"
        output = case / "draft"
        case.mkdir()
        if previous:
            output.mkdir()
            for name, text in old.items():
                (output / name).write_text(text)
        status = _publish_crashing_at(str(output), "directory", crash_at)
        if status == 0:  # the publish got through all its steps
            assert _read_dir(output) == new and _siblings(case) == []
            break
        missing_before_recovery.append(not output.exists())
        atomic.remove_stale_siblings(str(output))  # what the next publish of `output` does first
        assert _siblings(case) == [], crash_at
        if output.exists() and _read_dir(output):
            assert _read_dir(output) in (old, new), crash_at  # whole, never mixed or partial
            if previous and crash_at <= 3:  # killed before the new version was in place
                assert _read_dir(output) == old, crash_at
        else:
            assert not previous, f"killed at step {crash_at}: the previous version is lost"
    else:
        pytest.fail("the publish never completed")
    assert crash_at >= 3, "the child never reached the publish"
    if previous:
        # The case the two-rename replacement cannot avoid was reached: killed between moving the
        # previous version aside and moving the new one in; recovery put the previous one back.
        assert any(missing_before_recovery)


def test_a_file_publish_killed_at_any_step_leaves_the_previous_file(tmp_path):
    for crash_at in range(1, 10):
        case = tmp_path / f"crash{crash_at}"
        case.mkdir()
        tracker = case / "latest_checkpointed_iteration.txt"
        tracker.write_text("old content")
        if _publish_crashing_at(str(tracker), "file", crash_at) == 0:
            assert tracker.read_text() == "new content"
            break
        assert tracker.read_text() == "old content"
        atomic.remove_stale_siblings(str(tracker))
        assert _siblings(case) == []
    else:
        pytest.fail("the publish never completed")


def test_a_failed_replacement_puts_the_previous_version_back_at_once(tmp_path, monkeypatch):
    """An error (not a kill) while moving the new version in: the previous one is back in place
    before the error reaches the caller, and the staged copy is gone."""
    output = tmp_path / "export"
    output.mkdir()
    (output / "config.json").write_text("old")
    real_rename = os.rename

    def failing_second_rename(src, dst):
        if os.path.basename(src).startswith(".export.tmp-"):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_second_rename)
    with pytest.raises(atomic.NoSpaceError, match=f"no space left on device writing {output};"):
        with atomic.atomic_directory(str(output), replace=True) as staged:
            with open(os.path.join(staged, "config.json"), "w") as f:
                f.write("new")
    assert (output / "config.json").read_text() == "old"
    assert _siblings(tmp_path) == []


def test_refusals_come_before_anything_is_written(tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass --force"):
        atomic.check_destination(str(output), replace=False, replace_flag="--force")
    with pytest.raises(ValueError, match="overlaps the input"):
        atomic.check_destination(str(output / "sub"), replace=True, source=str(output))
    with pytest.raises(FileExistsError, match="not empty; refusing"):
        with atomic.atomic_directory(str(output), replace=False) as staged:
            open(os.path.join(staged, "x"), "w").close()
    assert _read_dir(output) == {"keep.txt": "mine"} and _siblings(tmp_path) == []
