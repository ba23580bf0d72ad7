"""The frozen target as the step uses it (`training.frozen_target.FrozenTarget`): it runs on real tokens only (the
batch cut after its longest real row), and a run trains as it would with the target over the padding too: the
same batch plans, losses, gradients and weights, with both target backends."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training_runs import training_argv, run_training

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows much shorter than the sequence length (the synthetic chats hold well under 128 tokens): most of each
# padded row is padding, as for short real chats at a longer --seq-length.
SHORT_CHATS = ["--seq-length", "128", "--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "4",
               "--dflash-eval-prompts", "0"]


def _record(monkeypatch, backend: str) -> dict:
    """Spies: the widths the target's own forward is called with, and each micro-batch's plan."""
    from megatron_dflash.target.megatron.model import MegatronTarget
    from megatron_dflash.target.taps import HFTarget
    from megatron_dflash.training.frozen_target import FrozenTarget

    seen = {"widths": [], "seq": [], "plans": []}
    module = HFTarget if backend == "hf" else MegatronTarget
    forward, call = module.forward, FrozenTarget.__call__

    def spy_forward(self, input_ids, *args, **kwargs):
        seen["widths"].append(int(input_ids.shape[1]))
        return forward(self, input_ids, *args, **kwargs)

    def spy_call(self, batch):
        seen["seq"].append(int(batch["tokens"].shape[1]))
        seen["plans"].append({f.name: getattr(batch["dflash_plan"], f.name)
                              for f in dataclasses.fields(batch["dflash_plan"])})
        return call(self, batch)

    monkeypatch.setattr(module, "forward", spy_forward)
    monkeypatch.setattr(FrozenTarget, "__call__", spy_call)
    return seen


def _steps(argv) -> list:
    """Per optimizer step: the loss, the body's gradients and its weights after the step."""
    steps = []

    def on_step(iteration, values, body):
        grads = {n: (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad)
                 .detach().clone() for n, p in body.named_parameters()}
        steps.append({"loss": values["loss"], "grads": grads,
                      "weights": {n: p.detach().clone() for n, p in body.named_parameters()}})

    run_training(argv, hooks={"on_step": on_step})
    return steps


@pytest.mark.parametrize("backend, variant", [("hf", "dflash"), ("megatron", "dflash"), ("hf", "jetspec"),
                                              ("hf", "dspark")])
def test_the_target_runs_on_real_tokens_only_and_trains_as_over_the_padding(backend, variant, tiny_target, tmp_path,
                                                                             monkeypatch):
    """At rows far shorter than --seq-length the target's forward sees only the columns up to the longest real
    row (a multiple of 16), and the run's batch plans, losses, gradients and weights equal those of the run whose
    target also computes the padding (every column); also for the losses that read the target's final hidden
    state (JetSpec, DSpark)."""
    from megatron_dflash.training import frozen_target

    args = [*SHORT_CHATS, "--target-backend", backend, "--dflash-variant", variant]
    with monkeypatch.context() as m:
        trimmed = _record(m, backend)
        short = _steps(training_argv(tiny_target, tmp_path / "trimmed", *args))
    assert trimmed["widths"] and max(trimmed["widths"]) < 128, trimmed["widths"]
    assert all(w % 16 == 0 for w in trimmed["widths"]), trimmed["widths"]
    with monkeypatch.context() as m:
        m.setattr(frozen_target, "real_length", lambda document_ids, multiple=1: document_ids.shape[1])
        padded = _record(m, backend)
        full = _steps(training_argv(tiny_target, tmp_path / "padded", *args))

    assert set(trimmed["seq"]) == {128} and set(padded["widths"]) == {128}
    assert len(trimmed["plans"]) == len(padded["plans"])
    for a, b in zip(trimmed["plans"], padded["plans"]):
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    assert len(short) == len(full) == 2
    for a, b in zip(short, full):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
        for name in b["grads"]:
            torch.testing.assert_close(a["grads"][name], b["grads"][name], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(a["weights"][name], b["weights"][name], rtol=1e-5, atol=1e-7)
