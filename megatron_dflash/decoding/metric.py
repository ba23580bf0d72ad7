"""The headline decode metric, defined once for training evaluation and `tools/evaluate_acceptance.py`.

Greedy (or sampled) speculative decoding of held-out prompts (`decoding.generate.spec_generate`) gives, per prompt,
the tokens committed by each verify cycle. From them:

* **acceptance length**: the mean of the committed tokens per verify cycle, over every cycle of every
  prompt (undefined, None, when no cycle ran);
* **tokens per target forward**: generated tokens over target forwards, where each prompt costs its prefill
  forward (which gives its first token) plus one verify forward per cycle (README "What the numbers mean").

Pure Python (no torch): the tool's `--help` reads it.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["decode_metric", "decode_summary", "row_tokens_per_target_forward", "no_verify_cycle_reason"]


def row_tokens_per_target_forward(generated_tokens: int, cycles: int) -> float:
    """One prompt's generated tokens over its target forwards: its prefill plus one per verify cycle."""
    return generated_tokens / (1 + cycles)


def decode_metric(acceptance_lengths: Sequence[Sequence[int]], generated_tokens: Sequence[int]) -> dict:
    """The headline numbers of a decoding run from its per-prompt cycles and generated token counts.

    Args:
        acceptance_lengths: per prompt, the tokens committed by each of its verify cycles.
        generated_tokens: per prompt, the tokens it generated (the prefill's token included).

    Returns:
        ``acceptance_length`` (mean over all cycles; None without a cycle), ``cycles``, ``generated_tokens``,
        ``target_forwards`` and ``tokens_per_target_forward`` (None without a prompt).
    """
    cycles = [a for row in acceptance_lengths for a in row]
    generated = int(sum(generated_tokens))
    forwards = sum(1 + len(row) for row in acceptance_lengths)
    return {
        "acceptance_length": sum(cycles) / len(cycles) if cycles else None,
        "cycles": len(cycles),
        "generated_tokens": generated,
        "target_forwards": forwards,
        "tokens_per_target_forward": generated / forwards if forwards else None,
    }


def no_verify_cycle_reason(why: str, remedy: str) -> str:
    """Why the acceptance length is undefined: no prompt got past the prefill's token. `why`: what the prompts
    ended with; `remedy`: what the user can change (the caller's flags)."""
    return f"no verify cycle ran: every prompt ended at the target's first generated token ({why}); {remedy}"


def decode_summary(acceptance_lengths: Sequence[Sequence[int]], generated_tokens: Sequence[int], *, why: str,
                   remedy: str) -> dict:
    """`decode_metric` of a decoding run with its number of ``prompts``, and, when no verify cycle ran, its
    ``no_cycle_reason`` (`no_verify_cycle_reason(why, remedy)`). What training evaluation and
    `tools/evaluate_acceptance.py` both report."""
    summary = {**decode_metric(acceptance_lengths, generated_tokens), "prompts": len(acceptance_lengths)}
    if not summary["cycles"]:
        summary["no_cycle_reason"] = no_verify_cycle_reason(why, remedy)
    return summary
