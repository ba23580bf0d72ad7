"""One way to name a model on every command line: a local HF directory or a hub id (`Qwen/Qwen3-8B`).

`resolve_model_dir(flag, name)` returns a local directory for either. A hub id is resolved once, here, to its
snapshot in the local Hugging Face cache (`huggingface_hub.snapshot_download`); every later step (the target's
config, its weights, the tokenizer, the manifests) then works on that directory and never asks the hub again.

* In the cache already (a snapshot for `refs/main`): returned without any request, online or not.
* Not in the cache, hub reachable: local rank 0 downloads it (the configs, safetensors weights, tokenizer and
  chat-template files: what the loaders read) while the other ranks of its node wait, then read the same cache.
  The job is resolved on every rank before any process group exists, so the wait is on a file that local rank
  0 writes when its download ended (with its result or its error line), as the embedded target's build does.
* Missing (neither a directory nor in the cache, and `HF_HUB_OFFLINE=1` or no network): one `UsageError` line,
  the same from every entry point, saying what was looked for, where the cache is and how to fill it.

Imports only the standard library at module level (`huggingface_hub` inside the functions), so a command line
is checked before torch loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from typing import Mapping, Optional

from .atomic import write_file
from .cli import UsageError, require_dir

__all__ = ["hub_cache_dir", "hub_offline", "looks_like_hub_id", "resolve_model_dir", "missing_model_message"]

# What a target or tokenizer directory needs (configs, safetensors weights, tokenizer files, chat templates);
# not PyTorch .bin / GGUF / the original checkpoints some repositories carry next to the HF ones.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
IGNORED_PATTERNS = ("original/*",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_cache_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """The hub cache huggingface_hub reads (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`),
    from `env` at call time (the library's own constants are fixed when it is first imported)."""
    env = os.environ if env is None else env
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.expanduser(os.path.expandvars(cache))


def hub_offline(env: Optional[Mapping[str, str]] = None) -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set: no request at all."""
    env = os.environ if env is None else env
    return (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def looks_like_hub_id(name: str) -> bool:
    """`org/model` as the hub spells it, and no existing path."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not os.path.exists(name)


def missing_model_message(flag: str, name: str, env: Optional[Mapping[str, str]] = None,
                          why: Optional[str] = None) -> str:
    """The one line every entry point prints for a model that is neither a directory nor in the cache."""
    cache = hub_cache_dir(env)
    why = why or ("HF_HUB_OFFLINE is set, so the hub was not asked" if hub_offline(env) else
                  "the hub could not be reached")
    return (f"{flag} {name}: no such directory, and no snapshot of the hub model {name} in the Hugging Face cache "
            f"{cache} ({why}); fill the cache on a machine with network with `hf download {name}` "
            f"(`huggingface-cli download {name}` before huggingface_hub 1.0) into the same HF_HOME / HF_HUB_CACHE, "
            "or pass a local directory.")


def _snapshot(name: str, cache: str, *, local_only: bool) -> str:
    """The snapshot directory of `name` (raises huggingface_hub's errors)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(name, cache_dir=cache, local_files_only=local_only,
                             allow_patterns=list(DOWNLOAD_PATTERNS), ignore_patterns=list(IGNORED_PATTERNS))


def _download(flag: str, name: str, env: Mapping[str, str], log) -> str:
    """Local rank 0's download; every failure becomes the one-line `UsageError`."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = hub_cache_dir(env)
    log(f"[hub] {name}: not in {cache}; downloading it once (the configs, safetensors weights and tokenizer)")
    try:
        return _snapshot(name, cache, local_only=False)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{flag} {name}: the hub has no model {name} this user may read ({first}); check the id, "
                         "log in (`hf auth login`) for a gated model, or pass a local directory.") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise UsageError(missing_model_message(flag, name, env, f"the hub could not be reached: "
                                               f"{type(err).__name__}")) from None


def _wait_file(name: str, env: Mapping[str, str]) -> str:
    """Where local rank 0 tells its node's other ranks how its download ended: one file per launch (the
    launcher's process, rendezvous and restart count name it) and model."""
    launch = [env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                       "TORCHELASTIC_RESTART_COUNT")]
    key = hashlib.sha256(json.dumps([name, hub_cache_dir(env), os.getppid(), *launch]).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"megatron-dflash-hub-{key}.json")


def _several_local_ranks(env: Mapping[str, str]) -> bool:
    return int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1 or str(env.get("LOCAL_RANK", "0")) != "0"


def _resolve_hub_id(flag: str, name: str, env: Mapping[str, str], log, wait_s: float) -> str:
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(env)
    try:
        return _snapshot(name, cache, local_only=True)  # never a request
    except (LocalEntryNotFoundError, OSError):
        pass
    if hub_offline(env):
        raise UsageError(missing_model_message(flag, name, env))
    wait_file = _wait_file(name, env)
    if str(env.get("LOCAL_RANK", "0")) == "0":
        try:
            path = _download(flag, name, env, log)
            outcome = {"path": path}
        except UsageError as err:
            outcome = {"error": str(err)}
        if _several_local_ranks(env):
            write_file(wait_file, json.dumps(outcome))
        if "error" in outcome:
            raise UsageError(outcome["error"])
        return outcome["path"]
    deadline = time.monotonic() + wait_s
    while not os.path.isfile(wait_file):
        if time.monotonic() > deadline:
            raise UsageError(f"{flag} {name}: timed out after {wait_s:.0f} s waiting for local rank 0 to download it "
                             f"into {cache}; fill the cache first (`hf download {name}`), then launch again.")
        time.sleep(1.0)
    with open(wait_file, encoding="utf-8") as f:
        outcome = json.load(f)
    if "error" in outcome:
        raise UsageError(outcome["error"])
    return _snapshot(name, cache, local_only=True)


def resolve_model_dir(flag: str, name: str, what: str = "HF model directory", must_contain: Optional[str] = "config.json",
                      *, env: Optional[Mapping[str, str]] = None, log=None, wait_s: float = 6 * 3600.0) -> str:
    """A local directory for `name` (a directory, or a hub id resolved through the local cache), checked to hold
    `must_contain`; raises `UsageError` (one line naming `flag`) otherwise. `log` (default: stderr) gets the one
    line said before a download."""
    env = os.environ if env is None else env
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if not looks_like_hub_id(name):  # a path (existing or not), checked as one
        require_dir(flag, name, what, must_contain=must_contain)
        return name
    path = _resolve_hub_id(flag, name, env, log, wait_s)
    if must_contain is not None and not os.path.exists(os.path.join(path, must_contain)):
        raise UsageError(f"{flag} {name}: its snapshot {path} has no {must_contain}; expected a {what} (download it "
                         f"whole: `hf download {name}`).")
    return path
