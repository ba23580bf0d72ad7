"""Benchmark prompt sets in their published file layouts, asked as the DFlash papers' evaluation asks them.

`tools/evaluate_acceptance.py --benchmark NAME --benchmark-file PATH` reads one set's file as it is published
(docs/design.md §7 Module map; README "Speculative decoding"). Each record becomes a `BenchmarkItem`: an id, a
category and the user's turns, already worded as the evaluation asks them; the chat template of the target
renders them later (`decoding/benchmark_turns.py`), with no system prompt and thinking off unless asked.

Per set: the fields read (the published layout), the category, and the user's turn as asked.

* ``mt-bench``: ``question_id``, ``category``, ``turns`` (FastChat's ``question.jsonl``; the HF copy's
  ``prompt_id`` / ``prompt`` too); category ``category``; each turn as written.
* ``gsm8k``: ``question`` (``answer`` ignored); category ``gsm8k``; the question, then `BOXED_INSTRUCTION`.
* ``humaneval``: ``task_id``, ``prompt``; category ``humaneval``; the stub in a Python block, asked to be
  solved so that its tests pass.
* ``mbpp``: ``task_id``, ``prompt`` (sanitized) or ``text`` (full); ``test_list`` is not part of the question,
  as in the DFlash evaluation; category ``mbpp``; the description as written.
* ``math500``: ``problem``, ``subject``, ``unique_id``; category ``subject``; the problem, then
  `BOXED_INSTRUCTION`.
* ``alpaca``: ``instruction``, ``input``; category ``alpaca``; the instruction, then the input after a blank
  line when it has one.
* ``livecodebench``: ``question_content``, ``question_id``, ``difficulty``; category ``difficulty``; the
  question as written.

The files are read through `data.formats.open_records` (JSONL and JSON arrays, gzipped as HumanEval and MBPP are
published or not, Parquet, ``save_to_disk`` directories): a record's place is ``file:line`` (JSONL) or ``file[index]``. A record without a field its set
needs is a `BenchmarkError` naming that place and the field. Nothing here downloads anything, and no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ..common.errors import DataError
from .formats import open_records
from .prompts import spread_over_categories

__all__ = [
    "BENCHMARK_NAMES",
    "BOXED_INSTRUCTION",
    "BenchmarkError",
    "BenchmarkItem",
    "BenchmarkSet",
    "BENCHMARK_SETS",
    "benchmark_set",
    "missing_file_message",
    "read_benchmark",
]

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""What the DFlash evaluation appends (on its own line) to a GSM8K or MATH-500 question."""


class BenchmarkError(ValueError):
    """A benchmark file or record that cannot be used; the message names the file (and line) and the field."""


@dataclasses.dataclass(frozen=True)
class BenchmarkItem:
    """One question of a set: ``turns`` are the user's messages in order (one, or MT-Bench's two), worded as
    the evaluation asks them; ``where`` is the record's place in its file."""

    set: str
    question_id: str
    category: str
    turns: tuple
    where: str


def _text(record: dict, field: str, where: str, layout: str) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        shown = "missing" if field not in record else f"not a non-empty string ({type(value).__name__})"
        raise BenchmarkError(f"{where}: field {field!r} is {shown}; expected {layout}.")
    return value


def _optional(record: dict, field: str) -> Optional[str]:
    value = record.get(field)
    if value is None or isinstance(value, bool):
        return None
    return str(value) if str(value).strip() else None


def _mt_bench(record: dict, where: str, index: int) -> tuple:
    layout = "MT-Bench question.jsonl records {question_id, category, turns: [first, second]}"
    turns = record.get("turns", record.get("prompt"))  # the HF copy names the turns 'prompt'
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        field = "turns" if "prompt" not in record else "prompt"
        shown = "missing" if field not in record else "not a list of non-empty strings"
        raise BenchmarkError(f"{where}: field {field!r} is {shown}; expected {layout}.")
    category = _text(record, "category", where, layout)
    qid = _optional(record, "question_id") or _optional(record, "prompt_id") or str(index)
    return qid, category, tuple(turns)


def _gsm8k(record: dict, where: str, index: int) -> tuple:
    question = _text(record, "question", where, "GSM8K test.jsonl records {question, answer}")
    return str(index), "gsm8k", (f"{question}\n{BOXED_INSTRUCTION}",)


def _humaneval(record: dict, where: str, index: int) -> tuple:
    layout = "HumanEval records {task_id, prompt, ...}"
    task = _text(record, "task_id", where, layout)
    stub = _text(record, "prompt", where, layout)
    return task, "humaneval", ("Write a solution to the following problem and make sure that it passes the "
                               f"tests:\n```python\n{stub}\n```",)


def _mbpp(record: dict, where: str, index: int) -> tuple:
    field = "prompt" if "prompt" in record else "text"  # sanitized: prompt; full: text
    layout = "MBPP records {task_id, prompt (sanitized) or text (full), test_list}"
    description = _text(record, field, where, layout)
    return _optional(record, "task_id") or str(index), "mbpp", (description,)


def _math500(record: dict, where: str, index: int) -> tuple:
    problem = _text(record, "problem", where, "MATH-500 records {problem, subject, level, unique_id, ...}")
    category = _optional(record, "subject") or "math500"
    return _optional(record, "unique_id") or str(index), category, (f"{problem}\n{BOXED_INSTRUCTION}",)


def _alpaca(record: dict, where: str, index: int) -> tuple:
    instruction = _text(record, "instruction", where, "Alpaca records {instruction, input, output}")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BenchmarkError(f"{where}: field 'input' is not a string ({type(extra).__name__}); expected Alpaca "
                             "records {instruction, input, output}.")
    return str(index), "alpaca", (f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction,)


def _livecodebench(record: dict, where: str, index: int) -> tuple:
    layout = "LiveCodeBench code_generation records {question_title, question_content, question_id, difficulty}"
    content = _text(record, "question_content", where, layout)
    qid = _optional(record, "question_id") or _optional(record, "question_title") or str(index)
    return qid, _optional(record, "difficulty") or "livecodebench", (content.strip(),)


@dataclasses.dataclass(frozen=True)
class BenchmarkSet:
    """A prompt set: its name, where its file is published, and the reader of one record (``(record, where,
    index)`` -> ``(question_id, category, turns)``)."""

    name: str
    published: str
    read: Callable[[dict, str, int], tuple]


BENCHMARK_SETS = {s.name: s for s in (
    BenchmarkSet("mt-bench", "FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl (lm-sys/FastChat), or a "
                 "JSONL/Parquet copy of the HF data set HuggingFaceH4/mt_bench_prompts", _mt_bench),
    BenchmarkSet("gsm8k", "grade_school_math/data/test.jsonl of openai/grade-school-math, or the test split of the "
                 "HF data set openai/gsm8k (main)", _gsm8k),
    BenchmarkSet("humaneval", "data/HumanEval.jsonl.gz of openai/human-eval, or the HF data set "
                 "openai/openai_humaneval", _humaneval),
    BenchmarkSet("mbpp", "sanitized-mbpp.json or mbpp.jsonl of google-research/google-research (mbpp/), or the HF "
                 "data set google-research-datasets/mbpp (sanitized, test split)", _mbpp),
    BenchmarkSet("math500", "test.jsonl of the HF data set HuggingFaceH4/MATH-500", _math500),
    BenchmarkSet("alpaca", "alpaca_data.json of tatsu-lab/stanford_alpaca, or the HF data set tatsu-lab/alpaca",
                 _alpaca),
    BenchmarkSet("livecodebench", "a test*.jsonl of the HF data set livecodebench/code_generation_lite",
                 _livecodebench),
)}
BENCHMARK_NAMES = tuple(BENCHMARK_SETS)


def benchmark_set(name: str) -> BenchmarkSet:
    if name not in BENCHMARK_SETS:
        raise BenchmarkError(f"unknown benchmark {name!r}; one of {', '.join(BENCHMARK_NAMES)}.")
    return BENCHMARK_SETS[name]


def read_benchmark(name: str, path: str, limit: Optional[int] = None) -> list[BenchmarkItem]:
    """The questions of set ``name``'s file at ``path`` (gzipped as published, or not), in file order; with
    ``limit``, that many spread over the categories (`data.prompts.spread_over_categories`). Every record is
    read and checked, also with a limit."""
    bench = benchmark_set(name)
    try:
        source = open_records(path)
    except (DataError, OSError) as err:
        raise BenchmarkError(f"--benchmark-file {path}: {err}") from None
    items: list[BenchmarkItem] = []
    for index in range(len(source)):
        where = source.where(index)
        try:
            record: Any = source.record(index)
        except DataError as err:
            raise BenchmarkError(str(err)) from None
        if not isinstance(record, dict):
            raise BenchmarkError(f"{where}: expected a JSON object (a {name} record), got {type(record).__name__}.")
        qid, category, turns = bench.read(record, where, index)
        items.append(BenchmarkItem(name, qid, category, turns, where))
    if not items:
        raise BenchmarkError(f"{path} holds no {name} question.")
    return spread_over_categories(items, limit, lambda item: item.category)


def missing_file_message(name: str) -> str:
    """The one line that says where set ``name``'s file is published (nothing is downloaded)."""
    return (f"--benchmark {name} needs --benchmark-file PATH: the set as published, {benchmark_set(name).published}; "
            "nothing is downloaded")

