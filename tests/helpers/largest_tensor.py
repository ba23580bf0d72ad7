"""A dispatch mode that records the largest tensor the ops under it allocate: the tests' memory bound on
the loss kernel (never more than one chunk of logits)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestNewTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op allocates (views and in-place ops excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = []
        torch.utils._pytree.tree_map(lambda x: inputs.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
        input_storages = {x.untyped_storage().data_ptr() for x in inputs}

        def visit(x):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in input_storages:
                numel = x.untyped_storage().nbytes() // x.element_size()
                if numel > self.largest:
                    self.largest, self.op = numel, str(func)

        torch.utils._pytree.tree_map(visit, out)
        return out
