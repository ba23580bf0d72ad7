#!/usr/bin/env python
"""Measure a DFlash draft on a HF target: acceptance length, tokens per target forward, speedup.

Runs `megatron_dflash.generate.spec_generate` over a JSONL file of prompts and times it
against plain autoregressive greedy decoding of the same target (HF `generate`), then prints
per-prompt acceptance lengths, the means and the wall-clock speedup, and writes a JSON report.

Prompt lines (one JSON object per line, any of):
    {"input_ids": [1, 2, 3]}                          token ids, no tokenizer needed
    {"prompt": "text"}                                tokenized with the target's tokenizer
    {"messages": [{"role": "user", "content": ...}]}  rendered with the tokenizer's chat template

Example:
    python tools/evaluate_acceptance.py --target Qwen/Qwen3-8B --draft runs/draft_hf \\
        --prompts prompts.jsonl --max-new-tokens 256 --batch-size 4 --output report.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Iterable, Optional

# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Speculative decoding with a DFlash draft: acceptance length, tokens per target "
        "forward and wall-clock speedup over autoregressive greedy decoding.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="HF directory (or hub id) of the target causal LM.")
    parser.add_argument(
        "--draft", required=True,
        help="HF draft directory (config.json + model.safetensors); DFlash 2 when its config says "
        "DFlash2DraftModel.",
    )
    parser.add_argument("--prompts", required=True, help="JSONL file of prompts (input_ids, prompt or messages).")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target); only "
                        "needed for 'prompt'/'messages' lines.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off.")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together.")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts.")
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
    return args


# ================================================================================== progress


class _SimpleProgress:
    """A stand-in for tqdm: one updating line on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self._draw()

    def _draw(self) -> None:
        width = 30
        done = int(width * self.n / self.total) if self.total else width
        sys.stderr.write(f"\r{self.desc}: [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total}")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress(total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr)
    except ImportError:
        return _SimpleProgress(total, desc)


# ================================================================================== loading


def read_prompts(path: str, limit: Optional[int]) -> list[dict]:
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SystemExit(f"{path}:{number}: not valid JSON ({err}).")
            if not isinstance(record, dict) or not any(k in record for k in ("input_ids", "prompt", "messages")):
                raise SystemExit(
                    f"{path}:{number}: each line must be an object with 'input_ids', 'prompt' or 'messages'."
                )
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise SystemExit(f"{path} holds no prompts.")
    return records


def tokenize_prompts(records: list[dict], tokenizer_path: str) -> list[list[int]]:
    """Token ids of every record; the tokenizer is loaded only if some record needs it."""
    tokenizer = None
    out = []
    for index, record in enumerate(records):
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise SystemExit(f"prompt {index}: input_ids must be a non-empty list of integers.")
            out.append(list(ids))
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if "messages" in record:
            if getattr(tokenizer, "chat_template", None) is None:
                raise SystemExit(
                    f"prompt {index} has 'messages' but the tokenizer at {tokenizer_path} has no chat template."
                )
            ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise SystemExit(f"prompt {index} tokenizes to nothing.")
        out.append(ids)
    return out


def load_target(path: str, device, dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return model.to(device).eval()


def load_draft(path: str, device, dtype, attention_backend: str):
    """A DFlash or DFlash 2 body from a HF draft directory (architecture read from config.json)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise SystemExit(f"{config_path} does not exist: --draft must be a HF draft directory.")
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    if "DFlash2DraftModel" in architectures:
        from megatron_dflash.variants.dflash2 import load_dflash2_checkpoint

        body = load_dflash2_checkpoint(path, attention_backend=attention_backend)
    else:
        from megatron_dflash.checkpoint import load_hf_checkpoint

        body = load_hf_checkpoint(path, attention_backend=attention_backend)
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


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    from megatron_dflash.generate import spec_generate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    records = read_prompts(args.prompts, args.limit)
    prompts = tokenize_prompts(records, args.tokenizer or args.target)
    target = load_target(args.target, device, dtype)
    draft = load_draft(args.draft, device, dtype, args.attention_backend)
    if args.ignore_eos:
        stop_tokens: list[int] = []
    elif args.stop_token_ids:
        stop_tokens = [int(t) for t in args.stop_token_ids.split(",") if t.strip()]
    else:
        stop_tokens = default_stop_tokens(target)
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)
    sample_kwargs = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

    def run_spec(batch):
        return spec_generate(
            target, draft, batch, max_new_tokens=args.max_new_tokens, stop_token_ids=stop_tokens,
            generator=generator, attention_backend=args.attention_backend, **sample_kwargs,
        )

    for _, batch in list(batches(prompts, args.batch_size))[: args.warmup]:
        run_spec([p for p in batch])
        if not args.no_baseline:
            autoregressive_greedy(target, batch, min(8, args.max_new_tokens), stop_tokens, device)

    per_prompt = []
    spec_time = 0.0
    totals = {"target_forwards": 0, "prefill_forwards": 0, "draft_forwards": 0}
    bar = progress(len(prompts), "spec_generate")
    for start, batch in batches(prompts, args.batch_size):
        _sync(device)
        began = time.perf_counter()
        out = run_spec(batch)
        _sync(device)
        spec_time += time.perf_counter() - began
        totals["target_forwards"] += out.num_target_forwards
        totals["prefill_forwards"] += out.num_prefill_forwards
        totals["draft_forwards"] += out.num_draft_forwards
        for row in range(len(batch)):
            generated = out.generated(row)
            cycles = out.acceptance_lengths[row]
            per_prompt.append(
                {
                    "index": start + row,
                    "prompt_tokens": len(batch[row]),
                    "generated_tokens": len(generated),
                    "acceptance_lengths": cycles,
                    "mean_acceptance_length": (sum(cycles) / len(cycles)) if cycles else None,
                    # Target forwards this row took part in: its prefill plus one per cycle.
                    "tokens_per_target_forward": len(generated) / (1 + len(cycles)),
                    "stopped": bool(out.stopped[row]),
                    "generated_ids": generated,
                }
            )
        bar.update(len(batch))
    bar.close()

    ar_time = None
    ar_tokens = None
    greedy_match = None
    if not args.no_baseline:
        ar_time, ar_tokens, matches = 0.0, 0, 0
        bar = progress(len(prompts), "autoregressive")
        for start, batch in batches(prompts, args.batch_size):
            _sync(device)
            began = time.perf_counter()
            generated = autoregressive_greedy(target, batch, args.max_new_tokens, stop_tokens, device)
            _sync(device)
            ar_time += time.perf_counter() - began
            for row, ids in enumerate(generated):
                ar_tokens += len(ids)
                matches += ids == per_prompt[start + row]["generated_ids"]
            bar.update(len(batch))
        bar.close()
        greedy_match = matches / len(prompts) if args.temperature == 0 else None

    all_cycles = [a for p in per_prompt for a in p["acceptance_lengths"]]
    spec_tokens = sum(p["generated_tokens"] for p in per_prompt)
    row_forwards = sum(1 + len(p["acceptance_lengths"]) for p in per_prompt)
    spec_tps = spec_tokens / spec_time if spec_time > 0 else math.nan
    summary = {
        "prompts": len(per_prompt),
        "generated_tokens": spec_tokens,
        "mean_acceptance_length": (sum(all_cycles) / len(all_cycles)) if all_cycles else None,
        "mean_of_prompt_acceptance_lengths": _mean(
            [p["mean_acceptance_length"] for p in per_prompt if p["mean_acceptance_length"] is not None]
        ),
        "tokens_per_target_forward": spec_tokens / row_forwards if row_forwards else None,
        "batched_target_forwards": totals["target_forwards"],
        "batched_prefill_forwards": totals["prefill_forwards"],
        "batched_draft_forwards": totals["draft_forwards"],
        "spec_seconds": spec_time,
        "spec_tokens_per_second": spec_tps,
    }
    if ar_time is not None:
        ar_tps = ar_tokens / ar_time if ar_time > 0 else math.nan
        summary.update(
            {
                "autoregressive_seconds": ar_time,
                "autoregressive_tokens": ar_tokens,
                "autoregressive_tokens_per_second": ar_tps,
                # Throughput ratio: robust to the two runs stopping at different lengths.
                "speedup": spec_tps / ar_tps if ar_tps and ar_tps > 0 else None,
                "greedy_outputs_identical_fraction": greedy_match,
            }
        )
    settings = {
        "target": args.target,
        "draft": args.draft,
        "draft_architecture": type(draft).__name__,
        "block_size": draft.config.block_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "batch_size": args.batch_size,
        "device": str(device),
        "dtype": dtype_name,
        "stop_token_ids": stop_tokens,
        "seed": args.seed,
    }
    return {"settings": settings, "summary": summary, "prompts": per_prompt}


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_report(report: dict) -> None:
    for p in report["prompts"]:
        print(
            f"prompt {p['index']:4d}: acceptance length {_fmt(p['mean_acceptance_length'])} "
            f"over {len(p['acceptance_lengths'])} cycles, {p['generated_tokens']} tokens, "
            f"{_fmt(p['tokens_per_target_forward'])} tokens/target forward"
        )
    s = report["summary"]
    print(f"mean acceptance length:      {_fmt(s['mean_acceptance_length'])}")
    print(f"tokens per target forward:   {_fmt(s['tokens_per_target_forward'])}")
    print(f"spec decoding:               {s['generated_tokens']} tokens in {s['spec_seconds']:.2f} s "
          f"({_fmt(s['spec_tokens_per_second'], '.1f')} tok/s)")
    if "speedup" in s:
        print(f"autoregressive greedy:       {s['autoregressive_tokens']} tokens in "
              f"{s['autoregressive_seconds']:.2f} s ({_fmt(s['autoregressive_tokens_per_second'], '.1f')} tok/s)")
        print(f"speedup (throughput):        {_fmt(s['speedup'])}x")
        if s.get("greedy_outputs_identical_fraction") is not None:
            print(f"greedy outputs identical:    {s['greedy_outputs_identical_fraction']:.0%}")


def main(argv: Optional[list[str]] = None) -> int:
    """Exit status 0, or 1 with one `error:` line for a bad model, draft or prompt (the traceback too with
    MEGATRON_DFLASH_DEBUG=1)."""
    args = parse_args(argv)
    try:
        report = evaluate(args)
    except (ValueError, OSError) as err:  # unreadable or mismatched files, bad decoding inputs
        if os.environ.get("MEGATRON_DFLASH_DEBUG", "").lower() in ("1", "true", "yes"):
            import traceback

            traceback.print_exc()
        print(f"evaluate_acceptance.py: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 1
    print_report(report)
    if args.output:
        directory = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(directory, exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"report written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
