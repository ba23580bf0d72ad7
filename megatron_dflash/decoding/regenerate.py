"""Regeneration of a chat data set's answers with the target, resumable, in numbered shards.

A draft learns the target's distribution best from the target's own answers. `regenerate` strips
the assistant turns of every conversation and asks an answer back end (`decoding/local_answers.py`,
the target in this process; `decoding/server_answers.py`, an OpenAI-compatible server) for them, turn
by turn: the answer to turn `k` is part of the prompt of turn `k + 1`. A conversation that ends with a
user turn gets an answer to it as well (a prompts-only data set).

Output (docs/design.md §8 Data path, "Regenerating the answers with the target"):

    OUT/_manifest.json       input fingerprint, target, sampling settings, shard size and kind, policies
    OUT/shard-00000.jsonl    records [0, shard_size) in input order, then the next shard, ...
    OUT/_shard-00003.failed.json   a shard some of whose records kept failing (their ids and errors)

Shards are files of the input's kind (`.jsonl`, `.json` or `.parquet`; JSONL for a directory input), so OUT
is itself a data directory the training job reads (`--train-data OUT`: the names starting with `_` are not
data, `data.formats`). Every record is written in the style it was read in (OpenAI `messages` or ShareGPT
`conversations`), keeps its other fields and gets `finish_reason` ("stop", or "length" when an answer was cut
at `max_new_tokens`) and `generation` (the settings); an answer's thinking (a server's reasoning parser)
is its message's `reasoning_content`, as the readers take it. What becomes of a record with a cut answer is
`TRUNCATION_POLICIES`: left out (the default: a cut answer trained on would teach the draft that the target
stops there), ended with the cut answer (its later turns dropped, counted), or continued. A shard is written
whole (`common.atomic.write_file`) or not at all; shard `k` belongs to rank `k % world_size`, so ranks
never share a file, and one run at a time writes into OUT (`decoding/output_lock.py`). A rerun skips the
shards on disk, redoes the others, and refuses an output directory whose manifest differs (one line naming
the field; the target by its resolved path, not by how its path was spelled). Per-answer seeds come from
(seed, record id, turn), never from a rank, a batch or a position in a batch, so the output does not depend
on how many ranks or how large batches were.

Records are read and written by `data.formats` (every file kind and record style the training job reads;
bad records fail or are skipped by `formats.BadRecords`, as in training). Before a shard is generated, each
of its records is checked by the back end's `check_record` when it has one (`decoding/prompt_limits.py`:
the roles the training job accepts, the prompt within the target's context); an answer that cannot be a
record's (not valid Unicode, far longer than `max_new_tokens` allows, a prompt past the context at a later
turn) is a `RequestFailed(bad_answer=True)`: the record is named and, by the same rule, skipped or its
shard left undone while the others finish. No torch here: a rerun whose shards are all done, and the server
back end, start in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from typing import Callable, Optional, Protocol, Sequence

from ..common.atomic import remove_stale_siblings, write_file
from ..common.errors import DataError
from ..data.chat import CHAT_ROLES, check_messages, unicode_problem
from ..data.formats import BadRecords, NormalizedRecord, data_sha256, file_kind, open_records, \
    normalize_record, write_records
from .output_lock import lock_output

__all__ = [
    "MANIFEST", "MANIFEST_FORMAT", "TRUNCATION_POLICIES", "MAX_CHARS_PER_TOKEN", "Settings", "Request", "Answer",
    "RequestFailed", "AnswerBackend", "Summary", "read_chats", "record_id", "answer_seed", "conversation_turns",
    "answer_problem", "target_identity", "shard_path", "build_manifest", "check_manifest", "regenerate", "Progress",
    "DEFAULT_PROGRESS_INTERVAL",
]

MANIFEST = "_manifest.json"  # '_': not a data file of the output directory (data.formats)
MANIFEST_FORMAT = "megatron-dflash regenerated chats v3"
ASSISTANT = "assistant"
FINISH_REASONS = ("stop", "length")
TRUNCATION_POLICIES = ("skip-record", "drop-rest", "continue")
"""A record with an answer cut at `max_new_tokens`: left out; ended with the cut answer (its later turns
dropped); or its later turns asked all the same (the cut answer in their prompts). The record's
`finish_reason` is "length" in the last two."""
MAX_CHARS_PER_TOKEN = 64
"""An answer (text and thinking) longer than this many characters per `max_new_tokens` is no target's answer."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the answers are generated; all of it goes into the manifest and onto every record."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    chat_template_kwargs: Optional[dict] = None  # e.g. {"enable_thinking": true}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Request:
    """One answer to generate: the conversation so far (ends with a non-assistant turn) and its seed."""

    messages: list
    seed: int
    name: str  # the record id and the turn, for messages


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str  # "stop" or "length"
    tokens: int  # generated tokens (with the stop token)
    reasoning: Optional[str] = None  # the thinking a server's reasoning parser split off the text


@dataclasses.dataclass(frozen=True)
class RequestFailed:
    """A request that failed for good (after the back end's retries): the reason, one line. `bad_answer`:
    the record's own failure, which another try repeats (its prompt, or an answer that cannot be written);
    it is named and skipped or failed by the bad-records rule."""

    reason: str
    bad_answer: bool = False


class AnswerBackend(Protocol):
    def answer(self, requests: Sequence[Request]) -> list:
        """One `Answer` or `RequestFailed` per request, in order."""

    # Optional: `check_record(messages, where)` raises a `DataError` naming `where` for a record the target
    # cannot answer (`decoding/prompt_limits.PromptLimits.check_record`).


# ------------------------------------------------------------------------------ the records seam


def _regenerable(record: NormalizedRecord, where: str) -> None:
    """A record regeneration can answer: a chat (not a text record) of the chat roles with string contents."""
    if not record.is_chat:
        raise DataError(f"{where}: a text record has no turns to regenerate; give chat records (messages or "
                        "conversations).")
    check_messages(record.messages, where, CHAT_ROLES)
    if all(m["role"] == ASSISTANT for m in record.messages):
        raise DataError(f"{where}: no turn to answer (every message is the assistant's).")
    for name, value in record.fields.items():  # written back with the answers: a shard must be able to hold them
        problem = unicode_problem(json.dumps(value, ensure_ascii=False))
        if problem is not None:
            raise DataError(f"{where}: field {name!r} {problem}; the regenerated record could not be written.")


def read_chats(path: str, bad_records: Optional[BadRecords] = None, log=print) -> list:
    """``(index, where, NormalizedRecord)`` of the chat records of ``path`` (any file kind and record style of
    ``data.formats``; ``index`` is the record's place in the input, bad records counted; ``where`` its
    ``file:line``): the bad ones (not a chat, a message without a role, non-string content, ...) fail or are
    skipped by ``bad_records``."""
    source = open_records(path)

    def accept(raw, where):
        _regenerable(normalize_record(raw, where), where)

    kept = (bad_records or BadRecords()).scan(source, accept, log)
    return [(i, source.where(i), normalize_record(source.record(i), source.where(i))) for i in kept]


# ------------------------------------------------------------------------------ conversations


def record_id(record: NormalizedRecord, index: int) -> str:
    """The record's own `id` when it has one (a string or an integer), else its index in the input."""
    rid = record.fields.get("id")
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else str(index)


def answer_seed(seed: int, rid: str, turn: int) -> int:
    """The seed of turn `turn` of record `rid`: a hash of the three, below 2**31 (what servers accept)."""
    digest = hashlib.sha256(f"{seed}\x00{rid}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def conversation_turns(messages: list) -> list[list]:
    """The non-assistant messages of a conversation grouped by the assistant answer that follows them: one
    group per answer to generate (the assistant turns stripped; consecutive ones are one answer)."""
    groups, current = [], []
    for m in messages:
        if m["role"] == ASSISTANT:
            if current:
                groups.append(current)
                current = []
        else:
            current.append(m)
    if current:
        groups.append(current)
    return groups


def answer_problem(answer: Answer, settings: Settings) -> Optional[str]:
    """Why `answer` cannot be a record's answer (None: it can): a finish reason other than stop / length, text
    that is not valid Unicode (a lone surrogate a server's JSON escapes can carry), or more characters than
    `MAX_CHARS_PER_TOKEN` per `max_new_tokens` (a runaway server)."""
    if answer.finish_reason not in FINISH_REASONS:
        return f"finish_reason {answer.finish_reason!r} (expected one of {', '.join(FINISH_REASONS)})"
    size = len(answer.text) + len(answer.reasoning or "")
    if size > MAX_CHARS_PER_TOKEN * settings.max_new_tokens:
        return (f"the answer holds {size} characters, far beyond --max-new-tokens {settings.max_new_tokens} "
                f"(at most {MAX_CHARS_PER_TOKEN} per token)")
    for what, text in (("answer", answer.text), ("thinking", answer.reasoning or "")):
        problem = unicode_problem(text)
        if problem is not None:
            return f"the {what} {problem}"
    return None


class _Conversation:
    """One record being regenerated: its turns, the messages so far, and how it ended."""

    def __init__(self, record: NormalizedRecord, rid: str, truncated: str = "skip-record"):
        self.record, self.rid, self.truncated = record, rid, truncated
        self.turns = conversation_turns(record.messages)
        self.messages: list = []
        self.turn = 0
        self.cut = 0  # answers cut at max_new_tokens
        self.failure: Optional[RequestFailed] = None
        self.named = False  # the failure was logged when found
        self.where = f"record {rid}"  # its file:line, once known

    @property
    def finish_reason(self) -> str:
        return "length" if self.cut else "stop"

    @property
    def dropped_turns(self) -> int:
        """Turns never asked because an earlier answer was cut (drop-rest)."""
        return 0 if self.failure else len(self.turns) - self.turn

    def next_request(self, seed: int) -> Optional[Request]:
        if self.failure or (self.cut and self.truncated != "continue") or self.turn >= len(self.turns):
            return None
        self.messages += self.turns[self.turn]
        # the earlier answers' thinking stays out of the prompt (the record keeps it; templates drop it)
        prompt = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in self.messages]
        return Request(prompt, answer_seed(seed, self.rid, self.turn), f"record {self.rid} turn {self.turn}")

    def take(self, result, settings: Settings) -> int:
        """Record the answer of the current turn; returns the tokens it took."""
        if isinstance(result, Answer):
            problem = answer_problem(result, settings)
            if problem is not None:
                result = RequestFailed(problem, bad_answer=True)
        if isinstance(result, RequestFailed):
            reason = f"{self.where}: turn {self.turn}: {result.reason}" if result.bad_answer else result.reason
            self.failure = RequestFailed(reason, result.bad_answer)
            return 0
        message = {"role": ASSISTANT, "content": result.text}
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning
        self.messages.append(message)
        self.cut += result.finish_reason == "length"
        self.turn += 1
        return result.tokens

    def output(self, settings: Settings) -> NormalizedRecord:
        """The regenerated record, in its input's style, with its other fields, `finish_reason` and `generation`."""
        fields = {**self.record.fields, "finish_reason": self.finish_reason, "generation": settings.as_dict()}
        return NormalizedRecord(self.record.style, messages=self.messages, fields=fields)


def _regenerate_shard(conversations: list, backend: AnswerBackend, settings: Settings, progress) -> list:
    """The shard's conversations regenerated turn by turn across all its records."""
    while True:
        pending = [(c, c.next_request(settings.seed)) for c in conversations]
        pending = [(c, q) for c, q in pending if q is not None]
        if not pending:
            return conversations
        results = backend.answer([q for _, q in pending])
        tokens = sum(c.take(res, settings) for (c, _), res in zip(pending, results))
        progress.update(0, tokens)


# ------------------------------------------------------------------------------ manifest and shards


def shard_kind(input_path: str) -> str:
    """The output shards' file kind: the input file's (jsonl, json, parquet), JSONL for a directory input."""
    return "jsonl" if os.path.isdir(input_path) else file_kind(input_path)


def shard_path(output: str, shard: int, kind: str = "jsonl") -> str:
    return os.path.join(output, f"shard-{shard:05d}.{kind}")


def _failed_path(output: str, shard: int) -> str:
    return os.path.join(output, f"_shard-{shard:05d}.failed.json")



def input_sha256(path: str) -> str:
    """The fingerprint of the input (`data.formats.data_sha256`: the file's SHA-256, or a directory's over its
    data files): the digest a training run's target-state cache also records of its data."""
    return data_sha256(path)


def target_identity(target: str) -> str:
    """The target as the manifest names it: a local directory by its resolved path (so `./t`, `t/` and its
    absolute path are one target, a symbolic link the directory it leads to), anything else (a hub id, a
    server's model name) as given."""
    return os.path.realpath(target) if os.path.isdir(target) else target


def build_manifest(input_path: str, records: int, target: str, settings: Settings, shard_size: int,
                   truncated: str = "skip-record", bad_records: Optional[BadRecords] = None,
                   chat_template_sha256: Optional[str] = None) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "input_sha256": input_sha256(input_path),
        "input_records": records,
        "bad_records": (bad_records or BadRecords()).mode,
        "shard_kind": shard_kind(input_path),
        "target": target_identity(target),
        "chat_template_sha256": chat_template_sha256,
        "sampling": settings.as_dict(),
        "shard_size": shard_size,
        "truncated": truncated,
    }


def _first_difference(old, new, where: str = "") -> Optional[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = _first_difference(old.get(key), new.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    return None if old == new else f"{where} (was {json.dumps(old)}, now {json.dumps(new)})"


def check_manifest(output: str, manifest: dict, *, rank: int = 0, wait_s: float = 600.0) -> None:
    """Write `output/_manifest.json` (rank 0), or check the one there: a rerun must regenerate the same thing.
    The other ranks wait for rank 0's (up to `wait_s` seconds): one writer, so no rank removes another's
    staged copy."""
    path = os.path.join(output, MANIFEST)
    if rank == 0:
        remove_stale_siblings(path)
        if not os.path.exists(path):
            os.makedirs(output, exist_ok=True)
            write_file(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            return
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise DataError(f"rank {rank}: rank 0 wrote no {path} in {wait_s:.0f} s; see rank 0's error.")
        time.sleep(0.05)
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is unreadable ({err}); pass a new output directory.")
    diff = _first_difference(old, manifest)
    if diff:
        name = "input fingerprint (another or an edited input file)" if diff.startswith("input_") else diff
        raise DataError(f"{output} holds a regeneration with another {name}; rerun with the same settings or "
                        "pass a new output directory.")


# ------------------------------------------------------------------------------ the run


DEFAULT_PROGRESS_INTERVAL = 30.0
"""Seconds between progress lines when the output is no terminal (a log file, a pipe)."""


class Progress:
    """Records and tokens per second of one rank, on `stream`: a bar on a terminal; else a line at the end of
    each shard and at least every `interval` seconds, also while one `generate` call or one server turn runs
    for minutes (a background heartbeat says the run is alive and what it has done, so a log file is never
    silent for long). `unit`: what is counted ("records"; e.g. "prompts" for an evaluation)."""

    def __init__(self, total: int, label: str = "", stream=None, min_interval: float = 0.5,
                 interval: float = DEFAULT_PROGRESS_INTERVAL, unit: str = "records"):
        if not interval > 0:
            raise ValueError(f"progress interval must be > 0 seconds, got {interval!r}.")
        self.total, self.label, self.stream, self.unit = total, label, stream or sys.stderr, unit
        self.records = self.tokens = 0
        self.start = self.last = time.monotonic()
        self.min_interval, self.interval = min_interval, interval
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeat = None
        if not self.tty:
            self._heartbeat = threading.Thread(target=self._beat, name="regenerate-progress", daemon=True)
            self._heartbeat.start()

    def update(self, records: int, tokens: int, *, force: bool = False) -> None:
        with self._lock:
            self.records += records
            self.tokens += tokens
            now = time.monotonic()
            due = now - self.last >= (self.min_interval if self.tty else self.interval)
            if force or due:
                self._say(now)

    def _say(self, now: float) -> None:
        """One progress line (the caller holds the lock)."""
        self.last = now
        dt = max(now - self.start, 1e-9)
        width = 30
        filled = int(width * self.records / max(self.total, 1))
        line = (f"{self.label}[{'#' * filled}{'.' * (width - filled)}] {self.records}/{self.total} {self.unit} "
                f"{self.records / dt:.2f} {self.unit}/s {self.tokens / dt:.1f} tokens/s")
        if not self.tty:
            line += f" ({_elapsed(dt)})"
        try:
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed or failing log: progress is not worth stopping the run for
            pass

    def _beat(self) -> None:
        while not self._closed.wait(max(0.05, self.last + self.interval - time.monotonic())):
            with self._lock:
                now = time.monotonic()
                if now - self.last >= self.interval and not self._closed.is_set():
                    self._say(now)

    def close(self) -> None:
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.tty:
            print(file=self.stream, flush=True)


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d} elapsed"


@dataclasses.dataclass
class Summary:
    shards_written: int = 0
    shards_skipped: int = 0
    records_written: int = 0
    truncated: int = 0  # records with an answer cut at max_new_tokens (left out, ended or continued: the policy)
    dropped_turns: int = 0  # turns never asked after a cut answer (drop-rest)
    failed: list = dataclasses.field(default_factory=list)  # (record id, reason)
    skipped: list = dataclasses.field(default_factory=list)  # (record id, reason): bad records left out


def _checked(conversations: list, wheres: list, backend, bad_records: BadRecords, log) -> list:
    """The conversations the back end's `check_record` accepts; the others fail the run or are skipped and
    named, by `bad_records`."""
    check = getattr(backend, "check_record", None)
    if check is None:
        return conversations
    kept = []
    for c, where in zip(conversations, wheres):
        try:
            check(c.record.messages, where)
            kept.append(c)
        except DataError as err:
            if bad_records.mode == "fail":
                raise DataError(f"{str(err).rstrip('.')}; --bad-records skip leaves such records out.") from None
            log(f"[data] skipped: {err}")
            c.failure, c.named = RequestFailed(str(err), bad_answer=True), True
    return kept


def _finish_shard(output, shard, kind, conversations, settings, truncated, bad_records, summary, log) -> None:
    bad = [c for c in conversations if c.failure and c.failure.bad_answer and bad_records.mode == "skip"]
    for c in bad:
        if not c.named:
            log(f"[data] skipped: record {c.rid}: {c.failure.reason}")  # the reason names its file:line
    summary.skipped += [(c.rid, c.failure.reason) for c in bad]
    failed = [(c.rid, c.failure.reason + ("; --bad-records skip leaves the record out" if c.failure.bad_answer else ""))
              for c in conversations if c.failure and c not in bad]
    done = [c for c in conversations if not c.failure]
    if failed:
        summary.failed += failed
        write_file(_failed_path(output, shard), json.dumps(
            [{"id": rid, "error": reason} for rid, reason in failed], indent=1) + "\n")
        return  # the shard stays undone: a rerun retries it whole
    kept = [c.output(settings) for c in done if not (truncated == "skip-record" and c.cut)]
    write_records(shard_path(output, shard, kind), kept, style=None)  # each record in its input's style
    if os.path.exists(_failed_path(output, shard)):
        os.unlink(_failed_path(output, shard))
    summary.shards_written += 1
    summary.records_written += len(kept)
    summary.truncated += sum(bool(c.cut) for c in done)
    summary.dropped_turns += sum(c.dropped_turns for c in done) if truncated == "drop-rest" else 0


def regenerate(input_path: str, output: str, backend: Callable[[], AnswerBackend], settings: Settings, *,
               target: str, shard_size: int = 1000, truncated: str = "skip-record", rank: int = 0,
               world_size: int = 1, progress_stream=None, bad_records: Optional[BadRecords] = None,
               chat_template_sha256: Optional[str] = None,
               progress_interval: float = DEFAULT_PROGRESS_INTERVAL) -> Summary:
    """Regenerate the answers of `input_path` (a data file or directory, `data.formats`) into `output` (this
    rank's shards, under this rank's lock of `output`); `backend` is called once, only when a shard remains
    to do. `target` names the model in the manifest (a directory by its resolved path); `truncated` is one of
    `TRUNCATION_POLICIES`; `bad_records` says what becomes of records that are no chat, that the back end's
    `check_record` refuses or whose answer is bad (default: fatal); `progress_interval`: the seconds between
    progress lines when `progress_stream` is no terminal."""
    if shard_size < 1:
        raise ValueError(f"shard size must be at least 1, got {shard_size}.")
    if truncated not in TRUNCATION_POLICIES:
        raise ValueError(f"truncated must be one of {', '.join(TRUNCATION_POLICIES)}, got {truncated!r}.")
    bad_records = bad_records or BadRecords()
    stream = progress_stream or sys.stderr
    log = lambda line: print(line, file=stream, flush=True)  # noqa: E731
    lock = lock_output(output, rank, log)
    try:
        quiet = lambda line: None  # noqa: E731 - the skipped records are named once, by rank 0
        chats = read_chats(input_path, bad_records, log=log if rank == 0 else quiet)
        check_manifest(output, build_manifest(input_path, len(chats), target, settings, shard_size, truncated,
                                              bad_records, chat_template_sha256), rank=rank)
        return _run_shards(chats, output, shard_kind(input_path), backend, settings, shard_size, truncated,
                           bad_records, rank, world_size, progress_stream, log, progress_interval)
    finally:
        lock.release()


def _run_shards(chats, output, kind, backend, settings, shard_size, truncated, bad_records, rank, world_size,
                progress_stream, log, progress_interval: float) -> Summary:
    shards = range(rank, (len(chats) + shard_size - 1) // shard_size, world_size)
    summary = Summary()
    todo = [k for k in shards if not os.path.exists(shard_path(output, k, kind))]
    summary.shards_skipped = len(shards) - len(todo)
    if not todo:
        return summary
    answers = backend()
    label = f"rank {rank}: " if world_size > 1 else ""
    progress = Progress(sum(len(chats[k * shard_size:(k + 1) * shard_size]) for k in todo), label, progress_stream,
                        interval=progress_interval)
    try:
        _answer_shards(todo, chats, output, kind, answers, settings, shard_size, truncated, bad_records, summary,
                       progress, log)
    finally:
        progress.close()
    return summary


def _answer_shards(todo, chats, output, kind, answers, settings, shard_size, truncated, bad_records, summary,
                   progress, log) -> None:
    for k in todo:
        remove_stale_siblings(shard_path(output, k, kind))  # a staged copy a killed run left
        part = chats[k * shard_size:(k + 1) * shard_size]
        conversations = [_Conversation(r, record_id(r, i), truncated) for i, _, r in part]
        for c, (_, where, _) in zip(conversations, part):
            c.where = where
        _regenerate_shard(_checked(conversations, [w for _, w, _ in part], answers, bad_records, log), answers,
                          settings, progress)
        _finish_shard(output, k, kind, conversations, settings, truncated, bad_records, summary, log)
        if len(summary.skipped) > bad_records.max_fraction * len(chats):
            raise DataError(f"{len(summary.skipped)} of {len(chats)} records were left out as bad (more than "
                            f"--max-bad-fraction {bad_records.max_fraction:g}); the first: record "
                            f"{summary.skipped[0][0]}: {summary.skipped[0][1]}")
        progress.update(len(part), 0, force=True)
