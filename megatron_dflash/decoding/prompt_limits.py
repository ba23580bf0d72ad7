"""What the target can answer: the roles its chat template renders and the prompt length its context leaves.

Regeneration checks every record against these before asking for its answers (`decoding/regenerate.py`),
so a record the training job would refuse, or a prompt past the target's positions (which a model answers
with garbage, or with an allocation error after a minute on a 1M-token record), is named before any
generation, and fails or is skipped by the bad-records rule (`data.formats.BadRecords`):

* roles: `data.chat.check_messages` with `data.chat.chat_roles(tokenizer)`, the training job's own rule;
* template: the record's last prompt (every turn up to its last question, the answers empty) must render;
* length: that prompt, with the generation prompt, must leave `max_new_tokens` of the context
  (`max_position_embeddings` of the target's config); a later turn's prompt, which holds the earlier
  answers, is checked again when it is asked (`prompt_problem`).

At most `CHARS_PER_TOKEN` x (limit + 1) characters of a prompt are tokenised to tell that it is too long, so
a 5 MB record is refused in milliseconds. Nothing here loads torch (`from_directory` loads transformers).
"""

from __future__ import annotations

from typing import Optional

from ..common.errors import DataError
from ..data.chat import check_messages, chat_roles, one_line_error

__all__ = ["CHARS_PER_TOKEN", "PromptLimits", "context_of"]

CHARS_PER_TOKEN = 32
"""More characters than any tokenizer puts in one token on average over a long text."""


def context_of(config) -> Optional[int]:
    """The positions of a HF config (its text config's `max_position_embeddings`), None when it names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class PromptLimits:
    """The rules of one tokenizer (its chat template's roles) and context (`None`: unknown, not checked)."""

    def __init__(self, tokenizer, context: Optional[int], max_new_tokens: int, template_kwargs=None):
        self.tokenizer, self.context, self.max_new_tokens = tokenizer, context, max_new_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.roles = chat_roles(tokenizer)

    @classmethod
    def from_directory(cls, path: str, max_new_tokens: int, template_kwargs=None, chat_template=None):
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        try:
            context = context_of(AutoConfig.from_pretrained(path))
        except (OSError, ValueError):  # a tokenizer directory without the model's config
            context = None
        return cls(tokenizer, context, max_new_tokens, template_kwargs)

    @property
    def prompt_limit(self) -> Optional[int]:
        return None if self.context is None else self.context - self.max_new_tokens

    def prompt_text(self, messages: list) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)

    def prompt_tokens(self, text: str, limit: int) -> tuple[int, bool]:
        """(tokens, exact): the prompt's token count, or a count above `limit` of a prefix (`exact` False)."""
        cut = CHARS_PER_TOKEN * (limit + 1)
        if len(text) > cut:
            n = len(self.tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
            if n > limit:
                return n, False
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]), True

    def prompt_problem(self, messages: list, what: str = "the prompt") -> Optional[str]:
        """Why `messages` cannot be answered: the chat template refuses them, or they do not fit the context
        with `max_new_tokens` (None: they can)."""
        try:
            text = self.prompt_text(messages)
        except Exception as err:  # raise_exception() of a template that refuses the turn order, ...
            return f"the chat template refuses {what} ({one_line_error(err)})"
        limit = self.prompt_limit
        if limit is None:
            return None
        if limit < 1:
            return (f"--max-new-tokens {self.max_new_tokens} leaves no room for a prompt in the target's context of "
                    f"{self.context} positions")
        n, exact = self.prompt_tokens(text, limit)
        if n <= limit:
            return None
        return (f"{what} is {'' if exact else 'more than '}{n} tokens; with --max-new-tokens {self.max_new_tokens} "
                f"it does not fit the target's context of {self.context} positions (max_position_embeddings): "
                "shorten the record or lower --max-new-tokens")

    def check_record(self, messages: list, where: str) -> None:
        """A `DataError` naming `where` when the record uses a role the template does not render (the training
        job's rule), or the template refuses it, or its last prompt with empty answers (a lower bound of the
        prompt the last turn will have) already leaves less than `max_new_tokens` of the context."""
        check_messages(messages, where, self.roles)
        last = max(i for i, m in enumerate(messages) if m["role"] != "assistant")
        skeleton = [{"role": m["role"], "content": ""} if m["role"] == "assistant" else m for m in messages[:last + 1]]
        problem = self.prompt_problem(skeleton, "its prompt (the turns without the answers)")
        if problem is not None:
            raise DataError(f"{where}: {problem}.")
