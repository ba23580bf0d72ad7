"""The run directory: everything a training run leaves behind, in one place.

    runs/<name>/                  (--run-dir; default runs/<DFLASH_RUN_NAME or dflash-<time>>)
      args.json                   the resolved arguments (after validation and derived defaults)
      console.log                 what the run printed (pretrain_dflash.py)
      metrics.jsonl               one JSON object per log interval and per evaluation
      metrics.png                 loss and acceptance over iterations (with matplotlib installed)
      checkpoints/                torch_dist checkpoints (the embedded job's default --save)
      hf/                         the HF export of the draft (default --dflash-export)
      summary.json                the headline result, timings and paths, written at the end
    runs/latest -> <name>         the newest run under the default root

Only rank 0 writes. Every file is replaced atomically (metrics.jsonl is appended line by line),
so a crash leaves the files of the last completed write. The acceptance figures carry the names
of `monitor.ACCEPTANCE_LABELS` everywhere (console, metrics.jsonl, plot, TensorBoard/W&B).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import sys
import time
from typing import Optional

from ..atomic import write_file
from .monitor import DECODE_ACCEPTANCE, DECODE_TOKENS_PER_FORWARD, TRAIN_ACCEPTANCE, VALID_ACCEPTANCE

__all__ = ["DEFAULT_RUNS_ROOT", "resolve_run_dir", "ConsoleLog", "RunWriter", "next_step_commands"]

DEFAULT_RUNS_ROOT = "runs"
LATEST = "latest"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_run_dir(args, env=None) -> str:
    """--run-dir, else runs/<DFLASH_RUN_NAME or dflash-YYYYmmdd-HHMMSS> (relative to the working directory)."""
    if getattr(args, "run_dir", None):
        return args.run_dir
    env = os.environ if env is None else env
    name = env.get("DFLASH_RUN_NAME") or time.strftime("dflash-%Y%m%d-%H%M%S")
    return os.path.join(DEFAULT_RUNS_ROOT, name)


def _json_default(value):
    return str(value)


# ------------------------------------------------------------------------------------------ console


class _Tee(io.TextIOBase):
    def __init__(self, stream, sink: "ConsoleLog"):
        self.stream, self.sink = stream, sink

    def write(self, text: str) -> int:
        self.sink.record(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


class ConsoleLog:
    """Copies stdout and stderr into a file. Buffers in memory until `attach(path)` (the run
    directory is known only once the command line is validated), so a rejected command line
    leaves no file behind. Carriage-return redraws (progress bars) are not copied."""

    def __init__(self):
        self._buffer: list[str] = []
        self._file = None
        self._saved = None

    @classmethod
    def start(cls) -> "ConsoleLog":
        log = cls()
        log._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
        return log

    def record(self, text: str) -> None:
        if "\r" in text:  # a progress bar (re)draw: keep only a complete line after the last \r
            text = text.rsplit("\r", 1)[1]
            if not text.endswith("\n") or not text.strip() or "\033[K" in text:
                return
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
        else:
            self._buffer.append(text)

    def attach(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a")
        self._file.write("".join(self._buffer))
        self._file.flush()
        self._buffer = []

    def stop(self) -> None:
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if self._file is not None:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------------------------------ writer


class RunWriter:
    """Writes the run directory (rank 0; a no-op elsewhere)."""

    def __init__(self, path: str, *, active: bool = True, log=print):
        self.path = path
        self.active = active
        self.log = log
        self.records: list[dict] = []
        self._plot_warned = False
        if active:
            os.makedirs(path, exist_ok=True)
            self.metrics_path = os.path.join(path, "metrics.jsonl")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write_args(self, args) -> None:
        if not self.active:
            return
        values = {k: v for k, v in sorted(vars(args).items())}
        write_file(self.file("args.json"), (json.dumps(values, indent=2, default=_json_default) + "\n").encode())

    def link_latest(self) -> None:
        """runs/latest -> this run, when the run lives directly under the default root."""
        parent = os.path.dirname(os.path.normpath(self.path))
        if not self.active or os.path.normpath(parent) != DEFAULT_RUNS_ROOT:
            return
        link = os.path.join(parent, LATEST)
        if os.path.exists(link) and not os.path.islink(link):
            return  # someone's own directory: leave it alone
        tmp = f"{link}.tmp{os.getpid()}"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.basename(os.path.normpath(self.path)), tmp)
        os.replace(tmp, link)

    def metrics(self, record: dict) -> None:
        """Append one record (`iteration`, `split`, values) to metrics.jsonl."""
        if not self.active:
            return
        record = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}  # NaN -> null
        self.records.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")

    def load_existing_metrics(self, up_to_iteration: int) -> None:
        """A resumed run keeps the records of its earlier part (up to where it resumes) in the plot."""
        if not self.active or not os.path.isfile(self.metrics_path):
            return
        kept = []
        with open(self.metrics_path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if int(record.get("iteration", 0)) <= up_to_iteration:
                    kept.append(record)
        self.records = kept
        write_file(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept).encode())

    def plot(self) -> Optional[str]:
        """metrics.png: loss (train, valid) and the acceptance figures over iterations."""
        if not self.active or not self.records:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._plot_warned:
                self.log("[run] matplotlib is not installed: no metrics.png (pip install matplotlib).")
                self._plot_warned = True
            return None

        def series(split: str, key: str):
            points = [(r["iteration"], r[key]) for r in self.records
                      if r.get("split") == split and r.get(key) is not None]
            return [p[0] for p in points], [p[1] for p in points]

        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        for split, style in (("train", "-"), ("valid", "o--")):
            x, y = series(split, "loss")
            if x:
                ax_loss.plot(x, y, style, label=f"{split} loss")
        ax_loss.set_xlabel("iteration")
        ax_loss.set_ylabel("loss")
        ax_loss.set_title("loss")
        ax_loss.legend()
        for split, key, style in (("train", TRAIN_ACCEPTANCE, "-"), ("valid", VALID_ACCEPTANCE, "o--"),
                                  ("decode", DECODE_ACCEPTANCE, "s-")):
            x, y = series(split, key)
            if x:
                ax_acc.plot(x, y, style, label=key)
        ax_acc.axhline(1.0, color="gray", linewidth=0.8, linestyle=":", label="autoregressive baseline")
        ax_acc.set_xlabel("iteration")
        ax_acc.set_ylabel("tokens per block / per cycle")
        ax_acc.set_title("acceptance")
        ax_acc.legend(fontsize=8)
        fig.suptitle(os.path.basename(os.path.normpath(self.path)))
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        plt.close(fig)
        path = self.file("metrics.png")
        write_file(path, buffer.getvalue())
        return path

    def write_summary(self, summary: dict) -> None:
        if not self.active:
            return
        write_file(self.file("summary.json"),
                      (json.dumps(summary, indent=2, default=_json_default) + "\n").encode())


    def finish(self, job, result) -> None:
        """At the end of a run: the plot, summary.json, and the closing lines of the console, the
        headline result and the next commands (`next_step_commands`), ready to paste."""
        if not self.active:
            return
        args = job.args
        plot = self.plot()
        checkpoint = args.save if result.checkpoint_dir is not None else None
        prompts = args.dflash_eval_prompts
        steps = next_step_commands(
            run_dir=self.path, checkpoint_dir=checkpoint, export_dir=result.export_dir, target_dir=job.target_dir,
            embedded_target=job.embedded_target, eval_prompts_file=prompts if prompts and os.path.isfile(prompts) else None,
        )
        self.write_summary({
            "headline": headline(result.final_acceptance),
            "final_acceptance": result.final_acceptance,
            "final_validation": result.validation[-1][1] if result.validation else None,
            "final_train": result.metrics[-1] if result.metrics else None,
            "iterations": result.iterations,
            "wall_time_s": result.wall_time_s,
            "run_dir": self.path,
            "target": job.target_dir,
            "checkpoint": checkpoint,
            "hf_export": result.export_dir,
            "plot": plot,
            "next_steps": [{"what": what, "command": command} for what, command in steps],
        })
        files = sorted(name + ("/" if os.path.isdir(self.file(name)) else "") for name in os.listdir(self.path)
                       if not name.startswith("."))
        print(f"[run] {self.path}: {' '.join(files)}", flush=True)
        print(f"[result] {headline(result.final_acceptance)}", flush=True)
        for what, command in steps:
            print(f"[next] {what}:\n    {command}", flush=True)


# ------------------------------------------------------------------------------------------ next steps


def _shell_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else absolute; shell-quoted."""
    absolute = os.path.abspath(path)
    cwd = os.getcwd()
    shown = os.path.relpath(absolute, cwd) if absolute.startswith(cwd + os.sep) else absolute
    return shlex.quote(shown)


def _tool(name: str) -> str:
    return f"python {_shell_path(os.path.join(_REPO_ROOT, 'tools', name))}"


def next_step_commands(*, run_dir: str, checkpoint_dir: Optional[str], export_dir: Optional[str],
                       target_dir: str, embedded_target: bool, eval_prompts_file: Optional[str]) -> list[tuple[str, str]]:
    """(what, command) pairs that continue from a finished run, ready to paste."""
    steps = []
    if checkpoint_dir is not None:
        steps.append((
            "convert the torch_dist checkpoint to the HF format",
            f"{_tool('convert_checkpoint.py')} to-hf --load {_shell_path(checkpoint_dir)} "
            f"--output {_shell_path(os.path.join(run_dir, 'converted-hf'))} --validate",
        ))
    if export_dir is not None:
        report = _shell_path(os.path.join(run_dir, "eval.json"))
        if embedded_target:  # the tool defaults to the embedded target and its prompts
            steps.append(("measure speculative decoding on the shipped prompts",
                          f"{_tool('evaluate_acceptance.py')} --draft {_shell_path(export_dir)} --output {report}"))
        elif eval_prompts_file is not None:
            steps.append(("measure speculative decoding",
                          f"{_tool('evaluate_acceptance.py')} --target {_shell_path(target_dir)} --draft "
                          f"{_shell_path(export_dir)} --prompts {_shell_path(eval_prompts_file)} --output {report}"))
    return steps


def headline(final_acceptance: Optional[dict]) -> str:
    if final_acceptance is None:
        return "no decode acceptance length measured (see [final] above)"
    value = final_acceptance["acceptance_length"]
    if final_acceptance.get("cycles", 0) == 0:
        return f"{DECODE_ACCEPTANCE}: n/a ({final_acceptance.get('no_cycle_reason', 'no verify cycle ran')})"
    return (f"{DECODE_ACCEPTANCE}: {value:.3f} (autoregressive baseline 1.0) over "
            f"{final_acceptance['prompts']} held-out prompts; "
            f"{final_acceptance['tokens_per_target_forward']:.2f} {DECODE_TOKENS_PER_FORWARD}")
