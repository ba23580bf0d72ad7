#!/usr/bin/env python
"""Will this HF draft load in vLLM and SGLang, and serve what it was trained as?

    python tools/check_serving.py runs/latest/hf
    python tools/check_serving.py my-draft-hf --target Qwen/Qwen3-8B-dir --json serving.json
    python tools/check_serving.py runs/latest/hf --runtime-version vllm=036a00d sglang=003b23d

Reads the draft the way each runtime reads it (architecture registry, where it finds block_size,
mask_token_id and the tap list and which target layer that taps, how it runs each layer in-block,
which head settings it applies, its model file's own rules) and compares that with what the draft was
trained with (this package's reading of the same file). Prints per runtime and the release its rules
encode (vLLM 0.34.0, SGLang 0.5.23 unless --runtime-version picks the previous, commit-pinned ones):
loads / loads with a caveat / does not load, with the runtime's own reasons, then ready-to-paste serve
commands. With --target, also the
target's vocabulary, hidden size and depth and its tokenizer against the draft's MASK token.
The rules and the runtime sources they encode: megatron_dflash/checkpoint/serving.py
(docs/design.md §19 Serving check).

Exit status: 0 every runtime loads it (caveats included: read them), 1 one does not, 2 usage error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.atomic import write_file  # noqa: E402  (standard library only)
from megatron_dflash.common.cli import (  # noqa: E402  (no torch: --help and usage errors answer at once)
    ArgumentParser,
    UsageError,
    quiet_dependency_warnings,
    report_failure,
    require_dir,
    usage_status,
)
from megatron_dflash.common.model_dirs import looks_like_hub_id, resolve_model_dir  # noqa: E402  (no torch)

PROG = "check_serving.py"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Check an exported HF draft against how vLLM and SGLang read it: per runtime, loads / "
        "loads with a caveat / does not load, with the reasons, then the serve commands. Exit status 0 when "
        "every runtime loads it (caveats included), 1 when one does not.",
    )
    parser.add_argument("draft", help="HF draft directory (config.json + model.safetensors), e.g. runs/latest/hf.")
    parser.add_argument("--target", default=None,
                        help="the target's HF directory or hub id (read from the local HF cache): its config.json (vocabulary, hidden size, depth) and "
                        "tokenizer.json (the MASK token) are checked against the draft, and the serve commands "
                        "name it.")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the verdicts as JSON to OUT.")
    parser.add_argument("--runtime-version", nargs="+", action="extend", default=[], metavar="RUNTIME=VERSION",
                        help="the release whose rules to check against, per runtime: vllm=0.34.0 (default) or "
                        "vllm=036a00d (the commit-pinned rules before it), sglang=0.5.23 (default) or sglang=003b23d.")
    parser.add_argument("--vllm-v2-runner", action="store_true",
                        help="with --runtime-version vllm=036a00d only: vLLM runs its V2 model runner "
                        "(VLLM_USE_V2_MODEL_RUNNER=1), which serves drafts with mixed sliding/full layer types "
                        "(vLLM 0.34.0 has no other runner).")
    return parser


def runtime_versions(values) -> dict:
    """{runtime: version} of the --runtime-version words (`UsageError` for one that is not RUNTIME=VERSION)."""
    out = {}
    for word in values:
        name, sep, version = word.partition("=")
        if not sep or not name or not version:
            raise UsageError(f"--runtime-version {word}: give RUNTIME=VERSION, e.g. vllm=036a00d or sglang=0.5.23.")
        out[name.lower()] = version
    return out


def _check_paths(args) -> Optional[str]:
    """The target's local directory (a hub id: its snapshot in the local HF cache), or None without --target."""
    require_dir("draft", args.draft, must_contain="config.json")
    target_dir = None if args.target is None else resolve_model_dir("--target", args.target)
    if args.json is not None and os.path.isdir(args.json):
        raise UsageError(f"--json {args.json} is a directory; give a file name.")
    return target_dir


def main(argv=None) -> int:
    quiet_dependency_warnings()
    args = build_parser().parse_args(argv)
    try:
        versions = runtime_versions(args.runtime_version)
        target_dir = _check_paths(args)
    except UsageError as err:
        return usage_status(PROG, err)
    # loads torch
    from megatron_dflash.checkpoint.serving import check_serving, exit_status, report_lines, runtime_rules

    try:
        rules = runtime_rules(versions)
    except ValueError as err:  # a release with no rules: a usage error like a mistyped flag
        return usage_status(PROG, err)
    try:
        # a hub id stays the name in the serve commands: the runtimes resolve it from the same cache
        name = args.target if args.target is not None and looks_like_hub_id(args.target) else None
        reports = check_serving(args.draft, target_dir, target_name=name, vllm_v2_runner=args.vllm_v2_runner,
                                runtimes=rules)
    except (ValueError, OSError) as err:
        report_failure(PROG, err)
        return 1
    print("\n".join(report_lines(args.draft, reports)))
    if args.json is not None:
        verdicts = {"draft": os.path.abspath(args.draft), "target": args.target,
                    "exit_status": exit_status(reports), "runtimes": [r.to_json() for r in reports]}
        try:  # the repository's one writer: the previous file or the whole new one, never a partial one
            write_file(args.json, json.dumps(verdicts, indent=2) + "\n")
        except OSError as err:  # an unwritable directory, a full disk
            report_failure(PROG, err)
            return 1
    return exit_status(reports)


if __name__ == "__main__":
    sys.exit(main())
