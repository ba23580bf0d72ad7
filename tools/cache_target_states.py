#!/usr/bin/env python
"""Write the cache of the target's states that `pretrain_dflash.py --dflash-target-cache DIR` trains from.

Takes `pretrain_dflash.py`'s own arguments (the target, the data, the sequence length, the variant: they decide
what is cached and the manifest a training run must match) and runs only the frozen target over every training and
validation sample, writing `DIR/train-NNNNN.safetensors`, `valid-NNNNN.safetensors`, `manifest.json` and, once
complete, `index.json` (docs/design.md §8 Data path, "Training from cached target states"). A rerun after a kill
writes only the missing shards; a manifest of other settings is refused naming the field.

    python tools/cache_target_states.py --target Qwen/Qwen3-8B --train-data chats.jsonl --seq-length 4096 \\
        --dflash-target-cache states/
    torchrun --nproc-per-node 8 tools/cache_target_states.py ... --dflash-target-cache states/   # 8 DP writers
    torchrun --nproc-per-node 8 tools/cache_target_states.py ... --target-backend megatron \\
        --tensor-model-parallel-size 8 --dflash-target-cache states/                              # a TP=8 target

Exit status 0 when the cache is complete, 1 for an expected failure (data, a differing manifest, too little free
space, a file system that fills while writing: the file named, the shards written kept), 2 for a bad command line.
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.cli import (  # noqa: E402
    UsageError, is_no_space, report_failure, report_interrupt, usage_error)
from megatron_dflash.training.arguments import ArgumentError, check_input_paths, parse_args  # noqa: E402  (no torch)

PROG = "cache_target_states.py"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        check_input_paths(args)
        if args.dflash_target_cache is None:
            raise UsageError("--dflash-target-cache DIR is required: the directory the states are written to.")
    except UsageError as err:
        usage_error(PROG, str(err))
    try:
        # after --help and usage errors: torch and megatron load here
        from megatron_dflash.common.errors import RunError
        from megatron_dflash.training.job import prepare_job
        from megatron_dflash.training.target_cache import write_cache_of_job
    except KeyboardInterrupt:
        return report_interrupt(PROG, "while loading")
    try:
        job = prepare_job(args, None, None)
        manifest = write_cache_of_job(job)
    except RunError as err:
        report_failure(PROG, err, debug="--debug" in argv)
        return 2 if isinstance(err, ArgumentError) else 1
    except Exception as err:  # noqa: BLE001 - a full file system is expected (the file named); bugs are not
        if not is_no_space(err):
            raise
        report_failure(PROG, err, debug="--debug" in argv)
        return 1
    if os.environ.get("RANK", "0") == "0":
        print(f"[cache] complete: {args.dflash_target_cache} ({sum(manifest.samples.values())} samples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
