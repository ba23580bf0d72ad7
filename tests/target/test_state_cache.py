"""The target-state cache's format (`target/state_cache.py`): what a shard holds and gives back, the manifest's
comparison (the differing field named), an incomplete cache, a corrupt shard, a sample that is not there."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_dflash.target.state_cache import (
    CACHE_FORMAT_VERSION,
    CacheManifest,
    StateCacheError,
    StateCacheReader,
    publish_manifest,
    shard_ranges,
    write_index,
    write_shard,
)

MANIFEST = CacheManifest(CACHE_FORMAT_VERSION, "t" * 64, (1, 3), 8, True, "float32", 16, False, "d" * 64, 2,
                         {"train": 3, "valid": 0})


def states(seed: int, length: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 100, (length,), generator=gen), torch.randn(length, 16, generator=gen),
            torch.randn(length, 8, generator=gen))


@pytest.fixture
def cache(tmp_path):
    publish_manifest(str(tmp_path), MANIFEST)
    written = {11: states(0, 5), 12: states(1, 16), 13: states(2, 1)}
    write_shard(str(tmp_path), "train", 0, {11: written[11], 12: written[12]})
    write_shard(str(tmp_path), "train", 1, {13: written[13]})
    write_index(str(tmp_path), MANIFEST)
    return tmp_path, written


def test_a_cache_gives_back_every_sample_as_written(cache):
    directory, written = cache
    reader = StateCacheReader(str(directory), MANIFEST)
    for sample_id, expected in written.items():
        assert all(torch.equal(a, b) for a, b in zip(reader.sample(sample_id), expected))
    # a shard is a plain safetensors file: tensors only, named by the sample id
    assert sorted(load_file(str(directory / "train-00001.safetensors"))) == [
        "0000000000000000013.final", "0000000000000000013.input_ids", "0000000000000000013.taps"]
    assert shard_ranges(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(StateCacheError, match="sample 99 is not in the target-state cache"):
        reader.sample(99)


@pytest.mark.parametrize("field, value", [("target", "x" * 64), ("target_layer_ids", (1, 4)), ("hidden_size", 16),
                                          ("dtype", "bfloat16"), ("seq_length", 32), ("packing", True),
                                          ("data", "e" * 64), ("samples", {"train": 4, "valid": 0})])
def test_a_manifest_of_other_settings_is_refused_naming_the_field(cache, field, value):
    directory, _ = cache
    run = dataclasses.replace(MANIFEST, **{field: value})
    with pytest.raises(StateCacheError, match=rf"does not match this run \({field}: cache "):
        StateCacheReader(str(directory), run)
    with pytest.raises(StateCacheError, match=rf"\({field}: cache "):
        publish_manifest(str(directory), run)


def test_final_hidden_state_is_needed_only_where_a_loss_reads_it(cache, tmp_path_factory):
    directory, _ = cache
    StateCacheReader(str(directory), dataclasses.replace(MANIFEST, final_hidden=False))  # has more: fine
    bare = tmp_path_factory.mktemp("bare")
    publish_manifest(str(bare), dataclasses.replace(MANIFEST, final_hidden=False))
    with pytest.raises(StateCacheError, match=r"final_hidden: cache False, run True"):
        StateCacheReader(str(bare), MANIFEST)


def test_an_incomplete_or_absent_cache_is_refused(cache, tmp_path_factory):
    directory, _ = cache
    (directory / "index.json").unlink()
    with pytest.raises(StateCacheError, match="is incomplete .no index.json.; rerun tools/cache_target_states.py"):
        StateCacheReader(str(directory), MANIFEST)
    with pytest.raises(StateCacheError, match="holds no target-state cache"):
        StateCacheReader(str(tmp_path_factory.mktemp("empty")), MANIFEST)


def test_a_corrupt_shard_is_named(cache):
    directory, _ = cache
    shard = directory / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    reader = StateCacheReader(str(directory), MANIFEST)
    reader.sample(11)  # the other shard is intact
    with pytest.raises(StateCacheError, match="shard train-00001.safetensors .* is corrupt: its sha256 differs"):
        reader.sample(13)
    shard.write_bytes(b"\xff" * 16)  # a header that cannot be read
    with pytest.raises(StateCacheError, match="shard train-00001.safetensors .* is corrupt: its header"):
        StateCacheReader(str(directory), MANIFEST)
    assert json.loads((directory / "manifest.json").read_text())["format_version"] == CACHE_FORMAT_VERSION


def _replace_in_header(shard, old: bytes, new: bytes) -> None:
    """Rewrite bytes of a shard's header in place (same length: the header's size and the data stay)."""
    data = shard.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert len(old) == len(new) and old in data[:header_end]
    shard.write_bytes(data[:header_end].replace(old, new) + data[header_end:])


@pytest.mark.parametrize("new", [b"00000000000000000x3", b"0000000000000000019"])
def test_a_shard_with_a_corrupt_sample_key_is_named_at_reader_start(cache, new):
    """A sample key damaged in a shard's header (to a non-number, or to another sample's id) is named with its
    shard when the reader opens, not at the step that misses the sample."""
    directory, _ = cache
    _replace_in_header(directory / "train-00001.safetensors", b"0000000000000000013", new)
    with pytest.raises(StateCacheError, match=r"^shard train-00001.safetensors of the target-state cache .* is "
                                              r"corrupt: [^;]*; delete it and its index.json"):
        StateCacheReader(str(directory), MANIFEST)


def test_a_truncated_shard_is_named_at_reader_start(cache):
    directory, _ = cache
    shard = directory / "train-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(StateCacheError, match=r"shard train-00000.safetensors .* is corrupt: .*truncated"):
        StateCacheReader(str(directory), MANIFEST)


@pytest.mark.parametrize("index, why", [
    ("{not json", "not the index"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"shards": {"../outside/train-00000.safetensors": "' + "0" * 64 + '"}}', "outside"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
], ids=["not-json", "a-list", "outside", "nested"])
def test_an_index_that_is_not_this_caches_is_refused_in_one_line(cache, index, why):
    """index.json must be a JSON object naming exactly this cache's shards (so no file outside the directory is
    read): anything else is one line naming it, at reader start."""
    directory, _ = cache
    (directory / "index.json").write_text(index)
    with pytest.raises(StateCacheError) as err:
        StateCacheReader(str(directory), MANIFEST)
    message = str(err.value)
    assert message.startswith(f"{directory / 'index.json'} is not the index of this target-state cache (")
    assert why in message and "write the cache again" in message and "\n" not in message


@pytest.mark.parametrize("text, field", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ("[1]", "a JSON list, not an object"),
    (MANIFEST.to_json().replace('"shard_size": 2', '"shard_size": "2"'), "field shard_size is \"2\""),
    (MANIFEST.to_json().replace('"train": 3', '"train": -3'), "field samples is"),
], ids=["nested", "a-list", "a-string-count", "a-negative-count"])
def test_a_manifest_that_is_not_one_is_refused_in_one_line(cache, text, field):
    directory, _ = cache
    (directory / "manifest.json").write_text(text)
    with pytest.raises(StateCacheError, match=rf"manifest.json is not a target-state cache manifest \({field}"):
        StateCacheReader(str(directory), MANIFEST)
