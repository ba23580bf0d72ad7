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
    sglang_config,
)
from megatron_dflash.variants.domino import DominoBody
from variant_drafts import VARIANTS, variant_draft

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ the runtimes' readings


def vllm_reading(config: dict) -> dict:
    """vLLM (qwen3_dflash.py, eagle3_utils.get_eagle3_aux_layers_from_config): aux hidden-state indices from
    `eagle_aux_hidden_state_layer_ids` as they are, else a DFlash / DSpark tap list + 1; index k is the
    output of layer k - 1. MASK from dflash_config, then the top level. Causal: is_causal, then
    dflash_config.causal, then sliding layers."""
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
    """SGLang (dflash_utils.parse_dflash_draft_config, models/dflash.py): dflash_config first, then the top level;
    a tap id is the output of that layer; block 16 when absent; only sliding layers run causally."""
    dflash = config.get("dflash_config") or {}
    pick = lambda name: dflash[name] if dflash.get(name) is not None else config.get(name)  # noqa: E731
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {
        "registered": config["architectures"][0] in {"DFlashDraftModel", "Qwen3DSparkModel"},
        "taps": pick("target_layer_ids"),
        "mask": pick("mask_token_id"),
        "block": pick("block_size") or 16,
        "causal": [t == "sliding_attention" for t in types],
    }


def served_as_trained(reading: dict, trained) -> bool:
    directions = [trained.layer_attention(i)[0] for i in range(trained.num_hidden_layers)]
    return (reading["registered"] and reading["taps"] == list(trained.target_layer_ids)
            and reading["mask"] == trained.mask_token_id and reading["block"] in (None, trained.block_size)
            and reading["causal"] == directions)


# ------------------------------------------------------------------------------------------ the converter's exports


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(variant, export_for): (HF directory written by to-hf, the config it was built with)}: each tiny draft
    goes HF -> torch_dist -> HF through the converter, for both label sets SGLang may need."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for variant in (*VARIANTS, "dspark-vanilla"):
        body, _, _ = variant_draft(variant.split("-")[0])
        if variant == "dspark-vanilla":
            body, _, _ = _vanilla_dspark()
        save_hf_checkpoint(body, str(root / variant / "hf"))
        convert_hf_to_megatron(str(root / variant / "hf"), str(root / variant / "megatron"))
        for export_for in ("default", "sglang"):
            directory = str(root / variant / export_for)
            convert_megatron_to_hf(str(root / variant / "megatron"), directory, validate=True, export_for=export_for)
            out[variant, export_for] = (directory, body.config)
    return out


def _vanilla_dspark():
    from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
    from variant_drafts import common_draft_kwargs

    torch.manual_seed(1)
    return DSparkBody(DSparkConfig(**common_draft_kwargs(), markov_rank=8), attention_backend="chunked"), None, None


def verdicts(directory: str, **kwargs) -> dict:
    reports = check_serving(directory, **kwargs)
    return {r.runtime: r for r in reports}


# What the model files add to the readings (stated per variant): vLLM serves no Domino head and only the
# vanilla Markov head; SGLang has no DFlash 2 model.
MODEL_FILE_FAILURES = {
    ("domino", "sglang", "vLLM"): "no Domino correction head",
    ("dspark", "default", "vLLM"): "only the vanilla Markov head",
    ("dspark", "sglang", "vLLM"): "only the vanilla Markov head",
}


@pytest.mark.parametrize("export_for", ["default", "sglang"])
@pytest.mark.parametrize("variant", [*VARIANTS, "dspark-vanilla"])
def test_every_export_gets_the_verdicts_of_the_runtimes_readings(exports, variant, export_for):
    directory, trained = exports[variant, export_for]
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    reports = verdicts(directory)
    for runtime, reading in (("vLLM", vllm_reading(config)), ("SGLang", sglang_reading(config))):
        report = reports[runtime]
        reasons = " | ".join(f.reason for f in report.findings)
        expected_failure = MODEL_FILE_FAILURES.get((variant, export_for, runtime))
        if served_as_trained(reading, trained) and expected_failure is None:
            assert report.verdict == LOADS, (runtime, reasons)
            assert report.command is not None and directory in report.command
        else:
            assert report.verdict == FAILS, (runtime, reasons)
            assert report.command is None
            if expected_failure is not None:
                assert expected_failure in reasons
    assert exit_status(reports.values()) == (0 if all(r.verdict != FAILS for r in reports.values()) else 1)


def test_the_verdicts_the_readings_imply_are_the_ones_users_need(exports):
    """The oracle's consequences, spelled out: plain DFlash is served by both; DFlash 2 and JetSpec by vLLM only;
    Domino by SGLang once relabelled; DSpark with the rnn head by SGLang only, with the vanilla head by both."""
    expected = {
        ("dflash", "default"): (LOADS, LOADS), ("dflash2", "default"): (LOADS, FAILS),
        ("jetspec", "default"): (LOADS, FAILS), ("domino", "default"): (FAILS, FAILS),
        ("domino", "sglang"): (FAILS, LOADS), ("dspark", "default"): (FAILS, LOADS),
        ("dspark-vanilla", "default"): (LOADS, LOADS),
    }
    for key, (vllm, sglang) in expected.items():
        reports = verdicts(exports[key][0])
        assert (reports["vLLM"].verdict, reports["SGLang"].verdict) == (vllm, sglang), key
    jetspec = " ".join(f.reason for f in verdicts(exports["jetspec", "default"][0])["SGLang"].findings)
    assert "bidirectional in-block; the draft was trained causal" in jetspec
    domino = " ".join(f.reason for f in verdicts(exports["domino", "default"][0])["SGLang"].findings)
    assert "DominoDraftModel" in domino and "--export-for sglang" in domino


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


def test_a_tap_list_shifted_by_one_fails_where_it_is_read(dflash_dir):
    # the off-by-one of the issue trackers: the DFlash ids written where vLLM expects hidden-state indices
    data = edit_config(dflash_dir, lambda d: d.update(eagle_aux_hidden_state_layer_ids=d["dflash_config"]["target_layer_ids"]))
    assert vllm_reading(data)["taps"] == [t - 1 for t in data["dflash_config"]["target_layer_ids"]]
    reports = verdicts(str(dflash_dir))
    assert reports["vLLM"].verdict == FAILS and "every tap shifted by -1" in reasons_of(reports["vLLM"])
    assert reports["SGLang"].verdict == LOADS  # SGLang does not read eagle_aux_hidden_state_layer_ids


def test_a_missing_mask_token_id_fails_in_both(dflash_dir):
    def drop(d):
        d["dflash_config"].pop("mask_token_id")
        d.pop("mask_token_id", None)

    edit_config(dflash_dir, drop)
    reports = verdicts(str(dflash_dir))
    for runtime in ("vLLM", "SGLang"):
        assert reports[runtime].verdict == FAILS and "reads no mask_token_id" in reasons_of(reports[runtime])
    assert "'<|MASK|>'" in reasons_of(reports["SGLang"])


def test_a_domino_label_fails_in_vllm(exports):
    reports = verdicts(exports["domino", "sglang"][0])
    assert reports["vLLM"].verdict == FAILS and "no Domino correction head" in reasons_of(reports["vLLM"])


def test_a_causal_drafter_fails_in_sglang_whichever_flag_says_so(dflash_dir):
    for flag in ("is_causal", "dflash_causal"):
        def make_causal(d, flag=flag):
            d.pop("is_causal", None)
            if flag == "is_causal":
                d["is_causal"] = True
            else:
                d["dflash_config"]["causal"] = True

        data = edit_config(dflash_dir, make_causal)
        assert sglang_reading(data)["causal"] == [False, False] and vllm_reading(data)["causal"] == [True, True]
        reports = verdicts(str(dflash_dir))
        assert reports["SGLang"].verdict == FAILS and "trained causal" in reasons_of(reports["SGLang"])
        assert reports["vLLM"].verdict == LOADS, reasons_of(reports["vLLM"])


def test_mixed_layer_types_need_vllms_v2_runner(dflash_dir):
    edit_config(dflash_dir, lambda d: d.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                               use_sliding_window=True))
    v1 = verdicts(str(dflash_dir))
    assert v1["vLLM"].verdict == FAILS and "NotImplementedError" in reasons_of(v1["vLLM"])
    assert v1["SGLang"].verdict == LOADS, reasons_of(v1["SGLang"])  # a sliding layer runs causally, as trained
    v2 = verdicts(str(dflash_dir), vllm_v2_runner=True)
    assert v2["vLLM"].verdict == CAVEAT and v2["vLLM"].command.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve")


def test_settings_a_runtime_ignores_are_caveats(dflash_dir):
    edit_config(dflash_dir, lambda d: d["dflash_config"].update(output_multiplier=2.0))
    reports = verdicts(str(dflash_dir))
    assert reports["vLLM"].verdict == CAVEAT and "ignores output_multiplier=2.0" in reasons_of(reports["vLLM"])
    assert reports["SGLang"].verdict == LOADS  # parse_dflash_draft_config reads it from dflash_config
    assert exit_status(reports.values()) == 0
    edit_config(dflash_dir, lambda d: d["dflash_config"].update(input_embedding_scale=0.5))
    reports = verdicts(str(dflash_dir))
    assert reports["SGLang"].verdict == CAVEAT and "ignores input_embedding_scale=0.5" in reasons_of(reports["SGLang"])


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
    assert lines[-5] == "serve commands:"
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
        assert report.verdict == FAILS and "registers no 'KimiK3DFlashDraftModel'" in reasons_of(report)
    assert exit_status(reports) == 1


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
