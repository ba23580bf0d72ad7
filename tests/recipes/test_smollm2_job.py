"""The SmolLM2 job's whole pipeline on a tiny random Llama written as a GGUF (the real one's architecture: tied
embeddings, 3 KV heads, a ChatML template with a system turn), with a budget of seconds: every stage leaves its
output in the run directory, a rerun skips the stages done, and the report has a row per MT-Bench category."""

import json
import os

import pytest

pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package (pip install gguf)")

from megatron_dflash.recipes.smollm2_job import run_job  # noqa: E402
from smollm2_tiny import CATEGORIES, TINY_BUDGET as TINY, tiny_inputs  # noqa: E402


def test_the_short_pipeline_runs_every_stage_resumes_and_reports_per_category(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stages' own processes
    inputs, run_dir = tiny_inputs(tmp_path), str(tmp_path / "run")
    lines = []
    summary = run_job(inputs, TINY, run_dir, log=lines.append)

    assert os.path.isfile(os.path.join(inputs.cache_dir, "tiny", "model.safetensors"))
    assert sum(1 for _ in open(os.path.join(run_dir, "data", "prompts.jsonl"))) == 8
    assert os.path.isfile(os.path.join(run_dir, "data", "chats", "_manifest.json"))
    assert os.path.isfile(os.path.join(run_dir, "target_cache", "index.json"))  # 2 epochs: the cache pays
    assert os.path.isfile(os.path.join(run_dir, "train", "summary.json"))
    assert os.path.isfile(os.path.join(run_dir, "train", "hf", "config.json"))
    assert os.path.isfile(os.path.join(run_dir, "eval", "mt_bench.json"))
    on_disk = json.load(open(os.path.join(run_dir, "summary.json")))
    assert on_disk == summary
    rows = {line["category"] for line in summary["categories"] if line["kind"] == "category"}
    assert rows == set(CATEGORIES)  # one question per category, not the file's first eight
    assert summary["greedy_outputs_identical_fraction"] == 1.0  # lossless
    assert summary["decode_acceptance_length"] >= 1.0 and summary["tokens_per_target_forward"] >= 1.0
    assert summary["serving"]

    os.remove(os.path.join(run_dir, "stages", "serving.json"))  # a stage interrupted: only it runs again
    again = []
    assert run_job(inputs, TINY, run_dir, log=again.append)["categories"] == summary["categories"]
    skipped = [line for line in again if line.endswith("done before, skipped")]
    assert len(skipped) == 6 and not any("$ " in line for line in again)
    assert any("serving: running" in line for line in again)
