"""NeMo AutoModel's DFlash drafters as references: its modules (or a skip), its mask, and its drafters called
as its trainer calls them, on shared anchors.

`ANCHORS` / `SEQ`: two rows of four blocks of size 4 over 20 tokens (every anchor fits); `randomize` makes
every weight random so that no identity init hides a wrong tensor.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import pytest
import torch

from megatron_dflash.plan.batch_plan import DFlashBatchPlan

SEQ = 20
ANCHORS = torch.tensor([[2, 7, 12, 16], [5, 1, 15, 9]])  # block_size 4 fits: anchor <= 16


@contextlib.contextmanager
def _without_datasets():
    """NeMo AutoModel's package imports its data loaders, which import `datasets`; the modeling
    code never calls it. When `datasets` is absent an empty stand-in lets the import finish, and
    is removed again afterwards."""
    if importlib.util.find_spec("datasets") is not None:
        yield
        return

    class _Placeholder(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    sys.modules["datasets"] = _Placeholder("datasets")
    try:
        yield
    finally:
        sys.modules.pop("datasets", None)


def nemo(module: str):
    """`nemo_automodel.components.speculative.dflash.<module>`, or skip."""
    if importlib.util.find_spec("nemo_automodel") is None:
        pytest.skip("NeMo AutoModel (`nemo-automodel==0.7.0`) is not installed")
    with _without_datasets():
        return importlib.import_module(f"nemo_automodel.components.speculative.dflash.{module}")


def nemo_mask(plan: DFlashBatchPlan, *, causal: bool) -> torch.Tensor:
    from nemo_automodel.components.attention.dflash_mask import create_dflash_sdpa_mask

    return create_dflash_sdpa_mask(
        plan.anchor_positions, plan.block_valid, plan.seq_length, plan.block_size, torch.device("cpu"),
        torch.float32, causal=causal,
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight random (the identity inits of DFlash 2 and Domino would hide a wrong tensor),
    norm weights around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.1 * noise)


def training_forward(ref, taps, blocks, plan, *, causal: bool, **kwargs) -> torch.Tensor:
    """A NeMo drafter called as its trainer calls it: every block of a row in one forward over
    `[context | blocks]` with its dense mask. Returns `[B, N, W, H]`."""
    B, N, W, H = blocks.shape
    positions = torch.cat([torch.arange(SEQ).expand(B, SEQ), plan.position_ids.reshape(B, N * W)], dim=1)
    out = ref(
        position_ids=positions,
        attention_mask=nemo_mask(plan, causal=causal),
        noise_embedding=blocks.reshape(B, N * W, H),
        target_hidden=taps,
        **kwargs,
    )
    return out.reshape(B, N, W, H)
