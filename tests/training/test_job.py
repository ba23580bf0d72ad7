"""The MASK token of a new draft, chosen the published way (`training.job.choose_mask_token`, docs/design.md §2):
the flag, else the tokenizer's mask token, else the first embedding row past the tokenizer's ids, else refused
in one line; never a resize, never pad or EOS."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR
from megatron_dflash.training.arguments import ArgumentError
from megatron_dflash.training.job import choose_mask_token

ROWS = 320  # the tiny target's embedding; its tokenizer's ids are 0..314


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)


@pytest.fixture
def no_mask(tokenizer):
    tok = AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)
    tok.mask_token = None
    assert tok.mask_token_id is None
    return tok


def test_the_tokenizers_mask_token(tokenizer):
    mask, why = choose_mask_token(None, tokenizer, ROWS, "tok/")
    assert mask == tokenizer.convert_tokens_to_ids("<|mask|>") and "<|mask|>" in why


def test_without_one_the_first_row_no_token_maps_to(no_mask):
    mask, why = choose_mask_token(None, no_mask, ROWS, "tok/")
    assert mask == 315 == len(no_mask) and mask not in no_mask.get_vocab().values() and mask < ROWS
    assert "no mask token" in why and "320-row" in why


def test_without_either_it_is_refused_in_one_line(no_mask):
    with pytest.raises(ArgumentError) as err:
        choose_mask_token(None, no_mask, 315, "tok/")  # every row of the embedding is a token
    message = str(err.value)
    assert "\n" not in message and "tok/" in message and "--dflash-mask-token-id" in message


def test_the_flag_wins(tokenizer, no_mask):
    assert choose_mask_token(7, tokenizer, ROWS, "tok/") == (7, "given by --dflash-mask-token-id")
    assert choose_mask_token(7, no_mask, 315, "tok/")[0] == 7
