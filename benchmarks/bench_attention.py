"""Block attention: chunked (production) path against the dense reference, forward + backward.

Examples:
    python benchmarks/bench_attention.py                              # full sweep S x N
    python benchmarks/bench_attention.py --seq 1024 --anchors 64 256  # a subset
    python benchmarks/bench_attention.py --device cuda --dtype bfloat16 --impls chunked dense sdpa flex

Implementations:
    chunked  block_attention(backend="chunked"): context + in-block parts merged by log-sum-exp, chunked over
             blocks under activation checkpointing.
    dense    block_attention(backend="dense"): the test oracle, fp32 softmax with the additive
             [B, 1, N*W, S+N*W] mask.
    sdpa     the reference formulation of published drafters: scaled_dot_product_attention over
             [context keys, all block keys] with the same additive mask.
    flex     block_attention(backend="flex") (CUDA only: FlexAttention has no CPU backward).

Time: median of ``--repeats`` forward+backward passes after ``--warmup`` passes; wall time by default,
or this process's CPU time with ``--timer cpu`` (steadier when other jobs share the CPU; with T threads it
is up to T times the wall time).
Peak memory: bytes allocated beyond what was live before the pass (inputs), at the high-water mark of one
forward+backward. On CUDA this is ``torch.cuda.max_memory_allocated``; on CPU it is computed from the
allocation and free events that torch's CPU allocator reports to the profiler (``profile_memory=True``),
which counts exactly the tensors torch allocates (RSS would also count allocator caching and other
processes' noise). Ratios are <impl>/chunked, so a ratio of 10 means chunked is 10x faster or smaller.

Dense configurations whose estimated footprint exceeds ``--max-dense-gib`` are skipped and reported as
such (``dense``: mask plus four score-sized fp32 tensors: scores, probabilities, and their gradients;
``sdpa``: twice the mask, its fused kernels do not materialise scores); an out-of-memory error during a
run is reported the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dflash.draft.attention import (  # noqa: E402
    BlockVisibility,
    _default_chunk_blocks,
    block_attention,
    dense_block_attention_mask,
)

GIB = 2**30
MIB = 2**20
DENSE_IMPLS = ("dense", "sdpa")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths S")
    parser.add_argument("--anchors", type=int, nargs="+", default=[64, 256, 512], help="blocks per row N")
    parser.add_argument("--block-size", type=int, default=16, help="W = gamma + 1")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads Hq")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true", help="causal in-block attention")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--chunk-blocks", type=int, default=None, help="chunked backend (default: automatic)")
    parser.add_argument(
        "--impls", nargs="+", default=["chunked", "dense"], choices=["chunked", "dense", "sdpa", "flex"]
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--timer",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: perf_counter; cpu: this process's CPU time (steadier on a shared, busy CPU host)",
    )
    parser.add_argument(
        "--max-dense-gib", type=float, default=4.0, help="skip dense/sdpa configs estimated above this"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_case(args, seq_length: int, num_blocks: int):
    """Random sorted distinct anchors (all valid, unpacked) and random q/k/v that require grad."""
    B, W = args.batch, args.block_size
    gen = torch.Generator().manual_seed(args.seed)
    candidates = seq_length - W + 1
    if num_blocks > candidates:
        raise ValueError(f"N={num_blocks} blocks of {W} slots do not fit in S={seq_length}.")
    anchors = torch.stack(
        [torch.randperm(candidates, generator=gen)[:num_blocks].sort().values for _ in range(B)]
    )
    visibility = BlockVisibility(
        anchor_positions=anchors,
        context_start=torch.zeros_like(anchors),
        block_valid=torch.ones(B, num_blocks, dtype=torch.bool),
        causal=args.causal,
        sliding_window=args.sliding_window,
    ).to(args.device)
    dtype = getattr(torch, args.dtype)
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim

    def tensor(*shape):
        return torch.randn(*shape, generator=gen).to(args.device, dtype).requires_grad_()

    inputs = (
        tensor(B, num_blocks, W, Hq, D),
        tensor(B, seq_length, Hkv, D),
        tensor(B, seq_length, Hkv, D),
        tensor(B, num_blocks, W, Hkv, D),
        tensor(B, num_blocks, W, Hkv, D),
    )
    return visibility, inputs


def sdpa_reference(query, context_key, context_value, block_key, block_value, visibility, scale):
    """The published drafters' formulation: one SDPA call with the dense additive mask."""
    B, N, W, Hq, D = query.shape
    S, Hkv = context_key.shape[1], context_key.shape[2]
    q = query.reshape(B, N * W, Hq, D).transpose(1, 2)
    k = torch.cat([context_key, block_key.reshape(B, N * W, Hkv, D)], 1).transpose(1, 2)
    v = torch.cat([context_value, block_value.reshape(B, N * W, Hkv, D)], 1).transpose(1, 2)
    mask = dense_block_attention_mask(visibility, S, W, query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    out = out.transpose(1, 2).reshape(B, N, W, Hq, D)
    return out * visibility.block_valid.view(B, N, 1, 1, 1).to(out.dtype)


def make_step(impl: str, visibility, inputs, scale: float, chunk_blocks):
    def step():
        for tensor in inputs:
            tensor.grad = None
        if impl == "sdpa":
            out = sdpa_reference(*inputs, visibility, scale)
        else:
            out = block_attention(*inputs, visibility, scale=scale, backend=impl, chunk_blocks=chunk_blocks)
        out.backward(torch.ones_like(out))

    return step


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_step(step, device: str, warmup: int, repeats: int, timer: str = "wall") -> float:
    clock = time.process_time if timer == "cpu" else time.perf_counter
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        synchronize(device)
        times.append(clock() - start)
    return statistics.median(times)


def peak_bytes(step, device: str) -> int:
    """High-water mark of bytes allocated during one call of ``step`` beyond those live before it."""
    if device.startswith("cuda"):
        synchronize(device)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def dense_estimate(args, impl: str, seq_length: int, num_blocks: int) -> tuple[float, float]:
    """(mask GiB, estimated forward+backward GiB) of a dense-mask implementation.

    ``dense`` materialises fp32 scores: mask plus four score-sized tensors (scores, probabilities and their
    gradients). ``sdpa`` runs fused kernels that only materialise the mask (counted twice for slack).
    """
    rows = args.batch * num_blocks * args.block_size
    keys = seq_length + num_blocks * args.block_size
    mask = 4 * rows * keys
    scores = 4 * args.heads * rows * keys
    estimate = mask + 4 * scores if impl == "dense" else 2 * mask
    return mask / GIB, estimate / GIB


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate" in text


def measure(impl, args, visibility, inputs, scale, chunk_blocks):
    if impl == "flex" and not args.device.startswith("cuda"):
        return "n/a (flex has no CPU backward)"
    step = make_step(impl, visibility, inputs, scale, chunk_blocks)
    try:
        seconds = time_step(step, args.device, args.warmup, args.repeats, args.timer)
        memory = peak_bytes(step, args.device)
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return "skipped (out of memory)"
    finally:
        for tensor in inputs:
            tensor.grad = None
    return seconds, memory


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "chunked" not in args.impls:
        args.impls = ["chunked", *args.impls]
    scale = args.head_dim**-0.5
    print(
        f"device={args.device} dtype={args.dtype} B={args.batch} Hq={args.heads} Hkv={args.kv_heads} "
        f"D={args.head_dim} W={args.block_size} causal={args.causal} window={args.sliding_window} "
        f"threads={torch.get_num_threads()} timer={args.timer} repeats={args.repeats} "
        "(forward+backward, median)"
    )
    others = [impl for impl in args.impls if impl != "chunked"]
    header = ["S", "N", "chunk", "chunked ms", "chunked MiB"]
    for impl in others:
        header += [f"{impl} ms", f"{impl} MiB", f"{impl}/chunked time", f"{impl}/chunked mem"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for seq_length in args.seq:
        for num_blocks in args.anchors:
            visibility, inputs = make_case(args, seq_length, num_blocks)
            chunk = args.chunk_blocks or _default_chunk_blocks(
                args.batch, args.heads, args.block_size, seq_length, num_blocks, torch.device(args.device)
            )
            base = measure("chunked", args, visibility, inputs, scale, chunk)
            row = [str(seq_length), str(num_blocks), str(chunk)]
            row += [f"{base[0] * 1e3:.1f}", f"{base[1] / MIB:.1f}"] if isinstance(base, tuple) else [base, ""]
            for impl in others:
                mask_gib, estimate_gib = dense_estimate(args, impl, seq_length, num_blocks)
                if impl in DENSE_IMPLS and estimate_gib > args.max_dense_gib:
                    result = f"skipped (dense mask {mask_gib:.2f} GiB, est. {estimate_gib:.1f} GiB)"
                else:
                    result = measure(impl, args, visibility, inputs, scale, chunk)
                if isinstance(result, tuple) and isinstance(base, tuple):
                    row += [
                        f"{result[0] * 1e3:.1f}",
                        f"{result[1] / MIB:.1f}",
                        f"{result[0] / base[0]:.2f}x",
                        f"{result[1] / max(base[1], 1):.2f}x",
                    ]
                else:
                    row += [result if isinstance(result, str) else "", "", "", ""]
            print("| " + " | ".join(row) + " |", flush=True)
            del visibility, inputs


if __name__ == "__main__":
    main()
