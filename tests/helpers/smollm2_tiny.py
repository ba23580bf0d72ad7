"""The SmolLM2 job's inputs at test size: a tiny random Llama written as a GGUF (the real one's architecture:
tied embeddings, 3 KV heads, a ChatML template with a system turn), a ShareGPT file of short asks, an MT-Bench
question file with two questions per category, and a budget of seconds (`TINY_BUDGET`)."""

from __future__ import annotations

import json

from gguf_files import tiny_llama_gguf
from megatron_dflash.recipes.budgets import Budget
from megatron_dflash.recipes.smollm2_job import Inputs

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
ASKS = ["What is the capital of France?", "Write a short poem about the sea and the wind.",
        "How do I sort a list in Python?", "Explain why the sky is blue in two sentences.",
        "What is the quick brown fox?", "How is the wind of the sea?", "Write the capital of the sky.",
        "Explain how you sort the list.", "What is your poem about the dog?", "How do you write Python?"]

TINY_BUDGET = Budget("tiny", prompts=8, max_new_tokens=12, on_truncated="drop-rest", draft_layers=1, block_size=4,
                     anchors=4, seq_length=96, train_iters=4, micro_batch=2, global_batch=4,
                     questions_per_category=1, eval_max_new_tokens=8, prompt_min_tokens=2, prompt_max_tokens=64,
                     shard_size=4)


def tiny_inputs(root) -> Inputs:
    """The job's `Inputs` written under `root` (a `pathlib.Path`), the converted target cached there too."""
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
