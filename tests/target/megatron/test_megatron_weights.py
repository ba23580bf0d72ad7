"""HF -> megatron weights of one rank: the fused QKV layout, TP shards of a tiny Qwen3, the vocabulary padding
and the tied output layer of a last stage without the embedding (compared against the HF tensors themselves).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dflash.target.megatron.config import hf_target_spec, padded_vocab_size
from megatron_dflash.target.megatron.weights import convert_hf_to_megatron_state_dict, fused_qkv_weight
from tiny_targets import VOCAB, tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_models(str(tmp_path_factory.mktemp("targets")))


def test_fused_qkv_layout_is_megatrons_per_group_interleave():
    groups, q_per_group, hd, hidden = 2, 3, 4, 5
    q = torch.randn(groups * q_per_group * hd, hidden)
    k = torch.randn(groups * hd, hidden)
    v = torch.randn(groups * hd, hidden)
    fused = fused_qkv_weight(q, k, v, groups, hd).view(groups, (q_per_group + 2) * hd, hidden)
    # What SelfAttention.get_query_key_value_tensors does with [.., ng, (np/ng + 2) * hn]:
    q2, k2, v2 = torch.split(fused, [q_per_group * hd, hd, hd], dim=1)
    torch.testing.assert_close(q2.reshape(-1, hidden), q)
    torch.testing.assert_close(k2.reshape(-1, hidden), k)
    torch.testing.assert_close(v2.reshape(-1, hidden), v)


def test_converter_shards_and_tied_output_layer(tiny):
    from safetensors.torch import load_file

    _, path = tiny["qwen3"]
    hf = load_file(os.path.join(path, "model.safetensors"))
    spec = hf_target_spec(path)
    padded = padded_vocab_size(VOCAB, 2)
    assert padded == 512
    shards = [convert_hf_to_megatron_state_dict(hf, path, r, 2) for r in range(2)]
    assert "output_layer.weight" not in shards[0]  # tied, same stage as the embedding
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (padded, 32)
    torch.testing.assert_close(emb[:VOCAB], hf["model.embed_tokens.weight"])
    assert emb[VOCAB:].abs().sum() == 0
    fc1 = [s["decoder.layers.1.mlp.linear_fc1.weight"] for s in shards]
    gate = torch.cat([f[:24] for f in fc1])
    up = torch.cat([f[24:] for f in fc1])
    torch.testing.assert_close(gate, hf["model.layers.1.mlp.gate_proj.weight"])
    torch.testing.assert_close(up, hf["model.layers.1.mlp.up_proj.weight"])
    proj = torch.cat([s["decoder.layers.1.self_attention.linear_proj.weight"] for s in shards], dim=1)
    torch.testing.assert_close(proj, hf["model.layers.1.self_attn.o_proj.weight"])
    # A last stage without the embedding gets its own copy of the tied weight; layers are renumbered.
    last = convert_hf_to_megatron_state_dict(hf, path, 1, 2, layer_offset=2, num_layers=2, pre_process=False)
    assert "embedding.word_embeddings.weight" not in last
    torch.testing.assert_close(last["output_layer.weight"], shards[1]["embedding.word_embeddings.weight"])
    torch.testing.assert_close(last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])
    assert not any(k.startswith("decoder.layers.2") for k in last)
    assert spec.qk_layernorm and spec.tie_word_embeddings and spec.head_dim == 16
