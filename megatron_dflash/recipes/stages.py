"""The stages of a ready-made job, each resumable: a stage whose record (`<run dir>/stages/<name>.json`) exists
is done and skipped; a stage interrupted midway runs again, and the ones that keep partial work (regeneration's
shards, the cache's shards, training's checkpoints) resume it. A stage's record holds what it produced (paths,
counts, figures), which later stages and the summary read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..common.atomic import write_file
from ..common.errors import RunError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StageFailed(RunError):
    """A stage's command exited non-zero (its own lines say why)."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[dict], dict]  # the records of the earlier stages -> this stage's record


def record_path(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, "stages", f"{name}.json")


def read_record(run_dir: str, name: str) -> Optional[dict]:
    try:
        with open(record_path(run_dir, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_stages(run_dir: str, stages: Sequence[Stage], log: Callable[[str], None] = print) -> dict:
    """Every stage in order, the done ones skipped; returns {name: record}."""
    records: dict = {}
    for number, stage in enumerate(stages, 1):
        done = read_record(run_dir, stage.name)
        if done is not None:
            log(f"[recipe] stage {number}/{len(stages)} {stage.name}: done before, skipped")
            records[stage.name] = done
            continue
        log(f"[recipe] stage {number}/{len(stages)} {stage.name}: running")
        start = time.monotonic()
        record = dict(stage.run(records))
        record["seconds"] = round(time.monotonic() - start, 1)
        os.makedirs(os.path.dirname(record_path(run_dir, stage.name)), exist_ok=True)
        write_file(record_path(run_dir, stage.name), (json.dumps(record, indent=2) + "\n").encode())
        log(f"[recipe] stage {number}/{len(stages)} {stage.name}: done ({record['seconds']:.0f}s)")
        records[stage.name] = record
    return records


def run_entry_point(script: str, argv: Sequence[str], log: Callable[[str], None] = print) -> None:
    """One of the package's entry points (`pretrain_dflash.py`, `tools/...py`) in a process of its own, its lines
    passed through: each starts its own torch.distributed group, which one process holds only once."""
    command = [sys.executable, os.path.join(REPO_ROOT, script), *argv]
    log(f"[recipe] $ {' '.join(command[1:])}")
    sys.stdout.flush()  # this process's lines before the child's, in a log file too
    status = subprocess.call(command, cwd=REPO_ROOT)
    if status != 0:
        raise StageFailed(f"{script} exited with status {status}; its lines above say why. Run the same "
                          "command again to resume from the stages already done.")
