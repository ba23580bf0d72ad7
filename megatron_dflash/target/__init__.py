"""The frozen target: its taps, its output head, its families and backends (docs/design.md §9, §17).

Owns: the tap convention, the tap capture every target shares and the single-process HF target (`taps`), the
megatron target with its config, weights and forward-only pipeline (`megatron/`), the target families and
their draft families (`families`), the Kimi K3 target (`kimi_k3`), the attention masks (`masks`) and the
output head the objectives and decoding borrow (`head`).
May import: `common`, `data`, `plan`, `draft` (a target family names its draft family's config).
"""
