"""`benchmarks/bench_quality.py` on the SmolLM2 job's data at test size: both trainers train a draft per seed on
the same regenerated chats and cache, the same decoder measures both, and the report has every MT-Bench category
for every side and seed, with each training's cost."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package (pip install gguf)")
pytest.importorskip("nemo_automodel", reason="the reference side is NeMo AutoModel's trainer (installed by the set-up)")

from megatron_dflash.recipes.smollm2_job import stages  # noqa: E402
from megatron_dflash.recipes.stages import run_stages  # noqa: E402
from repo_paths import REPO_ROOT  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from smollm2_tiny import CATEGORIES, TINY_BUDGET, tiny_inputs  # noqa: E402

STAGES_BEFORE_TRAINING = 4  # target, prompts, regenerate, cache


def test_both_trainers_train_on_the_same_data_and_are_measured_by_the_same_decoder(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    inputs, run_dir = tiny_inputs(tmp_path), str(tmp_path / "run")
    run_stages(run_dir, stages(inputs, TINY_BUDGET, run_dir, log=lambda _: None)[:STAGES_BEFORE_TRAINING],
               log=lambda _: None)
    budget_file = tmp_path / "budget.json"
    budget_file.write_text(json.dumps(dataclasses.asdict(TINY_BUDGET)))
    output, work = tmp_path / "quality.json", tmp_path / "work"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_quality.py"), "--run-dir", run_dir,
                           "--budget", str(budget_file), "--train-iters", "3", "--seeds", "2", "--mt-bench",
                           inputs.mt_bench, "--work-dir", str(work), "--output", str(output)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads(output.read_text())
    assert report["seeds"] == [1, 2] and report["budget"]["train_iters"] == 3
    for side in ("ours", "nemo"):
        for seed in ("1", "2"):
            result = report["results"][side][seed]
            assert set(result["acceptance"]) == set(CATEGORIES) | {"all"}  # spread over the categories
            assert all(value >= 1.0 for value in result["acceptance"].values())
            assert result["greedy_outputs_identical_fraction"] == 1.0  # one decoder, lossless for both
            assert result["train"]["cpu_s"] > 0 and result["train"]["peak_rss_mib"] > 0
    assert "[nemo] step 3/3" in done.stdout  # NeMo's side ran the budget's steps
    # Each seed trains its own draft on each side.
    for side in ("ours", "nemo"):
        one, two = (load_file(next(os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")))
                    for d in (str(work / f"{side}-seed{s}" / "hf") for s in (1, 2)))
        assert one.keys() == two.keys()
        assert any(not one[k].equal(two[k]) for k in one), side
    assert "nemo / ours" in done.stdout and "| all |" in done.stdout
