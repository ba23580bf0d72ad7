"""Chat records: rendering with the tokenizer's chat template and the chat options (`ChatOptions`: template
kwargs, what becomes of thinking, the turns the loss covers), the assistant loss mask, the roles a record may
use and the check of a record's messages (docs/design.md §8 Data path).

The assistant spans come from the template's ``{% generation %}`` markers when it has them (and the tokenizer
is a fast one), otherwise from rendering prefixes of the conversation (``assistant_mask_from_prefixes``);
the thinking inside a span from rendering the turn with its thinking and no answer (``--reasoning mask``).
Nothing here loads torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Optional, Sequence

from ..common.errors import DataError

__all__ = [
    "REASONING_MODES",
    "LOSS_TURNS",
    "ChatOptions",
    "load_chat_template",
    "prepare_messages",
    "render_chat",
    "tokenize_chat",
    "template_has_generation_markers",
    "assistant_mask_from_prefixes",
    "CHAT_ROLES",
    "chat_roles",
    "check_messages",
    "unicode_problem",
    "json_kind",
    "one_line_error",
]

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


REASONING_MODES = ("train", "mask", "drop")
"""What becomes of an assistant's thinking (``reasoning_content``, ``<think>...</think>`` in its content):
trained on like the answer, kept in the input but out of the loss, or removed before rendering."""

LOSS_TURNS = ("all", "last")
"""Which assistant turns the loss covers: every one, or only the last."""

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a chat becomes tokens and a loss mask (docs/design.md §8 Data path).

    ``template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``{"enable_thinking": False}``);
    ``reasoning`` is one of `REASONING_MODES`, ``loss_turns`` one of `LOSS_TURNS`; ``assistant_mask`` as
    ``tokenize_chat`` documents. A chat template given by file is set on the tokenizer itself
    (`load_chat_template`), so every rendering of the job (data, evaluation prompts) uses it.
    """

    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reasoning: str = "train"
    loss_turns: str = "all"
    assistant_mask: str = "auto"

    def __post_init__(self):
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {self.reasoning!r}.")
        if self.loss_turns not in LOSS_TURNS:
            raise ValueError(f"loss_turns must be one of {', '.join(LOSS_TURNS)}, got {self.loss_turns!r}.")
        if self.assistant_mask not in ("auto", "template", "prefix"):
            raise ValueError(f"assistant_mask must be 'auto', 'template' or 'prefix', got {self.assistant_mask!r}.")
        if not isinstance(self.template_kwargs, Mapping):
            raise ValueError(f"template_kwargs must be a JSON object, got {type(self.template_kwargs).__name__}.")


def load_chat_template(path: str) -> str:
    """The Jinja chat template in file ``path`` (a ``.jinja`` file, or a tokenizer_config-style JSON file with
    a ``chat_template`` string)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        text = json.loads(text).get("chat_template")
        if not isinstance(text, str):
            raise ValueError(f"{path}: no 'chat_template' string in the JSON file.")
    if not text.strip():
        raise ValueError(f"{path}: the chat template is empty.")
    return text


def prepare_messages(messages: list, reasoning: str = "train") -> list:
    """The messages to render: with ``reasoning="drop"`` the assistants' ``reasoning_content`` and
    ``<think>...</think>`` blocks are removed; otherwise ``messages`` as they are (the template renders the
    thinking its way)."""
    if reasoning != "drop":
        return messages
    out = []
    for message in messages:
        if message.get("role") == "assistant":
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
            if isinstance(message.get("content"), str):
                message["content"] = _THINK_BLOCK.sub("", message["content"])
        out.append(message)
    return out


def render_chat(tokenizer, messages: list, options: Optional[ChatOptions] = None, *,
                add_generation_prompt: bool = False) -> str:
    """The chat template's text of ``messages`` (prepared for ``options.reasoning``) with the options' kwargs."""
    options = options or ChatOptions()
    return tokenizer.apply_chat_template(prepare_messages(messages, options.reasoning), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **options.template_kwargs)


def _render_ids(tokenizer, messages: list, *, add_generation_prompt: bool, kwargs: Mapping = None) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **(kwargs or {})
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


def _assistant_span(tokenizer, messages: list, i: int, full: list[int], kwargs: Mapping) -> tuple[int, int]:
    """[start, end) of assistant message ``i`` in ``full``: from the end of ``messages[:i]`` rendered with the
    generation prompt (the assistant header) to the end of ``messages[:i + 1]`` rendered without it, so it
    covers the content and the end-of-turn tokens the template emits after it, like ``{% generation %}``."""
    if i == 0:
        # No prefix to render (templates refuse empty conversations): the content starts where the
        # rendering with an empty content first differs from the full one.
        start = _common_prefix(full, _render_ids(tokenizer, [dict(messages[0], content="")],
                                                 add_generation_prompt=False, kwargs=kwargs))
    else:
        start = _boundary(full, _render_ids(tokenizer, messages[:i], add_generation_prompt=True, kwargs=kwargs),
                          f"messages[:{i}] with the generation prompt")
    end = _boundary(full, _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, kwargs=kwargs),
                    f"messages[:{i + 1}]")
    return start, end


def _assistant_indices(messages: list, loss_turns: str) -> list[int]:
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return indices[-1:] if loss_turns == "last" else indices


def assistant_mask_from_prefixes(tokenizer, messages: list, input_ids: Sequence[int], *,
                                 kwargs: Optional[Mapping] = None, loss_turns: str = "all") -> list[int]:
    """Assistant mask of ``input_ids`` (the rendering of ``messages``) for templates without markers, by
    rendering prefixes of the conversation (`_assistant_span`); ``loss_turns="last"`` renders and marks only
    the last assistant message (whose prefixes a template renders as in the whole chat even when it renders
    earlier turns differently once later ones follow, like Qwen3 dropping earlier thinking)."""
    full = [int(t) for t in input_ids]
    mask = [0] * len(full)
    for i in _assistant_indices(messages, loss_turns):
        start, end = _assistant_span(tokenizer, messages, i, full, kwargs or {})
        for j in range(start, end):
            mask[j] = 1
    return mask


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of ones in ``mask``."""
    runs, start = [], None
    for j, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


def _reasoning_end(tokenizer, messages: list, i: int, full: list[int], span: tuple[int, int], kwargs: Mapping) -> int:
    """Where the answer of assistant message ``i`` starts in ``full``: the end of what the template renders for
    the message with its thinking (``reasoning_content``, or its content up to the last ``</think>``) and no
    answer. The thinking the template renders, its tags included, lies in ``[span[0], that)``."""
    message = messages[i]
    content = message.get("content") or ""
    cut = content.rfind("</think>")
    probe = dict(message, content=content[: cut + len("</think>")] if cut >= 0 else "")
    lcp = _common_prefix(full, _render_ids(tokenizer, messages[:i] + [probe], add_generation_prompt=False,
                                           kwargs=kwargs))
    return min(max(lcp, span[0]), span[1])


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


CONTENT_PROBES = ("", "A", "B")
"""Contents rendered in place of the last message's to find what the template renders after it (`open_end`)."""


def open_end(tokenizer, messages: list, ids: list[int], mask: list[int], kwargs: Mapping) -> tuple[list, list]:
    """``ids``/``mask`` of a chat whose last message is an answer the target never finished (cut at the
    regeneration's ``max_new_tokens``, or cut to fit the sequence) without what the template renders after its
    content (its end of turn and whatever follows the conversation), which would teach the draft a stop the
    target never made.

    What follows the content is the shortest common suffix of ``ids`` and the chat rendered with each of
    `CONTENT_PROBES` as the last message's content: every rendering ends with it, and a content differs from
    at least one probe at its own last token, whatever the tokenizer (a word-level one maps both letters to
    one unknown token; the empty content meets the header)."""
    content = messages[-1].get("content") or ""
    closing = min(_common_suffix(ids, _render_ids(tokenizer, messages[:-1] + [dict(messages[-1], content=probe)],
                                                  add_generation_prompt=False, kwargs=kwargs))
                  for probe in CONTENT_PROBES if probe != content)
    return ids[: len(ids) - closing], mask[: len(mask) - closing]


def tokenize_chat(tokenizer, messages: list, *, assistant_mask: Optional[str] = None,
                  options: Optional[ChatOptions] = None, cut_answer: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of a chat and its loss mask (1 on the assistant tokens the loss covers).

    Args:
        tokenizer: a HF tokenizer with a chat template.
        messages: ``[{"role": ..., "content": ..., "reasoning_content"?: ...}, ...]``.
        assistant_mask: ``"template"`` uses the template's ``{% generation %}`` markers
            (``return_assistant_tokens_mask``); ``"prefix"`` computes the spans by tokenising prefixes of
            the conversation; ``"auto"`` picks ``"template"`` when the template has markers and the
            tokenizer is a fast one, ``"prefix"`` otherwise. Overrides ``options.assistant_mask``.
        cut_answer: the last message is an assistant's answer that did not end (`open_end`): the tokens the
            template renders after its content are left out, so the chat ends open, as the target left it.
        options: `ChatOptions`: the template kwargs, what becomes of thinking (``reasoning``: dropped before
            rendering, or with ``"mask"`` rendered but out of the loss) and which turns the loss covers.
    """
    options = options or ChatOptions()
    if assistant_mask is not None:
        options = dataclasses.replace(options, assistant_mask=assistant_mask)
    kwargs, mode = dict(options.template_kwargs), options.assistant_mask
    messages = prepare_messages(messages, options.reasoning)
    if mode == "auto":
        markers = template_has_generation_markers(tokenizer)
        mode = "template" if markers and getattr(tokenizer, "is_fast", False) else "prefix"
    if mode == "template":
        if not template_has_generation_markers(tokenizer):
            raise ValueError(
                "assistant_mask='template' needs {% generation %} markers in the chat template; "
                "use assistant_mask='prefix' (or 'auto')."
            )
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        ids, mask = [int(t) for t in out["input_ids"]], [int(m) for m in out["assistant_masks"]]
        indices = _assistant_indices(messages, "all")
        spans = _runs(mask)
        if len(spans) != len(indices):
            raise ValueError(f"the template's generation markers give {len(spans)} assistant spans for "
                             f"{len(indices)} assistant messages; use assistant_mask='prefix'.")
        spans = dict(zip(indices, spans))
    else:
        ids = _render_ids(tokenizer, messages, add_generation_prompt=False, kwargs=kwargs)
        spans = {i: _assistant_span(tokenizer, messages, i, ids, kwargs)
                 for i in _assistant_indices(messages, options.loss_turns)}
    mask = [0] * len(ids)
    for i in _assistant_indices(messages, options.loss_turns):
        start, end = spans[i]
        if options.reasoning == "mask":
            start = _reasoning_end(tokenizer, messages, i, ids, (start, end), kwargs)
        mask[start:end] = [1] * (end - start)
    if cut_answer:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("cut_answer: the chat does not end with an assistant message")
        return open_end(tokenizer, messages, ids, mask, kwargs)
    return ids, mask


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


def json_kind(value) -> str:
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


def one_line_error(err: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception on one line, at most ``limit`` characters of the message (what a
    record's error says of a template's or a tokenizer's exception)."""
    text = " ".join(str(err).split()).encode("utf-8", "backslashreplace").decode("utf-8")  # printable
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def unicode_problem(text: str) -> Optional[str]:
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
            shown = json.dumps(role)[:40] if isinstance(role, str) else json_kind(role)
            raise DataError(f"{where}: message {j}: role is {shown}, not one of the roles the chat template "
                            f"renders ({', '.join(roles)}).")
        content = message.get("content")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {j} ({role}): content is {json_kind(content)}, not a string.")
        problem = unicode_problem(content)
        if problem is not None:
            raise DataError(f"{where}: message {j} ({role}): the content {problem}.")
    return messages
