"""Datasets, packing, collation, a DP-aware sampler and Megatron GPT batches.

Everything here produces or consumes one batch format, a Megatron-style dict of tensors:

=================  ===========  =================================================================
key                shape/dtype  meaning
=================  ===========  =================================================================
``tokens``         [B, S] long  token ids; padding = the tokenizer's pad id
``loss_mask``      [B, S] bool  supervised tokens (assistant turns for chat, every real token for
                                text); False on padding
``position_ids``   [B, S] long  RoPE positions, restarting at 0 at every packed document
                                (padding continues the count of the row's last document)
``document_ids``   [B, S] long  document of each token: 0, 1, ... per packed document, 0 for every
                                real token of an unpacked row, -1 on padding
``sample_ids``     [B] int64    stable, unique ID of the row (see ``stable_sample_id``)
=================  ===========  =================================================================

``plan.data_hook.attach_dflash_plan`` adds the batch plan to such a batch.

Determinism: datasets are map-style and a pure function of their files / seed; sample IDs are hashes
of (dataset kind, name, index, content), never of Python's randomised ``hash``; the sampler's order is
a pure function of ``(seed, epoch)`` and resumes exactly at any optimizer step.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..common.errors import DataError
from ..common.hashing import M32 as _M32
from ..common.hashing import absorb, hash_elements, mix32
from ..embedded_job.synthetic_corpus import conversations

__all__ = [
    "Sample",
    "PackedRow",
    "stable_sample_id",
    "tokenize_chat",
    "CHAT_ROLES",
    "chat_roles",
    "check_messages",
    "CHARS_PER_TOKEN",
    "record_budget",
    "one_line_error",
    "ChatJSONLDataset",
    "TextJSONLDataset",
    "IndexedDataset",
    "SyntheticChatDataset",
    "pack_samples",
    "collate",
    "Collator",
    "MicroBatchIterator",
    "content_sample_ids",
    "from_megatron_gpt_batch",
    "template_has_generation_markers",
    "assistant_mask_from_prefixes",
]

_INT63 = (1 << 63) - 1


# --------------------------------------------------------------------------------------------------
# Samples and their IDs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One tokenised document.

    Attributes:
        input_ids: [L] int64 token ids, 1 <= L <= seq_length of the dataset.
        loss_mask: [L] bool, True on supervised tokens.
        sample_id: stable non-negative int63 ID (see ``stable_sample_id``).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_id: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class PackedRow:
    """Documents packed into one row (unpadded, length <= seq_length).

    Attributes:
        input_ids, loss_mask: [L] concatenation of the documents.
        position_ids: [L] int64, restarting at 0 at each document.
        document_ids: [L] int64, 0, 1, ... in the order the documents were placed (contiguous runs).
        sample_id: ID of the row: the document's own ID for a single document, otherwise a hash of the
            documents' IDs in order.
        sample_ids: IDs of the documents, in row order.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    sample_id: int
    sample_ids: tuple

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def stable_sample_id(*parts: Union[str, bytes, int]) -> int:
    """A stable, non-negative int63 ID: blake2b of the parts, folded to 63 bits.

    Parts are strings (UTF-8), bytes or ints, each length-prefixed so that ``("ab", "c")`` and
    ``("a", "bc")`` differ. The result is the same on every machine, Python version and run (it does not
    use Python's randomised ``hash``).
    """
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("stable_sample_id parts must be str, bytes or int, not bool")
        if isinstance(part, (int, np.integer)):
            data, tag = str(int(part)).encode(), b"i"
        elif isinstance(part, str):
            data, tag = part.encode("utf-8"), b"s"
        elif isinstance(part, (bytes, bytearray)):
            data, tag = bytes(part), b"b"
        else:
            raise TypeError(f"stable_sample_id parts must be str, bytes or int, got {type(part).__name__}")
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(h.digest(), "little") & _INT63


def _make_sample(ids, mask, sample_id: int, seq_length: int) -> Sample:
    input_ids = torch.as_tensor(list(ids)[:seq_length] if not isinstance(ids, torch.Tensor) else ids[:seq_length])
    loss_mask = torch.as_tensor(list(mask)[:seq_length] if not isinstance(mask, torch.Tensor) else mask[:seq_length])
    return Sample(input_ids.to(torch.int64), loss_mask.to(torch.bool), sample_id)


def _check_seq_length(seq_length) -> int:
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be an int >= 1, got {seq_length!r}.")
    return seq_length


# --------------------------------------------------------------------------------------------------
# Chat tokenisation with an assistant mask
# --------------------------------------------------------------------------------------------------

_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


def _chat_template_of(tokenizer) -> str:
    template = None
    getter = getattr(tokenizer, "get_chat_template", None)
    if getter is not None:
        try:
            template = getter()
        except Exception:  # no default template
            template = None
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; chat data needs one "
            f"(set tokenizer.chat_template)."
        )
    return template


def template_has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    return bool(_GENERATION_TAG.search(_chat_template_of(tokenizer)))


def _render_ids(tokenizer, messages: list, *, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return [int(t) for t in out["input_ids"]]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _boundary(full: list[int], prefix: list[int], what: str) -> int:
    """Index in ``full`` where the rendered ``prefix`` ends.

    The rendering of a conversation prefix must be a token prefix of the full rendering; one differing
    token at the very end is tolerated (a BPE merge across the boundary), the boundary then falls before it.
    """
    lcp = _common_prefix(full, prefix)
    if lcp >= len(prefix) - 1:
        return lcp
    raise ValueError(
        f"cannot find the assistant tokens: the chat template does not render the conversation "
        f"incrementally ({what} is not a prefix of the full conversation; they differ from token {lcp} "
        f"of {len(prefix)}). Use a template with {{% generation %}} ... {{% endgeneration %}} markers."
    )


def assistant_mask_from_prefixes(tokenizer, messages: list, input_ids: Sequence[int]) -> list[int]:
    """Assistant mask of ``input_ids`` (the rendering of ``messages``) for templates without markers.

    Assistant message ``i`` spans from the end of ``messages[:i]`` rendered with the generation prompt
    (the assistant header) to the end of ``messages[:i + 1]`` rendered without it, so it covers the
    content and the end-of-turn tokens the template emits after it, like ``{% generation %}`` does.
    """
    full = [int(t) for t in input_ids]
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            # No prefix to render (templates refuse empty conversations): the content starts where the
            # rendering with an empty content first differs from the full one.
            start = _common_prefix(full, _render_ids(tokenizer, [dict(message, content="")],
                                                     add_generation_prompt=False))
        else:
            start = _boundary(full, _render_ids(tokenizer, messages[:i], add_generation_prompt=True),
                              f"messages[:{i}] with the generation prompt")
        end = _boundary(full, _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False),
                        f"messages[:{i + 1}]")
        for j in range(start, end):
            mask[j] = 1
    return mask


def tokenize_chat(tokenizer, messages: list, *, assistant_mask: str = "auto") -> tuple[list[int], list[int]]:
    """Token ids of a chat and its assistant mask (1 on assistant tokens).

    Args:
        tokenizer: a HF tokenizer with a chat template.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        assistant_mask: ``"template"`` uses the template's ``{% generation %}`` markers
            (``return_assistant_tokens_mask``); ``"prefix"`` computes the spans by tokenising prefixes of
            the conversation; ``"auto"`` picks ``"template"`` when the template has markers and the
            tokenizer is a fast one, ``"prefix"`` otherwise.
    """
    if assistant_mask not in ("auto", "template", "prefix"):
        raise ValueError(f"assistant_mask must be 'auto', 'template' or 'prefix', got {assistant_mask!r}.")
    if assistant_mask == "auto":
        markers = template_has_generation_markers(tokenizer)
        assistant_mask = "template" if markers and getattr(tokenizer, "is_fast", False) else "prefix"
    if assistant_mask == "template":
        if not template_has_generation_markers(tokenizer):
            raise ValueError(
                "assistant_mask='template' needs {% generation %} markers in the chat template; "
                "use assistant_mask='prefix' (or 'auto')."
            )
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return [int(t) for t in out["input_ids"]], [int(m) for m in out["assistant_masks"]]
    ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    return ids, assistant_mask_from_prefixes(tokenizer, messages, ids)


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles of the chat format; a template need not render all of them (``chat_roles``)."""

_TOOL_ROLE = re.compile(r"""(['"])tool\1""")


def _renders_as_assistant(tokenizer, role: str) -> bool:
    """Whether the template's ``{% generation %}`` markers supervise a lone ``role`` message (a template
    that renders every role it does not test for as the assistant's). False when that cannot be told:
    no markers, a slow tokenizer, or a template that refuses the lone message."""
    if not template_has_generation_markers(tokenizer) or not getattr(tokenizer, "is_fast", False):
        return False
    try:
        out = tokenizer.apply_chat_template([{"role": role, "content": "probe"}], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception:  # the template wants more than one message: it checks roles itself
        return False
    return any(out["assistant_masks"])


def chat_roles(tokenizer) -> tuple[str, ...]:
    """The roles a chat record may use with ``tokenizer``: user and assistant; system unless the template
    supervises it as the assistant's; tool when the template names it (as ``'tool'`` or ``"tool"``, the way
    templates that render tool results test for it) and does not supervise it.

    Any other role is refused: templates render the roles they do not know as one of theirs (often the
    assistant's, whose tokens are supervised), so a typo would be trained on silently."""
    template = _chat_template_of(tokenizer)
    return tuple(role for role in CHAT_ROLES if role in ("user", "assistant") or (
        (role != "tool" or _TOOL_ROLE.search(template)) and not _renders_as_assistant(tokenizer, role)))


def _json_kind(value) -> str:
    """How JSON spells the type of a decoded value (for messages about records)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return "a string" if isinstance(value, str) else type(value).__name__


def _unicode_problem(text: str) -> Optional[str]:
    """Why ``text`` cannot be tokenised as Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes can
    produce and no tokenizer accepts), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"is not valid Unicode (a lone surrogate {ascii(text[err.start])[1:-1]} at character {err.start}; "
                "the file was written by a broken encoder)")
    return None


def check_messages(messages, where: str, roles: Sequence[str]) -> list:
    """``messages`` if it is a chat of the format (objects with a role of ``roles`` and a string ``content``),
    else a `DataError` naming ``where``, the message and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: no messages (expected a non-empty list under 'messages').")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"{where}: message {j} must be an object with a 'role', got {message!r:.80}.")
        role = message["role"]
        if not isinstance(role, str) or role not in roles:
            shown = json.dumps(role)[:40] if isinstance(role, str) else _json_kind(role)
            raise DataError(f"{where}: message {j}: role is {shown}, not one of the roles the chat template "
                            f"renders ({', '.join(roles)}).")
        content = message.get("content")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {j} ({role}): content is {_json_kind(content)}, not a string.")
        problem = _unicode_problem(content)
        if problem is not None:
            raise DataError(f"{where}: message {j} ({role}): the content {problem}.")
    return messages


# --------------------------------------------------------------------------------------------------
# JSONL datasets
# --------------------------------------------------------------------------------------------------


# Characters of a record handed to the tokenizer per token of the sequence length (see ``record_budget``).
CHARS_PER_TOKEN = 32


def record_budget(seq_length: int) -> int:
    """Characters of one record handed to the tokenizer: ``CHARS_PER_TOKEN * seq_length``.

    A sample keeps the first ``seq_length`` tokens of its record, so tokenising all of a huge record (a
    30 MB line: a minute or more and gigabytes of memory per read) buys nothing. 32 characters per token
    is a generous upper bound of what ``seq_length`` tokens cover: BPE vocabularies average about 4
    characters per token on English prose and fewer on code and other scripts; only text made mostly of
    long runs (whitespace, repeated punctuation, words unknown to a word-level vocabulary) averages more,
    and a cut that leaves such a record short of ``seq_length`` tokens is reported (``_JSONLDataset``).
    """
    return CHARS_PER_TOKEN * seq_length


def _cut_text(text: str, budget: int) -> str:
    """``text`` if it has at most ``budget`` characters, else its beginning, ending before a space.

    The cut falls just before the last space in ``text[budget // 2 : budget + 1]`` that follows a
    non-space character: the pre-tokenizers of byte-level BPE (GPT-2 / Llama-3 / Qwen patterns),
    SentencePiece (``▁`` starts a word) and word-level vocabularies all start a new piece at such a space
    (a piece carries a space only at its start), so every piece before the cut, and so every token, is the
    same as in the whole text. When the beginning holds more than ``seq_length`` tokens (ordinary text, by
    a wide margin, see ``record_budget``) the kept tokens are therefore bit-identical to those of the whole
    text. A "word" longer than half the budget is cut at the budget itself.
    """
    if len(text) <= budget:
        return text
    low = budget // 2
    cut = text.rfind(" ", low, budget + 1)
    while cut > low and text[cut - 1].isspace():
        cut = text.rfind(" ", low, cut)
    return text[:cut] if cut > low else text[:budget]


def _cut_chat(messages: list, budget: int) -> list:
    """The beginning of a chat whose message contents, plus ``CHARS_PER_TOKEN`` per message, fit in ``budget``
    characters (``messages`` itself when the whole chat fits).

    The cut is made in the message contents, not in the rendered conversation: the template still renders
    whole messages, so the role headers, end-of-turn tokens and ``{% generation %}`` spans (or, without
    markers, the rendered prefixes of ``assistant_mask_from_prefixes``) of the kept messages are the
    template's own, and every kept token has the loss mask the whole chat would give it. Cutting the
    rendered text or its tokens instead would lose the template's end of the cut turn, and a mask computed
    on a cut rendering would not be the template's. Each message is charged one token's worth of characters
    for its header besides its content, so a chat of millions of short messages is bounded too. The message
    in which the budget runs out keeps the beginning of its content (cut as ``_cut_text`` does, before a
    space) and the later messages are dropped. The kept tokens equal the whole chat's whenever the budget
    holds more than ``seq_length`` tokens and the template renders contents verbatim and earlier turns
    independently of later ones, which the prefix assistant mask assumes already.
    """
    left = budget
    for j, message in enumerate(messages):
        left -= CHARS_PER_TOKEN
        content = message["content"]
        if len(content) > left:
            if left <= 0 and j > 0:
                return messages[:j]
            return messages[:j] + [dict(message, content=_cut_text(content, max(left, 0)))]
        left -= len(content)
    return messages


def one_line_error(err: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception on one line, at most ``limit`` characters of the message."""
    text = " ".join(str(err).split()).encode("utf-8", "backslashreplace").decode("utf-8")  # printable
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


class _JSONLDataset(torch.utils.data.Dataset, abc.ABC):
    """Map-style dataset over the non-blank lines of a JSONL file.

    The file is scanned once at construction: every line is parsed and checked against the format (clear
    ``file:line`` `DataError`s before training starts), and only byte offsets are kept, so memory stays
    small. Reading a sample parses and checks its line again and tokenises at most ``record_budget
    (seq_length)`` characters of it; whatever fails in there (the JSON parser, the chat template, the
    tokenizer) is a `DataError` naming the file and line, so a training loop meets one kind of error only.
    A record cut to the budget is reported through ``log``, once per record.
    """

    kind = "jsonl"

    def __init__(self, path: str, seq_length: int, name: Optional[str] = None, log: Callable[[str], Any] = print):
        self.path = os.fspath(path)
        self.seq_length = _check_seq_length(seq_length)
        self.log = log
        self._reported_cuts: set[int] = set()
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{type(self).__name__}: {self.path} does not exist (or is not a file).")
        self.name = name if name is not None else os.path.basename(self.path)
        offsets, lines = [], []
        with open(self.path, "rb") as f:
            lineno, offset = 0, 0
            for raw in f:
                lineno += 1
                if raw.strip():
                    self._validate(self._parse(raw, lineno), lineno)
                    offsets.append(offset)
                    lines.append(lineno)
                offset += len(raw)
        if not offsets:
            raise DataError(f"{type(self).__name__}: {self.path} has no samples (empty or only blank lines).")
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)

    def _where(self, lineno: int) -> str:
        return f"{self.path}:{lineno}"

    def _parse(self, raw: bytes, lineno: int) -> Any:
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
            raise DataError(f"{self._where(lineno)}: invalid JSON ({detail}).") from None
        except RecursionError:
            raise DataError(f"{self._where(lineno)}: invalid JSON (nested deeper than the JSON parser can "
                            "read).") from None
        if not isinstance(record, dict):
            raise DataError(f"{self._where(lineno)}: expected a JSON object, got {type(record).__name__}.")
        return record

    @abc.abstractmethod
    def _validate(self, record: dict, lineno: int) -> None:
        """Raise `DataError` (naming the file and line) if `record` is not a sample of this format."""

    @abc.abstractmethod
    def _sample(self, index: int, raw: bytes, record: dict, lineno: int) -> Sample:
        """The sample of the checked ``record`` (line ``lineno``, bytes ``raw``) at ``index``."""

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of {n} samples")
        index %= n
        lineno = int(self._lines[index])
        try:
            with open(self.path, "rb") as f:
                f.seek(int(self._offsets[index]))
                raw = f.readline()
            record = self._parse(raw, lineno)
            self._validate(record, lineno)  # the file may have changed since the scan
            return self._sample(index, raw, record, lineno)
        except DataError:
            raise
        except Exception as err:  # the template's, the tokenizer's, ...: this record, named
            raise DataError(f"{self._where(lineno)}: cannot tokenise the record ({one_line_error(err)}).") from err

    def sample_id(self, index: int, raw: bytes) -> int:
        return stable_sample_id(self.kind, self.name, index, raw.rstrip(b"\r\n"))

    def _report_cut(self, index: int, lineno: int, what: str, kept_chars: int, tokens: int) -> None:
        """Say (once per record) that ``what`` was cut to ``kept_chars`` characters and gave ``tokens`` tokens."""
        if index in self._reported_cuts:
            return
        self._reported_cuts.add(index)
        short = (f"; they give only {tokens} of the {self.seq_length} tokens a sample holds (more than "
                 f"{CHARS_PER_TOKEN} characters per token)" if tokens < self.seq_length else "")
        self.log(f"[data] {self._where(lineno)}: {what} cut to {kept_chars} characters before tokenising "
                 f"({CHARS_PER_TOKEN} per token of seq_length {self.seq_length}){short}.")


class ChatJSONLDataset(_JSONLDataset):
    """Chats, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line.

    ``role`` is one of ``chat_roles(tokenizer)`` (system, user, assistant, and tool when the template
    names it) and ``content`` a string; any other record is a `DataError` naming its file and line.
    Tokenised with the tokenizer's chat template; the loss mask covers the assistant turns (see
    ``tokenize_chat`` for ``assistant_mask``); truncated to ``seq_length`` tokens, of which at most
    ``record_budget(seq_length)`` characters are rendered (see ``_cut_chat``).
    Sample ID: ``stable_sample_id("chat", name, index, line)`` with ``name`` the file's base name.
    """

    kind = "chat"

    def __init__(self, path: str, tokenizer, seq_length: int, *, name: Optional[str] = None,
                 messages_key: str = "messages", assistant_mask: str = "auto", log: Callable[[str], Any] = print):
        self.tokenizer = tokenizer
        self.messages_key = messages_key
        self.assistant_mask = assistant_mask
        self.roles = chat_roles(tokenizer)  # and fail early without a template
        super().__init__(path, seq_length, name, log)

    def _validate(self, record: dict, lineno: int) -> None:
        check_messages(record.get(self.messages_key), f"{self._where(lineno)} ('{self.messages_key}')", self.roles)

    def _sample(self, index: int, raw: bytes, record: dict, lineno: int) -> Sample:
        messages = record[self.messages_key]
        kept = _cut_chat(messages, record_budget(self.seq_length))
        ids, mask = tokenize_chat(self.tokenizer, kept, assistant_mask=self.assistant_mask)
        if not ids:
            raise DataError(f"{self._where(lineno)}: the chat renders to no tokens.")
        if kept is not messages:
            chars = sum(len(m["content"]) for m in messages)
            self._report_cut(index, lineno, f"the chat's {chars} characters of content in {len(messages)} messages",
                             sum(len(m["content"]) for m in kept), len(ids))
        return _make_sample(ids, mask, self.sample_id(index, raw), self.seq_length)


class TextJSONLDataset(_JSONLDataset):
    """Plain text, one ``{"text": ...}`` per line; loss on every token; truncated to ``seq_length``, of which
    at most ``record_budget(seq_length)`` characters are tokenised (see ``_cut_text``).

    ``append_eos`` ends each document with the tokenizer's EOS (when it has one), so packed documents
    are separated like Megatron's ``--append-eod`` (not a cut one: it does not end there).
    Sample ID: ``stable_sample_id("text", name, index, line)``.
    """

    kind = "text"

    def __init__(self, path: str, tokenizer, seq_length: int, text_key: str = "text", *,
                 name: Optional[str] = None, append_eos: bool = True, log: Callable[[str], Any] = print):
        self.tokenizer = tokenizer
        self.text_key = text_key
        self.append_eos = append_eos
        super().__init__(path, seq_length, name, log)

    def _validate(self, record: dict, lineno: int) -> None:
        text = record.get(self.text_key)
        if not isinstance(text, str):
            raise DataError(f"{self._where(lineno)}: no text (expected a string under '{self.text_key}').")
        problem = _unicode_problem(text)
        if problem is not None:
            raise DataError(f"{self._where(lineno)}: the text {problem}.")

    def _sample(self, index: int, raw: bytes, record: dict, lineno: int) -> Sample:
        text = record[self.text_key]
        kept = _cut_text(text, record_budget(self.seq_length))
        ids = [int(t) for t in self.tokenizer(kept)["input_ids"]]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if self.append_eos and eos is not None and len(kept) == len(text) and (not ids or ids[-1] != eos):
            ids.append(int(eos))
        if not ids:
            raise DataError(f"{self._where(lineno)}: the text tokenises to no tokens.")
        if len(kept) < len(text):
            self._report_cut(index, lineno, f"the text of {len(text)} characters", len(kept), len(ids))
        return _make_sample(ids, [1] * len(ids), self.sample_id(index, raw), self.seq_length)


# --------------------------------------------------------------------------------------------------
# Megatron indexed dataset
# --------------------------------------------------------------------------------------------------


class IndexedDataset(torch.utils.data.Dataset):
    """Pre-tokenised Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``): one sample per document.

    A document is the concatenation of its sequences (``document_indices``); only the first
    ``seq_length`` tokens are read. Loss on every token.
    Sample ID: ``stable_sample_id("indexed", name, document index)``, ``name`` = base name of the prefix.
    """

    kind = "indexed"

    def __init__(self, path_prefix: str, seq_length: int, *, name: Optional[str] = None, mmap: bool = True):
        from megatron.core.datasets.indexed_dataset import IndexedDataset as _MegatronIndexedDataset

        self.path_prefix = os.fspath(path_prefix)
        self.seq_length = _check_seq_length(seq_length)
        missing = [p for p in (self.path_prefix + ".idx", self.path_prefix + ".bin") if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"IndexedDataset: {', '.join(missing)} does not exist (expected the Megatron indexed dataset "
                f"files {self.path_prefix}.bin and {self.path_prefix}.idx)."
            )
        self.name = name if name is not None else os.path.basename(self.path_prefix)
        self.dataset = _MegatronIndexedDataset(self.path_prefix, mmap=mmap)
        self._doc_index = np.asarray(self.dataset.document_indices, dtype=np.int64)
        self._lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        if len(self) == 0:
            raise ValueError(f"IndexedDataset: {self.path_prefix} has no documents.")

    def __len__(self) -> int:
        return max(0, len(self._doc_index) - 1)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for IndexedDataset of {n} documents")
        index %= n
        parts, left = [], self.seq_length
        for seq in range(int(self._doc_index[index]), int(self._doc_index[index + 1])):
            if left <= 0:
                break
            take = min(left, int(self._lengths[seq]))
            if take > 0:
                parts.append(np.asarray(self.dataset.get(seq, 0, take), dtype=np.int64))
                left -= take
        ids = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        if ids.numel() == 0:
            raise ValueError(f"IndexedDataset: document {index} of {self.path_prefix} has no tokens.")
        sid = stable_sample_id(self.kind, self.name, index)
        return Sample(ids, torch.ones(ids.shape[0], dtype=torch.bool), sid)


# --------------------------------------------------------------------------------------------------
# Synthetic chats (the embedded default job)
# --------------------------------------------------------------------------------------------------


class SyntheticChatDataset(torch.utils.data.Dataset):
    """``count`` chats of ``embedded_job.synthetic_corpus.conversations(seed, count)``.

    Use a different seed for a held-out split (IDs include the seed, so splits never share IDs).
    Sample ID: ``stable_sample_id("synthetic-chat", seed, index)``.
    """

    kind = "synthetic-chat"

    def __init__(self, seed: int, count: int, tokenizer, seq_length: int, *, assistant_mask: str = "auto"):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"SyntheticChatDataset: count must be an int >= 1, got {count!r}.")
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.seq_length = _check_seq_length(seq_length)
        self.assistant_mask = assistant_mask
        self.chats = list(conversations(self.seed, count))

    def __len__(self) -> int:
        return len(self.chats)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for SyntheticChatDataset of {n} chats")
        index %= n
        ids, mask = tokenize_chat(self.tokenizer, self.chats[index], assistant_mask=self.assistant_mask)
        return _make_sample(ids, mask, stable_sample_id(self.kind, self.seed, index), self.seq_length)


# --------------------------------------------------------------------------------------------------
# Packing and collation
# --------------------------------------------------------------------------------------------------


def _as_sample(sample, seq_length: int, i: int) -> Sample:
    if isinstance(sample, Mapping):
        sample = Sample(torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["loss_mask"]),
                        int(sample["sample_id"]))
    if not hasattr(sample, "input_ids") or not hasattr(sample, "loss_mask") or not hasattr(sample, "sample_id"):
        raise TypeError(f"sample {i} must be a Sample (input_ids, loss_mask, sample_id), got {type(sample).__name__}.")
    ids = torch.as_tensor(sample.input_ids).reshape(-1)
    mask = torch.as_tensor(sample.loss_mask).reshape(-1)
    if ids.shape != mask.shape:
        raise ValueError(
            f"sample {i}: input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in length."
        )
    if ids.numel() == 0:
        raise ValueError(f"sample {i} (id {sample.sample_id}) has no tokens.")
    return Sample(ids[:seq_length].to(torch.int64), mask[:seq_length].to(torch.bool), int(sample.sample_id))


def pack_samples(samples: Sequence, seq_length: int) -> list[PackedRow]:
    """Pack documents into rows of at most ``seq_length`` tokens: greedy first fit, in order.

    Each sample (truncated to ``seq_length``) goes into the first row, in creation order, with room for
    it; a new row is opened when none has. Deterministic; no token is dropped beyond the truncation.
    """
    seq_length = _check_seq_length(seq_length)
    docs = [_as_sample(s, seq_length, i) for i, s in enumerate(samples)]
    rows: list[list[Sample]] = []
    free: list[int] = []
    for doc in docs:
        n = len(doc)
        for r, room in enumerate(free):
            if room >= n:
                rows[r].append(doc)
                free[r] -= n
                break
        else:
            rows.append([doc])
            free.append(seq_length - n)
    out = []
    for members in rows:
        ids = [d.sample_id for d in members]
        out.append(PackedRow(
            input_ids=torch.cat([d.input_ids for d in members]),
            loss_mask=torch.cat([d.loss_mask for d in members]),
            position_ids=torch.cat([torch.arange(len(d), dtype=torch.int64) for d in members]),
            document_ids=torch.cat([torch.full((len(d),), j, dtype=torch.int64) for j, d in enumerate(members)]),
            sample_id=ids[0] if len(ids) == 1 else stable_sample_id("packed", *ids),
            sample_ids=tuple(ids),
        ))
    return out


def collate(samples: Sequence, pad_id: int, seq_length: int, pack: bool = False) -> dict:
    """Stack samples into a batch dict (see the module docstring), padded to ``seq_length``.

    Without packing every sample is one row (B = len(samples)); with ``pack=True`` the samples are packed
    by ``pack_samples`` and B is the number of packed rows (<= len(samples)).
    """
    seq_length = _check_seq_length(seq_length)
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise ValueError(f"pad_id must be an int (the tokenizer's pad id), got {pad_id!r}.")
    if len(samples) == 0:
        raise ValueError("collate needs at least one sample.")
    if pack:
        rows = pack_samples(samples, seq_length)
    else:
        rows = []
        for i, s in enumerate(samples):
            s = _as_sample(s, seq_length, i)
            n = len(s)
            rows.append(PackedRow(s.input_ids, s.loss_mask, torch.arange(n, dtype=torch.int64),
                                  torch.zeros(n, dtype=torch.int64), s.sample_id, (s.sample_id,)))
    b = len(rows)
    tokens = torch.full((b, seq_length), int(pad_id), dtype=torch.int64)
    loss_mask = torch.zeros(b, seq_length, dtype=torch.bool)
    position_ids = torch.zeros(b, seq_length, dtype=torch.int64)
    document_ids = torch.full((b, seq_length), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        n = len(row)
        tokens[r, :n] = row.input_ids
        loss_mask[r, :n] = row.loss_mask
        position_ids[r, :n] = row.position_ids
        document_ids[r, :n] = row.document_ids
        last = int(row.position_ids[-1]) + 1
        position_ids[r, n:] = torch.arange(last, last + seq_length - n, dtype=torch.int64)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "sample_ids": torch.tensor([row.sample_id for row in rows], dtype=torch.int64),
    }


@dataclass(frozen=True)
class Collator:
    """Picklable ``collate_fn`` (for ``MicroBatchIterator`` or a torch ``DataLoader``)."""

    pad_id: int
    seq_length: int
    pack_sequences: bool = False

    def __call__(self, samples: Sequence) -> dict:
        return collate(samples, self.pad_id, self.seq_length, pack=self.pack_sequences)


# --------------------------------------------------------------------------------------------------
# DP-aware deterministic sampler
# --------------------------------------------------------------------------------------------------


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


class MicroBatchIterator:
    """The micro-batches of one data-parallel rank, step after step, in a seeded order.

    The samples form one endless stream: epoch ``e`` is the permutation
    ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``, epochs follow each other. Optimizer
    step ``t`` consumes stream positions ``[t * G, (t + 1) * G)`` (G = global batch size); within it,
    micro-batch ``m`` of DP rank ``r`` is ``t * G + m * (M * D) + r * M + [0, M)`` (M = micro batch size,
    D = DP size), Megatron's layout. So every sample is seen once per epoch across the DP ranks, and
    starting at ``start_step`` jumps straight to position ``start_step * G`` without touching earlier ones.

    Iterating yields ``num_micro_batches = G / (M * D)`` micro-batches per step, flat (the way a Megatron
    training loop calls ``next`` on its data iterator); each is ``collate_fn(list of samples)``, or the
    list itself without a ``collate_fn``.
    """

    def __init__(self, dataset, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, start_step: int = 0, collate_fn: Optional[Callable] = None):
        self.micro_batch_size = _check_count("micro_batch_size", micro_batch_size, 1)
        self.global_batch_size = _check_count("global_batch_size", global_batch_size, 1)
        self.dp_size = _check_count("dp_size", dp_size, 1)
        self.dp_rank = _check_count("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be < dp_size={dp_size}.")
        per_micro = self.micro_batch_size * self.dp_size
        if self.global_batch_size % per_micro:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be divisible by micro_batch_size * dp_size = "
                f"{micro_batch_size} * {dp_size} = {per_micro}."
            )
        self.num_micro_batches = self.global_batch_size // per_micro
        self.seed = _check_count("seed", seed, 0)
        self.start_step = _check_count("start_step", start_step, 0)
        self.dataset = dataset
        self.num_samples = len(dataset)
        if self.num_samples == 0:
            raise ValueError("MicroBatchIterator: the dataset is empty.")
        self.collate_fn = collate_fn
        self.step = self.start_step  # the step the next micro-batch belongs to
        self.micro = 0  # index of the next micro-batch within the step
        self._perms: dict[int, np.ndarray] = {}

    # ---- pure index arithmetic -------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch`` (cached, at most two epochs kept)."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def micro_batch_indices(self, step: int, micro: int) -> list[int]:
        """Dataset indices of micro-batch ``micro`` of ``step`` on this DP rank."""
        if not 0 <= micro < self.num_micro_batches:
            raise ValueError(f"micro={micro} out of range [0, {self.num_micro_batches}).")
        first = (step * self.global_batch_size + micro * self.micro_batch_size * self.dp_size
                 + self.dp_rank * self.micro_batch_size)
        out = []
        for g in range(first, first + self.micro_batch_size):
            epoch, offset = divmod(g, self.num_samples)
            out.append(int(self.permutation(epoch)[offset]))
        return out

    def step_indices(self, step: int) -> list[list[int]]:
        """The ``num_micro_batches`` micro-batches (dataset indices) of ``step`` on this DP rank."""
        return [self.micro_batch_indices(step, m) for m in range(self.num_micro_batches)]

    def epoch_of(self, step: int) -> int:
        """Epoch of the first sample of ``step``."""
        return step * self.global_batch_size // self.num_samples

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all DP ranks before the next step (Megatron's ``consumed_train_samples``)."""
        return self.step * self.global_batch_size

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self):
        indices = self.micro_batch_indices(self.step, self.micro)
        self.micro += 1
        if self.micro == self.num_micro_batches:
            self.step, self.micro = self.step + 1, 0
        samples = [self.dataset[i] for i in indices]
        return self.collate_fn(samples) if self.collate_fn is not None else samples


# --------------------------------------------------------------------------------------------------
# Megatron GPT batches
# --------------------------------------------------------------------------------------------------

_STAGE_CONTENT_LO = 0x2545F491
_STAGE_CONTENT_HI = 0x9E3779B1
_STAGE_CHECK = 0x4F1BBCDD


def content_sample_ids(tokens: torch.Tensor) -> torch.Tensor:
    """[B] int64 row IDs hashed from the tokens on the device (for batches that carry no sample IDs).

    Row ``i``'s ID depends only on ``tokens[i]`` (not on the batch, the device or the rank); identical
    rows get identical IDs. Non-negative, < 2**63. No host synchronisation.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a [batch, seq] tensor, got {getattr(tokens, 'shape', type(tokens))}.")
    tokens = tokens.to(torch.int64)
    pos = torch.arange(tokens.shape[1], dtype=torch.int64, device=tokens.device)[None, :]
    lo = hash_elements(tokens, _STAGE_CONTENT_LO, pos).sum(dim=1) & _M32  # order-aware through positions
    hi = hash_elements(tokens, _STAGE_CONTENT_HI, pos).sum(dim=1) & _M32
    lo, hi = mix32(lo), mix32(absorb(hi, lo, _STAGE_CHECK))
    return ((hi & 0x7FFFFFFF) << 32) | lo


def from_megatron_gpt_batch(batch: Mapping[str, torch.Tensor], *, eod_token_id: Optional[int] = None) -> dict:
    """Convert a Megatron ``GPTDataset`` batch (label-aligned ``loss_mask``) to this module's format.

    Megatron's ``loss_mask[i]`` weights the prediction of ``labels[i] = tokens[i + 1]``; the DFlash plan
    wants the token-aligned mask, ``loss_mask[j] = megatron_loss_mask[j - 1]`` (False at j = 0).
    Documents start at position 0 (``reset_position_ids``) and, with ``eod_token_id``, after every EOD
    token. Sample IDs are taken from ``batch["sample_ids"]`` when present, else hashed from the tokens.
    All on the device of the batch, no host synchronisation. Other keys are passed through.
    """
    for key in ("tokens", "loss_mask", "position_ids"):
        if key not in batch:
            raise KeyError(f"Megatron GPT batch has no '{key}' (keys: {sorted(batch)}).")
    tokens = batch["tokens"]
    position_ids = batch["position_ids"]
    megatron_mask = batch["loss_mask"]
    if tokens.dim() != 2 or position_ids.shape != tokens.shape or megatron_mask.shape != tokens.shape:
        raise ValueError(
            f"tokens, position_ids and loss_mask must all be [batch, seq]; got {tuple(tokens.shape)}, "
            f"{tuple(position_ids.shape)}, {tuple(megatron_mask.shape)}."
        )
    loss_mask = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    loss_mask[:, 1:] = megatron_mask[:, :-1] > 0
    starts = position_ids == 0
    if eod_token_id is not None:
        starts[:, 1:] |= tokens[:, :-1] == eod_token_id
    starts[:, 0] = True
    document_ids = starts.to(torch.int64).cumsum(dim=1) - 1
    out = dict(batch)
    out.update(
        tokens=tokens,
        loss_mask=loss_mask,
        position_ids=position_ids,
        document_ids=document_ids,
        sample_ids=batch["sample_ids"] if "sample_ids" in batch else content_sample_ids(tokens),
    )
    return out
