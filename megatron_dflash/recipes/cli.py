"""`pretrain_dflash.py --recipe NAME [--recipe-budget short|full] [--run-dir DIR]`: a ready-made job on a real
target, its inputs installed from the package registry (`recipes/smollm2.py`'s `INSTALL_LINE`). Parsed apart
from the training flags: a recipe decides those itself (`recipes/budgets.py`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional, Sequence

from ..common.cli import ArgumentParser
from .budgets import BUDGETS

RECIPES = ("smollm2-135m",)


def wants_recipe(argv: Sequence[str]) -> bool:
    return any(a == "--recipe" or a.startswith("--recipe=") for a in argv)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pretrain_dflash.py --recipe",
                       description="A ready-made job on a real target: the HF target from its GGUF, a seeded "
                       "ShareGPT slice, the target's answers, the target-state cache, DFlash training, and decode "
                       "acceptance per MT-Bench category with the serving verdict, in one run directory; rerun "
                       "the same command to resume.", allow_abbrev=False)
    p.add_argument("--recipe", choices=RECIPES, required=True)
    p.add_argument("--recipe-budget", choices=tuple(BUDGETS), default="short",
                   help="short: about 30 minutes on a 2-core CPU; full: a GPU or a long CPU run.")
    p.add_argument("--run-dir", default=None, help="default: runs/<recipe>-<budget> (a rerun resumes it).")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..common.cli import report_failure
    from ..common.errors import RunError
    from .smollm2 import MT_BENCH, SHAREGPT, SMOLLM2_GGUF, TARGET_NAME
    from .smollm2_job import Inputs, run_job

    args = build_parser().parse_args(argv)
    run_dir = args.run_dir or os.path.join("runs", f"{args.recipe}-{args.recipe_budget}")
    start = time.monotonic()
    try:
        inputs = Inputs(gguf=SMOLLM2_GGUF.path(), sharegpt=SHAREGPT.path(), mt_bench=MT_BENCH.path(), name=TARGET_NAME)
        run_job(inputs, BUDGETS[args.recipe_budget], run_dir, log=lambda line: print(line, flush=True))
    except RunError as err:
        report_failure("pretrain_dflash.py", err)
        return 1
    print(f"[recipe] {args.recipe} ({args.recipe_budget}) finished in {time.monotonic() - start:.0f}s: {run_dir}")
    return 0
