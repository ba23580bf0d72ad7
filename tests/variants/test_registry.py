"""The variant registry: what it knows, and a variant added from outside the package end to end.

`test_a_registered_variant_trains_exports_and_decodes` is the recipe of docs/design.md §12 ("Adding a
variant") in code: a toy variant (DFlash whose every MLP output goes through a learned per-channel gate,
asked for through the layer spec) is defined and registered here, outside the package, trained through
`pretrain_dflash.py`'s entry point on the tiny target, exported as a HF draft, reloaded through the generic
loader and decoded with `spec_generate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.checkpoint.hf import load_hf_checkpoint
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.draft.layers import DFlashLayerSubmodules
from megatron_dflash.objectives.dflash_loss import LossWeighting, dflash_loss
from megatron_dflash.variants import (
    Variant,
    VariantLoss,
    get_variant,
    register_variant,
    unregister_variant,
    variant_for_hf_config,
    variant_names,
)
from megatron_dflash.variants.options import Flag, VariantOptions

pytestmark = pytest.mark.usefixtures("one_thread")


# ================================================================================== the toy variant

GATED_ARCHITECTURE = "GatedDFlashDraftModel"


class GatedConfig(DFlashConfig):
    """DFlash's fields; written under its own architecture name."""

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        return super().to_hf_dict(GATED_ARCHITECTURE)


class ChannelGate(nn.Module):
    """`finish(y) = y * scale` (per channel), the identity at initialisation."""

    def __init__(self, config: DFlashConfig, dtype: torch.dtype):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype))

    def prepare(self, x):
        return x, None

    def finish(self, y, coefficients):
        return y * self.scale


class GatedBody(DFlashBody):
    def __init__(self, config, parallel_config=None, tp_group=None, attention_backend="auto"):
        super().__init__(config, parallel_config=parallel_config, tp_group=tp_group,
                         attention_backend=attention_backend, layer_submodules=DFlashLayerSubmodules(mlp_conv=ChannelGate))


def gated_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None, **ctx):
    out = dflash_loss(hidden, plan, input_ids, head, decay_gamma=decay_gamma, chunk_slots=chunk_slots)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


GATED = Variant(name="gated_toy", title="Gated DFlash (toy)", config_cls=GatedConfig, body_cls=GatedBody,
                architecture=GATED_ARCHITECTURE, loss=gated_loss)


@pytest.fixture
def gated_variant():
    register_variant(GATED)
    try:
        yield GATED
    finally:
        unregister_variant(GATED.name)


# ================================================================================== tests


def test_built_in_variants_and_duplicates():
    assert {"dflash", "dflash2", "jetspec", "domino"} <= set(variant_names())
    with pytest.raises(ValueError, match="'dflash2' is registered already"):
        register_variant(get_variant("dflash2"))
    with pytest.raises(ValueError, match="built-in"):
        unregister_variant("dflash")
    with pytest.raises(ValueError, match="unknown draft variant 'nope'"):
        get_variant("nope")
    # The capabilities the training arguments and the converter ask for.
    assert get_variant("dflash").supports_variable_prefix and not get_variant("domino").supports_variable_prefix
    assert get_variant("jetspec").needs_final_hidden and get_variant("jetspec").causal is True
    # D-PACE weighs the cross entropy with the label: DFlash (and its K3 form) and DFlash 2, not Domino / JetSpec,
    # whose loss adapters refuse it even when called past the argument checks.
    assert [name for name in ("dflash", "dflash2", "kimi_k3", "domino", "jetspec") if get_variant(name).supports_dpace] \
        == ["dflash", "dflash2", "kimi_k3"]
    for name in ("domino", "jetspec"):
        with pytest.raises(ValueError, match="does not train with --dflash-loss-weighting dpace"):
            get_variant(name).loss(None, None, None, None, None, decay_gamma=None, chunk_slots=None, total_steps=1,
                                   weighting=LossWeighting("dpace"))
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        get_variant("dflash2").check_dtype(torch.float16)
    # NeMo AutoModel's class names read as ours.
    assert variant_for_hf_config({"architectures": ["Qwen3DFlash2DraftModel"]}) is get_variant("dflash2")
    assert variant_for_hf_config({"architectures": ["Qwen3DFlashDraftModel"]}) is get_variant("dflash")


def test_registration_is_refused_twice_and_unknown_flags_fail(gated_variant, tiny_target):
    with pytest.raises(ValueError, match="registered already"):
        register_variant(GATED)
    from megatron_dflash.training.arguments import ArgumentError, parse_args
    from megatron_dflash.training.job import prepare_job

    with pytest.raises(ArgumentError, match="--dflash-variant nope: unknown draft variant"):
        prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", "--dflash-variant", "nope"]), 1,
                    env={}, cuda=False)
    # A flag that belongs to another variant is refused for the new one as for the built-in ones.
    with pytest.raises(ArgumentError, match="only applies to --dflash-variant dflash2"):
        prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", "--dflash-variant", "gated_toy",
                                "--dflash-selector-rank", "8"]), 1, env={}, cuda=False)


def test_a_registered_variant_trains_exports_and_decodes(gated_variant, tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_dflash.decoding.generate import spec_generate
    from megatron_dflash.training.loop import main

    export = tmp_path / "hf"
    code = main(["--target", tiny_target, "--dflash-variant", "gated_toy", "--dflash-export", str(export),
                 "--run-dir", str(tmp_path), "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                 "--dflash-num-layers", "2", "--dflash-block-size", "8", "--data-format", "synthetic",
                 "--no-progress-bar", "--seq-length", "48", "--synthetic-train-samples", "16",
                 "--synthetic-valid-samples", "8", "--eval-iters", "1", "--dflash-anchors-per-sample", "4",
                 "--lr", "5e-3", "--lr-warmup-iters", "1", "--train-iters", "2", "--micro-batch-size", "4",
                 "--global-batch-size", "4", "--dflash-eval-prompts", "0"])
    assert code == 0
    # The HF export and the training checkpoint carry the variant's own architecture and tensors.
    with open(export / "config.json") as f:
        assert json.load(f)["architectures"] == [GATED_ARCHITECTURE]
    with open(tmp_path / "ckpt" / "iter_0000002" / "dflash_config.json") as f:
        assert json.load(f)["architectures"] == [GATED_ARCHITECTURE]
    draft = load_hf_checkpoint(str(export), attention_backend="chunked").eval()
    assert type(draft) is GatedBody and type(draft.config) is GatedConfig
    gate = draft.layers[0].mlp_conv.scale
    assert not torch.equal(gate, torch.ones_like(gate)), "the gate was trained and exported"

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    prompts = [[3, 10, 20, 7], [5, 9, 11, 12, 13, 2]]
    out = spec_generate(target, draft, prompts, max_new_tokens=12)
    for b, prompt in enumerate(prompts):  # greedy speculative decoding is lossless
        reference = list(prompt)
        with torch.no_grad():  # the target's own greedy continuation (no stop token, as above)
            for _ in range(12):
                reference.append(int(target(torch.tensor([reference])).logits[0, -1].argmax()))
        assert out.sequence(b) == reference, f"row {b}"
    assert out.num_draft_forwards > 0 and all(1 + sum(a) == 12 for a in out.acceptance_lengths)


# ================================================================================== the plug-in boundary


@dataclass(frozen=True)
class ScaledOptions:
    """The toy variant's own settings: a factor on its loss, and the schedule it last saw."""

    loss_scale: float = 1.0


SCALED_FLAGS = (Flag("--dflash-toy-loss-scale", "loss_scale", float, 1.0, check="finite_non_negative",
                     help="toy: factor on the DFlash loss."),)
SEEN: list = []  # (options, step, total_steps) of every call of the toy's loss adapter


def scaled_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, options, step, total_steps, **ctx):
    SEEN.append((options, step, total_steps))
    out = dflash_loss(hidden, plan, input_ids, head, decay_gamma=decay_gamma, chunk_slots=chunk_slots)
    return VariantLoss(out.loss_sum * options.loss_scale, out.weight_sum, out.metrics)


SCALED = Variant(name="scaled_toy", title="Scaled DFlash (toy)", config_cls=DFlashConfig, body_cls=DFlashBody,
                 architecture="ScaledDFlashDraftModel", loss=scaled_loss,
                 options=VariantOptions(ScaledOptions, flags=SCALED_FLAGS))


def test_a_registered_variant_declares_its_flag_as_data_and_its_loss_reads_its_options(tiny_target, tmp_path):
    """A variant from outside the package: its flag, declared as data, reaches the parser, is checked and
    refused for the other variants like a built-in one's, and arrives in its loss adapter as its options record
    (with the schedule's length), through the job and the training loop, with nothing changed outside this test."""
    from megatron_dflash.training.arguments import ArgumentError, parse_args
    from megatron_dflash.training.job import prepare_job
    from megatron_dflash.training.loop import main

    common = ["--target", tiny_target, "--data-format", "synthetic", "--run-dir", str(tmp_path), "--dflash-num-layers",
              "1", "--dflash-block-size", "4", "--seq-length", "16"]
    with pytest.raises(SystemExit):  # not a flag before the variant is registered
        parse_args([*common, "--dflash-toy-loss-scale", "2"])
    register_variant(SCALED)
    try:
        job = prepare_job(parse_args([*common, "--dflash-variant", "scaled_toy", "--dflash-toy-loss-scale", "2.5"]),
                          1, env={}, cuda=False)
        assert job.variant is SCALED and job.variant_options == ScaledOptions(loss_scale=2.5)
        assert prepare_job(parse_args([*common, "--dflash-variant", "scaled_toy"]), 1, env={},
                           cuda=False).variant_options == ScaledOptions(loss_scale=1.0)
        with pytest.raises(ArgumentError, match=r"--dflash-toy-loss-scale=-1.0 must be a finite number >= 0"):
            prepare_job(parse_args([*common, "--dflash-variant", "scaled_toy", "--dflash-toy-loss-scale", "-1"]), 1,
                        env={}, cuda=False)
        with pytest.raises(ArgumentError, match="--dflash-toy-loss-scale only applies to --dflash-variant scaled_toy"):
            prepare_job(parse_args([*common, "--dflash-toy-loss-scale", "2"]), 1, env={}, cuda=False)

        SEEN.clear()
        code = main([*common, "--dflash-variant", "scaled_toy", "--dflash-toy-loss-scale", "3",
                     "--no-progress-bar",
                     "--synthetic-train-samples", "8", "--synthetic-valid-samples", "4", "--eval-iters", "1",
                     "--dflash-anchors-per-sample", "2", "--lr-warmup-iters", "0", "--train-iters", "2",
                     "--micro-batch-size", "2", "--global-batch-size", "2", "--dflash-eval-prompts", "0",
                     "--dflash-export", str(tmp_path / "hf")])
        assert code == 0
        trained = [(options, step, total) for options, step, total in SEEN]
        assert trained and all(options == ScaledOptions(loss_scale=3.0) and total == 2 for options, _, total in trained)
        assert {step for _, step, _ in trained} >= {0, 1}
    finally:
        unregister_variant(SCALED.name)
    with pytest.raises(SystemExit):  # its flag leaves with it
        parse_args([*common, "--dflash-toy-loss-scale", "2"])


def test_nothing_outside_the_variants_names_a_variant_or_reads_argparse_inside_them():
    """docs/design.md §12's boundary rule: no variant name as a string outside `variants/` (and the K3 draft
    family's package), except where a target family names its draft family, target family or HF model type
    (`target/families.py`: those are not variant names, though K3's coincide); no `argparse` inside `variants/`."""
    import ast
    import pathlib

    import megatron_dflash
    from megatron_dflash.target.families import TARGET_FAMILIES

    package = pathlib.Path(megatron_dflash.__file__).parent
    family_names = {n for f in TARGET_FAMILIES.values() for n in (f.name, f.draft_family, *f.model_types)}
    names = {name for name in variant_names() if name != "dflash"}  # "dflash" is also the package's own word
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        source = path.read_text()
        if relative.startswith("variants/"):
            assert "argparse" not in source, f"{relative} reads argparse; declare flags as variants.options.Flag data"
            continue
        if relative.startswith("draft/kimi_k3/"):
            continue
        allowed = family_names if relative == "target/families.py" else set()
        found += [f"{relative}:{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Constant) and node.value in names - allowed]
    assert not found, f"variant names outside variants/: {found}"
