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
_SIGPIPE_DEFAULT = ("import runpy, signal, sys; signal.signal(signal.SIGPIPE, signal.SIG_DFL); "
                    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


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


def test_a_run_directory_removed_during_the_run_is_made_again_with_everything(tiny_target, tmp_path, capsys):
    """The run directory is deleted after iteration 3 of 6: training goes on, says so in one line, and the
    directory is made again at the next write with console.log and metrics.jsonl whole (the removed files are
    read back) and args.json, metrics.png and summary.json written anew."""
    from megatron_dflash.training.loop import run
    from megatron_dflash.training.rundir import ConsoleLog

    run_dir = tmp_path / "run"

    def on_step(iteration, values, body):
        if iteration == 3:
            shutil.rmtree(run_dir)

    argv = training_argv(tiny_target, tmp_path, "--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size",
                         "4", "--dflash-eval-prompts", "0", "--eval-interval", "2", "--run-dir", str(run_dir))
    console = ConsoleLog.start()
    try:
        result = run(argv, hooks={"on_step": on_step}, console=console)
    finally:
        console.stop()
    assert result.iterations == 6
    err = capsys.readouterr().err
    assert err.count(f"[run] {run_dir} was removed during the run: made it again") == 1, err
    assert "WARNING" not in err, err
    log = (run_dir / "console.log").read_text()
    assert any(line.startswith("[dflash] variant dflash") for line in log.splitlines()[:3]), log  # the run's start
    assert _iterations(log) == list(range(1, 7)), log
    assert log.count("[eval] iteration 2 validation") == 1 and "[dflash] done: 6 iterations" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["split"] == "train"] == list(range(1, 7))
    assert [r["iteration"] for r in records if r["split"] == "valid"] == [2, 4, 6]
    assert json.loads((run_dir / "args.json").read_text())["train_iters"] == 6
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] == 6
    assert (run_dir / "metrics.png").stat().st_size > 0
