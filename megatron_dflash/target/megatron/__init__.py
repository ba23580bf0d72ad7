"""The megatron backend of the frozen target (docs/design.md §13 Parallelism, §17 Target families).

Owns: HF config -> megatron-core config and layer specs (`config`), HF -> megatron weights of one rank
(`weights`), the frozen ``GPTModel`` stage that captures taps (`model`) and the forward-only pipeline that
routes taps to the draft's stage (`pipeline`).
May import: what the `target` stage may (`common`, `data`, `plan`, `draft`) and the target's shared modules
(`target.taps`, `target.head`, `target.masks`, `target.families`); nothing outside this folder imports it
except `training` (and the command lines and tests).
"""
