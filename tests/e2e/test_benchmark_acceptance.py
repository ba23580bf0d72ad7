"""`tools/evaluate_acceptance.py --benchmark`: the per-category tables equal a direct `spec_generate` over the
same prompts, which this test formats itself (the target's chat template with the generation prompt, thinking
off) and decodes one by one; MT-Bench's second turn is asked after the generated first answer; `--compare`
puts two reports side by side; a bad benchmark file is one error line naming file:line and field."""

from __future__ import annotations

import json

import pytest
import torch

from entry_points import evaluate_module
from tiny_decoding import make_draft, qwen3_target

synthetic = pytest.importorskip("megatron_dflash.embedded_job.synthetic_corpus")

MT_BENCH = [  # FastChat's question.jsonl layout, in the tiny tokenizer's words
    {"question_id": 81, "category": "counting", "turns": ["count from 3 to 9", "count from 9 to 15"]},
    {"question_id": 82, "category": "spelling", "turns": ["spell the word fox", "spell the word river"]},
    {"question_id": 83, "category": "counting", "turns": ["count from 40 to 47", "count from 47 to 50"]},
]
MAX_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random target with the synthetic chat tokenizer, a random draft, both on disk, and an MT-Bench file."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = synthetic.build_tokenizer()
    target_dir, draft_dir = root / "target", root / "draft"
    qwen3_target(vocab=len(tokenizer), mode="mixed").save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    from megatron_dflash.checkpoint.hf import save_hf_checkpoint

    save_hf_checkpoint(make_draft(len(tokenizer), backend="chunked"), str(draft_dir))
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in MT_BENCH))
    return {"root": root, "target": str(target_dir), "draft": str(draft_dir), "questions": str(questions),
            "tokenizer": tokenizer}


def _run(models, *extra) -> tuple[int, dict]:
    tool = evaluate_module()
    out = models["root"] / f"report{len(list(models['root'].glob('report*.json')))}.json"
    code = tool.main(["--target", models["target"], "--draft", models["draft"], "--max-new-tokens", str(MAX_NEW),
                      "--device", "cpu", "--dtype", "float32", "--ignore-eos", "--warmup", "0",
                      "--output", str(out), *extra])
    return code, (json.loads(out.read_text()) if code == 0 else {})


def _direct(models, *, temperature=0.0, num_samples=1, seed=0) -> list:
    """The oracle: every turn formatted here and decoded alone by `spec_generate` (turn 2 after this decode's own
    first answer); rows ordered by question, sample, turn."""
    from transformers import AutoModelForCausalLM

    from megatron_dflash.checkpoint.hf import load_hf_checkpoint
    from megatron_dflash.data.benchmarks import BenchmarkItem
    from megatron_dflash.decoding.benchmark_turns import prompt_seed
    from megatron_dflash.decoding.generate import spec_generate

    tok = models["tokenizer"]
    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    draft = load_hf_checkpoint(models["draft"], attention_backend="chunked").eval()
    rows = []
    for q in MT_BENCH:
        item = BenchmarkItem("mt-bench", str(q["question_id"]), q["category"], tuple(q["turns"]), "")
        for sample in range(num_samples):
            messages = []
            for turn, question in enumerate(q["turns"]):
                messages.append({"role": "user", "content": question})
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              enable_thinking=False)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                generator = torch.Generator().manual_seed(prompt_seed(seed, item, sample, turn))
                out = spec_generate(target, draft, [ids], max_new_tokens=MAX_NEW, stop_token_ids=[],
                                    generator=generator, temperature=temperature, attention_backend="chunked")
                answer = tok.decode(out.generated(0), skip_special_tokens=True)
                rows.append({"category": q["category"], "turn": turn + 1, "cycles": out.acceptance_lengths[0],
                             "generated": out.generated(0), "answer": answer, "prompt_ids": ids})
                messages.append({"role": "assistant", "content": answer})
    return rows


def _by_category(rows) -> dict:
    """Acceptance length over every cycle and tokens per target forward, per category, per turn and overall."""
    groups = {}
    for row in rows:
        groups.setdefault(row["category"], []).append(row)
    for row in rows:
        if row.get("turn") is not None:
            groups.setdefault(f"turn {row['turn']}", []).append(row)
    groups["all"] = list(rows)
    return {c: (sum(sum(r["cycles"]) for r in g) / sum(len(r["cycles"]) for r in g),
                sum(len(r["generated"]) for r in g) / sum(1 + len(r["cycles"]) for r in g)) for c, g in groups.items()}


def _table(report) -> dict:
    return {line["category"]: (line["acceptance_length"], line["tokens_per_target_forward"])
            for line in report["categories"]}


def test_mt_bench_tables_equal_a_direct_spec_generate(models, capsys):
    code, report = _run(models, "--benchmark", "mt-bench", "--benchmark-file", models["questions"])
    assert code == 0
    direct = _direct(models)
    rows = report["prompts"]
    assert [(r["question_id"], r["turn"]) for r in rows] == [(str(q["question_id"]), t) for q in MT_BENCH
                                                             for t in (1, 2)]
    for row, expected in zip(rows, direct):
        assert row["acceptance_lengths"] == expected["cycles"]
        assert row["generated_ids"] == expected["generated"]
    assert _table(report) == _by_category(direct)
    assert [line["category"] for line in report["categories"]] == ["counting", "spelling", "turn 1", "turn 2",
                                                                   "all"]
    assert report["categories"][-1]["set"] == "mt-bench" and report["categories"][-1]["speedup"] > 0
    # The second turn is asked after the decode's own first answer.
    for q, first, second in zip(MT_BENCH, rows[0::2], rows[1::2]):
        text = second["prompt_text"]
        assert text.startswith(q["turns"][0]) and text.endswith(q["turns"][1])
        assert text[len(q["turns"][0]):-len(q["turns"][1])].strip() == first["generated_text"].strip() != ""
    assert report["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    printed = capsys.readouterr().out
    assert "[counting 81 turn 2]" in printed and "mt-bench (all)" in printed


def test_sampling_with_several_samples_per_question(models):
    code, report = _run(models, "--benchmark", "mt-bench", "--benchmark-file", models["questions"],
                        "--temperature", "1", "--num-samples", "2", "--seed", "3", "--no-baseline")
    assert code == 0
    rows = report["prompts"]
    assert len(rows) == len(MT_BENCH) * 2 * 2
    assert [(r["question_id"], r["sample"], r["turn"]) for r in rows[:4]] == [("81", 0, 1), ("81", 0, 2),
                                                                              ("81", 1, 1), ("81", 1, 2)]
    assert len({r["seed"] for r in rows}) == len(rows)
    assert report["settings"]["num_samples"] == 2
    direct = _direct(models, temperature=1.0, num_samples=2, seed=3)
    for row, expected in zip(rows, direct):
        assert row["generated_ids"] == expected["generated"]
        assert row["acceptance_lengths"] == expected["cycles"]
    assert _table(report) == _by_category(direct)
    assert any(a["generated_ids"] != b["generated_ids"] for a, b in zip(rows[0::4], rows[2::4]))  # distinct draws
    assert all(line["speedup"] is None for line in report["categories"])


def test_compare_prints_two_reports_side_by_side(models, capsys):
    _, first = _run(models, "--benchmark", "mt-bench", "--benchmark-file", models["questions"], "--limit", "2",
                    "--no-baseline")
    first_path = models["root"] / "first.json"
    first_path.write_text(json.dumps(first))
    code, second = _run(models, "--benchmark", "mt-bench", "--benchmark-file", models["questions"],
                        "--no-baseline", "--compare", str(first_path))
    assert code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    lines = lines[lines.index(f"A: {first_path}"):]  # the comparison, after this run's own report
    a, b = _table(first), _table(second)
    spelling = next(line for line in lines if line.startswith("spelling "))
    assert spelling.split()[1:4] == [f"{a['spelling'][0]:.2f}", f"{b['spelling'][0]:.2f}",
                                    f"{b['spelling'][0] - a['spelling'][0]:+.2f}"]
    total = next(line for line in lines if line.startswith("mt-bench (all)"))
    assert total.split()[2:4] == [f"{a['all'][0]:.2f}", f"{b['all'][0]:.2f}"]
    # two reports, nothing decoded (no --draft needed)
    second_path = models["root"] / "second.json"
    second_path.write_text(json.dumps(second))
    assert evaluate_module().main(["--compare", str(first_path), str(second_path)]) == 0
    assert f"B: {second_path}" in capsys.readouterr().out


def test_prompt_lines_with_categories_get_the_table(models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"category": "a", "input_ids": [5, 17, 3, 40]}, {"category": "b", "input_ids": [9, 1, 33]},
             {"category": "a", "input_ids": [44, 3, 19, 8, 8]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, report = _run(models, "--prompts", str(prompts))
    assert code == 0
    from transformers import AutoModelForCausalLM

    from megatron_dflash.checkpoint.hf import load_hf_checkpoint
    from megatron_dflash.decoding.generate import spec_generate

    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    draft = load_hf_checkpoint(models["draft"], attention_backend="chunked").eval()
    direct = []
    for line in lines:
        out = spec_generate(target, draft, [line["input_ids"]], max_new_tokens=MAX_NEW, stop_token_ids=[])
        direct.append({"category": line["category"], "cycles": out.acceptance_lengths[0],
                       "generated": out.generated(0)})
    assert _table(report) == _by_category(direct)
    assert report["settings"]["chat_template_kwargs"] == {}  # --prompts: the template's own defaults


def test_bad_benchmark_files_are_one_line_errors(models, tmp_path, capsys):
    bad = tmp_path / "question.jsonl"
    bad.write_text(json.dumps(MT_BENCH[0]) + "\n" + json.dumps({"question_id": 2, "turns": ["count"]}) + "\n")
    with pytest.raises(SystemExit) as exit_:  # read before the models (and torch) load
        _run(models, "--benchmark", "mt-bench", "--benchmark-file", str(bad))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"evaluate_acceptance.py: error: {bad}:2: field 'category' is missing")
    tool = evaluate_module()
    for argv, expected in (
        (["--benchmark", "gsm8k"], "--benchmark gsm8k needs --benchmark-file PATH: the set as published"),
        (["--benchmark", "gsm8k", "--benchmark-file", str(bad), "--prompts", str(bad)], "alternatives"),
        (["--benchmark-file", str(bad)], "--benchmark-file needs --benchmark NAME"),
        (["--benchmark", "mt-bench", "--benchmark-file", str(bad), "--num-samples", "0"], "--num-samples"),
    ):
        with pytest.raises(SystemExit) as exit_:
            tool.parse_args(["--draft", models["draft"], *argv])
        assert exit_.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
        assert expected in line
    not_a_report = tmp_path / "r.json"
    not_a_report.write_text('{"prompts": [{"category": "x"}]}')
    assert tool.main(["--compare", str(not_a_report), str(not_a_report)]) == 2
    assert "not a report of this tool" in capsys.readouterr().err


def test_categories_named_all_or_turn_2_get_lines_of_their_own(models, capsys):
    """MT-Bench questions whose categories are called "all" and "turn 2": the report's lines stay unique by
    (set, kind, category), so `--compare` puts each next to its own."""
    renamed = models["root"] / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({**q, "category": name}) + "\n"
                               for q, name in zip(MT_BENCH, ["all", "turn 2", "all"])))
    code, report = _run(models, "--benchmark", "mt-bench", "--benchmark-file", str(renamed), "--no-baseline")
    assert code == 0
    keys = [(line["set"], line["kind"], line["category"]) for line in report["categories"]]
    assert keys == [("mt-bench", "category", "all"), ("mt-bench", "category", "turn 2"), ("mt-bench", "turn", "turn 1"),
                    ("mt-bench", "turn", "turn 2"), ("mt-bench", "set", "all")]
    assert [line["prompts"] for line in report["categories"]] == [4, 2, 3, 3, 6]
    path = models["root"] / "renamed-report.json"
    path.write_text(json.dumps(report))
    capsys.readouterr()
    assert evaluate_module().main(["--compare", str(path), str(path)]) == 0
    rows = capsys.readouterr().out.splitlines()[4:]
    assert [row.split("  ")[0].strip() for row in rows] == ['"all"', '"turn 2"', "turn 1", "turn 2", "mt-bench (all)"]
    assert all(row.split()[-1] in ("+0.00", "n/a") for row in rows), rows
