"""HF checkpoints of the draft body: the published drafters' layout.

A HF draft is a directory with `config.json` and `model.safetensors` that the reference modeling
code and the serving runtimes load as is (docs/design.md §11 HF export format). Tensor names are
the body's own state-dict names, which are the published ones: no `model.` prefix, no embedding,
no LM head, no megatron `_extra_state`. Weights are stored whole; under tensor parallelism they
are gathered on save and sliced on load (`draft/sharding.py`), so a file written at one TP size loads
at any other.

Which variant a directory holds, and which architecture name and dtypes a body's variant has,
is the variant registry's to say (`variants.registry`); this module reads and writes the files.
The megatron `dist_checkpointing` view of a body (`sharded_state_dict`) lives in `draft/sharding.py`
and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from torch import nn

from ..common.atomic import atomic_directory, check_destination
from ..common.errors import CheckpointError
from ..common.parallel import agree_or_raise
from ..common.safetensors_files import SAFETENSORS_NAME, safetensors_files, safetensors_index_files
from ..draft.body import default_parallel_config
from ..draft.config import DFlashConfig
from ..draft.draft_vocab import DraftVocabulary
from ..draft.sharding import (
    check_tensor_shapes,
    data_parallel_rank,
    hf_state_dict,
    load_hf_state_dict_into,
    load_sharded_state_dict_into,
    sharded_state_dict,
)
from ..variants.registry import variant_of
from .architectures import read_hf_draft_config

__all__ = [
    "SAFETENSORS_NAME",
    "hf_state_dict",
    "save_hf_checkpoint",
    "load_hf_checkpoint",
    "load_hf_state_dict_into",
    "read_safetensors",
    "safetensors_index_files",
    "safetensors_files",
    "check_tensor_shapes",
    "sharded_state_dict",
    "load_sharded_state_dict_into",
]


CONFIG_NAME = "config.json"


# ---------------------------------------------------------------------------------- HF export


def _is_writer(body: nn.Module) -> bool:
    """One rank writes a HF checkpoint: TP rank 0 of data-parallel replica 0."""
    return body.tp_group.rank() == 0 and data_parallel_rank() == 0


def _write_directory(
    config: DFlashConfig, tensors: dict[str, torch.Tensor], directory: str, architecture: str, overwrite: bool,
    extra_files: Optional[dict[str, str]] = None,
) -> None:
    """Write config + safetensors (+ `extra_files`) into a temporary sibling, then move it into place.

    A reader never sees a half-written checkpoint: it finds the complete old directory (or
    none) or the complete new one. The temporary directory sits next to `directory` so that
    the final rename stays on one file system.
    """
    from safetensors.torch import save_file

    directory = os.path.abspath(directory)
    check_destination(directory, replace=overwrite, replace_flag="overwrite=True")
    with atomic_directory(directory, replace=overwrite) as tmp:
        config.save_pretrained(tmp, architecture=architecture)
        save_file(tensors, os.path.join(tmp, SAFETENSORS_NAME), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)


def save_hf_checkpoint(
    body: nn.Module,
    directory: str,
    *,
    dtype: Optional[torch.dtype] = None,
    architecture: Optional[str] = None,
    overwrite: bool = False,
    extra_files: Optional[dict[str, str]] = None,
) -> None:
    """Write `body` as a published-format HF draft: `config.json` + `model.safetensors`.

    A collective over `body.tp_group` (weights are gathered); only TP rank 0 of data-parallel
    replica 0 writes, atomically (temporary sibling directory, then rename). The ranks of the
    writer's TP group return once the directory is complete, or all raise if writing failed;
    other data-parallel replicas only wait for their own group, so barrier the world before
    another process reads the directory.

    Args:
        body: the draft body (any TP size).
        directory: target directory; must be missing or empty unless `overwrite=True`.
        dtype: cast floating-point weights to this dtype (e.g. `torch.bfloat16` for serving);
            None keeps the parameters' dtype. Recorded as `torch_dtype`/`dtype` in config.json.
        architecture: `architectures[0]` of config.json; default: the architecture of the body's
            registered variant (`variants.registry.variant_of`).
        overwrite: replace a non-empty existing directory.
        extra_files: `{file name: text}` written into the directory with the weights, so that they
            are published in the same rename (e.g. the training run's export marker).

    Raises:
        ValueError: the body's variant does not run in `dtype` (DFlash 2 in float16), or the
            body is not of a registered variant and no `architecture` is given.
        atomic.NoSpaceError: the file system of `directory` is full (on every rank of the TP
            group; `directory` keeps its previous content).
    """
    if architecture is None:
        variant = variant_of(body)
        variant.check_dtype(dtype)
        architecture = variant.architecture
    tensors = hf_state_dict(body)
    if "d2t" in tensors:  # a reduced draft vocabulary: the mask too, as speculators and SpecForge write it (§20)
        tensors["t2d"] = DraftVocabulary.from_d2t(tensors["d2t"], body.config.vocab_size).t2d
    device = next(iter(tensors.values())).device
    error: Optional[BaseException] = None
    if _is_writer(body):
        try:
            out = {}
            for name, tensor in tensors.items():
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[name] = tensor.detach().to("cpu").contiguous()
            saved_dtype = dtype or body.fc.weight.dtype
            dtype_name = str(saved_dtype).removeprefix("torch.")
            extra = dict(body.config.extra_hf_fields)
            # Both spellings: transformers >= 4.56 reads `dtype`, older runtimes `torch_dtype`.
            extra.update({"torch_dtype": dtype_name, "dtype": dtype_name})
            config = dataclasses.replace(body.config, extra_hf_fields=extra)
            _write_directory(config, out, directory, architecture, overwrite, extra_files)
        except BaseException as err:  # every rank of the TP group must learn of it
            error = err
    # The TP group's barrier, telling every rank whether the writer succeeded (one all-reduce): a failed save
    # raises everywhere instead of leaving the others waiting; a full file system is `NoSpaceError` on every rank.
    agree_or_raise(error, group=body.tp_group, device=device, path=directory,
                   elsewhere=f"saving the HF checkpoint to {directory} failed on the writing rank; see its error.")


# ---------------------------------------------------------------------------------- HF import


def read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the HF draft directory `directory` (`safetensors_files`), each file checked for NaN / inf."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        out.update(_load_safetensors_file(path))
    return out


def _load_safetensors_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; `ValueError` naming the file when it cannot be read or holds
    NaN/inf (a damaged or diverged checkpoint: its outputs, and any comparison with it, mean nothing)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError, ...: the file is the cause
        raise ValueError(f"{path} is not a readable safetensors file ({type(err).__name__}: {err}).") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: tensor {name} holds NaN or inf values; the checkpoint is damaged or diverged.")
    return tensors


def load_hf_checkpoint(
    directory: str,
    *,
    parallel_config=None,
    tp_group=None,
    attention_backend: str = "auto",
) -> nn.Module:
    """Build the draft body of a HF draft directory and load its weights.

    The variant is the one the registry reads from `config.json` (`variants.registry`): DFlash,
    DFlash 2, Domino, JetSpec or a registered one, in the layout of any published writer
    (`draft/config.py`), e.g. a NeMo AutoModel `Qwen3DFlash2DraftModel` loads as a `DFlash2Body`.

    Every rank reads the file and keeps its own shard, so the TP size may differ from the
    one the checkpoint was trained with. With `parallel_config=None` the body is built by
    `default_parallel_config()` (fp32); pass a megatron `ModelParallelConfig` to choose
    `params_dtype` etc.

    Raises:
        FileNotFoundError: no config.json / safetensors in `directory`.
        CheckpointError: a config field of the wrong type, out of range or contradicting the weights' shapes.
        ValueError: the weights do not match the config (names listed).
    """
    variant, config = read_hf_draft_config(directory)  # checked against the weights' shapes before the build
    # Initialised although every weight is overwritten: megatron only marks its split weights
    # (`tensor_model_parallel`, which its optimizer and grad-norm code read) while initialising them.
    body = variant.build_body(
        config, parallel_config=parallel_config or default_parallel_config(), tp_group=tp_group,
        attention_backend=attention_backend,
    )
    try:
        tensors = variant.read_hf_tensors(read_safetensors(directory), config)
    except CheckpointError as err:  # a reduced vocabulary's d2t / t2d: name the directory
        raise CheckpointError(f"{directory}: {err}") from None
    load_hf_state_dict_into(body, tensors)
    return body
