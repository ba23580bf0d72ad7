"""Decoding speed of the draft's forward with a KV cache against the decode-only layer copy it replaced.

Examples:
    python benchmarks/bench_decode.py                         # hidden 256, batch 4, both measurements
    python benchmarks/bench_decode.py --hidden 512 --rounds 5

`new` decodes through `DFlashBody.forward(..., kv_cache=DraftKVCache)`, the modules training runs.
`old` is the copy of the decode-only layer kept by the tests (`tests/reference_decode.py`: its
`DraftKVCache.write` + `draft_block_hidden`, and the decoding loop around them). Two measurements:

* `draft`: one decoding cycle of the draft alone (write the `W` verified slots' context into the
  cache, draft one block per row over a context of `--context` positions), the part that changed;
* `spec_generate`: whole greedy speculative decoding of `--new-tokens` per row on a random Qwen3
  target, per generated token (the target's forwards dominate; the draft is a fraction of it).

Each path runs in its own process, in alternating rounds (one thread each); the table gives the
median wall and CPU time over the rounds, the process's peak RSS, and the ratios new / old. The
machine may be shared: compare the ratios of one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAPS = [1, 3]


def _models(hidden: int, layers: int, block_size: int, vocab: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_dflash.draft.body import DFlashBody
    from megatron_dflash.draft.config import DFlashConfig

    torch.manual_seed(0)
    heads = hidden // 32
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=6,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )).eval()
    config = DFlashConfig(
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=32, vocab_size=vocab, block_size=block_size,
        mask_token_id=vocab - 1, num_target_layers=6, target_layer_ids=TAPS, max_position_embeddings=4096,
    )
    draft = DFlashBody(config, attention_backend="chunked").eval()
    return target, draft


def _draft_cycles(path: str, draft, batch: int, context: int, cycles: int) -> list[tuple[float, float]]:
    """Time `cycles` draft cycles (context write + one block per row); returns (wall, cpu) per cycle."""
    import torch

    cfg = draft.config
    W, H = cfg.block_size, cfg.hidden_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randn(batch, context, len(TAPS) * H, generator=generator)
    slabs = [torch.randn(batch, W, len(TAPS) * H, generator=generator) for _ in range(cycles + 1)]
    blocks = [torch.randn(batch, W, H, generator=generator) for _ in range(cycles + 1)]
    # Rows advance by different amounts, as they do when they accept different lengths.
    advances = [torch.randint(1, W + 1, (batch,), generator=generator) for _ in range(cycles + 1)]
    committed = torch.full((batch,), context, dtype=torch.int64)
    times = []
    with torch.inference_mode():
        if path == "old":
            from reference_decode import DraftKVCache, draft_block_hidden

            cache = DraftKVCache(draft, batch, context + 4 * W)
            cache.write(prompt, torch.zeros(batch, dtype=torch.int64))
            start = committed
            for i in range(cycles + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                if i:
                    cache.write(slabs[i], start)
                draft_block_hidden(draft, cache, blocks[i], committed, attention_backend="chunked")
                times.append((time.perf_counter() - t0, time.process_time() - c0))
                start, committed = committed, committed + advances[i]
        else:
            from megatron_dflash.draft.kv_cache import DraftKVCache
            from megatron_dflash.plan.batch_plan import DFlashBatchPlan

            cache = DraftKVCache(draft, batch, context + 4 * W)
            new_context, start = prompt, torch.zeros(batch, dtype=torch.int64)
            for i in range(cycles + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                if i:
                    new_context = slabs[i]
                positions = start[:, None] + torch.arange(new_context.shape[1])
                plan = DFlashBatchPlan.for_decoding(committed, positions, block_size=W)
                draft(new_context, blocks[i][:, None], plan, cache, "chunked")
                times.append((time.perf_counter() - t0, time.process_time() - c0))
                start, committed = committed, committed + advances[i]
    return times[1:]  # the first forward also writes the prompt: not a steady-state cycle


def child(path: str, what: str, args) -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import contextlib

    import torch

    torch.set_num_threads(1)
    target, draft = _models(args.hidden, args.layers, args.block_size, args.vocab)
    if what == "draft":
        times = _draft_cycles(path, draft, args.batch, args.context, args.cycles)
        wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        unit = 1
    else:
        from megatron_dflash.decoding.generate import spec_generate

        if path == "old":
            from reference_decode import reference_decode

            scope = reference_decode()
        else:
            scope = contextlib.nullcontext()
        generator = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, args.vocab - 1, (48 + 7 * b,), generator=generator).tolist()
                   for b in range(args.batch)]
        with scope:
            spec_generate(target, draft, prompts, max_new_tokens=4)  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            out = spec_generate(target, draft, prompts, max_new_tokens=args.new_tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        unit = int(out.num_generated.sum())
    return {"wall": wall / unit, "cpu": cpu / unit, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="draft layers")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="draft: committed context before the timed cycles")
    parser.add_argument("--cycles", type=int, default=40, help="draft: timed cycles per round")
    parser.add_argument("--new-tokens", type=int, default=64, help="spec_generate: tokens per row")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (one process per path each)")
    parser.add_argument("--what", nargs="+", default=["draft", "spec_generate"], choices=["draft", "spec_generate"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        path, what = args.child.split(":")
        print(json.dumps(child(path, what, args)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--what")]
    forwarded = [a for a in forwarded if a not in ("draft", "spec_generate")]
    print(f"{'measure':13} | {'path':4} | {'ms/unit':>8} | {'cpu ms':>8} | {'peak RSS MiB':>12} | wall ratio | cpu ratio")
    for what in args.what:
        results = {"old": [], "new": []}
        for _ in range(args.rounds):
            for path in ("old", "new"):
                out = subprocess.run([sys.executable, __file__, "--child", f"{path}:{what}", *forwarded],
                                     env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{path}:{what} failed:\n{out.stderr[-3000:]}")
                results[path].append(json.loads(out.stdout.strip().splitlines()[-1]))
        medians = {name: {key: statistics.median(r[key] for r in runs) for key in ("wall", "cpu", "rss_mib")}
                   for name, runs in results.items()}
        for name in ("old", "new"):
            m = medians[name]
            print(f"{what:13} | {name:4} | {1000 * m['wall']:8.3f} | {1000 * m['cpu']:8.3f} | {m['rss_mib']:12.0f} | "
                  f"{m['wall'] / medians['old']['wall']:10.3f} | {m['cpu'] / medians['old']['cpu']:.3f}")
    print(f"units: draft = one cycle (batch {args.batch}, context {args.context}+, block {args.block_size}); "
          f"spec_generate = one generated token. Draft: hidden {args.hidden}, {args.layers} layers.")


if __name__ == "__main__":
    main()
