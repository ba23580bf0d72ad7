"""The DFlash training loop: data -> plan -> target taps -> draft body -> loss -> optimizer.

`main(argv)` is what `pretrain_dflash.py` runs: parse, validate (identically on every rank,
before any collective), initialise `torch.distributed` and megatron's `parallel_state`, train,
checkpoint, evaluate, export. `train(job)` is the in-process API the tests call.

This module holds the run (`train`, `_Training`: build, resume, the optimizer steps, checkpoints, the
export and the final evaluation) and the command line; its parts are their own modules: the distributed
set-up (`training/distributed.py`), the frozen target (`training/frozen_target.py`), the datasets
(`training/datasets.py`), the micro-batch step and its statistics (`training/step.py`) and the evaluation
(`training/evaluation.py`).

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

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..checkpoint.hf import load_hf_checkpoint, load_hf_state_dict_into, read_safetensors, save_hf_checkpoint
from ..common.cli import is_no_space, report_failure, report_interrupt
from ..common.errors import DivergenceError, RunError
from ..common.parallel import SingleRankGroup, agree_or_raise
from ..data.batching import Collator, MicroBatchIterator
from ..draft.body import default_parallel_config
from ..variants.dspark import FROZEN_COPIES, target_copy_mismatch
from . import optim
from .arguments import ArgumentError, parse_args
from .checkpointing import load_checkpoint, save_checkpoint
from .datasets import build_datasets, check_training_data
from .device_shim import megatron_target_on_cpu
from .distributed import initialize_distributed
from .evaluation import acceptance_length, acceptance_line, decode_record, validation_loss
from .draft_vocab import install_draft_vocab, read_draft_vocab_file, resolve_draft_vocab, target_head_rows
from .frozen_target import FrozenTarget, load_hf_model
from .job import Job, prepare_job
from .monitor import Monitor, format_metrics, labelled
from .optim import optimizer_layout
from .outputs import check_export_directory, export_marker, run_name
from .resume import agree_on_resume_point
from .rundir import ConsoleLog, RunWriter
from .savelock import lock_save_directory
from .signals import STOPPED_EXIT_STATUS, StopSignals
from .step import RankData, StepRunner, StepStatistics
from .target_cache import build_cached_target

__all__ = ["TrainResult", "train", "run", "main"]


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


def _first_message(per_rank: list, mismatch: bool) -> str:
    """`agree_or_raise`'s message when some ranks of the group erred: the first rank's, raised on every rank."""
    return next(error for error, _ in per_rank if error is not None)


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
        vocab_file = read_draft_vocab_file(job)  # --dflash-draft-vocab's file: before the data is read
        train_ds, self.valid_ds = build_datasets(job)
        collate = Collator(job.pad_token_id, args.seq_length, args.pack_sequences)
        check_training_data(job, train_ds, collate, log=self.log0)
        self.draft_vocab = resolve_draft_vocab(job, train_ds, log=self.log0, chosen=vocab_file)
        self._build_models({"train": train_ds, "valid": self.valid_ds})
        start_iteration = self._resume()
        data_iter = MicroBatchIterator(
            train_ds, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
            dp_rank=self.ctx.groups.dp_rank, dp_size=job.dp, seed=args.seed,
            start_step=start_iteration, collate_fn=collate,
        )
        self.train_data = RankData(data_iter, collate, job.pad_token_id, args.micro_batch_size)
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
                  f"device {ctx.device.type}; loss weights {job.loss_weighting.describe(job.decay_gamma)}")

    def _build_models(self, datasets: dict) -> None:
        """The target (every rank; read from `--dflash-target-cache` when given) and, on the draft's stage (PP > 1:
        one stage only), the body and its engine."""
        job, args, cfg, ctx = self.job, self.args, self.job.draft_config, self.ctx
        if args.dflash_target_cache is None:
            self.target = FrozenTarget(job, ctx.device, self.dtype, ctx.groups)
        else:
            self.target = build_cached_target(job, datasets, ctx.device, self.dtype, ctx.groups, log=self.log0)
        if self.target.placement is not None:
            self.log0(f"[dflash] pipeline: the draft is on stage {self.target.placement.draft_stage} of {job.pp}")
        torch.manual_seed(args.seed)
        if self.target.is_draft:
            parallel_config = default_parallel_config(params_dtype=self.dtype, bf16=args.bf16)
            body = job.variant.build_body(cfg, parallel_config, attention_backend=args.dflash_attention_backend)
            if self.draft_vocab is not None:  # docs/design.md §20 Reduced draft vocabulary
                install_draft_vocab(body, self.draft_vocab, self.target.head, trainable=args.dflash_train_draft_head)
            if job.init_from is not None:
                try:
                    tensors = read_safetensors(job.init_from)
                    if self.draft_vocab is not None and "d2t" not in tensors:  # a full-vocabulary drafter
                        tensors.update({"lm_head.weight": target_head_rows(self.target.head, self.draft_vocab.ids),
                                        "d2t": self.draft_vocab.d2t})
                    if any(name in tensors for name in FROZEN_COPIES):  # each rank compares its vocabulary rows
                        agree_or_raise(target_copy_mismatch(tensors, self.target.embedding, self.target.head),
                                       group=self.target.head.tp_group, explain=_first_message)
                    load_hf_state_dict_into(body, job.variant.read_hf_tensors(tensors, cfg))
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
        self.runner = StepRunner(job, self.body, model, self.target, ctx.device, ctx.groups)

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
            self.log(f"[eval] iteration {iteration} | {acceptance_line(acc)}")
            self.monitor.scalars(decode_record(iteration, acc), iteration, prefix="decode")
            run_dir.metrics({"iteration": iteration, "split": "decode", **decode_record(iteration, acc)})
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
            self.target.before_step(iteration)  # hybrid cache mode: the first epoch's end completes the cache
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
            hf_model = target.hf_model if target.hf_model is not None else load_hf_model(job, self.dtype)
            final = acceptance_length(hf_model.to(ctx.device), exported, job.eval_prompts, job)
            result.final_acceptance = final
            result.acceptance.append((iteration, final))
            print(f"[final] {acceptance_line(final)}", flush=True)
            run_dir.metrics({"iteration": iteration, "split": "decode", **decode_record(iteration, final)})
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
