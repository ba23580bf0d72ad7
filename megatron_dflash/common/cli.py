"""What every command-line entry point shares: quiet dependencies, help text, usage errors.

* `quiet_dependency_warnings()` silences the warnings that are known to be harmless here, each
  one by category, module and message (nothing else is filtered), and keeps progress bars of
  transformers / huggingface_hub out of output that is not a terminal (log files, pipes).
* `ArgumentParser` is `argparse.ArgumentParser` with one convention for every tool: each
  default is shown in `--help` exactly once (`DefaultsOnceFormatter`), a usage error is one
  line plus a "did you mean" suggestion for a mistyped flag (no usage block), exit status 2.
* `usage_error(prog, message)` ends a tool the same way for errors found after parsing (a
  missing path, a bad file); `usage_status` prints the same line and returns 2, for a `main` that
  returns its exit status; `require_*` check paths without importing anything heavy.

This module imports only the standard library (and `atomic`, which does too), so a tool can parse and check its command
line in a fraction of a second, before torch / megatron / transformers load.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
import sys
import warnings
from typing import NoReturn, Optional

from .atomic import as_no_space

__all__ = [
    "HARMLESS_WARNINGS",
    "quiet_dependency_warnings",
    "DefaultsOnceFormatter",
    "ArgumentParser",
    "UsageError",
    "usage_error",
    "usage_status",
    "report_failure",
    "is_no_space",
    "report_interrupt",
    "INTERRUPTED_EXIT_STATUS",
    "DEBUG_ENV",
    "suggest_option",
    "require_file",
    "require_dir",
    "require_output_file",
    "json_object_option",
]

USAGE_EXIT_CODE = 2  # every tool: a bad command line or input path
INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a program ended by Ctrl-C

# (category, module regex, message regex) of warnings that say nothing actionable on a
# supported installation:
# * megatron-core warns at import time on every machine without Transformer Engine and Apex
#   (always the case on CPU; never install TE there) that it falls back to local kernels.
# * megatron-core's torch_dist loader calls torch's deprecated `load_state_dict` once per load.
# * megatron-core 0.16's own default (`cuda_graph_scope="full"`) warns in every TransformerConfig.
HARMLESS_WARNINGS = (
    (UserWarning, r"megatron\.core(\..*)?$", r"Transformer Engine and Apex are not installed"),
    (FutureWarning, r"megatron\.core\.dist_checkpointing(\..*)?$", r"`load_state_dict` is deprecated"),
    (UserWarning, r"megatron\.core\.transformer\.transformer_config$", r"full scope is deprecated"),
)


def quiet_dependency_warnings(stream=None) -> None:
    """Filter `HARMLESS_WARNINGS`; without a terminal on `stream`, disable HF progress bars."""
    for category, module, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    stream = sys.stderr if stream is None else stream
    if not _isatty(stream):
        # Read by huggingface_hub when it is imported (transformers takes its bars from there).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ help


_NO_HELP = "\x00"


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless its help already names the default.

    Options without help text get the default too; flags (`store_true`), `None` defaults and
    positional arguments get nothing (there is no value to show).
    """

    def _format_action(self, action):
        if not action.help and self._default_text(action):
            # argparse prints a help column only for a non-blank help: give it a placeholder
            # that `_get_help_string` replaces by the default.
            action = copy.copy(action)
            action.help = _NO_HELP
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = "" if action.help in (None, _NO_HELP) else action.help
        default = self._default_text(action)
        if default and "default" not in text.lower():
            text = f"{text} ({default})" if text else f"({default})"
        return text

    @staticmethod
    def _default_text(action) -> Optional[str]:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return None
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            return None  # store_true / store_false / help / version / count: nothing to show
        return "default: %(default)s"


# ------------------------------------------------------------------------------------------ errors


class UsageError(ValueError):
    """A bad command line or a bad input path/file: reported in one line, exit status 2."""


DEBUG_ENV = "MEGATRON_DFLASH_DEBUG"  # set to 1 for the traceback of expected failures too


def report_failure(prog: str, err: BaseException, *, debug: bool = False) -> None:
    """Print an expected failure as one `prog: error: message` line on stderr, after its traceback
    when `debug` or `$MEGATRON_DFLASH_DEBUG` asks for it. Call it from an `except` block.

    An error that a full file system caused, in whatever shape its writer raised it, is said as
    `common.atomic.NoSpaceError` says it (the path and "no space left on device")."""
    if debug or os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes"):
        import traceback

        traceback.print_exc()
    err = as_no_space(err) or err
    print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)


def is_no_space(err: BaseException) -> bool:
    """Whether a full file system caused `err` (an expected failure, for an entry point's `except`)."""
    return as_no_space(err) is not None


def report_interrupt(prog: str, where: str = "") -> int:
    """Print a Ctrl-C (KeyboardInterrupt) as one `prog: interrupted (SIGINT) ...` line on stderr instead of
    its traceback; returns `INTERRUPTED_EXIT_STATUS`. Call it from an `except KeyboardInterrupt` block."""
    print(f"{prog}: interrupted (SIGINT){' ' + where if where else ''}.", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT_STATUS


def usage_status(prog: str, message, stream=None) -> int:
    """Print `prog: error: message` (one line) and return the usage exit status 2: for an entry point whose
    `main` returns its status (``except UsageError as err: return usage_status(PROG, err)``)."""
    stream = sys.stderr if stream is None else stream
    print(f"{prog}: error: {message}", file=stream, flush=True)
    return USAGE_EXIT_CODE


def usage_error(prog: str, message: str, stream=None) -> NoReturn:
    """Print `prog: error: message` (one line) and exit with status 2."""
    sys.exit(usage_status(prog, message, stream))


def suggest_option(word: str, options) -> Optional[str]:
    """The closest known option to a mistyped `--flag` (or `--flag=value`), if any is close."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    matches = difflib.get_close_matches(flag, sorted(set(options)), n=1, cutoff=0.75)
    return matches[0] if matches else None


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `parser` and of its sub-commands."""
    out = []
    for action in parser._actions:
        out.extend(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(_option_strings(sub))
    return out


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `DefaultsOnceFormatter` and one-line usage errors.

    A usage error prints `prog: error: ...`, a "did you mean --x?" for each mistyped option,
    and a pointer to `--help` (not the whole usage block), then exits with status 2.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsOnceFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        guesses = []
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            options = _option_strings(self)
            guesses = [g for g in (suggest_option(w, options) for w in unknown.group(1).split()) if g]
        if guesses:
            message += f" (did you mean {' / '.join(dict.fromkeys(guesses))}?)"
        usage_error(self.prog, f"{message}; see '{self.prog} --help'.")


def require_file(flag: str, path: str, what: str = "file") -> None:
    """Raise `UsageError` unless `path` is an existing file."""
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such {what}.")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: not a {what} (a directory?).")


def require_dir(flag: str, path: str, what: str = "directory", must_contain: Optional[str] = None) -> None:
    """Raise `UsageError` unless `path` is a directory (holding `must_contain`, when given)."""
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such {what}.")
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory.")
    if must_contain is not None and not os.path.exists(os.path.join(path, must_contain)):
        raise UsageError(f"{flag} {path}: no {must_contain} in it; expected a {what}.")


def require_output_file(flag: str, path: str) -> None:
    """Raise `UsageError` unless `path` can be written as a file: not a directory, and a missing parent can be
    made (the first existing ancestor a writable directory). Checked before the work whose result it holds."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; give a file name (e.g. {os.path.join(path, 'out.json')}).")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag} {path} cannot be written: {ancestor} is a file, not a directory; choose another "
                         "path.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path} cannot be written: {ancestor} is not writable by this user; choose another "
                         "path.")


def json_object_option(flag: str, text: Optional[str], example: str = '{"enable_thinking": false}') -> dict:
    """The value of an option that takes a JSON object (``--chat-template-kwargs``), decoded: ``{}`` when the
    option is absent, `UsageError` naming the flag when it is no JSON or no object. The one reading of such
    an option for the training job and every tool."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag} is not JSON ({err.msg} at column {err.colno}): give a JSON object, e.g. "
                         f"'{example}'.") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object, got {type(value).__name__}; e.g. '{example}'.")
    return value
