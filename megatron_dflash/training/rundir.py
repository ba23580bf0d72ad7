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

Writing the run directory never stops training (docs/design.md §14): a write the file system
refuses (full, quota, a lost mount) warns once (`RunDirHealth`) and training goes on. The lines of
console.log and metrics.jsonl it could not take stay in memory (`AppendedFile`, up to
`PENDING_LIMIT` bytes each, the oldest lines dropped beyond) and are written with the next line
that fits, so the files catch up once there is space again; the plot and the other files are
rewritten whole at their next write. One line says when writing works again, and how much of the
console or the metrics was dropped, if any. A run directory removed during the run is made again
at the next write: console.log and metrics.jsonl are read back through the descriptors that still
hold the removed files (`AppendedFile._take_back`), the files written whole are written again
(`RunWriter._write_again`), and one line says so. The console itself may fail too (closed, a
reader gone under `| head`): `ConsoleLog` then warns once and keeps console.log alone
(`console.ConsoleStream`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import time
from typing import Optional

from ..common.atomic import write_file
from .console import ConsoleStream, ignore_sigpipe, is_closed, silence
from .monitor import DECODE_ACCEPTANCE, DECODE_TOKENS_PER_FORWARD, TRAIN_ACCEPTANCE, VALID_ACCEPTANCE

__all__ = ["DEFAULT_RUNS_ROOT", "resolve_run_dir", "ConsoleLog", "RunWriter", "RunDirHealth", "AppendedFile",
           "next_step_commands"]

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


# ------------------------------------------------------------------------------------------ failed writes

PENDING_LIMIT = 8 << 20  # bytes of console.log / metrics.jsonl kept in memory while the disk refuses them


class RunDirHealth:
    """Whether writing one run directory works. The first failed write warns (one line on stderr:
    the file, the reason, that training goes on); more failures say nothing; the first moment no
    file is failing any more says so in one line, with what was lost. One per run directory
    (`health_of`), shared by the console log and the `RunWriter`."""

    def __init__(self, path: str):
        self.path = path
        self.failing: dict[str, str] = {}  # file name -> why its last write failed
        self.lost: dict[str, int] = {}     # file name -> bytes dropped while failing
        self._made_again: list = []        # what rewrites its files when the directory is made again

    def when_made_again(self, rewrite) -> None:
        """Call `rewrite()` whenever the directory, removed under the run, has been made again (until `forget`)."""
        self._made_again.append(rewrite)

    def forget(self, rewrite) -> None:
        """No more `rewrite()` (its writer is closed: a later run on this directory in this process has its own)."""
        with contextlib.suppress(ValueError):
            self._made_again.remove(rewrite)

    def made_again(self) -> None:
        """The directory was removed during the run and a write has just made it again: one line, and every
        writer registered with `when_made_again` writes its files anew."""
        self._say(f"[run] {self.path} was removed during the run: made it again; console.log and metrics.jsonl "
                  "are written again whole from what the run holds, the other files at once.")
        for rewrite in self._made_again:
            rewrite()

    def failed(self, name: str, err: OSError) -> None:
        first = not self.failing
        self.failing[name] = err.strerror or str(err)
        if first:
            # after the state change: the warning passes through the console tee, whose own failing
            # write comes back here and must not warn again
            self._say(f"[run] WARNING: cannot write {os.path.join(self.path, name)} ({self.failing[name].lower()}); "
                      "training goes on, the run directory's files are kept in memory and written once there is "
                      "space again.")

    def succeeded(self, name: str, lost: int = 0) -> None:
        if lost:
            self.lost[name] = self.lost.get(name, 0) + lost
        if self.failing.pop(name, None) is None or self.failing:
            return
        dropped = ", ".join(f"{n}: {b} bytes" for n, b in sorted(self.lost.items()))
        self.lost = {}
        self._say(f"[run] {self.path} is written again; " + (
            f"dropped while the disk refused them: {dropped}." if dropped else "nothing was lost."))

    @staticmethod
    def _say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


_HEALTH: dict[str, RunDirHealth] = {}


def health_of(run_dir: str) -> RunDirHealth:
    """The `RunDirHealth` of the run directory `run_dir` (one per directory in this process)."""
    key = os.path.abspath(run_dir)
    if key not in _HEALTH:
        _HEALTH[key] = RunDirHealth(run_dir)
    return _HEALTH[key]


def make_directory(path: str) -> bool:
    """`os.makedirs(path)`; whether it had to make it (it was not there: new, or removed under the run)."""
    if os.path.isdir(path):
        return False
    os.makedirs(path, exist_ok=True)
    return True


def _open_appended(path: str) -> int:
    """`path` opened for appending, and for reading where allowed (`AppendedFile._take_back` reads it back)."""
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    except PermissionError:  # a file of ours made write-only
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)


class AppendedFile:
    """A file the run appends to (console.log, metrics.jsonl) whose writes never raise. Bytes the file
    system refuses stay in memory (at most `limit`: beyond, the oldest whole lines are dropped and
    counted) and go out, in order and exactly once, ahead of the next append; `os.write` says how much
    of a write reached the file, so a partial write is neither lost nor repeated. A file removed under
    the run (its directory deleted) is made again at the next append, with what it held: its old
    descriptor still reads the removed file (`_take_back`)."""

    def __init__(self, path: str, health: RunDirHealth, limit: int = PENDING_LIMIT):
        self.path, self.name, self.health, self.limit = path, os.path.basename(path), health, limit
        self._fd: Optional[int] = None
        self._pending = bytearray()
        self._lost = 0
        self._removed = False  # the file was removed under the run and is not written again yet

    def append(self, text: str) -> None:
        self._pending += text.encode("utf-8", "replace")
        self._bound()
        self.flush()

    def _bound(self) -> None:
        """At most `limit` bytes pending: the oldest whole lines beyond it are dropped (and counted)."""
        if len(self._pending) > self.limit:
            cut = len(self._pending) - self.limit
            newline = self._pending.find(b"\n", cut)
            cut = len(self._pending) if newline < 0 else newline + 1
            self._lost += cut
            del self._pending[:cut]

    def flush(self) -> None:
        if not self._pending:
            return
        try:
            if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
                self._take_back()
            made = False
            if self._fd is None:
                made = make_directory(os.path.dirname(self.path) or ".")
                self._fd = _open_appended(self.path)
            while self._pending:
                del self._pending[:os.write(self._fd, self._pending)]
        except OSError as err:
            self.health.failed(self.name, err)
            return
        lost, self._lost = self._lost, 0
        self.health.succeeded(self.name, lost)
        made_again, self._removed = made and self._removed, False
        if made_again:
            self.health.made_again()

    def _take_back(self) -> None:
        """The file was removed (no link left): what it held (its last `limit` bytes) goes ahead of the pending
        bytes, to be written into the file made again; its descriptor is closed."""
        fd, self._fd = self._fd, None
        self._removed = True
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - self.limit)
            held = bytearray()
            while start + len(held) < size:
                chunk = os.pread(fd, size - start - len(held), start + len(held))
                if not chunk:
                    break
                held += chunk
            if start:  # from the first whole line on
                newline = held.find(b"\n")
                del held[:newline + 1 if newline >= 0 else len(held)]
            self._lost += size - len(held)
        except OSError:  # not readable (opened write-only by an older run): only the new lines are kept
            held = bytearray()
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pending[:0] = held
        self._bound()

    def catch_up(self) -> None:
        """Write the file again now if it was removed under the run (else that waits for the next append)."""
        with contextlib.suppress(OSError):
            if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
                self._take_back()
        self.flush()

    def reopen(self) -> None:
        """Open the file again at the next write (it was replaced)."""
        self.close(flush=False)

    def close(self, flush: bool = True) -> None:
        if flush:
            self.catch_up()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


# ------------------------------------------------------------------------------------------ console


class ConsoleLog:
    """Copies stdout and stderr into a file. Buffers in memory until `attach(path)` (the run
    directory is known only once the command line is validated), so a rejected command line
    leaves no file behind. Carriage-return redraws (progress bars) are not copied. A write the
    file system refuses never reaches the program (`AppendedFile`), and neither does a console
    that is closed or fails (`console.ConsoleStream`): the run warns once and goes on with
    console.log alone."""

    def __init__(self):
        self._buffer: list[str] = []
        self._file: Optional[AppendedFile] = None
        self._saved = None
        self._tees: tuple = ()
        self._console_warned = False
        self._line_open = False  # the last text kept ended inside a line
        self._deferred = ""      # a warning kept for the end of that line

    @classmethod
    def start(cls) -> "ConsoleLog":
        log = cls()
        ignore_sigpipe()
        log._saved = (sys.stdout, sys.stderr)
        log._tees = (ConsoleStream(sys.stdout, log, "stdout", 1), ConsoleStream(sys.stderr, log, "stderr", 2))
        sys.stdout, sys.stderr = log._tees
        for tee in log._tees:
            if tee.stream is None:  # started with the descriptor closed (`>&-`): Python gave it no stream
                if is_closed(tee.fd):
                    silence(tee.fd)  # so no file opened later takes its number and gets the console's bytes
                log.console_lost(tee.name, None)
        return log

    def console_lost(self, name: str, err: Optional[Exception]) -> None:
        """The console stream `name` failed (`err`; None: closed from the start): the first time, one line into
        the log and onto the stream that still works, if one does."""
        if self._console_warned:
            return
        self._console_warned = True
        if err is None or isinstance(err, ValueError):
            reason = "it is closed"
        else:
            reason = (err.strerror or str(err) or type(err).__name__).lower()
        where = self._file.path if self._file is not None else "the run directory's console.log"
        text = (f"[run] WARNING: cannot write {name} ({reason}); training goes on, and what it prints is kept "
                f"in {where}.\n")
        if self._line_open:  # print() failed between a line and its newline: the warning goes after that line
            self._deferred = text
        else:
            self.record(text)
        for tee in self._tees:
            tee.echo(text)
            tee.flush()

    def record(self, text: str) -> None:
        if "\r" in text:  # a progress bar (re)draw: keep only a complete line after the last \r
            text = text.rsplit("\r", 1)[1]
            if not text.endswith("\n") or not text.strip() or "\033[K" in text:
                return
        if not text:
            return
        self._keep(text)
        self._line_open = not text.endswith("\n")
        if self._deferred and not self._line_open:
            deferred, self._deferred = self._deferred, ""
            self._keep(deferred)

    def _keep(self, text: str) -> None:
        if self._file is not None:
            self._file.append(text)
        else:
            self._buffer.append(text)

    def attach(self, path: str) -> None:
        self._file = AppendedFile(path, health_of(os.path.dirname(path) or "."))
        buffered, self._buffer = "".join(self._buffer), []
        self._file.append(buffered)

    def stop(self) -> None:
        for tee in self._tees:  # what is still buffered, while a failure is still caught (not at exit)
            tee.flush()
        if self._deferred:  # the last line never ended
            self._keep("\n" + self._deferred)
            self._deferred = ""
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if self._file is not None:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------------------------------ writer


class RunWriter:
    """Writes the run directory (rank 0; a no-op elsewhere). No write raises: a failed one is told to
    the directory's `RunDirHealth` and done again at the next write of that file."""

    def __init__(self, path: str, *, active: bool = True, log=print):
        self.path = path
        self.active = active
        self.log = log
        self.records: list[dict] = []
        self._plot_warned = False
        self._written: dict[str, bytes] = {}  # files written whole, as last written (for `_write_again`)
        self._linked = False
        if active:
            self.health = health_of(path)
            self._had_directory = self._attempt(path, lambda: os.makedirs(path, exist_ok=True))
            self.metrics_path = os.path.join(path, "metrics.jsonl")
            self._metrics_file = AppendedFile(self.metrics_path, self.health)
            self.health.when_made_again(self._write_again)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _attempt(self, path: str, write) -> bool:
        """Run `write` (which writes `path`); a failure is reported to `health`, not raised."""
        name = os.path.relpath(path, self.path)
        try:
            write()
        except OSError as err:
            self.health.failed(name, err)
            return False
        self.health.succeeded(name)
        return True

    def _write(self, name: str, data: bytes) -> bool:
        path = self.file(name)
        if name != os.path.basename(self.metrics_path):  # metrics.jsonl is its appended file's to restore
            self._written[name] = data

        def write():
            if make_directory(self.path) and self._had_directory:  # removed under the run: everything comes back
                self.health.made_again()
            self._had_directory = True
            write_file(path, data)

        return self._attempt(path, write)

    def _write_again(self) -> None:
        """The run directory was made again (it was removed during the run): the files written whole, the
        `runs/latest` link and metrics.jsonl (from its appended file) are written anew."""
        for name, data in list(self._written.items()):
            self._attempt(self.file(name), lambda name=name, data=data: write_file(self.file(name), data))
        if self._linked:
            self.link_latest()
        self._metrics_file.catch_up()

    def write_args(self, args) -> None:
        if not self.active:
            return
        values = {k: v for k, v in sorted(vars(args).items())}
        self._write("args.json", (json.dumps(values, indent=2, default=_json_default) + "\n").encode())

    def link_latest(self) -> None:
        """runs/latest -> this run, when the run lives directly under the default root."""
        parent = os.path.dirname(os.path.normpath(self.path))
        if not self.active or os.path.normpath(parent) != DEFAULT_RUNS_ROOT:
            return
        link = os.path.join(parent, LATEST)
        if os.path.exists(link) and not os.path.islink(link):
            return  # someone's own directory: leave it alone
        self._linked = True
        tmp = f"{link}.tmp{os.getpid()}"

        def relink():
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.basename(os.path.normpath(self.path)), tmp)
            os.replace(tmp, link)

        self._attempt(link, relink)

    def metrics(self, record: dict) -> None:
        """Append one record (`iteration`, `split`, values) to metrics.jsonl."""
        if not self.active:
            return
        record = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}  # NaN -> null
        self.records.append(record)
        self._metrics_file.append(json.dumps(record, default=_json_default) + "\n")

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
        self._metrics_file.reopen()
        self._write("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept).encode())

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
        return self.file("metrics.png") if self._write("metrics.png", buffer.getvalue()) else None

    def write_summary(self, summary: dict) -> None:
        if not self.active:
            return
        self._write("summary.json", (json.dumps(summary, indent=2, default=_json_default) + "\n").encode())

    def close(self) -> None:
        """Write what metrics.jsonl still holds in memory (a last try) and close it."""
        if self.active:
            self._metrics_file.close()
            self.health.forget(self._write_again)


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
        names = os.listdir(self.path) if os.path.isdir(self.path) else []
        files = sorted(name + ("/" if os.path.isdir(self.file(name)) else "") for name in names
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
    checked = export_dir or (os.path.join(run_dir, "converted-hf") if checkpoint_dir is not None else None)
    if checked is not None:
        target = "" if embedded_target else f" --target {_shell_path(target_dir)}"
        steps.append(("check that vLLM and SGLang load it and serve it as trained; prints their serve commands",
                      f"{_tool('check_serving.py')} {_shell_path(checked)}{target}"))
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
