"""Checkpoint conversion megatron (torch_dist) <-> HF: `megatron_dflash.checkpoint.conversion`, the layout it reads and
writes (`megatron_dflash.checkpoint.torch_dist`) and its CLI (`megatron_dflash.checkpoint.convert`).

The key checks: HF -> megatron -> HF gives byte-identical files for DFlash and DFlash 2;
megatron checkpoints written by TP=1, 2 and 4 ranks convert to exactly the TP=1 export (the
layout does not depend on the TP size, megatron reshards on load); the converted directory
loads in the reference `dflash.model` classes with the same outputs as our body; any extra
variant tensors travel too (the converter is name-agnostic); and every refusal (non-empty
output, missing / unexpected / mis-shaped tensors, config that disagrees with the weights,
fp16 DFlash 2, impossible TP size) is a clear error that leaves nothing behind.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dflash.checkpoint import convert, torch_dist, torch_dist_save
from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config
from megatron_dflash.variants.registry import get_variant, variant_for_hf_config, variant_of

from builders import tiny_draft_kwargs
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VARIANTS = ("dflash", "dflash2")
ARCH = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
SEQ = 20
ANCHORS = torch.tensor([[2, 7, 12, 16], [5, 1, 14, 9]])


# ================================================================================== helpers


def config_kwargs(**overrides) -> dict:
    # 4 KV heads: TP 1, 2 and 4 all split the draft.
    layout = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=48,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    return tiny_draft_kwargs(**{**layout, **overrides})


def make_config(variant: str, **overrides):
    if variant == "dflash2":
        extra = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)
        return DFlash2Config(**config_kwargs(**extra, **overrides))
    return DFlashConfig(**config_kwargs(**overrides))


def randomize(body: torch.nn.Module, seed: int) -> None:
    """Every tensor away from its structured init (norms off 1, non-identity convolutions, a
    non-zero successor codebook), so a tensor lost or swapped in conversion shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in body.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("base_kernel"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                param[:, 0] += 1.0
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def make_body(variant: str, seed: int = 0, **config_overrides):
    config = make_config(variant, **config_overrides)
    cls = DFlash2Body if variant == "dflash2" else DFlashBody
    body = cls(config, parallel_config=default_parallel_config(perform_initialization=False))
    randomize(body, seed)
    return body.eval()


def run_cli(*argv) -> tuple[int, str]:
    """`main(argv)` in this process -> (exit status, stderr text)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = convert.main([str(a) for a in argv])
    return status, err.getvalue()


def file_bytes(directory, name="model.safetensors") -> bytes:
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


def leftovers(parent) -> list[str]:
    """Temporary directories of an atomic write left in `parent` (must be none)."""
    return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n)


def write_megatron(directory, sharded: dict, body) -> None:
    """A hand-made megatron checkpoint directory (for the error cases)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    with torch_dist.single_process_group():
        dist_checkpointing.save(sharded, str(directory), sharded_strategy=torch_dist_save.in_process_save_strategy())
    with open(os.path.join(directory, torch_dist.DRAFT_CONFIG_FILENAME), "w") as f:
        json.dump(torch_dist.draft_config_dict(body), f)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per variant: a body, its HF export `hf0`, `hf0` -> megatron (`meg`) -> HF (`hf1`)."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        body = make_body(variant, seed=len(variant))
        save_hf_checkpoint(body, str(root / "hf0"), architecture=ARCH[variant])
        status, err = run_cli("to-megatron", "--load", root / "hf0", "--output", root / "meg", "--validate")
        assert status == 0, err
        status, err = run_cli("to-hf", "--load", root / "meg", "--output", root / "hf1", "--validate")
        assert status == 0, err
        out[variant] = dict(body=body, root=root, hf0=str(root / "hf0"), meg=str(root / "meg"), hf1=str(root / "hf1"))
    return out


# ================================================================================== round trips


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_megatron_hf_round_trip_is_exact(converted, variant):
    case = converted[variant]
    # The megatron layout: tracker -> release/, a torch_dist checkpoint plus dflash_config.json.
    assert torch_dist.read_tracker(case["meg"]) == torch_dist.RELEASE
    release = os.path.join(case["meg"], "release")
    assert torch_dist.resolve_iteration_dir(case["meg"]) == release
    assert {"metadata.json", ".metadata", "dflash_config.json", "common.pt"} <= set(os.listdir(release))
    with open(os.path.join(release, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    with open(os.path.join(release, "dflash_config.json")) as f:
        assert json.load(f)["architectures"] == [ARCH[variant]]
    expected = hf_state_dict(case["body"])
    with torch_dist.single_process_group():
        stored = torch_dist.megatron_draft_tensors(release)
    assert stored == {name: (tuple(t.shape), torch.float32) for name, t in expected.items()}
    if variant == "dflash2":
        assert "candidate_selector.successor_codebook" in stored and "layers.1.attention_conv.base_kernel" in stored
    # Back in HF: the same bytes as the original export, weights and config alike.
    assert sorted(os.listdir(case["hf1"])) == ["config.json", "model.safetensors"]
    assert file_bytes(case["hf1"]) == file_bytes(case["hf0"])
    assert file_bytes(case["hf1"], "config.json") == file_bytes(case["hf0"], "config.json")
    assert leftovers(case["root"]) == []
    assert not torch.distributed.is_initialized()  # the CLI's one-rank group is gone


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_checkpoint_matches_the_reference_model(converted, variant):
    dflash_model = pytest.importorskip("dflash.model", reason="the reference modeling code (`dflash`) is not installed")
    case = converted[variant]
    body, config = case["body"], case["body"].config
    cls = dflash_model.DFlash2DraftModel if variant == "dflash2" else dflash_model.DFlashDraftModel
    ref, info = cls.from_pretrained(case["hf1"], dtype=torch.float32, output_loading_info=True)
    ref = ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    gen = torch.Generator().manual_seed(7)
    B, N = ANCHORS.shape
    taps = torch.randn(B, SEQ, config.num_taps * config.hidden_size, generator=gen)
    blocks = torch.randn(B, N, config.block_size, config.hidden_size, generator=gen)
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=config.block_size, seq_length=SEQ)
    worst = 0.0
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        for row in range(B):
            for blk in range(N):
                p = int(ANCHORS[row, blk])
                theirs = ref(
                    position_ids=torch.arange(p + config.block_size)[None],
                    noise_embedding=blocks[row, blk][None],
                    target_hidden=taps[row, :p][None],
                )[0]
                worst = max(worst, (ours[row, blk] - theirs).abs().max().item())
    assert worst <= 1e-5, worst


def test_dtypes(converted, tmp_path):
    case = converted["dflash2"]
    fp32 = load_file(os.path.join(case["hf0"], "model.safetensors"))
    # to-hf --dtype bf16: one cast on export.
    status, err = run_cli("to-hf", "--load", case["meg"], "--output", tmp_path / "bf16", "--dtype", "bf16", "--validate")
    assert status == 0, err
    bf16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert bf16.keys() == fp32.keys()
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    # bf16 HF -> megatron keeps bf16 by default; back to HF it is the same file.
    status, err = run_cli("to-megatron", "--load", tmp_path / "bf16", "--output", tmp_path / "meg16", "--validate")
    assert status == 0, err
    with torch_dist.single_process_group():
        stored = torch_dist.megatron_draft_tensors(torch_dist.resolve_iteration_dir(str(tmp_path / "meg16")))
    assert {dtype for _, dtype in stored.values()} == {torch.bfloat16}
    status, err = run_cli("to-hf", "--load", tmp_path / "meg16", "--output", tmp_path / "bf16b", "--validate")
    assert status == 0, err
    assert file_bytes(tmp_path / "bf16b") == file_bytes(tmp_path / "bf16")
    # DFlash 2 in fp16 is refused both ways (docs/design.md §15 Pitfalls), and nothing is written.
    for argv in (
        ("to-hf", "--load", case["meg"], "--output", tmp_path / "fp16"),
        ("to-megatron", "--load", case["hf0"], "--output", tmp_path / "fp16"),
    ):
        status, err = run_cli(*argv, "--dtype", "fp16")
        assert status == 1 and "float16" in err and "bf16" in err, err
        assert not os.path.exists(tmp_path / "fp16")
    # Plain DFlash may be written in fp16.
    status, err = run_cli("to-hf", "--load", converted["dflash"]["meg"], "--output", tmp_path / "d16", "--dtype", "fp16", "--validate")
    assert status == 0, err
    assert {t.dtype for t in load_file(str(tmp_path / "d16" / "model.safetensors")).values()} == {torch.float16}
    assert leftovers(tmp_path) == []


# ================================================================================== tensor parallel


def _save_at_tp(rank, world_size, tp: int, hf_dirs: dict, save_root: str, tp1_megatron: dict):
    """On each rank of TP=tp (x DP=world_size/tp): load the HF draft (each rank keeps its shard) and write
    it with `save_megatron_draft`, plus sharded optimizer-like state under another prefix that
    the converter must ignore; then read the TP=1 megatron checkpoint back at this TP size."""
    import torch.distributed as dist

    gathered = {}
    for variant, hf_dir in hf_dirs.items():
        body = load_hf_checkpoint(hf_dir)
        assert body.tp_group.size() == tp
        extra = {
            "optimizer": {"exp_avg": body.sharded_state_dict(prefix="optimizer.exp_avg.")},
            "iteration": 100,
        }
        save = os.path.join(save_root, variant)
        torch_dist.save_megatron_draft(body, os.path.join(save, torch_dist.iteration_dir_name(100)), extra_state=extra)
        if dist.get_rank() == 0:
            torch_dist.write_tracker(save, 100)
        dist.barrier()
        reloaded = torch_dist.load_megatron_draft(torch_dist.resolve_iteration_dir(tp1_megatron[variant]))
        assert reloaded.tp_group.size() == tp and type(reloaded) is type(body)
        gathered[variant] = hf_state_dict(reloaded)
    return gathered


# TP=2 runs on the 4-rank pool as TP=2 x DP=2 (one pool to start, and data-parallel replicas
# must write each shard once).
@pytest.mark.parametrize("world_size,tp", [(1, 1), (4, 2), (4, 4)], ids=["tp1", "tp2xdp2", "tp4"])
def test_tp_sharded_megatron_checkpoints_convert_to_the_tp1_export(converted, tmp_path, tp_pool, world_size, tp):
    hf_dirs = {v: converted[v]["hf0"] for v in VARIANTS}
    megs = {v: converted[v]["meg"] for v in VARIANTS}
    if world_size == 1:
        with torch_dist.single_process_group():
            results = [_save_at_tp(0, 1, 1, hf_dirs, str(tmp_path), megs)]
    else:
        results = tp_pool(world_size).run(_save_at_tp, tp, hf_dirs, str(tmp_path), megs, tp=tp, timeout=180)
    for variant in VARIANTS:
        expected = hf_state_dict(converted[variant]["body"])
        for gathered in results:  # TP=1 checkpoint loaded (resharded) at TP=world_size
            assert gathered[variant].keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(gathered[variant][name], tensor), (variant, name)
        save = tmp_path / variant
        assert torch_dist.read_tracker(str(save)) == 100
        with torch_dist.single_process_group():
            stored = torch_dist.megatron_draft_tensors(str(save / "iter_0000100"))
            others = torch_dist.megatron_draft_tensors(str(save / "iter_0000100"), prefix="optimizer.exp_avg.")
        assert stored.keys() == expected.keys() and others.keys() == expected.keys()
        status, err = run_cli("to-hf", "--load", save, "--output", tmp_path / f"{variant}_hf", "--validate")
        assert status == 0, err
        assert file_bytes(tmp_path / f"{variant}_hf") == file_bytes(converted[variant]["hf0"]), (variant, tp)


# ================================================================================== name-agnostic


class ExtraHeadConfig(DFlashConfig):
    """A stand-in for a variant with its own tensors (Domino's `domino_head.*`)."""

    def to_hf_dict(self, architecture=None):
        return super().to_hf_dict("ExtraHeadDraftModel")


class ExtraHeadBody(DFlashBody):
    def __init__(self, config, parallel_config=None, tp_group=None, attention_backend="auto"):
        super().__init__(config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend)
        H = config.hidden_size
        self.domino_head = torch.nn.GRUCell(H, H, dtype=self.fc.weight.dtype)
        self.domino_head.register_parameter("gate", torch.nn.Parameter(torch.ones(3, H, dtype=self.fc.weight.dtype)))


def test_any_variant_tensors_are_converted(tmp_path):
    from megatron_dflash.variants.registry import Variant, register_variant, unregister_variant

    extra_head = Variant(name="extra_head", title="ExtraHead", config_cls=ExtraHeadConfig, body_cls=ExtraHeadBody,
                         architecture="ExtraHeadDraftModel", loss=None)
    register_variant(extra_head)
    try:
        body = ExtraHeadBody(ExtraHeadConfig(**config_kwargs()),
                             parallel_config=default_parallel_config(perform_initialization=False))
        randomize(body, 3)
        assert variant_of(body) is extra_head
        save_hf_checkpoint(body, str(tmp_path / "hf0"))
        assert run_cli("to-megatron", "--load", tmp_path / "hf0", "--output", tmp_path / "meg", "--validate")[0] == 0
        with torch_dist.single_process_group():
            stored = torch_dist.megatron_draft_tensors(str(tmp_path / "meg" / "release"))
        assert {"domino_head.weight_ih", "domino_head.bias_hh", "domino_head.gate"} <= set(stored)
        assert run_cli("to-hf", "--load", tmp_path / "meg", "--output", tmp_path / "hf1", "--validate")[0] == 0
        assert file_bytes(tmp_path / "hf1") == file_bytes(tmp_path / "hf0")
    finally:
        unregister_variant("extra_head")
    # An architecture nobody registered is a clear error.
    status, err = run_cli("to-megatron", "--load", tmp_path / "hf0", "--output", tmp_path / "meg2")
    assert status == 1 and "ExtraHeadDraftModel" in err and "register_variant" in err, err


def _variant_body(variant: str):
    if variant == "domino":
        domino = pytest.importorskip("megatron_dflash.variants.domino")
        config = domino.DominoConfig(**config_kwargs(), emb_dim=16, gru_hidden_dim=24)
        cls = domino.DominoBody
    else:
        jetspec = pytest.importorskip("megatron_dflash.variants.jetspec")
        config = jetspec.JetSpecConfig(**config_kwargs())
        cls = DFlashBody
    body = cls(config, parallel_config=default_parallel_config(perform_initialization=False))
    randomize(body, 5)
    return body


@pytest.mark.parametrize("variant", ["domino", "jetspec"])
def test_other_variants_round_trip(tmp_path, variant):
    """Domino (its own tensors, `DominoDraftModel`) and JetSpec (`DFlashDraftModel` with
    `is_causal: true`) are recognised from config.json and come back byte-identical."""
    body = _variant_body(variant)
    entry = variant_of(body)
    assert entry is get_variant(variant)
    save_hf_checkpoint(body, str(tmp_path / "hf0"))
    config = json.loads((tmp_path / "hf0" / "config.json").read_text())
    assert variant_for_hf_config(config) is entry
    assert run_cli("to-megatron", "--load", tmp_path / "hf0", "--output", tmp_path / "meg", "--validate")[0] == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_cli("to-hf", "--load", tmp_path / "meg", "--output", tmp_path / "hf1", "--validate")[0] == 0
    # SpecForge runs every full-attention layer bidirectionally: exporting a causal drafter says so.
    assert ("SpecForge" in out.getvalue()) == (variant == "jetspec"), out.getvalue()
    for name in ("model.safetensors", "config.json"):
        assert file_bytes(tmp_path / "hf1", name) == file_bytes(tmp_path / "hf0", name), name
    with torch_dist.single_process_group():
        stored = torch_dist.megatron_draft_tensors(str(tmp_path / "meg" / "release"))
    assert stored.keys() == hf_state_dict(body).keys()
    if variant == "domino":
        assert any(n.startswith("prefix_gru.") for n in stored) and any(n.startswith("embed_proj.") for n in stored)
        # A Domino file labelled DFlashDraftModel with projector_type "domino" is still Domino.
        config["architectures"] = ["DFlashDraftModel"]
        assert variant_for_hf_config(config) is entry
    else:
        # A bidirectional DFlash file stays plain DFlash.
        config.pop("is_causal")
        config["dflash_config"].pop("causal")
        assert variant_for_hf_config(config) is get_variant("dflash")


# ================================================================================== errors


def test_refuses_a_non_empty_output_without_force(converted, tmp_path):
    case = converted["dflash"]
    for command, source in (("to-hf", case["meg"]), ("to-megatron", case["hf0"])):
        target = tmp_path / command
        target.mkdir()
        (target / "keep.txt").write_text("x")
        status, err = run_cli(command, "--load", source, "--output", target)
        # a usage error (exit 2), in the CLI's words
        assert status == 2 and "not empty" in err and "pass --force " in err and "force=True" not in err, err
        assert err.count("\n") == 1, err
        assert os.listdir(target) == ["keep.txt"]
        status, err = run_cli(command, "--load", source, "--output", target, "--force", "--validate")
        assert status == 0, err
        assert "keep.txt" not in os.listdir(target)
    (tmp_path / "empty").mkdir()  # an existing empty directory is fine
    assert run_cli("to-hf", "--load", case["meg"], "--output", tmp_path / "empty")[0] == 0
    (tmp_path / "file").write_text("x")
    status, err = run_cli("to-hf", "--load", case["meg"], "--output", tmp_path / "file", "--force")
    assert status == 2 and "not a directory" in err
    status, err = run_cli("to-hf", "--load", case["meg"], "--output", os.path.join(case["meg"], "inside"), "--force")
    assert status == 2 and "overlaps the input" in err
    assert leftovers(tmp_path) == []


def test_hf_tensor_errors(converted, tmp_path):
    case = converted["dflash"]
    good = load_file(os.path.join(case["hf0"], "model.safetensors"))

    def hf_dir(name, tensors, edit_config=None):
        directory = tmp_path / name
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        with open(os.path.join(case["hf0"], "config.json")) as f:
            config = json.load(f)
        if edit_config:
            edit_config(config)
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    cases = {
        "missing": ({k: v for k, v in good.items() if k != "layers.1.mlp.up_proj.weight"}, None,
                    r"missing tensors ['layers.1.mlp.up_proj.weight']"),
        "unexpected": (dict(good, **{"lm_head.weight": torch.zeros(48, 64)}), None,
                       "unexpected tensors ['lm_head.weight']"),
        "shape": (dict(good, **{"layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)}), None,
                  "layers.1.self_attn.k_proj.weight: checkpoint [64, 64] vs model [32, 64]"),
        "config": (good, lambda c: c.update(num_hidden_layers=1, layer_types=["full_attention"]),
                   "config.json: num_hidden_layers 1 contradicts"),  # checked before the body is built
    }
    for name, (tensors, edit, message) in cases.items():
        status, err = run_cli("to-megatron", "--load", hf_dir(name, tensors, edit), "--output", tmp_path / f"out_{name}")
        assert status == 1 and message in err, (name, err)
        assert not os.path.exists(tmp_path / f"out_{name}")
    assert "LM head" in run_cli("to-megatron", "--load", tmp_path / "unexpected", "--output", tmp_path / "o")[1]

    # A DFlash 2 file labelled as plain DFlash (docs/design.md §15 Pitfalls) is caught, not silently truncated.
    d2 = converted["dflash2"]["hf0"]
    mislabelled = tmp_path / "mislabelled"
    mislabelled.mkdir()
    for name in ("model.safetensors", "config.json"):
        (mislabelled / name).write_bytes(file_bytes(d2, name))
    data = json.loads((mislabelled / "config.json").read_text())
    data["architectures"] = ["DFlashDraftModel"]
    (mislabelled / "config.json").write_text(json.dumps(data))
    status, err = run_cli("to-megatron", "--load", mislabelled, "--output", tmp_path / "o")
    assert status == 1 and "unexpected tensors" in err and "belong to another variant" in err, err
    assert "DFlash2DraftModel" in err, err

    # The wrong direction is named.
    status, err = run_cli("to-megatron", "--load", case["meg"], "--output", tmp_path / "o")
    assert status == 1 and "convert it with to-hf" in err, err
    status, err = run_cli("to-hf", "--load", case["hf0"], "--output", tmp_path / "o")
    assert status == 1 and "convert it with to-megatron" in err, err
    assert not os.path.exists(tmp_path / "o")
    assert leftovers(tmp_path) == []


def test_megatron_tensor_errors(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    body = make_body("dflash", seed=4)
    prefix = torch_dist.MODEL_PREFIX

    def sharded():
        return body.sharded_state_dict(prefix=prefix)

    missing = sharded()
    del missing[prefix + "layers.1.mlp.up_proj.weight"]
    unexpected = dict(sharded())
    unexpected[prefix + "lm_head.weight"] = ShardedTensor.from_rank_offsets(prefix + "lm_head.weight", torch.zeros(48, 64))
    shape = sharded()
    key = prefix + "layers.1.self_attn.k_proj.weight"  # layer 0's is checked before the body is built
    shape[key] = ShardedTensor.from_rank_offsets(key, torch.zeros(64, 64))
    cases = {
        "missing": (missing, r"missing tensors ['layers.1.mlp.up_proj.weight']"),
        "unexpected": (unexpected, "unexpected tensors ['lm_head.weight']"),
        "shape": (shape, "layers.1.self_attn.k_proj.weight: checkpoint [64, 64] vs model [32, 64]"),
    }
    for name, (state, message) in cases.items():
        write_megatron(tmp_path / name, state, body)
        status, err = run_cli("to-hf", "--load", tmp_path / name, "--output", tmp_path / f"out_{name}")
        assert status == 1 and message in err, (name, err)
        assert not os.path.exists(tmp_path / f"out_{name}")
    assert "LM head" in run_cli("to-hf", "--load", tmp_path / "unexpected", "--output", tmp_path / "o")[1]

    # dflash_config.json that disagrees with the weights: 2 taps, fc was trained for 3.
    write_megatron(tmp_path / "config", sharded(), body)
    path = tmp_path / "config" / torch_dist.DRAFT_CONFIG_FILENAME
    data = json.loads(path.read_text())
    data["dflash_config"]["target_layer_ids"] = [2, 4]
    path.write_text(json.dumps(data))
    status, err = run_cli("to-hf", "--load", tmp_path / "config", "--output", tmp_path / "out_config")
    assert status == 1 and "target_layer_ids [2, 4] contradicts fc.weight [64, 192]" in err, err

    # No dflash_config.json: say so, and --config supplies one.
    os.remove(path)
    status, err = run_cli("to-hf", "--load", tmp_path / "config", "--output", tmp_path / "out_config")
    assert status == 1 and "no dflash_config.json" in err and "--config" in err, err
    save_hf_checkpoint(body, str(tmp_path / "hf"))
    status, err = run_cli("to-hf", "--load", tmp_path / "config", "--output", tmp_path / "out_config",
                          "--config", tmp_path / "hf" / "config.json", "--validate")
    assert status == 0, err
    assert file_bytes(tmp_path / "out_config") == file_bytes(tmp_path / "hf")

    # A directory that is no dist checkpoint at all.
    (tmp_path / "plain").mkdir()
    status, err = run_cli("to-hf", "--load", tmp_path / "plain", "--output", tmp_path / "o2")
    assert status == 1 and "no megatron checkpoint" in err, err
    assert leftovers(tmp_path) == []


def test_iteration_selection(tmp_path):
    save = tmp_path / "save"
    bodies = {100: make_body("dflash", seed=10), 200: make_body("dflash", seed=20)}
    for iteration, body in bodies.items():
        torch_dist.save_megatron_draft(body, str(save / torch_dist.iteration_dir_name(iteration)))
        save_hf_checkpoint(body, str(tmp_path / f"hf{iteration}"))
    assert not torch.distributed.is_initialized()  # the helper set up and removed its own group
    # No tracker: the choice is the user's.
    status, err = run_cli("to-hf", "--load", save, "--output", tmp_path / "out")
    assert status == 1 and "--iteration" in err and "[100, 200]" in err, err
    torch_dist.write_tracker(str(save), 200)
    assert run_cli("to-hf", "--load", save, "--output", tmp_path / "latest")[0] == 0
    assert file_bytes(tmp_path / "latest") == file_bytes(tmp_path / "hf200")
    assert run_cli("to-hf", "--load", save, "--output", tmp_path / "first", "--iteration", "100")[0] == 0
    assert file_bytes(tmp_path / "first") == file_bytes(tmp_path / "hf100")
    # An iteration directory itself works too.
    assert run_cli("to-hf", "--load", save / "iter_0000100", "--output", tmp_path / "direct")[0] == 0
    assert file_bytes(tmp_path / "direct") == file_bytes(tmp_path / "hf100")
    status, err = run_cli("to-hf", "--load", save, "--output", tmp_path / "none", "--iteration", "300")
    assert status == 1 and "iter_0000300" in err and "[100, 200]" in err, err
    # to-megatron --iteration writes an iter_ directory and points the tracker at it.
    assert run_cli("to-megatron", "--load", tmp_path / "hf100", "--output", tmp_path / "m", "--iteration", "7")[0] == 0
    assert torch_dist.read_tracker(str(tmp_path / "m")) == 7 and os.path.isdir(tmp_path / "m" / "iter_0000007")
    with pytest.raises(ValueError, match="extra_state must not have the key 'model'"):
        torch_dist.save_megatron_draft(bodies[100], str(tmp_path / "x"), extra_state={"model": {}})


def test_target_tensor_parallel_size(converted, tmp_path):
    hf0 = converted["dflash"]["hf0"]
    for tp in (3, 8):
        status, err = run_cli("to-megatron", "--load", hf0, "--output", tmp_path / f"tp{tp}", "--target-tensor-parallel-size", tp)
        assert status == 1 and "num_key_value_heads=4" in err and "[1, 2, 4]" in err, err
        assert not os.path.exists(tmp_path / f"tp{tp}")
    status, err = run_cli("to-megatron", "--load", hf0, "--output", tmp_path / "tp4", "--target-tensor-parallel-size", 4)
    assert status == 0, err


def test_validate_catches_a_bad_write_and_leaves_nothing(converted, tmp_path, monkeypatch):
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def corrupting_save_file(tensors, filename, metadata=None):
        tensors = dict(tensors)
        tensors["norm.weight"] = tensors["norm.weight"] + 1e-3
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", corrupting_save_file)
    status, err = run_cli("to-hf", "--load", converted["dflash"]["meg"], "--output", tmp_path / "out", "--validate")
    assert status == 1 and "validation failed" in err and "norm.weight: values differ" in err, err
    assert os.listdir(tmp_path) == []  # neither the output nor a temporary directory


# ================================================================================== entry points


def test_help():
    for argv, expected in (
        ([], ["to-hf", "to-megatron"]),
        (["to-hf"], ["--load", "--output", "--iteration", "--dtype", "--validate", "--force"]),
        (["to-megatron"], ["--target-tensor-parallel-size", "--dtype", "--validate", "--force"]),
    ):
        done = subprocess.run([sys.executable, TOOL, *argv, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        for word in expected:
            assert word in done.stdout, (argv, word)
    done = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "required" in done.stderr


def test_console_script_entry_point():
    import importlib.metadata
    import pkgutil

    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    scripts = [
        ast.literal_eval(kw.value)["console_scripts"]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
        for kw in node.keywords
        if kw.arg == "entry_points"
    ]
    assert scripts == [["megatron-dflash-convert = megatron_dflash.checkpoint.convert:main"]]
    assert pkgutil.resolve_name("megatron_dflash.checkpoint.convert:main") is convert.main
    installed = importlib.metadata.entry_points(group="console_scripts", name="megatron-dflash-convert")
    for entry in installed:  # present once the package is (re)installed with this setup.py
        assert entry.value == "megatron_dflash.checkpoint.convert:main" and entry.load() is convert.main


def test_megatron_private_save_helpers():
    """`checkpoint/torch_dist_save.py` builds megatron's `torch_dist` format from megatron-core helpers that are
    private (`_replace_state_dict_keys_with_sharded_keys`) or internals of its save strategy, and
    `checkpoint/torch_dist_load.py` reads it with the helpers of its load strategy. This pins what they rely on,
    so a megatron release that changes them fails here, by name, instead of writing checkpoints that
    megatron's own loader cannot read (or reading them wrong)."""
    import inspect

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    helper = getattr(mcore_torch, "_replace_state_dict_keys_with_sharded_keys", None)
    assert helper is not None, "megatron-core removed _replace_state_dict_keys_with_sharded_keys (torch_dist_save.py)"
    assert list(inspect.signature(helper).parameters)[:2] == ["sharded_state_dict", "keep_only_main_replica"]
    assert list(inspect.signature(mcore_torch.mcore_to_pyt_state_dict).parameters)[:2] == ["state_dict", "is_loading"]
    planner = mcore_torch.MCoreSavePlanner(  # the arguments torch_dist_save.py passes
        dedup_replicated_tensors=False, flatten_state_dict=False, can_run_decentralized_global_plan=False
    )
    assert planner.flatten_state_dict is False and planner.can_run_decentralized_global_plan is False

    # What the helper returns for a nested state dict: shards grouped under their sharded key, the
    # replicas that are not the main one dropped.
    main = ShardedTensor.from_rank_offsets("model.w", torch.ones(2, 3), replica_id=0)
    replica = ShardedTensor.from_rank_offsets("model.v", torch.ones(4), replica_id=1)
    grouped, flat_mapping, rename_mapping = helper({"model": {"w": main, "v": replica}}, keep_only_main_replica=True)
    assert list(grouped) == ["model.w"] and grouped["model.w"] == [main]
    with torch_dist.single_process_group():
        pyt = mcore_torch.mcore_to_pyt_state_dict(grouped, False)
    assert list(pyt) == ["model.w"] and tuple(pyt["model.w"].size()) == (2, 3)

    # torch_dist_load.py repeats the steps of megatron's torch_dist load with its own reader and planner
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    for name, parameters in (("_unwrap_pyt_sharded_tensor", ["sh_ten"]),
                             ("_replace_sharded_keys_with_state_dict_keys", ["state_dict", "flat_mapping", "rename_mapping"]),
                             ("_restore_dict_types", ["x", "keys_template"])):
        helper = getattr(mcore_torch, name, None)
        assert helper is not None, f"megatron-core removed {name} (torch_dist_load.py)"
        assert list(inspect.signature(helper).parameters) == parameters, name
    planner_parameters = inspect.signature(mcore_torch.MCoreLoadPlanner.__init__).parameters
    assert {"shapes_validation_sharded_tensors", "allow_shape_mismatch_sharded_tensors"} <= set(planner_parameters)
    # the two places where torch unpickles, which torch_dist_load.py overrides
    assert list(inspect.signature(DefaultLoadPlanner.load_bytes).parameters) == ["self", "read_item", "value"]
    assert "read_metadata" in vars(FileSystemReader)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_evaluation_tool_reads_the_training_layout(converted, variant):
    """`tools/evaluate_acceptance.py --draft` takes the trainer's torch_dist save directory (or one of its
    checkpoint directories) as well as a HF directory, and builds the same draft from either."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    case = converted[variant]
    from_hf = evaluate_acceptance.load_draft(case["hf0"], "cpu", torch.float32, "dense")
    for draft in (case["meg"], os.path.join(case["meg"], "release")):
        from_megatron = evaluate_acceptance.load_draft(draft, "cpu", torch.float32, "dense")
        assert type(from_megatron) is type(from_hf)
        expected, got = hf_state_dict(from_hf), hf_state_dict(from_megatron)
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[name], expected[name]) for name in expected), draft
