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


KWARGS_TEMPLATE = "{{ 'please ' if short else '' }}"  # a template kwarg the prompts must be rendered with


def _kwargs_tokenizer():
    from transformers import AutoTokenizer

    from megatron_dflash.embedded_job import synthetic_corpus as sc
    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    tok = AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)
    tok.chat_template = KWARGS_TEMPLATE + sc.CHAT_TEMPLATE
    return tok


def _rendered(tok, messages, **kwargs) -> list:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs)
    return [int(t) for t in out["input_ids"]]


def test_the_tool_renders_chat_prompts_with_the_runs_template_and_kwargs(tmp_path, capsys):
    """tools/evaluate_acceptance.py --chat-template FILE --chat-template-kwargs JSON: the prompts are the ones
    training rendered (compared with apply_chat_template called here)."""
    import json

    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    tool = evaluate_module()
    tok = _kwargs_tokenizer()
    template = tmp_path / "template.jinja"
    template.write_text(tok.chat_template)
    chats = [[{"role": "user", "content": "count from 1 to 3"}], [{"role": "user", "content": "spell the word cat"}]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    (tmp_path / "config.json").write_text("{}")  # the draft is not loaded here
    args = tool.parse_args(["--draft", str(tmp_path), "--target", SHIPPED_TARGET_DIR, "--prompts", str(prompts),
                            "--chat-template", str(template), "--chat-template-kwargs", '{"short": true}'])
    ids, _, _ = tool.read_prompts(args.prompts, None, tool.PromptTokenizer(args.target, args.chat_template),
                               args.template_kwargs)
    assert ids == [_rendered(tok, m, short=True) for m in chats]
    plain, _, _ = tool.read_prompts(args.prompts, None, tool.PromptTokenizer(args.target, args.chat_template), {})
    assert plain == [_rendered(tok, m) for m in chats] != ids
    with pytest.raises(SystemExit) as stop:
        tool.parse_args(["--draft", str(tmp_path), "--chat-template-kwargs", "[1]"])
    assert stop.value.code == 2 and "--chat-template-kwargs must be a JSON object" in capsys.readouterr().err


def test_the_held_out_synthetic_prompts_take_the_template_kwargs():
    """`--dflash-eval-prompts N` renders the held-out chats with --chat-template-kwargs, like the data."""
    from megatron_dflash.embedded_job.synthetic_corpus import conversations
    from megatron_dflash.training.arguments import EMBEDDED_SYNTHETIC_HELDOUT_SEED
    from megatron_dflash.training.job import synthetic_eval_prompts

    tok = _kwargs_tokenizer()
    expected = [_rendered(tok, chat[:1], short=True) for chat in conversations(EMBEDDED_SYNTHETIC_HELDOUT_SEED, 3)]
    assert synthetic_eval_prompts(tok, 3, template_kwargs={"short": True}) == expected
    assert synthetic_eval_prompts(tok, 3) != expected
