"""Tests for megatron_dflash.data.chat: chat rendering, the assistant mask and the roles a record may use.

The oracle of the assistant mask is written from the token strings, independently of the implementation.
"""

from __future__ import annotations

import pytest

from megatron_dflash.data.chat import chat_roles, template_has_generation_markers, tokenize_chat
from megatron_dflash.embedded_job import synthetic_corpus as sc

from data_records import MULTI_TURN


def _expected_assistant_mask(tokens: list[str]) -> list[int]:
    """Oracle: after each <|assistant|> header, everything up to and including the next <|end|>."""
    mask, inside = [], False
    for t in tokens:
        if t == "<|assistant|>":
            mask.append(0)
            inside = True
        elif inside:
            mask.append(1)
            inside = t != "<|end|>"
        else:
            mask.append(0)
    return mask


# --------------------------------------------------------------------------------------------------
# Chat tokenisation
# --------------------------------------------------------------------------------------------------


def test_chat_mask_covers_assistant_turns(tok):
    for messages in [MULTI_TURN, *sc.conversations(7, 5)]:
        ids, mask = tokenize_chat(tok, messages)
        tokens = tok.convert_ids_to_tokens(ids)
        assert mask == _expected_assistant_mask(tokens)
        assert sum(mask) > 0
    # The supervised text of the multi-turn chat is exactly the two answers and their end tokens.
    ids, mask = tokenize_chat(tok, MULTI_TURN)
    picked = [t for t, m in zip(tok.convert_ids_to_tokens(ids), mask) if m]
    assert picked == "3 4 5 6 7 <|end|> c a t <|end|>".split()


def test_prefix_fallback_matches_generation_markers(tok, tok_plain):
    assert template_has_generation_markers(tok)
    assert not template_has_generation_markers(tok_plain)
    chats = [MULTI_TURN, [MULTI_TURN[1]] + MULTI_TURN[2:], *sc.conversations(11, 12)]  # incl. assistant first
    for messages in chats:
        reference = tokenize_chat(tok, messages, assistant_mask="template")
        assert tokenize_chat(tok_plain, messages) == reference  # "auto" falls back to prefixes
        assert tokenize_chat(tok_plain, messages, assistant_mask="prefix") == reference
        assert tokenize_chat(tok, messages, assistant_mask="prefix") == reference
    with pytest.raises(ValueError, match="generation"):
        tokenize_chat(tok_plain, MULTI_TURN, assistant_mask="template")


def test_prefix_fallback_rejects_non_incremental_template():
    t = sc.build_tokenizer()
    # The message count at the start changes with every prefix: prefixes are not token prefixes.
    t.chat_template = "{{ messages | length }} " + sc.CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    with pytest.raises(ValueError, match="incrementally"):
        tokenize_chat(t, MULTI_TURN)


def test_roles_follow_the_chat_template(tok):
    # the tiny template renders every role but the user's as the assistant's: it has no system or tool role
    assert chat_roles(tok) == ("user", "assistant")
    t = sc.build_tokenizer()
    t.chat_template = ("{% for m in messages %}{% if m['role'] in ['user', 'system', 'tool'] %}<|user|> "
                       "{{ m['content'] }} <|end|> {% else %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>"
                       "{% endgeneration %} {% endif %}{% endfor %}")
    assert chat_roles(t) == ("system", "user", "assistant", "tool")
