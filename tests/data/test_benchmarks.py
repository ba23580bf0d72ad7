"""Benchmark prompt sets read from their published layouts (a few records of each, written here), and asked as
the DFlash evaluation asks them: the reference package's own formatting (`dflash.benchmark.DATASETS`) is the
oracle for the five sets it covers."""

import gzip
import json

import pytest

from megatron_dflash.data.benchmarks import (
    BENCHMARK_NAMES,
    BOXED_INSTRUCTION,
    BenchmarkError,
    missing_file_message,
    read_benchmark,
)

dflash_benchmark = pytest.importorskip("dflash.benchmark")

# A few records of each set, field for field as published (values shortened).
LAYOUTS = {
    "mt-bench": [  # FastChat's question.jsonl
        {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post about Hawaii.",
                                                             "Rewrite your previous response with A words."]},
        {"question_id": 101, "category": "reasoning", "turns": ["You overtake the second person. Where are you?",
                                                               "What if you overtake the last person?"],
         "reference": ["second", "impossible"]},
    ],
    "gsm8k": [
        {"question": "Janet's ducks lay 16 eggs per day. How much does she make?", "answer": "... #### 18"},
        {"question": "A robe takes 2 bolts of blue fiber. How many bolts in total?", "answer": "#### 3"},
    ],
    "humaneval": [
        {"task_id": "HumanEval/0", "prompt": "def has_close_elements(numbers, threshold):\n    \"\"\"...\"\"\"\n",
         "canonical_solution": "    return False\n", "test": "def check(candidate): pass", "entry_point": "x"},
    ],
    "mbpp": [
        {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,  # sanitized-mbpp.json
         "prompt": "Write a function to find the shared elements from the given two lists.",
         "code": "def similar_elements(a, b): ...", "test_imports": [],
         "test_list": ["assert set(similar_elements((3, 4), (5, 4))) == set((4,))"]},
        {"text": "Write a function to find the minimum cost path.", "code": "def min_cost(): ...",  # mbpp.jsonl
         "task_id": 1, "test_setup_code": "", "test_list": ["assert min_cost() == 8"], "challenge_test_list": []},
    ],
    "math500": [
        {"problem": "Convert the point $(0,3)$ to polar coordinates.", "solution": "...", "answer": "(3, \\pi/2)",
         "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
        {"problem": "What is $1+1$?", "solution": "2", "answer": "2", "subject": "Algebra", "level": 1,
         "unique_id": "test/algebra/1.json"},
    ],
    "alpaca": [
        {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well."},
        {"instruction": "Translate the sentence.", "input": "Bonjour", "output": "Hello"},
    ],
    "livecodebench": [
        {"question_title": "A. Short Sort", "question_content": "  There are three cards a, b, c.\n",
         "platform": "codeforces", "question_id": "1873A", "contest_id": "1873", "contest_date": "2023-08-21",
         "starter_code": "", "difficulty": "easy", "public_test_cases": "[]", "private_test_cases": "",
         "metadata": "{}"},
    ],
}


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("name", ["gsm8k", "math500", "humaneval", "mbpp"])
def test_single_turn_sets_are_asked_as_the_dflash_evaluation_asks_them(tmp_path, name):
    path = _write_jsonl(tmp_path / f"{name}.jsonl", LAYOUTS[name])
    items = read_benchmark(name, path)
    formatting = dflash_benchmark.DATASETS[name]["format"]
    for item, record in zip(items, LAYOUTS[name]):
        if name == "mbpp" and "prompt" not in record:  # the reference reads only the sanitized layout
            record = {**record, "prompt": record["text"]}
        assert item.turns == (formatting(record),)
        assert item.set == name
    assert [item.where for item in items] == [f"{path}:{k + 1}" for k in range(len(LAYOUTS[name]))]


def test_mt_bench_keeps_both_turns_and_the_category(tmp_path):
    items = read_benchmark("mt-bench", _write_jsonl(tmp_path / "question.jsonl", LAYOUTS["mt-bench"]))
    assert [(i.question_id, i.category) for i in items] == [("81", "writing"), ("101", "reasoning")]
    assert items[0].turns == tuple(LAYOUTS["mt-bench"][0]["turns"])
    # the HF copy of the set (prompt_id / prompt), formatted as the reference formats it
    hf = [{"prompt": r["turns"], "prompt_id": r["question_id"], "category": r["category"]}
          for r in LAYOUTS["mt-bench"]]
    hf_items = read_benchmark("mt-bench", _write_jsonl(tmp_path / "hf.jsonl", hf))
    assert [i.turns for i in hf_items] == [tuple(dflash_benchmark.DATASETS["mt-bench"]["format"](r)) for r in hf]
    assert [i.question_id for i in hf_items] == ["81", "101"]


def test_categories_ids_and_the_other_sets(tmp_path):
    math = read_benchmark("math500", _write_jsonl(tmp_path / "m.jsonl", LAYOUTS["math500"]))
    assert [(i.question_id, i.category) for i in math] == [("test/precalculus/807.json", "Precalculus"),
                                                           ("test/algebra/1.json", "Algebra")]
    assert math[1].turns == (f"What is $1+1$?\n{BOXED_INSTRUCTION}",)
    alpaca = read_benchmark("alpaca", _write_jsonl(tmp_path / "a.jsonl", LAYOUTS["alpaca"]))
    assert [i.turns for i in alpaca] == [("Give three tips for staying healthy.",),
                                         ("Translate the sentence.\n\nBonjour",)]
    assert {i.category for i in alpaca} == {"alpaca"}
    lcb = read_benchmark("livecodebench", _write_jsonl(tmp_path / "l.jsonl", LAYOUTS["livecodebench"]))
    assert (lcb[0].question_id, lcb[0].category, lcb[0].turns) == ("1873A", "easy",
                                                                   ("There are three cards a, b, c.",))
    gsm = read_benchmark("gsm8k", _write_jsonl(tmp_path / "g.jsonl", LAYOUTS["gsm8k"]), limit=1)
    assert [(i.question_id, i.category) for i in gsm] == [("0", "gsm8k")]


def test_json_array_files_name_records_by_index(tmp_path):
    path = tmp_path / "alpaca_data.json"  # Alpaca is published as one JSON array
    path.write_text(json.dumps(LAYOUTS["alpaca"]))
    items = read_benchmark("alpaca", str(path))
    assert [i.where for i in items] == [f"{path}[0]", f"{path}[1]"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([LAYOUTS["alpaca"][0], {"input": "x", "output": "y"}]))
    with pytest.raises(BenchmarkError, match=r"bad\.json\[1\]: field 'instruction' is missing"):
        read_benchmark("alpaca", str(bad))


@pytest.mark.parametrize("name,field", [("mt-bench", "turns"), ("mt-bench", "category"), ("gsm8k", "question"),
                                        ("humaneval", "prompt"), ("humaneval", "task_id"), ("math500", "problem"),
                                        ("livecodebench", "question_content")])
def test_a_record_without_a_field_is_named_by_file_line_and_field(tmp_path, name, field):
    records = [dict(r) for r in LAYOUTS[name]] + [dict(LAYOUTS[name][0])]
    del records[-1][field]
    path = _write_jsonl(tmp_path / "set.jsonl", records)
    with pytest.raises(BenchmarkError) as err:
        read_benchmark(name, path)
    message = str(err.value)
    assert message.startswith(f"{path}:{len(records)}: field {field!r} is missing") and "\n" not in message


def test_bad_values_and_files(tmp_path):
    turns = _write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "x", "turns": "one string"}])
    with pytest.raises(BenchmarkError, match=r"q\.jsonl:1: field 'turns' is not a list of non-empty strings"):
        read_benchmark("mt-bench", turns)
    not_gzip = tmp_path / "HumanEval.jsonl.gz"
    not_gzip.write_text(json.dumps(LAYOUTS["humaneval"][0]) + "\n")  # named .gz, not compressed
    with pytest.raises(BenchmarkError, match=r"HumanEval\.jsonl\.gz: not a readable gzip file") as err:
        read_benchmark("humaneval", str(not_gzip))
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(BenchmarkError, match="holds no gsm8k question"):
        read_benchmark("gsm8k", str(empty))
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"question": "a"}\n{"question": \n')
    with pytest.raises(BenchmarkError, match=r"broken\.jsonl:2: invalid JSON"):
        read_benchmark("gsm8k", str(not_json))
    with pytest.raises(BenchmarkError, match="unknown benchmark"):
        read_benchmark("mmlu", str(empty))


def test_every_set_says_where_its_file_is_published():
    for name in BENCHMARK_NAMES:
        message = missing_file_message(name)
        assert message.startswith(f"--benchmark {name} needs --benchmark-file PATH") and "\n" not in message


def test_compressed_files_are_read_as_published(tmp_path):
    """HumanEval is published as HumanEval.jsonl.gz and MBPP's JSON copies gzipped too: read as they are, the
    questions and their places equal those of the uncompressed file."""
    for name, file in (("humaneval", "HumanEval.jsonl"), ("mbpp", "mbpp.jsonl"), ("alpaca", "alpaca_data.json")):
        plain = tmp_path / file
        text = (json.dumps(LAYOUTS[name]) if file.endswith(".json")
                else "".join(json.dumps(r) + "\n" for r in LAYOUTS[name]))
        plain.write_text(text)
        packed = tmp_path / (file + ".gz")
        packed.write_bytes(gzip.compress(text.encode()))
        want, got = read_benchmark(name, str(plain)), read_benchmark(name, str(packed))
        assert [(i.question_id, i.category, i.turns) for i in got] == [(i.question_id, i.category, i.turns)
                                                                       for i in want]
        assert [i.where for i in got] == [i.where.replace(str(plain), str(packed)) for i in want]


def test_a_limit_spreads_the_questions_over_the_categories(tmp_path):
    """MT-Bench's question.jsonl is written category by category (10 writing, then 10 roleplay, ...): a subset
    takes the first question of every category, then the second, ..., each kept in file order."""
    categories = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    records = [{"question_id": 81 + 10 * c + k, "category": name, "turns": [f"{name} question {k}", "again"]}
               for c, name in enumerate(categories) for k in range(10)]
    path = _write_jsonl(tmp_path / "question.jsonl", records)
    eight = read_benchmark("mt-bench", path, limit=8)
    assert [i.category for i in eight] == categories
    assert [i.turns[0] for i in eight] == [f"{name} question 0" for name in categories]
    sixteen = read_benchmark("mt-bench", path, limit=16)
    assert [(i.category, i.turns[0][-1]) for i in sixteen] == [(name, k) for name in categories for k in "01"]
    three = read_benchmark("mt-bench", path, limit=3)
    assert [i.category for i in three] == categories[:3]
    assert len(read_benchmark("mt-bench", path, limit=1000)) == 80
    gsm = read_benchmark("gsm8k", _write_jsonl(tmp_path / "g.jsonl", LAYOUTS["gsm8k"] * 3), limit=4)
    assert [i.question_id for i in gsm] == ["0", "1", "2", "3"]  # one category: the first four
