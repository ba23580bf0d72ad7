"""The run directory's console log when the console itself fails: a lost terminal (EIO), a console that cannot
show a character."""

import errno
import io
import os
import sys

from megatron_dflash.training.rundir import ConsoleLog


class _Terminal(io.StringIO):
    """A console that takes `ok` writes, then fails every one as a lost terminal does (EIO)."""

    def __init__(self, ok: int, encoding: str = "utf-8"):
        super().__init__()
        self.ok, self._encoding = ok, encoding

    @property
    def encoding(self):
        return self._encoding

    def write(self, text):
        text.encode(self._encoding)  # UnicodeEncodeError for a character this console cannot show
        if self.ok <= 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.ok -= 1
        return super().write(text)


def test_a_lost_terminal_is_told_once_and_the_log_keeps_everything(tmp_path, monkeypatch):
    terminal, stderr = _Terminal(ok=2), io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", stderr)
    log = ConsoleLog.start()
    try:
        print("a")        # two writes: the line and its newline
        print("b")        # the terminal is lost here, inside the line
        print("c", flush=True)
        log.attach(str(tmp_path / "console.log"))
        print("d", flush=True)
        print("e", file=sys.stderr, flush=True)
    finally:
        log.stop()
    warning = ("[run] WARNING: cannot write stdout (input/output error); training goes on, and what it prints is "
               "kept in the run directory's console.log.\n")
    assert (tmp_path / "console.log").read_text() == "a\nb\n" + warning + "c\nd\ne\n"
    assert terminal.getvalue() == "a\n" and stderr.getvalue() == warning + "e\n"
    assert sys.stdout is terminal and sys.stderr is stderr


def test_a_character_the_console_cannot_show_is_replaced_there_only(tmp_path, monkeypatch):
    terminal = _Terminal(ok=10, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", terminal)
    log = ConsoleLog.start()
    try:
        log.attach(str(tmp_path / "console.log"))
        print("loss \u2193 0.5")
        print("next")
    finally:
        log.stop()
    assert terminal.getvalue() == "loss ? 0.5\nnext\n"
    assert (tmp_path / "console.log").read_text(encoding="utf-8") == "loss \u2193 0.5\nnext\n"
