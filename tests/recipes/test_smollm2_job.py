"""The SmolLM2 job's whole pipeline on a tiny random Llama written as a GGUF (the real one's architecture: tied
embeddings, 3 KV heads, a ChatML template with a system turn), with a budget of seconds: every stage leaves its
output in the run directory, a rerun skips the stages done, and the report has a row per MT-Bench category."""

import json
import os

import pytest

pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package (pip install gguf)")

from gguf_files import tiny_llama_gguf  # noqa: E402
from megatron_dflash.recipes.budgets import Budget  # noqa: E402
from megatron_dflash.recipes.smollm2_job import Inputs, run_job  # noqa: E402

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
ASKS = ["What is the capital of France?", "Write a short poem about the sea and the wind.",
        "How do I sort a list in Python?", "Explain why the sky is blue in two sentences.",
        "What is the quick brown fox?", "How is the wind of the sea?", "Write the capital of the sky.",
        "Explain how you sort the list.", "What is your poem about the dog?", "How do you write Python?"]

TINY = Budget("tiny", prompts=8, max_new_tokens=12, on_truncated="drop-rest", draft_layers=1, block_size=4,
              anchors=4, seq_length=96, train_iters=4, micro_batch=2, global_batch=4, questions_per_category=1,
              eval_max_new_tokens=8, prompt_min_tokens=2, prompt_max_tokens=64, shard_size=4)


def _inputs(root) -> Inputs:
    tiny_llama_gguf(str(root / "tiny.gguf"))
    chats = [{"id": f"c{i}", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}
             for i, text in enumerate(ASKS)]
    (root / "sharegpt.json").write_text(json.dumps(chats))
    with open(root / "question.jsonl", "w") as f:
        for i, category in enumerate(CATEGORIES * 2):
            f.write(json.dumps({"question_id": 81 + i, "category": category,
                                "turns": [ASKS[i % len(ASKS)], "Explain why in two sentences."]}) + "\n")
    return Inputs(gguf=str(root / "tiny.gguf"), sharegpt=str(root / "sharegpt.json"),
                  mt_bench=str(root / "question.jsonl"), name="tiny", cache_dir=str(root / "cache"))


def test_the_short_pipeline_runs_every_stage_resumes_and_reports_per_category(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stages' own processes
    inputs, run_dir = _inputs(tmp_path), str(tmp_path / "run")
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
