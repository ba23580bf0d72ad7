"""The GPU acceptance check: what only a GPU can show, in one command and one table.

    python benchmarks/gpu_check.py                  # every check (meant to finish within 8 minutes on one GPU)
    python benchmarks/gpu_check.py --only attention draft_step

Checks (one row each; `ok`, `FAIL` or `skip` with the reason):
    attention[fp32|bf16]  compiled FlexAttention forward + backward against the exact chunked kernel, on
                          random blocks (S=2048, N=256, W=16, 32 query / 8 key-value heads of 128): the
                          largest difference of the output and of the q/k/v gradients, relative to the
                          largest magnitude of the chunked result; fp32 within 1e-4, bf16 within 3e-2
                          (both kernels round their bf16 output once, flex also its fp32 statistics).
    train_step            two bf16 steps of the embedded job (`pretrain_dflash.py` defaults, tiny target)
                          with `MegatronEngine` on this GPU: finite losses and grad norms, the step time.
    te_layer_spec         the target built with Transformer Engine's layer spec gives the same taps as the
                          local spec (bf16, within 2e-2 relative); skipped when transformer_engine does not
                          import.
    torchrun_tp2          `torchrun --nproc-per-node 2 pretrain_dflash.py` at TP=2 on NCCL (megatron
                          target): it trains and its first loss equals the TP=1 run's; skipped with one GPU.
    draft_step            forward + loss + backward of a 5-layer draft, hidden 4096, vocabulary 151936, at
                          S=4096 with 512 anchors of block 16 (bf16): median step time, peak memory, and
                          the kernel the `auto` attention backend chose.

Exit status 1 if any check fails. Every check is a function of this module that also runs on the CPU at
small sizes, which is how the test suite keeps this script working between GPU runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 2**30


@dataclasses.dataclass
class Row:
    check: str
    status: str  # "ok", "FAIL" or "skip"
    measured: str = ""
    detail: str = ""


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ attention

ATTENTION_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def check_attention(device: str, dtype: str, *, seq_length: int = 2048, num_blocks: int = 256, block_size: int = 16,
                    heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> Row:
    """FlexAttention (compiled on CUDA) against the chunked kernel: output and input gradients.

    Off CUDA flex has no backward (and runs eagerly), so only the forward is compared there."""
    from bench_attention import make_case

    from megatron_dflash.draft.attention import block_attention

    name = f"attention[{'fp32' if dtype == 'float32' else 'bf16'}]"
    case = types.SimpleNamespace(batch=1, block_size=block_size, seed=0, causal=False, sliding_window=None,
                                 device=device, dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    visibility, inputs = make_case(case, seq_length, num_blocks)
    scale = head_dim ** -0.5
    backward = device.startswith("cuda")

    def run(backend):
        grads = [None] * len(inputs)
        with torch.set_grad_enabled(backward):
            out = block_attention(*inputs, visibility, scale=scale, backend=backend)
            if backward:
                grads = torch.autograd.grad(out.float().square().sum(), inputs)
        return [out] + list(grads)

    chunked, flex = run("chunked"), run("flex")
    names = ["out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"]
    worst, where = 0.0, "out"
    for label, a, b in zip(names, chunked, flex):
        if a is None:
            continue
        rel = (a.float() - b.float()).abs().max().item() / max(a.float().abs().max().item(), 1e-30)
        if rel > worst:
            worst, where = rel, label
    tol = ATTENTION_TOLERANCE[dtype]
    what = "forward + backward, compiled" if backward else "forward only (no flex backward off CUDA), eager"
    return Row(name, "ok" if worst <= tol else "FAIL", f"max rel diff {worst:.2e} ({where})",
               f"S={seq_length} N={num_blocks} W={block_size}; {what}; tolerance {tol:g}")


# ------------------------------------------------------------------------------------------ training step


def check_train_step(extra_argv: tuple = (), *, cache_dir: Optional[str] = None, bf16: bool = True) -> Row:
    """Two steps of the embedded job with the engine the launch builds (`MegatronEngine`)."""
    from megatron_dflash.training import optim
    from megatron_dflash.training.loop import run

    engines = []
    build = optim.build_engine

    def recording(*args, **kwargs):
        engines.append(build(*args, **kwargs))
        return engines[-1]

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        saved_cache = os.environ.get("MEGATRON_DFLASH_CACHE")
        os.environ["MEGATRON_DFLASH_CACHE"] = cache_dir or os.path.join(tmp, "cache")
        optim.build_engine = recording
        try:
            argv = ["--train-iters", "2", "--dflash-eval-prompts", "0", "--no-progress-bar",
                    "--dflash-export", os.path.join(tmp, "hf"), "--run-dir", os.path.join(tmp, "run"),
                    *(["--bf16"] if bf16 else []), *extra_argv]
            t0 = time.perf_counter()
            result = run(argv)
            wall = time.perf_counter() - t0
        finally:
            optim.build_engine = build
            if saved_cache is None:
                os.environ.pop("MEGATRON_DFLASH_CACHE", None)
            else:
                os.environ["MEGATRON_DFLASH_CACHE"] = saved_cache
    engine = type(engines[0]).__name__ if engines else "none"
    finite = all(map(_finite, result.losses + result.grad_norms)) and len(result.losses) == 2
    ok = finite and engine == "MegatronEngine"
    losses = ", ".join(f"{x:.4f}" for x in result.losses)
    norms = ", ".join(f"{x:.3f}" for x in result.grad_norms)
    return Row("train_step", "ok" if ok else "FAIL", f"losses {losses}; grad norms {norms}",
               f"{'bf16' if bf16 else 'fp32'}, engine {engine}, {wall:.1f}s for the whole run")


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


# ------------------------------------------------------------------------------------------ TE layer spec


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return False
    return True


def check_te_layer_spec(target_dir, device: str, *, specs: tuple = (False, True)) -> Row:
    """Taps of the megatron target with the TE layer spec against the local spec (one rank).

    `target_dir`: the HF target, or a function that returns it (called only when the check runs).
    `specs`: the two `use_te` values compared (the tests compare the local spec with itself on the CPU,
    to keep this code path working where Transformer Engine cannot be installed)."""
    if any(specs) and not _have_transformer_engine():
        return Row("te_layer_spec", "skip", "", "transformer_engine does not import")
    if callable(target_dir):
        target_dir = target_dir()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dflash.target.megatron.config import hf_target_spec
    from megatron_dflash.target.megatron.model import MegatronTarget

    owns = not dist.is_initialized()
    if owns:
        tmp = tempfile.mkdtemp(prefix="gpu-check-rdzv-")
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.startswith("cuda"):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    try:
        spec = hf_target_spec(target_dir)
        layers = [1, max(2, spec.num_layers // 2)]
        S = 64
        tokens = torch.randint(0, spec.vocab_size, (2, S), generator=torch.Generator().manual_seed(0)).to(device)
        positions = torch.arange(S, device=device)[None].expand(2, -1)
        # megatron builds its default causal mask on CUDA only; on the CPU it is passed (True = masked)
        mask = None if device.startswith("cuda") else torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
        taps = []
        for use_te in specs:
            target = MegatronTarget.from_pretrained(target_dir, layers, use_te=use_te,
                                                    params_dtype=torch.bfloat16).to(device)
            with torch.no_grad():
                out = target(tokens, attention_mask=mask, position_ids=positions)
            taps.append([out.taps[i].float() for i in layers])
            del target
        rel = max((a - b).abs().max().item() / max(a.abs().max().item(), 1e-30) for a, b in zip(*taps))
    finally:
        if owns:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    names = " vs ".join("TE spec" if te else "local spec" for te in specs)
    return Row("te_layer_spec", "ok" if rel <= 2e-2 else "FAIL", f"max rel diff of the taps {rel:.2e}",
               f"{names}, layers {layers}, bf16, tolerance 2e-2")


# ------------------------------------------------------------------------------------------ torchrun TP=2


def check_torchrun_tp2(cache_dir: str, timeout_s: float = 300.0) -> Row:
    """`torchrun` TP=2 on NCCL, compared with the same job at TP=1 (first loss, before any update)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return Row("torchrun_tp2", "skip", "", f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)")
    common = ["--train-iters", "2", "--dflash-eval-prompts", "0", "--no-progress-bar", "--log-interval", "1",
              "--target-backend", "megatron", "--bf16"]
    env = dict(os.environ, MEGATRON_DFLASH_CACHE=cache_dir)
    losses = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-tp2-") as tmp:
        for tp in (1, 2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
                   str(ROOT / "pretrain_dflash.py"), *common, "--tensor-model-parallel-size", str(tp),
                   "--dflash-export", os.path.join(tmp, f"hf-tp{tp}"), "--run-dir", os.path.join(tmp, f"run-tp{tp}")]
            try:
                done = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return Row("torchrun_tp2", "FAIL", "", f"TP={tp} run exceeded {timeout_s:.0f}s")
            if done.returncode != 0:
                return Row("torchrun_tp2", "FAIL", "", f"TP={tp} exit {done.returncode}: {done.stderr.strip()[-300:]}")
            losses[tp] = _first_loss(done.stdout)
    if losses[1] is None or losses[2] is None:
        return Row("torchrun_tp2", "FAIL", "", "no loss in the log")
    rel = abs(losses[1] - losses[2]) / max(abs(losses[1]), 1e-30)
    return Row("torchrun_tp2", "ok" if rel <= 1e-2 else "FAIL", f"first loss TP=1 {losses[1]:.4f}, TP=2 {losses[2]:.4f}",
               "NCCL, megatron target, bf16, tolerance 1e-2 relative")


def _first_loss(log: str) -> Optional[float]:
    for line in log.splitlines():
        if line.lstrip().startswith("iteration") and "| loss:" in line:
            return float(line.split("| loss:")[1].split("|")[0])
    return None


# ------------------------------------------------------------------------------------------ draft step


@dataclasses.dataclass
class DraftSize:
    seq_length: int = 4096
    anchors: int = 512
    block_size: int = 16
    hidden: int = 4096
    intermediate: int = 12288
    layers: int = 5
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    target_layers: int = 36


def check_draft_step(device: str, size: DraftSize = DraftSize(), *, dtype=torch.bfloat16, repeats: int = 3) -> Row:
    """Forward + loss + backward of the draft body at `size`; the `auto` attention backend decides the kernel."""
    from megatron_dflash.draft import attention
    from megatron_dflash.draft.body import DFlashBody, default_parallel_config
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.objectives.dflash_loss import OutputHead, dflash_loss
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan

    taps = 5
    config = DFlashConfig(
        hidden_size=size.hidden, intermediate_size=size.intermediate, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
        vocab_size=size.vocab, block_size=size.block_size, mask_token_id=size.vocab - 1,
        num_target_layers=size.target_layers,
        target_layer_ids=[1 + i * (size.target_layers - 3) // (taps - 1) for i in range(taps)],
    )
    body = DFlashBody(config, default_parallel_config(params_dtype=dtype, bf16=dtype == torch.bfloat16),
                      attention_backend="auto").to(device)
    head = torch.nn.Linear(size.hidden, size.vocab, bias=False).to(device, dtype).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    S, N, W = size.seq_length, size.anchors, size.block_size
    tokens = torch.randint(0, size.vocab - 1, (1, S), generator=gen).to(device)
    plan = build_dflash_batch_plan(torch.ones(1, S, dtype=torch.bool, device=device),
                                   torch.zeros(1, dtype=torch.long, device=device),
                                   anchors_per_sample=N, block_size=W, optimizer_step=0, seed=0)
    target_hidden = torch.randn(1, S, taps * size.hidden, generator=gen).to(device, dtype)
    blocks = torch.randn(1, N, W, size.hidden, generator=gen).to(device, dtype)
    # what `auto` runs: record which kernel of the attention module is called
    kernels = {"flex": "_flex_attention", "chunked": "_chunked_attention", "dense": "_dense_attention"}
    originals = {name: getattr(attention, fn) for name, fn in kernels.items()}
    called = set()

    def recording(name):
        def kernel(*args, **kwargs):
            called.add(name)
            return originals[name](*args, **kwargs)
        return kernel

    def step():
        body.zero_grad(set_to_none=True)
        hidden = body(target_hidden, blocks, plan)
        out = dflash_loss(hidden, plan, tokens, OutputHead(head, size.vocab), decay_gamma=float(W - 1))
        out.loss_sum.backward()
        return out

    for name, fn in kernels.items():
        setattr(attention, fn, recording(name))
    try:
        step()  # warm-up (and compilation)
        _synchronize(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            _synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        for name, fn in kernels.items():
            setattr(attention, fn, originals[name])
    peak = torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else float("nan")
    params = sum(p.numel() for p in body.parameters()) / 1e9
    auto = "+".join(sorted(called)) or "not called"
    return Row("draft_step", "ok", f"{1000 * statistics.median(times):.0f} ms/step, peak {peak:.1f} GiB",
               f"S={S} N={N} W={W} hidden {size.hidden} x {size.layers} layers ({params:.2f}B params), vocab "
               f"{size.vocab}, {str(dtype).replace('torch.', '')}; auto attention -> {auto}")


# ------------------------------------------------------------------------------------------ main


def format_table(rows: list) -> str:
    header = ("check", "result", "measured", "detail")
    cells = [header] + [(r.check, r.status, r.measured, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = []
    for i, c in enumerate(cells):
        lines.append(" | ".join(c[j].ljust(widths[j]) for j in range(3)) + " | " + c[3])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * len(header[3]))
    return "\n".join(lines)


def _guarded(name: str, fn: Callable[[], Row]) -> Row:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
        return Row(name, "FAIL", "", f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", nargs="+", default=None,
                        choices=["attention", "train_step", "te_layer_spec", "torchrun_tp2", "draft_step"])
    parser.add_argument("--cache", default=None, help="MEGATRON_DFLASH_CACHE for the embedded tiny target "
                        "(default: a temporary directory)")
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        print("gpu_check: no CUDA device: the checks run on the CPU (attention forward only, full sizes are slow "
              "there); this is not the GPU acceptance result.", flush=True)
    wanted = set(args.only or ["attention", "train_step", "te_layer_spec", "torchrun_tp2", "draft_step"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-cache-") as tmp_cache:
        cache = args.cache or tmp_cache
        rows = []
        if "attention" in wanted:
            for dtype in ("float32", "bfloat16"):
                rows.append(_guarded("attention", lambda dtype=dtype: check_attention(args.device, dtype)))
        if "train_step" in wanted:
            rows.append(_guarded("train_step", lambda: check_train_step(cache_dir=cache)))
        if "te_layer_spec" in wanted:
            def tiny_target():
                from megatron_dflash.embedded_job.tiny_target import ensure_tiny_target

                return ensure_tiny_target(cache, log=lambda *a: None)

            rows.append(_guarded("te_layer_spec", lambda: check_te_layer_spec(tiny_target, args.device)))
        if "torchrun_tp2" in wanted:
            rows.append(_guarded("torchrun_tp2", lambda: check_torchrun_tp2(cache)))
        if "draft_step" in wanted:
            rows.append(_guarded("draft_step", lambda: check_draft_step(args.device)))
    print(format_table(rows), flush=True)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
