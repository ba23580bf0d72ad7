"""The D-PACE weights of one block from their definition, slot by slot (the oracle of the D-PACE tests)."""


def reference_block_weights(q: list, supervised: list, alpha: float, scheme: str) -> list:
    """The D-PACE weights of one block, from the definition, one slot at a time."""
    cumulative, running = [], 1.0
    for qi, sup in zip(q, supervised):
        running *= ((1.0 - alpha) * qi + alpha) if sup else 1.0
        cumulative.append(running)
    out = []
    for j, sup in enumerate(supervised):
        suffix = sum(cumulative[m] for m in range(j, len(q)) if supervised[m])
        value = {"dpace": suffix, "dpace-cumulative-confidence-only": cumulative[j],
                 "dpace-continuation-value-only": suffix / cumulative[j]}[scheme]
        out.append(value if sup else 0.0)
    return out
