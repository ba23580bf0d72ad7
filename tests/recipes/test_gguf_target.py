"""A GGUF file turned into a HF target directory: the same weights and logits as the model it was written
from, transformers' own dequantization of a quantized file, converted once and rebuilt when the file changes."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package (pip install gguf)")

from gguf_files import tiny_llama_gguf  # noqa: E402
from megatron_dflash.common.errors import RunError  # noqa: E402
from megatron_dflash.recipes import gguf_target  # noqa: E402
from megatron_dflash.recipes.installed import MissingPackageError, PackagedFile  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the random model, the GGUF's path, the converted directory, the conversion's log)."""
    root = tmp_path_factory.mktemp("gguf")
    path = str(root / "tiny.gguf")
    model = tiny_llama_gguf(path)
    lines = []
    directory = gguf_target.gguf_target_dir(path, cache_dir=str(root / "cache"), log=lines.append, interval=0.0)
    return model, path, directory, lines


def test_converted_directory_holds_the_model_the_gguf_was_written_from(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, directory, _ = converted
    ours = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert (ours.config.num_attention_heads, ours.config.num_key_value_heads) == (6, 3)
    expected = model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    tok = AutoTokenizer.from_pretrained(directory)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a small test assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert tok.decode(ids[0]) == text  # the byte-level BPE round-trips
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, model(ids).logits)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    with open(os.path.join(directory, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2


def test_quantized_tensors_are_transformers_own_dequantization(tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(tmp_path / "q.gguf")
    tiny_llama_gguf(path, quant="Q4_1", seed=1)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="q.gguf")
    model = gguf_target._plain_model(config)
    written = gguf_target.read_gguf_weights(path, model, log=lambda _: None)
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    assert sorted(written) == sorted(reference)
    params = dict(model.named_parameters())
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor.float()), name


def test_converted_once_and_rebuilt_when_the_gguf_changes(converted, tmp_path):
    _, path, directory, lines = converted
    assert any("converting" in line for line in lines)
    progress = [line for line in lines if "tensors dequantized" in line]
    assert len(progress) == 20 and progress[-1].startswith("[gguf] 20/20 tensors")  # interval 0: one per tensor
    again = []
    assert gguf_target.gguf_target_dir(path, cache_dir=os.path.dirname(directory), log=again.append) == directory
    assert again == []  # a matching directory is returned as it is
    cache = str(tmp_path / "cache")
    path2 = str(tmp_path / "tiny.gguf")
    tiny_llama_gguf(path2, seed=0)
    first = gguf_target.gguf_target_dir(path2, cache_dir=cache, log=lambda _: None)
    before = open(os.path.join(first, "model.safetensors"), "rb").read()
    tiny_llama_gguf(path2, seed=5)  # the same name, other weights
    rebuilt = []
    assert gguf_target.gguf_target_dir(path2, cache_dir=cache, log=rebuilt.append) == first
    assert any("rebuilt" in line for line in rebuilt)
    assert open(os.path.join(first, "model.safetensors"), "rb").read() != before
    with open(os.path.join(first, "source.json")) as f:
        assert json.load(f) == gguf_target.source_record(path2)
    assert sorted(os.listdir(cache)) == ["tiny"]  # nothing staged left behind


def test_without_the_gguf_package_one_line_names_it(converted, monkeypatch, tmp_path):
    _, path, _, _ = converted
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingPackageError) as err:
        gguf_target.gguf_target_dir(path, cache_dir=str(tmp_path))
    assert str(err.value).endswith(": pip install gguf") and "\n" not in str(err.value)
    assert not os.listdir(tmp_path)


def test_a_packaged_file_that_is_not_installed_names_its_pip_line():
    missing = PackagedFile("no_such_package_xyz", "data/x.json", "pip install --no-deps no-such==1.0", "the data")
    with pytest.raises(RunError, match=r"^the data is not installed \(package no_such_package_xyz is not installed\): "
                                      r"pip install --no-deps no-such==1.0$"):
        missing.path()
    absent_file = PackagedFile("json", "no_such_file.txt", "pip install x", "a file")
    with pytest.raises(RunError, match="package json has no no_such_file.txt"):
        absent_file.path()


def test_a_step_that_is_one_call_prints_a_line_at_the_interval():
    import time

    lines = []
    with gguf_target.heartbeat(lines.append, "writing the weights", interval=0.05):
        time.sleep(0.3)
    count = len(lines)
    time.sleep(0.15)
    assert count >= 2 and len(lines) == count  # lines while the step ran, none after
    assert lines[0].startswith("[gguf] still writing the weights (")

