"""Decoding and the HF export of a draft with a reduced vocabulary (docs/design.md §20).

The draft proposes among its K ids, mapped to target ids through ``d2t``; the target verifies in its whole
vocabulary, so greedy decoding equals the target's own greedy output and sampled decoding follows the target's
exact law (chi-square against the enumerated distribution on a vocabulary of 8, the draft proposing among 5).
The exported directory holds what vLLM reads (``draft_vocab_size``, ``d2t`` int64 offsets, ``lm_head.weight``
``[K, H]``) and speculators' ``t2d`` mask; it loads back with identical outputs, also from a file holding only
the mask.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from megatron_dflash.checkpoint.hf import load_hf_checkpoint, read_safetensors, save_hf_checkpoint
from megatron_dflash.decoding.generate import spec_generate
from megatron_dflash.draft.draft_vocab import DraftVocabulary
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.target.head import OutputHead
from megatron_dflash.training.draft_vocab import install_draft_vocab

pytest.importorskip("transformers")
from reference_sampling import chi_square_pvalue, exact_joint, marginal  # noqa: E402
from tiny_decoding import PROMPTS, TAPS, check_statistics, hf_greedy, make_draft, qwen3_target  # noqa: E402


def _reduced_draft(target, vocab: int, ids: list, **kwargs):
    draft = make_draft(vocab, draft_vocab_size=len(ids), **kwargs)
    chosen = DraftVocabulary.from_ids(ids, vocab)
    install_draft_vocab(draft, chosen, OutputHead(target.lm_head, vocab), trainable=False)
    return draft, chosen


def test_greedy_decoding_equals_the_target_greedy_output():
    vocab, W, new = 96, 4, 23
    target = qwen3_target(vocab=vocab, mode="absorbing")
    ids = sorted(set(range(0, vocab, 2)) | {vocab - 1})  # MASK (vocab - 1) kept
    draft, chosen = _reduced_draft(target, vocab, ids, block_size=W, backend="chunked")
    out = spec_generate(target, draft, PROMPTS, max_new_tokens=new)
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == hf_greedy(target, prompt, new), f"row {b}"
    check_statistics(out, W, new)


def test_export_holds_the_serving_layout_and_loads_with_identical_outputs(tmp_path):
    vocab, W = 96, 4
    target = qwen3_target(vocab=vocab)
    ids = [0, 3, 4, 9, 17, 21, 22, 30, 38, 39, 60, 77, 95]
    draft, chosen = _reduced_draft(target, vocab, ids, block_size=W, backend="chunked")
    with torch.no_grad():
        draft.lm_head.weight.add_(0.01)  # not the target's rows any more: the export must carry its own
    save_hf_checkpoint(draft, str(tmp_path / "hf"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    tensors = read_safetensors(str(tmp_path / "hf"))
    assert config["draft_vocab_size"] == len(ids) and config["vocab_size"] == vocab
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].tolist() == [t - i for i, t in enumerate(ids)]
    assert tensors["t2d"].dtype == torch.bool and torch.nonzero(tensors["t2d"]).view(-1).tolist() == ids
    assert tuple(tensors["lm_head.weight"].shape) == (len(ids), draft.config.hidden_size)
    loaded = load_hf_checkpoint(str(tmp_path / "hf"), attention_backend="chunked")
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight) and torch.equal(loaded.d2t, draft.d2t)
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 6, len(TAPS) * draft.config.hidden_size, generator=gen)
    blocks = torch.randn(1, 1, W, draft.config.hidden_size, generator=gen)
    plan = DFlashBatchPlan.for_decoding(torch.tensor([6]), torch.arange(6)[None], block_size=W)
    with torch.no_grad():
        assert torch.equal(draft(taps, blocks, plan), loaded(taps, blocks, plan))
    first = spec_generate(target, draft, PROMPTS, max_new_tokens=12)
    again = spec_generate(target, loaded, PROMPTS, max_new_tokens=12)
    assert [first.generated(b) for b in range(len(PROMPTS))] == [again.generated(b) for b in range(len(PROMPTS))]
    assert first.acceptance_lengths == again.acceptance_lengths
    # A file with only the mask (no d2t) loads to the same mapping.
    from safetensors.torch import save_file

    only_mask = {k: v for k, v in tensors.items() if k != "d2t"}
    os.makedirs(tmp_path / "mask", exist_ok=True)
    save_file(only_mask, str(tmp_path / "mask" / "model.safetensors"))
    json.dump(config, open(tmp_path / "mask" / "config.json", "w"))
    assert torch.equal(load_hf_checkpoint(str(tmp_path / "mask")).d2t, draft.d2t)


def test_a_mask_disagreeing_with_d2t_is_refused(tmp_path):
    vocab = 40
    target = qwen3_target(vocab=vocab)
    draft, _ = _reduced_draft(target, vocab, [1, 2, 5, 39], block_size=4)
    save_hf_checkpoint(draft, str(tmp_path / "hf"))
    from safetensors.torch import save_file

    tensors = read_safetensors(str(tmp_path / "hf"))
    tensors["t2d"][7] = True
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d"):
        load_hf_checkpoint(str(tmp_path / "hf"))


def test_sampled_decoding_follows_the_target_law():
    """4 generated tokens, 3000 times, the draft proposing among 5 of 8 ids: the joint law of the generated tokens
    is the target's (rejection sampling with the draft's law placed on its target ids)."""
    pytest.importorskip("scipy")
    vocab, W, steps, N = 8, 3, 4, 3000
    target = qwen3_target(vocab=vocab, seed=2, head_std=0.3)
    draft, chosen = _reduced_draft(target, vocab, [0, 2, 3, 5, 7], block_size=W, backend="chunked", seed=5)
    prompt = [1, 4, 2, 6]
    out = spec_generate(target, draft, [prompt] * N, max_new_tokens=steps, temperature=1.0,
                        generator=torch.Generator().manual_seed(1234))
    check_statistics(out, W, steps)
    samples = [tuple(out.generated(b)) for b in range(N)]
    assert {t for s in samples for t in s} - set(chosen.ids.tolist())  # the target emits ids the draft cannot
    joint = exact_joint(target, prompt, steps, 1.0, 1.0, 0)
    cycles = Counter(a for row in out.acceptance_lengths for a in row)
    assert cycles[1] > 0 and cycles[W] > 0
    for positions in [(0,), (1,), (2,), (3,), (0, 1), (1, 2), (2, 3)]:
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        pvalue = chi_square_pvalue(counts, marginal(joint, positions), N)
        assert pvalue > 1e-4, f"positions {positions}: p-value {pvalue:.2e}"
