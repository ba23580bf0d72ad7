"""Short runs of the training entry point for the end-to-end tests: their arguments, the run itself in this
process, its exit status and stderr as the command line would give them, and what a run leaves on disk.

Everything is tiny: the session's 20-step tiny target (the `tiny_target` fixture), 4-row micro-batches of
48 tokens and a handful of steps.
"""

from __future__ import annotations

import os
import shutil

# The tiny target has 6 layers: the published recipe's 5-layer, block-16 draft does not fit it.
TINY_DRAFT = ["--dflash-num-layers", "2", "--dflash-block-size", "8"]
STEPS_ARGS = [*TINY_DRAFT, "--data-format", "synthetic", "--no-progress-bar", "--log-interval", "1", "--seq-length", "48", "--synthetic-train-samples", "64",
              "--synthetic-valid-samples", "16", "--eval-iters", "1", "--dflash-anchors-per-sample", "4",
              "--lr", "2e-3", "--lr-warmup-iters", "1"]

MULTI_RANK_TIMEOUT_S = 300.0  # generous (a shared, loaded machine), but a hang fails instead of blocking
SHORT = ["--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]


def with_run_dir(argv) -> list:
    """`argv` with the run directory next to its export when it names none: a test's run never writes into the
    checkout's runs/."""
    argv = list(argv)
    if "--run-dir" not in argv and "--dflash-export" in argv:
        argv += ["--run-dir", os.path.dirname(argv[argv.index("--dflash-export") + 1])]
    return argv


def run_training(argv, hooks=None, world_size=None):
    from megatron_dflash.training.loop import run

    return run(with_run_dir(argv), hooks=hooks, world_size=world_size)


def training_argv(target, out, *extra):
    return ["--target", target, "--dflash-export", str(out / "hf"), *STEPS_ARGS, *extra]


def run_main(argv, capsys, monkeypatch, debug=False):
    """`pretrain_dflash.py ARGV` in this process: (exit status, stderr)."""
    from megatron_dflash.common.errors import DEBUG_ENV
    from megatron_dflash.training.loop import main

    monkeypatch.setenv(DEBUG_ENV, "1" if debug else "0")
    capsys.readouterr()
    status = main(with_run_dir(argv))
    return status, capsys.readouterr().err


def copy_save(save, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(save, out)
    return out


def safetensors_of(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))
