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

from ..common.safetensors_files import safetensors_files as checkpoint_safetensors_files

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
    plan = _RankWeightPlan(
        spec, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=padded_vocab, dtype=dtype,
        etp_rank=tp_rank if etp_rank is None else etp_rank, etp_size=tp_size if etp_size is None else etp_size,
    )
    if transformer_engine_names:
        norm_names = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
    else:
        norm_names = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    if pre_process:
        plan.add("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], plan.vocab_shard)
    experts_per_rank = spec.num_experts // ep_size if spec.num_experts else 0
    experts = range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)  # this EP rank's, in order
    for local in range(num_layers):
        plan.decoder_layer(layer_offset + local, f"decoder.layers.{local}.", norm_names, experts)
    if post_process:
        plan.add("decoder.final_layernorm.weight", ["model.norm.weight"], _same)
        if not spec.tie_word_embeddings:
            plan.add("output_layer.weight", ["lm_head.weight"], plan.vocab_shard)
        elif not pre_process:
            # Tied, but the embedding lives on another stage: this stage keeps its own copy.
            plan.add("output_layer.weight", ["model.embed_tokens.weight"], plan.vocab_shard)
    return plan.weights


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _RankWeightPlan:
    """The `MegatronWeight` list of one rank as it is built, with the steps that add a layer's tensors.

    ``spec`` is the `HFTargetSpec`; TP splits attention, dense MLPs and the vocabulary, expert TP
    (``etp_rank``/``etp_size``) the experts' MLPs. Every built tensor is cast to ``dtype`` (when given) and made
    contiguous.
    """

    def __init__(self, spec: Any, *, tp_rank: int, tp_size: int, etp_rank: int, etp_size: int, padded_vocab: int,
                 dtype: Optional[torch.dtype]):
        self.spec = spec
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.etp_rank, self.etp_size = etp_rank, etp_size
        self.padded_vocab = padded_vocab
        self.dtype = dtype
        self.weights: list[MegatronWeight] = []

    def add(self, name: str, sources: Sequence[str], build: Callable[..., torch.Tensor]) -> None:
        dtype = self.dtype

        def cast(*tensors: torch.Tensor) -> torch.Tensor:
            out = build(*tensors)
            out = out.to(dtype) if dtype is not None else out
            return out.contiguous()

        self.weights.append(MegatronWeight(name, tuple(sources), cast))

    # ---- builds: HF tensor(s) -> this rank's megatron tensor

    def vocab_shard(self, weight: torch.Tensor) -> torch.Tensor:
        """``[V, H]`` -> this rank's rows of the ``[padded_vocab, H]`` matrix (padding rows zero)."""
        if weight.shape[0] != self.spec.vocab_size:
            raise ValueError(f"the vocabulary matrix has {weight.shape[0]} rows but vocab_size={self.spec.vocab_size}.")
        return _chunk(_pad_rows(weight, self.padded_vocab), self.tp_rank, self.tp_size, 0)

    def qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Groups are contiguous row blocks of the fused matrix: TP takes whole groups.
        fused = fused_qkv_weight(q, k, v, self.spec.num_key_value_heads, self.spec.head_dim)
        return _chunk(fused, self.tp_rank, self.tp_size, 0)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Column-parallel: this rank's block of output rows."""
        return _chunk(t, self.tp_rank, self.tp_size, 0)

    def columns(self, t: torch.Tensor) -> torch.Tensor:
        """Row-parallel: this rank's block of input columns."""
        return _chunk(t, self.tp_rank, self.tp_size, 1)

    # ---- a decoder layer's tensors

    def mlp(self, prefix: str, src: str, rank: int, size: int) -> None:
        """A gated MLP: ``linear_fc1 = [gate shard; up shard]`` and ``linear_fc2`` split on its input dim."""
        self.add(prefix + "linear_fc1.weight", [src + "gate_proj.weight", src + "up_proj.weight"],
                 lambda gate, up: torch.cat([_chunk(gate, rank, size, 0), _chunk(up, rank, size, 0)], dim=0))
        self.add(prefix + "linear_fc2.weight", [src + "down_proj.weight"], lambda down: _chunk(down, rank, size, 1))

    def mla(self, prefix: str, attn: str) -> None:
        """Multi-latent attention's projections and norms (DeepSeek-V3 / Kimi)."""
        # Head-major outputs ([heads, nope + rope] for q, [heads, nope + v] for kv) split by whole heads;
        # the down projections' outputs ([q_lora] and [kv_lora + rope]) by rows, gathered again by megatron.
        if self.spec.q_lora_rank:
            self.add(prefix + "linear_q_down_proj.weight", [attn + "q_a_proj.weight"], self.rows)
            self.add(prefix + "q_layernorm.weight", [attn + "q_a_layernorm.weight"], _same)
            self.add(prefix + "linear_q_up_proj.weight", [attn + "q_b_proj.weight"], self.rows)
        else:
            self.add(prefix + "linear_q_proj.weight", [attn + "q_proj.weight"], self.rows)
        self.add(prefix + "linear_kv_down_proj.weight", [attn + "kv_a_proj_with_mqa.weight"], self.rows)
        self.add(prefix + "kv_layernorm.weight", [attn + "kv_a_layernorm.weight"], _same)
        self.add(prefix + "linear_kv_up_proj.weight", [attn + "kv_b_proj.weight"], self.rows)

    def attention(self, dst: str, attn: str) -> None:
        """Self-attention of one layer (``dst``: its megatron prefix, ``attn``: its HF ``self_attn.`` prefix)."""
        if self.spec.mla:
            self.mla(dst + "self_attention.", attn)
        else:
            self.add(dst + "self_attention.linear_qkv.weight",
                     [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], self.qkv)
        self.add(dst + "self_attention.linear_proj.weight", [attn + "o_proj.weight"], self.columns)
        if self.spec.qk_layernorm:
            self.add(dst + "self_attention.q_layernorm.weight", [attn + "q_norm.weight"], _same)
            self.add(dst + "self_attention.k_layernorm.weight", [attn + "k_norm.weight"], _same)

    def moe(self, dst: str, src: str, experts: range) -> None:
        """A MoE layer: its own pre-MLP norm, router, shared experts and this EP rank's ``experts``."""
        # The MoE layer keeps its own pre-MLP norm (TE fuses norms only into dense linear_fc1).
        self.add(dst + "pre_mlp_layernorm.weight", [src + "post_attention_layernorm.weight"], _same)
        self.add(dst + "mlp.router.weight", [src + "mlp.gate.weight"], _same)
        if self.spec.expert_bias:
            self.add(dst + "mlp.router.expert_bias", [src + "mlp.gate.e_score_correction_bias"], _same)
        if self.spec.shared_expert_intermediate_size:
            self.mlp(dst + "mlp.shared_experts.", src + "mlp.shared_experts.", self.tp_rank, self.tp_size)
        for j, expert in enumerate(experts):
            self.mlp(dst + f"mlp.experts.local_experts.{j}.", src + f"mlp.experts.{expert}.", self.etp_rank, self.etp_size)

    def decoder_layer(self, layer: int, dst: str, norm_names: tuple[str, str], experts: range) -> None:
        """HF layer ``layer`` as megatron's layer prefix ``dst``; ``norm_names``: the (input, pre-MLP) norm names
        of the spec (local or Transformer Engine)."""
        src = f"model.layers.{layer}."
        input_norm, mlp_norm = norm_names
        self.attention(dst, src + "self_attn.")
        self.add(dst + input_norm, [src + "input_layernorm.weight"], _same)
        if self.spec.is_moe_layer(layer):
            self.moe(dst, src, experts)
        else:
            self.add(dst + mlp_norm, [src + "post_attention_layernorm.weight"], _same)
            self.mlp(dst + "mlp.", src + "mlp.", self.tp_rank, self.tp_size)


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
