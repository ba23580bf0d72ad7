"""A model named by a local directory or a hub id: read from a pre-filled hub cache without a request, downloaded
by local rank 0 only (the other local ranks wait and read the same cache), one line when it is missing.

No test reaches the network: the cache is filled on disk, and where a download is needed it is a stand-in for
huggingface_hub's `snapshot_download` (sockets refuse to connect throughout)."""

from __future__ import annotations

import os
import socket

import huggingface_hub
import pytest

from hub_cache import HUB_ID, fill_hub_cache, offline_hub_env
from megatron_dflash.common.cli import UsageError
from megatron_dflash.common.model_dirs import resolve_model_dir


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no network in the tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where local rank 0 leaves its word
    hub = str(tmp_path / "hub")
    os.makedirs(hub)
    for key, value in offline_hub_env(hub).items():
        monkeypatch.setenv(key, value)
    return hub


def test_a_hub_id_in_the_cache_is_its_snapshot_offline(cache):
    snapshot = fill_hub_cache(cache)
    assert resolve_model_dir("--target", HUB_ID) == snapshot
    assert resolve_model_dir("--tokenizer", HUB_ID, "tokenizer directory", must_contain=None) == snapshot


def test_a_hub_id_in_the_cache_needs_no_request_online_either(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    snapshot = fill_hub_cache(cache)

    def download(*args, **kwargs):
        assert kwargs.get("local_files_only"), "asked the hub for a model already in the cache"
        return real(*args, **kwargs)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve_model_dir("--target", HUB_ID) == snapshot


def test_a_missing_hub_id_is_one_line_naming_the_cache_and_how_to_fill_it(cache):
    with pytest.raises(UsageError) as err:
        resolve_model_dir("--target", "Org/Absent-8B")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--target Org/Absent-8B: ")
    assert cache in message and "HF_HUB_OFFLINE" in message
    assert "`hf download Org/Absent-8B`" in message and "local directory" in message


def test_local_directories_are_taken_as_they_are(tmp_path, cache):
    local = fill_hub_cache(cache)
    assert resolve_model_dir("--target", local) == local
    with pytest.raises(UsageError, match=r"--target /no/such/model: no such HF model directory"):
        resolve_model_dir("--target", "/no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json in it"):
        resolve_model_dir("--target", str(tmp_path / "empty"))


def _ranks_env(cache, local_rank: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # the hub is "reachable"
    return {**env, "HF_HUB_CACHE": cache, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(20000 + os.getpid() % 10000)}


def test_local_rank_zero_downloads_once_and_the_other_rank_reads_the_cache(cache, monkeypatch):
    downloads = []
    real = huggingface_hub.snapshot_download

    def download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        downloads.append(repo_id)
        return fill_hub_cache(kwargs["cache_dir"], repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    lines = []
    snapshot = resolve_model_dir("--target", HUB_ID, env=_ranks_env(cache, 0), log=lines.append)
    assert downloads == [HUB_ID] and len(lines) == 1 and HUB_ID in lines[0]
    # local rank 1 found the cache empty when it looked; it waits for rank 0's word, then reads the cache
    assert resolve_model_dir("--target", HUB_ID, env=_ranks_env(cache, 1), wait_s=5) == snapshot
    assert downloads == [HUB_ID]


def test_a_failed_download_is_the_same_line_on_every_local_rank(cache, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(repo_id, **kwargs):
        raise LocalEntryNotFoundError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    messages = []
    for rank in (0, 1):
        with pytest.raises(UsageError) as err:
            resolve_model_dir("--target", "Org/Unreachable", env=_ranks_env(cache, rank), log=lambda line: None,
                              wait_s=5)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "could not be reached" in messages[0] and cache in messages[0]
