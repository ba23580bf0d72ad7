"""Hostile draft configs through every tool that builds a draft from one: `convert_checkpoint.py to-megatron`
(a HF directory's config.json) and `to-hf --validate` (a megatron checkpoint's dflash_config.json),
`evaluate_acceptance.py --draft` (either) and `check_serving.py`. Each case is a field of the wrong JSON type, a size no
draft has, or a size its weights contradict: one line naming the file, the field and its value, exit status 1
(the serving check: "does not load" on every runtime, the same line as the reason), no traceback, nothing
allocated and nothing written (docs/design.md §14 Reliability guarantees)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_dflash.checkpoint import convert
from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron
from megatron_dflash.checkpoint.hf import save_hf_checkpoint
from entry_points import evaluate_module, tool_module
from variant_drafts import tiny_target, variant_draft

pytestmark = pytest.mark.usefixtures("one_thread")

BIG = 10**12
# (variant, {field: value} set at the top level and, where the export has it, in dflash_config, what the line says)
CASES = {
    "layers-1e12": ("dflash", {"num_hidden_layers": BIG}, f"num_hidden_layers is {BIG}; it must be an integer"),
    "hidden-1e9": ("dflash", {"hidden_size": 10**9}, "hidden_size is 1000000000; it must be an integer"),
    "hidden-contradicts": ("dflash", {"hidden_size": 128}, "hidden_size 128 contradicts fc.weight [64, 128]"),
    "kv-heads-contradict": ("dflash", {"num_key_value_heads": 4},
                            "num_key_value_heads 4 contradicts layers.0.self_attn.k_proj.weight [32, 64]"),
    "block-1e12": ("dflash", {"block_size": BIG}, f"block_size is {BIG}; it must be an integer"),
    "vocab-1e12": ("dflash2", {"vocab_size": BIG}, f"vocab_size is {BIG}; it must be an integer"),
    "vocab-contradicts": ("domino", {"vocab_size": 200}, "vocab_size 200 contradicts embed_proj.2.weight [96, 16]"),
    "markov-1e12": ("dspark", {"markov_rank": BIG}, f"markov_rank is {BIG}; it must be an integer"),
    "markov-string": ("dspark", {"markov_rank": "256"}, 'markov_rank is "256"; it must be an integer'),
    "markov-contradicts": ("dspark", {"markov_rank": 16},
                           "markov_rank 16 contradicts markov_head.markov_w1.weight [96, 8]"),
    "architectures-5": ("dflash", {"architectures": 5}, "architectures is 5; it must be a list of strings"),
    "layer-types-5": ("dflash", {"layer_types": 5}, "layer_types is 5; it must be a list of strings"),
}
TOOLS = ("to-megatron", "to-hf", "evaluate", "evaluate-megatron", "serving")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Per variant of the cases: its tiny draft as a HF directory and as a megatron save directory, and the
    tiny target the evaluation decodes with."""
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for variant in sorted({variant for variant, _, _ in CASES.values()}):
        hf = str(root / variant / "hf")
        save_hf_checkpoint(variant_draft(variant)[0], hf)
        convert_hf_to_megatron(hf, str(root / variant / "megatron"))
        out[variant] = (hf, str(root / variant / "megatron"))
    tiny_target().save_pretrained(str(root / "target"))
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    return root, out


def _edit(path: str, fields: dict) -> None:
    config = json.loads(open(path).read())
    for name, value in fields.items():
        config[name] = value
        if isinstance(config.get("dflash_config"), dict) and name in config["dflash_config"]:
            config["dflash_config"][name] = value
    with open(path, "w") as f:
        json.dump(config, f)


def _hostile_copy(exports, tmp_path, tool: str, variant: str, fields: dict) -> tuple[str, str]:
    """(the directory the tool reads, the config file edited in it)."""
    hf, megatron = exports[1][variant]
    if tool in ("to-hf", "evaluate-megatron"):
        directory = shutil.copytree(megatron, tmp_path / "megatron")
        config = os.path.join(directory, "release", "dflash_config.json")
    else:
        directory = shutil.copytree(hf, tmp_path / "hf")
        config = os.path.join(directory, "config.json")
    _edit(config, fields)
    return str(directory), config


def _run(tool: str, directory: str, exports, tmp_path) -> int:
    root = exports[0]
    if tool in ("to-megatron", "to-hf"):
        return convert.main([tool, "--load", directory, "--output", str(tmp_path / "out"), "--validate"])
    if tool.startswith("evaluate"):
        return evaluate_module().main(["--target", str(root / "target"), "--draft", directory, "--prompts",
                                       str(root / "prompts.jsonl"), "--max-new-tokens", "2", "--device", "cpu",
                                       "--dtype", "float32"])
    return tool_module("check_serving").main([directory])


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_config_is_one_line_naming_the_field(case, tool, exports, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    variant, fields, message = CASES[case]
    directory, config = _hostile_copy(exports, tmp_path, tool, variant, fields)
    capsys.readouterr()
    status = _run(tool, directory, exports, tmp_path)
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err, (out + err)[-3000:]
    assert not os.path.exists(tmp_path / "out")  # nothing written
    if tool == "serving":  # a verdict for every runtime, the reason the one line
        lines = out.splitlines()
        assert "vLLM 0.34.0: does not load" in lines and "SGLang 0.5.23: does not load" in lines, out
        assert any(line.startswith(f"  - does not load: {config}: {message}") for line in lines), out
        return
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{config}: {message}" in errors[0], err
