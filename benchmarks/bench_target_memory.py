"""Host memory of the MoE target conversion, and parameter bytes per rank under expert parallelism.

Examples:
    python benchmarks/bench_target_memory.py                       # a ~2 GB, bf16 Qwen3-MoE checkpoint in 8 shards
    python benchmarks/bench_target_memory.py --size-gb 0.5 --rounds 1

A Qwen3-MoE checkpoint (HF names and shapes, bf16, ``--shards`` safetensors files with an index) is written
into a temporary directory (or ``--dir``); the values are constant, only sizes matter. Every measurement then
runs in a fresh Python process (imports done, baseline RSS taken, then the conversion), in alternating
rounds, and reports the high-water RSS above the baseline (``ru_maxrss``; it includes the pages of the mmapped
shard files that were touched and are still mapped):

    stream   ``target.megatron.weights.stream_with_plan``, the production loader: shard by shard, each converted tensor
             handed on (here: dropped, as after its copy into a device parameter) before the next is read.
    lazy     one lazy mapping over every shard (all files mapped at once), the rank's whole converted state dict
             built, then dropped: what the converter did before the streaming loader.
    dict     the naive reference: every shard read into one state dict (``safetensors.torch.load_file``), then
             converted.

and, from the same plan, the bytes of parameters each rank loads at EP=1 and EP=2 (rank 0 and 1; TP=PP=1).
The plan names exactly the model's state dict (checked by ``load_plan_into`` when building), so these are the
per-rank parameter bytes of the target. Ratios are against the checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)

GIB = 2**30
MIB = 2**20


def moe_config(size_gb: float) -> dict:
    """A Qwen3-MoE config (hidden 1024, 64 experts of 384, vocab 32k) with as many layers as fill ``size_gb``."""
    hidden, experts, moe_inter, vocab, heads, kv, hd = 1024, 64, 384, 32000, 16, 4, 64
    per_layer = 2 * (experts * 3 * hidden * moe_inter + experts * hidden + (heads + 2 * kv) * hd * hidden
                     + heads * hd * hidden + 2 * hidden + 2 * hd)
    layers = max(2, round((size_gb * GIB - 2 * 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "moe_intermediate_size": moe_inter, "num_experts": experts,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }


def hf_shapes(cfg: dict) -> dict:
    h, e, i, v = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (cfg["head_dim"],), p + "self_attn.k_norm.weight": (cfg["head_dim"],),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate.weight": (e, h),
        })
        for x in range(e):
            shapes.update({p + f"mlp.experts.{x}.gate_proj.weight": (i, h), p + f"mlp.experts.{x}.up_proj.weight": (i, h),
                           p + f"mlp.experts.{x}.down_proj.weight": (h, i)})
    return shapes


def write_checkpoint(directory: str, size_gb: float, shards: int) -> int:
    """Write config, index and ``shards`` bf16 safetensors files; returns the checkpoint's tensor bytes."""
    import torch
    from safetensors.torch import save_file

    cfg = moe_config(size_gb)
    shapes = hf_shapes(cfg)
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    budget = total / shards
    weight_map, batch, used, index = {}, {}, 0, 0

    def flush():
        nonlocal batch, used, index
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(batch, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in batch})
        batch, used, index = {}, 0, index + 1

    for key, shape in shapes.items():
        batch[key] = torch.full(shape, 0.01, dtype=torch.bfloat16)
        used += 2 * torch.Size(shape).numel()
        if used >= budget and index < shards - 1:
            flush()
    flush()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(mode: str, directory: str, ep_rank: int, ep_size: int) -> dict:
    """One measurement in this (fresh) process."""
    import torch  # noqa: F401  (imported before the baseline)
    from safetensors.torch import load_file

    from megatron_dflash.common.safetensors_files import target_safetensors_files
    from megatron_dflash.target.megatron.config import hf_target_spec
    from megatron_dflash.target.megatron.weights import (
        checked_weight_plan,
        convert_with_plan,
        load_hf_state_dict,
        stream_with_plan,
    )

    spec = hf_target_spec(directory)
    plan = checked_weight_plan(spec, 0, 1, layer_offset=0, num_layers=None, pre_process=True, post_process=True,
                               padded_vocab=None, make_vocab_size_divisible_by=128, ep_rank=ep_rank,
                               ep_size=ep_size, etp_rank=None, etp_size=None)
    files = target_safetensors_files(directory)
    base = _rss()
    loaded = 0
    if mode == "stream":
        for _, tensor in stream_with_plan(plan, files, spec.model_type):
            loaded += tensor.numel() * tensor.element_size()
            del tensor
    elif mode == "lazy":
        state = convert_with_plan(plan, load_hf_state_dict(directory), spec.model_type)
        loaded = sum(t.numel() * t.element_size() for t in state.values())
        del state
    elif mode == "dict":
        hf = {}
        for path in files:
            hf.update(load_file(path))
        state = convert_with_plan(plan, hf, spec.model_type)
        loaded = sum(t.numel() * t.element_size() for t in state.values())
        del state, hf
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_above_baseline": peak - base, "loaded_bytes": loaded,
            "largest_shard": max(os.path.getsize(p) for p in files)}


def run_child(mode: str, directory: str, ep_rank: int = 0, ep_size: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", directory, "--ep-rank", str(ep_rank),
           "--ep-size", str(ep_size)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["stream", "lazy", "dict"], choices=["stream", "lazy", "dict"])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ep-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ep-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.ep_rank, args.ep_size)))
        return
    with tempfile.TemporaryDirectory(prefix="moe-ckpt-") as tmp:
        directory = args.dir or tmp
        if not os.path.isfile(os.path.join(directory, "model.safetensors.index.json")):
            total = write_checkpoint(directory, args.size_gb, args.shards)
        else:
            with open(os.path.join(directory, "model.safetensors.index.json")) as f:
                total = json.load(f)["metadata"]["total_size"]
        print(f"checkpoint: {total / GIB:.2f} GiB of tensors in {args.shards} shards ({directory})")
        peaks = {m: [] for m in args.modes}
        info = {}
        for _ in range(args.rounds):  # alternate the modes within each round
            for mode in args.modes:
                result = run_child(mode, directory)
                peaks[mode].append(result["peak_above_baseline"])
                info = result
        print(f"largest shard: {info['largest_shard'] / MIB:.0f} MiB")
        print(f"{'mode':8s} {'peak host RSS above baseline (MiB)':>36s} {'/ checkpoint':>14s} {'/ largest shard':>16s}")
        for mode, values in peaks.items():
            peak = min(values)
            print(f"{mode:8s} {peak / MIB:36.0f} {peak / total:14.2f} {peak / info['largest_shard']:16.2f}"
                  f"   (rounds: {', '.join(f'{v / MIB:.0f}' for v in values)})")
        ep1 = run_child("stream", directory, 0, 1)["loaded_bytes"]
        ep2 = [run_child("stream", directory, r, 2)["loaded_bytes"] for r in range(2)]
        print(f"parameter bytes per rank (TP=PP=1): EP=1 {ep1 / MIB:.0f} MiB; EP=2 rank 0 {ep2[0] / MIB:.0f} MiB, "
              f"rank 1 {ep2[1] / MIB:.0f} MiB; EP=2 / EP=1 = {ep2[0] / ep1:.3f}")


if __name__ == "__main__":
    main()
