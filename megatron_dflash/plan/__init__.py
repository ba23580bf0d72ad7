"""The batch plan: anchors, draft blocks, positions and the loss mask of a step (docs/design.md §5 The
batch plan and the anchor rule).

Owns: `build_dflash_batch_plan` / `DFlashBatchPlan` and the one-block plan of a decoding forward.
May import: `common`.
"""
