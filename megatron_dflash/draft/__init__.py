"""The draft body: tensor-parallel decoder layers on megatron-core linears that return hidden states
(docs/design.md §3 Block attention, §16 Kimi K3 draft family).

Owns: the config (`config`), the shared body skeleton and the Qwen3-style body (`body`), its layers,
block attention, the gated MLP, RMSNorm, RoPE, the KV cache of decoding, how its tensors lie over TP
(`sharding`), and the Kimi K3 draft family (`kimi_k3/`).
May import: `common`, `plan`.
"""
