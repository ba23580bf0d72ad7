"""Loss forward+backward: the fused head loss against the unfused (recomputing) path and full logits.

Examples:
    python benchmarks/bench_loss.py                                   # DFlash, vocab 32000 and 151936
    python benchmarks/bench_loss.py --loss dflash2                    # DFlash 2: CE + the selector term
    python benchmarks/bench_loss.py --loss dspark --block-size 7 --rank 256   # DSpark: CE + L1 + BCE, Markov head
    python benchmarks/bench_loss.py --slots 1024 4096 --vocab 32000   # peak memory against the slot count
    python benchmarks/bench_loss.py --device cuda --dtype bfloat16
    python benchmarks/bench_loss.py --vocab 151936 --impls fused reduced --draft-vocab-size 32000

Implementations (same inputs, same weighted objective, frozen target head, gradient w.r.t. the hidden
states, and for DFlash 2 the selector's parameters):
    fused     the production path (``fused=None`` with a frozen head, `objectives.head_loss._FusedHeadLoss`): each chunk
              of ``--chunk`` slots in one reused ``[chunk, V]`` buffer, the gradient w.r.t. the hidden states
              formed in forward, nothing recomputed; DFlash 2's candidates taken from the same logits.
    unfused   ``fused=False``: each chunk's logits, vocab-parallel CE and argmax (and top-k) under activation
              recomputation, the path a trainable head takes and the only path before the fused kernel.
    reduced   (DFlash, ``--impls fused reduced``) the production path over a reduced draft vocabulary: the draft's
              own frozen head of ``--draft-vocab-size`` rows (docs/design.md §20), the same slots.
    full      (DFlash, DSpark) the textbook formulation: ``logits = hidden @ W^T`` for every slot at once
              (materialised, fp32), ``F.cross_entropy(reduction="none")``, the same weights; DSpark adds the
              Markov bias, the target's logits, both softmaxes, the L1 distance and the confidence BCE, all
              dense, through autograd.
    baseline  with ``--baseline-ref REF``: the production call (frozen head, default arguments) of the
              package as it was at git commit REF (extracted with ``git archive``), e.g. the DFlash 2 loss
              before its selector term shared the kernel's logits pass.

The slots are laid out as ``slots / gamma`` blocks of ``W = --block-size`` in one row (slot 0 of each block is
the anchor and is not predicted), so ``--slots`` is the number of predicted slots. DSpark predicts every slot
(``slots / W`` blocks), with a Markov head of rank ``--rank`` (its features and ``W2`` get gradients) and a
confidence logit per slot.

Every measurement runs in its own process (a fresh allocator, nothing cached from the other side), in
alternating order over ``--rounds`` rounds; each process does ``--warmup`` untimed passes, then one timed
pass. Reported: the median over the rounds of the wall time and of the process CPU time (user + system,
all threads), and the peak memory beyond what was live before the pass:
    CUDA: ``torch.cuda.max_memory_allocated``.
    CPU:  "alloc" = high-water mark of the bytes torch's CPU allocator reports to the profiler
          (``profile_memory=True``, a separate untimed pass) and "rss" = high-water of the process RSS
          sampled every millisecond by a thread during the timed pass (includes allocator caching).
Ratios are other/fused: 2.0 means the fused loss is twice as fast, or needs half the memory. The machine
may be shared: compare the ratios of one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _package_root(argv) -> str:
    """This checkout, or (a worker measuring ``--baseline-ref``) the package extracted from that commit."""
    if "--package-root" in argv:
        return argv[argv.index("--package-root") + 1]
    return str(Path(__file__).resolve().parents[1])


sys.path.insert(0, _package_root(sys.argv))

# `objectives.OutputHead`: the name both this checkout and older commits export.
from megatron_dflash.objectives.dflash_loss import OutputHead, decay_weights, dflash_loss  # noqa: E402
from megatron_dflash.plan.batch_plan import DFlashBatchPlan  # noqa: E402
from peak_memory import alloc_peak  # noqa: E402  (benchmarks/peak_memory.py)

MIB = 2**20
IMPLS = ("fused", "unfused", "full", "baseline", "reduced")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", default="dflash", choices=["dflash", "dflash2", "dspark"])
    parser.add_argument("--slots", type=int, nargs="+", default=[4096], help="predicted slots (B * N * gamma)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="vocabulary sizes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1024, help="chunk_slots of the chunked paths")
    parser.add_argument("--block-size", type=int, default=17, help="W = gamma + 1; gamma must divide --slots")
    parser.add_argument("--decay-gamma", type=float, default=7.0)
    parser.add_argument("--top-k", type=int, default=16, help="DFlash 2: selector_top_k")
    parser.add_argument("--rank", type=int, default=256, help="DFlash 2: selector_rank; DSpark: markov_rank")
    parser.add_argument("--impls", nargs="+", default=None, choices=IMPLS,
                        help="default: fused unfused full (DFlash), fused unfused (DFlash 2), fused full (DSpark)")
    parser.add_argument("--draft-vocab-size", type=int, default=32000,
                        help="impl 'reduced': the fused loss over this many rows of the head (a reduced draft vocabulary)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds, one process per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes in each process before the timed one")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-alloc-profile", action="store_true", help="CPU: skip the profiler pass (RSS only)")
    parser.add_argument("--baseline-ref", default=None, help="git commit whose production loss to measure as 'baseline'")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "impl,vocab,slots": one measurement
    parser.add_argument("--package-root", default=None, help=argparse.SUPPRESS)  # the baseline's package
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ one measurement


def _blocks_and_head(args, vocab: int, num_blocks: int):
    """``num_blocks`` blocks of ``--block-size`` back to back in one row: the plan, random tokens ``[1, S]``,
    block hidden states ``[1, N, W, H]`` (requiring grad), a random head ``[V, H]``, and the generator that drew
    them (the caller's further draws continue its stream)."""
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
    return plan, input_ids, hidden, head, gen


def make_inputs(args, vocab: int, slots: int):
    if args.loss == "dspark":
        return make_dspark_inputs(args, vocab, slots)
    gamma = args.block_size - 1
    if slots % gamma:
        raise SystemExit(f"--slots={slots} must be a multiple of gamma = --block-size - 1 = {gamma}")
    num_blocks = slots // gamma
    plan, input_ids, hidden, head, gen = _blocks_and_head(args, vocab, num_blocks)
    dtype = hidden.dtype
    head.weight.requires_grad_(False)  # the target's head is frozen
    selector = None
    if args.loss == "dflash2":
        from megatron_dflash.variants.dflash2 import CandidateSelector

        torch.manual_seed(1)  # the selector's initialisation
        selector = CandidateSelector(vocab, args.hidden, args.rank, args.top_k, dtype=dtype, device=args.device)
        with torch.no_grad():  # not the identity: the selector term has a gradient everywhere
            selector.successor_codebook.normal_(0.0, 0.02, generator=gen)
    return plan, input_ids, hidden, head, selector


def make_dspark_inputs(args, vocab: int, slots: int):
    """DSpark's inputs: every slot predicts, so ``slots / W`` blocks; the Markov features ``[1, N, W, r]``,
    ``W2 [V, r]`` and the confidence logits train; the target's final hidden states ``[1, S, H]``."""
    W = args.block_size
    if slots % W:
        raise SystemExit(f"--slots={slots} must be a multiple of --block-size={W} for DSpark")
    num_blocks = slots // W
    plan, input_ids, hidden, head, gen = _blocks_and_head(args, vocab, num_blocks)
    dtype = hidden.dtype
    head.weight.requires_grad_(False)
    extra = {
        "teacher": torch.randn(1, input_ids.shape[1], args.hidden, generator=gen).to(args.device, dtype),
        "features": torch.randn(1, num_blocks, W, args.rank, generator=gen).to(args.device, dtype).requires_grad_(),
        "w2": (torch.randn(vocab, args.rank, generator=gen) * 0.02).to(args.device).requires_grad_(),
        "confidence": torch.randn(1, num_blocks, W, generator=gen).to(args.device).requires_grad_(),
    }
    return plan, input_ids, hidden, head, extra


def make_dspark_step(impl, args, plan, input_ids, hidden, head, extra, vocab):
    """The DSpark loss (fused) or its dense formulation (full), forward and backward."""
    from megatron_dflash.objectives.dspark_loss import dspark_loss, dspark_slot_targets

    teacher, features, w2, confidence = extra["teacher"], extra["features"], extra["w2"], extra["confidence"]
    if impl == "fused":
        output_head = OutputHead(head, vocab)

        def step():
            out = dspark_loss(hidden, plan, input_ids, output_head, teacher_hidden=teacher, markov_features=features,
                              markov_w2=w2, confidence_logits=confidence, decay_gamma=args.decay_gamma,
                              chunk_slots=args.chunk)
            out.loss_sum.backward()
            return out.loss_sum.detach()

        return step
    if impl != "full":
        raise SystemExit("DSpark measures fused and full only")
    targets = dspark_slot_targets(input_ids, plan, decay_gamma=args.decay_gamma)
    weights, labels = targets.flat_weights, targets.flat_labels
    positions = (plan.anchor_positions[:, :, None] + torch.arange(plan.block_size, device=args.device)).reshape(-1)

    def step():
        z = F.linear(hidden.reshape(-1, hidden.shape[-1]), head.weight).float()  # [slots, V] materialised
        z = z + features.reshape(-1, features.shape[-1]).float() @ w2.t()
        t = F.linear(teacher[0, positions], head.weight).float()
        l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
        accept = (1.0 - l1 / 2).clamp(0.0, 1.0).detach()
        bce = F.binary_cross_entropy_with_logits(confidence.reshape(-1), accept, reduction="none")
        per_slot = 0.1 * F.cross_entropy(z, labels, reduction="none") + 0.9 * l1 + bce
        loss = (per_slot * weights).sum()
        loss.backward()
        return loss.detach()

    return step


def _reduced_head(head, vocab: int, size: int) -> OutputHead:
    """The draft's own frozen head over ``size`` rows of ``head`` (ids 0..size-1; which rows does not change the
    work: every slot is computed, those whose label is outside with weight 0), docs/design.md §20."""
    import types

    from megatron_dflash.draft.draft_vocab import DraftLMHead, DraftVocabulary

    vocabulary = DraftVocabulary(torch.arange(size), vocab)
    layer = DraftLMHead(size, head.weight.shape[1], dtype=head.weight.dtype).to(head.weight.device)
    layer.copy_target_rows(head.weight[:size])
    return OutputHead.of_draft(types.SimpleNamespace(lm_head=layer, d2t=vocabulary.d2t), OutputHead(head, vocab))


def make_step(impl, args, plan, input_ids, hidden, head, selector, vocab):
    if args.loss == "dspark":
        return make_dspark_step(impl, args, plan, input_ids, hidden, head, selector, vocab)
    if impl == "reduced":
        output_head = _reduced_head(head, vocab, args.draft_vocab_size)

        def step():
            out = dflash_loss(hidden, plan, input_ids, output_head, decay_gamma=args.decay_gamma, chunk_slots=args.chunk)
            out.loss_sum.backward()
            return out.loss_sum.detach()

        return step
    if impl in ("fused", "unfused", "baseline"):
        output_head = OutputHead(head, vocab)
        # The baseline is called as production calls it (no `fused`: older commits lack the argument).
        options = {} if impl == "baseline" else {"fused": impl == "fused"}
        if selector is not None:
            from megatron_dflash.variants.dflash2 import dflash2_loss

            def step():
                out = dflash2_loss(hidden, plan, input_ids, output_head, selector, decay_gamma=args.decay_gamma,
                                   chunk_slots=args.chunk, **options)
                out.loss_sum.backward()
                return out.loss_sum.detach()

            return step

        def step():
            out = dflash_loss(hidden, plan, input_ids, output_head, decay_gamma=args.decay_gamma,
                              chunk_slots=args.chunk, **options)
            out.loss_sum.backward()
            return out.loss_sum.detach()

        return step
    if selector is not None:
        raise SystemExit("the full-logits reference is DFlash only")

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


def worker(args) -> dict:
    """One measurement in this process: ``--warmup`` passes, one timed pass, one profiled pass (CPU)."""
    impl, vocab, slots = args.worker.split(",")
    vocab, slots = int(vocab), int(slots)
    plan, input_ids, hidden, head, selector = make_inputs(args, vocab, slots)
    step = make_step(impl, args, plan, input_ids, hidden, head, selector, vocab)
    cuda = args.device.startswith("cuda")
    try:
        for _ in range(args.warmup):
            hidden.grad = None
            step()
        synchronize(args.device)
        hidden.grad = None
        if isinstance(selector, torch.nn.Module):
            selector.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        rss = None if cuda else RssPeak()
        if rss is not None:
            rss.__enter__()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        loss = step()
        synchronize(args.device)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if rss is not None:
            rss.__exit__(None, None, None)
        grad = hidden.grad.detach().double()
        result = {"wall": wall, "cpu": cpu, "loss": float(loss), "grad_norm": float(grad.norm()),
                  "grad_sum": float(grad.sum())}
        if isinstance(selector, torch.nn.Module):
            result["selector_grad_norm"] = float(
                torch.stack([p.grad.double().norm() for p in selector.parameters() if p.grad is not None]).norm())
        if cuda:
            result["alloc"] = torch.cuda.max_memory_allocated() - before
        else:
            result["rss"] = rss.delta
            if not args.no_alloc_profile:
                hidden.grad = None
                result["alloc"] = alloc_peak(step)
    except (RuntimeError, MemoryError) as error:
        if "out of memory" not in str(error).lower() and not isinstance(error, MemoryError):
            raise
        result = {"error": "out of memory"}
    return result


# ------------------------------------------------------------------------------------------ the driver


def extract_baseline(ref: str) -> str:
    """The ``megatron_dflash`` package of git commit ``ref``, extracted into a temporary directory."""
    root = Path(__file__).resolve().parents[1]
    target = tempfile.mkdtemp(prefix="bench-loss-baseline-")
    archive = subprocess.run(["git", "-C", str(root), "archive", ref, "megatron_dflash"], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline-ref={ref}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", target], input=archive.stdout, check=True)
    return target


def run_worker(argv, impl: str, vocab: int, slots: int, package_root=None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *argv, "--worker", f"{impl},{vocab},{slots}"]
    if impl == "baseline":
        command += ["--package-root", package_root]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {impl} vocab={vocab} slots={slots} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt_mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:9.1f}"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return
    impls = args.impls or {"dflash": ["fused", "unfused", "full"], "dflash2": ["fused", "unfused"],
                           "dspark": ["fused", "full"]}[args.loss]
    if args.baseline_ref and "baseline" not in impls:
        impls = impls + ["baseline"]
    if "fused" not in impls:
        raise SystemExit("--impls must include fused (the ratios are against it)")
    if "baseline" in impls and not args.baseline_ref:
        raise SystemExit("--impls baseline needs --baseline-ref REF")
    package_root = extract_baseline(args.baseline_ref) if args.baseline_ref else None
    try:
        compare(args, argv, impls, package_root)
    finally:
        if package_root is not None:
            shutil.rmtree(package_root, ignore_errors=True)


def compare(args, argv, impls, package_root) -> None:
    """The table and the ratios: every (vocab, slots) over ``--rounds`` alternating rounds."""
    print(f"# loss={args.loss} device={args.device} dtype={args.dtype} hidden={args.hidden} chunk={args.chunk} "
          f"block_size={args.block_size} threads={args.threads or torch.get_num_threads()} rounds={args.rounds} "
          f"warmup={args.warmup}" + (f" top_k={args.top_k} rank={args.rank}" if args.loss == "dflash2" else "")
          + (f" markov_rank={args.rank}" if args.loss == "dspark" else "")
          + (f" baseline={args.baseline_ref}" if args.baseline_ref else ""))
    mem_keys = ["alloc"] if args.device.startswith("cuda") else ["alloc", "rss"]
    print(f"{'vocab':>7} {'slots':>6} {'impl':>8} {'wall s':>8} {'cpu s':>8} "
          + " ".join(f"{k + ' MiB':>10}" for k in mem_keys) + f" {'loss':>14} {'grad norm':>12}")
    for vocab in args.vocab:
        for slots in args.slots:
            runs = {impl: [] for impl in impls}
            for round_index in range(args.rounds):
                order = impls if round_index % 2 == 0 else impls[::-1]  # alternate who goes first
                for impl in order:
                    runs[impl].append(run_worker(argv, impl, vocab, slots, package_root))
            summary = {}
            for impl, results in runs.items():
                if any("error" in r for r in results):
                    print(f"{vocab:>7} {slots:>6} {impl:>8} out of memory")
                    continue
                s = {key: statistics.median(r[key] for r in results) for key in ("wall", "cpu")}
                for key in mem_keys:
                    s[key] = max(r.get(key, 0) for r in results) if results[0].get(key) is not None else None
                s.update({key: results[0][key] for key in ("loss", "grad_norm")})
                summary[impl] = s
                mems = " ".join(f"{fmt_mib(s.get(k)):>10}" for k in mem_keys)
                print(f"{vocab:>7} {slots:>6} {impl:>8} {s['wall']:8.3f} {s['cpu']:8.3f} {mems} "
                      f"{s['loss']:14.6e} {s['grad_norm']:12.6e}")
            if "fused" not in summary:
                continue
            base = summary["fused"]
            for other in impls:
                if other == "fused" or other not in summary:
                    continue
                o = summary[other]
                ratios = [f"wall {o['wall'] / base['wall']:.2f}x", f"cpu {o['cpu'] / base['cpu']:.2f}x"]
                for key in mem_keys:
                    if base.get(key) and o.get(key):
                        ratios.append(f"{key} {o[key] / max(base[key], 1):.1f}x")
                rel_loss = abs(base["loss"] - o["loss"]) / max(abs(o["loss"]), 1e-30)
                rel_grad = abs(base["grad_norm"] - o["grad_norm"]) / max(abs(o["grad_norm"]), 1e-30)
                print(f"{vocab:>7} {slots:>6} {other + '/fused':>17}: " + ", ".join(ratios)
                      + f"  (agreement: loss rel {rel_loss:.1e}, grad norm rel {rel_grad:.1e})")


if __name__ == "__main__":
    main()
