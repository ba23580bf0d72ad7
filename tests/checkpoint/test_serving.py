"""The serving check: every export of every variant the converter writes gets exactly the verdicts the runtimes'
readings give it, and configs built to break one rule each fail with that rule's reason.

The oracle is each runtime's reading written again here from its source, independently of the checker's
tables (`vllm_reading`, `sglang_reading`): which architectures it registers, where it reads the tap list,
the block and the MASK token and which target layer a tap id selects, and how it runs each layer in-block.
A draft is served as trained when that reading equals what the draft was built with (its `DFlashConfig`,
not the file). The rules of one model file (Domino's head, DSpark's Markov head) are stated per variant.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

import torch

from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_dflash.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.checkpoint.serving import (
    CAVEAT,
    FAILS,
    LOADS,
    check_serving,
    exit_status,
    report_lines,
    runtime_rules,
    sglang_config,
)
from megatron_dflash.variants.domino import DominoBody
from variant_drafts import VARIANTS, variant_draft

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ the runtimes' readings


def vllm_reading(config: dict) -> dict:
    """vLLM 0.34.0 (qwen3_dflash.py, eagle3_utils.get_eagle3_aux_layers_from_config): aux hidden-state indices from
    `eagle_aux_hidden_state_layer_ids` as they are, else a DFlash / DSpark tap list + 1; index k is the
    output of layer k - 1. MASK from dflash_config, then the top level. Causal: is_causal, then
    dflash_config.causal, then sliding layers. The block comes from the serve command."""
    dflash = config.get("dflash_config") or {}
    aux = config.get("eagle_aux_hidden_state_layer_ids") or None
    for ids in (dflash.get("target_layer_ids"), config.get("dspark_target_layer_ids"), config.get("target_layer_ids")):
        if aux is None and ids:
            aux = [i + 1 for i in ids]
    causal = config.get("is_causal", dflash.get("causal"))
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {
        "registered": config["architectures"][0] in {"DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel"},
        "taps": None if aux is None else [k - 1 for k in aux],
        "mask": dflash.get("mask_token_id", config.get("mask_token_id")),
        "block": None,  # from the command line
        "causal": [bool(causal) if causal is not None else t == "sliding_attention" for t in types],
    }


def sglang_reading(config: dict) -> dict:
    """SGLang 0.5.23 (dflash_utils.parse_dflash_draft_config, models/dflash.py): dflash_config first, then the top
    level; a tap id is the output of that layer; block 16 when absent; with layer_types, is_causal decides when
    present, else only sliding layers run causally; without layer_types every layer is bidirectional."""
    dflash = config.get("dflash_config") or {}
    pick = lambda name: dflash[name] if dflash.get(name) is not None else config.get(name)  # noqa: E731
    types = config.get("layer_types")
    causal = config.get("is_causal")
    return {
        "registered": config["architectures"][0] in {"DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel",
                                                     "DSparkDraftModel"},
        "taps": pick("target_layer_ids"),
        "mask": pick("mask_token_id"),
        "block": pick("block_size") or 16,
        "causal": ([False] * config["num_hidden_layers"] if not types else
                   [bool(causal) if causal is not None else t == "sliding_attention" for t in types]),
    }


def served_as_trained(reading: dict, trained) -> bool:
    directions = [trained.layer_attention(i)[0] for i in range(trained.num_hidden_layers)]
    return (reading["registered"] and reading["taps"] == list(trained.target_layer_ids)
            and reading["mask"] == trained.mask_token_id and reading["block"] in (None, trained.block_size)
            and reading["causal"] == directions)


# ------------------------------------------------------------------------------------------ the converter's exports

EXPORTED = (*VARIANTS, "dspark-vanilla", "dspark-gated")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(variant, export_for): (HF directory written by to-hf, the config it was built with)}: each tiny draft
    goes HF -> torch_dist -> HF through the converter, for both label sets SGLang may need."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for variant in EXPORTED:
        body = _markov_dspark(variant.split("-")[1]) if "-" in variant else variant_draft(variant)[0]
        save_hf_checkpoint(body, str(root / variant / "hf"))
        convert_hf_to_megatron(str(root / variant / "hf"), str(root / variant / "megatron"))
        for export_for in ("default", "sglang"):
            directory = str(root / variant / export_for)
            convert_megatron_to_hf(str(root / variant / "megatron"), directory, validate=True, export_for=export_for)
            out[variant, export_for] = (directory, body.config)
    return out


def _markov_dspark(head: str):
    from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
    from variant_drafts import common_draft_kwargs

    torch.manual_seed(1)
    return DSparkBody(DSparkConfig(**common_draft_kwargs(), markov_rank=8, markov_head_type=head),
                      attention_backend="chunked")


def verdicts(directory: str, **kwargs) -> dict:
    reports = check_serving(directory, **kwargs)
    return {r.runtime: r for r in reports}


# What the model files add to the readings (stated per variant): vLLM serves no Domino head and only the
# vanilla Markov head; SGLang 0.5.23 builds no confidence head under its default verify mode (a caveat).
MODEL_FILE_FAILURES = {
    ("domino", "sglang", "vLLM"): "no Domino correction head",
    **{(v, e, "vLLM"): "only the vanilla Markov head" for v in ("dspark", "dspark-gated")
       for e in ("default", "sglang")},
}
MODEL_FILE_CAVEATS = {(v, e, "SGLang"): "the confidence head is not used" for v in EXPORTED if v.startswith("dspark")
                      for e in ("default", "sglang")}


@pytest.mark.parametrize("export_for", ["default", "sglang"])
@pytest.mark.parametrize("variant", EXPORTED)
def test_every_export_gets_the_verdicts_of_the_runtimes_readings(exports, variant, export_for):
    directory, trained = exports[variant, export_for]
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    reports = verdicts(directory)
    for runtime, reading in (("vLLM", vllm_reading(config)), ("SGLang", sglang_reading(config))):
        report = reports[runtime]
        reasons = " | ".join(f.reason for f in report.findings)
        expected_failure = MODEL_FILE_FAILURES.get((variant, export_for, runtime))
        caveat = MODEL_FILE_CAVEATS.get((variant, export_for, runtime))
        if served_as_trained(reading, trained) and expected_failure is None:
            assert report.verdict == (CAVEAT if caveat else LOADS), (runtime, reasons)
            assert caveat is None or caveat in reasons
            assert report.command is not None and directory in report.command
        else:
            assert report.verdict == FAILS, (runtime, reasons)
            assert report.command is None
            if expected_failure is not None:
                assert expected_failure in reasons
    assert exit_status(reports.values()) == (0 if all(r.verdict != FAILS for r in reports.values()) else 1)


def test_the_verdicts_the_readings_imply_are_the_ones_users_need(exports):
    """The oracle's consequences, spelled out for vLLM 0.34.0 and SGLang 0.5.23: DFlash, DFlash 2 and JetSpec are
    served by both; Domino by SGLang once relabelled; DSpark with the rnn or gated head by SGLang only, with the
    vanilla head by both; SGLang's default verify mode leaves DSpark's confidence head unused (a caveat)."""
    expected = {
        ("dflash", "default"): (LOADS, LOADS), ("dflash2", "default"): (LOADS, LOADS),
        ("jetspec", "default"): (LOADS, LOADS), ("domino", "default"): (FAILS, FAILS),
        ("domino", "sglang"): (FAILS, LOADS), ("dspark", "default"): (FAILS, CAVEAT),
        ("dspark-gated", "default"): (FAILS, CAVEAT), ("dspark-vanilla", "default"): (LOADS, CAVEAT),
    }
    for key, (vllm, sglang) in expected.items():
        reports = verdicts(exports[key][0])
        assert (reports["vLLM"].verdict, reports["SGLang"].verdict) == (vllm, sglang), key
        assert (reports["vLLM"].version, reports["SGLang"].version) == ("0.34.0", "0.5.23")
    domino = " ".join(f.reason for f in verdicts(exports["domino", "default"][0])["SGLang"].findings)
    assert "DominoDraftModel" in domino and "--export-for sglang" in domino and "models/dflash.py:1317-1324" in domino


def test_the_previous_releases_rules_give_the_previous_verdicts(exports):
    """`versions` picks the commit-pinned rules 0.34.0 / 0.5.23 replaced, where a rule differs: SGLang @003b23d
    registered no DFlash 2 model and ran JetSpec's layers bidirectionally."""
    old = {"vllm": "036a00d", "sglang": "003b23d"}
    assert verdicts(exports["dflash2", "default"][0], versions=old)["SGLang"].verdict == FAILS
    jetspec = verdicts(exports["jetspec", "default"][0], versions=old)["SGLang"]
    assert jetspec.version == "003b23d" and jetspec.verdict == FAILS
    assert "bidirectional in-block" in reasons_of(jetspec) and "trained causal" in reasons_of(jetspec)
    assert verdicts(exports["dspark", "default"][0], versions=old)["SGLang"].verdict == LOADS
    with pytest.raises(ValueError, match="vllm=0.33.0: no rules for that release"):
        runtime_rules({"vllm": "0.33.0"})
    with pytest.raises(ValueError, match="trtllm: no such runtime"):
        runtime_rules({"trtllm": "1.0"})
    assert [r.version for r in runtime_rules({"SGLang": "003b23d"})] == ["0.34.0", "003b23d"]


def test_the_sglang_export_relabels_only_domino_and_reads_back_the_same(exports):
    for variant in VARIANTS:
        default, sglang = (json.load(open(os.path.join(exports[variant, e][0], "config.json")))
                           for e in ("default", "sglang"))
        if variant == "domino":
            assert default["architectures"] == ["DominoDraftModel"]
            assert sglang["architectures"] == ["DFlashDraftModel"]
            assert sglang["dflash_config"]["projector_type"] == "domino"
            assert sglang["dflash_config"]["pure_draft_prefix_len"] == 1
            assert {k: v for k, v in sglang.items() if k != "architectures"} == \
                {k: v for k, v in default.items() if k != "architectures"}
            assert isinstance(load_hf_checkpoint(exports[variant, "sglang"][0]), DominoBody)
        else:
            assert sglang == default, variant


def test_a_domino_draft_sglang_cannot_serve_is_refused_before_anything_is_written(tmp_path):
    body, _, _ = variant_draft("domino")
    body.config.pure_draft_prefix_len = 0
    save_hf_checkpoint(body, str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="pure_draft_prefix_len 1"):
        sglang_config(json.load(open(tmp_path / "hf" / "config.json")))
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "megatron"))
    with pytest.raises(ValueError, match="pure_draft_prefix_len 1"):
        convert_megatron_to_hf(str(tmp_path / "megatron"), str(tmp_path / "out"), export_for="sglang")
    assert not (tmp_path / "out").exists()
    sglang = verdicts(str(tmp_path / "hf"))["SGLang"]  # labelled by hand, SGLang still refuses it
    data = json.load(open(tmp_path / "hf" / "config.json"))
    data["architectures"] = ["DFlashDraftModel"]
    json.dump(data, open(tmp_path / "hf" / "config.json", "w"))
    sglang = verdicts(str(tmp_path / "hf"))["SGLang"]
    assert sglang.verdict == FAILS and "pure_draft_prefix_len 1" in " ".join(f.reason for f in sglang.findings)


# ------------------------------------------------------------------------------------------ configs that break a rule


@pytest.fixture
def dflash_dir(exports, tmp_path):
    """A copy of the plain DFlash export (both runtimes serve it) to break."""
    directory = tmp_path / "draft"
    shutil.copytree(exports["dflash", "default"][0], directory)
    return directory


def edit_config(directory, change) -> dict:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return data


def reasons_of(report) -> str:
    return " | ".join(f"{f.level}: {f.reason}" for f in report.findings)


def _pop(*path):
    def change(d):
        for key in path[:-1]:
            d = d[key]
        d.pop(path[-1], None)
    return change


def _all(*changes):
    def change(d):
        for one in changes:
            one(d)
    return change


def _set(**fields):
    return lambda d: d.update(fields)


def _set_nested(**fields):
    return lambda d: d["dflash_config"].update(fields)


def _move_to_top(name):
    return lambda d: d.update({name: d["dflash_config"].pop(name)})


_MIXED = dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)

# One rule broken per case, on a copy of an export that both runtimes serve as trained (or, for DSpark, whose
# verdicts the exports' test states): (id, export, change, vLLM 0.34.0's verdict, SGLang 0.5.23's, a phrase of
# vLLM's reason, of SGLang's). Each verdict is the one the runtime's code gives (the file:line of each rule: the
# table of docs/design.md §19 Serving check); None: no reason expected.
BREAKAGES = [
    ("drop-block_size", "dflash", _all(_pop("block_size"), _pop("dflash_config", "block_size")), CAVEAT, FAILS,
     "config.json has no block_size", "speculative_hook.py:389-422"),
    ("conflicting-block_size", "dflash", _set_nested(block_size=8), CAVEAT, FAILS,
     "dflash_config.block_size 8 and the top-level block_size 4 differ", "dflash_utils.py:608-617"),
    ("block_size-top-level-only", "dflash", _pop("dflash_config", "block_size"), LOADS, LOADS, None, None),
    ("wrong-architecture", "dflash", _set(architectures=["Qwen3ForCausalLM"]), FAILS, FAILS,
     "has no 'Qwen3ForCausalLM' in its registry, model_executor/models/registry.py:677-780",
     "has no 'Qwen3ForCausalLM' in its registry, the EntryClass lists of models/dflash.py:1317-1324"),
    ("no-mask_token_id", "dflash", _pop("dflash_config", "mask_token_id"), FAILS, FAILS,
     "qwen3_dflash.py:496-498", "'<|MASK|>'"),
    ("mask_token_id-top-level-only", "dflash", _move_to_top("mask_token_id"), LOADS, LOADS, None, None),
    ("taps-as-eagle-aux-ids", "dflash",
     lambda d: d.update(eagle_aux_hidden_state_layer_ids=d["dflash_config"]["target_layer_ids"]), FAILS, LOADS,
     "eagle3_utils.py:103-140); the draft was trained on [0, 2] (every tap shifted by -1)", None),
    ("taps-top-level-only", "dflash", _move_to_top("target_layer_ids"), LOADS, LOADS, None, None),
    ("is_causal-true", "dflash", _set(is_causal=True), LOADS, LOADS, None, None),
    ("causal-only-in-dflash_config", "dflash", _set_nested(causal=True), LOADS, FAILS,
     None, "dflash_config.causal is not read"),
    ("jetspec-without-layer_types", "jetspec", _pop("layer_types"), LOADS, FAILS,
     None, "no layer_types, all bidirectional"),
    ("jetspec-is_causal-false-causal-nested", "jetspec", _set(is_causal=False), FAILS, FAILS,
     "qwen3_dflash.py:86-97", "models/dflash.py:157-190"),
    ("layer_types-mixed", "dflash", _set(**_MIXED, sliding_window=8), LOADS, LOADS, None, None),
    ("layer_types-mixed-without-window", "dflash", _set(**_MIXED), FAILS, FAILS,
     "qwen3_dflash.py:176-185 raises ValueError", "dflash_utils.py:400-413 raises ValueError"),
    ("output_multiplier", "dflash", _set_nested(output_multiplier=2.0), CAVEAT, CAVEAT,
     "qwen3_dflash ignores output_multiplier=2.0", "models/dflash.py ignores output_multiplier=2.0"),
    ("input_embedding_scale", "dflash", _set_nested(input_embedding_scale=0.5), CAVEAT, CAVEAT,
     "ignores input_embedding_scale=0.5", "ignores input_embedding_scale=0.5"),
    ("dflash2-output_multiplier", "dflash2", _set_nested(output_multiplier=2.0), LOADS, LOADS, None, None),
    ("dflash2-labelled-dflash", "dflash2", _set(architectures=["DFlashDraftModel"]), FAILS, FAILS,
     "candidate_selector", "load_weights skips candidate_selector.*"),
    ("dflash2-without-selector_rank", "dflash2", _pop("dflash_config", "selector_rank"), FAILS, FAILS,
     "qwen3_dflash2.py:254-255, 534-535", "models/dflash.py:1270-1273"),
    ("domino-without-projector_type", "domino",
     _all(_set(architectures=["DFlashDraftModel"]), _pop("dflash_config", "projector_type")), FAILS, FAILS,
     "no Domino correction head", "models/dflash.py:923-929"),
    ("markov_head_type-only-nested-gated", "dspark-gated", _pop("markov_head_type"), FAILS, FAILS,
     "only the vanilla Markov head", "models/dspark.py:392 builds the vanilla Markov head"),
    ("markov_head_type-only-nested-vanilla", "dspark-vanilla", _pop("markov_head_type"), LOADS, CAVEAT, None,
     "the confidence head is not used"),
    ("markov_rank-only-nested", "dspark-vanilla", _pop("markov_rank"), FAILS, FAILS,
     "qwen3_dspark.py:210-213", "models/dspark.py:386-390"),
    ("no-markov_head_type", "dspark-vanilla", _all(_pop("markov_head_type"), _pop("dflash_config", "markov_head_type")),
     LOADS, FAILS, None, "dspark_config.py:263-267"),
    ("dspark-specforge-label", "dspark-vanilla", _set(architectures=["DSparkDraftModel"]), FAILS, CAVEAT,
     "registers 'DSparkDraftModel' for DeepSeek-V4's DSpark drafter", "the confidence head is not used"),
    ("dspark-drop-block_size", "dspark-vanilla", _all(_pop("block_size"), _pop("dflash_config", "block_size")),
     CAVEAT, FAILS, "DSpark's width defaults to the top-level block_size", "(here: 7)"),
    ("dspark-without-confidence-head", "dspark-vanilla", None, LOADS, CAVEAT, None,
     "another mode builds one whatever enable_confidence_head says"),
    # neither runtime reads it (SGLang takes the depth from the taps, models/dflash.py:750-755); this package does
    ("no-num_target_layers", "dflash", _pop("num_target_layers"), CAVEAT, CAVEAT,
     "this package does not read it as a draft", "this package does not read it as a draft"),
]


def _without_confidence_head(directory):
    tensors = {k: v for k, v in load_file(str(directory / "model.safetensors")).items()
               if not k.startswith("confidence_head.")}
    save_file(tensors, str(directory / "model.safetensors"))
    edit_config(directory, _set(enable_confidence_head=False, confidence_head_with_markov=False))


@pytest.mark.parametrize("case, export, change, vllm, sglang, vllm_reason, sglang_reason", BREAKAGES,
                         ids=[c[0] for c in BREAKAGES])
def test_a_config_with_one_rule_broken_gets_each_runtimes_verdict(exports, tmp_path, case, export, change, vllm,
                                                                 sglang, vllm_reason, sglang_reason):
    directory = tmp_path / "draft"
    shutil.copytree(exports[export, "sglang" if export == "domino" else "default"][0], directory)
    if change is None:
        _without_confidence_head(directory)
    else:
        edit_config(directory, change)
    reports = verdicts(str(directory))
    for runtime, verdict, reason in (("vLLM", vllm, vllm_reason), ("SGLang", sglang, sglang_reason)):
        report = reports[runtime]
        assert report.verdict == verdict, (runtime, reasons_of(report))
        assert reason is None or reason in reasons_of(report), (runtime, reasons_of(report))
        assert (report.command is None) == (verdict == FAILS)
        if verdict == FAILS:  # the runtime's own reason, not only this package's reading of the file
            assert any(f.level == FAILS and not f.reason.startswith("this package") for f in report.findings)


def test_a_block_size_the_file_does_not_record_gets_no_guessed_number(dflash_dir):
    """The serve commands carry the block the runtime reads from the file: never a default for a draft whose file
    does not say (or contradicts itself about) its block."""
    edit_config(dflash_dir, _all(_pop("dflash_config", "block_size"), _set(block_size=8)))
    reports = verdicts(str(dflash_dir))
    assert '"num_speculative_tokens": 7' in reports["vLLM"].command
    assert reports["SGLang"].command.endswith("--speculative-num-draft-tokens 8")
    edit_config(dflash_dir, _set_nested(block_size=16))
    reports = verdicts(str(dflash_dir))
    assert '"num_speculative_tokens": "BLOCK_SIZE-1"' in reports["vLLM"].command and ": 15" not in reports["vLLM"].command
    assert reports["SGLang"].verdict == FAILS and reports["SGLang"].command is None


def test_mixed_layer_types_load_in_vllm_0_34_and_need_the_v2_runner_before(dflash_dir):
    edit_config(dflash_dir, _set(**_MIXED, sliding_window=8))
    now = verdicts(str(dflash_dir))
    assert now["vLLM"].verdict == LOADS and "VLLM_USE_V2_MODEL_RUNNER" not in now["vLLM"].command
    assert now["SGLang"].verdict == LOADS, reasons_of(now["SGLang"])  # a sliding layer runs causally, as trained
    v1 = verdicts(str(dflash_dir), versions={"vllm": "036a00d"})
    assert v1["vLLM"].verdict == FAILS and "NotImplementedError" in reasons_of(v1["vLLM"])
    v2 = verdicts(str(dflash_dir), versions={"vllm": "036a00d"}, vllm_v2_runner=True)
    assert v2["vLLM"].verdict == CAVEAT and v2["vLLM"].command.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve")


def test_a_specforge_dspark_is_written_where_both_runtimes_read_it(exports, tmp_path):
    """SpecForge's layout (the DSpark fields only in dflash_config) gets SGLang's vanilla head for a gated draft;
    our export writes them at the top level too, where SGLang's build_markov_head and vLLM read them."""
    directory = tmp_path / "specforge"
    shutil.copytree(exports["dspark-gated", "default"][0], directory)
    edit_config(directory, _all(*(_pop(name) for name in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                          "confidence_head_with_markov"))))
    assert verdicts(str(directory))["SGLang"].verdict == FAILS
    convert_hf_to_megatron(str(directory), str(tmp_path / "megatron"))
    convert_megatron_to_hf(str(tmp_path / "megatron"), str(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    for name, value in (("markov_rank", 8), ("markov_head_type", "gated"), ("enable_confidence_head", True)):
        assert written[name] == written["dflash_config"][name] == value
    assert verdicts(str(tmp_path / "hf"))["SGLang"].verdict == CAVEAT


def _target_dir(tmp_path, vocab=96, hidden=64, layers=4, tokens=None):
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab,
                                                    "hidden_size": hidden, "num_hidden_layers": layers}))
    if tokens is not None:
        (target / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(tokens)}},
                                                           "added_tokens": []}))
    return str(target)


@pytest.mark.parametrize("target, reason", [
    (dict(vocab=64), "mask_token_id 95 is not a row of the target's embedding (vocab_size 64)"),
    (dict(tokens=90), "mask_token_id 95 is no token of the target's tokenizer.json"),
    (dict(hidden=128), "target hidden_size: the draft has 64"),
    (dict(layers=6), "target num_target_layers / num_hidden_layers: the draft has 4"),
], ids=["mask-outside-vocab", "mask-not-a-token", "hidden-size", "depth"])
def test_a_target_the_draft_was_not_made_for_fails_in_both(dflash_dir, tmp_path, target, reason):
    reports = verdicts(str(dflash_dir), target=_target_dir(tmp_path, **target))
    for report in reports.values():
        assert report.verdict == FAILS and reason in reasons_of(report), reasons_of(report)
    fine = verdicts(str(dflash_dir), target=_target_dir(tmp_path, tokens=96))
    assert all(r.verdict == LOADS for r in fine.values()) and "--model-path" in fine["SGLang"].command


def _reduce_vocab(directory, d2t, head_rows, mask_in=True):
    """vLLM's reduced draft vocabulary: draft_vocab_size, d2t offsets (target = draft id + d2t) and a head."""
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["d2t"] = torch.tensor(d2t, dtype=torch.int64)
    if head_rows is not None:
        tensors["lm_head.weight"] = torch.zeros(head_rows, 64)
    save_file(tensors, str(directory / "model.safetensors"))
    edit_config(directory, lambda d: d.update(draft_vocab_size=len(d2t)))


def _offsets(targets):
    return [t - i for i, t in enumerate(targets)]


@pytest.mark.parametrize("targets, head_rows, verdict, reason", [
    (list(range(0, 96, 2)) + [95], 49, LOADS, None),
    (list(range(0, 96, 2)), 48, CAVEAT, "the mask token 95 is not in the draft vocabulary"),
    (list(range(0, 96, 2)) + [95], 40, FAILS, "needs the draft's own lm_head.weight with 49 rows"),
    (list(range(0, 96, 2)) + [95], None, FAILS, "needs the draft's own lm_head.weight with 49 rows"),
    (list(range(2, 98, 2)) + [95], 49, FAILS, "outside [0, 96)"),
    (list(range(0, 96, 2)) + [0], 49, FAILS, "two draft ids to the same target id"),
], ids=["good", "mask-unmapped", "head-rows", "no-head", "out-of-range", "duplicate"])
def test_a_reduced_draft_vocabulary_in_vllms_layout(dflash_dir, targets, head_rows, verdict, reason):
    _reduce_vocab(dflash_dir, _offsets(targets), head_rows)
    reports = verdicts(str(dflash_dir))
    assert reports["vLLM"].verdict == verdict, reasons_of(reports["vLLM"])
    if reason is not None:
        assert reason in reasons_of(reports["vLLM"])
    assert reports["SGLang"].verdict == CAVEAT and "ignores draft_vocab_size" in reasons_of(reports["SGLang"])


def test_a_d2t_of_the_wrong_length_fails(dflash_dir):
    _reduce_vocab(dflash_dir, _offsets(range(49)), 49)
    edit_config(dflash_dir, lambda d: d.update(draft_vocab_size=50))
    assert "d2t has 49 entries; draft_vocab_size is 50" in reasons_of(verdicts(str(dflash_dir))["vLLM"])


def test_the_report_ends_with_the_serve_commands(exports):
    directory = exports["dflash", "default"][0]
    lines = report_lines(directory, check_serving(directory))
    assert lines[1] == "vLLM 0.34.0: loads" and "SGLang 0.5.23: loads" in lines  # the release its rules encode
    assert lines[-5] == "serve commands:" and lines[-4] == "  # vLLM 0.34.0"
    assert lines[-3].strip().startswith("vllm serve <target> --speculative-config")
    assert '"num_speculative_tokens": 3' in lines[-3] and '"method": "dflash"' in lines[-3]
    assert lines[-1].strip().startswith("python -m sglang.launch_server --model-path <target> --speculative-algorithm "
                                        "DFLASH") and "--speculative-num-draft-tokens 4" in lines[-1]
    dspark = check_serving(exports["dspark-vanilla", "default"][0])[0].command
    assert '"method": "dspark"' in dspark and '"num_speculative_tokens": 4' in dspark  # every slot proposes


def test_kimi_k3_drafts_are_served_by_neither_runtime(tmp_path):
    from kimi_k3_configs import CASES, our_config
    from megatron_dflash.draft.kimi_k3.body import KimiK3Body

    torch.manual_seed(0)
    save_hf_checkpoint(KimiK3Body(our_config(next(iter(CASES)))), str(tmp_path / "k3"))
    reports = check_serving(str(tmp_path / "k3"))
    for report in reports:
        assert report.verdict == FAILS and "has no 'KimiK3DFlashDraftModel' in its registry" in reasons_of(report)
    assert exit_status(reports) == 1
    # the Kimi K3 DSpark drafter: vLLM 0.34.0 registers a K3 DSpark model under another name (K3DSparkModel)
    from dspark_models import k3_config
    from megatron_dflash.variants.dspark import KimiK3DSparkBody

    save_hf_checkpoint(KimiK3DSparkBody(k3_config()), str(tmp_path / "k3-dspark"))
    for report in check_serving(str(tmp_path / "k3-dspark")):
        assert report.verdict == FAILS and "has no 'KimiK3DSparkModel' in its registry" in reasons_of(report)


# ------------------------------------------------------------------------------------------ d2t / t2d our loader refuses


def _mask_of(targets, size=96):
    mask = torch.zeros(size, dtype=torch.bool)
    mask[torch.tensor(targets)] = True
    return mask


_GOOD_TARGETS = list(range(0, 96, 2)) + [95]


@pytest.mark.parametrize("targets, t2d, said", [
    (list(range(0, 94, 2)) + [95, 94], None, "d2t[48] = 46: draft id 48's target id (i + d2t[i]) is 94, below "
                                             "entry 47's 95"),
    (_GOOD_TARGETS, _mask_of(_GOOD_TARGETS + [1]), "t2d marks target id 1, which d2t does not map to"),
    (_GOOD_TARGETS, _mask_of(_GOOD_TARGETS[:-1], 95), "t2d has 95 entries; vocab_size is 96"),
    (_GOOD_TARGETS, _mask_of(_GOOD_TARGETS).float(), "t2d has dtype float32 and shape [96]"),
], ids=["unordered-d2t", "t2d-disagrees", "t2d-short", "t2d-float"])
def test_a_d2t_or_t2d_our_loader_refuses_does_not_load(dflash_dir, targets, t2d, said):
    _reduce_vocab(dflash_dir, _offsets(targets), len(targets))
    if t2d is not None:
        tensors = load_file(str(dflash_dir / "model.safetensors"))
        save_file({**tensors, "t2d": t2d}, str(dflash_dir / "model.safetensors"))
    reports = verdicts(str(dflash_dir))
    assert reports["vLLM"].verdict == FAILS and said in reasons_of(reports["vLLM"]), reasons_of(reports["vLLM"])
    assert exit_status(list(reports.values())) == 1
    with pytest.raises(ValueError) as refused:  # the reason is the one this package's loader gives
        load_hf_checkpoint(str(dflash_dir))
    assert said in str(refused.value)
