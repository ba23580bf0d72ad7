"""Prompt files for acceptance evaluation: one JSONL format for the trainer and the tools.

Each non-blank line is a JSON object with one of these fields::

    {"input_ids": [1, 2, 3]}                          token ids, no tokenizer needed
    {"text": "count from 3 to 9"}                     tokenized with the target's tokenizer
    {"prompt": "count from 3 to 9"}                   the same ("prompt" is an alias of "text")
    {"messages": [{"role": "user", "content": ...}]}  rendered with the chat template and the
                                                      generation prompt; a trailing assistant
                                                      turn (the reference answer) is dropped

A line may also name its ``"category"`` (a string): `tools/evaluate_acceptance.py` then reports the
acceptance per category (`decoding.benchmark_report`); training evaluation ignores it.

`pretrain_dflash.py --dflash-eval-prompts` and `tools/evaluate_acceptance.py --prompts` both read
them with `read_prompt_file` + `tokenize_prompt`. Errors name the file and line (`PromptError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

__all__ = [
    "PROMPT_FIELDS",
    "PromptError",
    "PromptRecord",
    "read_prompt_file",
    "spread_over_categories",
    "prompt_category",
    "read_data_prompts",
    "tokenize_prompt",
    "load_prompt_ids",
    "unknown_token_fraction",
    "unknown_token_warning",
]

PROMPT_FIELDS = ("input_ids", "text", "prompt", "messages")
# A prompt with at least this fraction of unknown words is mostly invisible to the target.
UNKNOWN_WARNING_FRACTION = 0.5


class PromptError(ValueError):
    """A prompt file or line that cannot be used; the message names the file and line."""


@dataclass
class PromptRecord:
    record: dict
    where: str  # "path:line"


def spread_over_categories(items: list, limit: Optional[int], category_of: Callable[[Any], Any]) -> list:
    """``limit`` of ``items`` (all without a limit) spread over their categories, in file order: the first of
    each category (in the order the categories first appear), then the second of each, and so on, so a subset
    of a set written category by category (MT-Bench's file is) holds every category, not the first one only;
    items without categories give the first ``limit``. E.g. categories ``a a a b b c``, limit 4 -> the first
    and second ``a``, the first ``b``, the ``c``."""
    if limit is None or limit >= len(items):
        return list(items)
    by_category: dict = {}
    for index, item in enumerate(items):
        by_category.setdefault(category_of(item), []).append(index)
    chosen: list = []
    for rank in range(max(len(group) for group in by_category.values())):
        chosen.extend(group[rank] for group in by_category.values() if rank < len(group))
        if len(chosen) >= limit:
            break
    return [items[index] for index in sorted(chosen[:limit])]


def read_prompt_file(path: str, limit: Optional[int] = None) -> list[PromptRecord]:
    """The prompt objects of a JSONL file (blank lines skipped), checked for a known field; with ``limit``,
    that many spread over the lines' categories (`spread_over_categories`; every line is read and checked)."""
    records: list[PromptRecord] = []
    try:
        f = open(path, "rb")  # decoded line by line: a bad byte is named by its line
    except OSError as err:
        raise PromptError(f"{path}: cannot read the prompt file ({err.strerror}).") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptError(f"{where}: invalid JSON ({err.msg}).") from None
            except UnicodeDecodeError as err:
                raise PromptError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start}).") from None
            except RecursionError:
                raise PromptError(f"{where}: invalid JSON (nested deeper than the JSON parser can read).") from None
            if not isinstance(record, dict) or not any(k in record for k in PROMPT_FIELDS):
                raise PromptError(
                    f"{where}: expected a JSON object with one of {', '.join(repr(k) for k in PROMPT_FIELDS)}."
                )
            records.append(PromptRecord(record, where))
    if not records:
        raise PromptError(f"{path} holds no prompt.")
    return spread_over_categories(records, limit, prompt_category)


def prompt_category(item: PromptRecord) -> Optional[str]:
    """The line's ``category`` (None when it names none)."""
    category = item.record.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        raise PromptError(f"{item.where}: 'category' must be a non-empty string.")
    return category


def read_data_prompts(path: str, limit: Optional[int] = None) -> list[PromptRecord]:
    """The first ``limit`` records of training-format data (any file and record format of `data.formats`) as
    prompts: chats as ``messages``, text as ``text``; the records no format reads are left out (the data's own
    check names them)."""
    from ..common.errors import DataError  # here, not at the top: see _tokenize_text_or_chat
    from .formats import normalize_record, open_records

    try:
        source = open_records(path)
    except (DataError, OSError) as err:
        raise PromptError(str(err)) from None
    records: list[PromptRecord] = []
    for index in range(len(source)):
        where = source.where(index)
        try:
            record = normalize_record(source.record(index), where)
        except DataError:
            continue
        records.append(PromptRecord({"messages": record.messages} if record.is_chat else {"text": record.text}, where))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise PromptError(f"{path} holds no prompt.")
    return records


TokenizerSource = Union[Any, Callable[[], Any]]


def tokenize_prompt(item: PromptRecord, tokenizer: TokenizerSource, template_kwargs: Optional[dict] = None) -> list[int]:
    """Token ids of one prompt. `tokenizer` may be a zero-argument callable that loads it (only
    called for text and chat lines, so `input_ids` files need no tokenizer); ``template_kwargs`` go to the
    chat template (``--chat-template-kwargs``)."""
    record, where = item.record, item.where
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError(f"{where}: 'input_ids' must be a list of integers.")
    else:
        tok = tokenizer() if callable(tokenizer) and not hasattr(tokenizer, "encode") else tokenizer
        ids = _tokenize_text_or_chat(record, where, tok, template_kwargs or {})
    ids = [int(t) for t in ids]
    if not ids:
        raise PromptError(f"{where}: the prompt has no tokens.")
    return ids


def _tokenize_text_or_chat(record: dict, where: str, tok, template_kwargs: dict) -> list:
    """Token ids of a `text` / `prompt` or `messages` prompt. Chats are checked like training chats
    (`data.chat.check_messages`: roles the template renders, string contents, valid Unicode); whatever the template
    or the tokenizer raises on the prompt is a `PromptError` naming it."""
    # here, not at the top: the tools read and check a prompt file's lines before torch loads
    from ..common.errors import DataError
    from .chat import chat_roles, check_messages
    from .datasets import one_line_error

    try:
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise PromptError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects.")
            if getattr(tok, "chat_template", None) is None:
                raise PromptError(f"{where}: a 'messages' prompt needs a tokenizer with a chat template.")
            check_messages(messages, where, chat_roles(tok))
            if messages[-1].get("role") == "assistant":
                messages = messages[:-1]  # the prompt is everything before the answer
            out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                          **template_kwargs)
            return out["input_ids"]
        text = record.get("text", record.get("prompt"))
        if not isinstance(text, str):
            raise PromptError(f"{where}: 'text' / 'prompt' must be a string.")
        return tok(text)["input_ids"]
    except PromptError:
        raise
    except DataError as err:
        raise PromptError(str(err)) from None
    except Exception as err:  # the template's, the tokenizer's: this prompt, named
        raise PromptError(f"{where}: cannot tokenise the prompt ({one_line_error(err)}).") from err


def load_prompt_ids(path: str, tokenizer: TokenizerSource, limit: Optional[int] = None) -> list[list[int]]:
    return [tokenize_prompt(item, tokenizer) for item in read_prompt_file(path, limit)]


def _content_ids(ids: list[int], tokenizer) -> list[int]:
    """`ids` without the special tokens a chat template adds (the unknown token stays)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) - {unk}
    return [t for t in ids if t not in special]


def unknown_token_fraction(ids: list[int], tokenizer) -> float:
    """Fraction of the prompt's content tokens (special tokens aside) that are the unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    content = _content_ids(ids, tokenizer)
    if unk is None or not content:
        return 0.0
    return sum(1 for t in content if t == unk) / len(content)


def unknown_token_warning(ids: list[int], tokenizer, where: str) -> Optional[str]:
    """A warning when most of a prompt's tokens are the tokenizer's unknown token, else None."""
    fraction = unknown_token_fraction(ids, tokenizer)
    if fraction < UNKNOWN_WARNING_FRACTION:
        return None
    content = len(_content_ids(ids, tokenizer))
    unknown = round(fraction * content)
    return (f"warning: {where}: {unknown} of {content} words are unknown to the tokenizer "
            f"({tokenizer.unk_token}); the target sees mostly noise, so decoding (and acceptance) says "
            "little. Use prompts in the target's vocabulary (for the embedded tiny target: "
            "examples/prompts_tiny_target.jsonl).")
