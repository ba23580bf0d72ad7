"""The DFlash training loop: data -> plan -> target taps -> draft body -> loss -> optimizer.

`main(argv)` is what `pretrain_dflash.py` runs: parse, validate (identically on every rank,
before any collective), initialise `torch.distributed` and megatron's `parallel_state`, train,
checkpoint, evaluate, export. `train(job)` is the in-process API the tests call.

One optimizer step (iteration `t`, counted from 0)::

    for each of the G / (M * DP) micro-batches of this DP rank:
        batch  = next(MicroBatchIterator)                 # deterministic order, resumable at t
        plan   = build_dflash_batch_plan(..., optimizer_step=t, seed)
        taps   = target(batch)                            # frozen, no grad
        blocks = target.embedding([anchor, MASK, ...])    # frozen
        loss_sum, weight_sum = variant.loss(body(taps, blocks, plan), ...)
        loss_sum.backward()                               # unnormalised
    gradients: sum over DP, then / (global sum of weight_sum)  (engine.finish_grads)
    clip (global norm), Adam, scheduler step

Pipeline parallelism (`--pipeline-model-parallel-size > 1`, megatron target): every rank builds its own
stage of the target; the draft body and its optimizer exist only on the stage `--dflash-pipeline-stage`
(default the last), which gets frozen copies of the target's embedding and output layer
(`target.pipeline.copy_frozen_target_heads`). Every rank runs every micro-batch through
`target.pipeline.run_target_pipeline` (same data on every stage: the DP rank comes from the job's
`common.parallel.ProcessGroups`, built once by `initialize_distributed` and handed down); the
other stages contribute zero statistics, and the step statistics are summed over DP, then over the
pipeline group, so every rank (rank 0 included) logs the draft's numbers. The grad norm is reduced over
TP only. Checkpoints: every rank joins the collective save / load, the draft's stage with the draft and
optimizer shards, the others with their RNG state only; the HF export is written by the draft's stage.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..checkpoint.hf import load_hf_checkpoint, load_hf_state_dict_into, read_safetensors, save_hf_checkpoint
from ..common.cli import is_no_space, report_failure, report_interrupt
from ..common.errors import DataError, DivergenceError, RunError
from ..common.parallel import (
    ProcessGroups,
    SingleRankGroup,
    agree_or_raise,
    destroy_model_parallel,
    distributed_ready,
    initialize_model_parallel,
    megatron_ready,
)
from ..data import datasets as data
from ..data.datasets import (
    Collator,
    MicroBatchIterator,
    PlanDisagreementError,
    attach_dflash_plan,
    verify_plan_agreement,
)
from ..decoding.generate import spec_generate
from ..decoding.metric import decode_metric, no_verify_cycle_reason
from ..draft.body import default_parallel_config
from ..objectives.dflash_loss import AdditiveMetrics, all_reduce_together, embed_blocks
from ..objectives.variable_prefix import sample_prefix_lengths
from ..target.families import resolve_target_family, target_architecture
from ..target.masks import causal_mask, document_mask, hf_document_mask
from ..target.model import HFTarget, MegatronTarget, concat_taps
from ..target.pipeline import copy_frozen_target_heads, resolve_draft_stage, run_target_pipeline
from . import optim
from .agreement import agree_on_job
from .arguments import EMBEDDED_SYNTHETIC_HELDOUT_SEED, EMBEDDED_SYNTHETIC_TRAIN_SEED, ArgumentError, parse_args
from .checkpointing import load_checkpoint, save_checkpoint
from .data_checks import check_indexed_token_range, check_something_to_learn
from .device_shim import megatron_target_on_cpu
from .job import Job, prepare_job
from .monitor import DECODE_ACCEPTANCE, DECODE_TOKENS_PER_FORWARD, Monitor, format_metrics, labelled
from .optim import optimizer_layout
from .outputs import check_export_directory, export_marker, run_name
from .resume import agree_on_resume_point
from .rundir import ConsoleLog, RunWriter
from .savelock import lock_save_directory
from .signals import STOPPED_EXIT_STATUS, StopSignals

__all__ = ["TrainResult", "DistContext", "initialize_distributed", "train", "run", "main"]


# ------------------------------------------------------------------------------------------ distributed


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool
    owns_model_parallel: bool
    tmpdir: Optional[tempfile.TemporaryDirectory] = None
    # The job's process groups, built once here and handed down to the target, the step, the optimizer and
    # the checkpoints (nothing below reads megatron's global parallel_state).
    groups: ProcessGroups = field(default_factory=ProcessGroups.single)

    def close(self) -> None:
        # Drop the references first: a gloo group's threads end only when its last reference goes.
        self.groups = ProcessGroups.single()
        if self.owns_model_parallel and megatron_ready():
            destroy_model_parallel()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.tmpdir is not None:
            self.tmpdir.cleanup()
            self.tmpdir = None


def initialize_distributed(job: Job, env=None) -> DistContext:
    """Join (or create) the process group and set up megatron's parallel_state for TP/PP.

    * already initialised (e.g. by a test harness): reused;
    * torchrun / SLURM (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` set): `env://` rendezvous;
    * a plain single process: a 1-rank group over a `file://` rendezvous in a temporary directory
      (megatron's dist_checkpointing needs `torch.distributed`).

    Backend: nccl with CUDA, gloo without.
    """

    env = os.environ if env is None else env
    args = job.args
    use_cuda = args.use_cuda
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    owns_pg = False
    tmpdir = None
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
            dist.init_process_group(backend, init_method="env://", rank=int(env["RANK"]),
                                    world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        else:
            if job.world_size != 1:
                raise RuntimeError(
                    f"world size {job.world_size} but no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR); "
                    "launch with torchrun."
                )
            tmpdir = tempfile.TemporaryDirectory(prefix="dflash-rdzv-")
            dist.init_process_group(backend, init_method=f"file://{os.path.join(tmpdir.name, 'rendezvous')}",
                                    rank=0, world_size=1, timeout=timeout)
        owns_pg = True
    world = dist.get_world_size()
    if world != job.world_size:
        raise RuntimeError(f"the process group has {world} ranks but the job was validated for {job.world_size}.")
    # before megatron's groups and any other collective: every rank resolved the same job

    agree_on_job(job)
    tp, pp = job.tp, job.pp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    owns_mp = False
    if megatron_ready():
        current = ProcessGroups.from_megatron()
        same = (current.tp_size == tp and current.pp_size == pp and current.ep_size == ep
                and current.etp_size == (tp if etp is None else etp))
        if not same:
            destroy_model_parallel()
    if not megatron_ready():
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        owns_mp = True
    if use_cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return DistContext(dist.get_rank(), world, local_rank, device, owns_pg, owns_mp, tmpdir,
                       groups=ProcessGroups.from_megatron())


# ------------------------------------------------------------------------------------------ target


class _Target:
    """The frozen target as the loop uses it: `taps(batch)`, `embedding`, `head`, `hf_model`.

    Under pipeline parallelism (`--pipeline-model-parallel-size > 1`, megatron backend) every rank holds
    its own stage of the target; `placement` says which stage holds the draft (`is_draft`), and only
    there are `embedding` and `head` set (frozen copies of the first / last stage's, see `target/pipeline.py`).
    `__call__` is then collective over the pipeline and returns None off the draft's stage.
    """

    def __init__(self, job: Job, device: torch.device, dtype: torch.dtype, groups: ProcessGroups):
        self.groups = groups
        self.backend = job.args.target_backend
        self.device = device
        self.pack = job.args.pack_sequences
        self.hf_model = None
        self.placement = None
        self.is_draft = True
        self.need_final_hidden = bool(job.variant.needs_final_hidden) or job.args.dflash_soft_target != "none"
        if self.backend == "hf":
            self.hf_model = _load_hf_model(job, dtype).to(device)
            self.module = HFTarget.from_config(self.hf_model, job.draft_config)
        else:
            self.module = MegatronTarget.from_pretrained(job.target_dir, config=job.draft_config, params_dtype=dtype,
                                                         sequence_parallel=job.args.sequence_parallel, groups=groups)
            if device.type == "cuda":
                self.module.cuda()
        self.dtype = dtype
        if job.pp > 1:
            self.placement = resolve_draft_stage(job.args.dflash_pipeline_stage, job.pp)
            self.embedding, self.head = copy_frozen_target_heads(self.module, self.placement,  # every rank
                                                                 groups=groups)
            self.is_draft = self.placement.holds_draft(groups.pp_rank)
            return
        self.embedding = self.module.embedding
        self.head = self.module.output_head

    @torch.no_grad()
    def __call__(self, batch: dict):
        tokens = batch["tokens"]
        positions = batch["position_ids"]
        B, S = tokens.shape
        if self.backend == "hf":
            mask = None
            if self.pack:
                mask = hf_document_mask(batch["document_ids"], self.dtype)
            out = self.module(tokens, attention_mask=mask, position_ids=positions,
                              need_final_hidden=self.need_final_hidden)
            return out.taps, out.final_hidden
        # megatron: True = masked. Explicit masks on CPU (megatron builds its default on CUDA only).
        if self.pack:
            mask = document_mask(batch["document_ids"])
        elif tokens.is_cuda:
            mask = None
        else:
            mask = causal_mask(S, tokens.device)
        if self.placement is not None:
            out = run_target_pipeline(self.module, batch, draft_stage=self.placement, attention_mask=mask,
                                      need_final_hidden=self.need_final_hidden, groups=self.groups)
            return None if out is None else (out.taps, out.final_hidden)
        out = self.module(tokens, attention_mask=mask, position_ids=positions, need_final_hidden=self.need_final_hidden)

        return concat_taps(out.taps, self.module.target_layer_ids), out.final_hidden


def _load_hf_model(job: Job, dtype: torch.dtype):
    """The target causal LM in one process, loaded as its family says (`target.families.TargetFamily.loader`)."""

    family = job.target_family or resolve_target_family(job.target_config)
    model = family.loader(target_architecture(job.target_config))(job.target_dir, dtype)
    model.eval()
    return model


# ------------------------------------------------------------------------------------------ data


def build_datasets(job: Job):
    """(train, valid or None) map-style datasets of `data/datasets.py`."""

    args, tok = job.args, job.tokenizer
    fmt = args.data_format

    def one(path):
        if fmt == "chat":
            return data.ChatJSONLDataset(path, tok, args.seq_length)
        if fmt == "text":
            return data.TextJSONLDataset(path, tok, args.seq_length)
        return data.IndexedDataset(path, args.seq_length)

    if fmt == "synthetic":
        train = data.SyntheticChatDataset(EMBEDDED_SYNTHETIC_TRAIN_SEED, args.synthetic_train_samples, tok,
                                          args.seq_length)
        valid = data.SyntheticChatDataset(EMBEDDED_SYNTHETIC_HELDOUT_SEED, args.synthetic_valid_samples, tok,
                                          args.seq_length)
        return train, valid
    try:
        train = one(args.train_path)
        valid = one(args.valid_data) if args.valid_data else None
    except DataError:
        raise  # a record that cannot be used: one line naming its file and line already
    except (ValueError, FileNotFoundError) as err:
        raise ArgumentError(str(err)) from None
    return train, valid


def _check_data(job: Job, train_ds, collate, log=print) -> None:
    """Token ids of pre-tokenised data inside the target's vocabulary; something to learn in the training data
    (JSONL and synthetic data come from a tokenizer that `prepare_job` checked against the vocabulary)."""

    args = job.args
    if args.data_format == "indexed":
        for path in [args.train_path] + ([args.valid_data] if args.valid_data else []):
            check_indexed_token_range(path, int(job.target_text_config["vocab_size"]))
    check_something_to_learn(train_ds, collate, block_size=job.draft_config.block_size,
                             use_documents=args.pack_sequences, seed=args.seed,
                             what=f"the training data ({args.train_path or 'synthetic'})", log=log)


# ------------------------------------------------------------------------------------------ one step


@dataclass
class StepCounts(AdditiveMetrics):
    """The loop's own additive statistics of a micro-batch (summed over a step, then over DP and PP).

    Fields:
        loss_sum: the objective's numerator (detached).
        weight_sum: its denominator, ``sum(w * mask)``.
        tokens: real (non-padding) tokens read.
        empty_micro_batches: micro-batches without a supervised slot (no valid anchor).
        unreadable_micro_batches: stand-ins for a record this rank could not read (non-zero: every rank
            stops, see `_RankData`).
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    tokens: torch.Tensor
    empty_micro_batches: torch.Tensor
    unreadable_micro_batches: torch.Tensor


@dataclass
class StepStatistics:
    """What a step (or a validation pass) adds up: the loop's `StepCounts` and the variant's metrics
    (`VariantLoss.metrics`, None off the draft's pipeline stage until `_StepRunner.reduce`)."""

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
        return out


class _StepRunner:
    def __init__(self, job: Job, body, model, target: _Target, device, groups: ProcessGroups):
        self.job, self.body, self.model, self.target, self.device = job, body, model, target, device
        self.groups = groups
        self.args = job.args
        self.config = job.draft_config
        self._verified_step: Optional[int] = None  # last step whose plan the TP group compared

    def micro_batch(self, batch: dict, step: int, seed: int, backward: bool) -> StepStatistics:
        """Forward (+ backward) of one micro-batch; returns its additive statistics."""

        args, cfg = self.args, self.config
        batch = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        # Packed rows: blocks stay inside their document. Unpacked rows hold one document followed by
        # padding; a block may then run into the padding (those slots are unsupervised), so the last
        # tokens of a document are trained as anchors too, as decoding meets them.
        attach_dflash_plan(batch, optimizer_step=step, seed=seed, anchors_per_sample=args.dflash_anchors_per_sample,
                           block_size=cfg.block_size, use_documents=args.pack_sequences)
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
        with torch.set_grad_enabled(backward):
            hidden = self.model(taps, blocks, plan)
            out = self.job.variant.loss(
                self.body, hidden, plan, batch["tokens"], self.target.head, decay_gamma=self.job.decay_gamma,
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


class _RankData:
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


# ------------------------------------------------------------------------------------------ evaluation


def validation_loss(runner: _StepRunner, dataset, job: Job) -> dict:
    """Loss / accuracy / block acceptance on `--eval-iters` global batches of the validation data (no grad).

    The plans use a fixed step (0) and a derived seed, so every evaluation sees the same blocks.
    """

    args = job.args
    collate = Collator(job.pad_token_id, args.seq_length, args.pack_sequences)
    it = MicroBatchIterator(dataset, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                            dp_rank=runner.groups.dp_rank, dp_size=job.dp, seed=args.seed + 1,
                            start_step=0, collate_fn=collate)
    reader = _RankData(it, collate, job.pad_token_id, args.micro_batch_size)
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
    """Greedy speculative decoding of `prompts`: mean committed tokens per target forward."""

    lengths, generated = [], []
    was_training = draft.training
    draft.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            out = spec_generate(target_model, draft, prompts[start:start + batch_size],
                                max_new_tokens=job.args.dflash_eval_max_new_tokens,
                                stop_token_ids=None if job.args.dflash_eval_ignore_eos else (job.stop_token_ids or None),
                                pad_token_id=job.pad_token_id,
                                attention_backend="chunked")
            lengths += [list(row) for row in out.acceptance_lengths]
            generated += [int(n) for n in out.num_generated]
    finally:
        draft.train(was_training)
    metric = decode_metric(lengths, generated)  # the tool's definition (tools/evaluate_acceptance.py)
    result = {"acceptance_length": metric["acceptance_length"] if metric["cycles"] else float("nan"),
              "cycles": metric["cycles"], "generated_tokens": metric["generated_tokens"],
              "tokens_per_target_forward": metric["tokens_per_target_forward"] or 0.0, "prompts": len(prompts)}
    if not metric["cycles"]:
        # Each prompt's first token comes from the prefill; a cycle needs a second one to draft for.
        result["no_cycle_reason"] = no_verify_cycle_reason(
            f"{metric['generated_tokens']} tokens for {len(prompts)} prompts: a stop token, or prompts the target "
            "cannot continue", "use prompts the target knows, or --dflash-eval-ignore-eos")
    return result


def _acceptance_line(result: dict) -> str:
    if not result["cycles"]:
        return f"{DECODE_ACCEPTANCE} n/a over {result['prompts']} held-out prompts: {result['no_cycle_reason']}"
    return (f"{DECODE_ACCEPTANCE} {result['acceptance_length']:.3f} (autoregressive baseline 1.0) over "
            f"{result['prompts']} held-out prompts, {result['cycles']} verify cycles, "
            f"{result['tokens_per_target_forward']:.2f} {DECODE_TOKENS_PER_FORWARD} per sequence")


def _decode_record(iteration: int, result: dict) -> dict:
    """The metrics.jsonl / TensorBoard values of one speculative-decoding evaluation."""

    return {DECODE_ACCEPTANCE: result["acceptance_length"] if result["cycles"] else None,
            DECODE_TOKENS_PER_FORWARD: result["tokens_per_target_forward"], "verify cycles": result["cycles"],
            "prompts": result["prompts"]}


# ------------------------------------------------------------------------------------------ train


@dataclass
class TrainResult:
    iterations: int
    start_iteration: int
    losses: list                      # per iteration run here
    learning_rates: list
    grad_norms: list
    metrics: list                     # per iteration dicts
    validation: list                  # (iteration, dict)
    acceptance: list                  # (iteration, dict) periodic + final
    final_acceptance: Optional[dict]
    export_dir: Optional[str]
    checkpoint_dir: Optional[str]
    wall_time_s: float
    exited_early: bool = False
    skipped_steps: int = 0            # global batches without a supervised slot: no optimizer step
    empty_micro_batches: int = 0      # micro-batches without a supervised slot (summed over DP)
    stopped_by: Optional[str] = None  # the signal (SIGTERM / SIGINT) that stopped the run after a step
    stop_message: str = ""            # then: where it stopped, what was saved, how to resume (one line)


def _export(job: Job, body) -> None:
    """The HF export. Every rank (also off the draft's pipeline stage) checks again that the directory is
    empty or this run's own earlier export (it may have filled up during training), and all ranks agree on
    the verdict (one all-reduce) before any rank writes. Then the draft's stage writes it, with the marker
    that records the run inside (published in the same rename as the weights); every rank learns whether
    that worked (a full file system: the same `NoSpaceError` on every rank)."""

    error: Optional[BaseException] = None
    try:
        check_export_directory(job.export_dir, run_name(job.args))
    except ArgumentError as err:
        error = err
    # Every rank has checked before any rank writes: a rank still checking while the draft's stage publishes
    # the export would otherwise see a directory it did not expect and stop alone.
    agree_or_raise(error, path=job.export_dir, note=None,
                   elsewhere=f"the HF export {job.export_dir} was refused on another rank.")
    if body is not None:
        try:
            # collective over the draft's TP group
            save_hf_checkpoint(body, job.export_dir, overwrite=True, extra_files=export_marker(job.args))
        except Exception as err:  # noqa: BLE001 - every rank must learn about any rank's failure
            error = err
    kept = (f"the checkpoints in {job.args.save} are intact; tools/convert_checkpoint.py to-hf exports one"
            if job.args.save else None)
    agree_or_raise(error, path=job.export_dir, note=kept,
                   elsewhere=f"writing the HF export {job.export_dir} failed on another rank.")


def _stop_message(signal_name: str, iteration: int, args) -> str:
    """The one line that ends a run stopped by a signal."""
    if not args.save:
        return (f"stopped by {signal_name} at iteration {iteration}; nothing was saved (no --save): rerun with "
                "--save to keep the progress of a stopped run.")
    return (f"stopped by {signal_name} at iteration {iteration}; checkpoint of iteration {iteration} in --save "
            f"{args.save}: resume with --load {args.save}.")


def _last_checkpoint_hint(args, last_saved: Optional[int]) -> str:
    """Where a stopped run can resume from (for its one-line message)."""
    if not args.save:
        return ""
    if last_saved is None:
        return f" No checkpoint of this run in --save {args.save} yet."
    return f" The last checkpoint (iteration {last_saved}) is in --save {args.save}."


def _log(ctx_rank: int, text: str) -> None:
    if ctx_rank == 0:
        print(text, flush=True)


def _args_snapshot(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None), list))}


def train(job: Job, *, hooks: Optional[dict] = None, env=None) -> TrainResult:
    """Run the whole job in this process (one rank of the launch). Collective over all ranks.

    A megatron target without CUDA runs under `device_shim.megatron_target_on_cpu()` (gloo CPU ranks)."""
    if job.args.target_backend == "megatron" and not job.args.use_cuda:
        with megatron_target_on_cpu():
            return _train(job, hooks=hooks, env=env)
    return _train(job, hooks=hooks, env=env)


def _train(job: Job, *, hooks: Optional[dict], env) -> TrainResult:
    """`train` in this process: set up, build, resume, the steps, then the end (export, final evaluation);
    everything set up is released at the end, also on failure."""
    run = _Training(job, hooks or {}, env)
    try:
        return run.run()
    finally:
        run.close()


class _Training:
    """One training run, step by step (`run`); `close` releases what it set up. Every rank runs every step."""

    def __init__(self, job: Job, hooks: dict, env):
        self.job, self.args, self.hooks = job, job.args, hooks
        self.t_start = time.time()
        self.ctx = initialize_distributed(job, env)
        self.rank = self.ctx.rank
        self.monitor = self.run_dir = self.save_lock = None
        self.stop = StopSignals()
        self.dtype = torch.bfloat16 if self.args.bf16 else torch.float32
        self.body = self.engine = None
        self.last_saved: Optional[int] = None

    def log0(self, text: str) -> None:
        """A line printed by rank 0 only."""
        _log(self.rank, text)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.run_dir is not None:
            self.run_dir.close()
        self.stop.restore()
        if self.save_lock is not None:
            self.save_lock.release()
        self.ctx.close()

    def run(self) -> TrainResult:
        job, args = self.job, self.args
        if args.save:  # one run per save directory, before anything is built (the same verdict on every rank)
            self.save_lock = lock_save_directory(args.save, log=self.log0)
        self._announce()
        # data, checked before anything is built: same verdict on every rank (file reads only)
        train_ds, self.valid_ds = build_datasets(job)
        collate = Collator(job.pad_token_id, args.seq_length, args.pack_sequences)
        _check_data(job, train_ds, collate, log=self.log0)
        self._build_models()
        start_iteration = self._resume()
        data_iter = MicroBatchIterator(
            train_ds, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            dp_rank=self.ctx.groups.dp_rank, dp_size=job.dp, seed=args.seed,
            start_step=start_iteration, collate_fn=collate,
        )
        self.train_data = _RankData(data_iter, collate, job.pad_token_id, args.micro_batch_size)
        self._open_outputs(start_iteration)
        iteration, exited = self._steps(start_iteration)
        return self._finish(iteration, exited)

    def _announce(self) -> None:
        job, args, cfg, ctx = self.job, self.args, self.job.draft_config, self.ctx
        self.log0(f"[dflash] variant {job.variant.name}: {cfg.num_hidden_layers} draft layer(s), hidden "
                  f"{cfg.hidden_size}, block size {cfg.block_size}, target layers {cfg.target_layer_ids} of "
                  f"{cfg.num_target_layers}, MASK {cfg.mask_token_id}; target {job.target_dir} ({args.target_backend}); "
                  f"world {ctx.world_size} = TP {job.tp} x PP {job.pp} x DP {job.dp}; global batch "
                  f"{args.global_batch_size} = micro {args.micro_batch_size} x {args.num_micro_batches} x DP {job.dp}; "
                  f"device {ctx.device.type}")

    def _build_models(self) -> None:
        """The target (every rank) and, on the draft's stage (PP > 1: one stage only), the body and its engine."""
        job, args, cfg, ctx = self.job, self.args, self.job.draft_config, self.ctx
        self.target = _Target(job, ctx.device, self.dtype, ctx.groups)
        if self.target.placement is not None:
            self.log0(f"[dflash] pipeline: the draft is on stage {self.target.placement.draft_stage} of {job.pp}")
        torch.manual_seed(args.seed)
        if self.target.is_draft:
            parallel_config = default_parallel_config(params_dtype=self.dtype, bf16=args.bf16)
            body = job.variant.build_body(cfg, parallel_config, attention_backend=args.dflash_attention_backend)
            if job.init_from is not None:
                try:
                    load_hf_state_dict_into(body, job.variant.read_hf_tensors(read_safetensors(job.init_from)))
                except ValueError as err:  # damaged weights: the same on every rank (each reads the file)
                    raise ArgumentError(f"--dflash-init-from={job.init_from}: {err}") from err
                self.log0(f"[dflash] initialised the draft from {job.init_from}")
            body.to(ctx.device)
            body.train()
            self.body = body
            # through the module: the engine builder is the seam that the reference engine of the tests and the
            # GPU check swap in (`optim.build_engine = ...`)
            self.engine = optim.build_engine(body, args, cfg, use_cuda=args.use_cuda, groups=ctx.groups)
        model = self.engine.model if self.engine is not None else None
        self.runner = _StepRunner(job, self.body, model, self.target, ctx.device, ctx.groups)

    def _resume(self) -> int:
        """The iteration to start from: `--load`'s checkpoint restored (agreed on every rank), else 0."""
        args = self.args
        if args.load is None:
            return 0
        # read on rank 0 and broadcast: every rank resumes at the same iteration or raises the same error
        point = agree_on_resume_point(args.load, self.job.draft_config,
                                      override_config=getattr(args, "dflash_override_checkpoint_config", False),
                                      log=self.log0)
        state = None
        if point is not None:
            layout = optimizer_layout(args.use_distributed_optimizer, args.tensor_model_parallel_size)
            state = load_checkpoint(args.load, self.body, self.engine, point=point, log=self.log0,
                                    optimizer_layout=layout)
        if state is None:
            self.log0(f"[checkpoint] WARNING: --load={args.load} is {'empty' if os.path.isdir(args.load) else 'absent'}"
                      ": no checkpoint to resume from, TRAINING FROM SCRATCH.")
            return 0
        start_iteration = int(state["iteration"])
        saved = state.get("args", {})
        # the draft's own settings were compared with its dflash_config.json; these set the data order
        for key in ("global_batch_size", "seed", "data_format"):
            if saved.get(key) is not None and saved[key] != getattr(args, key):
                self.log0(f"[checkpoint] warning: --{key.replace('_', '-')} was {saved[key]} in the "
                          f"checkpoint and is {getattr(args, key)} now; the run does not continue exactly.")
        self.log0(f"[checkpoint] resumed from {state['directory']} at iteration {start_iteration}")
        return start_iteration

    def _open_outputs(self, start_iteration: int) -> None:
        """The monitor, the run directory and the result, from `start_iteration` on."""
        job, args = self.job, self.args
        self.monitor = Monitor(args, rank=self.rank, total_iters=args.train_iters, start_iter=start_iteration,
                               config=_args_snapshot(args))
        self.log = self.monitor.print
        self.run_dir = RunWriter(job.run_dir, active=self.rank == 0, log=self.log)
        self.run_dir.write_args(args)
        self.run_dir.link_latest()
        if start_iteration > 0:
            self.run_dir.load_existing_metrics(start_iteration)
        self.eval_here = (self.rank == 0 and job.eval_prompts is not None and job.tp == 1
                          and self.target.hf_model is not None)
        if job.eval_prompts is None:
            self.log(f"[eval] acceptance evaluation skipped: {job.eval_skip_reason}.")
        self.result = TrainResult(iterations=start_iteration, start_iteration=start_iteration, losses=[],
                                  learning_rates=[], grad_norms=[], metrics=[], validation=[], acceptance=[],
                                  final_acceptance=None, export_dir=None, checkpoint_dir=None, wall_time_s=0.0)
        self.last_saved = start_iteration if args.load is not None and start_iteration > 0 else None

    def checkpoint(self, iteration: int) -> None:
        args, engine = self.args, self.engine
        common = {
            "iteration": iteration,
            "consumed_train_samples": iteration * args.global_batch_size,
            # off the draft's stage there is no scheduler: save_checkpoint takes the draft stage's
            "scheduler": engine.scheduler.state_dict() if engine is not None else None,
            "args": _args_snapshot(args),
            "data": {"format": args.data_format, "seed": args.seed, "next_step": iteration},
        }
        t0 = time.time()
        self.result.checkpoint_dir = save_checkpoint(args.save, iteration, self.body, engine, common=common,
                                                     log=self.log, groups=self.ctx.groups)
        self.last_saved = iteration
        self.log(f"[checkpoint] saved iteration {iteration} to {self.result.checkpoint_dir} ({time.time() - t0:.1f}s)")

    def evaluate(self, iteration: int) -> None:
        """The periodic evaluation: validation loss, and decode acceptance where this rank can decode."""
        job, result, run_dir = self.job, self.result, self.run_dir
        if self.valid_ds is not None:
            values = validation_loss(self.runner, self.valid_ds, job)
            result.validation.append((iteration, values))
            self.log(f"[eval] iteration {iteration} validation | {format_metrics(labelled(values, 'valid'))}")
            self.monitor.scalars(labelled(values, "valid"), iteration, prefix="valid")
            run_dir.metrics({"iteration": iteration, "split": "valid", **labelled(values, "valid")})
        if self.eval_here:
            acc = acceptance_length(self.target.hf_model, self.body, job.eval_prompts, job)
            result.acceptance.append((iteration, acc))
            self.log(f"[eval] iteration {iteration} | {_acceptance_line(acc)}")
            self.monitor.scalars(_decode_record(iteration, acc), iteration, prefix="decode")
            run_dir.metrics({"iteration": iteration, "split": "decode", **_decode_record(iteration, acc)})
        run_dir.plot()
        if self.ctx.groups.is_distributed:
            dist.barrier()

    def _steps(self, start_iteration: int) -> tuple[int, bool]:
        """The optimizer steps up to `--train-iters`; returns the last iteration and whether `--exit-interval`
        ended them (a signal ends them with `result.stopped_by` set)."""
        args, result = self.args, self.result
        self.window = (time.time(), 0.0, start_iteration)  # (start time, tokens, first iteration) of a log interval
        iteration = start_iteration
        self.stop.install()  # SIGTERM / SIGINT: finish the step, save, exit (until the last checkpoint is written)
        while iteration < args.train_iters:
            step_t0 = time.time()
            totals = self._step(iteration)
            iteration += 1
            values = self._record(iteration, totals, step_t0)
            if "on_step" in self.hooks:
                self.hooks["on_step"](iteration, values, self.body)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                self.checkpoint(iteration)
            # On every rank, every step: one all-reduce of one integer. After the periodic save (a signal that
            # lands during it stops here too), before the evaluation (which a stopping run skips).
            result.stopped_by = self.stop.agreed()
            if result.stopped_by:
                return iteration, False
            if args.eval_interval and iteration % args.eval_interval == 0 and iteration < args.train_iters:
                self.evaluate(iteration)
            if getattr(args, "exit_interval", None) and iteration % args.exit_interval == 0 \
                    and iteration < args.train_iters:
                return iteration, True
        return iteration, False

    def _step(self, iteration: int) -> StepStatistics:
        """One optimizer step over this rank's micro-batches; its statistics reduced over DP (and PP)."""
        args, engine, runner = self.args, self.engine, self.runner
        if engine is not None:
            engine.zero_grad()
        acc = None
        for _ in range(args.num_micro_batches):
            stats = self.train_data.mark(runner.micro_batch(next(self.train_data), step=iteration, seed=args.seed,
                                                            backward=True))
            acc = stats if acc is None else acc + stats
        lr = grad_norm = float("nan")
        if engine is not None:
            lr = engine.lr
            # No supervised slot in the whole global batch (the weight is summed over DP, so every rank
            # decides alike): no optimizer step, so neither Adam's moments nor the schedule move.
            if engine.finish_grads(acc.counts.weight_sum) > 0:
                try:
                    grad_norm = engine.step()
                except DivergenceError as err:  # raised on every rank of the draft alike
                    hint = _last_checkpoint_hint(args, self.last_saved)
                    raise DivergenceError(f"iteration {iteration + 1}: {err}{hint}") from err
        totals = runner.reduce(acc, {"lr": lr, "grad_norm": grad_norm})
        self.train_data.stop_if_unreadable(totals)  # before anything of this step is logged or saved
        return totals

    def _record(self, iteration: int, totals: StepStatistics, step_t0: float) -> dict:
        """The step's values into the result, the monitor and (each log interval) the log; returns them."""
        result, log = self.result, self.log
        lr, grad_norm = totals.scalars["lr"], totals.scalars["grad_norm"]
        empty = int(round(float(totals.counts.empty_micro_batches)))
        result.empty_micro_batches += empty
        if float(totals.counts.weight_sum) <= 0:
            result.skipped_steps += 1
            log(f"[dflash] iteration {iteration}: no supervised slot in the global batch ({empty} empty "
                f"micro-batch(es)); optimizer step skipped ({result.skipped_steps} skipped so far).")
        values = totals.log_values()
        tokens = float(totals.counts.tokens)
        tps = tokens / max(1e-9, time.time() - step_t0)
        values.update({"learning rate": lr, "grad norm": grad_norm, "tokens per second": tps})
        if result.empty_micro_batches:
            values.update({"empty micro-batches": result.empty_micro_batches,
                           "skipped steps": result.skipped_steps})
        result.losses.append(values["loss"])
        result.learning_rates.append(lr)
        result.grad_norms.append(grad_norm)
        result.metrics.append(values)
        result.iterations = iteration
        window_t0, window_tokens, window_start = self.window
        self.window = (window_t0, window_tokens + tokens, window_start)
        self.monitor.scalars(labelled(values, "train"), iteration)
        self.monitor.advance(f"loss {values['loss']:.3f} acc {values['accuracy']:.2f}")
        if iteration % self.args.log_interval == 0 or iteration == self.args.train_iters:
            self._log_interval(iteration, values)
        return values

    def _log_interval(self, iteration: int, values: dict) -> None:
        """The log line of the interval that ends at `iteration` (like megatron: the statistics are means over
        the interval; lr and grad norm the last)."""
        args = self.args
        window_t0, window_tokens, window_start = self.window
        elapsed = time.time() - window_t0
        window = self.result.metrics[window_start - iteration:]
        means = {k: sum(m[k] for m in window) / len(window) for k in values
                 if k not in ("learning rate", "grad norm", "tokens per second")}
        line = {"iteration": f"{iteration:6d}/{args.train_iters}",
                "consumed samples": iteration * args.global_batch_size,
                "elapsed time per iteration (ms)": 1000.0 * elapsed / len(window)}
        line.update(labelled({**values, **means}, "train"))
        line["tokens per second"] = window_tokens / max(1e-9, elapsed)
        self.log(format_metrics(line))
        self.run_dir.metrics({"iteration": iteration, "split": "train",
                              **{k: v for k, v in line.items() if k != "iteration"}})
        self.window = (time.time(), 0.0, iteration)

    def _finish(self, iteration: int, exited: bool) -> TrainResult:
        """The last save; then a stopped or exited run returns, a finished one validates, exports and evaluates."""
        args, result = self.args, self.result
        if args.save and self.last_saved != iteration:
            self.checkpoint(iteration)
        result.stopped_by = result.stopped_by or self.stop.agreed()  # also a signal during that last save
        self.stop.restore()
        result.exited_early = exited or result.stopped_by is not None
        if result.stopped_by or exited:
            if result.stopped_by:
                result.stop_message = _stop_message(result.stopped_by, iteration, args)
                self.log(f"[dflash] {result.stop_message}")
            else:
                self.log(f"[dflash] exiting at iteration {iteration} (--exit-interval {args.exit_interval}); "
                         f"resume with --load {args.save}.")
            self.run_dir.plot()
            result.wall_time_s = time.time() - self.t_start
            return result
        self.monitor.close()
        self._final_outputs(iteration)
        result.wall_time_s = time.time() - self.t_start
        skipped = ""
        if result.empty_micro_batches:
            skipped = (f" ({result.empty_micro_batches} micro-batch(es) without a supervised slot, "
                       f"{result.skipped_steps} optimizer step(s) skipped)")
        self.log0(f"[dflash] done: {iteration} iterations in {result.wall_time_s:.0f}s{skipped}")
        self.run_dir.finish(self.job, result)  # summary.json, plot, the headline and the next steps (rank 0)
        return result

    def _final_outputs(self, iteration: int) -> None:
        """The final validation, the HF export, and the decode evaluation of the exported draft (rank 0)."""
        job, result, ctx, run_dir = self.job, self.result, self.ctx, self.run_dir
        if self.valid_ds is not None:
            values = validation_loss(self.runner, self.valid_ds, job)
            result.validation.append((iteration, values))
            self.log0(f"[eval] final validation | {format_metrics(labelled(values, 'valid'))}")
            run_dir.metrics({"iteration": iteration, "split": "valid", **labelled(values, "valid")})
        _export(job, self.body)
        result.export_dir = job.export_dir
        self.log0(f"[export] HF draft written to {job.export_dir}")
        if ctx.groups.is_distributed:
            dist.barrier()
        if job.eval_prompts is not None and self.rank == 0:
            exported = load_hf_checkpoint(job.export_dir, tp_group=SingleRankGroup(),
                                          attention_backend="chunked").to(ctx.device)
            target = self.target
            hf_model = target.hf_model if target.hf_model is not None else _load_hf_model(job, self.dtype)
            final = acceptance_length(hf_model.to(ctx.device), exported, job.eval_prompts, job)
            result.final_acceptance = final
            result.acceptance.append((iteration, final))
            print(f"[final] {_acceptance_line(final)}", flush=True)
            run_dir.metrics({"iteration": iteration, "split": "decode", **_decode_record(iteration, final)})
        elif job.eval_prompts is None:
            self.log0(f"[final] acceptance evaluation skipped: {job.eval_skip_reason}.")
        if ctx.groups.is_distributed:
            dist.barrier()


def run(argv: Optional[Sequence[str]] = None, *, hooks: Optional[dict] = None, env=None,
        world_size: Optional[int] = None, console=None) -> TrainResult:
    """Parse, validate, train. Raises `ArgumentError` for a bad command line (before any collective).

    `console` (a `rundir.ConsoleLog`) is attached to `<run-dir>/console.log` once the job is valid."""
    args = parse_args(argv)
    job = prepare_job(args, world_size, env)
    if console is not None:
        console.attach(os.path.join(job.run_dir, "console.log"))
    return train(job, hooks=hooks, env=env)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: expected failures (arguments, checkpoints, data, a diverged loss, a full file system
    under a checkpoint or the export) end in one line on stderr (exit 2 for arguments, 1 otherwise) on every
    rank; bugs keep their traceback. A run stopped by SIGTERM / SIGINT during the steps ends in one line with
    `signals.STOPPED_EXIT_STATUS`, a SIGINT outside them in one line with `common.cli.INTERRUPTED_EXIT_STATUS`."""

    # rank 0 keeps the console log (the other ranks print nothing but errors)
    console = ConsoleLog.start() if os.environ.get("RANK", "0") == "0" else None
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        result = run(argv, console=console)
        if result.stopped_by:  # SIGTERM / SIGINT during the steps: saved, resumable (every rank says so)
            print(f"pretrain_dflash.py: {result.stop_message}", file=sys.stderr, flush=True)
            return STOPPED_EXIT_STATUS
    except RunError as err:
        report_failure("pretrain_dflash.py", err, debug=debug)
        return 2 if isinstance(err, ArgumentError) else 1
    except Exception as err:  # noqa: BLE001 - a full file system (checkpoint, export) is expected; bugs are not
        if not is_no_space(err):
            raise
        report_failure("pretrain_dflash.py", err, debug=debug)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the steps: loading, the final evaluation or export
        return report_interrupt("pretrain_dflash.py", "outside the training steps (loading, evaluating or "
                                "exporting); the checkpoints already in --save are complete, rerun to continue")
    finally:
        if console is not None:
            console.stop()
    return 0
