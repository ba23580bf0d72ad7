"""Fixtures the data tests share: the embedded job's tokenizer, with and without generation markers."""

from __future__ import annotations

import pytest

from megatron_dflash.embedded_job import synthetic_corpus as sc


@pytest.fixture(scope="module")
def tok():
    return sc.build_tokenizer()


@pytest.fixture(scope="module")
def tok_plain():
    """The same tokenizer with a template that has no {% generation %} markers."""
    t = sc.build_tokenizer()
    t.chat_template = sc.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return t
