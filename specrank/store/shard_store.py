"""Versioned, resumable Parquet shard store (traces, candidate tables, ...).

A store is a folder:

    manifest.json              schema name + version, config, model ids, fingerprint
    shard-<id>.parquet         one finished shard, written to a temp name then renamed
    shard-<id>.done            completion marker: row count and the file's sha256

Readers only see shards that have a marker, so a killed writer never exposes
half a shard; `write_pending` (the one shard-writing loop of every stage) skips
finished shards on a rerun, so rounds are never duplicated. Tables are cast to the declared schema on write (missing
or extra columns are refused) and checked against it on read.

Versions: the manifest's version is the store's, and every shard carries it (a store never
mixes two). A store of the spec's version is read and written; a store of a version the spec
declares a migration from (`TableSpec.migrations`) is read as the current version, the
columns that version lacks null, and refused for writing; any other version is refused,
naming the file, the expected and the found version. This is the one place a store's
version is read (`ShardStore.dataset`, `ShardStore.check_compatible`).

Processes on one machine or many may write one store at once: `write_pending`
claims each shard first (`specrank.store.claims`), so no two write the same shard and
a killed writer's shard is redone; the manifest is created exclusively, so of two
writers with different configs starting together, one is refused.

Why not `datasets.ArrowWriter` or datatrove: both infer schemas from the data
by default and neither checks a version on read; this is ~200 lines we can test.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from specrank.runtime import faults
from specrank.settings.renames import migrated_config
from specrank.store import claims as claims_
from specrank.store.claims import Claim, ClaimLost, ShardRun, new_owner
from specrank.store.files import named_os_error
from specrank.store.tables import (
    Migration,
    SchemaError,
    TableSpec,
    check_columns,
    fingerprint_json,
    sha256_file,
)

MANIFEST = "manifest.json"
_SHARD_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _read_json(path: Path, what: str, remedy: str) -> dict[str, Any]:
    """A JSON object from `path`; a corrupt file is refused naming it, `what` it is and the remedy."""
    try:
        obj = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SchemaError(f"{path}: {what} is not valid JSON ({err}); {remedy}") from err
    if not isinstance(obj, dict):
        raise SchemaError(
            f"{path}: {what} must be a JSON object, found {type(obj).__name__}; {remedy}"
        )
    return obj


def _atomic_write_bytes(path: Path, data: bytes, owner: str) -> None:
    # The owner token (host, pid, random) keeps temp names apart across hosts sharing a folder.
    tmp = path.with_name(f".{path.name}.tmp-{owner.replace(':', '-')}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class ShardStore:
    """Writer and reader of one store folder for one `TableSpec`."""

    root: Path
    spec: TableSpec
    owner: str = field(default_factory=new_owner)  # this writer in claim files and temp names
    claim_stale_s: float = 300.0  # a claim not refreshed for this long is taken over
    claim_poll_s: float = 1.0  # how often to look again at shards another writer holds
    _checked: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    # -- manifest -----------------------------------------------------------------
    def open_for_writing(
        self, config: Mapping[str, Any], models: Mapping[str, Any] | None = None
    ) -> None:
        """Create the folder and manifest, or check that an existing one matches.

        A rerun with a different config into the same folder would mix two
        experiments in one table, so it is refused with the differing keys.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = {
            "table": self.spec.name,
            "schema_version": self.spec.version,
            "config": dict(config),
            "models": dict(models or {}),
            "config_fingerprint": fingerprint_json({"config": config, "models": models or {}}),
        }
        path = self.root / MANIFEST
        data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        # Created exclusively: of two writers starting at once, the second compares.
        if path.exists() or not claims_.create_exclusive(path, data, self.owner):
            self.check_compatible(config, models or {})

    def check_compatible(
        self, config: Mapping[str, Any], models: Mapping[str, Any] | None = None
    ) -> None:
        """Refuse writing `config` (and `models`, when given) into an existing store of another.

        No manifest yet: nothing to refuse. `models=None` compares the config only: a
        driver checks a store before its workers load the models it will record.
        """
        if not (self.root / MANIFEST).exists():
            return
        old = self.manifest()
        self._check_version(old)
        # Compared as JSON (what the manifest stores: tuples are lists there).
        want = {"config": _as_json(config), "models": _as_json(models or {})}
        # manifest() reads a store written before a rename under the new names
        got = {"config": old.get("config", {}), "models": old.get("models", {})}
        if models is None:
            want["models"] = got["models"]
        if fingerprint_json(want) != fingerprint_json(got):
            diff = _diff_keys(got["config"], want["config"])
            diff += [f"models.{k}" for k in _diff_keys(got["models"], want["models"])]
            raise SchemaError(
                f"{self.root}: this folder was written with a different config or models "
                f"(differing keys: {diff or ['?']}); write to a new folder or delete it"
            )

    def manifest(self) -> dict[str, Any]:
        """The store's manifest, refused when it does not match its own fingerprint; its config
        is read under today's setting names (a store written before a rename reads as if
        written after it: `specrank.settings.renames`)."""
        path = self.root / MANIFEST
        if not path.exists():
            raise FileNotFoundError(
                f"{self.spec.name} store: no {MANIFEST} in {self.root} (expected a folder written by specrank)"
            )
        remedy = (
            f"restore {MANIFEST} from a copy, or delete the folder and rerun the writer "
            f"(deleting only {MANIFEST} and rerunning the same command keeps the finished shards)"
        )
        manifest = _read_json(path, f"the manifest of the {self.spec.name} store", remedy)
        want = manifest.get("config_fingerprint")
        got = fingerprint_json(
            {"config": manifest.get("config", {}), "models": manifest.get("models", {})}
        )
        if want != got:
            raise SchemaError(
                f"{path}: the manifest's config and models do not match its recorded "
                f"fingerprint {str(want)[:12]} (found {got[:12]}): corrupt or edited; {remedy}"
            )
        return {**manifest, "config": migrated_config(manifest.get("config", {}))}

    def _check_version(
        self, manifest: Mapping[str, Any], reading: bool = False
    ) -> Migration | None:
        """Refuse a manifest of another table or version, naming the file. `reading`: a
        version the spec declares a migration from is accepted too (its stores read as the
        current version, their added columns null: `TableSpec.migrations`), and returned;
        they are never written into (mixing versions in one store)."""
        name, version = manifest.get("table"), manifest.get("schema_version")
        migration = self.spec.migration(version) if name == self.spec.name else None
        if name == self.spec.name and version == self.spec.version:
            return None
        if reading and migration is not None:
            return migration
        why = (f"; a v{version} store reads as v{self.spec.version} but is not written into: "
               f"write to a new folder") if migration is not None else ""  # fmt: skip
        raise SchemaError(
            f"{self.root / MANIFEST}: expected table '{self.spec.name}' schema version "
            f"{self.spec.version}, found table '{name}' schema version {version}{why}"
        )

    # -- shards -------------------------------------------------------------------
    def _paths(self, shard_id: str) -> tuple[Path, Path]:
        if not _SHARD_ID.match(shard_id):
            raise ValueError(f"shard id must match {_SHARD_ID.pattern}; got {shard_id!r}")
        return self.root / f"shard-{shard_id}.parquet", self.root / f"shard-{shard_id}.done"

    def is_done(self, shard_id: str) -> bool:
        return self._paths(shard_id)[1].exists()

    def write_shard(self, shard_id: str, table: pa.Table, claim: Claim | None = None) -> bool:
        """Write one shard atomically; return False (and write nothing) if it is done.

        Under a `claim` (`write_pending` passes its own) it is checked just before the rename:
        a writer whose claim was taken over raises `ClaimLost` and commits nothing.
        """
        data_path, done_path = self._paths(shard_id)
        if done_path.exists():
            return False
        table = self.spec.conform(table)
        tmp = data_path.with_name(f".{data_path.name}.tmp-{self.owner.replace(':', '-')}")
        faults.phase(f"writing shard {shard_id} of {self.root}")
        try:
            # Dictionary-encode only strings: on numeric list columns it costs ~20%
            # of write time for files within 1% of the size (measured on traces).
            strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
            try:
                pq.write_table(table, tmp, compression="zstd", use_dictionary=strings)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                faults.point("shard_write", data_path)
            except FileNotFoundError:  # the writer that took over removed our temp file
                if claim is None or claim.held():
                    raise
                claim.lost = True
            if claim is not None and (claim.lost or not claim.held()):
                raise ClaimLost(
                    f"{self.root}: the claim of {self.owner} on shard '{shard_id}' was taken "
                    f"over (no heartbeat for {self.claim_stale_s:g} s?); not committing it"
                )
            os.replace(tmp, data_path)
            marker = {"rows": table.num_rows, "sha256": sha256_file(data_path)}
            faults.point("shard_marker", done_path)
            _atomic_write_bytes(done_path, json.dumps(marker).encode(), self.owner)
        except OSError as err:  # a full disk: name the shard; the finished ones stay as they are
            raise named_os_error(err, data_path, f"cannot write shard '{shard_id}'") from err
        finally:
            tmp.unlink(missing_ok=True)
        faults.phase(f"shard {shard_id} written")
        return True

    def pending(self, shard_ids: Sequence[str]) -> list[str]:
        """The ids among `shard_ids` without a completion marker, in the given order."""
        return [sid for sid in shard_ids if not self.is_done(sid)]

    def claim(self, shard_id: str) -> Claim | None:
        """Claim an unfinished shard for this writer; None if done or held by a live writer."""
        self._paths(shard_id)  # validates the id
        return None if self.is_done(shard_id) else claims_.claim_shard(self, shard_id)

    def break_claims(self, shard_id: str, owner: str) -> int:
        """Void `owner`'s claims on a shard, when its process is known to be dead."""
        self._paths(shard_id)
        return claims_.break_claims(self.root, shard_id, owner)

    def write_pending(
        self,
        shard_ids: Sequence[str],
        build: Callable[[str], pa.Table],
        after: Callable[[str, pa.Table], None] | None = None,
    ) -> ShardRun:
        """The one shard-writing loop (record, synth, extract, online runs).

        Finished shards are skipped; each other shard is claimed, built by `build(id)`
        and written atomically, then `after(id, table)` runs (progress, logging). A run
        killed mid-shard leaves that shard unwritten, and a rerun redoes exactly it.
        A shard another live writer holds is skipped and looked at again every
        `claim_poll_s` until it is finished (or its writer is gone: then it is built
        here), so on return every shard of `shard_ids` is done.
        """
        return claims_.write_claimed(self, shard_ids, build, after)

    def done_shards(self) -> list[str]:
        return sorted(p.name[len("shard-") : -len(".done")] for p in self.root.glob("shard-*.done"))

    def fingerprint(self) -> str:
        """Content fingerprint: sha256 over the completed shards' ids and file hashes."""
        entries = []
        for sid in self.done_shards():
            entries.append((sid, self.marker(sid)["sha256"]))
        return fingerprint_json(entries)

    def marker(self, shard_id: str) -> dict[str, Any]:
        """A finished shard's completion marker: its row count and the file's sha256."""
        done_path = self._paths(shard_id)[1]
        marker = _read_json(done_path, f"the completion marker of shard '{shard_id}'",
                            self._remedy(shard_id))  # fmt: skip
        if not isinstance(marker.get("rows"), int) or not _SHA256.match(str(marker.get("sha256"))):
            raise SchemaError(
                f"{done_path}: expected a marker with an int 'rows' and a hex 'sha256', "
                f"found {marker!r}; {self._remedy(shard_id)}"
            )
        return marker

    def _remedy(self, shard_id: str) -> str:
        data_path, done_path = self._paths(shard_id)
        return (
            f"delete {data_path.name} and {done_path.name} from {self.root} and rerun the "
            f"writer: it redoes just this shard"
        )

    def dataset(self) -> ds.Dataset:
        """A `pyarrow.dataset` over completed shards, checked against the declared schema.

        Each shard's bytes are checked against the sha256 its marker recorded (a
        flipped byte would otherwise be read as a changed value; hashing costs a
        fraction of parsing, see bench/bench_store.py), then its row count, table
        name and version. Every refusal names the shard, the store and the remedy.
        """
        manifest = self.manifest()
        migration = self._check_version(manifest, reading=True)
        # every shard is of the manifest's version: a store never mixes two
        want, absent = str(manifest["schema_version"]), migration.added if migration else ()
        files = []
        for sid in self.done_shards():
            data_path, done_path = self._paths(sid)
            if not data_path.exists():
                raise SchemaError(
                    f"{done_path} marks shard '{sid}' done but {data_path.name} is missing; "
                    f"{self._remedy(sid)}"
                )
            marker = self.marker(sid)
            got = sha256_file(data_path)
            if got != marker["sha256"]:
                raise SchemaError(
                    f"{data_path}: shard '{sid}' of the {self.spec.name} store {self.root} is "
                    f"corrupt (content sha256 {got[:12]} != recorded {marker['sha256'][:12]}); "
                    f"{self._remedy(sid)}"
                )
            try:
                meta_file = pq.read_metadata(data_path)
            except (pa.ArrowInvalid, OSError) as err:
                raise SchemaError(
                    f"{data_path}: shard '{sid}' of the {self.spec.name} store {self.root} cannot "
                    f"be read as Parquet ({err}); {self._remedy(sid)}"
                ) from err
            if meta_file.num_rows != marker["rows"]:
                raise SchemaError(
                    f"{data_path}: shard '{sid}' holds {meta_file.num_rows} rows, its marker "
                    f"recorded {marker['rows']}; {self._remedy(sid)}"
                )
            found = meta_file.schema.to_arrow_schema()
            try:
                check_columns(self.spec, found.names, absent)
            except SchemaError as err:
                raise SchemaError(f"{data_path}: {err}") from err
            meta = found.metadata or {}
            version = meta.get(b"specrank.version", b"?").decode()
            if version != want:
                raise SchemaError(
                    f"{data_path}: expected {self.spec.name} schema version {want}, found {version}"
                )
            files.append(str(data_path))
        # an older version's shards lack its migration's added columns: read as null
        return ds.dataset(files, schema=self.spec.schema, format="parquet")

    def read(self, columns: list[str] | None = None) -> pa.Table:
        return self.dataset().to_table(columns=columns)


def _as_json(obj: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(obj), sort_keys=True, default=str))


def _diff_keys(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += _diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out
