"""Every draft setting on the command line, with the published recipe's defaults for a real target.

The recipe (NeMo AutoModel's DFlash recipes): 5 draft layers, block size 16, 512 anchors per row, decay
length 7 for block 16, DFlash 2 selector rank 256 / top-k 16 / 2-tap convolutions over groups of 16 /
selector loss weight 1, Domino embedding 256 / GRU 1024 / shift_label / one uncorrected slot, JetSpec
uniform weights, variable-prefix base 0.9. The embedded job (no --target) keeps its small settings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from megatron_dflash.training.arguments import (
    ArgumentError,
    build_parser,
    draft_config_overrides,
    parse_args,
    resolve_decay_gamma,
    validate_args,
)
from megatron_dflash.training.job import draft_config_from_target
from megatron_dflash.variants.registry import get_variant
from repo_paths import REPO_ROOT

REPO = REPO_ROOT

# Every draft setting and the default --help must show for it.
HELP_DEFAULTS = {
    "--dflash-num-layers": "5 with --target, 2 for the embedded job",
    "--dflash-block-size": "16 with --target, 8 for the embedded job",
    "--dflash-anchors-per-sample": "512 with --target, 8 for the embedded job",
    "--dflash-decay-gamma": "7 for block 16",
    "--dflash-num-heads": "the target's",
    "--dflash-num-kv-heads": "the target's",
    "--dflash-head-dim": "the target's",
    "--dflash-intermediate-size": "the target's",
    "--dflash-sliding-window": "none",
    "--dflash-layer-types": "full_attention on every layer",
    "--dflash-input-embedding-scale": "1.0",
    "--dflash-output-multiplier": "1.0",
    "--dflash-final-logit-softcapping": "none",
    "--dflash-soft-target": "none",
    "--dflash-distill-temperature": "1.0",
    "--dflash-loss-weighting": "decay",
    "--dflash-dpace-alpha": "0.5",
    "--dflash-dpace-normalization": "weight_sum",
    "--dflash-variable-prefix": "0.9",
    "--dflash-selector-rank": "256",
    "--dflash-selector-top-k": "16",
    "--dflash-conv-kernel-size": "2",
    "--dflash-conv-group-size": "16",
    "--dflash-selector-loss-weight": "1.0",
    "--dflash-domino-projector-type": "domino",
    "--dflash-domino-emb-dim": "256",
    "--dflash-domino-gru-hidden-dim": "1024",
    "--dflash-domino-shift-label": "True",
    "--dflash-domino-pure-draft-prefix-len": "1",
    "--dflash-domino-lambda-start": "1.0",
    "--dflash-domino-decay-ratio": "0.5",
}

TARGET = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 12, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 4096,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


@pytest.fixture
def target_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TARGET))
    return str(tmp_path)


def args_for(*argv, target=None):
    argv = list(argv) + (["--target", target, "--data-format", "synthetic"] if target else [])
    return validate_args(parse_args(argv), 1, env={}, cuda=False)


def help_text_of(flag: str, text: str) -> str:
    """The help entry of `flag` in `--help` output, joined onto one line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(flag + " ") or line.strip() == flag
                 or line.strip().startswith(flag + ","))
    entry = [lines[start]]
    for line in lines[start + 1:]:
        if line.startswith("  -") or not line.strip():
            break
        entry.append(line)
    return " ".join(" ".join(entry).split())


def test_help_lists_every_draft_setting_with_its_default():
    out = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_dflash.py"), "--help"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    for flag, default in HELP_DEFAULTS.items():
        entry = help_text_of(flag, out.stdout)
        assert "default" in entry and default in entry, (flag, entry)
    # No --dflash-* option without a stated default (plain on/off flags have none to state).
    for action in build_parser()._actions:
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            continue
        for flag in action.option_strings:
            if flag.startswith("--dflash-"):
                assert "default" in help_text_of(action.option_strings[0], out.stdout), flag


def test_recipe_defaults_with_a_target_and_the_embedded_job_without(target_dir):
    args = args_for(target=target_dir)
    assert (args.dflash_num_layers, args.dflash_block_size, args.dflash_anchors_per_sample) == (5, 16, 512)
    assert (args.dflash_selector_rank, args.dflash_selector_top_k) == (256, 16)
    assert (args.dflash_conv_kernel_size, args.dflash_conv_group_size, args.dflash_selector_loss_weight) == (2, 16, 1.0)
    assert (args.dflash_domino_emb_dim, args.dflash_domino_gru_hidden_dim) == (256, 1024)
    assert args.dflash_domino_shift_label is True and args.dflash_domino_pure_draft_prefix_len == 1
    assert resolve_decay_gamma(args, 16) == 7.0

    embedded = args_for()
    assert (embedded.dflash_num_layers, embedded.dflash_block_size, embedded.dflash_anchors_per_sample) == (2, 8, 8)
    assert resolve_decay_gamma(embedded, 8) == 7.0  # block_size - 1, as the embedded job always trained

    # Given explicitly, a value wins over every default, and with --dflash-init-from the drafter's
    # architecture is used (nothing set unless given).
    assert args_for("--dflash-block-size", "10", target=target_dir).dflash_block_size == 10
    drafter = os.path.join(target_dir)  # any directory with a config.json
    init = args_for("--dflash-init-from", drafter, target=target_dir)
    assert init.dflash_block_size is None and init.dflash_num_layers is None
    assert draft_config_overrides(init, 5) == {}


def test_a_variants_own_recipe_replaces_the_general_defaults(target_dir):
    """DSpark's recipe (block 7, decay 4; 5 layers and 512 anchors as the general recipe) when its flags are left
    alone, the general defaults for the other variants, and a value given wins."""
    args = args_for("--dflash-variant", "dspark", target=target_dir)
    assert (args.dflash_block_size, args.dflash_num_layers, args.dflash_anchors_per_sample) == (7, 5, 512)
    assert resolve_decay_gamma(args, 7) == 4.0
    assert (args.dflash_markov_rank, args.dflash_markov_head_type, args.dflash_confidence_threshold) == (
        256, "vanilla", None)
    embedded = args_for("--dflash-variant", "dspark")
    assert (embedded.dflash_block_size, embedded.dflash_num_layers, embedded.dflash_anchors_per_sample) == (7, 2, 8)
    assert resolve_decay_gamma(embedded, 7) == 4.0
    given = args_for("--dflash-variant", "dspark", "--dflash-block-size", "5", "--dflash-decay-gamma", "2",
                     target=target_dir)
    assert (given.dflash_block_size, resolve_decay_gamma(given, 5)) == (5, 2.0)
    assert args_for(target=target_dir).dflash_block_size == 16


@pytest.mark.parametrize("block, variant, expected", [
    (16, "dflash", 7.0), (10, "dflash", 5.0), (8, "dflash", 4.0), (12, "dflash", 5.5), (16, "dflash2", 7.0),
    (16, "domino", 7.0), (16, "jetspec", None),
])
def test_decay_gamma_default(target_dir, block, variant, expected):
    """The recipe's decay length per block size; JetSpec trains with uniform weights (its published
    setting) unless a decay is given."""
    args = args_for("--dflash-variant", variant, target=target_dir)
    assert resolve_decay_gamma(args, block) == expected
    assert resolve_decay_gamma(args_for("--dflash-variant", variant, "--dflash-decay-gamma", "3"), block) == 3.0
    assert resolve_decay_gamma(args_for("--dflash-variant", variant, "--dflash-decay-gamma", "0"), block) is None
    if variant == "jetspec":
        assert resolve_decay_gamma(args_for("--dflash-variant", "jetspec"), 8) is None


def test_every_setting_reaches_the_draft_config(target_dir):
    def build(variant, *argv):
        args = args_for("--dflash-variant", variant, "--dflash-num-layers", "3", "--dflash-block-size", "8", *argv,
                        target=target_dir)
        spec = get_variant(variant)
        return draft_config_from_target(
            TARGET, config_cls=spec.config_cls, num_layers=args.dflash_num_layers, block_size=args.dflash_block_size,
            mask_token_id=5, target_layer_ids=None, **draft_config_overrides(args, args.dflash_num_layers),
            **spec.config_overrides(spec.options.build(vars(args))),
        )

    plain = build("dflash")
    assert (plain.num_attention_heads, plain.num_key_value_heads, plain.head_dim, plain.intermediate_size) == (4, 2, 16, 160)
    assert plain.layer_types == ["full_attention"] * 3 and plain.sliding_window is None
    sized = build("dflash", "--dflash-num-heads", "8", "--dflash-num-kv-heads", "4", "--dflash-head-dim", "32",
                  "--dflash-intermediate-size", "96", "--dflash-sliding-window", "64",
                  "--dflash-input-embedding-scale", "2.0", "--dflash-output-multiplier", "0.5",
                  "--dflash-final-logit-softcapping", "30")
    assert (sized.num_attention_heads, sized.num_key_value_heads, sized.head_dim, sized.intermediate_size) == (8, 4, 32, 96)
    assert sized.layer_types == ["sliding_attention"] * 3 and sized.sliding_window == 64
    assert (sized.input_embedding_scale, sized.output_multiplier, sized.final_logit_softcapping) == (2.0, 0.5, 30.0)
    mixed = build("dflash", "--dflash-sliding-window", "64", "--dflash-layer-types",
                  "sliding_attention,full_attention,sliding_attention")
    assert mixed.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]

    d2 = build("dflash2", "--dflash-selector-rank", "32", "--dflash-selector-top-k", "4",
               "--dflash-conv-kernel-size", "3", "--dflash-conv-group-size", "8")
    assert (d2.selector_rank, d2.selector_top_k, d2.conv_kernel_size, d2.conv_group_size) == (32, 4, 3, 8)
    recipe_d2 = build("dflash2")
    assert (recipe_d2.selector_rank, recipe_d2.selector_top_k, recipe_d2.conv_group_size) == (256, 16, 16)

    domino = build("domino")
    assert (domino.emb_dim, domino.gru_hidden_dim, domino.shift_label, domino.pure_draft_prefix_len) == (256, 1024, True, 1)
    domino = build("domino", "--dflash-domino-emb-dim", "8", "--dflash-domino-gru-hidden-dim", "12",
                   "--no-dflash-domino-shift-label", "--dflash-domino-pure-draft-prefix-len", "0")
    assert (domino.emb_dim, domino.gru_hidden_dim, domino.shift_label, domino.pure_draft_prefix_len) == (8, 12, False, 0)
    assert build("jetspec").causal is True


@pytest.mark.parametrize("argv, message", [
    (["--dflash-selector-rank", "8"], "--dflash-selector-rank only applies to --dflash-variant dflash2"),
    (["--dflash-domino-emb-dim", "8"], "--dflash-domino-emb-dim only applies to --dflash-variant domino"),
    (["--dflash-selector-loss-weight", "0.5"], "only applies to --dflash-variant dflash2"),
    (["--dflash-domino-decay-ratio", "0.2"], "only applies to --dflash-variant domino"),
    (["--dflash-variant", "dflash2", "--dflash-selector-top-k", "0"], "--dflash-selector-top-k=0 must be"),
    (["--dflash-output-multiplier", "-1"], "--dflash-output-multiplier=-1.0 must be a finite number > 0"),
    (["--dflash-layer-types", "full,sliding"], "expected comma-separated full_attention / sliding_attention"),
    (["--dflash-variant", "jetspec", "--dflash-soft-target", "kl"], "--dflash-soft-target applies to"),
    (["--dflash-distill-temperature", "2"], "only applies to --dflash-variant jetspec or with --dflash-soft-target"),
    (["--dflash-variant", "dspark", "--dflash-distill-temperature", "2"],
     "--dflash-distill-temperature only applies to --dflash-variant jetspec or with --dflash-soft-target (not to dspark)."),
    (["--dflash-loss-weighting", "dpace", "--dflash-dpace-alpha", "1.5"], "--dflash-dpace-alpha=1.5 must be in [0, 1]."),
    (["--dflash-loss-weighting", "dpace", "--dflash-dpace-alpha", "-0.5"], "--dflash-dpace-alpha=-0.5 must be in [0, 1]."),
    (["--dflash-loss-weighting", "dpace", "--dflash-dpace-alpha", "nan"], "--dflash-dpace-alpha=nan must be in [0, 1]."),
    (["--dflash-dpace-alpha", "0.3"], "--dflash-dpace-alpha only applies with --dflash-loss-weighting dpace"),
    (["--dflash-dpace-normalization", "supervised"], "--dflash-dpace-normalization only applies with"),
    (["--dflash-loss-weighting", "dpace", "--dflash-decay-gamma", "4"],
     "--dflash-decay-gamma does not apply to --dflash-loss-weighting dpace"),
    (["--dflash-loss-weighting", "dpace", "--dflash-soft-target", "kl"], "it does not apply with --dflash-soft-target"),
    (["--dflash-variant", "domino", "--dflash-loss-weighting", "dpace"],
     "--dflash-loss-weighting dpace applies to --dflash-variant dflash / dflash2 / dspark (domino"),
    (["--dflash-variant", "jetspec", "--dflash-loss-weighting", "dpace-cumulative-confidence-only"],
     "applies to --dflash-variant dflash / dflash2 / dspark (jetspec"),
    (["--dflash-draft-vocab", "v.json"], "--dflash-draft-vocab needs --dflash-draft-vocab-size K"),
    (["--dflash-train-draft-head"], "--dflash-train-draft-head needs --dflash-draft-vocab-size K"),
    (["--dflash-draft-vocab-size", "0"], "--dflash-draft-vocab-size=0 must be a positive number"),
    (["--dflash-variant", "jetspec", "--dflash-draft-vocab-size", "100"],
     "--dflash-draft-vocab-size trains --dflash-variant dflash only (not jetspec)"),
    (["--dflash-draft-vocab-size", "100", "--dflash-train-draft-head", "--dflash-soft-target", "kl"],
     "--dflash-train-draft-head does not combine with --dflash-soft-target"),
])
def test_draft_setting_errors(argv, message):
    with pytest.raises(ArgumentError) as info:
        args_for(*argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)  # one line


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "dspark"])
def test_dpace_settings(target_dir, variant):
    """D-PACE has no decay; its settings reach the run's `LossWeighting`; the choices are the objective's."""
    from megatron_dflash.objectives.dflash_loss import DPACE_NORMALIZATIONS, LOSS_WEIGHTINGS, LossWeighting
    from megatron_dflash.training import arguments

    assert arguments.LOSS_WEIGHTINGS == LOSS_WEIGHTINGS and arguments.DPACE_NORMALIZATIONS == DPACE_NORMALIZATIONS
    args = args_for("--dflash-variant", variant, "--dflash-loss-weighting", "dpace", "--dflash-dpace-alpha", "0",
                    "--dflash-dpace-normalization", "sequences", target=target_dir)
    assert resolve_decay_gamma(args, 16) is None
    assert LossWeighting(args.dflash_loss_weighting, args.dflash_dpace_alpha, args.dflash_dpace_normalization) == \
        LossWeighting("dpace", 0.0, "sequences")
    plain = args_for("--dflash-variant", variant, target=target_dir)
    assert (plain.dflash_loss_weighting, plain.dflash_dpace_alpha, plain.dflash_dpace_normalization) == \
        ("decay", 0.5, "weight_sum")
    assert resolve_decay_gamma(plain, 16) == (4.0 if variant == "dspark" else 7.0)  # DSpark's recipe: decay 4


def test_variable_prefix_base_defaults_to_the_recipe():
    assert args_for("--dflash-variable-prefix").dflash_variable_prefix == 0.9
    assert args_for("--dflash-variable-prefix", "0.7").dflash_variable_prefix == 0.7
    assert args_for().dflash_variable_prefix is None
    soft = args_for("--dflash-soft-target", "kl", "--dflash-distill-temperature", "2")
    assert (soft.dflash_soft_target, soft.dflash_distill_temperature) == ("kl", 2.0)


def test_selector_loss_weight_reaches_the_dflash2_loss():
    import torch

    from megatron_dflash.objectives.dflash_loss import OutputHead
    from megatron_dflash.plan.batch_plan import DFlashBatchPlan
    from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config

    from builders import tiny_draft_kwargs

    torch.manual_seed(0)
    config = DFlash2Config(**tiny_draft_kwargs(conv_group_size=16, selector_rank=4, selector_top_k=5))
    body = DFlash2Body(config)
    with torch.no_grad():
        body.candidate_selector.successor_codebook.normal_()  # a selector that is not the identity
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[2, 6, 9]]), block_size=config.block_size, seq_length=14)
    ids = torch.randint(config.vocab_size, (1, 14))
    hidden = torch.randn(1, 3, config.block_size, config.hidden_size)
    head = OutputHead(torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False), config.vocab_size)
    spec = get_variant("dflash2")

    def loss(weight):
        options = spec.options.build(vars(args_for("--dflash-variant", "dflash2",
                                                   "--dflash-selector-loss-weight", str(weight))))
        with torch.no_grad():
            return spec.loss(body, hidden, plan, ids, head, decay_gamma=None, chunk_slots=None, options=options)

    none, one, two = loss(0.0), loss(1.0), loss(2.0)
    assert torch.equal(none.loss_sum.double(), none.metrics.base_loss_sum)
    selector_part = one.loss_sum - none.loss_sum
    assert selector_part > 0
    torch.testing.assert_close(two.loss_sum - none.loss_sum, 2 * selector_part)

    # The run's loss weighting reaches the DFlash 2 loss through its adapter.
    from megatron_dflash.objectives.dflash_loss import LossWeighting
    from megatron_dflash.variants.dflash2 import dflash2_loss

    options = spec.options.build(vars(args_for("--dflash-variant", "dflash2")))
    weighting = LossWeighting("dpace", 0.3, "supervised")
    with torch.no_grad():
        adapted = spec.loss(body, hidden, plan, ids, head, decay_gamma=None, chunk_slots=None, options=options,
                            weighting=weighting)
        direct = dflash2_loss(hidden, plan, ids, head, body.candidate_selector, chunk_slots=None, weighting=weighting)
    assert torch.equal(adapted.loss_sum, direct.loss_sum) and torch.equal(adapted.weight_sum, direct.weight_sum)
    assert not torch.allclose(adapted.metrics.base_loss_sum, one.metrics.base_loss_sum)
