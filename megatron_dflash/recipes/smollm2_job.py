"""The SmolLM2-135M job: `python pretrain_dflash.py --recipe smollm2-135m [--recipe-budget short|full]`.

Six stages into one run directory (`recipes/stages.py`: each resumable, a done one skipped):

    <run dir>/stages/<stage>.json   what each stage produced
    data/prompts.jsonl              (2) the seeded ShareGPT slice (`recipes/first_turns.py`)
    data/chats/                     (3) the target's answers (`decoding/regenerate.py`, resumable by shard)
    target_cache/                   (4) the target's states, when training sees each sample more than once
    train/                          (5) the training run directory (`pretrain_dflash.py`: summary.json, hf/)
    eval/mt_bench.json              (6) decode acceptance per MT-Bench category (`tools/evaluate_acceptance.py`)
    summary.json                    the headline: acceptance, tokens per target forward, lossless, serving

(1) the HF target is converted once into the user's cache (`recipes/gguf_target.py`). Training, the cache and
the evaluation run their entry points in processes of their own (`recipes/stages.run_entry_point`): the
recipes stage comes before `training/` (docs/design.md §7), and each entry point starts its own process group.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from ..common.atomic import write_file
from ..data.formats import BadRecords
from ..decoding.regenerate import Settings, regenerate
from .budgets import Budget
from .first_turns import FirstTurnFilter, write_first_turns
from .gguf_target import gguf_target_dir
from .stages import Stage, run_entry_point, run_stages

# SmolLM2's tokenizer fills all 49152 rows of its embedding, so no row is free for the MASK token
# (`training/job.py` choose_mask_token). <empty_output> marks empty Jupyter outputs in the code pretraining
# data: no chat text holds it. A tokenizer without it (the tests' tiny one) takes its last id, its rarest merge.
MASK_TOKEN = "<empty_output>"
CACHE_PAYS_ABOVE_EPOCHS = 1.5  # the cache's write costs about one pass of the target; it pays when reread


@dataclass(frozen=True)
class Inputs:
    gguf: str  # the target's GGUF
    sharegpt: str  # the chat file the prompts are sliced from
    mt_bench: str  # MT-Bench's question.jsonl
    name: str = "smollm2-135m-instruct"  # the converted target's directory in the cache
    cache_dir: Optional[str] = None  # default: the user's cache (`embedded_job/tiny_target.default_cache_dir`)
    seed: int = 1234  # the prompt slice's seed


def mask_token_id(tokenizer) -> int:
    vocab = tokenizer.get_vocab()
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else max(vocab.values())


def tap_layers(num_layers: int, count: int) -> list:
    """`count` target layers evenly from layer 1 to the third from last (published drafters: 1 to L-3), never the
    last (its output is the pre-final-norm state serving engines cannot give); fewer for a shallow target."""
    low, high = min(1, num_layers - 2), max(0, num_layers - 3)
    if count == 1 or high <= low:
        return sorted({(low + high) // 2})
    return sorted({low + round(i * (high - low) / (count - 1)) for i in range(count)})


def _target(inputs: Inputs, log) -> Callable[[dict], dict]:
    def run(_records):
        from transformers import AutoTokenizer

        target = gguf_target_dir(inputs.gguf, name=inputs.name, cache_dir=inputs.cache_dir, log=log)
        tokenizer = AutoTokenizer.from_pretrained(target)
        mask = mask_token_id(tokenizer)
        with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
            layers = json.load(f)["num_hidden_layers"]
        return {"target": target, "mask_token_id": mask, "mask_token": tokenizer.convert_ids_to_tokens(mask),
                "target_layers": layers}
    return run


def _prompts(inputs: Inputs, budget: Budget, run_dir: str, log) -> Callable[[dict], dict]:
    def run(records):
        from transformers import AutoTokenizer

        from .first_turns import length_summary

        rule = FirstTurnFilter(min_tokens=budget.prompt_min_tokens, max_tokens=budget.prompt_max_tokens)
        out = os.path.join(run_dir, "data", "prompts.jsonl")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(records["target"]["target"])
        chosen = write_first_turns(inputs.sharegpt, out, budget.prompts, tokenizer, seed=inputs.seed, rule=rule,
                                   log=log)
        return {"prompts": out, "source": inputs.sharegpt, "seed": inputs.seed, "count": len(chosen),
                "filter": rule.__dict__, "prompt_tokens": length_summary(chosen)}
    return run


def _regenerate(budget: Budget, run_dir: str) -> Callable[[dict], dict]:
    def run(records):
        target = records["target"]["target"]
        settings = Settings(max_new_tokens=budget.max_new_tokens)
        out = os.path.join(run_dir, "data", "chats")

        def backend():
            from ..decoding.local_answers import LocalAnswers

            return LocalAnswers(target, settings, batch_size=8)
        summary = regenerate(records["prompts"]["prompts"], out, backend, settings, target=target,
                             shard_size=budget.shard_size, truncated=budget.on_truncated,
                             progress_stream=sys.stdout, bad_records=BadRecords("skip"))
        written = _count_records(out)
        return {"chats": out, "records": written, "truncated_this_run": summary.truncated,
                "on_truncated": budget.on_truncated, "max_new_tokens": budget.max_new_tokens}
    return run


def _count_records(directory: str) -> int:
    from ..data.formats import read_records

    return sum(1 for _ in read_records(directory, bad_records=BadRecords("skip"), log=lambda _: None))


def train_args(budget: Budget, run_dir: str, records: dict) -> list:
    """`pretrain_dflash.py`'s flags of this job, shared by the cache writer (its manifest must match)."""
    b = budget
    return ["--target", records["target"]["target"], "--data-format", "chat",
            "--train-data", records["regenerate"]["chats"], "--seq-length", str(b.seq_length),
            "--micro-batch-size", str(b.micro_batch), "--global-batch-size", str(b.global_batch),
            "--train-iters", str(b.train_iters), "--lr", str(b.lr), "--min-lr", str(b.min_lr),
            "--dflash-num-layers", str(b.draft_layers), "--dflash-block-size", str(b.block_size),
            "--dflash-anchors-per-sample", str(b.anchors), "--dflash-target-layer-ids",
            ",".join(str(i) for i in tap_layers(records["target"]["target_layers"], b.taps)),
            "--dflash-mask-token-id", str(records["target"]["mask_token_id"]), *b.extra_train_args]


def _cache(budget: Budget, run_dir: str, log) -> Callable[[dict], dict]:
    def run(records):
        epochs = budget.epochs(records["regenerate"]["records"])
        if epochs < CACHE_PAYS_ABOVE_EPOCHS:
            log(f"[recipe] no target-state cache: training sees each sample {epochs:.1f} times, the target runs online")
            return {"cache": None, "epochs": round(epochs, 2)}
        out = os.path.join(run_dir, "target_cache")
        run_entry_point("tools/cache_target_states.py",
                        train_args(budget, run_dir, records) + ["--dflash-target-cache", out], log)
        return {"cache": out, "epochs": round(epochs, 2)}
    return run


def _train(budget: Budget, run_dir: str, log) -> Callable[[dict], dict]:
    def run(records):
        train_dir = os.path.join(run_dir, "train")
        checkpoints = os.path.join(train_dir, "checkpoints")
        cache = records["cache"]["cache"]
        argv = train_args(budget, run_dir, records) + [
            "--run-dir", train_dir, "--save", checkpoints, "--load", checkpoints,
            "--save-interval", str(max(1, budget.train_iters // 4)), "--log-interval", str(max(1, budget.train_iters // 20)),
            "--dflash-export", os.path.join(train_dir, "hf"), "--dflash-eval-prompts", "0"]
        if cache is not None:
            argv += ["--dflash-target-cache", cache]
        run_entry_point("pretrain_dflash.py", argv, log)
        return {"run_dir": train_dir, "draft": os.path.join(train_dir, "hf"),
                "train_summary": _read_json(os.path.join(train_dir, "summary.json"))}
    return run


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _evaluate(inputs: Inputs, budget: Budget, run_dir: str, log) -> Callable[[dict], dict]:
    def run(records):
        out = os.path.join(run_dir, "eval", "mt_bench.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        limit = budget.questions_per_category * len(_categories(inputs.mt_bench))
        run_entry_point("tools/evaluate_acceptance.py", evaluate_args(
            budget, records["target"]["target"], records["train"]["draft"], inputs.mt_bench, out), log)
        report = _read_json(out)
        return {"report": out, "questions": limit, "categories": report["categories"], "summary": report["summary"]}
    return run


def evaluate_args(budget: Budget, target: str, draft: str, question_file: str, output: str) -> list:
    """`tools/evaluate_acceptance.py`'s flags of this job's evaluation: MT-Bench, the budget's questions per
    category (spread over the categories), both turns, `eval_max_new_tokens` each, the report to `output`."""
    limit = budget.questions_per_category * len(_categories(question_file))
    return ["--target", target, "--draft", draft, "--benchmark", "mt-bench", "--benchmark-file", question_file,
            "--limit", str(limit), "--max-new-tokens", str(budget.eval_max_new_tokens), "--output", output]


def _categories(question_file: str) -> list:
    with open(question_file, encoding="utf-8") as f:
        return sorted({json.loads(line).get("category") for line in f if line.strip()}, key=str)


def _serving(run_dir: str) -> Callable[[dict], dict]:
    def run(records):
        from ..checkpoint.serving import check_serving

        reports = check_serving(records["train"]["draft"], records["target"]["target"])
        return {"runtimes": {r.runtime: r.verdict for r in reports}, "reports": [r.to_json() for r in reports]}
    return run


def stages(inputs: Inputs, budget: Budget, run_dir: str, log: Callable[[str], None] = print) -> list:
    return [Stage("target", _target(inputs, log)), Stage("prompts", _prompts(inputs, budget, run_dir, log)),
            Stage("regenerate", _regenerate(budget, run_dir)), Stage("cache", _cache(budget, run_dir, log)),
            Stage("train", _train(budget, run_dir, log)), Stage("evaluate", _evaluate(inputs, budget, run_dir, log)),
            Stage("serving", _serving(run_dir))]


def run_job(inputs: Inputs, budget: Budget, run_dir: str, log: Callable[[str], None] = print) -> dict:
    """Every stage (the done ones skipped), then `<run dir>/summary.json` and the headline on the console."""
    records = run_stages(run_dir, stages(inputs, budget, run_dir, log), log)
    summary = headline(records, budget)
    os.makedirs(run_dir, exist_ok=True)
    write_file(os.path.join(run_dir, "summary.json"), (json.dumps(summary, indent=2) + "\n").encode())
    from ..decoding.benchmark_report import format_category_table

    log(format_category_table(records["evaluate"]["categories"]))
    s = summary
    log(f"[recipe] {budget.name} budget: decode acceptance length {s['decode_acceptance_length']}, "
        f"tokens per target forward {s['tokens_per_target_forward']}, greedy output identical to the target's "
        f"{s['greedy_outputs_identical_fraction']}, serving {s['serving']}")
    for report in records["serving"]["reports"]:
        if report.get("command"):
            log(f"[recipe] serve with {report['runtime']} ({report['verdict']}): {report['command']}")
    log(f"[recipe] written: {os.path.join(run_dir, 'summary.json')} (stages {s['stage_seconds']:.0f}s in all)")
    return summary


def headline(records: dict, budget: Budget) -> dict:
    ev = records["evaluate"]["summary"]
    return {"recipe": "smollm2-135m", "budget": budget.__dict__ | {"extra_train_args": list(budget.extra_train_args)},
            "decode_acceptance_length": ev.get("mean_acceptance_length"),
            "tokens_per_target_forward": ev.get("tokens_per_target_forward"),
            "greedy_outputs_identical_fraction": ev.get("greedy_outputs_identical_fraction"),
            "speedup": ev.get("speedup"), "serving": records["serving"]["runtimes"],
            "stage_seconds": round(sum(r.get("seconds", 0.0) for r in records.values()), 1),
            "categories": records["evaluate"]["categories"],
            "stages": {name: {k: v for k, v in r.items() if k not in ("categories", "reports")}
                       for name, r in records.items()}}
