"""Fixtures the end-to-end modules share."""

from __future__ import annotations

import pytest

from training_runs import SHORT, run_training, training_argv


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """A save directory with the checkpoints of iterations 1 and 2 of a short run."""
    root = tmp_path_factory.mktemp("trained")
    save = root / "ckpt"
    run_training(training_argv(tiny_target, root, *SHORT, "--save", str(save), "--save-interval", "1"))
    return save
