"""Benchmark questions turn by turn: a later turn is asked after the decode's own earlier answer, each sample with
its own seeds, the rows back in question / sample / turn order."""

import pytest

from megatron_dflash.data.benchmarks import BenchmarkItem
from megatron_dflash.decoding.benchmark_turns import prompt_seed, run_benchmark_turns, turn_messages

ITEMS = [
    BenchmarkItem("mt-bench", "1", "writing", ("first question", "second question"), "q.jsonl:1"),
    BenchmarkItem("mt-bench", "2", "math", ("only question",), "q.jsonl:2"),
    BenchmarkItem("mt-bench", "3", "writing", ("third a", "third b"), "q.jsonl:3"),
]


def _answering(calls: list):
    """A decode that answers each prompt with a text naming its question, sample and turn."""
    def decode(prompts):
        calls.append(prompts)
        return [(f"answer {p.item.question_id}.{p.sample}.{p.turn}", {"seed": p.seed}) for p in prompts]
    return decode


def test_the_second_turn_holds_the_generated_first_answer():
    calls = []
    done = run_benchmark_turns(ITEMS, _answering(calls), num_samples=2, seed=5)
    # round 1: every first turn; round 2: the second turns of the two-turn questions
    assert [len(c) for c in calls] == [6, 4]
    for prompt in calls[1]:
        q, s = prompt.item.question_id, prompt.sample
        assert prompt.messages == [
            {"role": "user", "content": prompt.item.turns[0]},
            {"role": "assistant", "content": f"answer {q}.{s}.0"},  # this sample's own first answer
            {"role": "user", "content": prompt.item.turns[1]},
        ]
        assert prompt.where == f"{prompt.item.where} turn 2"
    order = [(p.item.question_id, p.sample, p.turn) for p, _ in done]
    assert order == [("1", 0, 0), ("1", 0, 1), ("1", 1, 0), ("1", 1, 1), ("2", 0, 0), ("2", 1, 0),
                     ("3", 0, 0), ("3", 0, 1), ("3", 1, 0), ("3", 1, 1)]
    seeds = [row["seed"] for _, row in done]
    assert len(set(seeds)) == len(seeds)  # every sample and turn draws with its own seed
    assert seeds[0] == prompt_seed(5, ITEMS[0], 0, 0) != prompt_seed(6, ITEMS[0], 0, 0)


def test_seeds_do_not_depend_on_which_questions_are_decoded_together():
    alone = run_benchmark_turns(ITEMS[2:], _answering([]), num_samples=2, seed=1)
    together = run_benchmark_turns(ITEMS, _answering([]), num_samples=2, seed=1)
    assert [row for _, row in alone] == [row for p, row in together if p.item.question_id == "3"]


def test_max_turns_and_turn_messages():
    calls = []
    done = run_benchmark_turns(ITEMS, _answering(calls), max_turns=1)
    assert len(calls) == 1 and len(done) == 3
    assert turn_messages(ITEMS[0], []) == [{"role": "user", "content": "first question"}]


def test_a_decode_that_drops_prompts_is_refused():
    with pytest.raises(ValueError, match="answered 2 of 3"):
        run_benchmark_turns(ITEMS, lambda prompts: [("a", None)] * (len(prompts) - 1))
