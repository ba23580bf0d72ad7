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

From an OpenAI-compatible server (vLLM, SGLang, ...), the records checked against the target's tokenizer:
    python tools/regenerate_data.py --input chats.jsonl --output regen/ \\
        --server http://127.0.0.1:8000 --model Qwen/Qwen3-8B --tokenizer Qwen/Qwen3-8B --concurrency 64

Exit status 0 when every record of this rank was written (or skipped, named, by --bad-records skip), 1 when
some kept failing or got a bad answer (named on stderr and in `_shard-NNNNN.failed.json`; rerun to retry
them), 2 for a bad command line or input (a bad record with --bad-records fail, a prompt past the target's
context, an output directory another run holds or made with other settings).
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import urllib.parse  # noqa: E402

from megatron_dflash.common.cli import ArgumentParser, UsageError, json_object_option, quiet_dependency_warnings, report_failure, report_interrupt, require_file, usage_error  # noqa: E402,E501
from megatron_dflash.common.errors import RunError  # noqa: E402
from megatron_dflash.common.model_dirs import resolve_model_dir  # noqa: E402
from megatron_dflash.data.chat import load_chat_template  # noqa: E402  (no torch)
from megatron_dflash.data.formats import BAD_RECORD_MODES, DEFAULT_MAX_BAD_FRACTION, BadRecords, data_path_problem  # noqa: E402,E501  (no torch)
from megatron_dflash.decoding.regenerate import DEFAULT_PROGRESS_INTERVAL, TRUNCATION_POLICIES, Settings, regenerate  # noqa: E402,E501  (no torch)

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
    p.add_argument("--tokenizer", default=None,
                   help="the target's tokenizer directory (default: --target): records are checked against its chat "
                   "template's roles (the training job's rule) and the context of its config.json before any "
                   "answer is asked; with --server, unchecked (the server judges) unless given.")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (with --server).")
    p.add_argument("--retries", type=int, default=5, help="retries of a failed request (with --server).")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take in all, connect to the last byte (with --server); then retried.")
    p.add_argument("--backoff", type=float, default=1.0,
                   help="seconds before the first retry, doubled at each next one (with --server).")
    p.add_argument("--batch-size", type=int, default=8, help="answers per generate call (with --target).")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="weights' dtype (with --target).")
    p.add_argument("--shard-size", type=int, default=1000, help="records per output shard.")
    p.add_argument("--progress-interval", type=float, default=DEFAULT_PROGRESS_INTERVAL,
                   help="seconds between progress lines when the output is no terminal (a log file): also while one "
                   "shard's answers take longer (default %(default)g).")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="per-answer seeds are derived from it and the record id.")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (.jinja, or a JSON file with 'chat_template') used instead of the "
                   "tokenizer's (with --target; a server renders with the template it was started with).")
    p.add_argument("--chat-template-kwargs", default=None,
                   help='JSON object for the chat template, e.g. \'{"enable_thinking": true}\'.')
    p.add_argument("--bad-records", choices=BAD_RECORD_MODES, default="fail",
                   help="records that are no chat (text records, a message without a role, non-string content), "
                   "use a role the chat template does not render, do not fit the target's context with "
                   "--max-new-tokens, or get an answer that cannot be written (not valid Unicode, far too long): "
                   "stop at the first (fail; a bad answer: its shard is not written, the others are) or skip them, "
                   "named.")
    p.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION,
                   help="with --bad-records skip: refuse the input when more than this fraction of it is bad.")
    p.add_argument("--on-truncated", choices=TRUNCATION_POLICIES, default="skip-record",
                   help="a record with an answer cut at --max-new-tokens: left out (skip-record); ended with the cut answer, "
                   "its later turns dropped (drop-rest: training ends the chat where the answer's text ends, "
                   "without the end of turn the chat template would add, a stop the target never made); or its "
                   "later turns asked all the same (continue: the cut answer, closed by the template, in their "
                   "prompts and trained so). The last two write finish_reason 'length'.")
    p.add_argument("--drop-truncated", action="store_const", const="skip-record", dest="on_truncated",
                   help=argparse.SUPPRESS)  # the earlier spelling of --on-truncated skip-record
    return p


def settings_of(args) -> Settings:
    kwargs = json_object_option("--chat-template-kwargs", args.chat_template_kwargs, '{"enable_thinking": true}') or None
    if (args.target is None) == (args.server is None):
        raise UsageError("pass exactly one of --target (in this process) and --server (with --model).")
    if args.server is not None and not args.model:
        raise UsageError("--server needs --model, the name the server serves the target under.")
    if args.server is not None:
        url = urllib.parse.urlsplit(args.server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UsageError(f"--server {args.server}: not an http:// or https:// URL with a host, e.g. "
                             "http://127.0.0.1:8000.")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--shard-size", args.shard_size),
                        ("--batch-size", args.batch_size), ("--concurrency", args.concurrency)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}.")
    if not (args.timeout > 0 and args.backoff >= 0 and args.retries >= 0):
        raise UsageError("--timeout must be > 0, --backoff >= 0 and --retries >= 0.")
    if not args.progress_interval > 0:
        raise UsageError(f"--progress-interval must be > 0 seconds, got {args.progress_interval}.")
    if args.chat_template is not None and args.server is not None:
        raise UsageError("--chat-template is for --target; a server renders with its own template: start it with "
                         "that template (vLLM and SGLang: --chat-template FILE).")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1].")
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        raise UsageError(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}.")
    return Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed, kwargs)


def chat_template_of(args) -> tuple:
    """(--chat-template's text, its SHA-256 for the manifest), or (None, None)."""
    if args.chat_template is None:
        return None, None
    require_file("--chat-template", args.chat_template, "chat template file")
    try:
        text = load_chat_template(args.chat_template)
    except (OSError, ValueError) as err:
        raise UsageError(f"--chat-template {args.chat_template}: {err}") from None
    return text, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def backend_of(args, settings: Settings, rank: int, chat_template=None):
    """The answer back end, built only when a shard is left to do."""
    if args.server is not None:
        def server():
            from megatron_dflash.decoding.server_answers import ServerAnswers  # stdlib only

            limits = None
            if args.tokenizer is None:
                print(f"{PROG}: notice: without --tokenizer the records are not checked against the chat template's "
                      "roles and the target's context before they are sent (the server judges the prompts; the "
                      "training job checks the roles again).", file=sys.stderr)
            else:  # transformers loads here, only when asked for
                from megatron_dflash.decoding.prompt_limits import PromptLimits

                limits = PromptLimits.from_directory(args.tokenizer, settings.max_new_tokens,
                                                     settings.chat_template_kwargs)
            return ServerAnswers(args.server, args.model, settings, concurrency=args.concurrency,
                                 retries=args.retries, backoff=args.backoff, timeout=args.timeout,
                                 api_key=os.environ.get("OPENAI_API_KEY", ""), limits=limits)
        return server

    def local():
        # torch and transformers load here, after the command line and the manifest are checked.
        import torch

        from megatron_dflash.decoding.local_answers import LocalAnswers

        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % torch.cuda.device_count()}" \
            if torch.cuda.is_available() else "cpu"
        return LocalAnswers(args.target, settings, batch_size=args.batch_size, device=device, dtype=args.dtype,
                            chat_template=chat_template, tokenizer=args.tokenizer)
    return local


TRUNCATED_SAID = {"skip-record": "left out", "drop-rest": "ended there", "continue": "continued"}


def report(summary, args, rank: int, world: int) -> int:
    """The run's summary lines on stderr; the exit status (1 when records failed)."""
    who = f"rank {rank}: " if world > 1 else ""
    dropped = f", {summary.dropped_turns} later turns not asked" if args.on_truncated == "drop-rest" else ""
    skipped = f", {len(summary.skipped)} bad records left out" if summary.skipped else ""
    print(f"{PROG}: {who}{summary.records_written} records in {summary.shards_written} new shards "
          f"({summary.shards_skipped} already done), {summary.truncated} records with an answer cut at "
          f"--max-new-tokens ({TRUNCATED_SAID[args.on_truncated]}{dropped}){skipped}, {len(summary.failed)} failed.",
          file=sys.stderr)
    for rid, reason in summary.failed:
        print(f"{PROG}: error: record {rid} failed: {reason}", file=sys.stderr)
    if summary.failed:
        print(f"{PROG}: {len(summary.failed)} records failed; their shards were not written. Run the same "
              "command again to retry them (a bad answer fails again: --bad-records skip leaves it out).",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    quiet_dependency_warnings()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        settings = settings_of(args)
        problem = data_path_problem(args.input)
        if problem is not None:
            raise UsageError(f"--input {args.input}: {problem}")
        # the manifest names the target as given (a hub id stays one; a directory by its resolved path); the target
        # runs from its local directory
        target = args.target if args.target is not None else args.model
        if args.target is not None:
            args.target = resolve_model_dir("--target", args.target)
        if args.tokenizer is not None:
            args.tokenizer = resolve_model_dir("--tokenizer", args.tokenizer, "tokenizer directory", must_contain=None)
        chat_template, template_sha = chat_template_of(args)
    except UsageError as err:
        usage_error(PROG, str(err))
    try:
        summary = regenerate(args.input, args.output, backend_of(args, settings, rank, chat_template), settings,
                             target=target, shard_size=args.shard_size, truncated=args.on_truncated, rank=rank,
                             progress_interval=args.progress_interval,
                             world_size=world, bad_records=BadRecords(args.bad_records, args.max_bad_fraction),
                             chat_template_sha256=template_sha)
    except (RunError, ValueError, OSError) as err:
        report_failure(PROG, err)
        return 2
    except KeyboardInterrupt:  # the shards written so far stay; the same command resumes
        return report_interrupt(PROG, "; run the same command again to resume")
    return report(summary, args, rank, world)


if __name__ == "__main__":
    sys.exit(main())
