"""Pipeline parallelism for the frozen target: run it stage by stage and route its taps to the draft's stage.

The target is a megatron-core ``GPTModel`` split over ``PP`` pipeline stages (`target.MegatronTarget` wraps
one stage). The draft body lives on **one** stage, chosen by the caller (`resolve_draft_stage`; default the
last, ``--dflash-pipeline-stage -1``). Because the target is frozen and forward-only, its pipeline is a plain
chain, with no backward pass and no 1F1B schedule:

1. stage ``s > 0`` receives the ``[S, B, H]`` activations of stage ``s - 1``; stage 0 embeds the tokens;
2. the stage runs its layers (`MegatronTarget.forward`, under ``no_grad``), capturing the taps of the layers
   it owns (global layer ids);
3. stage ``s < PP - 1`` sends its output activations to stage ``s + 1``;
4. a stage that owns tapped layers and is not the draft's stage sends them, concatenated in ascending layer
   id order (one ``[B, S, n_s * H]`` message per producing stage), to the draft's stage;
5. the draft's stage receives the taps of every producing stage (ascending stage order) and assembles the
   body's input ``[B, S, taps * H]`` in ``target_layer_ids`` order (`target.concat_taps`). When the draft
   is on the last stage it also has ``final_hidden`` (the target's final normed hidden states, for
   distillation); elsewhere the last stage sends them on request (``need_final_hidden=True``).

Every message goes from a rank to the rank with the **same tensor-parallel rank** on the other stage, over
megatron's pipeline group, with ``torch.distributed.send``/``recv`` and shapes every rank knows in advance
(``B, S`` from the batch, ``H`` and the per-stage layer ranges from the target's config): no shape exchange.
Megatron's own ``P2PCommunicator`` and schedules are not used: they allocate their buffers with
``torch.cuda.current_device()`` and synchronise CUDA, and they are built around a training schedule with
backward passes the frozen target does not have. Every TP rank of a stage holds the full (replicated)
activations and taps, so each TP rank sends its own copy; the traffic per micro-batch is
``(PP - 1) * S * B * H`` activations plus ``S * B * H`` per tap produced off the draft's stage, per TP rank.
With sequence parallelism the activations stay sharded (``[S / TP, B, H]`` per TP rank, ``1 / TP`` of the
traffic) while the taps are gathered to the full sequence on their stage (`MegatronTarget`). The stages run
one after another (no overlap between micro-batches): the target is forward
only and usually far cheaper than the draft's forward and backward on the draft's stage.

The block embeddings need the target's **input embedding** (first stage) and the loss needs its **output
layer** (last stage). Both are frozen, so the draft's stage keeps frozen copies made once at setup by
`copy_frozen_target_heads`: TP rank ``r`` of the first (last) stage sends its vocabulary shard to TP rank
``r`` of the draft's stage, which wraps it in a megatron ``VocabParallelEmbedding`` (an `head.OutputHead`
over a weightless ``ColumnParallelLinear``). Memory: ``V_padded * H / TP`` parameters per copy and TP rank
(Qwen3-8B, bf16, TP 8: 152k x 4096 / 8 x 2 bytes = 156 MB). With tied embeddings the output layer *is* the
embedding, so at most one copy is made; a draft on the first (last) stage needs no embedding (head) copy.

Every function validates before its first collective: the parallel layout (megatron ``parallel_state``
initialised, no virtual pipeline, no custom pipeline layout, no context parallelism), the draft's stage, the
batch shapes; then one small all-reduce over the model-parallel group (TP x PP) makes every rank raise the
same error if any rank's inputs are bad or the ranks disagree (draft stage, batch shape, tapped layers),
instead of hanging in a send that is never received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .head import OutputHead
from .parallel import gather_disagreement
from .target import MegatronTarget, concat_taps
from .target_masks import causal_mask

__all__ = [
    "DraftStagePlacement",
    "resolve_draft_stage",
    "stage_layer_ranges",
    "TargetOnDraftStage",
    "run_target_pipeline",
    "copy_frozen_target_heads",
]

_HASH_MOD = (1 << 61) - 1


# --------------------------------------------------------------------------------------------------
# Where the draft lives
# --------------------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DraftStagePlacement:
    """The pipeline stage that holds the draft body (and its optimizer), out of ``pp_size`` stages.

    Attributes:
        draft_stage: 0-based stage index, ``0 <= draft_stage < pp_size``.
        pp_size: number of pipeline stages (megatron's pipeline-model-parallel world size).
    """

    draft_stage: int
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.pp_size) or self.pp_size < 1:
            raise ValueError(f"DraftStagePlacement: pp_size={self.pp_size!r} must be a positive integer.")
        if not _is_int(self.draft_stage) or not 0 <= self.draft_stage < self.pp_size:
            raise ValueError(
                f"DraftStagePlacement: draft_stage={self.draft_stage!r} must be a stage index in "
                f"0..{self.pp_size - 1}; use resolve_draft_stage() for -1 (the last stage)."
            )

    @property
    def is_last_stage(self) -> bool:
        """Whether the draft sits on the last stage (the target's output layer and final norm are there)."""
        return self.draft_stage == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        """Whether the draft sits on the first stage (the target's input embedding is there)."""
        return self.draft_stage == 0

    def holds_draft(self, pp_rank: Optional[int] = None) -> bool:
        """Whether stage ``pp_rank`` (default: this rank's, from megatron's ``parallel_state``) holds the draft."""
        if pp_rank is None:
            pp_rank = _pp_rank_and_size()[0]
        return pp_rank == self.draft_stage


def resolve_draft_stage(arg: Union[int, DraftStagePlacement], pp_size: int) -> DraftStagePlacement:
    """The draft's stage from ``--dflash-pipeline-stage``: ``0..pp_size-1``, or negative from the end (-1 = last).

    A pure function of its arguments: every rank that passes the same command line gets the same result, or
    the same ``ValueError`` (no collective is involved).
    """
    if not _is_int(pp_size) or pp_size < 1:
        raise ValueError(f"resolve_draft_stage: pp_size={pp_size!r} must be a positive integer.")
    if isinstance(arg, DraftStagePlacement):
        if arg.pp_size != pp_size:
            raise ValueError(
                f"resolve_draft_stage: the placement was made for {arg.pp_size} pipeline stage(s) but the "
                f"pipeline has {pp_size}."
            )
        return arg
    if not _is_int(arg):
        raise ValueError(f"--dflash-pipeline-stage={arg!r} must be an integer stage index (-1: the last stage).")
    if not -pp_size <= arg < pp_size:
        raise ValueError(
            f"--dflash-pipeline-stage={arg} is outside the {pp_size} pipeline stage(s): use -1 (the last "
            f"stage, default) or a stage index in 0..{pp_size - 1}."
        )
    return DraftStagePlacement(arg % pp_size, pp_size)


# --------------------------------------------------------------------------------------------------
# Layout helpers (local, no collective)
# --------------------------------------------------------------------------------------------------


def _pp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 0, 1
    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def stage_layer_ranges(config, pp_size: int) -> list[range]:
    """Global decoder layers owned by each pipeline stage, computed from the target's ``TransformerConfig``.

    Uses megatron's own ``get_transformer_layer_offset`` for every stage (even and uneven splits,
    ``num_layers_in_first/last_pipeline_stage``, ``account_for_embedding/loss_in_pipeline_split``). Virtual
    (interleaved) pipelines and ``pipeline_model_parallel_layout`` are refused: their stages own several
    non-contiguous chunks.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp is not None and vp > 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vp}: interleaved pipeline stages are not supported for the "
            "frozen target (it runs forward only; interleaving gains nothing); build it without a virtual pipeline."
        )
    if getattr(config, "pipeline_model_parallel_layout", None):
        raise ValueError(
            "pipeline_model_parallel_layout is not supported for the frozen target; split its layers with "
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage or evenly."
        )
    if pp_size == 1:
        return [range(int(config.num_layers))]
    starts = [int(get_transformer_layer_offset(config, pp_rank=s)) for s in range(pp_size)]
    ends = starts[1:] + [int(config.num_layers)]
    return [range(a, b) for a, b in zip(starts, ends)]


def _device(target) -> torch.device:
    if isinstance(target, nn.Module):
        for p in target.parameters():
            return p.device
    return torch.device("cpu")


def _wire_dtype(config) -> torch.dtype:
    return getattr(config, "pipeline_dtype", None) or config.params_dtype


def _check_target(target) -> None:
    if not isinstance(target, MegatronTarget):
        raise ValueError(
            f"the pipeline needs a MegatronTarget (one stage of a megatron GPTModel), got {type(target).__name__}; "
            "an HFTarget runs in one process (PP=1) and needs no routing."
        )
    from .target import context_parallel_refusal

    refusal = context_parallel_refusal(target.model.config)
    if refusal:
        raise ValueError(refusal)


@dataclass
class _Layout:
    stage: int
    pp_size: int
    tp_size: int
    placement: DraftStagePlacement
    ranges: list
    hidden: int

    def owned(self, stage: int, ids: Sequence[int]) -> list[int]:
        """The tapped layers of ``stage``, ascending: the order of its tap message."""
        return sorted(i for i in ids if i in self.ranges[stage])


def _layout(target: MegatronTarget, draft_stage) -> _Layout:
    """Everything both entry points need, checked locally (raises ValueError; no collective)."""
    from megatron.core import parallel_state

    _check_target(target)
    if not (dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        raise ValueError(
            "the target pipeline needs torch.distributed and megatron's parallel_state initialised "
            "(initialize_model_parallel with the pipeline size)."
        )
    config = target.model.config
    stage = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if int(config.pipeline_model_parallel_size) != pp:
        raise ValueError(
            f"the target was built for pipeline_model_parallel_size={config.pipeline_model_parallel_size} but "
            f"parallel_state has {pp} stage(s)."
        )
    placement = resolve_draft_stage(draft_stage, pp)
    ranges = stage_layer_ranges(config, pp)
    if list(ranges[stage]) != list(target.layer_ids):
        raise ValueError(
            f"pipeline stage {stage} owns target layers {list(target.layer_ids)} but the config's split gives "
            f"{list(ranges[stage])}; build every stage with the same TransformerConfig."
        )
    if bool(target.pre_process) != (stage == 0) or bool(target.post_process) != (stage == pp - 1):
        raise ValueError(
            f"pipeline stage {stage} of {pp}: the target has pre_process={target.pre_process}, "
            f"post_process={target.post_process}; the first stage must embed and the last must hold the "
            "output layer (build with the defaults)."
        )
    return _Layout(stage, pp, tp, placement, ranges, int(config.hidden_size))


def _ids_hash(ids: Sequence[int]) -> int:
    h = 0
    for i in ids:
        h = (h * 1_000_003 + int(i) + 1) % _HASH_MOD
    return h


def _agree(local_error: Optional[str], signature: Sequence[int], what: str, device) -> None:
    """Raise the same ValueError on every rank of the model-parallel group if any rank erred or disagrees.

    One all-reduce (MAX of ``[error flag, signature, -signature]``); only on failure are the messages gathered.
    Without an initialised model-parallel group, just raise the local error.
    """
    from megatron.core import parallel_state

    ready = dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    group = parallel_state.get_model_parallel_group() if ready else None
    if group is None or dist.get_world_size(group) == 1:
        if local_error is not None:
            raise ValueError(f"{what}: {local_error}")
        return
    disagreement = gather_disagreement(local_error, signature, group, device)
    if disagreement is None:
        return
    gathered, mismatch = disagreement
    errors = [(r, err) for r, (err, _) in enumerate(gathered) if err is not None]
    if errors and len({err for _, err in errors}) == 1 and not mismatch:
        ranks = "every rank" if len(errors) == len(gathered) else "rank(s) " + ", ".join(str(r) for r, _ in errors)
        raise ValueError(f"{what}: {errors[0][1].rstrip('.')} (raised on {ranks} of the model-parallel group).")
    lines = [f"rank {r}: {err}" for r, err in errors]
    if mismatch:
        lines.append(
            "the ranks of the model-parallel group disagree on their arguments (signature: pipeline size, "
            "TP size, draft stage, then batch shape / vocabulary, hidden size, tapped layers): "
            + ", ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(gathered))
            + "; every rank must pass the same --dflash-pipeline-stage and the same batch"
        )
    raise ValueError(f"{what}: " + "; ".join(lines) + ".")


def _peer(stage: int):
    """Global rank of ``stage`` in this rank's pipeline group (same TP and DP coordinates)."""
    from megatron.core import parallel_state

    return dist.get_global_rank(parallel_state.get_pipeline_model_parallel_group(), stage)


def _send(tensor: torch.Tensor, stage: int) -> None:
    from megatron.core import parallel_state

    dist.send(tensor.contiguous(), dst=_peer(stage), group=parallel_state.get_pipeline_model_parallel_group())


def _recv(shape, dtype, device, stage: int) -> torch.Tensor:
    from megatron.core import parallel_state

    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=_peer(stage), group=parallel_state.get_pipeline_model_parallel_group())
    return buffer


# --------------------------------------------------------------------------------------------------
# The target's forward through the pipeline
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetOnDraftStage:
    """What the draft's stage gets from the target pipeline.

    Attributes:
        taps: ``[B, S, taps * H]``, the tapped layers' outputs concatenated in ``target_layer_ids`` order (the
            body's ``target_hidden``), in the pipeline dtype; no grad.
        final_hidden: ``[B, S, H]`` the target's final normed hidden states (what its output layer reads; the
            teacher of soft-target losses) when the draft is on the last stage or ``need_final_hidden=True``;
            else None.
    """

    taps: torch.Tensor
    final_hidden: Optional[torch.Tensor] = None


def _batch_tensors(batch: Mapping) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not isinstance(batch, Mapping) or "tokens" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"the batch must be a dict with 'tokens' [B, S] (and 'position_ids'), got {keys}.")
    tokens = batch["tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"batch['tokens'] must be a [batch, seq_length] tensor, got {shape}.")
    positions = batch.get("position_ids")
    if positions is not None and (not isinstance(positions, torch.Tensor) or tuple(positions.shape) != tuple(tokens.shape)):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"batch['position_ids'] must have the shape of the tokens {tuple(tokens.shape)}, got {shape}.")
    return tokens, positions


def run_target_pipeline(
    target: MegatronTarget,
    batch: Mapping,
    *,
    draft_stage: Union[int, DraftStagePlacement] = -1,
    target_layer_ids: Optional[Sequence[int]] = None,
    attention_mask: Optional[torch.Tensor] = None,
    need_final_hidden: bool = False,
    verify: bool = True,
) -> Optional[TargetOnDraftStage]:
    """Run the frozen target through every pipeline stage and deliver its taps to the draft's stage.

    Called by **every** rank of the model-parallel group (all TP ranks of all stages) with the same batch,
    once per micro-batch. Forward only, under ``no_grad``.

    Args:
        target: this rank's stage of the target.
        batch: the batch dict of `data.py`: ``tokens`` ``[B, S]`` (read on the first stage; its shape on every
            stage), ``position_ids`` ``[B, S]`` (optional, RoPE positions on every stage; default ``0..S-1``).
        draft_stage: a `DraftStagePlacement` or the ``--dflash-pipeline-stage`` value (-1: the last stage).
        target_layer_ids: the tapped layers in the body's order; default ``target.target_layer_ids`` (which
            must contain them: only those layers are hooked).
        attention_mask: for every stage's layers, as `MegatronTarget.forward` takes it: None (causal; an
            explicit causal mask is built for CPU tensors, where megatron cannot build one), a ``[B, S]``
            padding mask, or a bool ``[B or 1, 1, S, S]`` mask with True = masked (packed documents).
        need_final_hidden: also deliver the target's final normed hidden states when the draft is not on the
            last stage (one more ``[B, S, H]`` message from the last stage; soft-target losses need it).
        verify: run the agreement all-reduce (every rank raises the same error on bad or disagreeing inputs).
            Costs one tiny all-reduce and a host sync per call.

    Returns:
        On the draft's stage a `TargetOnDraftStage`; None on every other stage.
    """
    what = "run_target_pipeline"
    device = _device(target)
    error, layout, ids, tokens, positions = None, None, [], None, None
    try:
        layout = _layout(target, draft_stage)
        ids = list(target.target_layer_ids if target_layer_ids is None else target_layer_ids)
        unknown = [i for i in ids if i not in target.target_layer_ids]
        if not ids or len(set(ids)) != len(ids) or unknown:
            raise ValueError(
                f"target_layer_ids={ids} must be a non-empty list of distinct layers among the target's tapped "
                f"layers {target.target_layer_ids}" + (f" ({unknown} are not hooked)" if unknown else "") + "."
            )
        tokens, positions = _batch_tensors(batch)
        if target.sequence_parallel and tokens.shape[1] % layout.tp_size:
            raise ValueError(
                f"with sequence parallelism the sequence length ({tokens.shape[1]}) must be a multiple of "
                f"tensor_model_parallel_size={layout.tp_size}."
            )
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}.")
    except ValueError as err:
        error = str(err)
    if verify:
        B, S = (tuple(tokens.shape) if tokens is not None else (-1, -1))
        signature = [
            layout.pp_size if layout else -1,
            layout.tp_size if layout else -1,
            layout.placement.draft_stage if layout else -1,
            B,
            S,
            layout.hidden if layout else -1,
            int(bool(need_final_hidden)),
            len(ids),
            _ids_hash(ids),
        ]
        _agree(error, signature, what, device)
    elif error is not None:
        raise ValueError(f"{what}: {error}")

    stage, pp, d = layout.stage, layout.pp_size, layout.placement.draft_stage
    B, S = tokens.shape
    H = layout.hidden
    wire = _wire_dtype(target.model.config)
    if attention_mask is None and device.type != "cuda":
        attention_mask = causal_mask(S, device)
    with torch.no_grad():
        # 1-3: the activation chain.
        if stage == 0:
            out = target(tokens.to(device), attention_mask=attention_mask, position_ids=positions)
        else:
            # Under sequence parallelism each TP rank passes its own [S / TP, B, H] shard along the chain.
            shard = S // layout.tp_size if target.sequence_parallel else S
            incoming = _recv((shard, B, H), wire, device, stage - 1)
            out = target(None, attention_mask=attention_mask, position_ids=positions, input_tensor=incoming)
        if stage < pp - 1:
            _send(out.output_tensor.to(wire), stage + 1)
        # 4: taps of this stage to the draft's stage.
        mine = layout.owned(stage, ids)
        if stage != d and mine:
            _send(torch.cat([out.taps[i].to(wire) for i in mine], dim=-1), d)
        if stage == pp - 1 and need_final_hidden and d != pp - 1:
            _send(out.final_hidden.to(wire), d)
        if stage != d:
            return None
        # 5: assemble on the draft's stage.
        taps = {i: out.taps[i].to(wire) for i in mine}
        for s in range(pp):
            theirs = layout.owned(s, ids)
            if s == d or not theirs:
                continue
            received = _recv((B, S, len(theirs) * H), wire, device, s)
            taps.update(zip(theirs, received.split(H, dim=-1)))
        final_hidden = None
        if d == pp - 1:
            final_hidden = out.final_hidden
        elif need_final_hidden:
            final_hidden = _recv((B, S, H), wire, device, pp - 1)
        return TargetOnDraftStage(taps=concat_taps(taps, ids), final_hidden=final_hidden)


# --------------------------------------------------------------------------------------------------
# Frozen copies of the target's embedding and output layer on the draft's stage
# --------------------------------------------------------------------------------------------------


def _copy_config(target: MegatronTarget, tp_size: int):
    """A megatron ``ModelParallelConfig`` that builds the copies without initialising (or touching CUDA)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = target.model.config
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        params_dtype=config.params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        deterministic_mode=getattr(config, "deterministic_mode", False),
        gradient_accumulation_fusion=False,
    )


def _frozen(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight, requires_grad=False)


def copy_frozen_target_heads(
    target: MegatronTarget,
    draft_stage: Union[int, DraftStagePlacement] = -1,
    *,
    verify: bool = True,
) -> tuple[Optional[nn.Module], Optional[OutputHead]]:
    """Give the draft's stage the target's input embedding and output layer; call once at setup, on every rank.

    Returns ``(embedding, head)`` on the draft's stage and ``(None, None)`` elsewhere:

    * ``embedding``: the target's own ``VocabParallelEmbedding`` when the draft is on the first stage, else a
      frozen ``VocabParallelEmbedding`` holding a copy of this TP rank's vocabulary shard, sent by the same TP
      rank of the first stage. Use it as ``embed_blocks(..., embedding)``.
    * ``head``: the target's own `OutputHead` when the draft is on the last stage, else an `OutputHead` over a
      weightless ``ColumnParallelLinear`` with ``weight=`` the output-layer shard sent by the same TP rank of
      the last stage (tied embeddings: the embedding shard, no second copy), and the last stage's output
      multiplier and soft cap.

    Nothing returned requires grad or belongs to the draft body: keep the copies out of the optimizer and the
    draft's checkpoints (they are rebuilt from the target at every start). Memory: ``V_padded * H / TP``
    parameters per copy and TP rank.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

    what = "copy_frozen_target_heads"
    device = _device(target)
    error, layout = None, None
    model = getattr(target, "model", None)
    vocab = int(getattr(model, "vocab_size", -1))
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    try:
        layout = _layout(target, draft_stage)
        if vocab % layout.tp_size:
            raise ValueError(f"the padded vocabulary {vocab} is not divisible by TP={layout.tp_size}.")
        if layout.stage == 0 and target.embedding is None:
            raise ValueError("the first stage has no input embedding.")
        if layout.stage == layout.pp_size - 1 and target.output_head is None:
            raise ValueError("the last stage has no output head.")
    except ValueError as err:
        error = str(err)
    if verify:
        signature = [
            layout.pp_size if layout else -1,
            layout.tp_size if layout else -1,
            layout.placement.draft_stage if layout else -1,
            vocab,
            layout.hidden if layout else -1,
            int(tied),
        ]
        _agree(error, signature, what, device)
    elif error is not None:
        raise ValueError(f"{what}: {error}")

    stage, pp, d = layout.stage, layout.pp_size, layout.placement.draft_stage
    last = pp - 1
    shard = (vocab // layout.tp_size, layout.hidden)
    dtype = target.model.config.params_dtype
    tp_group = parallel_state.get_tensor_model_parallel_group()
    embedding = head = None
    # ---- the input embedding: first stage -> draft's stage
    if d != 0:
        if stage == 0:
            _send(target.embedding.weight.detach(), d)
        elif stage == d:
            weight = _recv(shard, dtype, device, 0)
            embedding = VocabParallelEmbedding(
                vocab, layout.hidden, init_method=nn.init.zeros_, config=_copy_config(target, layout.tp_size),
                tp_group=tp_group,
            )
            embedding.weight = _frozen(weight)
            embedding.eval()
    elif stage == d:
        embedding = target.embedding
    # ---- the output layer: last stage -> draft's stage
    if d != last:
        if stage == last:
            source = target.output_head
            cap = source.final_logit_softcapping
            meta = torch.tensor(
                [float(source.output_multiplier), float("nan") if cap is None else float(cap)],
                dtype=torch.float64, device=device,
            )
            _send(meta, d)
            if not tied:
                weight = source.weight if source.weight is not None else source.layer.weight
                _send(weight.detach(), d)
        elif stage == d:
            meta = _recv((2,), torch.float64, device, last).tolist()
            if tied:
                weight = embedding.weight
            else:
                weight = _frozen(_recv(shard, dtype, device, last))
            layer = ColumnParallelLinear(
                layout.hidden, vocab, config=_copy_config(target, layout.tp_size), init_method=nn.init.zeros_,
                bias=False, gather_output=False, skip_weight_param_allocation=True, tp_group=tp_group,
            )
            layer.eval()
            head = OutputHead(
                layer=layer,
                vocab_size=target.vocab_size,
                tp_group=tp_group,
                output_multiplier=meta[0],
                final_logit_softcapping=None if meta[1] != meta[1] else meta[1],
                weight=weight,
            )
    elif stage == d:
        head = target.output_head
    return embedding, head
