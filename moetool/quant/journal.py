"""The resume journal of an unfinished bundle: which layers' shards `quantize` has finished, each
with its sha256, and what it was quantizing (the model, its weights' fingerprint, the settings).

A run with the same identity continues from the shards that still hash right. One whose weights'
fingerprint alone changed (a checkpoint repaired after a refusal) starts over, and says so. One
with other settings or another model is refused while finished layers are there: a forgotten option
on a resume threw hours of work away without a word.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moetool.artifacts import atomic_write_bytes, read_json, sha256_file
from moetool.errors import MoetoolError
from moetool.quant.bundle import Entry
from moetool.quant.shards import Shard
from moetool.schema import build

JOURNAL = ".quantize-journal.json"
SHARD_NAME = re.compile(r"layer-\d{3,}\.safetensors")


def identity_sha256(identity: dict[str, Any]) -> str:
    """The digest a bundle records as `settings_sha256`: of the model type, config, settings and weights."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class Journal:
    """The shards an unfinished run has completed: layer -> (Shard, entries), kept only while the
    identity matches and the shard still hashes to what was recorded. The caller holds the
    directory's lock, so every shard-named file in it is quantize's own."""

    def __init__(self, out: Path, identity: dict[str, Any], note: Callable[[str], None] | None = None):
        self.path, self.identity, self.settings_sha = out / JOURNAL, identity, identity_sha256(identity)
        self.done: dict[int, tuple[Shard, list[Entry]]] = {}
        records, was = {}, None
        if self.path.exists():
            try:
                data = read_json(self.path)  # a regular file of bounded size: a FIFO here is not our journal
                records = {int(k): (build(Shard, v["shard"]), build(list[Entry], v["entries"]))
                           for k, v in data["layers"].items()}
                was = data.get("identity"), data["settings_sha256"]
            except (MoetoolError, ValueError, KeyError, TypeError, AttributeError):  # SchemaError is a ValueError
                records, was = {}, None
        on_disk = {layer: r for layer, r in records.items()
                   if SHARD_NAME.fullmatch(r[0].name) and (out / r[0].name).is_file()}
        if was is not None and was[1] != self.settings_sha and on_disk:
            self._other(out, was[0], len(on_disk), note)
        elif was is not None:
            self.done = {layer: r for layer, r in on_disk.items() if sha256_file(out / r[0].name) == r[0].sha256}
        # A shard whose journal entry was never saved (a signal between its rename and the journal's
        # write), or one of a run started over: no bundle may hold a shard its manifest does not list.
        kept = {shard.name for shard, _ in self.done.values()}
        for path in out.iterdir():
            if SHARD_NAME.fullmatch(path.name) and path.name not in kept:
                path.unlink(missing_ok=True)
        self._save()  # at once, even empty: it is what marks the directory as an unfinished bundle of ours

    def _other(self, out: Path, was: Any, finished: int, note: Callable[[str], None] | None) -> None:
        """Finished layers made for another identity: refused, unless only the weights changed."""
        now = self.identity
        was = was if isinstance(was, dict) else {}
        changed = [f"{k} {was['settings'].get(k)!r} -> {now['settings'].get(k)!r}"
                   for k in sorted(set(now["settings"]) | set(was.get("settings") or {}))
                   if isinstance(was.get("settings"), dict) and was["settings"].get(k) != now["settings"].get(k)]
        model = [k for k in ("model_type", "config_sha256") if was.get(k) != now.get(k)]
        if not changed and not model and was:
            if note is not None:
                note(f"{out} held {finished} finished MoE layer(s) quantized from other weights (the checkpoint's "
                     "weights fingerprint changed since): they are quantized again.")
            return
        what = ("another model (its config differs)" if was and model else
                f"other settings ({'; '.join(changed)})" if changed else "other settings or another model")
        raise MoetoolError(f"{out} holds {finished} finished MoE layer(s) of an interrupted quantize of {what}; rerun "
                           "the command that made them to continue, or delete the directory (or give another --out) "
                           "to start over.")

    def add(self, layer: int, shard: Shard, entries: list[Entry]) -> None:
        """Record a finished shard; `done` holds it only once the journal on disk does, so an interrupt
        in between never counts a layer the next run would not find."""
        self._save({**self.done, layer: (shard, entries)})
        self.done[layer] = (shard, entries)

    def _save(self, done: dict[int, tuple[Shard, list[Entry]]] | None = None) -> None:
        data = {"settings_sha256": self.settings_sha, "identity": self.identity,
                "layers": {str(k): {"shard": asdict(s), "entries": [asdict(e) for e in es]}
                           for k, (s, es) in sorted((self.done if done is None else done).items())}}
        atomic_write_bytes(self.path, json.dumps(data).encode())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
