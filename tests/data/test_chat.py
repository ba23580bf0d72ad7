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


# --------------------------------------------------------------------------------------------------
# Chat options: a Qwen3-style template given by file, its kwargs, thinking, the turns the loss covers
# --------------------------------------------------------------------------------------------------

# Qwen3-style: ChatML turns; an assistant's thinking (reasoning_content, or <think>...</think> in its content)
# rendered as a <think> block before the answer; enable_thinking=false puts an empty block in the generation
# prompt and in the assistant turns without thinking, as the prompt of a non-thinking answer.
# ``history_thinking=False`` renders the thinking of the last turn only (Qwen3's own convention).
QWEN3_STYLE = """{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content %}{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}{%- endif %}
{%- if HISTORY or loop.last %}{%- set shown = reasoning.strip() %}{%- else %}{%- set shown = '' %}{%- endif %}
{%- if shown or (enable_thinking is defined and enable_thinking is false) %}
{{- '<|im_start|>assistant\\n<think>\\n' + shown + '\\n</think>\\n\\n' + content.strip() + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

THINKING_CHAT = [
    {"role": "system", "content": "count"},
    {"role": "user", "content": "count from 3 to 7"},
    {"role": "assistant", "content": "3 4 5 6 7", "reasoning_content": "the cat is red"},
    {"role": "user", "content": "spell the word cat"},
    {"role": "assistant", "content": "<think>\nspell c then a then t\n</think>\n\nc a t"},
]
PLAIN_CHAT = [{"role": "system", "content": "count"}, *MULTI_TURN]


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    """The embedded job's tokenizer with the ChatML tokens and the Qwen3-style template, read from a file
    through ``load_chat_template`` (as ``--chat-template FILE`` does)."""
    from megatron_dflash.data.chat import load_chat_template

    t = sc.build_tokenizer()
    t.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "system", "user", "assistant"],
                 special_tokens=True)
    path = tmp_path_factory.mktemp("template") / "qwen3_style.jinja"
    path.write_text(QWEN3_STYLE.replace("HISTORY", "true"))
    t.chat_template = load_chat_template(str(path))
    return t


def _turn_by_turn(tok, messages, *, reasoning, loss_turns, enable_thinking=True, history=True):
    """Oracle: the Qwen3-style rendering written out piece by piece here, each piece tokenised on its own and
    marked supervised or not: the headers never, the thinking with ``reasoning="train"``, the answer and its
    <|im_end|> always, of every assistant turn (``all``) or the last (``last``)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    pieces = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
            continue
        think, answer = m.get("reasoning_content", ""), m["content"]
        if "</think>" in answer:
            think, answer = answer.split("</think>")[0].split("<think>")[-1], answer.split("</think>")[-1]
        think = think.strip() if reasoning != "drop" and (history or i == last) else ""
        supervised = loss_turns == "all" or i == last
        if think:
            pieces.append(("<|im_start|>assistant\n", False))
            pieces.append((f"<think>\n{think}\n</think>\n\n", supervised and reasoning == "train"))
        elif not enable_thinking:  # the empty block is the generation prompt's: never supervised
            pieces.append(("<|im_start|>assistant\n<think>\n\n</think>\n\n", False))
        else:
            pieces.append(("<|im_start|>assistant\n", False))
        pieces.append((answer.strip() + "<|im_end|>\n", supervised))
    ids, mask = [], []
    for text, supervised in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids, mask


@pytest.mark.parametrize("reasoning", ["train", "mask", "drop"])
@pytest.mark.parametrize("loss_turns", ["all", "last"])
def test_chat_options_match_the_turn_by_turn_rendering(qwen3_tok, reasoning, loss_turns):
    from megatron_dflash.data.chat import ChatOptions

    options = ChatOptions(reasoning=reasoning, loss_turns=loss_turns)
    ids, mask = tokenize_chat(qwen3_tok, THINKING_CHAT, options=options)
    assert (ids, mask) == _turn_by_turn(qwen3_tok, THINKING_CHAT, reasoning=reasoning, loss_turns=loss_turns)
    assert qwen3_tok.convert_ids_to_tokens(ids).count("<think>") == (0 if reasoning == "drop" else 2)


@pytest.mark.parametrize("loss_turns", ["all", "last"])
def test_template_kwargs_reach_the_template(qwen3_tok, loss_turns):
    """``{"enable_thinking": false}``: the empty thinking block of a non-thinking answer, out of the loss."""
    from megatron_dflash.data.chat import ChatOptions

    options = ChatOptions(template_kwargs={"enable_thinking": False}, loss_turns=loss_turns)
    ids, mask = tokenize_chat(qwen3_tok, PLAIN_CHAT, options=options)
    assert (ids, mask) == _turn_by_turn(qwen3_tok, PLAIN_CHAT, reasoning="train", loss_turns=loss_turns,
                                        enable_thinking=False)
    assert qwen3_tok.convert_ids_to_tokens(ids).count("<think>") == 2
    assert tokenize_chat(qwen3_tok, PLAIN_CHAT) == _turn_by_turn(qwen3_tok, PLAIN_CHAT, reasoning="train",
                                                                 loss_turns="all")


def test_thinking_of_the_last_turn_only(qwen3_tok):
    """Qwen3's own convention (earlier turns lose their thinking once a later one follows): the last turn is
    exact by rendered prefixes; every turn cannot be told apart that way, and the error says what to do."""
    from megatron_dflash.data.chat import ChatOptions

    tok = sc.build_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "system", "user", "assistant"],
                   special_tokens=True)
    tok.chat_template = QWEN3_STYLE.replace("HISTORY", "false")
    for reasoning in ("train", "mask"):
        got = tokenize_chat(tok, THINKING_CHAT, options=ChatOptions(reasoning=reasoning, loss_turns="last"))
        assert got == _turn_by_turn(tok, THINKING_CHAT, reasoning=reasoning, loss_turns="last", history=False)
    with pytest.raises(ValueError, match="does not render the conversation incrementally"):
        tokenize_chat(tok, THINKING_CHAT, options=ChatOptions(loss_turns="all"))


def test_chat_options_with_generation_markers(tok):
    """``loss_turns="last"`` keeps the last span of the template's markers: the prefix rendering's."""
    from megatron_dflash.data.chat import ChatOptions

    last = ChatOptions(loss_turns="last")
    marked = tokenize_chat(tok, MULTI_TURN, assistant_mask="template", options=last)
    assert marked == tokenize_chat(tok, MULTI_TURN, assistant_mask="prefix", options=last)
    full = tokenize_chat(tok, MULTI_TURN)[1]
    tail = tokenize_chat(tok, MULTI_TURN[:-1] + [MULTI_TURN[-1]])[0]
    assert sum(marked[1]) == len(tok(MULTI_TURN[-1]["content"])["input_ids"]) + 1 < sum(full)  # answer + <|end|>
    assert marked[0] == tail


def test_chat_options_refuse_unknown_values():
    from megatron_dflash.data.chat import ChatOptions

    for bad in ({"reasoning": "keep"}, {"loss_turns": "first"}, {"template_kwargs": []}):
        with pytest.raises(ValueError):
            ChatOptions(**bad)


def test_a_cut_answer_ends_open(tok, tok_plain, qwen3_tok):
    """``cut_answer``: the chat's tokens and loss mask up to the last token of the answer's content, without the
    end of turn the template closes it with (oracles: the token strings; the turn-by-turn rendering)."""
    for t in (tok, tok_plain):
        ids, mask = tokenize_chat(t, MULTI_TURN)
        cut_ids, cut_mask = tokenize_chat(t, MULTI_TURN, cut_answer=True)
        assert t.convert_ids_to_tokens(ids)[-1] == "<|end|>"
        assert t.convert_ids_to_tokens(cut_ids)[-3:] == ["c", "a", "t"] and cut_mask[-3:] == [1, 1, 1]
        assert (cut_ids, cut_mask) == (ids[:-1], mask[:-1])
    closing = len(qwen3_tok("<|im_end|>\n", add_special_tokens=False)["input_ids"])
    for chat in (PLAIN_CHAT, THINKING_CHAT):
        ids, mask = _turn_by_turn(qwen3_tok, chat, reasoning="train", loss_turns="all")
        assert tokenize_chat(qwen3_tok, chat, cut_answer=True) == (ids[:-closing], mask[:-closing])
    # an answer whose last token is the header's (a newline) or that is empty: only the end of turn goes
    for answer in ("c a t\n", ""):
        chat = MULTI_TURN[:3] + [{"role": "assistant", "content": answer}]
        ids, mask = _turn_by_turn(qwen3_tok, chat, reasoning="train", loss_turns="all")
        assert tokenize_chat(qwen3_tok, chat, cut_answer=True) == (ids[:-closing], mask[:-closing]), repr(answer)
    with pytest.raises(ValueError, match="does not end with an assistant message"):
        tokenize_chat(tok, MULTI_TURN[:3], cut_answer=True)
