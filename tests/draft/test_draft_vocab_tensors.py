"""A reduced draft vocabulary's tensors as a file holds them (docs/design.md §20): every loader refuses, in one line
naming the directory, the tensor and the entry, a ``d2t`` / ``t2d`` that breaks the serving layout (wrong dtype or
shape, target ids out of range, repeated or out of order, a mask that disagrees with the offsets or with the
config's sizes), before any weight is copied; a good file loads as before."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron
from megatron_dflash.checkpoint.hf import load_hf_checkpoint, read_safetensors, save_hf_checkpoint
from megatron_dflash.common.errors import CheckpointError
from megatron_dflash.draft.draft_vocab import DraftVocabulary
from tiny_decoding import make_draft

VOCAB, IDS = 40, [1, 2, 5, 39]


def _with_d2t(targets, t2d=None) -> dict:
    """The tensors to write over the export's: ``d2t`` mapping draft id i to ``targets[i]``; ``t2d`` dropped
    unless given."""
    return {"d2t": torch.tensor([t - i for i, t in enumerate(targets)]), "t2d": t2d}


def _mask(ids, size=VOCAB, dtype=torch.bool):
    mask = torch.zeros(size, dtype=dtype)
    mask[torch.tensor(ids)] = 1
    return mask


BROKEN = {  # name: (the tensors written over the export's, None: removed; what the one line says)
    "out-of-order": (_with_d2t([1, 5, 2, 39]), "d2t[2] = 0: draft id 2's target id (i + d2t[i]) is 2, below entry 1's 5"),
    "out-of-range": (_with_d2t([1, 2, 5, 40]), "d2t[3] = 37: draft id 3's target id (i + d2t[i]) is 40, outside [0, 40)"),
    "negative": (_with_d2t([-1, 2, 5, 39]), "d2t[0] = -1: draft id 0's target id (i + d2t[i]) is -1, outside"),
    "repeated": (_with_d2t([1, 2, 2, 39]), "is 2, like entry 1: that maps two draft ids to the same target id"),
    "float-d2t": ({"d2t": torch.tensor([1.0, 1.0, 3.0, 36.0]), "t2d": None}, "d2t has dtype float32 and shape [4]"),
    "bool-d2t": ({"d2t": torch.tensor([True, False, True, True]), "t2d": None}, "d2t has dtype bool and shape [4]"),
    "2-d-d2t": ({"d2t": torch.tensor([[1, 1], [3, 36]]), "t2d": None}, "d2t has dtype int64 and shape [2, 2]"),
    "short-t2d": ({"t2d": _mask(IDS[:3], VOCAB - 1)}, "t2d has 39 entries; vocab_size is 40"),
    "float-t2d": ({"t2d": _mask(IDS, dtype=torch.float32)}, "t2d has dtype float32 and shape [40]"),
    "t2d-disagrees": ({"t2d": _mask(IDS + [7])}, "t2d marks target id 7, which d2t does not map to"),
    "t2d-only-too-many": ({"d2t": None, "t2d": _mask(IDS + [7])}, "t2d marks 5 target ids, but the config's "
                                                                 "draft_vocab_size is 4"),
}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A reduced-vocabulary draft's HF export (``d2t`` and ``t2d`` of ``IDS``) and its tensors."""
    draft = make_draft(VOCAB, draft_vocab_size=len(IDS))
    with torch.no_grad():
        draft.d2t.copy_(DraftVocabulary.from_ids(IDS, VOCAB).d2t)
    directory = tmp_path_factory.mktemp("export") / "hf"
    save_hf_checkpoint(draft, str(directory))
    return directory, read_safetensors(str(directory))


def _broken_copy(export, tmp_path, change):
    directory, tensors = export
    out = tmp_path / "broken"
    out.mkdir(parents=True)
    (out / "config.json").write_text((directory / "config.json").read_text())
    tensors = dict(tensors)
    for name, tensor in change.items():
        if tensor is None:
            tensors.pop(name, None)
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_d2t_or_t2d_is_refused_by_every_loader_in_one_line(export, tmp_path, case):
    change, said = BROKEN[case]
    broken = _broken_copy(export, tmp_path, change)
    for load in (lambda: load_hf_checkpoint(str(broken)),
                 lambda: convert_hf_to_megatron(str(broken), str(tmp_path / "megatron"))):
        with pytest.raises(CheckpointError) as refused:
            load()
        message = str(refused.value)
        assert message.startswith(f"{broken}: ") and said in message and "\n" not in message, message
    assert not (tmp_path / "megatron").exists()


def test_a_good_file_loads_with_or_without_either_tensor(export, tmp_path):
    for n, change in enumerate(({}, {"t2d": None}, {"d2t": None}, {"t2d": _mask(IDS, dtype=torch.uint8)})):
        directory = _broken_copy(export, tmp_path / str(n), change)
        assert load_hf_checkpoint(str(directory)).d2t.tolist() == [t - i for i, t in enumerate(IDS)]
