"""Training evaluation (`training.evaluation`): its decode numbers are the evaluation tool's."""

from __future__ import annotations

import pytest

from entry_points import evaluate_module

pytestmark = pytest.mark.usefixtures("one_thread")


def test_training_evaluation_and_the_tool_share_one_decode_metric(monkeypatch):
    """The headline decode numbers of training evaluation and of tools/evaluate_acceptance.py come from one
    definition: acceptance length = mean committed tokens per verify cycle; tokens per target forward =
    generated tokens over (each prompt's prefill + one forward per cycle), the README's definition."""
    import types

    import torch

    from megatron_dflash.training import evaluation
    from megatron_dflash.variants.registry import get_variant

    cycles, generated = [[3, 2], [], [4]], [6, 0, 5]  # the second prompt's decoding ended at once

    def fake_spec_generate(target, draft, prompts, **kwargs):
        return types.SimpleNamespace(acceptance_lengths=cycles, num_generated=torch.tensor(generated))

    monkeypatch.setattr(evaluation, "spec_generate", fake_spec_generate)
    dflash = get_variant("dflash")
    job = types.SimpleNamespace(args=types.SimpleNamespace(dflash_eval_max_new_tokens=8, dflash_eval_ignore_eos=True),
                                stop_token_ids=None, pad_token_id=0, variant=dflash,
                                variant_options=dflash.options.options_cls())
    trained = evaluation.acceptance_length(None, torch.nn.Linear(1, 1), [[1], [2], [3]], job)
    assert trained["tokens_per_target_forward"] == 11 / 6  # 3 prefills + 3 verify cycles
    tool = evaluate_module()
    rows = [{"acceptance_lengths": c, "generated_tokens": g, "mean_acceptance_length": None}
            for c, g in zip(cycles, generated)]
    summary = tool._summary(types.SimpleNamespace(), rows, 1.0, {"target_forwards": 0, "prefill_forwards": 0,
                                                                 "draft_forwards": 0}, None)
    assert trained["acceptance_length"] == summary["mean_acceptance_length"] == 3.0
    assert trained["tokens_per_target_forward"] == summary["tokens_per_target_forward"] == 11 / 6  # 3 prefills + 3
