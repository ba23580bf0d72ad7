"""The batch plan: anchors, draft blocks, positions and the loss mask of a step (docs/design.md §5 The
batch plan and the anchor rule).

Owns: `build_dflash_batch_plan` / `DFlashBatchPlan`, the one-block plan of a decoding forward, and the data
hook that attaches a plan to a batch and checks that every rank built the same one (`data_hook`).
May import: `common`.
"""
