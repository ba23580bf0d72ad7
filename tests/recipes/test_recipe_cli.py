"""`pretrain_dflash.py --recipe`: the recipe's own command line, refused in one usage line when it names no
recipe we have or a training flag (a recipe chooses those itself)."""

import os
import subprocess
import sys

from megatron_dflash.recipes import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_recipe_flag_is_seen_in_either_spelling():
    assert cli.wants_recipe(["--recipe", "smollm2-135m"]) and cli.wants_recipe(["--recipe=smollm2-135m"])
    assert not cli.wants_recipe(["--recipe-budget", "short"]) and not cli.wants_recipe([])


def test_defaults_are_the_short_budget_and_a_run_directory_per_recipe_and_budget():
    args = cli.build_parser().parse_args(["--recipe", "smollm2-135m"])
    assert (args.recipe_budget, args.run_dir) == ("short", None)


def test_an_unknown_recipe_or_a_training_flag_is_a_usage_error_before_anything_runs():
    for extra in (["--recipe", "qwen9"], ["--recipe", "smollm2-135m", "--seq-length", "64"]):
        done = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_dflash.py"), *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "pretrain_dflash.py --recipe" in done.stderr and "Traceback" not in done.stderr
