"""A tiny random-weight Llama target written as a GGUF file, the way llama.cpp lays one out: the conversion
path of a real GGUF (`recipes/gguf_target.py`) without its 98 MB.

`tiny_llama_gguf(path)` writes the file and returns the random `LlamaForCausalLM` it was written from: tied
embeddings, 3 KV heads (a TP size must divide 3), a byte-level BPE tokenizer trained here on a few English
lines with ChatML's special tokens, and a chat template with a default system turn.
"""

from __future__ import annotations

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos / pad
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a small test assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea and the wind.",
    "How do I sort a list in Python? Use sorted(items) or items.sort().",
    "Explain why the sky is blue in two sentences.",
    "You are a helpful assistant. Answer the question below.",
]


def bpe_vocabulary(vocab_size: int = 320) -> tuple[list, list]:
    """(tokens by id, merges as "a b" strings) of a byte-level BPE trained on a few English lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_LINES * 20, trainer=trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = __import__("json").loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2):
    """A random fp32 `LlamaForCausalLM`: hidden 96, 6 heads / 3 KV heads, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a query / key projection (rotary pairs interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model) -> dict:
    """{GGUF name: fp32 array} of a `LlamaForCausalLM` (no `output.weight`: tied)."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = _llama_cpp_permute(w, c.num_attention_heads)
            elif gguf_name == "attn_k":
                w = _llama_cpp_permute(w, c.num_key_value_heads)
            out[f"blk.{i}.{gguf_name}.weight"] = w
    return out


def write_llama_gguf(path: str, model, tokens: list, merges: list, quant: str = "F32") -> None:
    """Write `model` and the BPE vocabulary as a llama GGUF; matrices in `quant` (`F32`, `Q8_0`, `Q4_1`),
    norms in F32 (as llama.cpp keeps them)."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, w in _gguf_tensors(model).items():
        if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_gguf(path: str, quant: str = "F32", seed: int = 0):
    """Write a tiny random Llama target to `path` as a GGUF; returns the model it was written from."""
    tokens, merges = bpe_vocabulary()
    model = tiny_llama(len(tokens), seed=seed)
    write_llama_gguf(path, model, tokens, merges, quant=quant)
    return model
