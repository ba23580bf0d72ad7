#!/usr/bin/env python
"""Rebuild the tiny target that ships with the package and compare it with the shipped one.

    python tools/build_tiny_target.py --output rebuilt-target          # full build (minutes on a CPU)
    python tools/build_tiny_target.py --output rebuilt-target --install # then replace the shipped copy
    python tools/build_tiny_target.py --output tiny-k3 --family kimi_k3 # a random tiny Kimi K3 target

The shipped directory (`megatron_dflash/assets/tiny_target`) is exactly what this script writes:
`train_tiny_target(TinyTargetRecipe())` (weights, tokenizer, chat template, `recipe.json`,
`trace.json`). The comparison reports whether `model.safetensors` is identical byte for byte
and, if not, the largest difference per tensor (a different torch build or CPU may round
differently). Edit `TinyTargetRecipe` (and bump its `version`) to change the target, then
rebuild with `--install`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

# Before torch loads OpenMP: idle threads sleep instead of spinning (as in pretrain_dflash.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.atomic import file_sha256  # noqa: E402
from megatron_dflash.common.cli import ArgumentParser, quiet_dependency_warnings, usage_error  # noqa: E402

PROG = "build_tiny_target.py"



def compare(built: str, shipped: str) -> tuple[bool, str]:
    """(identical, description) of two targets' `model.safetensors`."""
    a, b = os.path.join(built, "model.safetensors"), os.path.join(shipped, "model.safetensors")
    if file_sha256(a) == file_sha256(b):
        return True, f"identical to the shipped target (sha256 {file_sha256(a)[:16]}...)"
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    if x.keys() != y.keys():
        return False, "different tensors than the shipped target"
    worst = max(((float((x[k].double() - y[k].double()).abs().max()), k) for k in x), default=(0.0, ""))
    return False, f"differs from the shipped target: largest difference {worst[0]:.3e} in {worst[1]}"


def _build_kimi_k3(args) -> int:
    if args.install:
        usage_error(PROG, "--install replaces the shipped Qwen3 target; it does not apply to --family kimi_k3.")
    from megatron_dflash.target.kimi_k3 import KIMI_K3_INSTALL_HINT, build_tiny_kimi_k3_target, kimi_k3_available
    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    if not kimi_k3_available():
        usage_error(PROG, f"--family kimi_k3 builds on NeMo AutoModel's K3 model code: {KIMI_K3_INSTALL_HINT}.")
    start = time.time()
    with open(os.path.join(SHIPPED_TARGET_DIR, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    build_tiny_kimi_k3_target(args.output, tokenizer_dir=SHIPPED_TARGET_DIR, vocab_size=vocab, seed=args.seed)
    print(f"built a random tiny Kimi K3 target in {args.output} in {time.time() - start:.0f}s")
    return 0


def main(argv=None) -> int:
    quiet_dependency_warnings()
    parser = ArgumentParser(prog=PROG, description="Rebuild the shipped tiny target of the embedded job.")
    parser.add_argument("--output", required=True, help="directory to write (must not exist).")
    parser.add_argument("--install", action="store_true",
                        help="replace the shipped copy in megatron_dflash/assets/tiny_target with the result.")
    parser.add_argument("--family", choices=("qwen3", "kimi_k3"), default="qwen3",
                        help="qwen3: the shipped (trained) tiny target; kimi_k3: a randomly initialised tiny Kimi K3 "
                        "target in the released checkpoint layout with the shipped tokenizer, for trying the K3 "
                        "path (needs nemo-automodel; docs/design.md §17 Target families).")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the kimi_k3 target.")
    args = parser.parse_args(argv)
    if os.path.exists(args.output):
        usage_error(PROG, f"--output {args.output} exists; choose a new directory.")
    if args.family == "kimi_k3":
        return _build_kimi_k3(args)

    from megatron_dflash.common.atomic import atomic_directory
    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR, TinyTargetRecipe, train_tiny_target

    start = time.time()
    os.makedirs(args.output)
    train_tiny_target(TinyTargetRecipe(), args.output)
    print(f"built {args.output} in {time.time() - start:.0f}s")
    identical = None
    if os.path.isfile(os.path.join(SHIPPED_TARGET_DIR, "model.safetensors")):
        identical, text = compare(args.output, SHIPPED_TARGET_DIR)
        print(text)
    if args.install:
        with atomic_directory(SHIPPED_TARGET_DIR, replace=True) as staged:
            shutil.copytree(args.output, staged, dirs_exist_ok=True)
        print(f"installed into {SHIPPED_TARGET_DIR}")
    return 0 if identical in (None, True) or args.install else 1


if __name__ == "__main__":
    sys.exit(main())
