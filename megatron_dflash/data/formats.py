"""Dataset files and record formats: where records come from and what a record holds (docs/design.md §8 Data
path).

Files: JSONL (one record per non-blank line), JSON arrays (``[record, ...]``), Parquet, directories written by
the ``datasets`` library (``save_to_disk``) and directories holding such files (read in name order). JSONL and
JSON files may be gzip-compressed as published (``HumanEval.jsonl.gz``: the kind is the name without ``.gz``;
they are decompressed in memory once). Parquet and ``save_to_disk`` directories are read through ``datasets``
(memory-mapped Arrow), an optional dependency.

A JSON array cut or damaged mid-record (a download or a packaged copy that stops early) keeps its whole records
before the damage: the damage is one more record, unreadable, whose error names the byte where the array stops
being readable, so the one bad-records policy decides (fails by default; skipped and named under
``--bad-records skip``).

Records, detected one by one (`normalize_record`):

- OpenAI ``{"messages": [{"role", "content", "reasoning_content"?}, ...]}``; ``content`` a string or a list
  of parts of which the text parts (``{"type": "text", "text": ...}``) are kept, joined;
- ShareGPT ``{"conversations": [{"from": human|gpt|system|tool, "value": ...}, ...]}``;
- plain ``{"text": ...}``.

A record source (`open_records`) gives random access to the records of a path with a name for each
(``file:line`` for JSONL, ``file[index]`` otherwise), so a dataset keeps offsets, never the records. In a
directory of files, names starting with ``.`` or ``_`` are not data (staged copies, bookkeeping such as a
regeneration's ``_manifest.json``; the convention of Arrow and Spark datasets). `BadRecords` is the one
policy for records that cannot be used (fatal, or skipped and named up to a ceiling), for the datasets and the
tools alike. `read_records` yields ``(source_file, line_or_index, NormalizedRecord)`` for tools; `write_records`
writes normalized records back in any of the formats, each record's other fields kept, through
``common.atomic.write_file``. Nothing here loads torch.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import gzip
import hashlib
import io
import json
import os
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..common.atomic import file_sha256, write_file
from ..common.errors import DataError
from .chat import json_kind

__all__ = [
    "RECORD_STYLES",
    "BAD_RECORD_MODES",
    "DEFAULT_MAX_BAD_FRACTION",
    "SHAREGPT_ROLES",
    "SHOWN_BAD_RECORDS",
    "BadRecords",
    "NormalizedRecord",
    "normalize_record",
    "data_path_problem",
    "data_files",
    "data_sha256",
    "file_kind",
    "RecordSource",
    "open_records",
    "read_records",
    "write_records",
    "record_to_json",
    "need_datasets",
]

RECORD_STYLES = ("messages", "conversations", "text")
"""The record formats: OpenAI messages, ShareGPT conversations, plain text."""

BAD_RECORD_MODES = ("fail", "skip")
"""What a reader does with a record it cannot use: stop with its error, or skip it, named."""

DEFAULT_MAX_BAD_FRACTION = 0.01
"""With skipping: the data is refused when more than this fraction of its records are bad (a broken converter,
not a few odd records)."""

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
"""ShareGPT ``from`` values and the chat role each stands for."""

_TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
_FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_GZIP = ".gz"


@dataclasses.dataclass(frozen=True)
class NormalizedRecord:
    """One record in the one form the data path uses: ``messages`` (role / string content, and
    ``reasoning_content`` when the record had one) for chats, ``text`` for plain text; ``style`` is the
    format the record was written in (`RECORD_STYLES`); ``fields`` the record's other keys (an ``id``,
    metadata), written back by `write_records`."""

    style: str
    messages: Optional[list] = None
    text: Optional[str] = None
    fields: dict = dataclasses.field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _content_text(content, where: str):
    """A message's content as a string: list-of-parts content keeps its text parts, joined; anything
    else but a string is returned as is (and refused by ``chat.check_messages`` with the message named)."""
    if not isinstance(content, list):
        return content
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            shown = part.get("type") if isinstance(part, dict) else json_kind(part)
            raise DataError(f"{where}: content part {k} is {shown!r:.40}, not a text part ({{'type': 'text', "
                            "'text': ...}); only text is trained on.")
    return "".join(texts)


def _openai_messages(messages, where: str) -> list:
    out = []
    for j, message in enumerate(messages):
        if isinstance(message, dict):  # keys an Arrow table fills with null for the messages without them: gone
            message = {k: v for k, v in message.items() if v is not None or k in ("role", "content")}
            if "content" in message:
                message["content"] = _content_text(message["content"], f"{where}: message {j}")
        out.append(message)
    return out


def _sharegpt_messages(turns, where: str) -> list:
    out = []
    for j, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") is None and turn.get("role") is not None:  # ShareGPT files with OpenAI turns
            out.extend(_openai_messages([turn], f"{where} turn {j}"))
            continue
        if not isinstance(turn, dict) or turn.get("from") is None:
            raise DataError(f"{where}: turn {j} must be an object with a 'from', got {turn!r:.80}.")
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise DataError(f"{where}: turn {j}: 'from' is {json.dumps(turn['from'])[:40]}, not one of "
                            f"{', '.join(SHAREGPT_ROLES)}.")
        message = {"role": role, "content": _content_text(turn.get("value"), f"{where}: turn {j}")}
        if turn.get("reasoning_content") is not None:
            message["reasoning_content"] = turn["reasoning_content"]
        out.append(message)
    return out


def normalize_record(record: Any, where: str) -> NormalizedRecord:
    """The `NormalizedRecord` of a decoded record, its format detected by its key (``messages``,
    ``conversations`` or ``text``); a `DataError` naming ``where`` for anything else. Messages are only put in
    the one form here; whether they make a chat (roles, string contents) is ``chat.check_messages``'s call."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    present = [key for key in RECORD_STYLES if record.get(key) is not None]
    if len(present) != 1:
        what = "none" if not present else " and ".join(present)
        raise DataError(f"{where}: a record holds exactly one of 'messages' (OpenAI), 'conversations' (ShareGPT) "
                        f"or 'text'; this one has {what}.")
    style = present[0]
    value = record[style]
    fields = {key: v for key, v in record.items() if key not in RECORD_STYLES}  # Arrow's null columns too
    if style == "text":
        if not isinstance(value, str):
            raise DataError(f"{where}: no text (expected a string under 'text', got {json_kind(value)}).")
        return NormalizedRecord("text", text=value, fields=fields)
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: no messages (expected a non-empty list under '{style}').")
    messages = _openai_messages(value, where) if style == "messages" else _sharegpt_messages(value, where)
    return NormalizedRecord(style, messages=messages, fields=fields)


# --------------------------------------------------------------------------------------------------
# Record sources: random access to the records of a path
# --------------------------------------------------------------------------------------------------


def need_datasets(what: str):
    """The ``datasets`` module, or a one-line `DataError` saying what to install to read ``what``."""
    try:
        import datasets  # optional: only Parquet and save_to_disk directories need it
    except ImportError:
        raise DataError(f"reading {what} needs the 'datasets' package (and pyarrow): pip install datasets") from None
    return datasets


class RecordSource(abc.ABC):
    """The records of one path, by index: ``len``, ``where(i)`` (``file:line`` or ``file[i]``), ``raw(i)``
    (the bytes a sample ID hashes: the JSONL line, or the record's canonical JSON) and ``record(i)`` (the
    decoded record, a `DataError` naming it when it is not JSON)."""

    def __init__(self, path: str):
        self.path = path

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many records the path holds."""

    def where(self, index: int) -> str:
        return f"{self.path}[{index}]"

    def raw(self, index: int) -> bytes:
        return record_to_json(self.record(index)).encode("utf-8", "surrogatepass")

    @abc.abstractmethod
    def record(self, index: int) -> Any:
        """Record ``index``, decoded."""

    def location(self, index: int) -> tuple[str, int]:
        """(file, line) for JSONL, (file, index) otherwise."""
        return self.path, index


class _JSONLSource(RecordSource):
    """Byte offsets of the non-blank lines; a line is read and parsed when asked for. A gzip-compressed file
    is decompressed once and its lines read from memory (a compressed stream has no cheap seek)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._data = _gunzipped(path) if _is_gzip_name(path) else None
        offsets, lines = [], []
        with (io.BytesIO(self._data) if self._data is not None else open(path, "rb")) as f:
            lineno, offset = 0, 0
            for raw in f:
                lineno += 1
                if raw.strip():
                    offsets.append(offset)
                    lines.append(lineno)
                offset += len(raw)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._offsets)

    def location(self, index: int) -> tuple[str, int]:
        return self.path, int(self._lines[index])

    def where(self, index: int) -> str:
        return f"{self.path}:{int(self._lines[index])}"

    def raw(self, index: int) -> bytes:
        with (io.BytesIO(self._data) if self._data is not None else open(self.path, "rb")) as f:
            f.seek(int(self._offsets[index]))
            return f.readline().rstrip(b"\r\n")

    def record(self, index: int) -> Any:
        where = self.where(index)
        try:
            return json.loads(self.raw(index))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
            raise DataError(f"{where}: invalid JSON ({detail}).") from None
        except RecursionError:
            raise DataError(f"{where}: invalid JSON (nested deeper than the JSON parser can read).") from None


class _ListSource(RecordSource):
    """A JSON array, decoded whole (JSON arrays cannot be read a record at a time). An array cut or damaged
    mid-record keeps the whole records before the damage, and the damage is one more record that cannot be
    read (`record` raises a `DataError` naming the byte where the array stops being readable)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.damage: Optional[str] = None
        data = _gunzipped(path) if _is_gzip_name(path) else _read_bytes(path)
        try:
            records = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            if isinstance(err, json.JSONDecodeError) and err.msg == "Extra data":  # JSONL named .json
                raise DataError(f"{path}: not one JSON array (several JSON values): name a JSONL file .jsonl.") \
                    from None
            records, self.damage = _whole_records_of_array(data, path, err)
        if not isinstance(records, list):
            raise DataError(f"{path}: a .json data file holds an array of records, got {json_kind(records)}.")
        self._records = records

    def __len__(self) -> int:
        return len(self._records) + (self.damage is not None)

    def record(self, index: int) -> Any:
        if index == len(self._records) and self.damage is not None:
            raise DataError(self.damage)
        return self._records[index]


def _whole_records_of_array(data: bytes, path: str, err: Exception) -> tuple[list, str]:
    """The records of a JSON array that `json.loads` could not read whole, up to the first that does not
    decode, and the one line that says where the array stops being readable; a `DataError` when ``data`` is
    no array at all (nothing before the damage to keep)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise DataError(f"{path}: not UTF-8 text ({bad.reason} at byte {bad.start}).") from None
    decoder, records = json.JSONDecoder(), []
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        raise DataError(f"{path}: invalid JSON ({err}).") from None
    pos = _skip_space(text, pos + 1)
    while True:
        try:
            record, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as bad:
            detail = (bad.msg.removesuffix(" at").lower() if isinstance(bad, json.JSONDecodeError)
                      else "nested deeper than the JSON parser reads")
            break
        records.append(record)
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
            continue
        detail = "the array does not close" if pos >= len(text) else "expected ',' or ']' after a record"
        break
    where = len(text[:pos].encode("utf-8"))
    return records, (f"{path}[{len(records)}]: the JSON array is cut or damaged at byte {where} of {len(data)} "
                     f"({detail}); the {len(records)} whole records before it are readable, nothing from there on "
                     "(with --bad-records skip they are used).")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _is_gzip_name(path: str) -> bool:
    return path.lower().endswith(_GZIP)


def _gunzipped(path: str) -> bytes:
    """The decompressed bytes of a gzip file; a one-line `DataError` naming it when it is not one."""
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: not a readable gzip file ({err}); give the file as published, or gunzip it.") \
            from None


class _ArrowSource(RecordSource):
    """A ``datasets.Dataset`` (memory-mapped Arrow): Parquet files and ``save_to_disk`` directories."""

    def __init__(self, path: str, dataset):
        super().__init__(path)
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def record(self, index: int) -> Any:
        return self._dataset[int(index)]


class _ConcatSource(RecordSource):
    """The sources of a directory's files, one after the other."""

    def __init__(self, path: str, sources: Sequence[RecordSource]):
        super().__init__(path)
        self.sources = list(sources)
        self._starts = [0]
        for source in self.sources:
            self._starts.append(self._starts[-1] + len(source))

    def _find(self, index: int) -> tuple[RecordSource, int]:
        k = bisect.bisect_right(self._starts, index) - 1
        return self.sources[k], index - self._starts[k]

    def __len__(self) -> int:
        return self._starts[-1]

    def where(self, index: int) -> str:
        source, i = self._find(index)
        return source.where(i)

    def location(self, index: int) -> tuple[str, int]:
        source, i = self._find(index)
        return source.location(i)

    def raw(self, index: int) -> bytes:
        source, i = self._find(index)
        return source.raw(i)

    def record(self, index: int) -> Any:
        source, i = self._find(index)
        return source.record(i)


def _extension(path: str) -> str:
    """A data file's extension, ``.gz`` aside (``HumanEval.jsonl.gz`` -> ``.jsonl``)."""
    name = path[:-len(_GZIP)] if _is_gzip_name(path) else path
    return os.path.splitext(name)[1].lower()


def file_kind(path: str) -> str:
    """How a data file is read, by its extension (``.gz`` aside): ``jsonl`` (also any unknown extension),
    ``json`` or ``parquet``."""
    return _FILE_KINDS.get(_extension(path), "jsonl")


def _saved_dataset(path: str):
    """The ``datasets.Dataset`` a ``save_to_disk`` directory holds (one split)."""
    datasets = need_datasets(f"{path} (a directory written by datasets' save_to_disk)")
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = json.load(open(os.path.join(path, "dataset_dict.json"))).get("splits", [])
        raise DataError(f"{path} holds several splits ({', '.join(splits)}): give one split's folder, e.g. "
                        f"{os.path.join(path, splits[0] if splits else 'train')}.")
    return datasets.load_from_disk(path)


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _data_file_names(path: str) -> list:
    """The data files of a directory, in name order; names starting with ``.`` or ``_`` are not data."""
    return sorted(n for n in os.listdir(path)
                  if _extension(n) in _FILE_KINDS and not n.startswith((".", "_"))
                  and not (_is_gzip_name(n) and _extension(n) == ".parquet"))


def data_files(path: str) -> list:
    """Every file whose bytes make the records of ``path``, in a fixed order (what a fingerprint of the data
    hashes): the file itself, a directory's data files in name order, or all the files of a ``save_to_disk``
    directory in name order."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    if _is_saved_dataset(path):
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    else:
        names = _data_file_names(path)
    return [os.path.join(path, n) for n in names]


def data_sha256(path: str) -> str:
    """The fingerprint of the data at ``path``: its file's SHA-256, or for a directory one over the names and
    SHA-256s of all its data files in order (`data_files`). Every byte counts: a changed record anywhere changes it."""
    if not os.path.isdir(path):
        return file_sha256(path)
    h = hashlib.sha256()
    for file in data_files(path):
        h.update(f"{os.path.relpath(file, path)}\x00{file_sha256(file)}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def data_path_problem(path: str) -> Optional[str]:
    """Why ``path`` is no data file or directory this module reads (None: it is one). Cheap: the training
    arguments ask it before anything heavy loads."""
    if os.path.isdir(path):
        if _is_saved_dataset(path) or _data_file_names(path):
            return None
        return ("a data directory holds .jsonl, .json or .parquet files, the first two maybe gzipped (names not "
                "starting with '.' or '_'), "
                "or was written by datasets' save_to_disk; this one has none of them.")
    return None if os.path.isfile(path) else "no such data file or directory."


def open_records(path: str) -> RecordSource:
    """The `RecordSource` of a file or directory (see the module docstring for what is read)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _ArrowSource(path, _saved_dataset(path))
        problem = data_path_problem(path)
        if problem is not None:
            raise DataError(f"{path}: {problem}")
        return _ConcatSource(path, [open_records(os.path.join(path, n)) for n in _data_file_names(path)])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected a data file or directory).")
    kind = file_kind(path)
    if kind == "parquet" and _is_gzip_name(path):
        raise DataError(f"{path}: a gzip-compressed Parquet file; Parquet compresses its own pages: gunzip it.")
    if kind == "parquet":
        datasets = need_datasets(f"{path} (Parquet)")
        return _ArrowSource(path, datasets.Dataset.from_parquet(path))
    return _ListSource(path) if kind == "json" else _JSONLSource(path)


SHOWN_BAD_RECORDS = 10
"""Skipped records named one by one; the rest are counted."""


@dataclasses.dataclass(frozen=True)
class BadRecords:
    """The policy for records that cannot be used (not one of the formats, a message without a role, an
    empty conversation, content that is not a string, a turn order the chat template refuses; what counts as
    bad is the reader's ``check``).

    ``mode="fail"`` stops at the first one with its one-line error (file and line); ``"skip"`` names each
    (the first `SHOWN_BAD_RECORDS` of them, then their count) and leaves it out, unless more than
    ``max_fraction`` of the records are bad: then the data is refused (a converter that went wrong)."""

    mode: str = "fail"
    max_fraction: float = DEFAULT_MAX_BAD_FRACTION

    def __post_init__(self):
        if self.mode not in BAD_RECORD_MODES:
            raise ValueError(f"bad records: mode must be one of {', '.join(BAD_RECORD_MODES)}, got {self.mode!r}.")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"bad records: max_fraction must be in [0, 1], got {self.max_fraction!r}.")

    def scan(self, source: RecordSource, check: Callable[[Any, str], Any], log: Callable[[str], Any]) -> list:
        """Indices (in ``source``) of the records ``check(record, where)`` accepts (it raises `DataError` for
        a bad one); the bad ones fail, or are skipped and named through ``log``, by this policy."""
        kept, bad = [], []
        for index in range(len(source)):
            try:
                check(source.record(index), source.where(index))
                kept.append(index)
            except DataError as err:
                if self.mode == "fail":
                    raise
                bad.append(str(err))
        total = len(source)
        for message in bad[:SHOWN_BAD_RECORDS]:
            log(f"[data] skipped: {message}")
        if len(bad) > SHOWN_BAD_RECORDS:
            log(f"[data] skipped {len(bad) - SHOWN_BAD_RECORDS} more bad records of {source.path}.")
        if bad and len(bad) > self.max_fraction * total:
            raise DataError(f"{source.path}: {len(bad)} of {total} records are bad ({len(bad) / total:.1%}, more "
                            f"than --max-bad-fraction {self.max_fraction:g}); the first: {bad[0]}")
        if bad:
            log(f"[data] {source.path}: skipped {len(bad)} bad records of {total}.")
        return kept


def read_records(path: str, *, bad_records: Optional[BadRecords] = None,
                 check: Optional[Callable[[NormalizedRecord, str], Any]] = None,
                 log=print) -> Iterator[tuple[str, int, NormalizedRecord]]:
    """``(source_file, line_or_index, NormalizedRecord)`` of every usable record of ``path``: the line for JSONL
    (1-based), the index in its file otherwise. A record that is not one of the formats, or that ``check``
    (called with the normalized record and its name) refuses with a `DataError`, is bad: fatal or skipped by
    ``bad_records`` (default: fatal), all of them found before the first record is yielded."""
    policy = bad_records or BadRecords()
    source = open_records(path)

    def accept(record, where):
        normalized = normalize_record(record, where)
        if check is not None:
            check(normalized, where)
        return normalized

    for index in policy.scan(source, accept, log):
        file, line = source.location(index)
        yield file, line, normalize_record(source.record(index), source.where(index))


# --------------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------------


def record_to_json(record: Any) -> str:
    """A record's canonical JSON (sorted keys, no ASCII escaping): one JSONL line."""
    return json.dumps(record, ensure_ascii=False, sort_keys=True)


def _as_style(record: NormalizedRecord, style: str) -> dict:
    if not record.is_chat:
        if style != "text":
            raise ValueError(f"a text record cannot be written as {style!r}; write it with style='text'.")
        return {**record.fields, "text": record.text}
    if style == "messages":
        return {**record.fields, "messages": [dict(m) for m in record.messages]}
    if style == "conversations":
        turns = []
        for m in record.messages:
            turn = {"from": _TO_SHAREGPT[m["role"]], "value": m["content"]}
            if m.get("reasoning_content") is not None:
                turn["reasoning_content"] = m["reasoning_content"]
            turns.append(turn)
        return {**record.fields, "conversations": turns}
    raise ValueError(f"a chat record is written as 'messages' or 'conversations', not {style!r}.")


def _parquet_bytes(path: str, rows: list) -> bytes:
    need_datasets(f"{path} (Parquet)")
    import pyarrow as pa  # comes with datasets
    import pyarrow.parquet as pq

    columns = sorted({key for row in rows for key in row})  # from_pylist would take the first row's
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows]), sink)
    return sink.getvalue().to_pybytes()


def write_records(path: str, records: Iterable[NormalizedRecord], *, style: Optional[str] = "messages") -> int:
    """Write ``records`` to ``path`` in ``style`` (`RECORD_STYLES`; ``None``: each record in the style it was
    read in; text records always as ``text``), each with its other ``fields``, as JSONL, a JSON array
    (``.json``) or Parquet (``.parquet``, needs ``datasets``) by the file's extension, gzip-compressed when the
    name ends in ``.gz``; returns the count. The
    file appears whole or not at all (``common.atomic.write_file``)."""
    path = os.fspath(path)
    rows = [_as_style(r, "text" if not r.is_chat else (style or r.style)) for r in records]
    kind = file_kind(path)
    if kind == "parquet":
        data = _parquet_bytes(path, rows)
    elif kind == "json":
        data = json.dumps(rows, ensure_ascii=False, indent=1) + "\n"
    else:
        data = "".join(record_to_json(row) + "\n" for row in rows)
    data = data.encode("utf-8") if isinstance(data, str) else data
    if _is_gzip_name(path) and kind != "parquet":
        data = gzip.compress(data, mtime=0)  # mtime 0: the same records give the same bytes
    write_file(path, data)
    return len(rows)
