"""Evaluation of a training run, shared with `tools/evaluate_acceptance.py`.

* `validation_loss`: loss, accuracy and teacher-forced block acceptance on `--eval-iters` global batches of
  the validation data, through the training step (`step.StepRunner`, no gradient);
* `acceptance_length`: greedy speculative decoding (`decoding.generate.spec_generate`) of the held-out
  prompts on rank 0, with the run's decoding settings (`VariantOptions.decode`: DSpark's
  `--dflash-confidence-threshold`), summarised by `decoding.metric.decode_summary`, the tool's definition;
* `acceptance_line` / `decode_record`: its console line (the tool prints the same) and its
  metrics.jsonl / TensorBoard values.
"""

from __future__ import annotations

import torch

from ..data.batching import Collator, MicroBatchIterator
from ..decoding.generate import spec_generate
from ..decoding.metric import decode_summary
from .job import Job
from .monitor import DECODE_ACCEPTANCE, DECODE_TOKENS_PER_FORWARD
from .step import RankData, StepRunner

__all__ = ["validation_loss", "acceptance_length", "acceptance_line", "decode_record"]


def validation_loss(runner: StepRunner, dataset, job: Job) -> dict:
    """Loss / accuracy / block acceptance on `--eval-iters` global batches of the validation data (no grad).

    The plans use a fixed step (0) and a derived seed, so every evaluation sees the same blocks.
    """

    args = job.args
    collate = Collator(job.pad_token_id, args.seq_length, args.pack_sequences)
    it = MicroBatchIterator(dataset, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                            dp_rank=runner.groups.dp_rank, dp_size=job.dp, seed=args.seed + 1,
                            start_step=0, collate_fn=collate)
    reader = RankData(it, collate, job.pad_token_id, args.micro_batch_size)
    acc = None
    if runner.body is not None:
        runner.body.eval()
    try:
        for _ in range(args.eval_iters * args.num_micro_batches):
            stats = reader.mark(runner.micro_batch(next(reader), step=0, seed=args.seed + 1, backward=False))
            acc = stats if acc is None else acc + stats
    finally:
        if runner.body is not None:
            runner.body.train()
    totals = runner.reduce(acc)
    reader.stop_if_unreadable(totals)
    return totals.log_values()


@torch.no_grad()
def acceptance_length(target_model, draft, prompts: list, job: Job, batch_size: int = 8) -> dict:
    """Greedy speculative decoding of `prompts`: mean committed tokens per target forward, with the run's decoding
    settings (its variant's `options.decode_kwargs`, e.g. DSpark's confidence threshold)."""

    lengths, generated = [], []
    settings = job.variant.options.decode_kwargs(job.variant_options)
    was_training = draft.training
    draft.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            out = spec_generate(target_model, draft, prompts[start:start + batch_size],
                                max_new_tokens=job.args.dflash_eval_max_new_tokens,
                                stop_token_ids=None if job.args.dflash_eval_ignore_eos else (job.stop_token_ids or None),
                                pad_token_id=job.pad_token_id,
                                attention_backend="chunked", **settings)
            lengths += [list(row) for row in out.acceptance_lengths]
            generated += [int(n) for n in out.num_generated]
    finally:
        draft.train(was_training)
    # the tool's definition (tools/evaluate_acceptance.py); each prompt's first token comes from the prefill, a
    # cycle needs a second one to draft for
    summary = decode_summary(
        lengths, generated,
        why=f"{sum(generated)} tokens for {len(prompts)} prompts: a stop token, or prompts the target cannot continue",
        remedy="use prompts the target knows, or --dflash-eval-ignore-eos")
    result = {"acceptance_length": summary["acceptance_length"] if summary["cycles"] else float("nan"),
              "cycles": summary["cycles"], "generated_tokens": summary["generated_tokens"],
              "tokens_per_target_forward": summary["tokens_per_target_forward"] or 0.0, "prompts": len(prompts)}
    if "no_cycle_reason" in summary:
        result["no_cycle_reason"] = summary["no_cycle_reason"]
    return result


def acceptance_line(result: dict) -> str:
    """The console line of a decode evaluation (`acceptance_length`'s result; also the tool's headline)."""
    if not result["cycles"]:
        return f"{DECODE_ACCEPTANCE} n/a over {result['prompts']} held-out prompts: {result['no_cycle_reason']}"
    return (f"{DECODE_ACCEPTANCE} {result['acceptance_length']:.3f} (autoregressive baseline 1.0) over "
            f"{result['prompts']} held-out prompts, {result['cycles']} verify cycles, "
            f"{result['tokens_per_target_forward']:.2f} {DECODE_TOKENS_PER_FORWARD} per sequence")


def decode_record(iteration: int, result: dict) -> dict:
    """The metrics.jsonl / TensorBoard values of one speculative-decoding evaluation."""

    return {DECODE_ACCEPTANCE: result["acceptance_length"] if result["cycles"] else None,
            DECODE_TOKENS_PER_FORWARD: result["tokens_per_target_forward"], "verify cycles": result["cycles"],
            "prompts": result["prompts"]}
