"""`megatron-dflash-convert`: the command line of the checkpoint converter.

    megatron-dflash-convert to-hf --load SAVE_DIR --output HF_DIR [--iteration N] [--validate] [--export-for sglang]
    megatron-dflash-convert to-megatron --load HF_DIR --output SAVE_DIR [--iteration release|N]

The conversion itself is `checkpoint/conversion.py` (HF <-> megatron `torch_dist`), the megatron layout
`checkpoint/torch_dist.py` (docs/design.md §10 Training checkpoint layout). Runs as one CPU process; no GPU needed.

Imports: usage errors (a bad flag, a missing --load, a non-empty --output without --force) and
`--help` are answered before torch and megatron load (seconds), like every tool here; so this
module imports only the standard library, `cli` and the layout names of `torch_dist` (which
load no torch) at module level, and `conversion` once the arguments are checked.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..common.atomic import NoSpaceError, check_destination
from ..common.cli import (
    ArgumentParser,
    UsageError,
    quiet_dependency_warnings,
    report_failure,
    require_dir,
    require_file,
    usage_status,
)
from .torch_dist import RELEASE, Iteration, iteration_dir_name, parse_iteration

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------------------- CLI

_PROG = "megatron-dflash-convert"


def _iteration_arg(text: str) -> Iteration:
    try:
        return parse_iteration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    parser = ArgumentParser(  # one-line usage errors, each default shown once in --help
        prog=prog,
        description="Convert DFlash draft checkpoints (DFlash, DFlash 2 and other registered variants) "
        "between megatron's torch_dist training checkpoints and the HF format of the published "
        "drafters (config.json + model.safetensors). Runs as one CPU process; no GPU needed.",
        epilog="Megatron layout: <save>/latest_checkpointed_iteration.txt and <save>/iter_0000100/ "
        "(a torch_dist checkpoint with the draft under 'model.<HF name>' plus dflash_config.json). "
        "See megatron_dflash/checkpoint/torch_dist.py (docs/design.md §10 Training checkpoint layout).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{to-hf,to-megatron}")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                         help="dtype of the written weights (default: the input's). fp16 is refused "
                         "for DFlash 2.")
        sub.add_argument("--validate", action="store_true",
                         help="reload the written result and compare every tensor (exactly, after the "
                         "dtype cast) and the config before moving it into place.")
        sub.add_argument("--force", action="store_true",
                         help="replace --output if it exists and is not empty.")

    to_hf = commands.add_parser(
        "to-hf", help="megatron checkpoint -> HF draft directory",
        description="Megatron torch_dist checkpoint (any TP size) -> HF draft directory.",
    )
    to_hf.add_argument("--load", required=True,
                       help="megatron save directory (with latest_checkpointed_iteration.txt) or one "
                       "checkpoint directory (iter_0000100/).")
    to_hf.add_argument("--output", required=True, help="HF directory to write.")
    to_hf.add_argument("--iteration", type=_iteration_arg, default=None,
                       help="checkpoint of the save directory to convert: an iteration number or "
                       "'release' (default: the one the tracker file names).")
    to_hf.add_argument("--config", default=None,
                       help="HF config.json (or its directory) to use when the checkpoint has no "
                       "dflash_config.json.")
    to_hf.add_argument("--export-for", choices=["sglang"], default=None,
                       help="write the labels a serving runtime reads where they differ from the published "
                       "layout (which the z-lab reference, NeMo AutoModel, SpecForge and vLLM read): 'sglang' "
                       "writes Domino as DFlashDraftModel with dflash_config.projector_type 'domino'. Check "
                       "either with tools/check_serving.py.")
    common(to_hf)

    to_meg = commands.add_parser(
        "to-megatron", help="HF draft directory -> megatron checkpoint",
        description="HF draft directory -> megatron save directory (torch_dist). The result is resharded "
        "when loaded, so it loads at any tensor-parallel size the config allows.",
    )
    to_meg.add_argument("--load", required=True, help="HF draft directory (config.json + model.safetensors).")
    to_meg.add_argument("--output", required=True, help="megatron save directory to write.")
    to_meg.add_argument("--iteration", type=_iteration_arg, default=RELEASE,
                        help="checkpoint to write: 'release' (weights only, the default) or an "
                        "iteration number (iter_NNNNNNN/).")
    to_meg.add_argument("--target-tensor-parallel-size", type=_positive_int, default=None,
                        help="only check that the draft can be trained at this TP size (it must divide "
                        "num_key_value_heads); torch_dist checkpoints are resharded at load, so the "
                        "written files do not depend on it.")
    common(to_meg)
    return parser


def _check_cli_paths(args) -> None:
    """The command line's paths, checked before torch and megatron load (raises `UsageError`)."""
    require_dir("--load", args.load)
    config = getattr(args, "config", None)
    if config is not None and not os.path.isdir(config):
        require_file("--config", config)
    try:
        check_destination(args.output, replace=args.force, source=args.load, replace_flag="--force")
    except (ValueError, FileExistsError) as err:
        raise UsageError(str(err)) from None


def main(argv: Optional[list[str]] = None, prog: str = _PROG) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 conversion error or a full disk, 2 usage error).

    Usage errors (a bad flag, a missing --load, a non-empty --output without --force) are found
    before torch and megatron are imported and reported in one line, like every tool here.
    """
    quiet_dependency_warnings()
    args = build_parser(prog).parse_args(argv)
    try:
        _check_cli_paths(args)
    except UsageError as err:
        return usage_status(prog, err)
    from .conversion import convert_hf_to_megatron, convert_megatron_to_hf  # loads torch and megatron

    try:
        if args.command == "to-hf":
            result = convert_megatron_to_hf(
                args.load, args.output, iteration=args.iteration, dtype=args.dtype,
                validate=args.validate, force=args.force, config_path=args.config, export_for=args.export_for or "default",
            )
        else:
            result = convert_hf_to_megatron(
                args.load, args.output, dtype=args.dtype, validate=args.validate, force=args.force,
                target_tensor_parallel_size=args.target_tensor_parallel_size, iteration=args.iteration,
            )
    except (ValueError, FileExistsError, FileNotFoundError, NotADirectoryError, NoSpaceError) as err:
        report_failure(prog, err)  # a full disk: one line naming --output; nothing of it left behind
        return 1
    where = f" ({iteration_dir_name(result.iteration)})" if result.iteration is not None else ""
    print(
        f"wrote {result.architecture} ({result.num_tensors} tensors, {result.num_parameters:,} parameters, "
        f"{result.dtype}) from {result.source} to {result.output}{where}"
        + ("; validated: every tensor identical" if result.validated else "")
    )
    for note in result.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
