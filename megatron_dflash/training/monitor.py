"""Console / TensorBoard / W&B logging and the progress bar, on rank 0 only.

TensorBoard uses `torch.utils.tensorboard` when the `tensorboard` package is installed and is
skipped with one message otherwise; a write of it that fails (a full disk) warns once and never
stops training, later scalars are tried again (docs/design.md §14). W&B is imported only when
`--wandb-project` is given. The
progress bar is tqdm's when installed, else a small one of our own (only on a terminal).
"""

from __future__ import annotations

import re
import sys
import time
from typing import Optional

__all__ = ["Monitor", "format_metrics", "labelled", "ACCEPTANCE_LABELS", "TRAIN_ACCEPTANCE", "VALID_ACCEPTANCE",
           "DECODE_ACCEPTANCE", "DECODE_TOKENS_PER_FORWARD"]

# One name per acceptance figure, used on the console, in metrics.jsonl, the plot, TensorBoard/W&B
# and the README. They measure different things:
# * train / valid acceptance (teacher-forced): per training block, 1 + the number of consecutive
#   correct draft predictions from slot 1, with the true tokens as context (the training loss's
#   blocks; valid: on held-out data, no gradient);
# * decode acceptance length (speculative decoding): committed tokens per verify cycle when the
#   draft really drafts for the target (greedy), on held-out prompts: the number that sets speed.
TRAIN_ACCEPTANCE = "train acceptance (teacher-forced)"
VALID_ACCEPTANCE = "valid acceptance (teacher-forced)"
DECODE_ACCEPTANCE = "decode acceptance length (speculative decoding)"
DECODE_TOKENS_PER_FORWARD = "decode tokens per target forward"
ACCEPTANCE_LABELS = {"train": TRAIN_ACCEPTANCE, "valid": VALID_ACCEPTANCE}


def labelled(values: dict, split: str) -> dict:
    """`values` with the block-acceptance statistic ("acceptance") under the label of `split`."""
    label = ACCEPTANCE_LABELS[split]
    return {(label if key == "acceptance" else key): value for key, value in values.items()}


def _tag(prefix: str, key: str) -> str:
    """TensorBoard / W&B tag: `train/acceptance_teacher_forced` for "train acceptance (teacher-forced)"."""
    if key.startswith(prefix + " "):
        key = key[len(prefix) + 1:]
    return f"{prefix}/" + re.sub(r"[^0-9A-Za-z]+", "_", key).strip("_")


def format_metrics(values: dict) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            if key in ("learning rate",):
                parts.append(f"{key}: {value:.3E}")
            elif abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3):
                parts.append(f"{key}: {value:.4E}")
            else:
                parts.append(f"{key}: {value:.4f}")
        else:
            parts.append(f"{key}: {value}")
    return " | ".join(parts)


class _SimpleBar:
    """A one-line progress bar on stderr (terminals only)."""

    def __init__(self, total: int, initial: int = 0):
        self.total, self.n = total, initial
        self.enabled = sys.stderr.isatty()
        self.postfix = ""
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * self.n / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {self.postfix}\033[K")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if refresh:
            self._draw()

    def write(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
        print(text, flush=True)
        self._draw()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class Monitor:
    """Everything that reports progress. Methods are no-ops on ranks other than 0."""

    def __init__(self, args, *, rank: int, total_iters: int, start_iter: int = 0, config: Optional[dict] = None):
        self.rank = rank
        self.active = rank == 0
        self.tb = None
        self.wandb = None
        self.bar = None
        self._tb_failing = False
        self.start_time = time.time()
        if not self.active:
            return
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)
            except ImportError:
                self.print("[monitor] --tensorboard-dir given but the 'tensorboard' package is not installed; "
                           "TensorBoard logging is skipped (pip install tensorboard).")
        if args.wandb_project:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, config=config or {},
                                    dir=args.tensorboard_dir or None)
        if not args.no_progress_bar and total_iters > start_iter:
            try:
                from tqdm.auto import tqdm

                # disable=None: no bar when stderr is not a terminal (a log file gets the log lines only)
                self.bar = tqdm(total=total_iters, initial=start_iter, desc="training", unit="it",
                                dynamic_ncols=True, file=sys.stderr, disable=None)
            except ImportError:
                self.bar = _SimpleBar(total_iters, start_iter)

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, postfix: Optional[str] = None) -> None:
        if self.bar is not None:
            if postfix is not None:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)

    def scalars(self, values: dict, step: int, prefix: str = "train") -> None:
        if not self.active:
            return
        if self.tb is not None:
            self._tensorboard(lambda: [self.tb.add_scalar(_tag(prefix, key), value, step)
                                       for key, value in values.items() if isinstance(value, (int, float))])
        if self.wandb is not None:
            self.wandb.log({_tag(prefix, k): v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def _tensorboard(self, write) -> None:
        """Run a TensorBoard write; one that the file system refuses warns once (until one works again)."""
        try:
            write()
        except OSError as err:
            if not self._tb_failing:
                self.print(f"[monitor] WARNING: cannot write TensorBoard events ({err.strerror or err}); training "
                           "goes on, the scalars of the steps meanwhile are missing there.")
            self._tb_failing = True
            return
        self._tb_failing = False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self._tensorboard(self.tb.flush)
            self._tensorboard(self.tb.close)
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
