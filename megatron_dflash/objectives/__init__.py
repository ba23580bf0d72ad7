"""The losses and their metrics (docs/design.md §6 Objectives).

Owns: block tokens, labels and weights and the DFlash loss (`dflash_loss`), the one chunked vocab-parallel
loss kernel every variant uses (`head_loss`), DSpark's fused CE + L1 + confidence objective (`dspark_loss`),
and variable-prefix training (`variable_prefix`).
May import: `common`, `plan`, `draft`, `target` (the output head).
"""
