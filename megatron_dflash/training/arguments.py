"""Command-line arguments of `pretrain_dflash.py`: Megatron-style names, one validator.

`parse_args(argv)` only parses. `validate_args(args, world_size, env)` checks every combination
and raises one `ArgumentError` naming the flag(s) and the fix. It is a pure function of the
arguments, the world size and the environment (CUDA availability, installed optional packages):
every rank of a launch evaluates it before any collective, so a bad combination stops every rank
with the same message instead of leaving some of them waiting in a collective.

Run without any argument, the defaults are the embedded job: the cached tiny Qwen3 target
(`training.tiny_target.ensure_tiny_target`), synthetic chats (train split and held-out prompts from
two seeds), a 2-layer draft with block size 8, 1200 steps, HF export and a speculative-decoding
acceptance evaluation; a few minutes on a 2-core CPU once the target is cached. The batch-size /
sequence-length / learning-rate defaults are that job's; set them for real runs.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Mapping, Optional, Sequence

from .errors import RunError

__all__ = [
    "ArgumentError",
    "VARIANTS",
    "DATA_FORMATS",
    "TARGET_BACKENDS",
    "LR_DECAY_STYLES",
    "build_parser",
    "parse_args",
    "validate_args",
    "parse_layer_ids",
    "world_size_from_env",
    "cuda_available",
]

VARIANTS = ("dflash", "dflash2", "domino", "jetspec")
DATA_FORMATS = ("chat", "text", "indexed", "synthetic")
TARGET_BACKENDS = ("hf", "megatron")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
ATTENTION_BACKENDS = ("auto", "chunked", "flex", "dense")

# Defaults of the embedded job (no arguments): tuned to finish in a few minutes on a 2-core CPU.
EMBEDDED_SYNTHETIC_TRAIN_SEED = 20250101
EMBEDDED_SYNTHETIC_HELDOUT_SEED = 20250202


class ArgumentError(RunError):
    """A bad command line; the message says which flags and how to fix them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_dflash.py",
        description=(
            "Train a DFlash block-diffusion draft model next to a frozen target LLM (megatron-core). "
            "Without arguments: a complete small job on the embedded tiny target (CPU, a few minutes)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron's distributed optimizer: Adam state and fp32 main weights sharded over "
                        "data-parallel ranks (ZeRO-1); checkpoints resume exactly at the same or another DP size.")

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

    g = p.add_argument_group("checkpoints, evaluation, logging")
    g.add_argument("--save", default=None, help="directory of torch_dist training checkpoints.")
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

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="training data: a JSONL file (chat/text) or an indexed-dataset prefix (indexed).")
    g.add_argument("--train-data", default=None, help="training JSONL file (chat/text) or indexed prefix.")
    g.add_argument("--valid-data", default=None, help="validation JSONL file (chat/text) or indexed prefix.")
    g.add_argument("--data-format", choices=DATA_FORMATS, default=None,
                   help="default: synthetic when no data path is given and --target is not set.")
    g.add_argument("--pack-sequences", action="store_true", help="pack several documents per row.")
    g.add_argument("--synthetic-train-samples", type=int, default=20000)
    g.add_argument("--synthetic-valid-samples", type=int, default=256)
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target).")

    g = p.add_argument_group("target")
    g.add_argument("--target", default=None,
                   help="HF directory of the frozen target (default: the embedded tiny target, built "
                   "once and cached under $MEGATRON_DFLASH_CACHE or ~/.cache/megatron_dflash).")
    g.add_argument("--target-backend", choices=TARGET_BACKENDS, default="hf",
                   help="hf: transformers model (TP=PP=1 only); megatron: megatron-core GPTModel at TP/PP.")

    g = p.add_argument_group("draft")
    g.add_argument("--dflash-variant", choices=VARIANTS, default="dflash")
    g.add_argument("--dflash-block-size", type=int, default=None, help="gamma + 1 (default 8).")
    g.add_argument("--dflash-anchors-per-sample", type=int, default=8)
    g.add_argument("--dflash-decay-gamma", type=float, default=None,
                   help="loss weight decay length (default: block_size - 1; 0: uniform weights).")
    g.add_argument("--dflash-target-layer-ids", default=None,
                   help="comma-separated 0-based target layers to tap (default: the published formula).")
    g.add_argument("--dflash-mask-token-id", type=int, default=None,
                   help="MASK token id (default: the tokenizer's mask token; never guessed).")
    g.add_argument("--dflash-num-layers", type=int, default=None, help="draft decoder layers (default 2).")
    g.add_argument("--dflash-init-from", default=None, help="initialise from a published HF drafter directory.")
    g.add_argument("--dflash-pipeline-stage", type=int, default=-1,
                   help="pipeline stage that holds the draft (-1: the last).")
    g.add_argument("--dflash-variable-prefix", type=float, default=None, metavar="BASE",
                   help="variable-prefix (D2SD) training with prior Pr(l) ~ BASE**l (off by default).")
    g.add_argument("--dflash-distill-temperature", type=float, default=1.0,
                   help="JetSpec: temperature of the forward KL to the target.")
    g.add_argument("--dflash-domino-lambda-start", type=float, default=1.0,
                   help="Domino: initial weight of the backbone-only loss (curriculum).")
    g.add_argument("--dflash-domino-decay-ratio", type=float, default=0.5,
                   help="Domino: fraction of training over which that weight decays to 0.")
    g.add_argument("--dflash-loss-chunk", type=int, default=1024, help="predicted slots per loss chunk.")
    g.add_argument("--dflash-attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    g.add_argument("--dflash-eval-prompts", default=None,
                   help="JSONL of prompts ({input_ids}|{prompt}|{messages}) for the acceptance evaluation, "
                   "or an integer N: N held-out synthetic chats (default 24 for synthetic data).")
    g.add_argument("--dflash-eval-max-new-tokens", type=int, default=64)
    g.add_argument("--dflash-eval-ignore-eos", action="store_true",
                   help="acceptance evaluation: always generate --dflash-eval-max-new-tokens (no stop token).")
    g.add_argument("--dflash-export", default=None,
                   help="HF draft directory written at the end (default: <save>/hf, else runs/<time>/hf).")
    return p


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
    `use_cuda`.
    """
    env = os.environ if env is None else env
    cuda = cuda_available() if cuda is None else cuda
    errors: list[str] = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size

    # ---- parallel layout
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

    # ---- batch
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

    # ---- optimizer and schedule
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

    # ---- checkpoints and logging
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save (the checkpoint directory).")
    if args.save is not None and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise ArgumentError(f"--save={args.save} exists and is not a directory.")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ArgumentError(f"--load={args.load} is not a directory.")
    if args.wandb_exp_name is not None and args.wandb_project is None:
        raise ArgumentError("--wandb-exp-name needs --wandb-project.")
    if args.wandb_project is not None and not _module_available("wandb"):
        raise ArgumentError("--wandb-project is set but the 'wandb' package is not installed (pip install wandb).")

    # ---- data
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
    else:
        if train_path is None:
            raise ArgumentError(f"--data-format {fmt} needs --train-data (or --data-path).")
        paths = [("training data", train_path)] + ([("--valid-data", args.valid_data)] if args.valid_data else [])
        for what, path in paths:
            if fmt == "indexed":
                missing = [path + s for s in (".bin", ".idx") if not os.path.isfile(path + s)]
                if missing:
                    raise ArgumentError(
                        f"{what} {path}: --data-format indexed expects the Megatron indexed dataset prefix "
                        f"({path}.bin and {path}.idx); missing {', '.join(missing)}."
                    )
            elif not os.path.isfile(path):
                raise ArgumentError(f"{what} {path} does not exist (expected a JSONL file for --data-format {fmt}).")
    args.train_path = train_path

    # ---- target and draft
    if args.target is not None and not os.path.isfile(os.path.join(args.target, "config.json")):
        raise ArgumentError(f"--target={args.target} is not a HF model directory (no config.json in it).")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise ArgumentError(f"--tokenizer={args.tokenizer} is not a directory.")
    if args.dflash_init_from is not None:
        if not os.path.isfile(os.path.join(args.dflash_init_from, "config.json")):
            raise ArgumentError(
                f"--dflash-init-from={args.dflash_init_from} is not a HF drafter directory (no config.json)."
            )
    args.dflash_target_layer_ids_list = parse_layer_ids(args.dflash_target_layer_ids)
    if args.dflash_mask_token_id is not None and args.dflash_mask_token_id < 0:
        raise ArgumentError(f"--dflash-mask-token-id={args.dflash_mask_token_id} must be >= 0.")
    if args.dflash_variable_prefix is not None:
        base = args.dflash_variable_prefix
        if not (math.isfinite(base) and base > 0):
            raise ArgumentError(f"--dflash-variable-prefix={base} must be a positive number (the prior's ratio).")
        if args.dflash_variant != "dflash":
            raise ArgumentError(
                f"--dflash-variable-prefix (D2SD) is supported with --dflash-variant dflash only, not "
                f"{args.dflash_variant}."
            )
    if not (math.isfinite(args.dflash_distill_temperature) and args.dflash_distill_temperature > 0):
        raise ArgumentError(f"--dflash-distill-temperature={args.dflash_distill_temperature} must be > 0.")
    if args.dflash_distill_temperature != 1.0 and args.dflash_variant != "jetspec":
        raise ArgumentError("--dflash-distill-temperature only applies to --dflash-variant jetspec.")
    if not 0.0 <= args.dflash_domino_decay_ratio <= 1.0:
        raise ArgumentError(f"--dflash-domino-decay-ratio={args.dflash_domino_decay_ratio} must be in [0, 1].")
    if not (math.isfinite(args.dflash_domino_lambda_start) and 0.0 <= args.dflash_domino_lambda_start <= 1.0):
        raise ArgumentError(f"--dflash-domino-lambda-start={args.dflash_domino_lambda_start} must be in [0, 1].")
    if args.dflash_attention_backend == "flex" and not cuda:
        raise ArgumentError("--dflash-attention-backend flex needs CUDA; use auto or chunked on CPU.")
    prompts = args.dflash_eval_prompts
    if prompts is not None and not _is_int(prompts) and not os.path.isfile(prompts):
        raise ArgumentError(
            f"--dflash-eval-prompts={prompts} is neither a JSONL file nor an integer number of held-out "
            "synthetic prompts."
        )
    if prompts is not None and _is_int(prompts):
        if int(prompts) < 0:
            raise ArgumentError(f"--dflash-eval-prompts={prompts} must be >= 0.")
        if fmt != "synthetic" and int(prompts) > 0:
            raise ArgumentError(
                "--dflash-eval-prompts as a number draws held-out synthetic chats, which only match "
                "--data-format synthetic; give a JSONL file of prompts instead."
            )
    args.use_cuda = bool(cuda)
    return args


def _is_int(text) -> bool:
    try:
        int(str(text))
    except ValueError:
        return False
    return True
