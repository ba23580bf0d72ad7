#!/usr/bin/env python
"""Train a DFlash draft model next to a frozen target (megatron-core).

    python pretrain_dflash.py                         # the embedded job: tiny target, CPU, minutes
    python pretrain_dflash.py --recipe smollm2-135m   # a real target, end to end (README, "A real target")
    torchrun --nproc-per-node 8 pretrain_dflash.py --target Qwen/Qwen3-8B --target-backend megatron \
        --tensor-model-parallel-size 2 --data-format chat --train-data chats.jsonl \
        --dflash-mask-token-id 151669 --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 ...

See `python pretrain_dflash.py --help` and megatron_dflash/training/arguments.py.
"""

import os
import sys

# Before torch loads OpenMP: idle CPU threads sleep instead of spinning. On a busy (or small)
# machine spinning threads steal the cores the work needs (measured: 20x slower at 2 threads
# under load); on GPU runs the CPU side is small either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_dflash.common.cli import UsageError, quiet_dependency_warnings, report_interrupt, usage_error  # noqa: E402

quiet_dependency_warnings()  # before megatron and transformers load

from megatron_dflash.training.arguments import check_input_paths, parse_args  # noqa: E402

if __name__ == "__main__" and any(a == "--recipe" or a.startswith("--recipe=") for a in sys.argv[1:]):
    # a ready-made job on a real target (megatron_dflash/recipes/cli.py): its stages run their own processes
    from megatron_dflash.recipes.cli import main as recipe_main

    sys.exit(recipe_main(sys.argv[1:]))

if __name__ == "__main__":
    # --help, usage errors and missing input paths before torch and megatron load (exit status 2)
    try:
        check_input_paths(parse_args(sys.argv[1:]))
    except UsageError as err:
        usage_error("pretrain_dflash.py", str(err))

try:
    from megatron_dflash.training.loop import main  # noqa: E402
except KeyboardInterrupt:  # Ctrl-C while torch and megatron load: one line, not their import traceback
    sys.exit(report_interrupt("pretrain_dflash.py", "while loading"))

if __name__ == "__main__":
    sys.exit(main())
