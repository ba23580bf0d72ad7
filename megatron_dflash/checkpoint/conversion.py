"""Conversion of DFlash draft checkpoints between the megatron `torch_dist` layout and the HF format.

The HF format is the one of the published drafters (docs/design.md §11 HF export format,
`checkpoint/hf.py`): a directory with `config.json` and `model.safetensors`. The megatron layout is
the training checkpoint's (docs/design.md §10 Training checkpoint layout, `checkpoint/torch_dist.py`).
`convert_megatron_to_hf` reads any checkpoint of a save directory (any TP size) and writes a HF
directory; `convert_hf_to_megatron` writes a save directory with one checkpoint (`release/` by
default: weights only, no optimizer state, like megatron's own converters; `iteration=N` writes
`iter_NNNNNNN/`). The result of `to-megatron` does not depend on a TP size: torch_dist
checkpoints carry global shapes and are resharded on load, so `target_tensor_parallel_size` only
checks that the config can be split that way.

Both run as one process on the CPU; when `torch.distributed` is not initialised they set up a
one-rank gloo group (`checkpoint.torch_dist.single_process_group`). Outputs are published atomically
(`common.atomic.atomic_directory`): written into a staged sibling of `output`, moved into place only
once complete and, with `validate=True`, reloaded and compared tensor by tensor with the source.
The command line is `checkpoint/convert.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ..common.atomic import atomic_directory, check_destination
from ..common.errors import CheckpointError
from ..draft.body import default_parallel_config
from ..draft.config import resolve_causal
from ..draft.draft_vocab import read_vocab_tensors
from ..draft.sharding import local_tensors
from .architectures import (
    architecture_hint,
    build_body_for_checkpoint,
    config_from_dict,
    read_hf_draft_config,
    read_json_object,
)
from .hf import hf_state_dict, load_hf_state_dict_into, read_safetensors, save_hf_checkpoint
from .serving import sglang_config
from .torch_dist import (
    DRAFT_CONFIG_FILENAME,
    RELEASE,
    Iteration,
    check_draft_config_shapes,
    common_dtype,
    dtype_name,
    iteration_dir_name,
    load_megatron_draft,
    load_megatron_draft_into,
    looks_like_save_dir,
    megatron_draft_tensors,
    parse_iteration,
    read_draft_config,
    read_megatron_draft_state,
    resolve_iteration_dir,
    save_megatron_draft,
    single_process_group,
    write_tracker,
)

__all__ = ["ConversionResult", "convert_megatron_to_hf", "convert_hf_to_megatron", "serving_notes", "EXPORT_TARGETS"]


# ---------------------------------------------------------------------------------- dtypes

_DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def _parse_dtype(value):
    """`"bf16"` / `torch.bfloat16` / None -> torch dtype or None."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype {value} is not supported; use bf16, fp16 or fp32.")
        return value
    name = _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"dtype {value!r} is not supported; use bf16, fp16 or fp32.")
    return getattr(torch, name)


def _check_dtype_allowed(architecture, dtype) -> None:
    architecture.check_dtype(dtype)


def _require_single_process() -> None:
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ValueError(
            f"the converter runs as one process, but torch.distributed has {dist.get_world_size()} "
            "ranks; run it without torchrun (the result loads at any TP size)."
        )


# ---------------------------------------------------------------------------------- conversion


@dataclasses.dataclass
class ConversionResult:
    """What a conversion wrote."""

    architecture: str
    source: str  # the HF directory or megatron checkpoint directory read
    output: str
    dtype: str
    num_tensors: int
    num_parameters: int
    validated: bool
    iteration: Optional[Iteration] = None  # to-megatron: the checkpoint written
    notes: list[str] = dataclasses.field(default_factory=list)  # to-hf: `serving_notes` of the export


def serving_notes(config_data: Mapping[str, Any]) -> list[str]:
    """What a user serving an exported HF draft must know that its config.json cannot say.

    SpecForge 0.2.0 and SGLang before 0.5.23 (`models/dflash.py`, docs/design.md §19 Serving check) ignore
    `is_causal` and run every full-attention layer bidirectionally, so a drafter with causal in-block attention
    (JetSpec, or `causal: true`) runs wrong there; SGLang 0.5.23 reads the top-level `is_causal` (with
    `layer_types`, which the export writes) but not `dflash_config.causal`.
    """
    if resolve_causal(dict(config_data)) is True:
        return [
            "this draft has causal in-block attention (is_causal / dflash_config.causal: true). The z-lab "
            "dflash reference, vLLM and SGLang 0.5.23 honour the top-level is_causal; SpecForge and SGLang "
            "before 0.5.23 ignore it and would run its full-attention layers bidirectionally, so do not serve "
            "it with them (tools/check_serving.py says which runtime serves an export)."
        ]
    return []


def _compare_exact(expected: Mapping[str, Any], got: Mapping[str, Any], what: str) -> None:
    """Every tensor of `expected` is in `got` with the same dtype, shape and values."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = []
    for name in sorted(set(expected) & set(got)):
        a, b = expected[name], got[name]
        if a.dtype != b.dtype:
            wrong.append(f"{name}: dtype {b.dtype} vs {a.dtype}")
        elif tuple(a.shape) != tuple(b.shape):
            wrong.append(f"{name}: shape {list(b.shape)} vs {list(a.shape)}")
        elif not torch.equal(a.cpu(), b.cpu()):
            diff = (a.float().cpu() - b.float().cpu()).abs().max().item()
            wrong.append(f"{name}: values differ (max |diff| {diff:.3g})")
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        if wrong:
            parts.append("; ".join(wrong))
        raise ValueError(f"validation failed: {what} differs from the source: " + "; ".join(parts) + ".")


def _compare_configs(expected, got, what: str) -> None:
    a = dataclasses.replace(expected, extra_hf_fields={})
    b = dataclasses.replace(got, extra_hf_fields={})
    if type(a) is not type(b) or a != b:
        diffs = [
            f"{f.name}: {getattr(b, f.name, None)!r} vs {getattr(a, f.name)!r}"
            for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name, None)
        ]
        raise ValueError(
            f"validation failed: the config of {what} differs from the source: {diffs or type(b).__name__}."
        )


def _convert_dtype(tensors: Mapping[str, Any], dtype) -> dict:
    return {name: (t.to(dtype) if t.is_floating_point() else t) for name, t in tensors.items()}


def convert_megatron_to_hf(
    load: str,
    output: str,
    *,
    iteration: Optional[Iteration] = None,
    dtype=None,
    validate: bool = False,
    force: bool = False,
    config_path: Optional[str] = None,
    export_for: str = "default",
) -> ConversionResult:
    """Megatron checkpoint (save or checkpoint directory) -> HF draft directory.

    Args:
        load: a save directory (tracker + iter_*/release) or one checkpoint directory.
        output: the HF directory to write (missing or empty unless `force`).
        iteration: which checkpoint of a save directory (default: the tracker's).
        dtype: dtype of the written weights (default: the checkpoint's).
        validate: reload the written directory and compare every tensor and the config.
        force: replace a non-empty `output`.
        config_path: HF config.json to use when the checkpoint has no dflash_config.json.
        export_for: "default" (the published layout every reader takes) or "sglang": the labels SGLang
            reads where they differ (`serving.sglang_config`: Domino as `DFlashDraftModel` with
            `projector_type: "domino"`); this package reads both.
    """


    iteration_dir = resolve_iteration_dir(load, iteration)
    check_destination(output, replace=force, source=load, replace_flag="force=True")
    architecture, config = read_draft_config(iteration_dir, config_path)
    if export_for not in EXPORT_TARGETS:
        raise ValueError(f"export_for={export_for!r}: expected one of {list(EXPORT_TARGETS)}.")
    if export_for == "sglang":
        sglang_config(config.to_hf_dict())  # a draft SGLang cannot serve is refused before any tensor is read
    dtype = _parse_dtype(dtype)
    with single_process_group():
        _require_single_process()
        stored = megatron_draft_tensors(iteration_dir)
        check_draft_config_shapes(config, iteration_dir, config_path, stored)  # before the body is built from it
        out_dtype = dtype or common_dtype(d for _, d in stored.values())
        _check_dtype_allowed(architecture, out_dtype)
        # The body holds the weights as stored (fp32 when they mix dtypes: exact for all of
        # them); the one cast to the output dtype happens on export.
        body_dtype = common_dtype(d for _, d in stored.values())
        if body_dtype not in architecture.dtypes:
            body_dtype = torch.float32
        body = build_body_for_checkpoint(architecture, config, params_dtype=body_dtype, tp_group=None)
        load_megatron_draft_into(body, iteration_dir)
        # The source as stored, read without the body, for the comparison.
        source = _convert_dtype(read_megatron_draft_state(iteration_dir), out_dtype) if validate else None
    with atomic_directory(output, replace=force) as tmp:
        save_hf_checkpoint(body, tmp, dtype=out_dtype, architecture=architecture.architecture, overwrite=True)
        relabelled = _relabel_for(export_for, os.path.join(tmp, "config.json"))
        if validate:
            written = read_vocab_tensors(read_safetensors(tmp), config)  # t2d: derived from d2t, checked against it
            _compare_exact(source, written, f"the written {os.path.join(output, 'model.safetensors')}")
            with open(os.path.join(tmp, "config.json")) as f:
                written_arch, written_config = config_from_dict(json.load(f), "the written config.json")
            if written_arch.architecture != architecture.architecture:
                raise ValueError(
                    f"validation failed: the written config.json says {written_arch.architecture}, expected "
                    f"{architecture.architecture}."
                )
            _compare_configs(config, written_config, "the written config.json")
            rebuilt = build_body_for_checkpoint(written_arch, written_config, params_dtype=out_dtype)
            load_hf_state_dict_into(rebuilt, written)  # the written config agrees with the weights
    local = local_tensors(body)
    return ConversionResult(
        architecture=architecture.architecture,
        source=iteration_dir,
        output=os.path.abspath(output),
        dtype=dtype_name(out_dtype),
        num_tensors=len(local),
        num_parameters=sum(t.numel() for t in local.values()),
        validated=validate,
        notes=serving_notes(read_json_object(os.path.join(output, "config.json"))) + relabelled,
    )


EXPORT_TARGETS = ("default", "sglang")


def _relabel_for(export_for: str, config_file: str) -> list[str]:
    """Rewrite a written `config.json` with the labels `export_for` reads; the notes saying what changed."""
    if export_for == "default":
        return []
    data, change = sglang_config(read_json_object(config_file))
    if change is None:
        return ["--export-for sglang: SGLang reads this draft's default labels; nothing changed"]
    with open(config_file, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    return [f"--export-for sglang: {change}"]


def convert_hf_to_megatron(
    load: str,
    output: str,
    *,
    dtype=None,
    validate: bool = False,
    force: bool = False,
    target_tensor_parallel_size: Optional[int] = None,
    iteration: Iteration = RELEASE,
) -> ConversionResult:
    """HF draft directory -> megatron save directory (tracker + one checkpoint directory).

    The result loads at any TP size the config allows (megatron reshards torch_dist
    checkpoints on load); `target_tensor_parallel_size` only checks that the config allows it.

    Args:
        load: HF directory (config.json + model.safetensors or a sharded safetensors index).
        output: the save directory to write (missing or empty unless `force`).
        dtype: dtype of the stored weights (default: the HF file's).
        validate: reload the written checkpoint and compare every tensor and the config.
        force: replace a non-empty `output`.
        target_tensor_parallel_size: refuse (naming `num_key_value_heads`) a TP size the
            config cannot be split into.
        iteration: the checkpoint to write (`release` by default: weights only).
    """

    if not os.path.isdir(load):
        raise FileNotFoundError(f"{load} does not exist or is not a directory.")
    config_file = os.path.join(load, "config.json")
    if not os.path.isfile(config_file):
        hint = ""
        if looks_like_save_dir(load):
            hint = " It looks like a megatron checkpoint: convert it with to-hf."
        raise FileNotFoundError(f"{config_file} does not exist: not a HF draft directory.{hint}")
    iteration = parse_iteration(iteration)
    check_destination(output, replace=force, source=load, replace_flag="force=True")
    architecture, config = read_hf_draft_config(load)  # types, ranges and the weights' shapes, before the build
    if target_tensor_parallel_size is not None:
        config.validate_tensor_parallel(int(target_tensor_parallel_size))
    dtype = _parse_dtype(dtype)
    try:
        tensors = architecture.read_hf_tensors(read_safetensors(load), config)
    except CheckpointError as err:  # a reduced vocabulary's d2t / t2d: name the directory
        raise CheckpointError(f"{load}: {err}") from None
    out_dtype = dtype or common_dtype(t.dtype for t in tensors.values())
    _check_dtype_allowed(architecture, out_dtype)
    with single_process_group():
        _require_single_process()
        body = build_body_for_checkpoint(architecture, config, params_dtype=out_dtype, tp_group=None)
        try:
            load_hf_state_dict_into(body, tensors)
        except ValueError as err:
            message = f"{load}: {err}"
            hint = architecture_hint(architecture, sorted(set(tensors) - set(local_tensors(body))))
            if hint:
                message += f" Also: {hint}."
            raise ValueError(message) from None
        with atomic_directory(output, replace=force) as tmp:
            iteration_dir = os.path.join(tmp, iteration_dir_name(iteration))
            save_megatron_draft(body, iteration_dir)
            write_tracker(tmp, iteration)
            if validate:
                expected = _convert_dtype(tensors, out_dtype)
                # As stored (dtype included), read without the body ...
                _compare_exact(expected, read_megatron_draft_state(iteration_dir), "the written megatron checkpoint")
                # ... and through the tracker, dflash_config.json and a rebuilt body.
                reloaded = load_megatron_draft(resolve_iteration_dir(tmp), parallel_config=_parallel_config(out_dtype))
                _compare_configs(config, reloaded.config, f"the written {DRAFT_CONFIG_FILENAME}")
                _compare_exact(expected, hf_state_dict(reloaded), "the megatron checkpoint loaded into a draft body")
    return ConversionResult(
        architecture=architecture.architecture,
        source=os.path.abspath(load),
        output=os.path.abspath(output),
        dtype=dtype_name(out_dtype),
        num_tensors=len(tensors),
        num_parameters=sum(t.numel() for t in tensors.values()),
        validated=validate,
        iteration=iteration,
    )


def _parallel_config(dtype):
    return default_parallel_config(perform_initialization=False, params_dtype=dtype)
