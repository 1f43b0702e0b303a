"""Whether the Hugging Face hub can be reached, and a cache-only mode for when it cannot.

huggingface_hub and datasets retry an unreachable hub for ~25 s per file, printing a line per
retry; moetool asks once, with a short TCP probe, and otherwise reads their caches only.

    if not hub_reachable():
        with cache_only():
            AutoConfig.from_pretrained("org/name")  # the local cache, or a fast failure
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_by_environment() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE") for k in OFFLINE_VARS)


def hub_reachable() -> bool:
    """False when the environment says offline or a TCP connection to the hub fails within seconds."""
    return not offline_by_environment() and _probe()


@lru_cache(maxsize=1)
def _probe() -> bool:
    """One TCP connection to the hub's endpoint (asked once per process)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
            reached.append(True)
        except OSError:
            pass

    # A thread, because name resolution has no timeout of its own.
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S)
    return bool(reached)


def _flags() -> list[tuple[object, str]]:
    """(module, attribute) of every offline switch: huggingface_hub's and, where installed, datasets'.
    Both read HF_*_OFFLINE once, at import, so setting the environment later would change nothing."""
    import huggingface_hub.constants as hub

    flags = [(hub, "HF_HUB_OFFLINE")]
    try:
        import datasets.config as ds
    except ImportError:
        return flags
    return flags + [(ds, "HF_HUB_OFFLINE"), (ds, "HF_DATASETS_OFFLINE")]


@contextmanager
def cache_only() -> Iterator[None]:
    """Read only the local caches inside the block, as HF_*_OFFLINE=1 would."""
    flags = _flags()
    saved = [getattr(m, a) for m, a in flags]
    for m, a in flags:
        setattr(m, a, True)
    try:
        yield
    finally:
        for (m, a), v in zip(flags, saved):
            setattr(m, a, v)


def cache_only_if_unreachable(what: str) -> None:
    """Before `what` (a hub id) is loaded: if the hub cannot be reached, read only the caches from now
    on in this process, so a missing file fails at once instead of after a minute of retries."""
    if not hub_reachable():
        for m, a in _flags():
            setattr(m, a, True)
