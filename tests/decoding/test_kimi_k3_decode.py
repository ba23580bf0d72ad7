"""Speculative decoding with a Kimi K3 target, whose model code (NeMo AutoModel's) keeps no KV cache.

`spec_generate` recomputes such a target over the committed tokens plus the block every cycle (its
family says so, `target.families.target_keeps_kv_cache`). The oracle is the target's own greedy decoding,
written here independently: one full forward over the whole sequence per token. Checked:

* greedy decoding equals it token for token, for a K3 MLA draft and for a plain DFlash draft, a batch
  of prompts of different lengths whose rows accept different amounts (rejections and accepted draft
  tokens both occur);
* sampling follows the target's distribution (its exact law by enumeration on a vocabulary of 8,
  chi-square, as `test_generate.py` checks it for Qwen3 targets), and its tokens stay in the vocabulary;
* the evaluation tool measures acceptance on a K3 target, its baseline recomputing too.

The tiny K3 target is random; `_shape` makes its continuation depend on the context so that a random
draft is accepted sometimes (as `tiny_decoding.shape_target` does for Qwen3 targets).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
import torch

pytest.importorskip("nemo_automodel.components.models.kimi_k3.model")

from megatron_dflash.draft.body import DFlashBody  # noqa: E402
from megatron_dflash.draft.config import DFlashConfig  # noqa: E402
from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR  # noqa: E402
from megatron_dflash.target.families import target_keeps_kv_cache  # noqa: E402
from megatron_dflash.decoding.generate import spec_generate  # noqa: E402
from megatron_dflash.draft.kimi_k3 import KimiK3Body, KimiK3DraftConfig  # noqa: E402
from megatron_dflash.target.kimi_k3 import build_tiny_kimi_k3_target, load_kimi_k3_target  # noqa: E402
from reference_sampling import chi_square_pvalue, exact_joint, marginal  # noqa: E402
from tiny_decoding import check_statistics  # noqa: E402
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = REPO_ROOT
VOCAB = 320  # the shipped tiny tokenizer's
TAPS = [1, 3]
PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8, 50, 11], [44, 3, 19]]


def _shape(model, seed: int, favourite: int = 7) -> None:
    """Large constant first embedding coordinate that the LM head reads for `favourite` almost only, and strong
    attention / MLP outputs: the target often continues with `favourite`, depending on the context."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.copy_(torch.randn(embedding.shape, generator=gen))
        embedding[:, 0] = 3.0
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=gen))
        head[:, 0] = 0.0
        head[favourite, 0] = 10.5
        for name, param in model.model.layers.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_projs")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def recompute_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding: one forward over the whole sequence per token."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return build_tiny_kimi_k3_target(str(tmp_path_factory.mktemp("k3") / "target"), tokenizer_dir=SHIPPED_TARGET_DIR,
                                     vocab_size=VOCAB)


@pytest.fixture(scope="module")
def k3_target(k3_dir):
    model = load_kimi_k3_target(k3_dir)
    _shape(model, seed=0)
    return model


def k3_draft(text_config: dict, vocab: int, seed: int = 1, block_size: int = 4) -> KimiK3Body:
    config = KimiK3DraftConfig.from_target_config(
        text_config, num_hidden_layers=2, block_size=block_size, mask_token_id=vocab - 1, target_layer_ids=TAPS
    )
    torch.manual_seed(seed)
    return KimiK3Body(config, attention_backend="chunked").eval()


def dflash_draft(vocab: int, seed: int = 1, block_size: int = 4) -> DFlashBody:
    config = DFlashConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vocab, block_size=block_size, mask_token_id=vocab - 1, num_target_layers=6,
        target_layer_ids=TAPS, max_position_embeddings=512, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    return DFlashBody(config, attention_backend="chunked").eval()


def text_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)["text_config"]


def _hook_count(model) -> int:
    return sum(len(layer._forward_hooks) for layer in model.model.layers.values())


@pytest.mark.parametrize("family", ["kimi_k3", "dflash"])
def test_greedy_decoding_on_a_k3_target_equals_its_own_greedy_decoding(k3_dir, k3_target, family):
    assert target_keeps_kv_cache(k3_target.config) is False  # the loaded model's config: the recomputing path
    draft = k3_draft(text_config(k3_dir), VOCAB) if family == "kimi_k3" else dflash_draft(VOCAB)
    hooks = _hook_count(k3_target)
    new = 20
    out = spec_generate(k3_target, draft, PROMPTS, max_new_tokens=new)
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == recompute_greedy(k3_target, prompt, new), f"row {b}"
    check_statistics(out, 4, new)
    seen = Counter(a for row in out.acceptance_lengths for a in row)
    assert seen[1] > 0 and max(seen) > 1  # rejections and accepted draft tokens both occur
    assert len({tuple(row) for row in out.acceptance_lengths}) > 1  # rows accept differently
    assert _hook_count(k3_target) == hooks  # the tap hooks leave the caller's model


@pytest.fixture(scope="module")
def k3_target_vocab8(tmp_path_factory):
    """A K3 target over a vocabulary of 8 (no tokenizer), its head scaled down: a spread distribution."""
    directory = build_tiny_kimi_k3_target(str(tmp_path_factory.mktemp("k3v8") / "target"),
                                          tokenizer_dir=str(tmp_path_factory.mktemp("no_tokenizer")), vocab_size=8,
                                          seed=2)
    model = load_kimi_k3_target(directory)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    return directory, model


def test_sampling_on_a_k3_target_follows_its_distribution(k3_target_vocab8):
    """4 generated tokens, many times: their joint law must be the target's (chi-square, fixed seed), with
    rejections and fully accepted blocks both occurring."""
    pytest.importorskip("scipy")
    directory, target = k3_target_vocab8
    vocab, W, steps, N = 8, 3, 4, 2000
    draft = k3_draft(text_config(directory), vocab, seed=5, block_size=W)
    prompt = [1, 4, 2, 6]
    out = spec_generate(target, draft, [prompt] * N, max_new_tokens=steps, temperature=1.0,
                        generator=torch.Generator().manual_seed(1234))
    check_statistics(out, W, steps)
    assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < vocab
    cycles = Counter(a for row in out.acceptance_lengths for a in row)
    assert cycles[1] > 0 and cycles[W] > 0
    samples = [tuple(out.generated(b)) for b in range(N)]
    joint = exact_joint(target, prompt, steps, 1.0, 1.0, 0)
    for positions in [(0,), (1,), (2,), (3,), (0, 1), (1, 2), (2, 3)]:
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        pvalue = chi_square_pvalue(counts, marginal(joint, positions), N)
        assert pvalue > 1e-4, f"positions {positions}: p-value {pvalue:.2e}"


def test_the_evaluation_tool_measures_acceptance_on_a_k3_target(k3_dir, tmp_path, capsys):
    """`tools/evaluate_acceptance.py` on a K3 target directory and a K3 draft directory: lossless against its
    baseline, which recomputes the target per token (the target has no `generate` with a cache)."""
    from megatron_dflash.checkpoint.hf import save_hf_checkpoint

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    draft_dir = tmp_path / "draft"
    save_hf_checkpoint(k3_draft(text_config(k3_dir), VOCAB), str(draft_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    report_path = tmp_path / "report.json"
    code = evaluate_acceptance.main([
        "--target", k3_dir, "--draft", str(draft_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
        "--batch-size", "2", "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--output", str(report_path),
    ])
    assert code == 0
    assert "decode acceptance length (speculative decoding)" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    settings = report["settings"]
    assert settings["draft_architecture"] == "KimiK3Body" and settings["target_kv_cache"] is False
    assert settings["baseline"] == "recomputed"  # NeMo's K3 model has no `generate`
    summary = report["summary"]
    assert summary["greedy_outputs_identical_fraction"] == 1.0
    assert summary["generated_tokens"] == summary["autoregressive_tokens"] == 8 * len(PROMPTS)
    target = load_kimi_k3_target(k3_dir)
    for entry, prompt in zip(report["prompts"], PROMPTS):
        assert entry["generated_ids"] == recompute_greedy(target, prompt, 8)[len(prompt):]
