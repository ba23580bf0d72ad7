"""`tools/cache_target_states.py` end to end: killed (SIGKILL) at random points and rerun, the cache equals an
uninterrupted one byte for byte; its storage line and its refusals (too little free space, a differing manifest,
a bad command line).

The writers are forked from this process (torch is loaded once), so a kill lands in the writing itself rather
than in an import: each child is a whole run of the tool's `main`, killed by SIGKILL like any process."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import namedtuple

import pytest

from entry_points import cache_states_module
from training_runs import STEPS_ARGS

pytestmark = pytest.mark.usefixtures("one_thread")

KILLS = 10
SHARD = ["--dflash-target-cache-shard-size", "1"]  # 80 shards of the 64 + 16 samples: kills land between and in them


def tool_argv(target, cache, *extra) -> list:
    return ["--target", target, *STEPS_ARGS, "--micro-batch-size", "2", "--global-batch-size", "2",
            "--dflash-target-cache", str(cache), *SHARD, *extra]


def _tool_child(argv):
    import sys

    import torch

    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    os._exit(cache_states_module().main(argv))


def spawn_tool(argv):
    """The tool in a fresh process: a forked child inherits the state of any gloo group an earlier in-process run
    of this pytest process made (its transport's threads are not forked), and hangs in its own first collective."""
    proc = multiprocessing.get_context("spawn").Process(target=_tool_child, args=(argv,))
    proc.start()
    return proc


def every_file(out) -> dict:
    """Every entry of the cache directory (hidden leftovers too) and its bytes."""
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


def shards_done(out) -> int:
    return sum(n.endswith(".safetensors") for n in os.listdir(out)) if os.path.isdir(out) else 0


Whole = namedtuple("Whole", "cache seconds")


@pytest.fixture(scope="module")
def whole(tiny_target, tmp_path_factory):
    cache = tmp_path_factory.mktemp("whole") / "cache"
    start = time.monotonic()
    proc = spawn_tool(tool_argv(tiny_target, cache))
    proc.join()
    assert proc.exitcode == 0
    return Whole(cache, time.monotonic() - start)


def test_killed_at_random_points_and_rerun_equals_an_uninterrupted_cache(whole, tiny_target, tmp_path):
    rng = random.Random(0)
    out, killed, total = tmp_path / "killed", 0, shards_done(whole.cache)
    per_shard = whole.seconds / total / 2  # the whole run's time includes its start: a shard takes less
    while killed < KILLS and shards_done(out) < total:
        proc = spawn_tool(tool_argv(tiny_target, out))
        wait_for = shards_done(out) + rng.randrange(2)
        while proc.is_alive() and shards_done(out) < wait_for:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, per_shard))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            killed += 1
        proc.join()
    assert killed == KILLS
    proc = spawn_tool(tool_argv(tiny_target, out))
    proc.join()
    assert proc.exitcode == 0
    assert every_file(out) == every_file(whole.cache)


def test_storage_line_and_refusals(whole, tiny_target, tmp_path, capsys, monkeypatch):
    import shutil

    tool = cache_states_module()
    # the storage of a sample before anything is written; too little free space refuses
    free = namedtuple("usage", "total used free")(1 << 30, 0, 1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: free)
    assert tool.main(tool_argv(tiny_target, tmp_path / "small")) == 1
    out = capsys.readouterr()
    per_sample = 48 * (2 * 128 * 4 + 8)  # tokens x (taps x hidden x bytes + the token id)
    assert f"= {per_sample / 2**20:.3f} MiB; 80 sample(s) to write" in out.out
    assert out.err.strip().splitlines() == [  # one line, before the target is loaded
        f"cache_target_states.py: error: not enough free space for the target-state cache in {tmp_path / 'small'}: "
        f"storage per sample: up to 48 tokens x (2 taps) x 128 hidden x 4 bytes = {per_sample / 2**20:.3f} MiB; 80 "
        "sample(s) to write: up to 0.004 GiB, 0.000 GiB free; free space or choose another directory (or "
        "--dflash-target-cache-dtype bfloat16)."]
    assert shards_done(tmp_path / "small") == 0
    monkeypatch.undo()
    # a cache written for other settings: refused naming the field, nothing rewritten
    before = every_file(whole.cache)
    assert tool.main(tool_argv(tiny_target, whole.cache, "--dflash-target-layer-ids", "2,4")) == 1
    assert "target_layer_ids: cache (1, 3), run (2, 4)" in capsys.readouterr().err
    assert every_file(whole.cache) == before
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--target", tiny_target, "--data-format", "synthetic"])
    assert exit_.value.code == 2 and "--dflash-target-cache DIR is required" in capsys.readouterr().err
