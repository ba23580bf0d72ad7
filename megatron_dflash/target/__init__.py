"""The frozen target: its taps, its output head, its families and backends (docs/design.md §9, §17).

Owns: the HF and megatron targets (`model`), the target families and their draft families (`families`),
the Kimi K3 target (`kimi_k3`), the HF -> megatron weight plan (`weights`), the forward-only pipeline
(`pipeline`) and the output head the objectives and decoding borrow (`head`).
May import: `common`, `data`, `plan`, `draft` (a target family names its draft family's config).
"""
