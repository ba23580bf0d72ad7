"""Test-only patches that let megatron-core's ``GPTModel`` run on gloo CPU ranks.

Products never import this module: on a GPU launch none of it is needed. Three spots in
megatron-core 0.16 assume CUDA:

* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``;
* ``DotProductAttention`` forks the CUDA RNG tracker around (zero-probability) attention dropout;
* ``get_default_causal_mask`` (used when ``attention_mask=None``) builds the mask with ``device="cuda"``:
  tests pass `causal_mask(S)` explicitly instead.

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


@contextlib.contextmanager
def patched(skip_embedding_group_sync: bool = False):
    """Make megatron's GPTModel build and run on CPU inside the block; restore everything afterwards."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as mp_random

    saved_device = torch.cuda.current_device
    mp_random.initialize_rng_tracker()
    tracker = mp_random.get_cuda_rng_tracker()
    had_fork = "fork" in vars(tracker)
    saved_fork = vars(tracker).get("fork")
    saved_embd = LanguageModule._is_in_embd_group
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
