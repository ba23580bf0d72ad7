"""How a draft body's tensors lie over its tensor-parallel group, and moving whole weights in and out.

The layer below the checkpoint formats (`checkpoint/hf.py` for HF directories, the megatron `torch_dist`
layout): every function here takes a built body (`DFlashBody` or a variant's) and works on its tensors
under their published names, which are the body's own state-dict names (docs/design.md §11 HF export
format). Nothing here knows which variants exist or reads a file.

* `hf_state_dict` gathers the full weights (collective under TP); `load_hf_state_dict_into` slices full
  weights into each rank's shard, after `check_tensor_shapes` has named every disagreement.
* `sharded_state_dict` describes each rank's shard to megatron's `dist_checkpointing` (keys are the
  published names), `load_sharded_state_dict_into` copies what it loaded back.

Which parameters are split, and along which dimension, is read from the attributes megatron
puts on its parallel weights (`tensor_model_parallel`, `partition_dim`); every other parameter
is replicated over the TP group. A split tensor may also be split **unevenly** (`mark_uneven_split`):
rank `k` holds indices `[k * chunk, min(full, (k + 1) * chunk))` of its split dimension, so the last
ranks hold fewer (the partition of megatron's padded vocabulary, without the padding: DSpark's
`markov_w2`, docs/design.md §18 DSpark). Its full tensor has `full` rows in every format, and the
megatron layout describes it as an uneven grid, so it reshards at load like the even splits.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from ..common.parallel import current_process_groups, is_distributed_group

__all__ = [
    "local_tensors",
    "mark_uneven_split",
    "uneven_split_rows",
    "data_parallel_rank",
    "hf_state_dict",
    "check_tensor_shapes",
    "load_hf_state_dict_into",
    "sharded_state_dict",
    "load_sharded_state_dict_into",
]


def local_tensors(body: nn.Module) -> dict[str, torch.Tensor]:
    """The body's rank-local parameters and buffers under the module names, without megatron's
    `_extra_state` entries (FP8 metadata, never part of a published checkpoint)."""
    out = {}
    for name, value in body.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        out[name] = value
    return out


def mark_uneven_split(param: torch.Tensor, dim: int, full: int, chunk: int) -> None:
    """Mark `param` as this rank's part of a tensor split unevenly along `dim` over the TP group: `full`
    indices in all, rank `k` holding `[k * chunk, min(full, (k + 1) * chunk))` (see the module docstring)."""
    param.tensor_model_parallel = True
    param.partition_dim = int(dim)
    param.partition_stride = 1
    param.uneven_split = (int(full), int(chunk))


def uneven_split_rows(full: int, chunk: int, rank: int) -> tuple[int, int]:
    """`(start, end)` of the indices rank `rank` holds of an uneven split (`mark_uneven_split`)."""
    start = min(full, rank * chunk)
    return start, min(full, start + chunk)


def _partition_dims(body: nn.Module) -> dict[str, Optional[int]]:
    """Module name -> the dimension the tensor is split along over the TP group (None when
    replicated).

    Read from megatron's `tensor_model_parallel` / `partition_dim` attributes. Megatron only
    sets them while initialising a weight, so a layer built with
    `perform_initialization=False` has none: for the weights (and column-parallel biases) of
    megatron's parallel linears the split is then taken from the layer type, which is what
    the attributes would have said. Without that, a TP > 1 export would silently write one
    rank's slice as the whole tensor.
    """
    implied: dict[str, int] = {}
    for module_name, module in body.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(module, ColumnParallelLinear):
            implied[prefix + "weight"] = 0
            implied[prefix + "bias"] = 0
        elif isinstance(module, RowParallelLinear):
            implied[prefix + "weight"] = 1  # its bias is replicated

    dims: dict[str, Optional[int]] = {}
    for name, tensor in local_tensors(body).items():
        if hasattr(tensor, "tensor_model_parallel"):
            dim = int(tensor.partition_dim) if tensor.tensor_model_parallel else None
        else:
            dim = implied.get(name)
        stride = getattr(tensor, "partition_stride", 1)
        if dim is not None and stride != 1:
            raise ValueError(
                f"{name} is split with partition_stride={stride}; only contiguous (stride 1) "
                "tensor-parallel splits can be exported."
            )
        dims[name] = dim
    return dims


def _tp_size_rank(body: nn.Module) -> tuple[int, int]:
    group = body.tp_group
    return group.size(), group.rank()


def _gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the shards of `tensor` held by every rank of `group` along `dim` (an uneven split's
    shards are padded to `chunk` for the all-gather and trimmed again)."""
    local = tensor.detach()
    uneven = getattr(tensor, "uneven_split", None)
    if uneven is not None:
        local = nn.functional.pad(local.movedim(dim, -1), (0, uneven[1] - local.shape[dim])).movedim(-1, dim)
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local, group=group)
    if uneven is not None:
        parts = [p.narrow(dim, 0, b - a) for k, p in enumerate(parts) for a, b in [uneven_split_rows(*uneven, k)]]
    return torch.cat(parts, dim=dim)


def data_parallel_rank() -> int:
    """This rank's data(-and-context)-parallel index in `common.parallel.current_process_groups()` (0 without a job)."""
    return current_process_groups().dp_cp.rank()


def _full_shapes(body: nn.Module) -> dict[str, tuple[tuple[int, ...], Optional[int]]]:
    """Published name -> (full shape, partition dim or None) for every exported tensor."""
    tp, _ = _tp_size_rank(body)
    dims = _partition_dims(body)
    out = {}
    for name, tensor in local_tensors(body).items():
        dim = dims[name]
        shape = list(tensor.shape)
        uneven = getattr(tensor, "uneven_split", None)
        if dim is not None:
            shape[dim] = uneven[0] if uneven is not None else shape[dim] * tp
        out[name] = (tuple(shape), dim)
    return out



# ---------------------------------------------------------------------------------- full weights


def hf_state_dict(body: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of `body` under the published names.

    Under TP > 1 this is a collective: every rank of `body.tp_group` must call it. Split
    weights are all-gathered (column-parallel along dim 0, row-parallel along dim 1, as marked
    by megatron); replicated ones are taken from the local rank.

    Returns:
        `{name: tensor}` of detached tensors on the parameters' device, in the body's own
        order, e.g. `fc.weight [H, taps*H]`, `layers.0.self_attn.q_proj.weight [Hq*D, H]`.
    """
    group = body.tp_group
    distributed = is_distributed_group(group)
    dims = _partition_dims(body)
    out = {}
    for name, tensor in local_tensors(body).items():
        dim = dims[name]
        if dim is not None and distributed:
            full = _gather(tensor, dim, group)
        else:
            full = tensor.detach().clone()
        out[name] = full
    return out



def _describe(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _mismatch_hints(body: nn.Module, state_dict: Mapping[str, torch.Tensor], unexpected: list[str]) -> list[str]:
    """Say which config field disagrees with the weights when that can be told."""
    cfg = body.config
    H = cfg.hidden_size
    hints = []
    fc = state_dict.get("fc.weight")
    if fc is not None and fc.dim() == 2:
        if fc.shape[0] != H:
            hints.append(f"fc.weight has {fc.shape[0]} rows but config hidden_size={H}")
        elif fc.shape[1] != cfg.num_taps * H:
            if fc.shape[1] % H == 0:
                hints.append(
                    f"fc.weight {_describe(fc.shape)} concatenates {fc.shape[1] // H} target layers but "
                    f"config target_layer_ids={cfg.target_layer_ids} has {cfg.num_taps}"
                )
            else:
                hints.append(
                    f"fc.weight {_describe(fc.shape)} is not [hidden_size={H}, taps*hidden_size]"
                )
    layer_ids = {int(k.split(".")[1]) for k in state_dict if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if layer_ids and max(layer_ids) + 1 != cfg.num_hidden_layers:
        hints.append(
            f"the weights have {max(layer_ids) + 1} layers but config num_hidden_layers={cfg.num_hidden_layers}"
        )
    if any(k.startswith("model.") for k in unexpected):
        hints.append("the checkpoint names carry a 'model.' prefix; published drafters have none, strip it")
    if any("embed_tokens" in k or k.startswith("lm_head") for k in unexpected):
        hints.append(
            "the checkpoint holds an embedding or LM head; the draft has none (it uses the "
            "target's), drop those tensors"
        )
    return hints


def check_tensor_shapes(body: nn.Module, given: Mapping[str, tuple], what: str, extra_hints=()) -> None:
    """Raise `ValueError` naming missing, unexpected and mis-shaped tensors of `given`
    (`{name: full shape}`) against `body`, with a hint when the config is the likely cause.

    `extra_hints` (callables of the unexpected names returning a hint or None) let callers
    add what they know, e.g. that the tensors belong to another variant.
    """
    expected = {name: shape for name, (shape, _) in _full_shapes(body).items()}
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    mis_shaped = [
        f"{name}: checkpoint {_describe(given[name])} vs model {_describe(shape)}"
        for name, shape in expected.items()
        if name in given and tuple(given[name]) != tuple(shape)
    ]
    if not (missing or unexpected or mis_shaped):
        return
    parts = []
    if missing:
        parts.append(f"missing tensors {missing}")
    if unexpected:
        parts.append(f"unexpected tensors {unexpected}")
    if mis_shaped:
        parts.append("shape mismatches: " + "; ".join(mis_shaped))
    shapes_only = {name: torch.empty(shape, device="meta") for name, shape in given.items()}
    hints = _mismatch_hints(body, shapes_only, unexpected)
    hints += [h for h in (extra(unexpected) for extra in extra_hints) if h]
    message = f"{what} does not match the draft config: " + "; ".join(parts) + "."
    if hints:
        message += " Likely cause: " + "; ".join(hints) + "."
    raise ValueError(message)


def load_hf_state_dict_into(body: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full (unsharded) weights under the published names into `body`, each rank
    taking its own shard. Values are cast to the parameters' dtype.

    Raises:
        ValueError: listing missing, unexpected and mis-shaped tensors, with a hint when the
            config and the weights disagree (hidden size, number of taps, number of layers).
            Nothing is copied unless every tensor matches.
    """
    tp, rank = _tp_size_rank(body)
    expected = _full_shapes(body)
    given = dict(state_dict)
    check_tensor_shapes(body, {name: tuple(t.shape) for name, t in given.items()}, "the checkpoint")
    local = local_tensors(body)
    # Integer tensors (a reduced vocabulary's `d2t` offsets) are copied exactly, never cast from floats.
    for bad in (name for name, t in given.items() if t.is_floating_point() != local[name].is_floating_point()):
        raise ValueError(f"{bad} has dtype {given[bad].dtype}; the draft holds it as {local[bad].dtype}.")
    with torch.no_grad():
        for name, param in local.items():
            full = given[name]
            dim = expected[name][1]
            uneven = getattr(param, "uneven_split", None)
            if dim is not None and uneven is not None:
                start, end = uneven_split_rows(*uneven, rank)
                full = full.narrow(dim, start, end - start)
            elif dim is not None and tp > 1:
                full = full.chunk(tp, dim=dim)[rank]
            param.copy_(full.to(device=param.device, dtype=param.dtype))



# ---------------------------------------------------------------------------------- megatron


def sharded_state_dict(body: nn.Module, prefix: str = "") -> dict:
    """Megatron `dist_checkpointing` description of `body` keyed by `prefix` + published names.

    Split weights are `ShardedTensor`s with this rank's offset along their partition dim;
    replicated ones are whole tensors whose replica id is non-zero on every TP (and
    data-parallel) rank but the first, so each tensor is written once. Because offsets are
    stated in the full tensor, a checkpoint written at one TP size loads at another.

    Load with `checkpoint.torch_dist_load.load(sharded_state_dict(body), dir)` (megatron's `dist_checkpointing.load`
    with every pickle of the checkpoint read through an allow-list) and then
    `load_sharded_state_dict_into(body, loaded)`.
    """
    tp, tp_rank = _tp_size_rank(body)
    dp_rank = data_parallel_rank()
    dims = _partition_dims(body)
    out = {}
    for name, tensor in local_tensors(body).items():
        key = prefix + name
        dim = dims[name]
        uneven = getattr(tensor, "uneven_split", None)
        if dim is not None and uneven is not None:  # an irregular grid: offsets stated, not a fragment count
            start, _ = uneven_split_rows(*uneven, tp_rank)
            global_shape = list(tensor.shape)
            global_shape[dim] = uneven[0]
            offset = [0] * tensor.dim()
            offset[dim] = start
            sharded = ShardedTensor(key, tensor, tensor.dtype, tuple(tensor.shape), tuple(global_shape),
                                    tuple(offset), None, replica_id=(0, 0, dp_rank))
        elif dim is not None:
            sharded = ShardedTensor.from_rank_offsets(
                key, tensor, (dim, tp_rank, tp), replica_id=(0, 0, dp_rank)
            )
        else:
            sharded = ShardedTensor.from_rank_offsets(key, tensor, replica_id=(0, tp_rank, dp_rank))
        out[key] = sharded
    return out


def load_sharded_state_dict_into(body: nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Copy the local shards returned by `dist_checkpointing.load` into `body`.

    Raises:
        ValueError: on missing, unexpected or mis-shaped entries (names listed).
    """
    local = {prefix + name: t for name, t in local_tensors(body).items()}
    missing = sorted(set(local) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(local))
    mis_shaped = [
        f"{k}: loaded {_describe(state_dict[k].shape)} vs model {_describe(v.shape)}"
        for k, v in local.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or mis_shaped:
        raise ValueError(
            "the loaded sharded state does not match the body: "
            f"missing {missing}, unexpected {unexpected}, shape mismatches {mis_shaped}."
        )
    with torch.no_grad():
        for key, param in local.items():
            value = state_dict[key]
            if value is not param:
                param.copy_(value.to(device=param.device, dtype=param.dtype))
