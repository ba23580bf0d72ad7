"""Draft quality side by side: our trainer and NeMo AutoModel 0.7.0's `DFlashTrainerModule`, same data, same budget.

Examples:
    python pretrain_dflash.py --recipe smollm2-135m --run-dir runs/smollm2     # the data, cache and target
    python benchmarks/bench_quality.py --run-dir runs/smollm2                  # 2 seeds per side, the short budget
    python benchmarks/bench_quality.py --run-dir runs/smollm2 --seeds 3 --train-iters 200 --output quality.json

It reads what the SmolLM2 job (`recipes/smollm2_job.py`) left in ``--run-dir``: the converted target, the
regenerated chats and the target-state cache (written here when the job had none). For every seed, each side
trains one draft in a process of its own (the sides' order alternates from seed to seed) and the same decoder
then measures both (`tools/evaluate_acceptance.py`, MT-Bench, the budget's questions per category, both turns,
greedy: lossless by construction, so acceptance is the only difference).

    ours  `pretrain_dflash.py` with the job's own flags (`smollm2_job.train_args`) and ``--seed``.
    nemo  NeMo's `Qwen3DFlashDraftModel` (its config built from the target's as its recipe builds it: the draft
          has the target's attention shape) inside `DFlashTrainerModule` (its anchor sampling, its per-micro-batch
          decay-weighted mean loss), on the taps our cache holds for the same tokens (the same tap convention:
          layer ``i`` is HF ``hidden_states[i + 1]``), SDPA with its dense block mask (its flex-attention path
          has no CPU backward), over the target's frozen embedding and LM head.

Held equal: the draft's depth and shape, block size, anchors per sample, loss-decay gamma (ours as resolved for
the block), micro and global batch (gradient accumulation, each micro-batch's mean over the accumulation count),
AdamW (betas, eps, weight decay on matrices only), gradient clipping at 1.0 and the learning-rate schedule
(megatron's `OptimizerParamScheduler` through `training.optim.build_scheduler`, stepped once per optimizer step).
What is each side's own: the weights' initialisation, the anchor rule (ours: the deterministic plan; NeMo's:
random anchors per micro-batch), the loss's normalisation (ours: over the global batch's supervised tokens;
NeMo's: per micro-batch) and the data order (each side shuffles per epoch with the seed).

Printed: decode acceptance length per MT-Bench category, each side's mean over the seeds with its half-range
(half the spread between the seeds), and each training's wall-clock and CPU time and peak resident memory
(`os.wait4` of its process), with the ratios nemo/ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("ours", "nemo")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="a SmolLM2 job's run directory (target, regenerate stages done)")
    p.add_argument("--budget", default="short",
                   help="the job's budget whose training settings both sides use: a name, or a JSON file of its fields")
    p.add_argument("--seeds", type=int, default=2, help="seeds per side (1, 2, ...)")
    p.add_argument("--train-iters", type=int, default=None, help="optimizer steps (default: the budget's)")
    p.add_argument("--questions-per-category", type=int, default=None, help="MT-Bench questions per category")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per evaluated turn")
    p.add_argument("--mt-bench", default=None, help="MT-Bench question.jsonl (default: the installed package's)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--work-dir", default=None, help="default: <run-dir>/bench_quality")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    p.add_argument("--worker", choices=("nemo",), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    return p


def _budget(args):
    """The named budget (`recipes.budgets.BUDGETS`) or one read from a JSON file of `Budget`'s fields, with the
    command line's changes."""
    from megatron_dflash.recipes.budgets import BUDGETS, Budget

    if os.path.isfile(args.budget):
        with open(args.budget, encoding="utf-8") as f:
            fields = json.load(f)
        try:
            budget = Budget(**{**fields, "extra_train_args": tuple(fields.get("extra_train_args", ()))})
        except TypeError as err:
            raise SystemExit(f"bench_quality: --budget {args.budget}: {err}; give the fields of "
                             "recipes.budgets.Budget.") from None
    elif args.budget in BUDGETS:
        budget = BUDGETS[args.budget]
    else:
        raise SystemExit(f"bench_quality: no budget {args.budget!r}; use one of {', '.join(BUDGETS)} or a JSON "
                         "file of recipes.budgets.Budget's fields.")
    changes = {name: value for name, value in (("train_iters", args.train_iters),
                                               ("questions_per_category", args.questions_per_category),
                                               ("eval_max_new_tokens", args.max_new_tokens)) if value is not None}
    return dataclasses.replace(budget, **changes)


def _records(run_dir: str) -> dict:
    from megatron_dflash.recipes.stages import read_record

    records = {name: read_record(run_dir, name) for name in ("target", "regenerate", "cache")}
    missing = [name for name in ("target", "regenerate") if records[name] is None]
    if missing:
        raise SystemExit(f"bench_quality: {run_dir} has no finished {' and '.join(missing)} stage; run "
                         f"`python pretrain_dflash.py --recipe smollm2-135m --run-dir {run_dir}` first (its stages "
                         "through regenerate are the data both sides train on).")
    return records


def _train_argv(budget, run_dir: str, records: dict, cache: str, seed: int) -> list:
    from megatron_dflash.recipes.smollm2_job import train_args

    return train_args(budget, run_dir, records) + ["--dflash-target-cache", cache, "--seed", str(seed)]


def _ensure_cache(budget, run_dir: str, records: dict, work: str, log) -> str:
    """The job's cache when it wrote one (its flags are the ones both sides train with), else one written here."""
    from megatron_dflash.recipes.smollm2_job import train_args
    from megatron_dflash.recipes.stages import run_entry_point

    cache = (records.get("cache") or {}).get("cache")
    if cache and os.path.isfile(os.path.join(cache, "index.json")):
        return cache
    cache = os.path.join(work, "target_cache")
    if not os.path.isfile(os.path.join(cache, "index.json")):
        run_entry_point("tools/cache_target_states.py", train_args(budget, run_dir, records)
                        + ["--dflash-target-cache", cache], log)
    return cache


def _timed(command: list, log) -> dict:
    """Run `command`; its wall-clock, CPU seconds (user + system, its children included) and peak RSS (MiB)."""
    log(f"[bench_quality] $ {' '.join(command[1:])}")
    sys.stdout.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=str(ROOT))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"bench_quality: {command[1]} exited with status {code}; its lines above say why.")
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def _train(side: str, seed: int, budget, budget_arg: str, run_dir: str, records: dict, cache: str, out: str,
           log) -> dict:
    os.makedirs(out, exist_ok=True)
    argv = _train_argv(budget, run_dir, records, cache, seed)
    if side == "ours":
        command = [sys.executable, str(ROOT / "pretrain_dflash.py"), *argv, "--run-dir", out,
                   "--dflash-export", os.path.join(out, "hf"), "--dflash-eval-prompts", "0",
                   "--log-interval", str(max(1, budget.train_iters // 10))]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "nemo", "--run-dir", run_dir,
                   "--budget", budget_arg, "--train-iters", str(budget.train_iters), "--seed", str(seed),
                   "--out", out, "--cache", cache]
    timing = _timed(command, log)
    return {"draft": os.path.join(out, "hf"), **timing}


def _evaluate(draft: str, target: str, budget, question_file: str, out: str, log) -> dict:
    """The job's own evaluation (`smollm2_job.evaluate_args`) of `draft`; its report."""
    from megatron_dflash.recipes.smollm2_job import evaluate_args
    from megatron_dflash.recipes.stages import run_entry_point

    report = os.path.join(out, "mt_bench.json")
    run_entry_point("tools/evaluate_acceptance.py", evaluate_args(budget, target, draft, question_file, report), log)
    with open(report, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ NeMo's side


def _nemo_worker(args) -> None:
    import torch
    from transformers import AutoConfig

    from megatron_dflash.training.arguments import parse_args
    from megatron_dflash.training.datasets import build_datasets
    from megatron_dflash.training.job import prepare_job
    from megatron_dflash.training.optim import build_scheduler
    from megatron_dflash.target.frozen_heads import load_frozen_heads
    from megatron_dflash.training.target_cache import open_cache_reader

    from bench_step import _import_nemo

    budget, records = _budget(args), _records(args.run_dir)
    job = prepare_job(parse_args(_train_argv(budget, args.run_dir, records, args.cache, args.seed)), world_size=1,
                      log=lambda _: None)
    train_ds, valid_ds = build_datasets(job)
    reader = open_cache_reader(job, train_ds, valid_ds)
    DFlashTrainerModule, Qwen3DFlashDraftModel, build_draft_config, _ = _import_nemo()
    from nemo_automodel.components.speculative.dflash.core import NoValidAnchorsError

    draft_args = job.draft_config
    target_config = AutoConfig.from_pretrained(job.target_dir)
    torch.manual_seed(args.seed)
    config = build_draft_config(
        target_config, num_draft_layers=budget.draft_layers, num_target_layers=int(target_config.num_hidden_layers),
        block_size=budget.block_size, attention_backend="sdpa",
        dflash_config={"block_size": budget.block_size, "mask_token_id": draft_args.mask_token_id,
                       "target_layer_ids": list(draft_args.target_layer_ids)})
    config.is_causal = False  # what NeMo's recipe writes: a plain DFlash draft attends both ways in its block
    config.tie_word_embeddings = False  # the draft holds no embedding of its own
    draft = Qwen3DFlashDraftModel(config).train()
    # The target's frozen embedding and LM head as our trainer reads them (one tensor when tied), plain modules.
    tied = bool(job.target_text_config.get("tie_word_embeddings", job.target_config.get("tie_word_embeddings")))
    heads = load_frozen_heads(job.target_dir, draft_args, torch.float32, None, tied=tied, vocab_parallel=False)
    embed, head = heads.embedding, heads.head.layer
    trainer = DFlashTrainerModule(draft, head, embed, mask_token_id=draft_args.mask_token_id,
                                  block_size=budget.block_size, attention_backend="sdpa",
                                  num_anchors=budget.anchors, loss_decay_gamma=job.decay_gamma)
    a = job.args
    matrices = [p for p in draft.parameters() if p.requires_grad and p.dim() > 1]
    vectors = [p for p in draft.parameters() if p.requires_grad and p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": matrices}, {"params": vectors, "wd_mult": 0.0}], lr=a.lr,
                                  betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, weight_decay=a.weight_decay)
    scheduler = build_scheduler(optimizer, a)  # sets every group's lr and weight decay (no decay: wd_mult 0)
    micro, accumulation = budget.micro_batch, budget.global_batch // budget.micro_batch

    def micro_batches():
        epoch = 0
        while True:
            order = list(range(len(train_ds)))
            random.Random(args.seed * 1_000_003 + epoch).shuffle(order)
            for i in range(0, len(order) - micro + 1, micro):
                yield [train_ds[j] for j in order[i:i + micro]]
            epoch += 1

    def collate(samples):
        """Padded to the longest row: ``input_ids``, ``loss_mask`` ``[B, S]``; taps ``[B, S, T*H]`` (zeros on padding)."""
        rows = [reader.sample(s.sample_id) for s in samples]
        S = max(ids.shape[0] for ids, _, _ in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.long)
        taps = torch.zeros(len(rows), S, rows[0][1].shape[-1])
        for b, ((row_ids, row_taps, _), sample) in enumerate(zip(rows, samples)):
            n = row_ids.shape[0]
            if not torch.equal(row_ids, sample.input_ids[:n]):
                raise SystemExit(f"bench_quality: sample {sample.sample_id}: the cache holds other tokens; "
                                 "write the cache again for this data.")
            ids[b, :n], taps[b, :n], mask[b, :n] = row_ids, row_taps.float(), sample.loss_mask[:n].long()
        return ids, taps, mask

    stream, skipped, log_every = micro_batches(), 0, max(1, budget.train_iters // 10)
    start = time.perf_counter()
    for step in range(1, budget.train_iters + 1):
        losses, accuracies = [], []
        for _ in range(accumulation):
            ids, taps, mask = collate(next(stream))
            try:
                metrics = trainer(ids, taps, mask)
            except NoValidAnchorsError:
                skipped += 1  # no block fits this micro-batch's answers: NeMo's recipe skips it too
                continue
            (metrics.loss / accumulation).backward()
            losses.append(float(metrics.loss.detach()))
            accuracies.append(float(metrics.accuracy))
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), a.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step(1)
        if step % log_every == 0 or step == budget.train_iters:
            print(f"[nemo] step {step}/{budget.train_iters} loss {_mean(losses):.4f} accuracy {_mean(accuracies):.4f} "
                  f"grad norm {float(grad_norm):.3f} lr {optimizer.param_groups[0]['lr']:.3e} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    if skipped:
        print(f"[nemo] {skipped} micro-batches without a valid anchor skipped", flush=True)
    draft.save_pretrained(os.path.join(args.out, "hf"), safe_serialization=True)


# ------------------------------------------------------------------------------------------------ the report


def _acceptance_by_row(report: dict) -> dict:
    """{category or "all": decode acceptance length} of one evaluation."""
    rows = {}
    for line in report["categories"]:
        if line.get("kind") == "category":
            rows[line["category"]] = line["acceptance_length"]
        elif line.get("kind") == "set":
            rows["all"] = line["acceptance_length"]
    return rows


def _mean(values: list) -> float:
    return sum(values) / max(1, len(values))


def _mean_and_half_range(values: list) -> tuple:
    return _mean(values), (max(values) - min(values)) / 2


def format_table(results: dict, seeds: list) -> str:
    """Acceptance per category: each side's seeds, mean ± half-range; then each side's training cost."""
    sides = [s for s in SIDES if s in results]
    first = results[sides[0]][seeds[0]]["acceptance"]
    rows = [r for r in first if r != "all"] + ["all"]
    head = "| category | " + " | ".join(f"{side} seed {seed}" for side in sides for seed in seeds) + " | " + \
        " | ".join(f"{side} mean ± half-range" for side in sides) + " |"
    lines = [head, "|" + "---|" * (1 + len(sides) * (len(seeds) + 1))]
    for row in rows:
        cells = [f"{results[side][seed]['acceptance'][row]:.3f}" for side in sides for seed in seeds]
        for side in sides:
            mean, half = _mean_and_half_range([results[side][seed]["acceptance"][row] for seed in seeds])
            cells.append(f"{mean:.3f} ± {half:.3f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += ["", "| training | wall-clock s | CPU s | peak RSS MiB |", "|---|---|---|---|"]
    means = {}
    for side in sides:
        means[side] = {k: sum(results[side][s]["train"][k] for s in seeds) / len(seeds)
                       for k in ("wall_s", "cpu_s", "peak_rss_mib")}
        m = means[side]
        lines.append(f"| {side} (mean of {len(seeds)}) | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['peak_rss_mib']:.0f} |")
    if len(sides) == 2:
        ratio = {k: means["nemo"][k] / means["ours"][k] for k in means["ours"]}
        lines.append(f"| nemo / ours | {ratio['wall_s']:.2f}x | {ratio['cpu_s']:.2f}x | {ratio['peak_rss_mib']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.worker == "nemo":
        _nemo_worker(args)
        return {}
    if args.seeds < 1:
        raise SystemExit(f"bench_quality: --seeds must be at least 1, got {args.seeds}.")
    from megatron_dflash.recipes.smollm2 import mt_bench_question_file

    budget, records = _budget(args), _records(args.run_dir)
    question_file = args.mt_bench or mt_bench_question_file()
    if "nemo" in args.sides:
        from bench_step import _import_nemo

        try:
            _import_nemo()
        except ImportError as err:
            raise SystemExit(f"bench_quality: NeMo AutoModel is not importable ({err}); install the set-up's "
                             "nemo_automodel, or pass --sides ours.") from None
    work = args.work_dir or os.path.join(args.run_dir, "bench_quality")
    os.makedirs(work, exist_ok=True)
    cache = _ensure_cache(budget, args.run_dir, records, work, print)
    seeds = list(range(1, args.seeds + 1))
    results: dict = {side: {} for side in args.sides}
    for seed in seeds:
        order = args.sides if seed % 2 else list(reversed(args.sides))  # alternate who trains first
        for side in order:
            out = os.path.join(work, f"{side}-seed{seed}")
            train = _train(side, seed, budget, args.budget, args.run_dir, records, cache, out, print)
            report = _evaluate(train["draft"], records["target"]["target"], budget, question_file, out, print)
            results[side][seed] = {"train": train, "acceptance": _acceptance_by_row(report),
                                   "greedy_outputs_identical_fraction":
                                       report["summary"].get("greedy_outputs_identical_fraction")}
    table = format_table(results, seeds)
    print(table)
    payload = {"budget": dataclasses.asdict(budget), "seeds": seeds, "results": results, "table": table}
    if args.output:
        from megatron_dflash.common.atomic import write_file

        write_file(args.output, (json.dumps(payload, indent=2) + "\n").encode())
    return payload


if __name__ == "__main__":
    main()
