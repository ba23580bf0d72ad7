"""Optimizer-step cost of the training engine: `MegatronEngine` (megatron-core DDP + optimizer) against
the plain-torch reference engine of the tests (`tests/reference_engine.py`, the same semantics).

Examples:
    python benchmarks/bench_engine.py                       # hidden 512, 4 layers, fp32 and bf16
    python benchmarks/bench_engine.py --hidden 1024 --rounds 5

What is timed: one optimizer step's engine work on a draft body whose gradients are already there,
`zero_grad()` excluded: `finish_grads` (the gradient buffer scaled by the global weight) and `step`
(grad norm, clip, Adam over fp32 main weights, scheduler). Forward and backward are the same for both
engines and left out. On CPU, `MegatronEngine` runs under `device_shim.cuda_on_cpu()`.

Each engine runs in its own process (one rank, gloo), in alternating rounds; the table gives the median
per-step wall and CPU time over the rounds, the process's peak RSS, and the ratios megatron / reference.
The machine may be shared: compare the ratios of one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _engine_args(bf16: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        lr=1e-3, min_lr=1e-5, lr_warmup_iters=2, lr_decay_iters=1000, lr_decay_style="cosine", weight_decay=0.01,
        train_iters=1000, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=bf16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_distributed_optimizer=False,
    )


def child(engine_name: str, hidden: int, layers: int, bf16: bool, steps: int) -> dict:
    """One process: build the body and the engine, fill the gradients once, time `steps` engine steps."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dflash.draft.body import DFlashBody, default_parallel_config
    from megatron_dflash.draft.config import DFlashConfig

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-engine-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = DFlashConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8, vocab_size=1000,
                          block_size=8, mask_token_id=3, num_target_layers=12, target_layer_ids=[1, 5, 9])
    torch.manual_seed(0)
    body = DFlashBody(config, default_parallel_config(params_dtype=dtype, bf16=bf16))
    args = _engine_args(bf16)
    if engine_name == "megatron":
        from megatron_dflash.training.optim import build_engine

        engine = build_engine(body, args, config, use_cuda=False)
    else:
        from reference_engine import build_reference_engine

        engine = build_reference_engine(body, args, config, use_cuda=False)
    engine.zero_grad()
    params = [p for p in body.parameters() if p.requires_grad]
    weight = torch.tensor(1000.0)
    wall, cpu = [], []
    for _ in range(steps + 1):  # the first step (allocations, lazy state) is not timed
        with torch.no_grad():
            for p in params:
                p.main_grad.copy_(torch.randn_like(p.main_grad))
        t0, c0 = time.perf_counter(), time.process_time()
        engine.finish_grads(weight)
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"wall": statistics.median(wall[1:]), "cpu": statistics.median(cpu[1:]),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params": sum(p.numel() for p in params)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed engine steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (one process per engine each)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        engine_name, bf16 = args.child.split(":")
        print(json.dumps(child(engine_name, args.hidden, args.layers, bf16 == "bf16", args.steps)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"{'precision':9} | {'engine':9} | {'ms/step':>8} | {'cpu ms':>8} | {'peak RSS MiB':>12} | wall ratio | cpu ratio")
    for precision in args.precision:
        results = {"megatron": [], "reference": []}
        for _ in range(args.rounds):
            for engine_name in ("reference", "megatron"):
                out = subprocess.run([sys.executable, __file__, "--child", f"{engine_name}:{precision}",
                                      "--hidden", str(args.hidden), "--layers", str(args.layers),
                                      "--steps", str(args.steps)], env=env, capture_output=True, text=True, check=True)
                results[engine_name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        medians = {name: {key: statistics.median(r[key] for r in runs) for key in ("wall", "cpu", "rss_mib")}
                   for name, runs in results.items()}
        for name in ("reference", "megatron"):
            m = medians[name]
            ratio = m["wall"] / medians["reference"]["wall"]
            cpu_ratio = m["cpu"] / medians["reference"]["cpu"]
            print(f"{precision:9} | {name:9} | {1000 * m['wall']:8.2f} | {1000 * m['cpu']:8.2f} | "
                  f"{m['rss_mib']:12.0f} | {ratio:10.2f} | {cpu_ratio:.2f}")
    print(f"body: hidden {args.hidden}, {args.layers} layers, {results['megatron'][0]['params'] / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
