"""What a target-state cache's target field covers (`target/weight_digests.py`): the bytes of the tensors its states
depend on, so a fine-tuned target with the same config and shapes is another target; digests computed once per file
and kept, computed again when the file changes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_dflash.target import weight_digests
from megatron_dflash.target.weight_digests import weights_fingerprint

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.3.mlp.weight",
         "model.layers.5.mlp.weight", "model.norm.weight", "lm_head.weight"]


@pytest.fixture
def target(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_DFLASH_CACHE", str(tmp_path / "user-cache"))  # the digests kept here
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"hidden_size": 4, "num_hidden_layers": 6}))
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(4, 4, generator=gen) for n in NAMES}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def fine_tune(directory, name: str) -> None:
    """The same file with one tensor's values changed (same names, dtypes, shapes: the same header), saved over it
    later (a fine-tune takes longer than a file system's time stamp granularity)."""
    import time

    from safetensors.torch import load_file

    time.sleep(0.05)
    path = str(directory / "model.safetensors")
    tensors = load_file(path)
    tensors[name] = tensors[name] + 1e-3
    os.unlink(path)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.mlp.weight",
                                  "model.layers.3.mlp.weight"])
def test_a_fine_tune_of_a_tensor_the_taps_depend_on_is_another_target(target, name):
    before = weights_fingerprint(str(target), last_layer=3)
    fine_tune(target, name)
    assert weights_fingerprint(str(target), last_layer=3) != before


def test_layers_past_the_last_tap_count_only_for_the_final_hidden_state(target):
    taps, final = weights_fingerprint(str(target), last_layer=3), weights_fingerprint(str(target), last_layer=None)
    fine_tune(target, "model.layers.5.mlp.weight")
    assert weights_fingerprint(str(target), last_layer=3) == taps  # layer 5 makes no tap of layers 1..3
    assert weights_fingerprint(str(target), last_layer=None) != final


def test_the_digests_are_computed_once_per_file_and_again_when_it_changes(target, monkeypatch):
    first = weights_fingerprint(str(target), last_layer=3)
    reads = []
    real = weight_digests._read_digests
    monkeypatch.setattr(weight_digests, "_read_digests", lambda *a: reads.append(a[0]) or real(*a))
    assert weights_fingerprint(str(target), last_layer=3) == first and reads == []  # kept: no tensor read
    fine_tune(target, "model.layers.0.mlp.weight")
    assert weights_fingerprint(str(target), last_layer=3) != first and len(reads) == 1
    assert len(os.listdir(weight_digests.digest_store_dir())) == 1  # one small file per safetensors file
