"""HF checkpoint export/import of the draft body, checked against the reference modeling code.

The key test: a body saved with `save_hf_checkpoint` and loaded by the reference
`dflash.model.DFlashDraftModel` computes the same hidden states as the body for the same
context and block, called the way the reference decoder calls it (the context of positions
[0, p), the block at positions p .. p+W-1). And the reverse: a directory written by the
reference loads into the body with the same outputs.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.checkpoint.hf import (
    hf_state_dict,
    load_hf_checkpoint,
    load_hf_state_dict_into,
    load_sharded_state_dict_into,
    save_hf_checkpoint,
    sharded_state_dict,
)
from megatron_dflash.draft.config import DFlashConfig

from builders import random_body_inputs, tiny_draft_kwargs

dflash_model = pytest.importorskip("dflash.model", reason="the reference modeling code (`dflash`) is not installed")

TOL = 1e-5
SEQ = 24
# Two rows with several blocks each, anchors far enough for the sliding window (3) to bite.
ANCHORS = torch.tensor([[3, 9, 14, 20], [6, 1, 17, 11]])


def tiny_config(**overrides) -> DFlashConfig:
    return DFlashConfig(**tiny_draft_kwargs(**overrides))


def perturb_norms(module: torch.nn.Module, seed: int) -> None:
    """Move every RMSNorm weight away from 1 so that a norm applied in the wrong place
    (or not at all) changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen, dtype=torch.float64).to(param.dtype))


def random_body(config: DFlashConfig, seed: int = 0, **kwargs) -> DFlashBody:
    torch.manual_seed(seed)
    body = DFlashBody(config, **kwargs)
    perturb_norms(body, seed + 1)
    return body.eval()


def random_inputs(config: DFlashConfig, seed: int = 7):
    return random_body_inputs(config, ANCHORS, SEQ, seed)


@torch.no_grad()
def reference_block(ref, taps_row: torch.Tensor, block: torch.Tensor, anchor: int) -> torch.Tensor:
    """The reference draft on one block, called as `dflash_generate` calls it.

    `taps_row [S, taps*H]` (positions [0, anchor) are used as context), `block [W, H]`
    -> `[W, H]`.
    """
    W = block.shape[0]
    out = ref(
        position_ids=torch.arange(anchor + W)[None],
        noise_embedding=block[None],
        target_hidden=taps_row[None, :anchor],
    )
    return out[0]


def max_diff_against_reference(body: DFlashBody, ref, config: DFlashConfig) -> float:
    taps, blocks, plan = random_inputs(config)
    with torch.no_grad():
        ours = body(taps, blocks, plan)
    worst = 0.0
    for row in range(ANCHORS.shape[0]):
        for blk in range(ANCHORS.shape[1]):
            anchor = int(ANCHORS[row, blk])
            expected = reference_block(ref, taps[row], blocks[row, blk], anchor)
            worst = max(worst, (ours[row, blk] - expected).abs().max().item())
    return worst


def load_reference(directory: str):
    ref = dflash_model.DFlashDraftModel.from_pretrained(directory, dtype=torch.float32)
    return ref.eval()


PARITY_CONFIGS = {
    "full_bidirectional": dict(),
    # Layer 0 slides with a window smaller than most anchors: causal in-block (the published
    # rule for sliding layers); layer 1 attends fully and bidirectionally.
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),
    "causal": dict(causal=True),
    "sliding_forced_bidirectional": dict(
        layer_types=["full_attention", "sliding_attention"], sliding_window=5, causal=False
    ),
    "yarn": dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        max_position_embeddings=64,
    ),
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
}


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_saved_checkpoint_matches_reference(tmp_path, name):
    config = tiny_config(**PARITY_CONFIGS[name])
    body = random_body(config, seed=len(name))
    save_hf_checkpoint(body, str(tmp_path / "draft"))
    ref = load_reference(str(tmp_path / "draft"))
    # The reference resolves in-block direction and windows on its own from config.json.
    for i, layer in enumerate(ref.layers):
        causal, window = config.layer_attention(i)
        assert layer.self_attn.is_causal == causal
        assert layer.self_attn.sliding_window == window
    assert ref.target_layer_ids == config.target_layer_ids
    assert ref.block_size == config.block_size
    diff = max_diff_against_reference(body, ref, config)
    assert diff <= TOL, f"{name}: body vs reference max |diff| = {diff:.3g}"


def reference_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        vocab_size=100,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        num_target_layers=8,
        dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 3, 5], "block_size": 4},
    )
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    config.architectures = ["DFlashDraftModel"]
    return config


@pytest.mark.parametrize("sliding", [False, True])
def test_reference_checkpoint_loads_with_identical_outputs(tmp_path, sliding):
    extra = {}
    if sliding:
        extra = dict(
            layer_types=["sliding_attention", "full_attention"], sliding_window=3, use_sliding_window=True
        )
    torch.manual_seed(3)
    ref = dflash_model.DFlashDraftModel(reference_qwen3_config(**extra)).eval()
    perturb_norms(ref, 4)
    ref.save_pretrained(str(tmp_path / "ref"))
    body = load_hf_checkpoint(str(tmp_path / "ref"), attention_backend="dense").eval()
    config = body.config
    assert config.rope_theta == 5000.0
    assert config.target_layer_ids == [1, 3, 5] and config.block_size == 4 and config.mask_token_id == 3
    if sliding:
        assert config.layer_attention(0) == (True, 3) and config.layer_attention(1) == (False, None)
    ours = hf_state_dict(body)
    theirs = ref.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    diff = max_diff_against_reference(body, ref, config)
    assert diff <= TOL, f"reference -> body max |diff| = {diff:.3g}"


# ------------------------------------------------------------------------------ file format


def published_names(config: DFlashConfig) -> set[str]:
    """The tensor names of docs/design.md §11 HF export format, written out independently of the code."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(config.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names.add(f"layers.{i}.self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"layers.{i}.mlp.{proj}.weight")
        names.add(f"layers.{i}.input_layernorm.weight")
        names.add(f"layers.{i}.post_attention_layernorm.weight")
    return names


def test_safetensors_holds_exactly_the_published_names(tmp_path):
    config = tiny_config()
    save_hf_checkpoint(random_body(config), str(tmp_path / "d"))
    assert sorted(os.listdir(tmp_path / "d")) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["d"]  # no temporary directory left behind
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == published_names(config)
        assert f.metadata() == {"format": "pt"}
        H, D = config.hidden_size, config.head_dim
        assert f.get_slice("fc.weight").get_shape() == [H, config.num_taps * H]
        assert f.get_slice("layers.0.self_attn.q_norm.weight").get_shape() == [D]
        assert f.get_slice("layers.1.self_attn.k_proj.weight").get_shape() == [config.num_key_value_heads * D, H]
        assert f.get_slice("layers.1.self_attn.o_proj.weight").get_shape() == [H, config.num_attention_heads * D]
        assert f.get_slice("layers.0.mlp.down_proj.weight").get_shape() == [H, config.intermediate_size]
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    assert data["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 5], "block_size": 4}
    assert data["num_target_layers"] == 8 and data["rope_theta"] == 5000.0
    assert data["torch_dtype"] == "float32"


def test_save_load_save_is_byte_identical(tmp_path):
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    body = random_body(config)
    save_hf_checkpoint(body, str(tmp_path / "a"))
    again = load_hf_checkpoint(str(tmp_path / "a"))
    save_hf_checkpoint(again, str(tmp_path / "b"))
    first, second = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].dtype == second[key].dtype
        assert torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)), key
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert dataclasses.replace(again.config, extra_hf_fields={}) == body.config


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path):
    body = random_body(tiny_config())
    target = tmp_path / "d"
    target.mkdir()
    save_hf_checkpoint(body, str(target))  # an existing empty directory is fine
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_checkpoint(body, str(target))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_hf_checkpoint(body, str(tmp_path / "file"))
    other = random_body(tiny_config(), seed=5)
    save_hf_checkpoint(other, str(target), overwrite=True)
    loaded = load_file(str(target / "model.safetensors"))
    assert torch.equal(loaded["fc.weight"], other.fc.weight.detach())
    assert sorted(os.listdir(tmp_path)) == ["d", "file"]


def test_bf16_save(tmp_path):
    config = tiny_config()
    body = random_body(config)
    save_hf_checkpoint(body, str(tmp_path / "d"), dtype=torch.bfloat16)
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    full = hf_state_dict(body)
    for key, value in tensors.items():
        assert torch.equal(value, full[key].to(torch.bfloat16)), key
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    assert data["torch_dtype"] == "bfloat16" and data["dtype"] == "bfloat16"
    loaded = load_hf_checkpoint(str(tmp_path / "d"))  # an fp32 body from bf16 weights
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, tensors["fc.weight"].float())
    ref = load_reference(str(tmp_path / "d"))
    assert max_diff_against_reference(loaded, ref, config) <= TOL


# ------------------------------------------------------------------------------ load errors


def test_load_errors_name_the_tensors(tmp_path):
    config = tiny_config()
    body = random_body(config)
    good = hf_state_dict(body)

    missing = dict(good)
    del missing["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\]"):
        load_hf_state_dict_into(body, missing)

    extra = dict(good, **{"lm_head.weight": torch.zeros(100, 64)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head.weight'\].*LM head"):
        load_hf_state_dict_into(body, extra)

    prefixed = {"model." + k: v for k, v in good.items()}
    with pytest.raises(ValueError, match="'model.' prefix"):
        load_hf_state_dict_into(body, prefixed)

    bad_shape = dict(good, **{"layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj.weight: checkpoint \[64, 64\] vs model \[32, 64\]"):
        load_hf_state_dict_into(body, bad_shape)

    before = {k: v.clone() for k, v in hf_state_dict(body).items()}
    with pytest.raises(ValueError):
        load_hf_state_dict_into(body, dict(bad_shape, **{"fc.weight": torch.ones_like(good["fc.weight"])}))
    after = hf_state_dict(body)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing copied on error


def test_config_that_disagrees_with_the_weights(tmp_path):
    body = random_body(tiny_config())
    save_hf_checkpoint(body, str(tmp_path / "d"))
    path = tmp_path / "d" / "config.json"
    data = json.loads(path.read_text())
    data["dflash_config"]["target_layer_ids"] = [2, 4]  # 2 taps, fc was trained for 3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"target_layer_ids \[2, 4\] contradicts fc.weight \[64, 192\]"):
        load_hf_checkpoint(str(tmp_path / "d"))

    data["dflash_config"]["target_layer_ids"] = [1, 3, 5]
    data["num_hidden_layers"] = 1
    data["layer_types"] = ["full_attention"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="num_hidden_layers 1 contradicts .* which holds layers 0..1"):
        load_hf_checkpoint(str(tmp_path / "d"))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(str(tmp_path))
    tiny_config().save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(str(tmp_path))


def test_a_sharded_index_names_only_files_of_its_directory(tmp_path):
    """A model.safetensors.index.json whose weight_map leads out of the directory (`..`, an absolute path) is
    refused naming the entry, before any file is read; the draft and the target readers share the check."""
    import re

    from megatron_dflash.checkpoint.hf import read_safetensors
    from megatron_dflash.common.safetensors_files import target_safetensors_files

    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"fc.weight": torch.ones(2, 2)}, str(outside / "x.safetensors"))
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({"fc.bias": torch.ones(2)}, str(draft / "model-00001.safetensors"))
    for entry in ("../outside/x.safetensors", str(outside / "x.safetensors"), "sub/../../outside/x.safetensors"):
        weight_map = {"fc.bias": "model-00001.safetensors", "fc.weight": entry}
        (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        for read in (read_safetensors, target_safetensors_files):
            with pytest.raises(ValueError, match=re.escape(f"names the shard '{entry}', which is not a file in")) as info:
                read(str(draft))
            assert "\n" not in str(info.value)
    # entries inside the directory are read as before
    (draft / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.bias": "model-00001.safetensors"}}))
    assert sorted(read_safetensors(str(draft))) == ["fc.bias"]
    assert target_safetensors_files(str(draft)) == [str(draft / "model-00001.safetensors")]


# ------------------------------------------------------------------------------ megatron dist_checkpointing


def _cpu_dist_checkpointing(monkeypatch) -> None:
    """megatron's torch_dist saver calls `torch.cuda.synchronize()` and puts one flag on
    `torch.cuda.current_device()` even for CPU tensors; on a CPU-only torch both are made
    harmless for the test (the data path itself is device-agnostic)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture
def single_rank_process_group(tmp_path, monkeypatch):
    """A 1-rank gloo group (megatron's dist_checkpointing needs torch.distributed)."""
    import torch.distributed as dist

    _cpu_dist_checkpointing(monkeypatch)
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dist_checkpointing_round_trip_tp1(tmp_path, single_rank_process_group):
    from megatron.core import dist_checkpointing

    config = tiny_config()
    source = random_body(config, seed=1)
    sharded = sharded_state_dict(source, prefix="draft.")
    assert set(sharded) == {"draft." + n for n in published_names(config)}
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(sharded, str(tmp_path / "ckpt"))

    target = random_body(config, seed=2)
    loaded = dist_checkpointing.load(sharded_state_dict(target, prefix="draft."), str(tmp_path / "ckpt"))
    load_sharded_state_dict_into(target, loaded, prefix="draft.")
    expected, got = hf_state_dict(source), hf_state_dict(target)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    with pytest.raises(ValueError, match="missing"):
        load_sharded_state_dict_into(target, {}, prefix="draft.")


# ------------------------------------------------------------------------------ tensor parallel (gloo ranks)


def _tp_rank_work(rank, world_size, saved_hf_dir, saved_dist_dir, out_dir):
    """On every rank of TP=world_size.

    1. Export and save (HF) the seed-0 body: the gathered weights must equal TP=1's; a
       refused save raises on every rank.
    2. The TP sharding description must cover every tensor exactly once (megatron's own
       integrity check, run by its save path).
    3. Load a TP=1 HF checkpoint and a TP=1 torch_dist checkpoint: each rank gets its slice.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    body = random_body(tiny_config(), seed=0)
    exported = hf_state_dict(body)
    save_hf_checkpoint(body, out_dir)
    try:  # the writer refuses a non-empty directory: every rank must raise, none may hang
        save_hf_checkpoint(body, out_dir)
        refusal = None
    except Exception as err:  # noqa: BLE001 - the type is the result
        refusal = type(err).__name__
    save_preprocess(sharded_state_dict(body), validate_access_integrity=True)

    from_hf = load_hf_checkpoint(saved_hf_dir)
    from_dist = random_body(tiny_config(), seed=9)
    loaded = dist_checkpointing.load(sharded_state_dict(from_dist), saved_dist_dir)
    load_sharded_state_dict_into(from_dist, loaded)
    local = {k: v.detach().clone() for k, v in from_hf.state_dict().items() if isinstance(v, torch.Tensor)}
    local_dist = {k: v.detach().clone() for k, v in from_dist.state_dict().items() if isinstance(v, torch.Tensor)}
    # Megatron marks its split weights only while initialising them; the export must still
    # know they are split.
    uninitialised = DFlashBody(tiny_config(), parallel_config=default_parallel_config(perform_initialization=False))
    shapes = {k: tuple(v.shape) for k, v in hf_state_dict(uninitialised).items()}
    return exported, local, local_dist, hf_state_dict(from_hf), shapes, refusal


def test_tensor_parallel_save_and_load(tmp_path, tp_pool, single_rank_process_group):
    """TP=2 <-> TP=1 through both formats (gloo ranks on the CPU)."""
    from megatron.core import dist_checkpointing

    pool = tp_pool(2)
    config = tiny_config()
    reference = hf_state_dict(random_body(config, seed=0))  # TP-invariant init: same weights at TP=2
    source = random_body(config, seed=4)
    save_hf_checkpoint(source, str(tmp_path / "hf1"))
    (tmp_path / "dist1").mkdir()
    dist_checkpointing.save(sharded_state_dict(source), str(tmp_path / "dist1"))
    expected = hf_state_dict(source)

    results = pool.run(_tp_rank_work, str(tmp_path / "hf1"), str(tmp_path / "dist1"), str(tmp_path / "hf2"))
    at_tp1 = hf_state_dict(load_hf_checkpoint(str(tmp_path / "hf2")))
    for key in reference:
        assert torch.equal(at_tp1[key], reference[key]), key
    assert [r[-1] for r in results] == ["FileExistsError", "RuntimeError"]
    for rank, (exported, local, local_dist, gathered, shapes, _) in enumerate(results):
        assert shapes == {k: tuple(v.shape) for k, v in reference.items()}
        assert exported.keys() == reference.keys()
        for key in reference:
            assert torch.equal(exported[key], reference[key]), key
            assert torch.equal(gathered[key], expected[key]), key
        for name, full in expected.items():
            dim = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}.get(
                name.split(".")[-2]
            )
            want = full if dim is None else full.chunk(2, dim)[rank]
            assert torch.equal(local[name], want), name
            assert torch.equal(local_dist[name], want), name
