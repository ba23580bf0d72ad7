"""Command-line arguments of `pretrain_dflash.py`: Megatron-style names, one validator.

`parse_args(argv)` only parses. `validate_args(args, world_size, env)` checks every combination
and raises one `ArgumentError` naming the flag(s) and the fix. It is a pure function of the
arguments, the world size and the environment (CUDA availability, installed optional packages):
every rank of a launch evaluates it before any collective, so a bad combination stops every rank
with the same message instead of leaving some of them waiting in a collective.

Run without any argument, the defaults are the embedded job: the cached tiny Qwen3 target
(`embedded_job.tiny_target.ensure_tiny_target`), synthetic chats (train split and held-out prompts from
two seeds), a 2-layer draft with block size 8, 1200 steps, HF export and a speculative-decoding
acceptance evaluation; a few minutes on a 2-core CPU once the target is cached. The batch-size /
sequence-length / learning-rate defaults are that job's; set them for real runs.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Mapping, Optional, Sequence

from ..common.cli import ArgumentParser, UsageError, json_object_option, require_dir, require_file
from ..common.model_dirs import resolve_model_dir
from ..common.errors import RunError
from ..data.chat import LOSS_TURNS, REASONING_MODES
from ..data.formats import BAD_RECORD_MODES, DEFAULT_MAX_BAD_FRACTION, data_path_problem
from ..variants.options import BUILT_IN_OPTIONS, Flag, declared_options

__all__ = [
    "ArgumentError",
    "DATA_FORMATS",
    "TARGET_BACKENDS",
    "LR_DECAY_STYLES",
    "build_parser",
    "parse_args",
    "validate_args",
    "check_input_paths",
    "chat_template_kwargs",
    "parse_layer_ids",
    "RunDefault",
    "resolve_run_defaults",
    "draft_config_overrides",
    "resolve_decay_gamma",
    "world_size_from_env",
    "cuda_available",
]

DATA_FORMATS = ("chat", "text", "indexed", "synthetic")
TARGET_BACKENDS = ("hf", "megatron")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
ATTENTION_BACKENDS = ("auto", "chunked", "flex", "dense")
DEFAULT_VARIANT = next(iter(BUILT_IN_OPTIONS))  # the published DFlash draft

# Defaults of the embedded job (no arguments): tuned to finish in a few minutes on a 2-core CPU.
EMBEDDED_SYNTHETIC_TRAIN_SEED = 20250101
EMBEDDED_SYNTHETIC_HELDOUT_SEED = 20250202


class ArgumentError(RunError):
    """A bad command line; the message says which flags and how to fix them."""


def build_parser() -> argparse.ArgumentParser:

    p = ArgumentParser(
        prog="pretrain_dflash.py",
        description=(
            "Train a DFlash block-diffusion draft model next to a frozen target LLM (megatron-core). "
            "Without arguments: a complete small job on the embedded tiny target (CPU, a few minutes)."
        ),
        allow_abbrev=False,
    )
    _add_parallelism_arguments(p)
    _add_schedule_arguments(p)
    _add_output_arguments(p)
    _add_data_arguments(p)
    _add_target_arguments(p)
    _add_draft_arguments(p)
    add_draft_recipe_arguments(p)
    add_target_cache_arguments(p)
    return p


def _add_parallelism_arguments(p: argparse.ArgumentParser) -> None:
    """The "parallelism" options of `build_parser`."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism of a mixture-of-experts target (megatron backend): each rank holds "
                        "num_experts / EP experts of every MoE layer.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert of a MoE target (unset: "
                        "--tensor-model-parallel-size, as in megatron).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard the target's activations along the sequence within the tensor-parallel group "
                        "(megatron backend, TP > 1); the taps are gathered back to the full sequence.")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism is not supported for the target (only 1); see the error for why.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron's distributed optimizer: Adam state and fp32 main weights sharded over "
                        "data-parallel ranks (ZeRO-1); checkpoints resume exactly at the same or another DP size.")


def _add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """The "batch and schedule" options of `build_parser`."""
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch per data-parallel rank.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="rows per optimizer step over all data-parallel ranks (default: micro * DP).")
    g.add_argument("--seq-length", type=int, default=48)
    g.add_argument("--train-iters", type=int, default=1200)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="linear warm-up from 0 (default: 10%% of the decay length, at most 20).")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters.")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off).")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 weights and activations (fp32 master weights).")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The "checkpoints, evaluation, logging" options of `build_parser`."""
    g = p.add_argument_group("checkpoints, evaluation, logging")
    g.add_argument("--run-dir", default=None,
                   help="where the run writes args.json, console.log, metrics.jsonl, metrics.png, summary.json "
                   "(default: runs/<$DFLASH_RUN_NAME or dflash-<time>>; runs/latest points to the newest).")
    g.add_argument("--save", default=None,
                   help="directory of torch_dist training checkpoints (default: <run-dir>/checkpoints for the "
                   "embedded job, else none).")
    g.add_argument("--load", default=None,
                   help="resume from the checkpoint named by this directory's latest_checkpointed_iteration.txt "
                   "(absent or empty: train from scratch, with a warning).")
    g.add_argument("--dflash-override-checkpoint-config", action="store_true",
                   help="resume although the checkpoint's draft config (dflash_config.json) differs from this "
                   "run's (block size, MASK token, target layers, ...): its weights continue under the new settings.")
    g.add_argument("--debug", action="store_true",
                   help="print the traceback of expected failures too (also: MEGATRON_DFLASH_DEBUG=1).")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end).")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss + acceptance length every N iterations (default: none during "
                   "training, always at the end).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving a checkpoint) when the iteration is a multiple of N; resume with --load.")
    g.add_argument("--eval-iters", type=int, default=2, help="global batches of the validation loss.")
    g.add_argument("--log-interval", type=int, default=50)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--no-progress-bar", action="store_true")


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The "data" options of `build_parser`."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="training data: a data file or directory (chat/text) or an indexed-dataset prefix (indexed).")
    g.add_argument("--train-data", default=None,
                   help="training data: a JSONL, JSON-array or Parquet file, a directory of them or one written by "
                   "datasets' save_to_disk (chat/text), or an indexed-dataset prefix (indexed).")
    g.add_argument("--valid-data", default=None, help="validation data, as --train-data.")
    g.add_argument("--data-format", choices=DATA_FORMATS, default=None,
                   help="chat: each record an OpenAI 'messages', ShareGPT 'conversations' or plain 'text' record, "
                   "detected per record; text: 'text' records only; indexed; synthetic. Default: synthetic when no "
                   "data path is given and --target is not set.")
    g.add_argument("--bad-records", choices=BAD_RECORD_MODES, default="fail",
                   help="a record that cannot be used (not a format, no role, empty, non-string content, a turn "
                   "order the chat template refuses): stop with its file:line (fail) or skip it, named (skip).")
    g.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION,
                   help="with --bad-records skip: the data is refused when more than this fraction of its records "
                   "are bad.")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (.jinja, or a JSON file with 'chat_template') used instead of "
                   "the tokenizer's, for the data and the evaluation prompts.")
    g.add_argument("--chat-template-kwargs", default=None,
                   help='a JSON object passed to apply_chat_template, e.g. \'{"enable_thinking": false}\'.')
    g.add_argument("--reasoning", choices=REASONING_MODES, default="train",
                   help="assistant thinking (reasoning_content, <think>...</think>): trained on (train), in the "
                   "input but out of the loss (mask), or removed (drop).")
    g.add_argument("--loss-turns", choices=LOSS_TURNS, default="all",
                   help="the assistant turns the loss covers: every one (all) or only the last (last).")
    g.add_argument("--pack-sequences", action="store_true", help="pack several documents per row.")
    g.add_argument("--synthetic-train-samples", type=int, default=20000)
    g.add_argument("--synthetic-valid-samples", type=int, default=256)
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: --target).")


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The "target" options of `build_parser`."""
    g = p.add_argument_group("target")
    g.add_argument("--target", default=None,
                   help="HF directory or hub id (Qwen/Qwen3-8B: read from the local HF cache, downloaded once when "
                   "missing) of the frozen target (default: the embedded tiny target, built "
                   "once and cached under $MEGATRON_DFLASH_CACHE or ~/.cache/megatron_dflash).")
    g.add_argument("--target-backend", choices=TARGET_BACKENDS, default="hf",
                   help="hf: transformers model (TP=PP=1 only); megatron: megatron-core GPTModel at TP/PP.")


def _add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """The "draft" options of `build_parser`."""
    g = p.add_argument_group("draft")
    g.add_argument("--dflash-variant", default=DEFAULT_VARIANT, metavar="NAME",
                   help="the draft model to train: a variant of the registry (megatron_dflash.variants; built in: "
                   f"{', '.join(BUILT_IN_OPTIONS)}).")
    g.add_argument("--dflash-block-size", type=int, default=RunDefault(16, 8), help="gamma + 1.")
    g.add_argument("--dflash-anchors-per-sample", type=int, default=RunDefault(512, 8),
                   help="blocks per row (unless given, capped at seq_length - block_size + 1 with --target).")
    g.add_argument("--dflash-decay-gamma", type=float, default=RunDefault(DECAY_GAMMA_HELP, "block_size - 1"),
                   help="loss weight decay length (0: uniform weights; JetSpec is uniform unless given).")
    g.add_argument("--dflash-target-layer-ids", default=None,
                   help="comma-separated 0-based target layers to tap (default: the published formula).")
    g.add_argument("--dflash-mask-token-id", type=int, default=None,
                   help="MASK token id (default: the tokenizer's mask token, else the first row of the target's "
                   "embedding past the tokenizer's ids; never pad or EOS, never a resize).")
    g.add_argument("--dflash-num-layers", type=int, default=RunDefault(5, 2), help="draft decoder layers.")
    g.add_argument("--dflash-init-from", default=None, help="initialise from a published HF drafter (a directory or hub id; default: none, random initialisation).")
    g.add_argument("--dflash-pipeline-stage", type=int, default=-1,
                   help="pipeline stage that holds the draft (-1: the last).")
    g.add_argument("--dflash-variable-prefix", type=float, nargs="?", const=0.9, default=None, metavar="BASE",
                   help="variable-prefix (D2SD) training with prior Pr(l) ~ BASE**l (off by default; BASE 0.9 "
                   "when given without a value).")
    g.add_argument("--dflash-distill-temperature", type=float, default=1.0,
                   help="JetSpec, and --dflash-soft-target: temperature of the distillation to the target.")
    g.add_argument("--dflash-loss-chunk", type=int, default=1024, help="predicted slots per loss chunk.")
    _add_draft_vocab_arguments(g)
    g.add_argument("--dflash-attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="block attention kernel of the draft.")
    g.add_argument("--dflash-eval-prompts", default=None,
                   help="JSONL of prompts ({input_ids}|{prompt}|{messages}) for the acceptance evaluation, "
                   "or an integer N: N held-out synthetic chats (default 24 for synthetic data).")
    g.add_argument("--dflash-eval-max-new-tokens", type=int, default=64,
                   help="acceptance evaluation: tokens generated per prompt.")
    g.add_argument("--dflash-eval-ignore-eos", action="store_true",
                   help="acceptance evaluation: always generate --dflash-eval-max-new-tokens (no stop token).")
    g.add_argument("--dflash-export", default=None,
                   help="HF draft directory written at the end (default: <save>/hf when --save is given, else "
                   "<run-dir>/hf).")


def _add_draft_vocab_arguments(g) -> None:
    """The reduced draft vocabulary's options (docs/design.md §20 Reduced draft vocabulary)."""
    g.add_argument("--dflash-draft-vocab-size", type=int, default=None, metavar="K",
                   help="a reduced draft vocabulary: the draft proposes among K target tokens (the MASK and special "
                   "tokens, then the most frequent loss-masked tokens of the training data) through its own head "
                   "over those K rows of the target's (default: the whole target vocabulary).")
    g.add_argument("--dflash-draft-vocab", default=None, metavar="FILE",
                   help="with --dflash-draft-vocab-size: the K ids chosen by tools/count_draft_vocab.py (default: "
                   "counted over the training data when the job starts).")
    g.add_argument("--dflash-train-draft-head", action="store_true",
                   help="with --dflash-draft-vocab-size: train the draft head's rows (default: frozen copies of the "
                   "target head's).")


def _check_draft_vocab(args: argparse.Namespace) -> None:
    """The reduced draft vocabulary's flags: a size, DFlash's hard-label loss, what the others need."""
    K = args.dflash_draft_vocab_size
    if K is None:
        for flag, value in (("--dflash-draft-vocab", args.dflash_draft_vocab),
                            ("--dflash-train-draft-head", args.dflash_train_draft_head)):
            if value:
                raise ArgumentError(f"{flag} needs --dflash-draft-vocab-size K (the reduced draft vocabulary).")
        return
    if K < 1:
        raise ArgumentError(f"--dflash-draft-vocab-size={K} must be a positive number of tokens.")
    if args.dflash_variant != "dflash":
        raise ArgumentError(f"--dflash-draft-vocab-size trains --dflash-variant dflash only (not "
                            f"{args.dflash_variant}): the other variants' heads span the whole target vocabulary.")
    if args.dflash_train_draft_head and args.dflash_soft_target != "none":
        raise ArgumentError("--dflash-train-draft-head does not combine with --dflash-soft-target: the soft targets "
                            "are read through the draft head's rows, which must stay the target's.")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse only (argparse errors exit with status 2); call `validate_args` next."""
    return build_parser().parse_args(None if argv is None else list(argv))


def parse_layer_ids(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    parts = [t for t in str(text).replace(" ", "").split(",") if t != ""]
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise ArgumentError(
            f"--dflash-target-layer-ids={text!r}: expected comma-separated integers, e.g. '1,9,17,25,33'."
        ) from None
    if not ids:
        raise ArgumentError("--dflash-target-layer-ids is empty; give at least one layer id.")
    return ids


def world_size_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """WORLD_SIZE of a torchrun/SLURM launch, the initialised group's size, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ArgumentError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} is not an integer.") from None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _module_available(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _positive_int(errors: list, name: str, value, minimum: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or value < minimum):
        errors.append(f"{name}={value} must be an integer >= {minimum}.")


def _check_expert_and_sequence_parallel(args: argparse.Namespace, world_size: int, tp: int, pp: int) -> None:
    """--expert-model-parallel-size, --expert-tensor-parallel-size, --sequence-parallel, --context-parallel-size."""
    ep = args.expert_model_parallel_size
    etp = tp if args.expert_tensor_parallel_size is None else args.expert_tensor_parallel_size
    errors: list[str] = []
    _positive_int(errors, "--expert-model-parallel-size", ep)
    _positive_int(errors, "--expert-tensor-parallel-size", etp)
    _positive_int(errors, "--context-parallel-size", args.context_parallel_size)
    if errors:
        raise ArgumentError(errors[0])
    if args.context_parallel_size > 1:
        # here, not at the top: the arguments are parsed and checked before torch loads (--help, usage errors)
        from ..target.megatron.model import context_parallel_refusal

        raise ArgumentError("--context-parallel-size: " + context_parallel_refusal(args))
    sharded = [flag for flag, on in (("--expert-model-parallel-size", ep > 1),
                                     ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size is not None),
                                     ("--sequence-parallel", args.sequence_parallel)) if on]
    if args.target_backend == "hf" and sharded:
        raise ArgumentError(
            f"{', '.join(sharded)} shard the target, which --target-backend hf runs as one transformers model; "
            "use --target-backend megatron."
        )
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel shards the sequence over the tensor-parallel group and needs "
                            "--tensor-model-parallel-size > 1.")
    if args.sequence_parallel and isinstance(args.seq_length, int) and args.seq_length % tp:
        raise ArgumentError(
            f"--sequence-parallel: --seq-length {args.seq_length} must be a multiple of "
            f"--tensor-model-parallel-size {tp} (each TP rank holds seq_length / TP positions)."
        )
    if world_size % (etp * ep * pp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp} "
            "(megatron's expert-parallel grid); change the sizes or the number of ranks."
        )


def check_input_paths(args: argparse.Namespace) -> None:
    """Every input path of the command line exists and is of the right kind; raises `common.cli.UsageError`.

    Imports nothing heavy: `pretrain_dflash.py` calls it right after parsing, before torch loads, and
    `validate_args` calls it again (as an `ArgumentError`) for the in-process API. `--load` may be absent
    (training starts from scratch); the outputs (`--save`, `--dflash-export`, `--run-dir`) are checked
    by `outputs.check_outputs`. Data paths are checked for the `--data-format` given (none: the format
    is required and `validate_args` says so).
    """

    fmt = args.data_format
    data = [("--train-data", args.train_data), ("--valid-data", args.valid_data)]
    if args.data_path is not None and len(args.data_path) == 1:  # several: refused as blending by validate_args
        data.append(("--data-path", args.data_path[0]))
    for flag, path in data if fmt in ("chat", "text", "indexed") else []:
        if path is None:
            continue
        if fmt != "indexed":
            problem = data_path_problem(path)
            if problem is not None:
                raise UsageError(f"{flag} {path}: {problem}")
            continue
        missing = [path + s for s in (".bin", ".idx") if not os.path.isfile(path + s)]
        if missing:
            raise UsageError(
                f"{flag} {path}: --data-format indexed expects the Megatron indexed dataset prefix "
                f"({path}.bin and {path}.idx); missing {', '.join(missing)}."
            )
    if getattr(args, "chat_template", None) is not None:
        require_file("--chat-template", args.chat_template, "chat template file")
    if args.target is not None:  # a directory or a hub id, resolved once to its local snapshot
        args.target = resolve_model_dir("--target", args.target)
    if args.tokenizer is not None:
        args.tokenizer = resolve_model_dir("--tokenizer", args.tokenizer, "tokenizer directory", must_contain=None)
    if args.dflash_init_from is not None:
        args.dflash_init_from = resolve_model_dir("--dflash-init-from", args.dflash_init_from, "HF drafter directory")
    if args.dflash_eval_prompts is not None and not _is_int(args.dflash_eval_prompts):
        require_file("--dflash-eval-prompts", args.dflash_eval_prompts, "JSONL prompt file")
    if args.load is not None and os.path.exists(args.load):
        require_dir("--load", args.load, "checkpoint directory")


def validate_args(
    args: argparse.Namespace,
    world_size: int,
    env: Optional[Mapping[str, str]] = None,
    *,
    cuda: Optional[bool] = None,
) -> argparse.Namespace:
    """Check every flag and combination; fill derived defaults; return `args` (updated in place).

    Pure: reads only `args`, `world_size`, `env` (default `os.environ`) and whether CUDA and the
    optional logging packages are available, and never communicates, so every rank raises the same
    `ArgumentError` for the same launch.

    Derived fields set on `args`: `data_parallel_size`, `num_micro_batches`, `global_batch_size`
    (when None), `lr_decay_iters` (when None), `dflash_target_layer_ids_list`, `train_path`,
    `use_cuda`, and the draft settings' defaults for this run (`resolve_run_defaults`,
    `dflash_defaulted`).
    """

    env = os.environ if env is None else env
    cuda = cuda_available() if cuda is None else cuda
    resolve_run_defaults(args)
    try:
        check_input_paths(args)
    except UsageError as err:
        raise ArgumentError(str(err)) from None
    dp = _check_parallel_layout(args, world_size)
    _check_batch(args, world_size, dp)
    _check_optimizer_and_schedule(args)
    _check_checkpoints_and_logging(args)
    fmt = _resolve_data(args)
    _check_chat_options(args)
    _check_target_and_draft(args, cuda)
    _check_eval_prompts(args, fmt)
    check_target_cache_arguments(args)
    args.use_cuda = bool(cuda)
    return args


def _check_parallel_layout(args: argparse.Namespace, world_size: int) -> int:
    """The tensor / pipeline / expert / sequence layout against the world size; returns the data-parallel size."""
    errors: list[str] = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _positive_int(errors, "--tensor-model-parallel-size", tp)
    _positive_int(errors, "--pipeline-model-parallel-size", pp)
    if not isinstance(world_size, int) or world_size < 1:
        errors.append(f"world size {world_size} must be >= 1.")
    if errors:
        raise ArgumentError(errors[0])
    if world_size % (tp * pp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} ranks."
        )
    dp = world_size // (tp * pp)
    stage = args.dflash_pipeline_stage
    if not -pp <= stage < pp:
        raise ArgumentError(
            f"--dflash-pipeline-stage={stage} is outside the {pp} pipeline stage(s): use -1 (the last "
            f"stage, default) or a stage index in 0..{pp - 1}."
        )
    if args.target_backend == "hf" and (tp > 1 or pp > 1):
        raise ArgumentError(
            f"--target-backend hf runs the target as one transformers model and needs "
            f"--tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 (got TP={tp}, PP={pp}); "
            "use --target-backend megatron for tensor/pipeline parallelism."
        )
    _check_expert_and_sequence_parallel(args, world_size, tp, pp)
    return dp


def _check_batch(args: argparse.Namespace, world_size: int, dp: int) -> None:
    """Sizes and intervals; derives `global_batch_size` (when None), `data_parallel_size`, `num_micro_batches`."""
    errors: list[str] = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for name in ("micro_batch_size", "seq_length", "train_iters", "log_interval", "eval_iters",
                 "dflash_anchors_per_sample", "dflash_loss_chunk", "dflash_eval_max_new_tokens",
                 "synthetic_train_samples", "synthetic_valid_samples"):
        _positive_int(errors, "--" + name.replace("_", "-"), getattr(args, name))
    for name in ("global_batch_size", "save_interval", "eval_interval", "lr_decay_iters", "exit_interval",
                 "dflash_num_layers"):
        _positive_int(errors, "--" + name.replace("_", "-"), getattr(args, name))
    _positive_int(errors, "--lr-warmup-iters", args.lr_warmup_iters, minimum=0)
    if errors:
        raise ArgumentError(errors[0])
    if args.dflash_block_size is not None and args.dflash_block_size < 2:
        raise ArgumentError(
            f"--dflash-block-size={args.dflash_block_size} must be >= 2 (one anchor slot plus at least one "
            "predicted slot; block_size = gamma + 1)."
        )
    per_micro = args.micro_batch_size * dp
    if args.global_batch_size is None:
        args.global_batch_size = per_micro
    if args.global_batch_size % per_micro:
        raise ArgumentError(
            f"--global-batch-size={args.global_batch_size} must be divisible by --micro-batch-size x data-parallel "
            f"size = {args.micro_batch_size} x {dp} = {per_micro} (world {world_size} / (TP {tp} x PP {pp}))."
        )
    args.data_parallel_size = dp
    args.num_micro_batches = args.global_batch_size // per_micro


def _check_optimizer_and_schedule(args: argparse.Namespace) -> None:
    """Learning rates, Adam, clipping, warm-up / decay lengths (derived when None), loss decay, seed."""
    for name, value in (("--lr", args.lr), ("--min-lr", args.min_lr), ("--weight-decay", args.weight_decay),
                        ("--clip-grad", args.clip_grad), ("--adam-eps", args.adam_eps)):
        if not math.isfinite(value) or value < 0:
            raise ArgumentError(f"{name}={value} must be a finite number >= 0.")
    if args.lr <= 0:
        raise ArgumentError(f"--lr={args.lr} must be > 0.")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr={args.min_lr} must not exceed --lr={args.lr}.")
    for name, value in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise ArgumentError(f"{name}={value} must be in [0, 1).")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(20, args.lr_decay_iters // 10)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ArgumentError(
            f"--lr-warmup-iters={args.lr_warmup_iters} must be smaller than the decay length "
            f"--lr-decay-iters={args.lr_decay_iters} (default: --train-iters)."
        )
    if args.dflash_decay_gamma is not None and (not math.isfinite(args.dflash_decay_gamma) or args.dflash_decay_gamma < 0):
        raise ArgumentError(
            f"--dflash-decay-gamma={args.dflash_decay_gamma} must be > 0 (or 0 for uniform slot weights)."
        )
    if args.seed < 0:
        raise ArgumentError(f"--seed={args.seed} must be >= 0.")


def _check_checkpoints_and_logging(args: argparse.Namespace) -> None:
    """--save / --save-interval and the optional loggers."""
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save (the checkpoint directory).")
    if args.save is not None and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise ArgumentError(f"--save={args.save} exists and is not a directory.")
    if args.wandb_exp_name is not None and args.wandb_project is None:
        raise ArgumentError("--wandb-exp-name needs --wandb-project.")
    if args.wandb_project is not None and not _module_available("wandb"):
        raise ArgumentError("--wandb-project is set but the 'wandb' package is not installed (pip install wandb).")



def chat_template_kwargs(args: argparse.Namespace) -> dict:
    """``--chat-template-kwargs`` decoded (an empty dict when not given); `ArgumentError` unless a JSON object."""
    try:
        return json_object_option("--chat-template-kwargs", getattr(args, "chat_template_kwargs", None))
    except UsageError as err:
        raise ArgumentError(str(err)) from None


def _check_chat_options(args: argparse.Namespace) -> None:
    """The chat and bad-record options (`data.chat.ChatOptions`, `data.datasets.BadRecords`)."""
    chat_template_kwargs(args)
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        raise ArgumentError(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}.")


def _resolve_data(args: argparse.Namespace) -> str:
    """The data format (synthetic by default for the embedded job) and `train_path`; returns the format."""
    if args.data_path is not None and len(args.data_path) != 1:
        raise ArgumentError(
            f"--data-path got {len(args.data_path)} entries; dataset blending is not supported: give one "
            "JSONL file or one indexed-dataset prefix."
        )
    if args.data_path is not None and args.train_data is not None:
        raise ArgumentError("give the training data either as --data-path or as --train-data, not both.")
    train_path = args.train_data if args.train_data is not None else (args.data_path[0] if args.data_path else None)
    fmt = args.data_format
    if fmt is None:
        if train_path is None and args.valid_data is None and args.target is None:
            fmt = "synthetic"
        elif train_path is None:
            raise ArgumentError(
                "no training data: pass --train-data (or --data-path) with --data-format {chat,text,indexed}, "
                "or --data-format synthetic for the synthetic chats."
            )
        else:
            raise ArgumentError(
                f"--data-format is required with --train-data/--data-path ({train_path}): one of chat, text, indexed."
            )
    args.data_format = fmt
    if fmt == "synthetic":
        if train_path is not None or args.valid_data is not None:
            raise ArgumentError(
                "--data-format synthetic generates its own data; drop --train-data/--data-path/--valid-data "
                "or choose --data-format chat/text/indexed."
            )
    elif train_path is None:
        raise ArgumentError(f"--data-format {fmt} needs --train-data (or --data-path).")
    args.train_path = train_path  # the data files were checked by check_input_paths
    return fmt


def _check_target_and_draft(args: argparse.Namespace, cuda: bool) -> None:
    """Layer ids, MASK token, the variant's capabilities, the draft recipe's flags, the attention backend."""
    args.dflash_target_layer_ids_list = parse_layer_ids(args.dflash_target_layer_ids)
    if args.dflash_mask_token_id is not None and args.dflash_mask_token_id < 0:
        raise ArgumentError(f"--dflash-mask-token-id={args.dflash_mask_token_id} must be >= 0.")
    variant = run_variant(args)
    if args.dflash_variable_prefix is not None:
        base = args.dflash_variable_prefix
        if not (math.isfinite(base) and base > 0):
            raise ArgumentError(f"--dflash-variable-prefix={base} must be a positive number (the prior's ratio).")
        if not variant.supports_variable_prefix:
            raise ArgumentError(
                f"--dflash-variable-prefix (D2SD) is supported with --dflash-variant {_names_with('supports_variable_prefix')} "
                f"only, not {args.dflash_variant}."
            )
    if not (math.isfinite(args.dflash_distill_temperature) and args.dflash_distill_temperature > 0):
        raise ArgumentError(f"--dflash-distill-temperature={args.dflash_distill_temperature} must be > 0.")
    # A variant reads the temperature when its options take the flag (DSpark's L1 compares the untempered
    # distributions, as its reference does, though it reads the final hidden state too); DFlash only with a soft target.
    tempered = [name for name in _names_with("needs_final_hidden").split(" / ") if _takes_temperature(name)]
    soft = args.dflash_soft_target != "none" and _takes_temperature(args.dflash_variant)
    if args.dflash_distill_temperature != 1.0 and args.dflash_variant not in tempered and not soft:
        raise ArgumentError(
            f"--dflash-distill-temperature only applies to --dflash-variant {' / '.join(tempered)} or with "
            f"--dflash-soft-target (not to {args.dflash_variant})."
        )
    validate_draft_recipe_args(args)
    _check_draft_vocab(args)
    if args.dflash_attention_backend == "flex" and not cuda:
        raise ArgumentError("--dflash-attention-backend flex needs CUDA; use auto or chunked on CPU.")


def _check_eval_prompts(args: argparse.Namespace, fmt: str) -> None:
    """--dflash-eval-prompts given as a number: held-out synthetic chats, so synthetic data only."""
    prompts = args.dflash_eval_prompts
    if prompts is not None and _is_int(prompts):
        if int(prompts) < 0:
            raise ArgumentError(f"--dflash-eval-prompts={prompts} must be >= 0.")
        if fmt != "synthetic" and int(prompts) > 0:
            raise ArgumentError(
                "--dflash-eval-prompts as a number draws held-out synthetic chats, which only match "
                "--data-format synthetic; give a JSONL file of prompts instead."
            )


def _is_int(text) -> bool:
    try:
        int(str(text))
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------ draft settings
#
# Every setting of the draft on the command line. Defaults follow the published recipe (NeMo
# AutoModel's DFlash recipes, SpecForge) for a real target (`--target`); the embedded job (no
# `--target`) keeps its own small settings. Defaults that depend on that, or that must be told apart
# from the same value given explicitly (a drafter of `--dflash-init-from` brings its own), are
# `RunDefault`s, resolved by `resolve_run_defaults`.


class RunDefault:
    """The default of a flag: `recipe` for a run with `--target`, `embedded` for the embedded job.

    Shown by `--help` as is; `resolve_run_defaults` replaces it by the value, so later code never sees
    it. A flag still holding one was not given on the command line.
    """

    def __init__(self, recipe, embedded=None, *, same: bool = False):
        self.recipe = recipe
        self.embedded = recipe if same or embedded is None else embedded

    def value(self, with_target: bool):
        return self.recipe if with_target else self.embedded

    def __str__(self) -> str:
        if self.recipe == self.embedded:
            return str(self.recipe)
        return f"{self.recipe} with --target, {self.embedded} for the embedded job"

    __repr__ = __str__


LOSS_WEIGHTINGS = ("decay", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")
DPACE_NORMALIZATIONS = ("weight_sum", "supervised", "sequences")

# The published recipe's decay length per block size (16 is the shipped configuration).
RECIPE_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
DECAY_GAMMA_HELP = "the recipe's (7 for block 16, 5 for 10, 4 for 8, else (block_size - 1) / 2)"
LAYER_TYPE_NAMES = ("full_attention", "sliding_attention")

# --dflash-* flag (argparse dest) -> config field, for every variant. These describe the draft's architecture:
# with --dflash-init-from they come from the drafter, and a flag given explicitly must agree with it. A
# variant's own architecture flags are declared by the variant (`variants.options.Flag.config_field`).
DRAFT_CONFIG_FLAGS = {
    "dflash_num_heads": "num_attention_heads",
    "dflash_num_kv_heads": "num_key_value_heads",
    "dflash_head_dim": "head_dim",
    "dflash_intermediate_size": "intermediate_size",
    "dflash_sliding_window": "sliding_window",
    "dflash_layer_types": "layer_types",
    "dflash_input_embedding_scale": "input_embedding_scale",
    "dflash_output_multiplier": "output_multiplier",
    "dflash_final_logit_softcapping": "final_logit_softcapping",
    "dflash_draft_vocab_size": "draft_vocab_size",
}


def variant_flags() -> list[tuple[str, Flag]]:
    """`(variant name, flag)` of every flag the registered variants declare (`variants.options`)."""
    return [(name, flag) for name, options in declared_options().items() for flag in options.flags]


def _add_variant_flag(group, flag: Flag) -> None:
    """The parser option of a variant's flag; its default is a `RunDefault`, so a flag given is told apart."""
    kwargs = dict(default=RunDefault(flag.default, same=True), help=flag.help)
    if flag.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = flag.type
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    group.add_argument(flag.name, **kwargs)


def add_draft_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """The draft's architecture and the variants' settings, with the published recipe's defaults."""
    g = p.add_argument_group(
        "draft architecture and variant settings",
        "Unset sizes follow the target (the published recipe). With --dflash-init-from they come from the "
        "drafter, and a flag given must agree with it.",
    )
    target = RunDefault("the target's", same=True)
    g.add_argument("--dflash-num-heads", type=int, default=target, help="attention heads of the draft.")
    g.add_argument("--dflash-num-kv-heads", type=int, default=target, help="key/value heads of the draft.")
    g.add_argument("--dflash-head-dim", type=int, default=target, help="attention head size of the draft.")
    g.add_argument("--dflash-intermediate-size", type=int, default=target, help="MLP width of the draft.")
    g.add_argument("--dflash-sliding-window", type=int, default=RunDefault("none (full attention)", same=True),
                   help="attention window over the target context; makes every layer a sliding_attention layer "
                   "unless --dflash-layer-types says otherwise.")
    g.add_argument("--dflash-layer-types", default=RunDefault("full_attention on every layer", same=True),
                   help="comma-separated full_attention / sliding_attention, one per draft layer (or one for all).")
    g.add_argument("--dflash-input-embedding-scale", type=float, default=RunDefault(1.0, same=True),
                   help="the target's scale of its input embeddings (the draft blocks are embedded with it).")
    g.add_argument("--dflash-output-multiplier", type=float, default=RunDefault(1.0, same=True),
                   help="the target's multiplier of its output logits (> 0).")
    g.add_argument("--dflash-final-logit-softcapping", type=float, default=RunDefault("none", same=True),
                   help="the target's logit soft-capping.")
    g.add_argument("--dflash-soft-target", choices=("none", "ce", "kl"), default="none",
                   help="DFlash: train against the target's distribution (soft cross entropy or forward KL at "
                   "--dflash-distill-temperature) instead of the data tokens.")
    # The names of objectives.dflash_loss.dflash_loss.LOSS_WEIGHTINGS / DPACE_NORMALIZATIONS (torch-free here).
    g.add_argument("--dflash-loss-weighting", choices=LOSS_WEIGHTINGS, default="decay",
                   help="slot weights: decay (static, --dflash-decay-gamma) or D-PACE (dynamic, from the draft's "
                   "own per-slot confidence) and its two ablations; DFlash, DFlash 2 (backbone), variable prefix.")
    g.add_argument("--dflash-dpace-alpha", type=float, default=RunDefault(0.5, same=True),
                   help="D-PACE: confidence smoothing alpha in [0, 1] (1: uniform weights).")
    g.add_argument("--dflash-dpace-normalization", choices=DPACE_NORMALIZATIONS,
                   default=RunDefault("weight_sum", same=True),
                   help="D-PACE: the global denominator: weight_sum (ModelOpt), supervised slots (speculators) or "
                   "sequences, the rows of the global batch with a supervised slot (SpecForge).")
    for _, flag in variant_flags():  # each variant's own settings, declared by the variant
        _add_variant_flag(g, flag)


def resolve_run_defaults(args: argparse.Namespace) -> None:
    """Replace every `RunDefault` by its value for this run; record the flags left at their default in
    `args.dflash_defaulted`. With `--dflash-init-from`, the drafter's architecture is used: the
    architecture flags left at their default become None."""
    if hasattr(args, "dflash_defaulted"):  # already resolved
        return
    with_target = args.target is not None
    defaulted = set()
    for name, value in list(vars(args).items()):
        if isinstance(value, RunDefault):
            defaulted.add(name)
            setattr(args, name, value.value(with_target))
    args.dflash_defaulted = defaulted
    # Descriptions, not values: unset means "take it from the target / leave it off".
    for name in ("dflash_num_heads", "dflash_num_kv_heads", "dflash_head_dim", "dflash_intermediate_size",
                 "dflash_sliding_window", "dflash_layer_types", "dflash_final_logit_softcapping",
                 "dflash_decay_gamma"):
        if name in defaulted:
            setattr(args, name, None)
    # The training variant's own recipe where it differs from the general one (its block size, decay, ...).
    own = declared_options().get(getattr(args, "dflash_variant", None))
    for name, values in (own.recipe_defaults.items() if own is not None else ()):
        value = values[0] if with_target else values[1]
        if name == "dflash_decay_gamma" and getattr(args, "dflash_loss_weighting", "decay") != "decay":
            continue  # D-PACE forms its own weights, without decay
        if name in defaulted and value is not None:
            setattr(args, name, value)
    if args.dflash_init_from is not None:
        config_flags = [flag.dest for _, flag in variant_flags() if flag.config_field is not None]
        for name in ("dflash_block_size", "dflash_num_layers", *DRAFT_CONFIG_FLAGS, *config_flags):
            if name in defaulted:
                setattr(args, name, None)


def validate_draft_recipe_args(args: argparse.Namespace) -> None:
    """The checks of `add_draft_recipe_arguments`' flags (after `resolve_run_defaults`)."""
    variant = args.dflash_variant
    for owner, flag in variant_flags():
        if owner != variant and flag.dest not in args.dflash_defaulted:
            raise ArgumentError(f"{flag.name} only applies to --dflash-variant {owner} (this run trains {variant}).")
    for name in ("dflash_num_heads", "dflash_num_kv_heads", "dflash_head_dim", "dflash_intermediate_size",
                 "dflash_sliding_window"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}={value} must be an integer >= 1.")
    for _, flag in variant_flags():
        message = flag.error(getattr(args, flag.dest))
        if message:
            raise ArgumentError(message)
    for name in ("dflash_input_embedding_scale", "dflash_output_multiplier", "dflash_final_logit_softcapping"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ArgumentError(f"--{name.replace('_', '-')}={value} must be a finite number > 0.")
    if args.dflash_layer_types is not None:
        types = [t for t in str(args.dflash_layer_types).replace(" ", "").split(",") if t]
        unknown = sorted(set(types) - set(LAYER_TYPE_NAMES))
        if not types or unknown:
            raise ArgumentError(
                f"--dflash-layer-types={args.dflash_layer_types!r}: expected comma-separated "
                f"{' / '.join(LAYER_TYPE_NAMES)}."
            )
        args.dflash_layer_types = types
    if args.dflash_soft_target != "none" and not run_variant(args).supports_soft_targets:
        raise ArgumentError(
            f"--dflash-soft-target applies to --dflash-variant {_names_with('supports_soft_targets')} ({variant} has "
            "its own objective)."
        )
    _check_loss_weighting(args)


def _check_loss_weighting(args: argparse.Namespace) -> None:
    """--dflash-loss-weighting and the D-PACE settings (docs/design.md §6 Objectives)."""
    scheme, alpha = args.dflash_loss_weighting, args.dflash_dpace_alpha
    if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ArgumentError(f"--dflash-dpace-alpha={alpha} must be in [0, 1].")
    if scheme == "decay":
        for name in ("dflash_dpace_alpha", "dflash_dpace_normalization"):
            if name not in args.dflash_defaulted:
                raise ArgumentError(f"--{name.replace('_', '-')} only applies with --dflash-loss-weighting dpace "
                                    "(or one of its ablations).")
        return
    if not run_variant(args).supports_dpace:
        raise ArgumentError(
            f"--dflash-loss-weighting {scheme} applies to --dflash-variant {_names_with('supports_dpace')} "
            f"({args.dflash_variant} mixes other losses than the cross entropy with the label)."
        )
    if args.dflash_decay_gamma is not None:
        raise ArgumentError(f"--dflash-decay-gamma does not apply to --dflash-loss-weighting {scheme}: its weights "
                            "come from the draft's own confidence, without decay.")
    if args.dflash_soft_target != "none":
        raise ArgumentError(f"--dflash-loss-weighting {scheme} weighs the cross entropy with the data token; it does "
                            "not apply with --dflash-soft-target.")


def draft_config_overrides(args: argparse.Namespace, num_layers: Optional[int]) -> dict:
    """`DFlashConfig` fields common to every variant that the command line sets; the rest follow the
    target (or, with `--dflash-init-from`, the drafter). `num_layers` expands a single layer type. The
    variant's own architecture settings come from its options record (`Variant.config_overrides`)."""
    out = {}
    for name, field in DRAFT_CONFIG_FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            out[field] = value
    if "sliding_window" in out and "layer_types" not in out and num_layers is not None:
        out["layer_types"] = ["sliding_attention"] * num_layers  # as the published recipe does
    types = out.get("layer_types")
    if types is not None and len(types) == 1 and num_layers is not None:
        out["layer_types"] = types * num_layers
    return out


def run_variant(args: argparse.Namespace):
    """The registered `variants.registry.Variant` of `--dflash-variant`; `ArgumentError` naming the registered
    ones otherwise."""
    # The registry loads torch and the variants' modules; this module is imported (and --help, usage errors and
    # missing paths are reported) before they load.
    from ..variants.registry import get_variant

    try:
        return get_variant(args.dflash_variant)
    except ValueError as err:
        raise ArgumentError(f"--dflash-variant {args.dflash_variant}: {err}") from None


def _takes_temperature(variant: str) -> bool:
    """Whether `variant`'s options read --dflash-distill-temperature."""
    options = declared_options().get(variant)
    return options is not None and "dflash_distill_temperature" in options.shared.values()


def _names_with(capability: str) -> str:
    """The registered variants asked for by name (not a family's form) that have `capability` (a `Variant` flag), for
    messages."""
    # here, not at the top: the arguments are parsed and checked before torch loads (--help, usage errors)
    from ..variants.registry import get_variant, variant_names

    return " / ".join(name for name in variant_names()
                      if getattr(get_variant(name), capability) and get_variant(name).trains_as is None)


def resolve_decay_gamma(args: argparse.Namespace, block_size: int) -> Optional[float]:
    """The loss weights' decay length for this run (None: uniform weights).

    Given explicitly: that (0 is uniform). A D-PACE weighting has none. Otherwise a variant with
    `uniform_loss_weights` (JetSpec, its
    published setting) is uniform, a run
    with --target uses the recipe's value for its block size (`RECIPE_DECAY_GAMMA`, (W - 1) / 2 for the
    other sizes), and the embedded job keeps block_size - 1.
    """
    if args.dflash_decay_gamma is not None:
        return None if args.dflash_decay_gamma == 0 else float(args.dflash_decay_gamma)
    if args.dflash_loss_weighting != "decay":  # D-PACE: no decay
        return None
    if run_variant(args).uniform_loss_weights:
        return None
    if args.target is None:
        return float(block_size - 1)
    return RECIPE_DECAY_GAMMA.get(block_size, (block_size - 1) / 2)


# ------------------------------------------------------------------------ cached target states

TARGET_CACHE_MODES = ("write", "read", "hybrid")
TARGET_CACHE_DTYPES = ("float32", "bfloat16")


def add_target_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The "cached target states" options (docs/design.md §8 Data path, "Training from cached target states");
    `tools/cache_target_states.py` takes them too."""
    g = p.add_argument_group("cached target states")
    g.add_argument("--dflash-target-cache", default=None, metavar="DIR",
                   help="directory of the target's cached states (tools/cache_target_states.py): the run reads the "
                   "taps (and the final hidden state) from it and loads only the target's embedding and output head (default: "
                   "none, the target runs online).")
    g.add_argument("--dflash-target-cache-mode", choices=TARGET_CACHE_MODES, default="read",
                   help="read: the cache must be complete; write: write the missing shards first (every rank its "
                   "own), then train reading it; hybrid: the first epoch (the steps that draw a sample of the first "
                   "pass over the training data) runs the target online and stages each sample's states, the next "
                   "step completes the cache, releases the target's decoder layers and reads from then on (a rerun "
                   "with a complete cache reads from the start).")
    g.add_argument("--dflash-target-cache-dtype", choices=TARGET_CACHE_DTYPES, default=None,
                   help="dtype of the cached states (default: the run's, float32 or bfloat16 with --bf16; float32 "
                   "trains bitwise as online).")
    g.add_argument("--dflash-target-cache-shard-size", type=int, default=64, metavar="N",
                   help="samples per cache shard when writing (a killed writer redoes at most one shard per rank).")


def check_target_cache_arguments(args: argparse.Namespace) -> None:
    """The cache flags' combinations; sets ``dflash_target_cache_dtype`` to the run's dtype when not given."""
    given = [flag for flag, default in (("--dflash-target-cache-mode", "read"), ("--dflash-target-cache-dtype", None))
             if getattr(args, flag[2:].replace("-", "_")) != default]
    if args.dflash_target_cache_shard_size < 1:
        raise ArgumentError(f"--dflash-target-cache-shard-size must be at least 1, got "
                            f"{args.dflash_target_cache_shard_size}.")
    if args.dflash_target_cache is None:
        if given:
            raise ArgumentError(f"{given[0]} needs --dflash-target-cache DIR.")
        return
    if args.pack_sequences:
        raise ArgumentError("--dflash-target-cache holds the states of each sample alone and does not take "
                            "--pack-sequences; train unpacked, or without the cache.")
    if args.pipeline_model_parallel_size > 1:
        raise ArgumentError("--dflash-target-cache needs --pipeline-model-parallel-size 1 (the run holds only the "
                            "target's embedding and head, which one stage has).")
    if args.dflash_target_cache_dtype is None:
        args.dflash_target_cache_dtype = "bfloat16" if args.bf16 else "float32"
