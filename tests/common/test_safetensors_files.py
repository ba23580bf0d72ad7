"""Where a HF directory's tensors are, and the refusal of a target whose weights are pickles only."""

import pytest

from megatron_dflash.common.errors import RunError
from megatron_dflash.common.safetensors_files import (
    TargetWeightsError,
    pickled_weights,
    refuse_pickled_weights,
    target_safetensors_files,
)


def test_pickled_weights_are_named_and_never_read(tmp_path):
    """Shards and their index: the index is named; with safetensors beside them the pickles are ignored; the
    files are not opened (their bytes are no pickle at all)."""
    shards = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    for name in (*shards, "pytorch_model.bin.index.json"):
        (tmp_path / name).write_bytes(b"not read")
    assert pickled_weights(str(tmp_path)) == str(tmp_path / "pytorch_model.bin.index.json")
    with pytest.raises(TargetWeightsError) as info:
        target_safetensors_files(str(tmp_path))
    assert isinstance(info.value, RunError) and isinstance(info.value, FileNotFoundError)
    assert str(info.value).startswith(f"{tmp_path / 'pytorch_model.bin.index.json'}: the target's weights are a "
                                      "pickle, which is never loaded")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert pickled_weights(str(tmp_path)) is None and target_safetensors_files(str(tmp_path)) == [
        str(tmp_path / "model.safetensors")]


def test_a_directory_without_weights_passes_the_pickle_check_and_is_named_when_read(tmp_path):
    refuse_pickled_weights(str(tmp_path))  # a config-only directory: nothing pickled to refuse
    refuse_pickled_weights("org/hub-id")   # not a directory: the loader fetches safetensors only
    with pytest.raises(TargetWeightsError, match="holds no model.safetensors or model.safetensors.index.json"):
        target_safetensors_files(str(tmp_path))
