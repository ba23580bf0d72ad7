"""Training outlives its console and its run directory: a reader that goes away (`| head`), a closed descriptor, a
run directory removed while the run writes it (docs/design.md §14 Reliability guarantees)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from entry_points import child_env
from repo_paths import REPO_ROOT
from training_runs import training_argv

pytestmark = pytest.mark.usefixtures("one_thread")

_PRETRAIN = os.path.join(REPO_ROOT, "pretrain_dflash.py")
_STEPS = 8
# `python -c`: the entry point under SIGPIPE's default action (terminate), as a launcher or a library may leave it
_SIGPIPE_DEFAULT = ("import runpy, signal, sys; signal.signal(signal.SIGPIPE, signal.SIG_DFL); sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")


def _iterations(console_log) -> list:
    return [int(line.split("/")[0].split()[-1]) for line in console_log.splitlines() if line.startswith("iteration:")]


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGPIPE"), reason="no SIGPIPE on this platform")
@pytest.mark.parametrize("case", ["stdout | head -5", "2>&1 | head -5, SIGPIPE default"])
def test_a_console_reader_that_goes_away_never_stops_training(tiny_target, tmp_path, case):
    """The reader of the console pipe reads 5 lines and exits during the steps: the run finishes every step, saves
    and exports, exit 0, no traceback; one warning, on the stream that still works and in console.log, which holds
    the whole run."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    argv = training_argv(tiny_target, tmp_path, "--train-iters", str(_STEPS), "--micro-batch-size", "4",
                         "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--save", str(save),
                         "--run-dir", str(run_dir))
    together = case.startswith("2>&1")
    command = [sys.executable, "-c", _SIGPIPE_DEFAULT, _PRETRAIN] if together else [sys.executable, _PRETRAIN]
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen([*command, *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT if together else stderr, cwd=str(tmp_path),
                                   env=child_env(OMP_NUM_THREADS="1", MEGATRON_DFLASH_DEBUG="0"))
    try:
        head = [process.stdout.readline() for _ in range(5)]
        process.stdout.close()  # `head -5` exits: every later write to the pipe fails with EPIPE
        status = process.wait(timeout=300)
    finally:
        process.kill()
    assert all(head), head  # the reader went away during the run, not after it
    err = (tmp_path / "stderr").read_text()
    log = (run_dir / "console.log").read_text()
    assert status == 0, (status, err[-3000:], log[-3000:])
    assert "Traceback" not in err + log and "Exception ignored" not in err + log, err[-3000:] + log[-3000:]
    warning = f"[run] WARNING: cannot write stdout (broken pipe); training goes on, and what it prints is kept in " \
              f"{run_dir / 'console.log'}."
    assert log.count("WARNING: cannot write") == 1 and warning + "\n" in log, log[-3000:]
    if not together:  # stderr still works: the warning is shown there too
        assert err.count("WARNING: cannot write") == 1 and warning in err, err
    assert _iterations(log) == list(range(1, _STEPS + 1)), log
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(_STEPS)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] == _STEPS


def test_closed_console_descriptors_never_stop_training(tiny_target, tmp_path):
    """Started with stdout and stderr closed (`>&- 2>&-`): the run trains and saves, exit 0; console.log says so."""
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    argv = training_argv(tiny_target, tmp_path, "--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size",
                         "4", "--dflash-eval-prompts", "0", "--save", str(save), "--run-dir", str(run_dir))

    def close_console():
        os.close(1)
        os.close(2)

    status = subprocess.run([sys.executable, _PRETRAIN, *argv], stdin=subprocess.DEVNULL, preexec_fn=close_console,
                            cwd=str(tmp_path), env=child_env(OMP_NUM_THREADS="1", MEGATRON_DFLASH_DEBUG="0"),
                            timeout=300).returncode
    log = (run_dir / "console.log").read_text()
    assert status == 0 and "Traceback" not in log, log[-3000:]
    assert log.count("[run] WARNING: cannot write stdout (it is closed); training goes on") == 1, log
    assert _iterations(log) == [1, 2]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
