"""Short chats at a long sequence length: the frozen target over real tokens only against over every padded column.

Examples:
    python benchmarks/bench_padding.py                       # 8 target layers, batch 4, --seq-length 384
    python benchmarks/bench_padding.py --layers 30 --rounds 3 --steps 4

Both sides run the training loop of `pretrain_dflash.py` on the same chat JSONL, the same target and the same
seed: the same samples, batch plans and losses (tests/training/test_frozen_target.py), only the columns the
target computes differ.

    trimmed  the target runs on each micro-batch cut after its longest real row (rounded up to 16 columns), its
             states padded back with zeros (`training.frozen_target.FrozenTarget`; docs/design.md §8 Data path,
             "Real tokens only");
    padded   the target runs on all ``--seq-length`` columns, as it did before (the cut disabled in the worker).

The target is a randomly initialised Qwen3 of SmolLM2-135M's layer shape (hidden 576, 9 heads and 3 KV heads of
64, MLP 1536; ``--layers`` of them, 8 by default so a CPU round stays short) over the embedded tiny target's
tokenizer and chat template (a 320-token vocabulary: the LM head's cost is not the point here). The chats are
short as real first turns are: a prompt of about 52 tokens (lognormal) and an answer of 64 to 129 tokens, so a
row holds about 180 real tokens at the median and ``--seq-length`` 384 is mostly padding; the draft has 1 layer,
block 8, 16 anchors per row.

Every (side, round) runs in its own fresh process and the rounds alternate which side goes first. Reported per
side: the median over the timed steps (after ``--warmup`` steps) of the target's forward time per micro-batch and
of the whole optimizer step (wall time; CPU time of the process too, steadier on a shared machine), the median
real tokens per row and the columns the target ran; ratios are padded / trimmed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="target decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--seq-length", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--chats", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (one process per side per round)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["trimmed", "padded"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_target(out: str, layers: int) -> str:
    """A random-weight Qwen3 target of SmolLM2-135M's layer shape over the tiny target's tokenizer."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = ROOT / "megatron_dflash" / "assets" / "tiny_target"
    target = os.path.join(out, "target")
    os.makedirs(target, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny / name, os.path.join(target, name))
    base = json.loads((tiny / "config.json").read_text())
    config = Qwen3Config(vocab_size=base["vocab_size"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=base["pad_token_id"],
                         eos_token_id=base["eos_token_id"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # save_pretrained keeps them
        shutil.copy(tiny / name, os.path.join(target, name))
    return target


def write_chats(path: str, count: int) -> None:
    """Short first turns: a prompt of ~52 tokens (lognormal, 8..300) and an answer of 64..129 tokens (half of them
    at the 129-token generation budget)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = max(8, min(300, round(rng.lognormvariate(3.95, 0.5))))
            answer = min(129, rng.randint(64, 200))  # half cut at the 129-token budget, as regenerated answers
            words = lambda n: " ".join(str(rng.randrange(300)) for _ in range(n))  # noqa: E731
            f.write(json.dumps({"messages": [{"role": "user", "content": words(prompt)},
                                             {"role": "assistant", "content": words(answer)}]}) + "\n")


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from megatron_dflash.training import frozen_target
    from megatron_dflash.training.loop import run

    if args.worker == "padded":
        frozen_target.real_length = lambda document_ids, multiple=1: document_ids.shape[1]
    target_s, target_cpu_s, columns, real, marks = [], [], [], [], []
    call = frozen_target.FrozenTarget.__call__

    def timed(self, batch):
        t0, c0 = time.perf_counter(), time.process_time()
        out = call(self, batch)
        target_s.append(time.perf_counter() - t0)
        target_cpu_s.append(time.process_time() - c0)
        real.extend((batch["document_ids"] >= 0).sum(dim=1).tolist())
        columns.append(frozen_target.real_length(batch["document_ids"], self.trim_multiple))
        return out

    frozen_target.FrozenTarget.__call__ = timed

    def on_step(iteration, values, body):
        marks.append((time.perf_counter(), time.process_time(), len(target_s)))

    steps = args.warmup + args.steps
    work = Path(args.workdir)
    out = tempfile.mkdtemp(dir=work)
    argv = ["--target", str(work / "target"), "--train-data", str(work / "chats.jsonl"), "--data-format", "chat",
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.micro_batch_size), "--train-iters", str(steps),
            "--dflash-num-layers", "1", "--dflash-block-size", "8", "--dflash-anchors-per-sample", "16",
            "--dflash-eval-prompts", "0", "--no-progress-bar", "--log-interval", "1",
            "--lr", "1e-4", "--run-dir", out, "--dflash-export", os.path.join(out, "hf")]
    run(argv, hooks={"on_step": on_step})
    first = args.warmup - 1  # the mark after the last warm-up step
    step_s = [b[0] - a[0] for a, b in zip(marks[first:], marks[first + 1:])]
    cpu_s = [b[1] - a[1] for a, b in zip(marks[first:], marks[first + 1:])]
    timed_target = target_s[marks[first][2]:]
    return {"target_s": statistics.median(timed_target),
            "target_cpu_s": statistics.median(target_cpu_s[marks[first][2]:]), "step_s": statistics.median(step_s),
            "step_cpu_s": statistics.median(cpu_s), "real": statistics.median(real),
            "columns": statistics.median(columns[marks[first][2]:])}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    work = tempfile.mkdtemp(prefix="bench-padding-")
    build_target(work, args.layers)
    write_chats(os.path.join(work, "chats.jsonl"), args.chats)
    results = {"trimmed": [], "padded": []}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for r in range(args.rounds):
        order = ["trimmed", "padded"] if r % 2 == 0 else ["padded", "trimmed"]
        for side in order:
            cmd = [sys.executable, __file__, "--worker", side, "--workdir", work,
                   *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                     ("layers", "seq_length", "micro_batch_size", "steps", "warmup", "threads")]]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"worker {side} failed:\n{proc.stderr[-3000:]}")
            results[side].append(json.loads(line[-1][7:]))
            print(f"round {r} {side}: {results[side][-1]}", flush=True)
    med = {side: {k: statistics.median(v[k] for v in runs) for k in runs[0]} for side, runs in results.items()}
    print(f"\ntarget {args.layers} layers x (576 hidden, 9/3 heads), batch {args.micro_batch_size} x "
          f"--seq-length {args.seq_length}, median real tokens per row {med['trimmed']['real']:.0f}, "
          f"{args.threads} threads, {args.rounds} rounds x {args.steps} steps")
    print(f"{'side':8} {'columns':>8} {'target ms':>10} {'target CPU ms':>14} {'step ms':>9} {'step CPU ms':>12}")
    for side in ("padded", "trimmed"):
        m = med[side]
        print(f"{side:8} {m['columns']:8.0f} {1e3 * m['target_s']:10.1f} {1e3 * m['target_cpu_s']:14.1f} "
              f"{1e3 * m['step_s']:9.1f} {1e3 * m['step_cpu_s']:12.1f}")
    p, t = med["padded"], med["trimmed"]
    print(f"ratio padded/trimmed: target {p['target_s'] / t['target_s']:.2f}x (CPU "
          f"{p['target_cpu_s'] / t['target_cpu_s']:.2f}x), step {p['step_s'] / t['step_s']:.2f}x "
          f"(CPU {p['step_cpu_s'] / t['step_cpu_s']:.2f}x)")


if __name__ == "__main__":
    main()
