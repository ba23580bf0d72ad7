"""The frozen target as the training step uses it (`FrozenTarget`): taps (and the final hidden state) of a
batch, the input embedding and the output head, from a HF model or megatron's `GPTModel`, one pipeline stage
of it under pipeline parallelism (docs/design.md §13 Parallelism).

`load_hf_model` loads a target causal LM in one process, as its family says (also for the final decode
evaluation when the target trained through megatron).
"""

from __future__ import annotations

import torch

from ..common.parallel import ProcessGroups
from ..data.batching import real_length, trim_batch
from ..target.families import resolve_target_family, target_architecture
from ..target.masks import causal_mask, document_mask, hf_document_mask
from ..target.megatron.model import MegatronTarget
from ..target.megatron.pipeline import copy_frozen_target_heads, resolve_draft_stage, run_target_pipeline
from ..target.taps import HFTarget, concat_taps
from .job import Job

__all__ = ["FrozenTarget", "load_hf_model", "needs_final_hidden", "TRIM_MULTIPLE"]

# The target runs on the columns up to its batch's longest real row, rounded up to a multiple of this (times the
# TP size under sequence parallelism, whose shards split the sequence): few distinct shapes, tensor-core friendly.
TRIM_MULTIPLE = 16


def needs_final_hidden(job: Job) -> bool:
    """Whether a loss of this run reads the target's final hidden state (the variant's, or a soft target)."""
    return bool(job.variant.needs_final_hidden) or job.args.dflash_soft_target != "none"


class FrozenTarget:
    """The frozen target as the loop uses it: `taps(batch)`, `embedding`, `head`, `hf_model`.

    Under pipeline parallelism (`--pipeline-model-parallel-size > 1`, megatron backend) every rank holds
    its own stage of the target; `placement` says which stage holds the draft (`is_draft`), and only
    there are `embedding` and `head` set (frozen copies of the first / last stage's, see `target/pipeline.py`).
    `__call__` is then collective over the pipeline and returns None off the draft's stage.
    """

    def __init__(self, job: Job, device: torch.device, dtype: torch.dtype, groups: ProcessGroups):
        self.groups = groups
        self.backend = job.args.target_backend
        self.device = device
        self.pack = job.args.pack_sequences
        self.hf_model = None
        self.placement = None
        self.is_draft = True
        self.need_final_hidden = needs_final_hidden(job)
        if self.backend == "hf":
            self.hf_model = load_hf_model(job, dtype).to(device)
            self.module = HFTarget.from_config(self.hf_model, job.draft_config)
        else:
            self.module = MegatronTarget.from_pretrained(job.target_dir, config=job.draft_config, params_dtype=dtype,
                                                         sequence_parallel=job.args.sequence_parallel, groups=groups)
            if device.type == "cuda":
                self.module.cuda()
        self.dtype = dtype
        sp = self.backend == "megatron" and job.args.sequence_parallel
        self.trim_multiple = TRIM_MULTIPLE * (job.tp if sp else 1)
        if job.pp > 1:
            self.placement = resolve_draft_stage(job.args.dflash_pipeline_stage, job.pp)
            self.embedding, self.head = copy_frozen_target_heads(self.module, self.placement,  # every rank
                                                                 groups=groups)
            self.is_draft = self.placement.holds_draft(groups.pp_rank)
            return
        self.embedding = self.module.embedding
        self.head = self.module.output_head

    def before_step(self, iteration: int) -> None:
        """Called by the loop before every optimizer step; the online target has nothing to do (the hybrid cache
        target completes its cache there, `training.target_cache.HybridTarget`)."""

    @torch.no_grad()
    def __call__(self, batch: dict):
        """``(taps [B, S, T*H], final_hidden [B, S, H] or None)`` of ``batch`` (None off the draft's stage).

        The target runs on real tokens only: on the batch cut after its longest real row (`trim_batch`), the
        states then padded back to ``S`` with zeros, as `training.target_cache.CachedTarget` rebuilds rows. A
        causal target's states at a real position do not depend on the padding after it, and no context
        position of the draft reads the padding's (docs/design.md §8 Data path, "Real tokens only")."""
        S = batch["tokens"].shape[1]
        length = real_length(batch["document_ids"], self.trim_multiple)
        out = self._run(trim_batch(batch, length) if length < S else batch)
        if out is None or length == S:
            return out
        pad = lambda t: None if t is None else torch.nn.functional.pad(t, (0, 0, 0, S - length))  # noqa: E731
        return pad(out[0]), pad(out[1])

    def _run(self, batch: dict):
        tokens = batch["tokens"]
        positions = batch["position_ids"]
        B, S = tokens.shape
        if self.backend == "hf":
            mask = None
            if self.pack:
                mask = hf_document_mask(batch["document_ids"], self.dtype)
            out = self.module(tokens, attention_mask=mask, position_ids=positions,
                              need_final_hidden=self.need_final_hidden)
            return out.taps, out.final_hidden
        # megatron: True = masked. Explicit masks on CPU (megatron builds its default on CUDA only).
        if self.pack:
            mask = document_mask(batch["document_ids"])
        elif tokens.is_cuda:
            mask = None
        else:
            mask = causal_mask(S, tokens.device)
        if self.placement is not None:
            out = run_target_pipeline(self.module, batch, draft_stage=self.placement, attention_mask=mask,
                                      need_final_hidden=self.need_final_hidden, groups=self.groups)
            return None if out is None else (out.taps, out.final_hidden)
        out = self.module(tokens, attention_mask=mask, position_ids=positions, need_final_hidden=self.need_final_hidden)

        return concat_taps(out.taps, self.module.target_layer_ids), out.final_hidden


def load_hf_model(job: Job, dtype: torch.dtype):
    """The target causal LM in one process, loaded as its family says (`target.families.TargetFamily.loader`)."""

    family = job.target_family or resolve_target_family(job.target_config)
    model = family.loader(target_architecture(job.target_config))(job.target_dir, dtype)
    model.eval()
    return model
