"""DFlash loss: chunked vocab-parallel cross entropy (production) against full-logits cross entropy.

Examples:
    python benchmarks/bench_loss.py                                  # vocab 32k and 152k, 8192 slots, hidden 1024
    python benchmarks/bench_loss.py --slots 2048 --vocab 151936      # a smaller CPU run
    python benchmarks/bench_loss.py --device cuda --dtype bfloat16

Implementations (same inputs, same weighted objective, frozen head, gradient w.r.t. the hidden states):
    chunked  ``dflash_loss(..., chunk_slots=--chunk)`` (production, frozen head: the fused loss): the predicted
             slots in chunks of ``--chunk`` rows in one reused ``[chunk, V]`` buffer, the gradient w.r.t. the
             hidden states formed in forward, nothing recomputed in backward.
    recompute ``dflash_loss(..., fused=False)``: each chunk's logits, vocab-parallel CE and argmax under
             activation recomputation (the path a trainable head takes).
    full     the reference formulation: ``logits = hidden @ W^T`` for every predicted slot at once (materialised,
             fp32), ``F.cross_entropy(logits, labels, reduction="none")``, the same decay weights and mask.

The slots are laid out as ``slots / gamma`` blocks of ``W = --block-size`` in one row (slot 0 of each block is
the anchor and is not predicted), so ``--slots`` is the number of predicted slots.

Time: median of ``--repeats`` forward+backward passes after ``--warmup``; wall time, or this process's CPU
time with ``--timer cpu`` (steadier when other jobs share the CPU).
Peak memory, beyond what was live before the pass:
    CUDA: ``torch.cuda.max_memory_allocated``.
    CPU:  "alloc" = high-water mark of the bytes torch's CPU allocator reports to the profiler
          (``profile_memory=True``; exactly the tensors torch allocates) and "rss" = high-water of the process
          RSS sampled every millisecond by a thread (includes allocator caching, hence noisier).
Ratios are full/chunked and recompute/chunked: a ratio of 10 means chunked is 10x faster or smaller.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dflash.objectives import OutputHead, decay_weights, dflash_loss  # noqa: E402
from megatron_dflash.plan import DFlashBatchPlan  # noqa: E402

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8192, help="predicted slots (B * N * gamma)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="vocabulary sizes")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024, help="chunk_slots of the chunked loss")
    parser.add_argument("--block-size", type=int, default=17, help="W = gamma + 1; gamma must divide --slots")
    parser.add_argument("--decay-gamma", type=float, default=7.0)
    parser.add_argument("--impls", nargs="+", default=["chunked", "recompute", "full"], choices=["chunked", "recompute", "full"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--timer", default="wall", choices=["wall", "cpu"])
    parser.add_argument("--no-alloc-profile", action="store_true", help="CPU: skip the profiler pass (RSS only)")
    return parser.parse_args(argv)


def make_inputs(args, vocab: int):
    gamma = args.block_size - 1
    if args.slots % gamma:
        raise SystemExit(f"--slots={args.slots} must be a multiple of gamma = --block-size - 1 = {gamma}")
    num_blocks = args.slots // gamma
    W = args.block_size
    seq = num_blocks * W + 1
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    anchors = (torch.arange(num_blocks) * W)[None]
    plan = DFlashBatchPlan.from_anchors(anchors, block_size=W, seq_length=seq).to(args.device)
    input_ids = torch.randint(0, vocab, (1, seq), generator=gen).to(args.device)
    hidden = torch.randn(1, num_blocks, W, args.hidden, generator=gen).to(args.device, dtype).requires_grad_()
    head = torch.nn.Linear(args.hidden, vocab, bias=False, device=args.device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, args.hidden, generator=gen) * args.hidden**-0.5)
    head.weight.requires_grad_(False)  # the target's head is frozen
    return plan, input_ids, hidden, head


def make_step(impl, args, plan, input_ids, hidden, head, vocab):
    if impl in ("chunked", "recompute"):
        output_head = OutputHead(head, vocab)
        fused = impl == "chunked"

        def step():
            out = dflash_loss(
                hidden, plan, input_ids, output_head, decay_gamma=args.decay_gamma, chunk_slots=args.chunk, fused=fused
            )
            out.loss_sum.backward()
            return out.loss_sum.detach()

        return step

    weights = (decay_weights(plan, decay_gamma=args.decay_gamma) * plan.loss_mask)[:, :, 1:].reshape(-1)
    labels = torch.gather(input_ids, 1, plan.token_indices.reshape(1, -1)).view(plan.loss_mask.shape)
    labels = labels[:, :, 1:].reshape(-1)

    def step():
        flat = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])
        logits = F.linear(flat, head.weight).float()  # [slots, V] materialised
        nll = F.cross_entropy(logits, labels, reduction="none")
        loss = (nll * weights).sum()
        loss.backward()
        return loss.detach()

    return step


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class RssPeak:
    """High-water mark of this process's RSS, sampled every millisecond by a thread."""

    def __init__(self, interval_s: float = 1e-3):
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


def alloc_peak(step) -> int:
    """CPU: high-water mark of torch-allocated bytes during ``step`` from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(impl, args, vocab):
    plan, input_ids, hidden, head = make_inputs(args, vocab)
    step = make_step(impl, args, plan, input_ids, hidden, head, vocab)
    clock = time.perf_counter if args.timer == "wall" else time.process_time
    result = {}
    try:
        for _ in range(args.warmup):
            hidden.grad = None
            step()
        synchronize(args.device)
        times = []
        if args.device.startswith("cuda"):
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        rss = RssPeak() if not args.device.startswith("cuda") else None
        if rss is not None:
            gc.collect()
            rss.__enter__()
        try:
            for _ in range(args.repeats):
                hidden.grad = None
                start = clock()
                loss = step()
                synchronize(args.device)
                times.append(clock() - start)
        finally:
            if rss is not None:
                rss.__exit__(None, None, None)
        result["seconds"] = statistics.median(times)
        if rss is not None:
            result["rss"] = rss.delta
            if not args.no_alloc_profile:
                hidden.grad = None
                result["alloc"] = alloc_peak(step)
        else:
            result["alloc"] = torch.cuda.max_memory_allocated() - before
        result["loss"] = float(loss)
        result["grad"] = hidden.grad.detach().float().clone()
    except (RuntimeError, MemoryError) as error:
        if "out of memory" not in str(error).lower() and not isinstance(error, (MemoryError, torch.OutOfMemoryError)):
            raise
        result = {"error": "out of memory"}
    finally:
        del plan, input_ids, hidden, head, step
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


def fmt_mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:9.1f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# device={args.device} dtype={args.dtype} slots={args.slots} hidden={args.hidden} chunk={args.chunk} "
        f"block_size={args.block_size} threads={torch.get_num_threads()} timer={args.timer} "
        f"warmup={args.warmup} repeats={args.repeats}"
    )
    mem_keys = ["alloc"] if args.device.startswith("cuda") else ["alloc", "rss"]
    header = f"{'vocab':>7} {'impl':>8} {'time s':>9} " + " ".join(f"{k + ' MiB':>10}" for k in mem_keys)
    header += f" {'loss':>12}  full logits MiB"
    print(header)
    for vocab in args.vocab:
        results = {impl: measure(impl, args, vocab) for impl in args.impls}
        logits_mib = args.slots * vocab * 4 / MIB
        for impl, r in results.items():
            if "error" in r:
                print(f"{vocab:>7} {impl:>8} {r['error']}")
                continue
            mems = " ".join(f"{fmt_mib(r.get(k)):>10}" for k in mem_keys)
            print(f"{vocab:>7} {impl:>8} {r['seconds']:9.3f} {mems} {r['loss']:12.4f}  {logits_mib:.0f}")
        for other in ("full", "recompute"):
            if not all("error" not in results.get(i, {"error": 1}) for i in ("chunked", other)):
                continue
            c, f = results["chunked"], results[other]
            ratios = [f"time {f['seconds'] / c['seconds']:.2f}x"]
            for k in mem_keys:
                if c.get(k) and f.get(k):
                    ratios.append(f"{k} {f[k] / max(c[k], 1):.1f}x")
            rel_loss = abs(c["loss"] - f["loss"]) / max(abs(f["loss"]), 1e-12)
            rel_grad = float((c["grad"] - f["grad"]).abs().max() / f["grad"].abs().max().clamp(min=1e-30))
            print(f"{vocab:>7} {other + '/chunked':>17}: " + ", ".join(ratios)
                  + f"  (agreement: loss rel {rel_loss:.1e}, grad max rel {rel_grad:.1e})")


if __name__ == "__main__":
    main()
