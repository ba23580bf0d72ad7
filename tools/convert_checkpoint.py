#!/usr/bin/env python
"""Convert DFlash draft checkpoints between megatron (torch_dist) and the HF format.

    python tools/convert_checkpoint.py to-hf --load runs/draft --output runs/draft_hf --dtype bf16 --validate
    python tools/convert_checkpoint.py to-megatron --load z-lab/draft_hf --output runs/init --validate

Installed as the console script `megatron-dflash-convert`. One CPU process, no GPU; the logic
is `megatron_dflash/checkpoint/conversion.py`, the megatron checkpoint layout `megatron_dflash/checkpoint/torch_dist.py`.
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.cli import quiet_dependency_warnings  # noqa: E402

quiet_dependency_warnings()  # before megatron loads

from megatron_dflash.checkpoint.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=os.path.basename(sys.argv[0])))
