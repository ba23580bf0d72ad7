"""Test-only patches that let megatron-core's ``GPTModel`` run on gloo CPU ranks.

Products never import this module: on a GPU launch none of it is needed. Three spots in
megatron-core 0.16 assume CUDA:

* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``;
* ``DotProductAttention`` forks the CUDA RNG tracker around (zero-probability) attention dropout;
* ``get_default_causal_mask`` (used when ``attention_mask=None``) builds the mask with ``device="cuda"``:
  tests pass `causal_mask(S)` explicitly instead.

For mixture-of-experts layers, megatron's all-to-all token dispatcher creates a CUDA stream at construction
and copies its split sizes device -> host on it (``_maybe_dtoh_and_synchronize``); on the CPU the split sizes
already live on the host, so the stream is a placeholder and the copy becomes the tensor -> numpy conversion
the GPU path ends with (the all-to-all wants sequences of ints). And without Transformer
Engine, megatron 0.16's router gating (``moe_utils.router_gating_linear``) reads the name ``te_general_gemm``
that only a successful TE import defines: it is set to None, megatron's own "no TE" value, so the router
takes its ``torch.mm`` path. Likewise ``multi_latent_attention`` believes TE is there (its import of megatron's TE
extension succeeds with placeholder classes) and asks ``isinstance(..., TELinear)`` of a placeholder: inside the
block its ``HAVE_TE`` is False, which is the truth on this machine.

Expert tensor parallelism gathers and reduce-scatters tokens in **uneven** pieces (each rank routes a different
number of tokens to its experts). NCCL takes uneven ``all_gather``/``reduce_scatter`` lists; gloo does not, so
inside the block the uneven case of ``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
is done with equal-sized collectives (pad to the largest piece and trim; all-reduce and slice).

One more, only for tied embeddings under pipeline parallelism: ``setup_embeddings_and_output_layer``
moves the last stage's copy of the embedding to CUDA for an all-reduce over the embedding group. The
converter loads that copy from the checkpoint anyway, so `patched(skip_embedding_group_sync=True)` skips it.

Use ``with patched(): ...`` around building and running the model; everything is restored on exit.
"""

from __future__ import annotations

import contextlib

import torch


def causal_mask(seq_length: int, device="cpu") -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True = masked (megatron's convention): the causal mask megatron builds on CUDA."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)[None, None]


def _host_split_sizes(self, point, tokens_per_expert=None):
    """CPU stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: split sizes as numpy."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.numpy())
    return tokens_per_expert


def _uneven_gather(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)], dim=0)

    return gather


def _uneven_reduce_scatter(original):
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes), dim=0)[group.rank()].contiguous()

    return reduce_scatter


@contextlib.contextmanager
def patched(skip_embedding_group_sync: bool = False):
    """Make megatron's GPTModel build and run on CPU inside the block; restore everything afterwards."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as alltoall

    saved_device = torch.cuda.current_device
    mp_random.initialize_rng_tracker()
    tracker = mp_random.get_cuda_rng_tracker()
    had_fork = "fork" in vars(tracker)
    saved_fork = vars(tracker).get("fork")
    saved_embd = LanguageModule._is_in_embd_group
    from megatron.core.transformer.moe import moe_utils

    saved_stream, saved_dtoh = alltoall.cuda_dtoh_stream, alltoall._maybe_dtoh_and_synchronize
    from megatron.core.tensor_parallel import mappings

    saved_gather, saved_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = _uneven_gather(saved_gather)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(saved_scatter)
    from megatron.core.transformer import multi_latent_attention as mla

    saved_mla_te = mla.HAVE_TE
    mla.HAVE_TE = False
    define_gemm = not hasattr(moe_utils, "te_general_gemm")
    if define_gemm:
        moe_utils.te_general_gemm = None
    alltoall.cuda_dtoh_stream = object()  # not None: __init__ creates no CUDA stream
    alltoall._maybe_dtoh_and_synchronize = _host_split_sizes
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    if skip_embedding_group_sync:
        LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        if had_fork:
            tracker.fork = saved_fork
        else:
            del tracker.fork
        LanguageModule._is_in_embd_group = saved_embd
        alltoall.cuda_dtoh_stream, alltoall._maybe_dtoh_and_synchronize = saved_stream, saved_dtoh
        if define_gemm:
            del moe_utils.te_general_gemm
        mla.HAVE_TE = saved_mla_te
        mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = saved_gather, saved_scatter
