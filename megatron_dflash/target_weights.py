"""HF weights -> megatron ``GPTModel`` weights of one rank: the mapping plan and the shard-by-shard loader.

One idea, one place: `megatron_weight_plan` lists, for one (TP rank, EP rank, PP stage), every megatron
parameter this rank holds as a `MegatronWeight`: its name, the HF tensors it is made of, and how (fuse,
split, pad). Two drivers consume the plan:

* `convert_with_plan` reads a ``name -> tensor`` mapping (a dict, or a lazy view) into a state dict;
* `stream_with_plan` opens the HF safetensors files **one at a time**, reads from each only the tensors this
  rank needs, yields every megatron tensor as soon as its sources are complete, and closes the file before
  opening the next. Host memory is bounded by the tensors of one shard this rank needs (plus any sources
  still waiting for a partner in a later shard), not by the model; experts of other EP ranks are never
  read.

Layouts (megatron-core 0.16, local and Transformer Engine specs): ``linear_qkv`` is the per-query-group
interleaved ``[q_g; k_g; v_g]`` matrix, split by whole groups across TP; ``linear_proj`` and ``linear_fc2``
are split on their input dim; ``linear_fc1`` is ``[gate shard; up shard]`` per rank; the embedding and output
layer are split by vocabulary rows (padded rows are zero). MoE layers (``mlp.router.weight``, replicated, and
``mlp.experts.local_experts.{j}``: the experts ``ep_rank * E / EP + j`` of this expert-parallel rank, each
split like a dense MLP over the expert-tensor-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from .checkpoint import safetensors_files as checkpoint_safetensors_files

__all__ = [
    "MegatronWeight",
    "fused_qkv_weight",
    "megatron_weight_plan",
    "convert_with_plan",
    "safetensors_files",
    "stream_with_plan",
]


@dataclass(frozen=True)
class MegatronWeight:
    """One megatron tensor of this rank: ``build(*[hf[s] for s in sources])``."""

    name: str
    sources: tuple
    build: Callable[..., torch.Tensor]


def _chunk(tensor: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot split a tensor of shape {tuple(tensor.shape)} on dim {dim} into {size} parts.")
    return torch.chunk(tensor, size, dim=dim)[rank]


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    pad = weight.new_zeros((rows - weight.shape[0],) + tuple(weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def fused_qkv_weight(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` weight: per query group ``[q heads of the group; k; v]``.

    ``q [heads * hd, H]``, ``k``/``v`` ``[groups * hd, H]`` -> ``[groups * (heads/groups + 2) * hd, H]``, the
    layout `SelfAttention.get_query_key_value_tensors` views as ``[groups, (q_per_group + 2) * hd]``.
    """
    hidden = q.shape[-1]
    q = q.reshape(num_query_groups, -1, head_dim, hidden)
    k = k.reshape(num_query_groups, 1, head_dim, hidden)
    v = v.reshape(num_query_groups, 1, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def megatron_weight_plan(
    spec: Any,
    *,
    tp_rank: int,
    tp_size: int,
    layer_offset: int,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    padded_vocab: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: Optional[int] = None,
    etp_size: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    transformer_engine_names: bool = False,
) -> list[MegatronWeight]:
    """Every megatron tensor of one (TP rank, EP rank, PP stage) of the target ``spec`` (`HFTargetSpec`).

    ``etp_rank``/``etp_size`` (expert tensor parallelism) default to ``tp_rank``/``tp_size``, megatron's
    default. Layers ``layer_offset .. layer_offset + num_layers - 1`` are named ``decoder.layers.0 ..``.
    """
    etp_rank = tp_rank if etp_rank is None else etp_rank
    etp_size = tp_size if etp_size is None else etp_size
    plan: list[MegatronWeight] = []

    def add(name: str, sources: Sequence[str], build: Callable[..., torch.Tensor]) -> None:
        def cast(*tensors: torch.Tensor) -> torch.Tensor:
            out = build(*tensors)
            out = out.to(dtype) if dtype is not None else out
            return out.contiguous()

        plan.append(MegatronWeight(name, tuple(sources), cast))

    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    def vocab_shard(weight: torch.Tensor) -> torch.Tensor:
        if weight.shape[0] != spec.vocab_size:
            raise ValueError(f"the vocabulary matrix has {weight.shape[0]} rows but vocab_size={spec.vocab_size}.")
        return _chunk(_pad_rows(weight, padded_vocab), tp_rank, tp_size, 0)

    def qkv(q, k, v):
        # Groups are contiguous row blocks of the fused matrix: TP takes whole groups.
        return _chunk(fused_qkv_weight(q, k, v, spec.num_key_value_heads, spec.head_dim), tp_rank, tp_size, 0)

    def mlp(prefix: str, src: str, rank: int, size: int) -> None:
        add(prefix + "linear_fc1.weight", [src + "gate_proj.weight", src + "up_proj.weight"],
            lambda gate, up: torch.cat([_chunk(gate, rank, size, 0), _chunk(up, rank, size, 0)], dim=0))
        add(prefix + "linear_fc2.weight", [src + "down_proj.weight"], lambda down: _chunk(down, rank, size, 1))

    def rows(t):  # column-parallel: this rank's block of output rows
        return _chunk(t, tp_rank, tp_size, 0)

    def mla(prefix: str, attn: str) -> None:
        # Head-major outputs ([heads, nope + rope] for q, [heads, nope + v] for kv) split by whole heads;
        # the down projections' outputs ([q_lora] and [kv_lora + rope]) by rows, gathered again by megatron.
        if spec.q_lora_rank:
            add(prefix + "linear_q_down_proj.weight", [attn + "q_a_proj.weight"], rows)
            add(prefix + "q_layernorm.weight", [attn + "q_a_layernorm.weight"], same)
            add(prefix + "linear_q_up_proj.weight", [attn + "q_b_proj.weight"], rows)
        else:
            add(prefix + "linear_q_proj.weight", [attn + "q_proj.weight"], rows)
        add(prefix + "linear_kv_down_proj.weight", [attn + "kv_a_proj_with_mqa.weight"], rows)
        add(prefix + "kv_layernorm.weight", [attn + "kv_a_layernorm.weight"], same)
        add(prefix + "linear_kv_up_proj.weight", [attn + "kv_b_proj.weight"], rows)

    if transformer_engine_names:
        input_norm, mlp_norm = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    else:
        input_norm, mlp_norm = "input_layernorm.weight", "pre_mlp_layernorm.weight"

    if pre_process:
        add("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], vocab_shard)
    experts_per_rank = spec.num_experts // ep_size if spec.num_experts else 0
    for local in range(num_layers):
        layer = layer_offset + local
        src = f"model.layers.{layer}."
        dst = f"decoder.layers.{local}."
        attn = src + "self_attn."
        if spec.mla:
            mla(dst + "self_attention.", attn)
        else:
            add(dst + "self_attention.linear_qkv.weight",
                [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], qkv)
        add(dst + "self_attention.linear_proj.weight", [attn + "o_proj.weight"], lambda o: _chunk(o, tp_rank, tp_size, 1))
        if spec.qk_layernorm:
            add(dst + "self_attention.q_layernorm.weight", [attn + "q_norm.weight"], same)
            add(dst + "self_attention.k_layernorm.weight", [attn + "k_norm.weight"], same)
        add(dst + input_norm, [src + "input_layernorm.weight"], same)
        if spec.is_moe_layer(layer):
            # The MoE layer keeps its own pre-MLP norm (TE fuses norms only into dense linear_fc1).
            add(dst + "pre_mlp_layernorm.weight", [src + "post_attention_layernorm.weight"], same)
            add(dst + "mlp.router.weight", [src + "mlp.gate.weight"], same)
            if spec.expert_bias:
                add(dst + "mlp.router.expert_bias", [src + "mlp.gate.e_score_correction_bias"], same)
            if spec.shared_expert_intermediate_size:
                mlp(dst + "mlp.shared_experts.", src + "mlp.shared_experts.", tp_rank, tp_size)
            for j in range(experts_per_rank):
                expert = ep_rank * experts_per_rank + j
                mlp(dst + f"mlp.experts.local_experts.{j}.", src + f"mlp.experts.{expert}.", etp_rank, etp_size)
        else:
            add(dst + mlp_norm, [src + "post_attention_layernorm.weight"], same)
            mlp(dst + "mlp.", src + "mlp.", tp_rank, tp_size)
    if post_process:
        add("decoder.final_layernorm.weight", ["model.norm.weight"], same)
        if not spec.tie_word_embeddings:
            add("output_layer.weight", ["lm_head.weight"], vocab_shard)
        elif not pre_process:
            # Tied, but the embedding lives on another stage: this stage keeps its own copy.
            add("output_layer.weight", ["model.embed_tokens.weight"], vocab_shard)
    return plan


def convert_with_plan(plan: Sequence[MegatronWeight], hf: Mapping[str, torch.Tensor], model_type: str) -> dict:
    """``{megatron name: tensor}`` from a ``HF name -> tensor`` mapping (only the planned tensors are read)."""

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint has no tensor {name!r} (a {model_type} checkpoint was expected).")
        return hf[name]

    return {w.name: w.build(*[get(s) for s in w.sources]) for w in plan}


def safetensors_files(directory: str) -> list[str]:
    """The safetensors files of a HF target directory: `checkpoint.safetensors_files`, the one discovery, with
    the target's message when there are none."""
    return checkpoint_safetensors_files(directory, missing=(
        f"{directory} holds no model.safetensors or model.safetensors.index.json; save the target with "
        "save_pretrained(safe_serialization=True)."))


def stream_with_plan(plan: Sequence[MegatronWeight], files: Sequence[str], model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron name, tensor)`` for every planned weight, reading the files one after another.

    A source read from a shard is dropped as soon as every weight that needs it has been built; only
    sources whose partners (e.g. ``k_proj`` of a ``q_proj``) sit in a later shard wait.

    Raises:
        KeyError: naming the HF tensors the files do not hold, after the last file.
    """
    from safetensors import safe_open

    needed: dict[str, int] = {}
    for w in plan:
        for s in w.sources:
            needed[s] = needed.get(s, 0) + 1
    waiting = {i: set(w.sources) for i, w in enumerate(plan)}
    by_source: dict[str, list[int]] = {}
    for i, w in enumerate(plan):
        for s in set(w.sources):
            by_source.setdefault(s, []).append(i)
    held: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                if key not in needed or key in held:
                    continue
                held[key] = handle.get_tensor(key)
                for i in by_source[key]:
                    waiting[i].discard(key)
                    if waiting[i]:
                        continue
                    w = plan[i]
                    yield w.name, w.build(*[held[s] for s in w.sources])
                    for s in w.sources:
                        needed[s] -= 1
                        if needed[s] == 0:
                            held.pop(s, None)
                    del waiting[i]
    if waiting:
        missing = sorted({s for srcs in waiting.values() for s in srcs})
        raise KeyError(f"HF checkpoint has no tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                       f"(a {model_type} checkpoint was expected).")
