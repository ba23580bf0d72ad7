#!/usr/bin/env python
"""Regenerate a chat data set's answers with the target, so a draft learns the target's own distribution.

Strips the assistant turns of every conversation and asks the target for them, turn by turn, then writes
the records in numbered shards with a manifest (`megatron_dflash/decoding/regenerate.py`). The input is
anything `--train-data` reads (JSONL, JSON array, Parquet, a `save_to_disk` directory or a directory of such
files; OpenAI `messages` or ShareGPT `conversations` records); each record is written back in its own style,
the shards in the input file's kind (JSONL for a directory), so the output directory is `--train-data` as it
is. A rerun resumes: finished shards are skipped, the others redone; a manifest of other settings is refused.

In this process, on the local devices (one rank, or one per `torchrun` process, each with its own shards):
    python tools/regenerate_data.py --input chats.jsonl --output regen/ --target Qwen/Qwen3-8B \\
        --max-new-tokens 2048 --batch-size 16
    torchrun --nproc-per-node 8 tools/regenerate_data.py --input chats.jsonl --output regen/ --target ...

From an OpenAI-compatible server (vLLM, SGLang, ...):
    python tools/regenerate_data.py --input chats.jsonl --output regen/ \\
        --server http://127.0.0.1:8000 --model Qwen/Qwen3-8B --concurrency 64

Exit status 0 when every record of this rank was written, 1 when some kept failing (named on stderr and in
`_shard-NNNNN.failed.json`; rerun to retry them), 2 for a bad command line or input.
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.cli import ArgumentParser, UsageError, json_object_option, quiet_dependency_warnings, report_failure, report_interrupt, usage_error  # noqa: E402,E501
from megatron_dflash.common.model_dirs import resolve_model_dir  # noqa: E402
from megatron_dflash.common.errors import DataError  # noqa: E402
from megatron_dflash.data.formats import BAD_RECORD_MODES, DEFAULT_MAX_BAD_FRACTION, BadRecords, data_path_problem  # noqa: E402,E501  (no torch)
from megatron_dflash.decoding.regenerate import Settings, regenerate  # noqa: E402  (no torch)

PROG = "regenerate_data.py"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Regenerate the assistant turns of a chat data set with the target.")
    p.add_argument("--input", required=True,
                   help="chat records (OpenAI 'messages' or ShareGPT 'conversations'): a JSONL, .json (array) or "
                   ".parquet file, a datasets save_to_disk directory or a directory of such files.")
    p.add_argument("--output", required=True,
                   help="output directory: _manifest.json and shard-NNNNN.<the input file's kind; jsonl for a "
                   "directory>; usable as --train-data.")
    p.add_argument("--target", default=None, help="HF directory or hub id (read from the local HF cache, downloaded once "
                   "when missing) of the target, run in this process.")
    p.add_argument("--server", default=None, help="URL of an OpenAI-compatible server instead of --target.")
    p.add_argument("--model", default=None, help="the model name the server serves (with --server).")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (with --server).")
    p.add_argument("--retries", type=int, default=5, help="retries of a failed request (with --server).")
    p.add_argument("--batch-size", type=int, default=8, help="answers per generate call (with --target).")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="weights' dtype (with --target).")
    p.add_argument("--shard-size", type=int, default=1000, help="records per output shard.")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="per-answer seeds are derived from it and the record id.")
    p.add_argument("--chat-template-kwargs", default=None,
                   help='JSON object for the chat template, e.g. \'{"enable_thinking": true}\'.')
    p.add_argument("--bad-records", choices=BAD_RECORD_MODES, default="fail",
                   help="records that are no chat (text records, a message without a role, non-string content): "
                   "stop at the first (fail) or skip them, named.")
    p.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION,
                   help="with --bad-records skip: refuse the input when more than this fraction of it is bad.")
    p.add_argument("--drop-truncated", action="store_true",
                   help="leave out records whose answer hit --max-new-tokens (default: kept, finish_reason 'length').")
    return p


def settings_of(args) -> Settings:
    kwargs = json_object_option("--chat-template-kwargs", args.chat_template_kwargs, '{"enable_thinking": true}') or None
    if (args.target is None) == (args.server is None):
        raise UsageError("pass exactly one of --target (in this process) and --server (with --model).")
    if args.server is not None and not args.model:
        raise UsageError("--server needs --model, the name the server serves the target under.")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--shard-size", args.shard_size),
                        ("--batch-size", args.batch_size), ("--concurrency", args.concurrency)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}.")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1].")
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        raise UsageError(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}.")
    return Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed, kwargs)


def backend_of(args, settings: Settings, rank: int):
    """The answer back end, built only when a shard is left to do."""
    if args.server is not None:
        from megatron_dflash.decoding.server_answers import ServerAnswers  # stdlib only

        return lambda: ServerAnswers(args.server, args.model, settings, concurrency=args.concurrency,
                                     retries=args.retries, api_key=os.environ.get("OPENAI_API_KEY", ""))

    def local():
        # torch and transformers load here, after the command line and the manifest are checked.
        import torch

        from megatron_dflash.decoding.local_answers import LocalAnswers

        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}" \
            if torch.cuda.is_available() else "cpu"
        return LocalAnswers(args.target, settings, batch_size=args.batch_size, device=device, dtype=args.dtype)
    return local


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    quiet_dependency_warnings()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        settings = settings_of(args)
        problem = data_path_problem(args.input)
        if problem is not None:
            raise UsageError(f"--input {args.input}: {problem}")
        # the manifest names the target as given (a hub id stays one); the target runs from its local directory
        target = args.target if args.target is not None else args.model
        if args.target is not None:
            args.target = resolve_model_dir("--target", args.target)
    except UsageError as err:
        usage_error(PROG, str(err))
    try:
        summary = regenerate(args.input, args.output, backend_of(args, settings, rank), settings, target=target,
                             shard_size=args.shard_size, drop_truncated=args.drop_truncated, rank=rank,
                             world_size=world, bad_records=BadRecords(args.bad_records, args.max_bad_fraction))
    except (DataError, ValueError, OSError) as err:
        report_failure(PROG, err)
        return 2
    except KeyboardInterrupt:  # the shards written so far stay; the same command resumes
        return report_interrupt(PROG, "; run the same command again to resume")
    who = f"rank {rank}: " if world > 1 else ""
    print(f"{PROG}: {who}{summary.records_written} records in {summary.shards_written} new shards "
          f"({summary.shards_skipped} already done), {summary.truncated} answers cut at --max-new-tokens "
          f"({'dropped' if args.drop_truncated else 'kept'}), {len(summary.failed)} failed.", file=sys.stderr)
    for rid, reason in summary.failed:
        print(f"{PROG}: error: record {rid} failed: {reason}", file=sys.stderr)
    if summary.failed:
        print(f"{PROG}: {len(summary.failed)} records kept failing; their shards were not written. Run the same "
              "command again to retry them.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
