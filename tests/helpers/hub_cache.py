"""A Hugging Face hub cache filled in advance, as `hf download` leaves it, holding the shipped tiny target under a
hub id: `models--ORG--NAME/refs/main` naming a revision and `snapshots/REV/` with the model's files. Tests read it
with `HF_HUB_OFFLINE=1`, so no request ever leaves the machine."""

from __future__ import annotations

import os
import shutil

from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

HUB_ID = "megatron-dflash/tiny-target"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache: str, hub_id: str = HUB_ID, source: str = SHIPPED_TARGET_DIR) -> str:
    """Put `source`'s files in the hub cache `cache` as `hub_id`'s main revision; returns the snapshot dir."""
    repo = os.path.join(cache, "models--" + hub_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    shutil.copytree(source, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    return snapshot


def offline_hub_env(cache: str) -> dict:
    """The environment variables that point huggingface_hub (and this package) at `cache`, offline."""
    return {"HF_HUB_CACHE": cache, "HF_HOME": os.path.join(os.path.dirname(cache), "hf-home"), "HF_HUB_OFFLINE": "1"}
