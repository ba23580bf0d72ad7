"""A console stream (stdout, stderr) that never stops the program: a write that fails (the stream closed, its
reader gone: EPIPE under `| head`, its terminal lost: EIO) gives the stream up for good, points its descriptor at
os.devnull so nothing buffered for it and no flush at exit fails later, and tells its sink once
(docs/design.md §14 Reliability guarantees). `rundir.ConsoleLog` copies both streams into console.log through it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import threading
from typing import Optional

__all__ = ["CONSOLE_FAILURES", "ConsoleStream", "silence", "ignore_sigpipe", "is_closed"]

# A console stream that cannot take a write: closed (a `ValueError` from the file object), its reader gone
# (EPIPE: `| head`), its terminal lost (EIO), or any other OSError of the descriptor.
CONSOLE_FAILURES = (OSError, ValueError)


def silence(fd: Optional[int]) -> None:
    """Point the descriptor `fd` of a console stream that failed at os.devnull: what is still buffered for it,
    later writes through any handle of it and Python's flush at exit then succeed instead of raising."""
    if fd is None:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    if devnull == fd:  # `fd` was closed: devnull took its number, which is what was wanted
        return
    with contextlib.suppress(OSError):
        os.dup2(devnull, fd)
    os.close(devnull)


class ConsoleStream(io.TextIOBase):
    """One console stream (stdout or stderr, `stream`; `fd` its standard descriptor) whose every write is also
    given to `sink.record` (`rundir.ConsoleLog`: console.log). A stream that fails (`CONSOLE_FAILURES`) is given
    up for good: its descriptor is silenced (`silence`), `sink.console_lost` is told (it warns once) and every
    later write goes to the sink only, so a closed or failing console never stops the program. `stream` None:
    closed from the start (Python gives a closed descriptor no stream)."""

    def __init__(self, stream, sink, name: str, fd: int):
        self.stream, self.sink, self.name, self.fd = stream, sink, name, fd
        self.alive = stream is not None

    def write(self, text: str) -> int:
        self.sink.record(text)
        self.echo(text)
        return len(text)

    def echo(self, text: str) -> None:
        """`text` onto the console stream only (not into the log), if it still works."""
        if not self.alive:
            return
        try:
            try:
                self.stream.write(text)
            except UnicodeEncodeError:  # a console that cannot show a character: show the rest
                encoding = self.encoding or "ascii"
                self.stream.write(text.encode(encoding, "replace").decode(encoding))
        except CONSOLE_FAILURES as err:
            self._lost(err)

    def flush(self) -> None:
        if not self.alive:
            return
        try:
            self.stream.flush()
        except CONSOLE_FAILURES as err:
            self._lost(err)

    def _lost(self, err: Exception) -> None:
        self.alive = False
        try:
            fd = self.stream.fileno()
        except CONSOLE_FAILURES:
            fd = None  # not a descriptor of its own (a test's capture): nothing to silence
        silence(fd)
        self.sink.console_lost(self.name, err)

    def isatty(self) -> bool:
        if not self.alive:
            return False
        try:
            return self.stream.isatty()
        except CONSOLE_FAILURES:
            return False

    def fileno(self) -> int:
        if self.stream is None:
            raise io.UnsupportedOperation(f"{self.name} is closed")
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", None) or "utf-8"


def ignore_sigpipe() -> None:
    """A reader that goes away (`| head`) must end writes with EPIPE, which `ConsoleStream` handles, not the
    process: Python ignores SIGPIPE at start-up, but a library or a launcher may have restored the default
    (terminate)."""
    if hasattr(signal, "SIGPIPE") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def is_closed(fd: int) -> bool:
    """Whether the descriptor `fd` is not open (EBADF)."""
    try:
        os.fstat(fd)
    except OSError as err:
        return err.errno == errno.EBADF
    return False
