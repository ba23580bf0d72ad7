#!/usr/bin/env python
"""Measure a DFlash draft on a HF target: acceptance length, tokens per target forward, speedup.

Runs `megatron_dflash.decoding.generate.spec_generate` over a JSONL file of prompts and times it
against plain autoregressive greedy decoding of the same target (HF `generate`; for a target
without one, Kimi K3 on NeMo AutoModel's code, a loop that recomputes the target per token, as
speculative decoding recomputes it per cycle), then prints per-prompt acceptance lengths, the means and the
wall-clock speedup, and writes a JSON report.

Prompt lines (one JSON object per line; the format of `megatron_dflash.data.prompts`, shared with
`pretrain_dflash.py --dflash-eval-prompts`):
    {"input_ids": [1, 2, 3]}                          token ids, no tokenizer needed
    {"text": "..."} or {"prompt": "..."}              tokenized with the target's tokenizer
    {"messages": [{"role": "user", "content": ...}]}  rendered with the tokenizer's chat template

Without --target, the embedded tiny target of `python pretrain_dflash.py` is used, and without
--prompts, with that target, the prompts it knows (examples/prompts_tiny_target.jsonl). A prompt line may
name its "category"; the report then has a per-category table.

Benchmark prompt sets (`megatron_dflash.data.benchmarks`): --benchmark NAME --benchmark-file PATH reads the
set's file as published (MT-Bench question.jsonl, GSM8K, HumanEval, MBPP, MATH-500, Alpaca, LiveCodeBench),
asks each question as the DFlash papers' evaluation does (the target's chat template, no system prompt,
thinking off unless --thinking on; MT-Bench's second turn after the decode's own first answer,
`megatron_dflash.decoding.benchmark_turns`), --num-samples times with distinct seeds, and prints the
per-category table (`megatron_dflash.decoding.benchmark_report`). --compare REPORT.json puts a report next to
this run's (or --compare A.json B.json, two reports, without decoding).

Example:
    python tools/evaluate_acceptance.py --target Qwen/Qwen3-8B --draft runs/draft_hf \\
        --prompts prompts.jsonl --max-new-tokens 256 --batch-size 4 --output report.json
    python tools/evaluate_acceptance.py --target Qwen/Qwen3-8B --draft runs/draft_hf \\
        --benchmark mt-bench --benchmark-file question.jsonl --output mt_bench.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Iterable, Optional

# Before torch loads OpenMP: idle threads sleep instead of spinning (as in pretrain_dflash.py); on a
# busy CPU spinning threads slow decoding down many times over.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.cli import ArgumentParser, UsageError, json_object_option, quiet_dependency_warnings, report_failure, require_file, usage_error, usage_status  # noqa: E402,E501
from megatron_dflash.common.model_dirs import resolve_model_dir  # noqa: E402
from megatron_dflash.decoding.metric import (  # noqa: E402  (no torch: the headline metric, shared with training)
    decode_summary,
    row_tokens_per_target_forward,
)
from megatron_dflash.checkpoint.torch_dist import looks_like_save_dir  # noqa: E402  (no torch: layout names only)
from megatron_dflash.common.safetensors_files import TargetWeightsError  # noqa: E402  (no torch)
from megatron_dflash.data.benchmarks import BENCHMARK_NAMES, missing_file_message  # noqa: E402  (no torch)
from megatron_dflash.decoding.benchmark_report import (  # noqa: E402  (no torch: tables of a report)
    category_table,
    compare_reports,
    format_category_table,
    format_comparison,
)

DTYPES = ("float32", "bfloat16", "float16")
PROG = "evaluate_acceptance.py"
SHIPPED_PROMPTS = os.path.join(_ROOT, "examples", "prompts_tiny_target.jsonl")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Speculative decoding with a DFlash draft: acceptance length, tokens per target "
        "forward and wall-clock speedup over autoregressive greedy decoding.",
    )
    parser.add_argument("--target", default=None,
                        help="HF directory or hub id (read from the local HF cache, downloaded once when missing) of the target causal LM (default: the embedded tiny "
                        "target of `python pretrain_dflash.py`).")
    parser.add_argument(
        "--draft", default=None,
        help="HF draft directory (config.json + model.safetensors), or a megatron torch_dist checkpoint of "
        "the trainer (its --save directory, newest checkpoint, or one iter_* directory); the variant (any "
        "registered one: DFlash, DFlash 2, Domino, JetSpec, DSpark, ...) comes from the config. Required "
        "except with --compare A.json B.json.",
    )
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="drafts with a confidence head (DSpark) only: stop each drafted block at the first slot "
                        "whose cumulative predicted acceptance falls below this, in [0, 1] (default: off, every "
                        "slot proposes; a run's --dflash-confidence-threshold is its value to try).")
    parser.add_argument("--prompts", default=None,
                        help="JSONL file of prompts (input_ids, text/prompt or messages lines; default with "
                        "the embedded tiny target: examples/prompts_tiny_target.jsonl).")
    parser.add_argument("--benchmark", choices=BENCHMARK_NAMES, default=None,
                        help="a published prompt set instead of --prompts, read from --benchmark-file in its "
                        "published layout and asked as the DFlash papers' evaluation asks it (chat template, "
                        "MT-Bench's second turn after the decode's own first answer).")
    parser.add_argument("--benchmark-file", default=None,
                        help="the --benchmark set's file as published (JSONL, JSON array or Parquet); nothing "
                        "is downloaded.")
    parser.add_argument("--num-samples", type=int, default=1,
                        help="decode each benchmark question this many times, each with its own seeds (for "
                        "--temperature > 0); acceptance is averaged over all of them.")
    parser.add_argument("--thinking", choices=("on", "off"), default=None,
                        help="the chat template's enable_thinking: off unless 'on' with --benchmark (as the papers "
                        "measure); with --prompts, left to the template unless given.")
    parser.add_argument("--compare", nargs="+", default=None, metavar="REPORT",
                        help="REPORT.json: print it next to this run's report, per category and overall, with "
                        "the differences; two reports A.json B.json: compare them without decoding.")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: --target); needed "
                        "for 'text'/'prompt'/'messages' lines and for the decoded text of the report.")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (.jinja, or a JSON file with 'chat_template') for "
                        "'messages' prompts instead of the tokenizer's: the one the draft was trained with.")
    parser.add_argument("--chat-template-kwargs", default=None,
                        help="a JSON object passed to apply_chat_template for 'messages' prompts, e.g. "
                        "'{\"enable_thinking\": false}': the training run's --chat-template-kwargs.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off.")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together.")
    parser.add_argument("--limit", type=int, default=None,
                        help="use only N prompts (--benchmark: questions), spread over their categories, in file order.")
    parser.add_argument("--output", default=None, help="write the JSON report here.")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu.")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of target and draft (default: bfloat16 on cuda, float32 on cpu).")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator.")
    parser.add_argument(
        "--stop-token-ids", default=None,
        help="comma-separated stop tokens (default: the target's eos_token_id, if any).",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="never stop early; always generate "
                        "--max-new-tokens.")
    parser.add_argument("--no-baseline", action="store_true", help="skip the autoregressive baseline "
                        "(no speedup is reported).")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up batches before measuring.")
    parser.add_argument("--attention-backend", default="chunked", choices=("chunked", "dense"),
                        help="block attention backend of the draft.")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and check the command line (usage errors: one line, exit status 2, before torch loads)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.top_k < 0:
        parser.error("--top-k must be >= 0")
    if args.confidence_threshold is not None and not 0 <= args.confidence_threshold <= 1:
        parser.error("--confidence-threshold must be in [0, 1]")
    if args.num_samples < 1:
        parser.error("--num-samples must be >= 1")
    try:
        args.template_kwargs = json_object_option("--chat-template-kwargs", args.chat_template_kwargs)
    except UsageError as err:
        parser.error(str(err))
    _check_modes(parser, args)
    if compare_only(args):
        return args
    try:
        check_paths(args)
    except UsageError as err:
        usage_error(PROG, str(err))
    return args


def compare_only(args: argparse.Namespace) -> bool:
    """--compare A.json B.json: two reports side by side, nothing decoded."""
    return args.compare is not None and len(args.compare) == 2


def _check_modes(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """Which flags go together: --benchmark with its file and without --prompts, --compare with one or two
    reports, --draft unless two reports are compared."""
    if args.compare is not None:
        if len(args.compare) > 2:
            parser.error("--compare takes one report (compared with this run's) or two (compared with each other)")
        for path in args.compare:
            if not os.path.isfile(path):
                parser.error(f"--compare {path}: no such report file")
        if compare_only(args):
            return
    if args.draft is None:
        parser.error("--draft is required (except with --compare A.json B.json)")
    if args.benchmark is None:
        if args.benchmark_file is not None:
            parser.error("--benchmark-file needs --benchmark NAME (which set the file holds)")
        return
    if args.prompts is not None:
        parser.error("--benchmark and --prompts are alternatives: give one")
    if args.benchmark_file is None:
        parser.error(missing_file_message(args.benchmark))
    if not os.path.exists(args.benchmark_file):
        parser.error(f"--benchmark-file {args.benchmark_file}: no such file")


def check_paths(args: argparse.Namespace) -> None:
    """Every path of the command line, before torch and transformers load (raises `UsageError`).

    Resolves the defaults of --target (the embedded tiny target) and --prompts (its prompts).
    """
    from megatron_dflash.embedded_job.tiny_target import embedded_target_dir, matches_recipe

    if args.target is None:
        args.target = embedded_target_dir()
    benchmark = args.benchmark is not None
    if args.prompts is None and not benchmark and matches_recipe(args.target):  # the embedded tiny target
        args.prompts = SHIPPED_PROMPTS
    args.target = resolve_model_dir("--target", args.target)  # a directory or a hub id (its local snapshot)
    if args.prompts is None and not benchmark:
        raise UsageError("--prompts (or --benchmark) is required with a --target other than the embedded tiny "
                         "target.")
    if not looks_like_save_dir(args.draft):  # else a megatron checkpoint, checked when it is read
        args.draft = resolve_model_dir("--draft", args.draft, "HF draft directory")
    if benchmark:
        args.benchmark_items = read_benchmark_items(args)  # a bad record is named before torch loads; read once
    else:
        require_file("--prompts", args.prompts, "prompt file")
    if args.tokenizer is not None:
        args.tokenizer = resolve_model_dir("--tokenizer", args.tokenizer, "tokenizer directory", must_contain=None)
    if args.chat_template is not None:
        require_file("--chat-template", args.chat_template, "chat template file")


# ================================================================================== progress


def progress(total: int, phase: str, unit: str = "prompts"):
    """Progress of one phase on stderr (`decoding.regenerate.Progress`, as the regeneration tool prints it): a
    bar on a terminal; in a log a line at least every 30 seconds while the phase runs, and its last (`advance`).
    The report (stdout, --output) does not change."""
    from megatron_dflash.decoding.regenerate import Progress

    return Progress(total, f"{phase}: ", sys.stderr, unit=unit)


def advance(bar, done: int, tokens: int) -> None:
    """`done` more prompts (turns) decoded, `tokens` generated; the phase's last update is always printed."""
    bar.update(done, tokens, force=bar.records + done >= bar.total)


# ================================================================================== loading


class PromptTokenizer:
    """The tokenizer of --tokenizer / --target (with --chat-template's template), loaded on first use; `get()`
    raises a UsageError."""

    def __init__(self, path: str, chat_template: Optional[str] = None):
        self.path, self.chat_template = path, chat_template
        self._tokenizer = None
        self.error: Optional[str] = None

    def get(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except Exception as err:  # noqa: BLE001 - any loader failure is a bad --tokenizer/--target
                self.error = f"cannot load a tokenizer from {self.path} ({type(err).__name__}); pass --tokenizer DIR"
                raise UsageError(self.error + ".") from None
            if self.chat_template is not None:  # the template the draft's data was rendered with
                from megatron_dflash.data.chat import load_chat_template

                try:
                    self._tokenizer.chat_template = load_chat_template(self.chat_template)
                except (OSError, ValueError) as err:
                    raise UsageError(f"--chat-template {self.chat_template}: {err}") from None
        return self._tokenizer

    def maybe(self):
        """The tokenizer, or None when there is none (decoded text is then left out)."""
        try:
            return self.get()
        except UsageError:
            return None


def read_prompts(path: str, limit: Optional[int], tokenizer: PromptTokenizer,
                 template_kwargs: Optional[dict] = None) -> tuple[list[list[int]], list[str], list[Optional[str]]]:
    """Token ids of every prompt (chats rendered with ``template_kwargs``, --chat-template-kwargs), a warning
    for each prompt that is mostly unknown tokens, and each line's category (None where it names none), from
    one reading of the file."""
    from megatron_dflash.data.prompts import (
        PromptError,
        prompt_category,
        read_prompt_file,
        tokenize_prompt,
        unknown_token_warning,
    )

    try:
        items = read_prompt_file(path, limit)
        prompts = [tokenize_prompt(item, tokenizer.get, template_kwargs) for item in items]
        categories = [prompt_category(item) for item in items]
    except PromptError as err:
        raise UsageError(str(err)) from None
    warnings = []
    if any("input_ids" not in item.record for item in items):  # the tokenizer is loaded anyway
        tok = tokenizer.get()
        warnings = [w for w in (unknown_token_warning(ids, tok, item.where) for item, ids in zip(items, prompts)) if w]
    return prompts, warnings, categories


def read_benchmark_items(args: argparse.Namespace) -> list:
    """The questions of --benchmark-file (a `UsageError` naming file:line and field for a bad record)."""
    from megatron_dflash.data.benchmarks import BenchmarkError, read_benchmark

    try:
        return read_benchmark(args.benchmark, args.benchmark_file, args.limit)
    except BenchmarkError as err:
        raise UsageError(str(err)) from None


def template_kwargs(args: argparse.Namespace) -> dict:
    """The chat template's kwargs: --chat-template-kwargs, with enable_thinking as --thinking says (off by
    default with --benchmark, as the papers measure, unless --chat-template-kwargs sets it)."""
    kwargs = dict(args.template_kwargs)
    if args.thinking is not None:
        kwargs["enable_thinking"] = args.thinking == "on"
    elif args.benchmark:
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def load_target(path: str, device, dtype):
    """The target causal LM, loaded as its family says (`megatron_dflash.target.families`: the transformers auto class, or
    the family's own loader; a family whose targets keep no KV cache is decoded by recomputing, see
    `decoding.generate.spec_generate`)."""
    from transformers import PretrainedConfig

    from megatron_dflash.target.families import TargetFamilyError, resolve_target_family, target_architecture

    config, _ = PretrainedConfig.get_config_dict(path)  # a local directory or a hub id
    try:
        family = resolve_target_family(config)
    except TargetFamilyError as err:
        raise UsageError(f"--target {path}: {err}") from None
    return family.loader(target_architecture(config))(path, dtype).to(device).eval()


def _draft_error(path: str, err: BaseException) -> ValueError:
    return ValueError(f"--draft {path}: cannot load the draft ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}).")


def check_draft_config(path: str) -> None:
    """A HF draft's config.json checked (types, ranges, against its weights' shapes) before the target loads, so
    a broken draft is named at once; a megatron checkpoint's is checked when it is read."""
    from megatron_dflash.checkpoint.architectures import read_hf_draft_config

    if looks_like_save_dir(path):
        return
    try:
        read_hf_draft_config(path)
    except (OSError, ValueError) as err:
        raise _draft_error(path, err) from None


def load_draft(path: str, device, dtype, attention_backend: str):
    """The draft body of a HF draft directory or of a megatron torch_dist checkpoint (a save
    directory's newest checkpoint, or one checkpoint directory); the variant comes from its config."""
    megatron = looks_like_save_dir(path)
    if not megatron and not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--draft {path}: no config.json in it; expected a HF draft directory.")
    from megatron_dflash.checkpoint.hf import load_hf_checkpoint  # the variant comes from config.json
    from megatron_dflash.checkpoint.torch_dist import load_megatron_draft, resolve_iteration_dir, single_process_group
    from megatron_dflash.variants.registry import variant_of

    try:
        if megatron:
            with single_process_group():
                body = load_megatron_draft(resolve_iteration_dir(path), attention_backend=attention_backend)
        else:
            body = load_hf_checkpoint(path, attention_backend=attention_backend)
    except (OSError, ValueError, KeyError) as err:  # a broken config or weights file: exit 1, not a usage error
        raise _draft_error(path, err) from None
    try:
        variant_of(body).check_dtype(dtype)
    except ValueError as err:
        raise UsageError(f"--dtype: {err}") from None
    return body.to(device=device, dtype=dtype).eval()


def default_stop_tokens(target) -> list[int]:
    ids = []
    for source in (getattr(target, "generation_config", None), target.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
        break
    return sorted({int(i) for i in ids})


# ================================================================================== decoding


def batches(items: list, size: int) -> Iterable[tuple[int, list]]:
    for start in range(0, len(items), size):
        yield start, items[start : start + size]


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def autoregressive_greedy(target, prompts: list[list[int]], max_new_tokens: int, stop_tokens: list[int], device):
    """Plain greedy decoding with HF `generate` (left-padded batch). Returns generated ids per row."""
    import torch

    S = max(len(p) for p in prompts)
    pad = stop_tokens[0] if stop_tokens else 0
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, S - len(prompt) :] = torch.tensor(prompt)
        mask[b, S - len(prompt) :] = 1
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=stop_tokens or None,
        attention_mask=mask.to(device),
    )
    if not stop_tokens:
        kwargs["min_new_tokens"] = max_new_tokens
    with torch.inference_mode():
        out = target.generate(ids.to(device), **kwargs)
    generated = []
    for b in range(len(prompts)):
        row = out[b, S:].tolist()
        for j, token in enumerate(row):
            if token in stop_tokens:
                row = row[: j + 1]
                break
        generated.append(row)
    return generated


def recomputing_greedy(target, prompts: list[list[int]], max_new_tokens: int, stop_tokens: list[int], device):
    """Plain greedy decoding of a target without HF `generate` (Kimi K3 on NeMo AutoModel's code, which keeps no
    KV cache): every token recomputes the target over each row's whole sequence, as speculative decoding
    recomputes it every cycle. Rows are right-padded (a causal target needs no mask then). Returns generated
    ids per row."""
    import torch

    pad = stop_tokens[0] if stop_tokens else 0
    sequences = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    with torch.inference_mode():
        while live:
            width = max(len(sequences[b]) for b in live)
            ids = torch.full((len(live), width), pad, dtype=torch.long)
            for i, b in enumerate(live):
                ids[i, : len(sequences[b])] = torch.tensor(sequences[b])
            last = torch.tensor([len(sequences[b]) - 1 for b in live], device=device)
            logits = target(ids.to(device)).logits  # [B, width, V]
            tokens = logits[torch.arange(len(live), device=device), last].argmax(dim=-1).tolist()
            for b, token in zip(live, tokens):
                sequences[b].append(token)
                generated[b].append(token)
            live = [b for b in live if generated[b][-1] not in stop_tokens and len(generated[b]) < max_new_tokens]
    return generated


class _Run:
    """What every step of `evaluate` shares: the models, the prompts and the decoding settings."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from megatron_dflash.target.families import target_keeps_kv_cache
        from megatron_dflash.variants.registry import variant_of

        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype_name = args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        dtype = getattr(torch, self.dtype_name)
        tokenizer = PromptTokenizer(args.tokenizer or args.target, args.chat_template)
        self.template_kwargs = template_kwargs(args)
        self.items: list = []  # the benchmark's questions (--benchmark)
        self.categories: list = []  # each --prompts line's category
        if args.benchmark:
            self.items = args.benchmark_items  # read (and checked) by `check_paths`
            tokenizer.get()  # the questions are text: a bad --tokenizer / --target is named before the models load
            self.prompts = []  # filled turn by turn as they are decoded (`_benchmark_rows`)
        else:
            self.prompts, prompt_warnings, self.categories = read_prompts(args.prompts, args.limit, tokenizer,
                                                                          self.template_kwargs)
            for warning in prompt_warnings:
                print(warning, file=sys.stderr, flush=True)
        check_draft_config(args.draft)  # a broken draft is named before the target loads
        try:
            self.target = load_target(args.target, self.device, dtype)
        except TargetWeightsError as err:  # pickled weights (never unpickled), or none: its own line
            raise UsageError(f"--target {args.target}: {err}") from None
        except (OSError, ValueError) as err:  # a hub id that does not resolve, a broken directory
            raise UsageError(f"--target {args.target}: cannot load a causal LM ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}).") from None
        self.draft = load_draft(args.draft, self.device, dtype, args.attention_backend)
        self.variant = variant_of(self.draft)
        if args.confidence_threshold is not None:  # a draft without a confidence head: a usage error, now
            try:
                self.variant.propose_fn(self.draft, args.confidence_threshold)
            except ValueError as err:
                raise UsageError(f"--confidence-threshold: {err}") from None
        # Plain decoding as the target serves it: HF `generate` (with whatever cache the model keeps, also one
        # that speculative decoding cannot roll back); a model without one (NeMo's K3) is recomputed per token.
        self.target_kv_cache = target_keeps_kv_cache(self.target.config)
        self.baseline = autoregressive_greedy if callable(getattr(self.target, "generate", None)) else recomputing_greedy
        self.decode = tokenizer.maybe()
        if args.ignore_eos:
            self.stop_tokens: list[int] = []
        elif args.stop_token_ids:
            self.stop_tokens = [int(t) for t in args.stop_token_ids.split(",") if t.strip()]
        else:
            self.stop_tokens = default_stop_tokens(self.target)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed)

    def spec(self, batch):
        from megatron_dflash.decoding.generate import spec_generate

        a = self.args
        return spec_generate(
            self.target, self.draft, batch, max_new_tokens=a.max_new_tokens, stop_token_ids=self.stop_tokens,
            generator=self.generator, attention_backend=a.attention_backend,
            temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, confidence_threshold=a.confidence_threshold,
        )

    def turn_ids(self, prompt) -> list[int]:
        """Token ids of one benchmark turn (a `decoding.benchmark_turns.TurnPrompt`): its chat through the
        target's chat template with the generation prompt (`data.prompts.tokenize_prompt`)."""
        from megatron_dflash.data.prompts import PromptError, PromptRecord, tokenize_prompt

        try:
            return tokenize_prompt(PromptRecord({"messages": prompt.messages}, prompt.where), self.decode,
                                   self.template_kwargs)
        except PromptError as err:
            raise UsageError(str(err)) from None

    def warm_up(self) -> None:
        if self.args.benchmark:  # the first turns of the first questions
            from megatron_dflash.decoding.benchmark_turns import TurnPrompt, turn_messages

            warm = [self.turn_ids(TurnPrompt(item, 0, 0, turn_messages(item, []), 0))
                    for item in self.items[: self.args.batch_size]]
        else:
            warm = self.prompts
        for _, batch in list(batches(warm, self.args.batch_size))[: self.args.warmup]:
            self.spec(list(batch))
            if not self.args.no_baseline:
                self.baseline(self.target, batch, min(8, self.args.max_new_tokens), self.stop_tokens, self.device)


def evaluate(args: argparse.Namespace) -> dict:
    """Speculative decoding of the prompts, then the autoregressive baseline: the report (settings, summary,
    per-prompt rows)."""
    run = _Run(args)
    run.warm_up()
    per_prompt, spec_time, totals = (_benchmark_rows if args.benchmark else _speculative_rows)(run)
    baseline = None if args.no_baseline else _baseline(run, per_prompt)
    summary = _summary(run, per_prompt, spec_time, totals, baseline)
    return {"settings": _settings(run), "summary": summary, "categories": category_table(per_prompt),
            "prompts": per_prompt}


def _time_shares(seconds: float, tokens: list[int]) -> list[float]:
    """A batch's time shared among its rows by the tokens each generated (the per-category speedups)."""
    total = sum(tokens)
    return [seconds * t / total for t in tokens] if total else [seconds / len(tokens)] * len(tokens)


def _spec_batch(run: _Run, batch: list[list[int]], totals: dict) -> tuple:
    """One batch through `spec_generate`, timed: its output, its seconds; the forward counts added to `totals`."""
    _sync(run.device)
    began = time.perf_counter()
    out = run.spec(batch)
    _sync(run.device)
    seconds = time.perf_counter() - began
    totals["target_forwards"] += out.num_target_forwards
    totals["prefill_forwards"] += out.num_prefill_forwards
    totals["draft_forwards"] += out.num_draft_forwards
    return out, seconds


def _batch_rows(run: _Run, start: int, batch: list[list[int]], out, seconds: float) -> list[dict]:
    """The report rows of one decoded batch, each with its share of the batch's time."""
    rows = [_prompt_row(run, start + row, batch[row], out.generated(row), out.acceptance_lengths[row],
                        bool(out.stopped[row])) for row in range(len(batch))]
    for row, share in zip(rows, _time_shares(seconds, [r["generated_tokens"] for r in rows])):
        row["spec_seconds"] = share
    return rows


def _new_totals() -> dict:
    return {"target_forwards": 0, "prefill_forwards": 0, "draft_forwards": 0}


def _speculative_rows(run: _Run) -> tuple[list, float, dict]:
    """Every prompt through `spec_generate`: its report row, the decoding time and the batched forward counts."""
    per_prompt, spec_time, totals = [], 0.0, _new_totals()
    bar = progress(len(run.prompts), "spec_generate")
    try:
        for start, batch in batches(run.prompts, run.args.batch_size):
            out, seconds = _spec_batch(run, batch, totals)
            spec_time += seconds
            rows = _batch_rows(run, start, batch, out, seconds)
            for row in rows:
                if run.categories[row["index"]] is not None:
                    row["category"] = run.categories[row["index"]]
            per_prompt.extend(rows)
            advance(bar, len(batch), sum(row["generated_tokens"] for row in rows))
    finally:
        bar.close()
    return per_prompt, spec_time, totals


def _benchmark_rows(run: _Run) -> tuple[list, float, dict]:
    """Every turn of every sample of the benchmark's questions through `spec_generate`, turn by turn (a later
    turn after the decode's own earlier answers, `decoding.benchmark_turns`); each batch's draws seeded with its
    first prompt's seed. Rows ordered by question, sample, turn; `run.prompts` becomes their token ids (for the
    baseline)."""
    from megatron_dflash.data.prompts import unknown_token_warning
    from megatron_dflash.decoding.benchmark_turns import run_benchmark_turns

    a, clock, totals = run.args, [0.0], _new_totals()
    # Counted in turns: a question has one per turn and sample.
    bar = progress(sum(len(item.turns) for item in run.items) * a.num_samples, "spec_generate", "turns")

    def decode(prompts: list) -> list:
        ids = [run.turn_ids(p) for p in prompts]
        for p, p_ids in zip(prompts, ids):
            warning = unknown_token_warning(p_ids, run.decode, p.where) if p.turn == 0 and p.sample == 0 else None
            if warning:
                print(warning, file=sys.stderr, flush=True)
        results = []
        for start, batch in batches(list(range(len(prompts))), a.batch_size):
            run.generator.manual_seed(prompts[batch[0]].seed)
            out, seconds = _spec_batch(run, [ids[k] for k in batch], totals)
            clock[0] += seconds
            rows = _batch_rows(run, 0, [ids[k] for k in batch], out, seconds)
            for k, row in zip(batch, rows):
                p = prompts[k]
                row.update({"set": p.item.set, "category": p.item.category, "question_id": p.item.question_id,
                            "turn": p.turn + 1, "sample": p.sample, "seed": p.seed})
                answer = run.decode.decode(row["generated_ids"], skip_special_tokens=True)
                results.append((answer, (row, ids[k])))
            advance(bar, len(batch), sum(row["generated_tokens"] for row in rows))
        return results

    try:
        done = run_benchmark_turns(run.items, decode, num_samples=a.num_samples, seed=a.seed)
    finally:
        bar.close()
    per_prompt = []
    for index, (_, (row, ids)) in enumerate(done):
        row["index"] = index
        per_prompt.append(row)
        run.prompts.append(ids)
    return per_prompt, clock[0], totals


def _prompt_row(run: _Run, index: int, prompt: list[int], generated: list[int], cycles: list[int],
                stopped: bool) -> dict:
    """One prompt's report row."""
    row = {
        "index": index,
        "prompt_tokens": len(prompt),
        "generated_tokens": len(generated),
        "acceptance_lengths": cycles,
        "mean_acceptance_length": (sum(cycles) / len(cycles)) if cycles else None,
        "tokens_per_target_forward": row_tokens_per_target_forward(len(generated), len(cycles)),
        "stopped": stopped,
        "generated_ids": generated,
    }
    if run.decode is not None:  # readable text: without the chat template's special tokens
        row["prompt_text"] = run.decode.decode(prompt, skip_special_tokens=True)
        row["generated_text"] = run.decode.decode(generated, skip_special_tokens=True)
    if not cycles:
        row["no_cycle_reason"] = no_cycle_reason(generated, run.stop_tokens, run.args.max_new_tokens)
    return row


def _baseline(run: _Run, per_prompt: list) -> dict:
    """The autoregressive baseline over the same prompts: its time, tokens and how many outputs match."""
    ar_time, ar_tokens, matches = 0.0, 0, 0
    bar = progress(len(run.prompts), "autoregressive")
    try:
        for start, batch in batches(run.prompts, run.args.batch_size):
            _sync(run.device)
            began = time.perf_counter()
            generated = run.baseline(run.target, batch, run.args.max_new_tokens, run.stop_tokens, run.device)
            _sync(run.device)
            seconds = time.perf_counter() - began
            ar_time += seconds
            for row, (ids, share) in enumerate(zip(generated, _time_shares(seconds, [len(g) for g in generated]))):
                ar_tokens += len(ids)
                matches += ids == per_prompt[start + row]["generated_ids"]
                per_prompt[start + row].update({"autoregressive_tokens": len(ids), "autoregressive_seconds": share})
            advance(bar, len(batch), sum(len(g) for g in generated))
    finally:
        bar.close()
    greedy_match = matches / len(run.prompts) if run.args.temperature == 0 else None
    return {"seconds": ar_time, "tokens": ar_tokens, "greedy_match": greedy_match}


def _summary(run: _Run, per_prompt: list, spec_time: float, totals: dict, baseline: Optional[dict]) -> dict:
    """The report's summary: the headline metric (`decode_summary`, as training evaluation computes it), the
    batched forward counts and the throughput, with the speedup over the baseline when it ran."""
    metric = decode_summary(
        [p["acceptance_lengths"] for p in per_prompt], [p["generated_tokens"] for p in per_prompt],
        why="; ".join(sorted({p["no_cycle_reason"] for p in per_prompt if "no_cycle_reason" in p})),
        remedy="use prompts the target continues (for the embedded tiny target: examples/prompts_tiny_target.jsonl), "
               "or --ignore-eos")
    spec_tokens = metric["generated_tokens"]
    spec_tps = spec_tokens / spec_time if spec_time > 0 else math.nan
    summary = {
        "prompts": len(per_prompt),
        "generated_tokens": spec_tokens,
        "mean_acceptance_length": metric["acceptance_length"],
        "mean_of_prompt_acceptance_lengths": _mean(
            [p["mean_acceptance_length"] for p in per_prompt if p["mean_acceptance_length"] is not None]
        ),
        "verify_cycles": metric["cycles"],
        "tokens_per_target_forward": metric["tokens_per_target_forward"],
        "batched_target_forwards": totals["target_forwards"],
        "batched_prefill_forwards": totals["prefill_forwards"],
        "batched_draft_forwards": totals["draft_forwards"],
        "spec_seconds": spec_time,
        "spec_tokens_per_second": spec_tps,
    }
    if "no_cycle_reason" in metric:
        summary["no_cycle_reason"] = metric["no_cycle_reason"]
    if baseline is not None:
        ar_time, ar_tokens = baseline["seconds"], baseline["tokens"]
        ar_tps = ar_tokens / ar_time if ar_time > 0 else math.nan
        summary.update(
            {
                "autoregressive_seconds": ar_time,
                "autoregressive_tokens": ar_tokens,
                "autoregressive_tokens_per_second": ar_tps,
                # Throughput ratio: robust to the two runs stopping at different lengths.
                "speedup": spec_tps / ar_tps if ar_tps and ar_tps > 0 else None,
                "greedy_outputs_identical_fraction": baseline["greedy_match"],
            }
        )
        note = speedup_note(summary["speedup"], summary["tokens_per_target_forward"], run.device.type)
        if note:
            summary["speedup_note"] = note
    return summary


def _settings(run: _Run) -> dict:
    """The report's settings: what was measured, and how."""
    args = run.args
    return {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "benchmark": args.benchmark,
        "benchmark_file": args.benchmark_file,
        "questions": len(run.items) if args.benchmark else None,
        "num_samples": args.num_samples if args.benchmark else 1,
        "chat_template": args.chat_template,
        "chat_template_kwargs": run.template_kwargs,
        "draft_architecture": type(run.draft).__name__,
        "target_kv_cache": run.target_kv_cache,  # False: spec_generate recomputes the target every cycle
        "baseline": "generate" if run.baseline is autoregressive_greedy else "recomputed",
        "block_size": run.draft.config.block_size,
        # draft tokens a block verifies at most (DSpark: every slot proposes, block_size)
        "proposals_per_block": run.variant.proposals_per_block(run.draft.config.block_size),
        "confidence_threshold": args.confidence_threshold,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "batch_size": args.batch_size,
        "device": str(run.device),
        "dtype": run.dtype_name,
        "stop_token_ids": run.stop_tokens,
        "seed": args.seed,
    }


def no_cycle_reason(generated: list[int], stop_tokens: list[int], max_new_tokens: int) -> str:
    """Why a prompt ran no verify cycle (its acceptance length is undefined)."""
    if generated and generated[-1] in stop_tokens and len(generated) == 1:
        return f"the target's first token is the stop token {generated[-1]}"
    if max_new_tokens <= 1:
        return "--max-new-tokens 1 leaves nothing to speculate after the prefill"
    return "decoding ended at the prefill's token"


def speedup_note(speedup: Optional[float], tokens_per_forward: Optional[float], device: str) -> Optional[str]:
    """One line on why the wall-clock speedup is below 1 (when it is)."""
    if speedup is None or not math.isfinite(speedup) or speedup >= 1.0:
        return None
    gain = f"{tokens_per_forward:.2f} tokens per target forward" if tokens_per_forward else "the saved target forwards"
    where = "on CPU " if device == "cpu" else ""
    return (f"speedup < 1: {where}a small target costs about as much per forward as the draft, so "
            f"{gain} do not pay for the draft's forwards; speculative decoding saves time when a target "
            "forward is much more expensive than a draft forward (large targets, memory-bound GPU decoding).")


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return json.dumps(text if len(text) <= width else text[: width - 3] + "...")


def _prompt_tag(p: dict) -> str:
    """A benchmark row's question, turn and sample (nothing for a --prompts row)."""
    if "turn" not in p:
        return ""
    sample = f" sample {p['sample']}" if p["sample"] else ""
    return f" [{p['category']} {p['question_id']} turn {p['turn']}{sample}]"


def print_report(report: dict) -> None:
    for p in report["prompts"]:
        line = (f"prompt {p['index']:4d}{_prompt_tag(p)}: acceptance length {_fmt(p['mean_acceptance_length'])} "
                f"over {len(p['acceptance_lengths'])} cycles, {p['generated_tokens']} tokens, "
                f"{_fmt(p['tokens_per_target_forward'])} tokens/target forward")
        if "prompt_text" in p:
            line += f" | {_short(p['prompt_text'], 40)} -> {_short(p['generated_text'])}"
        else:
            line += f" | ids {p['generated_ids'][:12]}{' ...' if len(p['generated_ids']) > 12 else ''}"
        if p.get("no_cycle_reason"):
            line += f" (no cycle: {p['no_cycle_reason']})"
        print(line)
    s = report["summary"]
    # the headline line of training's evaluation (after torch has loaded: the training stage imports it)
    from megatron_dflash.training.evaluation import acceptance_line

    print(acceptance_line({"acceptance_length": s["mean_acceptance_length"], "cycles": s["verify_cycles"],
                           "prompts": s["prompts"], "tokens_per_target_forward": s["tokens_per_target_forward"],
                           "no_cycle_reason": s.get("no_cycle_reason")}))
    print(f"spec decoding:               {s['generated_tokens']} tokens in {s['spec_seconds']:.2f} s "
          f"({_fmt(s['spec_tokens_per_second'], '.1f')} tok/s)")
    if "speedup" in s:
        print(f"autoregressive greedy:       {s['autoregressive_tokens']} tokens in "
              f"{s['autoregressive_seconds']:.2f} s ({_fmt(s['autoregressive_tokens_per_second'], '.1f')} tok/s)")
        print(f"speedup (throughput):        {_fmt(s['speedup'])}x")
        if s.get("speedup_note"):
            print(f"  {s['speedup_note']}")
        if s.get("greedy_outputs_identical_fraction") is not None:
            print(f"greedy outputs identical:    {s['greedy_outputs_identical_fraction']:.0%}")
    if len(report["categories"]) > 1 or report["settings"].get("benchmark"):
        print(format_category_table(report["categories"]))


def print_comparison(first: dict, first_name: str, second: dict, second_name: str) -> None:
    """Two reports side by side, per category and overall (a `UsageError` when one holds no usable rows)."""
    try:
        comparison = compare_reports(first, second)
    except (KeyError, TypeError, AttributeError) as err:
        raise UsageError(f"--compare {first_name}: not a report of this tool ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}).") from None
    print(format_comparison(comparison, first_name, second_name))


def _load_report(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as err:
        raise UsageError(f"--compare {path}: cannot read the report ({type(err).__name__}).") from None
    if not isinstance(report, dict) or not isinstance(report.get("prompts", []), list):
        raise UsageError(f"--compare {path}: not a report of this tool (no 'prompts' rows).")
    _comparable(report, path)
    return report


def _comparable(report: dict, path: str) -> None:
    """A `UsageError` naming `path` unless its per-category table can be read or computed."""
    try:
        compare_reports(report, report)
    except (KeyError, TypeError, AttributeError) as err:
        raise UsageError(f"--compare {path}: not a report of this tool ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}).") from None


def main(argv: Optional[list[str]] = None) -> int:
    """Exit status 0; 2 with one `error:` line for a bad flag or path; 1 with one `error:` line for a damaged
    model, draft or prompt, or a report that cannot be written (a full disk) (the traceback too with
    MEGATRON_DFLASH_DEBUG=1)."""
    quiet_dependency_warnings()
    args = parse_args(argv)
    try:
        base = _load_report(args.compare[0]) if args.compare else None  # named before the models load
        if compare_only(args):
            print_comparison(base, args.compare[0], _load_report(args.compare[1]), args.compare[1])
            return 0
        report = evaluate(args)
        print_report(report)
        if base is not None:
            print_comparison(base, args.compare[0], report, args.output or "this run")
    except UsageError as err:
        return usage_status(PROG, err)
    except (ValueError, OSError) as err:  # unreadable or mismatched files, bad decoding inputs
        report_failure(PROG, err)
        return 1
    if args.output:
        try:
            write_report(args.output, report)
        except OSError as err:  # a full disk, an unwritable directory: the previous report (if any) is intact
            report_failure(PROG, err)
            return 1
        print(f"report written to {args.output}")
    return 0


def write_report(path: str, report: dict) -> None:
    """The JSON report at `path`, replaced atomically: a reader (or a failed write) finds the previous
    report or the complete new one, never a partial or empty file (a full disk: `common.atomic.NoSpaceError`)."""
    from megatron_dflash.common.atomic import write_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_file(path, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
