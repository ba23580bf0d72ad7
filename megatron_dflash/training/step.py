"""The training step's parts: one micro-batch forward (+ backward) and the reduction of its statistics.

* `StepRunner.micro_batch`: the plan attached to the batch (and, under TP, checked to agree across the
  group), the frozen target's taps, the blocks' embeddings, the draft's forward and the variant's loss
  (`loss_sum.backward()`, unnormalised, when training), docs/design.md §9 The training step and the engine;
* `StepCounts` / `StepStatistics`: what a micro-batch adds up, summed over a step, then (`StepRunner.reduce`)
  over DP and PP, so every rank logs the draft's numbers;
* `RankData`: this rank's micro-batches, where a record that cannot be read stops every rank alike.

The optimizer step itself (zero_grad, micro-batches, `finish_grads`, `step`) is `training.loop`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..common.errors import DataError
from ..common.parallel import ProcessGroups, distributed_ready
from ..plan.data_hook import PlanDisagreementError, attach_dflash_plan, verify_plan_agreement
from ..objectives.dflash_loss import AdditiveMetrics, all_reduce_together, embed_blocks
from ..objectives.variable_prefix import sample_prefix_lengths
from ..target.head import OutputHead
from .frozen_target import FrozenTarget
from .job import Job

__all__ = ["StepCounts", "StepStatistics", "StepRunner", "RankData"]


@dataclass
class StepCounts(AdditiveMetrics):
    """The loop's own additive statistics of a micro-batch (summed over a step, then over DP and PP).

    Fields:
        loss_sum: the objective's numerator (detached).
        weight_sum: its denominator, ``sum(w * mask)``.
        tokens: real (non-padding) tokens read.
        empty_micro_batches: micro-batches without a supervised slot (no valid anchor).
        unreadable_micro_batches: stand-ins for a record this rank could not read (non-zero: every rank
            stops, see `RankData`).
        label_tokens, out_of_draft_vocab_tokens: with a reduced draft vocabulary, the loss-masked tokens read
            and those of them outside the draft vocabulary (0 and 0 without one; docs/design.md §20).
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    tokens: torch.Tensor
    empty_micro_batches: torch.Tensor
    unreadable_micro_batches: torch.Tensor
    label_tokens: torch.Tensor
    out_of_draft_vocab_tokens: torch.Tensor


@dataclass
class StepStatistics:
    """What a step (or a validation pass) adds up: the loop's `StepCounts` and the variant's metrics
    (`VariantLoss.metrics`, None off the draft's pipeline stage until `StepRunner.reduce`)."""

    counts: StepCounts
    metrics: Optional[AdditiveMetrics]
    scalars: dict = field(default_factory=dict)  # after `reduce`: learning rate, grad norm

    def __add__(self, other: "StepStatistics") -> "StepStatistics":
        metrics = self.metrics if other.metrics is None else (
            other.metrics if self.metrics is None else self.metrics + other.metrics)
        return StepStatistics(self.counts + other.counts, metrics)

    def log_values(self) -> dict:
        """The logged values: ``loss`` (the global numerator over the global denominator), then the
        metrics' ratios (`AdditiveMetrics.logged`)."""
        c = self.counts
        weight_sum = float(c.weight_sum)
        out = {"loss": float(c.loss_sum) / weight_sum if weight_sum > 0 else float("nan")}
        out.update(self.metrics.log_values())
        if float(c.label_tokens) > 0:  # a reduced draft vocabulary: the share of labels it cannot propose
            out["out_of_draft_vocab"] = float(c.out_of_draft_vocab_tokens) / float(c.label_tokens)
        return out


class StepRunner:
    """One micro-batch through plan, target, body and loss (`micro_batch`), and a step's statistics summed over
    the job's groups (`reduce`); training steps and the validation pass run through it."""

    def __init__(self, job: Job, body, model, target: FrozenTarget, device, groups: ProcessGroups):
        self.job, self.body, self.model, self.target, self.device = job, body, model, target, device
        self.groups = groups
        self.args = job.args
        self.config = job.draft_config
        self._verified_step: Optional[int] = None  # last step whose plan the TP group compared
        self._draft_vocab = None  # a reduced draft vocabulary, read once from body.d2t (its host read syncs)

    def micro_batch(self, batch: dict, step: int, seed: int, backward: bool) -> StepStatistics:
        """Forward (+ backward) of one micro-batch; returns its additive statistics."""

        args, cfg = self.args, self.config
        batch = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        # Packed rows: blocks stay inside their document. Unpacked rows hold one document followed by
        # padding; a block may then run into the padding (those slots are unsupervised), so the last
        # tokens of a document are trained as anchors too, as decoding meets them.
        attach_dflash_plan(batch, optimizer_step=step, seed=seed, anchors_per_sample=args.dflash_anchors_per_sample,
                           block_size=cfg.block_size, use_documents=args.pack_sequences,
                           lookahead=self.job.variant.anchor_lookahead)
        plan = batch["dflash_plan"]
        if self.job.tp > 1 and backward and step != self._verified_step and (
                self._verified_step is None or step % args.log_interval == 0):
            # The TP ranks of a group must hold the same batch and plan (they build them independently): checked
            # on the first step and then once per logging interval (one small all-reduce over the TP group).

            try:
                verify_plan_agreement(plan, self.groups.tp, extra={"tokens": batch["tokens"]})
            except PlanDisagreementError as err:  # raised on every rank of the group alike
                raise DataError(f"{err} The tensor-parallel ranks read different data: the data files must be "
                                "identical on every node.") from err
            self._verified_step = step
        prefix = None
        if args.dflash_variable_prefix is not None:
            prefix = sample_prefix_lengths(plan, seed=seed, optimizer_step=step, base=args.dflash_variable_prefix,
                                           sample_ids=batch["sample_ids"])
        from_target = self.target(batch)  # collective over the pipeline when PP > 1
        if from_target is None:  # off the draft's stage: no body here, zero statistics
            return StepStatistics(StepCounts.zeros(self.device), None)
        taps, final_hidden = from_target
        with torch.no_grad():
            blocks = embed_blocks(batch["tokens"], plan, self.target.embedding, mask_token_id=cfg.mask_token_id,
                                  input_embedding_scale=cfg.input_embedding_scale, prefix_lengths=prefix)
        head = OutputHead.of_draft(self.body, self.target.head, self._draft_vocab)  # docs/design.md §20
        self._draft_vocab = head.draft_vocab
        with torch.set_grad_enabled(backward):
            hidden = self.model(taps, blocks, plan)
            out = self.job.variant.loss(
                self.body, hidden, plan, batch["tokens"], head, decay_gamma=self.job.decay_gamma,
                weighting=self.job.loss_weighting,
                chunk_slots=args.dflash_loss_chunk, prefix_lengths=prefix, final_hidden=final_hidden,
                options=self.job.variant_options, step=step, total_steps=args.train_iters,
                embedding=self.target.embedding, input_mask=batch["loss_mask"],
            )
            if backward:
                out.loss_sum.backward()
        f64 = lambda v: torch.as_tensor(v, dtype=torch.float64, device=self.device).detach().reshape(())  # noqa: E731
        weight_sum = f64(out.weight_sum)
        counts = StepCounts(
            loss_sum=f64(out.loss_sum), weight_sum=weight_sum, tokens=f64((batch["document_ids"] >= 0).sum()),
            # a micro-batch without a supervised slot (no valid anchor) adds nothing: counted, not an error
            empty_micro_batches=(weight_sum == 0).to(torch.float64), unreadable_micro_batches=f64(0.0),
            **_draft_vocab_counts(head, batch, f64),
        )
        return StepStatistics(counts, out.metrics.to(self.device))

    def reduce(self, stats: StepStatistics, scalars: Optional[dict] = None) -> StepStatistics:
        """Sum the statistics over DP, then (PP > 1) over the pipeline group, where only the draft's stage
        contributes: every rank, rank 0 included, gets the real numbers, on the host. One all-reduce per
        group for the counts and the metrics together. `scalars` (learning rate, grad norm: known on the
        draft's stage only) come back from the draft's stage as they are."""
        counts, metrics = stats.counts, stats.metrics
        if metrics is not None and self.groups.dp_size > 1:
            counts, metrics = all_reduce_together([counts, metrics], self.groups.dp)
        scalars = dict(scalars or {})
        if self.target.placement is not None:
            group = self.groups.pp
            src = self.groups.pp_peer(self.target.placement.draft_stage)
            meta = [type(metrics), scalars] if self.target.is_draft else [None, None]
            dist.broadcast_object_list(meta, src=src, group=group)
            kind, scalars = meta
            if not self.target.is_draft:  # SUM: the other stages contribute zeros
                counts, metrics = StepCounts.zeros(self.device), kind.zeros(self.device)
            counts, metrics = all_reduce_together([counts, metrics], group)
        return StepStatistics(counts.to("cpu"), metrics.to("cpu"), scalars)


def _draft_vocab_counts(head: OutputHead, batch: dict, f64) -> dict:
    """`StepCounts`' ``label_tokens`` / ``out_of_draft_vocab_tokens`` of a micro-batch (zeros without a reduced
    draft vocabulary)."""
    if head.draft_vocab is None:
        return {"label_tokens": f64(0.0), "out_of_draft_vocab_tokens": f64(0.0)}
    labels = batch["loss_mask"].bool()
    _, inside = head.to_draft(batch["tokens"])
    return {"label_tokens": f64(labels.sum()), "out_of_draft_vocab_tokens": f64((labels & ~inside).sum())}


class RankData:
    """The micro-batches of this rank; a record that cannot be read (tokenised) stops every rank alike.

    Such a record is met by one data-parallel replica only (each reads its own part of the global batch):
    raising there would leave the other replicas waiting in the step's next collective until the process
    group times out. So this rank keeps the error and completes the step with stand-in micro-batches that
    supervise nothing, joining every collective as usual; the step's statistics, which every rank reduces
    anyway, count those micro-batches (`mark`), and once the count is non-zero every rank raises the same
    `DataError` (`stop_if_unreadable`). Normal steps add one number to the statistics, nothing else.
    """

    def __init__(self, iterator, collate, pad_id: int, micro_batch_size: int):
        self.iterator = iterator
        self.error: Optional[str] = None  # the first unreadable record's message (file:line: what)
        # rows of one pad token (padded to the sequence length), no supervised token
        self._stand_in = [{"input_ids": [pad_id], "loss_mask": [0], "sample_id": 0}] * micro_batch_size
        self._collate = collate

    def __next__(self) -> dict:
        if self.error is None:
            try:
                return next(self.iterator)
            except ValueError as err:  # a record that cannot be tokenised (named by file and line)
                self.error = str(err)
        return self._collate(self._stand_in)

    def mark(self, stats: StepStatistics) -> StepStatistics:
        """``stats`` of a micro-batch with this rank's count of unreadable micro-batches set."""
        counts = stats.counts
        counts.unreadable_micro_batches = torch.full_like(counts.unreadable_micro_batches, float(self.error is not None))
        return stats

    def stop_if_unreadable(self, totals: StepStatistics) -> None:
        """Raise on every rank the `DataError` of the lowest rank that met an unreadable record, if any did
        (the reduced count says so on every rank; the messages are gathered on this failure path only)."""
        if float(totals.counts.unreadable_micro_batches) <= 0:
            return

        messages = [self.error]
        if distributed_ready() and dist.get_world_size() > 1:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, self.error)
        raise DataError(next(m for m in messages if m is not None))
