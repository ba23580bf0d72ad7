"""Kimi K3 targets in one process, on NeMo AutoModel's K3 model code (docs/design.md §17 Target families).

transformers has no Kimi K3 model; NeMo AutoModel (``nemo-automodel``, an optional dependency) does:
``KimiK3ForCausalLM``, a hybrid of KDA linear-attention and gated multi-latent-attention (MLA, NoPE) layers with
SiTU MLPs, a latent mixture of experts and learned attention residuals. `load_kimi_k3_target` builds it from a
HF checkpoint directory in the released layout (``KimiK3ForConditionalGeneration`` with a ``text_config``, text
weights under ``language_model.``, experts split per expert; or a text-only ``KimiK3ForCausalLM``), text
backbone only: the vision tower is never built, DFlash taps the text decoder.

The loaded model speaks the part of the causal-LM interface `target.taps.HFTarget` uses: ``config`` (the text
config), ``model.layers`` (a ``ModuleDict`` keyed by layer index), ``model(input_ids, ...)`` returning the
final-norm hidden states ``[B, S, H]``, ``get_input_embeddings()``, ``get_output_embeddings()``. With attention
residuals (``attn_res_block_size``) a decoder layer returns ``(hidden, block_residual)``; its tap is
``hidden`` (the layer's output stream), as NeMo AutoModel's DFlash target takes it.

`build_tiny_kimi_k3_target` writes a small randomly initialised K3 target in the released layout, for tests
and for trying the K3 path on a CPU. Its decoder layers are all MLA: K3's KDA layers run on
flash-linear-attention's Triton kernels (CUDA only), so a CPU build leaves them out (``kda_layers`` adds them
where those kernels run).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional, Sequence

import torch

from ..common.safetensors_files import target_safetensors_files
from ..draft.config import resolve_text_config

__all__ = ["KIMI_K3_INSTALL_HINT", "kimi_k3_available", "load_kimi_k3_target", "build_tiny_kimi_k3_target"]

KIMI_K3_INSTALL_HINT = "pip install --no-deps nemo-automodel==0.7.0"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _reference():
    """The K3 classes of NeMo AutoModel, or an ImportError that says how to install them."""
    try:
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.kimi_k3.config import KimiK3Config, KimiK3TextConfig
        from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM
    except ImportError as err:
        raise ImportError(
            f"Kimi K3 targets run on NeMo AutoModel's K3 model code, which is not importable here ({err}); install "
            f"it with `{KIMI_K3_INSTALL_HINT}`."
        ) from None
    return BackendConfig, KimiK3Config, KimiK3TextConfig, KimiK3ForCausalLM


def kimi_k3_available() -> bool:
    try:
        _reference()
    except ImportError:
        return False
    return True


def _backend(BackendConfig):
    # Plain torch everywhere: linears, fp32-variance RMSNorm, grouped experts by matmul, no token dispatcher
    # (one process). MLA layers pick their attention themselves; the HF state-dict adapter maps the
    # checkpoint's names (language_model., block_sparse_moe, w1/w2/w3 experts) onto the model's.
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False, experts="torch_mm",
                         dispatcher="torch", enable_hf_state_dict_adapter=True)


def _text_config(KimiK3TextConfig, data: dict, dtype: Optional[torch.dtype]):
    text = dict(resolve_text_config(data))
    for key in ("architectures", "model_type", "transformers_version", "auto_map"):
        text.pop(key, None)
    if dtype is not None:
        text["torch_dtype"] = _DTYPE_NAMES[dtype]
    return KimiK3TextConfig(**text)


def load_kimi_k3_target(directory: str, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The text causal LM of a K3 checkpoint directory, weights loaded, in eval mode.

    Args:
        directory: holds ``config.json`` (``KimiK3ForConditionalGeneration`` with ``text_config``, or a text
            config) and ``model.safetensors`` (or an index of shards) in the released K3 layout.
        dtype: parameter dtype (default: the checkpoint's ``torch_dtype``).

    Raises:
        ImportError: NeMo AutoModel is not installed (the message says how to install it).
        ValueError: the weights do not match the config (names missing or unexpected).
    """
    BackendConfig, _, KimiK3TextConfig, KimiK3ForCausalLM = _reference()
    from safetensors.torch import load_file


    with open(os.path.join(directory, "config.json")) as f:
        data = json.load(f)
    config = _text_config(KimiK3TextConfig, data, dtype)
    model = KimiK3ForCausalLM(config, backend=_backend(BackendConfig))
    hf_state: dict[str, torch.Tensor] = {}
    for path in target_safetensors_files(directory):
        # Text weights only: the vision tower and projector of a multimodal checkpoint are never built.
        hf_state.update({k: v for k, v in load_file(path).items() if not k.startswith(("vision_tower.", "mm_projector."))})
    native = model.state_dict_adapter.from_hf(hf_state)
    result = model.load_state_dict(native, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{directory}: the K3 weights do not match its config.json (missing {sorted(result.missing_keys)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]})."
        )
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def build_tiny_kimi_k3_target(
    directory: str,
    *,
    tokenizer_dir: str,
    vocab_size: int,
    seed: int = 0,
    num_hidden_layers: int = 6,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    kda_layers: Sequence[int] = (),
    num_experts: Optional[int] = 4,
    attn_res_block_size: Optional[int] = 2,
    **text_overrides: Any,
) -> str:
    """Write a randomly initialised K3 target (fp32) in the released checkpoint layout; returns ``directory``.

    The text config keeps K3's structure at toy sizes: gated MLA with a low-rank query and a compressed KV
    latent (NoPE), one dense first layer then latent-MoE layers with a shared expert and sigmoid routing,
    SiTU MLPs, attention residuals over blocks of ``attn_res_block_size`` layers. ``kda_layers`` (1-based, as
    K3's ``linear_attn_config`` counts) are KDA layers; they need flash-linear-attention's CUDA kernels.
    The tokenizer files of ``tokenizer_dir`` are copied; ``vocab_size`` must cover its ids.
    """
    BackendConfig, KimiK3Config, KimiK3TextConfig, KimiK3ForCausalLM = _reference()
    from safetensors.torch import save_file

    kda = sorted(int(i) for i in kda_layers)
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 4, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, linear_attn_config={"head_dim": 16, "num_heads": num_attention_heads,
                                           "short_conv_kernel_size": 4, "kda_layers": kda,
                                           "full_attn_layers": [i for i in range(1, num_hidden_layers + 1)
                                                                if i not in kda],
                                           "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        num_experts=num_experts, num_experts_per_token=2 if num_experts else None, num_shared_experts=1,
        moe_intermediate_size=hidden_size // 2, routed_expert_hidden_size=hidden_size // 2, first_k_dense_replace=1,
        attn_res_block_size=attn_res_block_size, max_position_embeddings=512, torch_dtype="float32",
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    text.update(text_overrides)
    tokenizer_config = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config) as f:
            tok = json.load(f)
        # K3's config carries token ids; the tokenizer's own eos / pad are what generation stops and pads with.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(tokenizer) > vocab_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens.")
        if tok.get("eos_token") is not None:
            text["eos_token_id"] = int(tokenizer.eos_token_id)
        if tokenizer.pad_token_id is not None:
            text["pad_token_id"] = int(tokenizer.pad_token_id)
    text_config = KimiK3TextConfig(**text)
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(text_config, backend=_backend(BackendConfig))
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    hf_state = {k: v.detach().contiguous() for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}

    os.makedirs(directory, exist_ok=True)
    wrapper = KimiK3Config(text_config=text_config.to_dict(), vision_config={"text_hidden_size": hidden_size},
                           architectures=["KimiK3ForConditionalGeneration"])
    data = wrapper.to_dict()
    data["architectures"] = ["KimiK3ForConditionalGeneration"]
    data["text_config"]["architectures"] = ["KimiK3ForCausalLM"]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(hf_state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        source = os.path.join(tokenizer_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(directory, name))
    return directory
