"""Benchmark questions decoded turn by turn: each later turn is asked after the decode's own earlier answers.

A question of a prompt set (`data.benchmarks.BenchmarkItem`) has one user turn, or two (MT-Bench). Turn `k`'s
prompt is the conversation so far: the user's turns `0..k` with, between them, the answers the speculative
decode generated itself (decoded text, special tokens left out), rendered later by the target's chat template
with the generation prompt. So the conversation grows with the measured decode's output, as in the DFlash
papers' evaluation, and acceptance of a second turn is measured on the context the draft will really meet.

`run_benchmark_turns` walks every (question, sample) pair round by round, turn 0 of all of them first, and hands
each round's prompts to a caller's ``decode`` (which batches, decodes and times them). Sample ``s`` of a
question is seeded with `prompt_seed` of (seed, question, sample, turn): the draws do not depend on the batch
or on the order of the questions. No torch here (docs/design.md §7 Module map).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from ..data.benchmarks import BenchmarkItem
from .regenerate import answer_seed

__all__ = ["TurnPrompt", "prompt_seed", "turn_messages", "run_benchmark_turns"]


@dataclasses.dataclass(frozen=True)
class TurnPrompt:
    """One prompt to decode: turn ``turn`` of sample ``sample`` of ``item``; ``messages`` is the conversation so
    far (ends with the user's turn); ``seed`` seeds its draws."""

    item: BenchmarkItem
    sample: int
    turn: int
    messages: list
    seed: int

    @property
    def where(self) -> str:
        return f"{self.item.where} turn {self.turn + 1}"


def prompt_seed(seed: int, item: BenchmarkItem, sample: int, turn: int) -> int:
    """The seed of one turn of one sample of a question (below 2**31): a hash of the run's seed, the question,
    the sample and the turn."""
    return answer_seed(seed, f"{item.set}/{item.question_id}/{sample}", turn)


def turn_messages(item: BenchmarkItem, answers: Sequence[str]) -> list:
    """The chat of turn ``len(answers)``: the user's turns so far with the generated ``answers`` between them."""
    messages: list = []
    for turn, question in enumerate(item.turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": question})
        if turn < len(answers):
            messages.append({"role": "assistant", "content": answers[turn]})
    return messages


def run_benchmark_turns(items: Sequence[BenchmarkItem], decode: Callable[[list], list], *, num_samples: int = 1,
                        seed: int = 0, max_turns: Optional[int] = None) -> list:
    """Every turn of every sample of ``items``, decoded by ``decode``.

    Args:
        items: the questions.
        decode: called once per round with the round's `TurnPrompt` list; returns, for each, the answer's text
            (what the next turn's conversation holds) and whatever the caller keeps of it, as ``(text, row)``.
        num_samples: how many times each question is decoded (each with its own seeds).
        seed: the run's seed (`prompt_seed`).
        max_turns: ask at most this many turns of each question (default: all of them).

    Returns:
        ``(TurnPrompt, row)`` pairs ordered by question, sample, turn.
    """
    pending = [(i, s) for i in range(len(items)) for s in range(num_samples)]
    answers: dict = {key: [] for key in pending}
    done: list = []
    turn = 0
    while True:
        limit = max_turns if max_turns is not None else max(len(item.turns) for item in items)
        live = [(i, s) for i, s in pending if turn < min(len(items[i].turns), limit)]
        if not live:
            break
        prompts = [TurnPrompt(items[i], s, turn, turn_messages(items[i], answers[(i, s)]),
                              prompt_seed(seed, items[i], s, turn)) for i, s in live]
        results = decode(prompts)
        if len(results) != len(prompts):
            raise ValueError(f"decode answered {len(results)} of {len(prompts)} prompts")
        for (i, s), prompt, (text, row) in zip(live, prompts, results):
            answers[(i, s)].append(text)
            done.append(((i, s, turn), prompt, row))
        turn += 1
    done.sort(key=lambda entry: entry[0])
    return [(prompt, row) for _, prompt, row in done]
