"""The repository's entry points as the tests reach them: a tool's module imported from `tools/`, and the
environment of a child process that runs one (`pretrain_dflash.py`, a tool, a `python -c` probe)."""

from __future__ import annotations

import importlib
import os
import sys

from repo_paths import REPO_ROOT


def tool_module(name: str):
    """The module of `tools/<name>.py`, imported as the tests call its functions."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def evaluate_module():
    return tool_module("evaluate_acceptance")


def regenerate_module():
    return tool_module("regenerate_data")


def cache_states_module():
    return tool_module("cache_target_states")


TORCH_PROBE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code
print("torch loaded:", "torch" in sys.modules, "exit:", code)
"""
"""`python -c TORCH_PROBE SCRIPT ARGS...` runs SCRIPT as its command line and prints whether torch was imported
and the exit status: a usage error or --help must answer before torch loads."""


def child_env(**overrides) -> dict:
    """The environment of a fresh shell (an in-process entry point may have quieted this one), the checkout
    first on PYTHONPATH, and `overrides` (e.g. OMP_NUM_THREADS="1")."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return {**env, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **overrides}

