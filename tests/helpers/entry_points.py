"""The repository's entry points as the tests reach them: a tool's module imported from `tools/`, and the
environment of a child process that runs one (`pretrain_dflash.py`, a tool, a `python -c` probe)."""

from __future__ import annotations

import os
import sys

from repo_paths import REPO_ROOT


def evaluate_module():
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    return evaluate_acceptance


def regenerate_module():
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import regenerate_data
    finally:
        sys.path.pop(0)
    return regenerate_data


def child_env(**overrides) -> dict:
    """The environment of a fresh shell (an in-process entry point may have quieted this one), the checkout
    first on PYTHONPATH, and `overrides` (e.g. OMP_NUM_THREADS="1")."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return {**env, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **overrides}


def cache_states_module():
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import cache_target_states
    finally:
        sys.path.pop(0)
    return cache_target_states
