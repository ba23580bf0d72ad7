"""HF weights -> megatron ``GPTModel`` weights of one rank: the mapping plan, its checks and the shard-by-shard loader.

One idea, one place: `megatron_weight_plan` lists, for one (TP rank, EP rank, PP stage), every megatron
parameter this rank holds as a `MegatronWeight`: its name, the HF tensors it is made of, and how (fuse,
split, pad). Two drivers consume the plan:

* `convert_with_plan` reads a ``name -> tensor`` mapping (a dict, or a lazy view) into a state dict;
* `stream_with_plan` (through `load_plan_into`, what `target.megatron.model.build_megatron_target` uses)
  opens the HF safetensors files **one at a time**, reads from each only the tensors this rank needs, yields
  every megatron tensor as soon as its sources are complete, and closes the file before opening the next.
  Host memory is bounded by the tensors of one shard this rank needs (plus any sources still waiting for a
  partner in a later shard), not by the model; experts of other EP ranks are never read.

Layouts (megatron-core 0.16, local and Transformer Engine specs): ``linear_qkv`` is the per-query-group
interleaved ``[q_g; k_g; v_g]`` matrix, split by whole groups across TP; ``linear_proj`` and ``linear_fc2``
are split on their input dim; ``linear_fc1`` is ``[gate shard; up shard]`` per rank; the embedding and output
layer are split by vocabulary rows (padded rows are zero). MoE layers (``mlp.router.weight``, replicated, and
``mlp.experts.local_experts.{j}``: the experts ``ep_rank * E / EP + j`` of this expert-parallel rank, each
split like a dense MLP over the expert-tensor-parallel group).

`checked_weight_plan` checks a rank's coordinates against the target (`config.check_parallel_sizes`, layer
range, padded vocabulary) before planning; `convert_hf_to_megatron_state_dict` is the whole conversion of one
shard from a mapping (`load_hf_state_dict`: a lazy view of a HF directory's safetensors files).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from ...common.safetensors_files import target_safetensors_files
from .config import HFTargetSpec, check_parallel_sizes, hf_target_spec, padded_vocab_size

__all__ = [
    "MegatronWeight",
    "fused_qkv_weight",
    "megatron_weight_plan",
    "checked_weight_plan",
    "convert_with_plan",
    "convert_hf_to_megatron_state_dict",
    "stream_with_plan",
    "load_plan_into",
    "load_hf_state_dict",
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


def convert_hf_to_megatron_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    layer_offset: int = 0,
    num_layers: Optional[int] = None,
    pre_process: bool = True,
    post_process: bool = True,
    padded_vocab: Optional[int] = None,
    make_vocab_size_divisible_by: int = 128,
    dtype: Optional[torch.dtype] = None,
    transformer_engine_names: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: Optional[int] = None,
    etp_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """The state dict of one (TP, EP rank, PP stage) shard of a megatron ``GPTModel`` from HF weights.

    Args:
        hf_state_dict: HF names (``model.layers.N.self_attn.q_proj.weight``, ...) to tensors; a lazy mapping
            is fine, only the tensors of this stage are read.
        tp_rank, tp_size: this rank's tensor-parallel coordinates.
        layer_offset, num_layers: the global layers ``layer_offset .. layer_offset + num_layers - 1`` this
            stage owns (megatron names them ``decoder.layers.0 ..``); all layers by default.
        pre_process, post_process: whether this stage holds the embedding / the final norm and output layer.
        padded_vocab: the model's (padded) vocabulary; `padded_vocab_size` by default. Padded rows are zero
            (never looked up; their logits are masked by `OutputHead`).
        dtype: cast every tensor to this dtype (default: keep).
        transformer_engine_names: name the norms as the TE spec does (fused into the following linear).
        ep_rank, ep_size: this rank's expert-parallel coordinates (MoE targets: only its experts are read).
        etp_rank, etp_size: expert tensor parallelism (default: ``tp_rank``/``tp_size``, megatron's default).

    Layouts: see this module's docstring. With tied embeddings the output layer is absent on a stage that also
    holds the embedding (megatron reuses the embedding weight) and is the embedding's copy otherwise.
    """
    spec = hf_target_spec(hf_config)
    plan = checked_weight_plan(spec, tp_rank, tp_size, layer_offset=layer_offset, num_layers=num_layers,
                        pre_process=pre_process, post_process=post_process, padded_vocab=padded_vocab,
                        make_vocab_size_divisible_by=make_vocab_size_divisible_by, dtype=dtype,
                        transformer_engine_names=transformer_engine_names, ep_rank=ep_rank, ep_size=ep_size,
                        etp_rank=etp_rank, etp_size=etp_size)
    return convert_with_plan(plan, hf_state_dict, spec.model_type)


def checked_weight_plan(
    spec: HFTargetSpec,
    tp_rank: int,
    tp_size: int,
    *,
    layer_offset: int,
    num_layers: Optional[int],
    padded_vocab: Optional[int],
    make_vocab_size_divisible_by: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: Optional[int],
    etp_size: Optional[int],
    **kwargs: Any,
) -> list:
    """`megatron_weight_plan` after checking this rank's coordinates against ``spec``."""
    check_parallel_sizes(spec, tp_size, ep_size, etp_size)
    for name, rank, size in (("tp_rank", tp_rank, tp_size), ("ep_rank", ep_rank, ep_size),
                             ("etp_rank", etp_rank, etp_size)):
        if rank is not None and not 0 <= rank < (size or tp_size):
            raise ValueError(f"{name}={rank} must be in [0, {size or tp_size}).")
    if num_layers is None:
        num_layers = spec.num_layers - layer_offset
    if layer_offset < 0 or num_layers < 0 or layer_offset + num_layers > spec.num_layers:
        raise ValueError(
            f"layers {layer_offset}..{layer_offset + num_layers - 1} are outside the target's {spec.num_layers} layers."
        )
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp_size, make_vocab_size_divisible_by)
    if vocab < spec.vocab_size or vocab % tp_size:
        raise ValueError(f"padded_vocab={vocab} must be >= vocab_size={spec.vocab_size} and divisible by TP={tp_size}.")
    return megatron_weight_plan(spec, tp_rank=tp_rank, tp_size=tp_size, layer_offset=layer_offset,
                                num_layers=num_layers, padded_vocab=vocab, ep_rank=ep_rank, ep_size=ep_size,
                                etp_rank=etp_rank, etp_size=etp_size, **kwargs)


class _SafetensorsDirectory(Mapping):
    """Lazy ``name -> tensor`` view of the safetensors files of a HF directory (one or many shards)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        files = target_safetensors_files(directory)
        self._handles = {path: safe_open(path, framework="pt") for path in files}
        self._where = {key: path for path, handle in self._handles.items() for key in handle.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where


def load_hf_state_dict(hf_dir: str) -> Mapping[str, torch.Tensor]:
    """A lazy mapping over the safetensors weights of ``hf_dir``: tensors are read when indexed."""
    return _SafetensorsDirectory(hf_dir)


def load_plan_into(model: nn.Module, plan: Sequence, files: Sequence[str], model_type: str) -> None:
    """Copy the planned weights into ``model``'s parameters as they stream in, one shard file at a time.

    The plan must name every tensor of ``model.state_dict()`` (Transformer Engine's ``_extra_state`` aside)
    and nothing else; this is checked before any file is read. Each converted tensor is copied into its
    parameter (on the model's device) and dropped, so host memory never holds this rank's whole slice.
    """
    state = model.state_dict(keep_vars=True)
    expected = {k for k in state if not k.endswith("_extra_state")}
    planned = [w.name for w in plan]
    missing = sorted(expected - set(planned))
    unexpected = sorted(set(planned) - expected)
    if missing or unexpected:
        raise RuntimeError(
            f"build_megatron_target: the converted weights do not match the model: missing {missing}, "
            f"unexpected {unexpected}."
        )
    with torch.no_grad():
        for name, tensor in stream_with_plan(plan, files, model_type):
            param = state[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise RuntimeError(
                    f"build_megatron_target: {name} is {tuple(tensor.shape)} in the converted checkpoint but "
                    f"{tuple(param.shape)} in the model."
                )
            param.copy_(tensor)
