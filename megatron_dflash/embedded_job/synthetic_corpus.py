"""A deterministic, structured chat corpus and its word-level tokenizer.

The embedded default job needs a target that really knows something, without downloads.
This corpus is made of small tasks whose answers follow from the question (counting,
spelling, repeating, reversing, arithmetic progressions, templated facts): a tiny target
learns them in a few minutes on a CPU, and a draft can then learn to predict the target's
continuations several tokens ahead, so the acceptance length is a meaningful number.

Everything is a pure function of the seed: the same seed gives the same conversations on
every machine.
"""

from __future__ import annotations

import random
from typing import Iterator

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|end|>", "<|unk|>"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
NUMBERS = [str(i) for i in range(200)]
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "lion", "tiger", "bear", "wolf", "fox", "owl", "frog"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink"]
PLACES = ["house", "garden", "forest", "river", "city", "field", "lake", "mountain"]
WORDS = (
    "count from to spell the word repeat times reverse list continue sequence step by "
    "describe where does live what color is a an and it in on of , . : ? lives likes "
    "sleeps near every day small big quick lazy then next numbers letters say please "
    "here are answer question tell me about"
).split()


def vocabulary() -> list[str]:
    """Token strings in id order: special tokens first, so their ids never move."""
    seen: list[str] = []
    for tok in SPECIAL_TOKENS + NUMBERS + LETTERS + ANIMALS + COLORS + PLACES + WORDS:
        if tok not in seen:
            seen.append(tok)
    return seen


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randrange(0, 150)
    end = start + rng.randrange(4, 30)
    end = min(end, 199)
    return f"count from {start} to {end}", " ".join(str(i) for i in range(start, end + 1))


def _progression(rng: random.Random) -> tuple[str, str]:
    step = rng.randrange(2, 6)
    start = rng.randrange(0, 40)
    values = [start + step * i for i in range(rng.randrange(5, 20)) if start + step * i < 200]
    return (
        f"continue the sequence {values[0]} {values[1]} {values[2]}",
        " ".join(str(v) for v in values),
    )


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(ANIMALS + COLORS + PLACES)
    return f"spell the word {word}", " ".join(word)


def _repeat(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(ANIMALS + COLORS)
    n = rng.randrange(3, 12)
    return f"repeat {word} {n} times", " ".join([word] * n)


def _letters(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(0, 20)
    b = min(25, a + rng.randrange(4, 15))
    return f"list the letters from {LETTERS[a]} to {LETTERS[b]}", " ".join(LETTERS[a : b + 1])


def _reverse(rng: random.Random) -> tuple[str, str]:
    values = [str(rng.randrange(0, 100)) for _ in range(rng.randrange(3, 9))]
    return f"reverse {' '.join(values)}", " ".join(reversed(values))


def _describe(rng: random.Random) -> tuple[str, str]:
    # Facts are a fixed function of the animal, so the target can memorise them.
    animal = rng.choice(ANIMALS)
    idx = ANIMALS.index(animal)
    color, place = COLORS[idx % len(COLORS)], PLACES[(idx * 3) % len(PLACES)]
    return (
        f"tell me about the {animal}",
        f"the {animal} is {color} . it lives near the {place} and sleeps in the {place} every day .",
    )


TASKS = (_count, _progression, _spell, _repeat, _letters, _reverse, _describe)


def conversations(seed: int, count: int) -> Iterator[list[dict]]:
    """`count` single-turn chats `[{"role": "user", ...}, {"role": "assistant", ...}]`."""
    rng = random.Random(seed)
    for _ in range(count):
        question, answer = rng.choice(TASKS)(rng)
        yield [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|> {{ message['content'] }} <|end|> "
    "{% else %}<|assistant|> {% generation %}{{ message['content'] }} <|end|>{% endgeneration %} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_tokenizer():
    """A word-level `PreTrainedTokenizerFast` over `vocabulary()` with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        bos_token=None,
        unk_token="<|unk|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|endoftext|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
