"""Declared tables: an Arrow schema with a name and a version, and the checks every writer
and reader of a `specrank.store.shard_store.ShardStore` applies with it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa


class SchemaError(ValueError):
    """A table, shard or store does not match its declared schema or version."""


@dataclass(frozen=True)
class Migration:
    """An older version of a table that reads as the current one: a store of `version` lacks
    the columns `added`, which read as null (each must be a nullable column of the current
    schema). Its stores are read, never written into (`ShardStore`)."""

    version: int
    added: tuple[str, ...]


@dataclass(frozen=True)
class TableSpec:
    """A declared table: name, version and Arrow schema (with provenance metadata), and the
    older versions that read as this one (`migrations`)."""

    name: str
    version: int
    schema: pa.Schema
    migrations: tuple[Migration, ...] = ()

    def __post_init__(self) -> None:
        for m in self.migrations:
            if m.version == self.version:
                raise ValueError(
                    f"{self.name}: a migration from v{m.version} is the current version"
                )
            for n in m.added:
                if n not in self.schema.names or not self.schema.field(n).nullable:
                    raise ValueError(f"{self.name} v{m.version} -> v{self.version}: added column "
                                     f"{n!r} must be a nullable column of the schema")  # fmt: skip
        meta = {
            b"specrank.table": self.name.encode(),
            b"specrank.version": str(self.version).encode(),
        }
        object.__setattr__(self, "schema", self.schema.with_metadata(meta))

    def migration(self, version: object) -> Migration | None:
        """The declared migration from `version`, None when there is none."""
        return next((m for m in self.migrations if m.version == version), None)

    def conform(self, table: pa.Table) -> pa.Table:
        """Cast `table` to this schema; refuse missing or extra columns, and nulls the schema
        does not allow (a field's or a list's items), by name."""
        check_columns(self, table.schema.names)
        table = table.select(self.schema.names)
        check_nulls(self, table)  # first: a cast may refuse them too, without naming the column
        try:
            return table.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise SchemaError(
                f"{self.name} v{self.version}: cannot cast to the declared schema: {err}"
            ) from err


def check_nulls(spec: TableSpec, table: pa.Table) -> None:
    """Refuse a null where `spec` declares none: a non-nullable field, or a list's items.

    Arrow records nullability in the schema but never enforces it (a cast or a read
    keeps the nulls), so this is the check.
    """
    for field_ in spec.schema:
        if field_.name not in table.column_names:
            continue
        col = table[field_.name]
        if col.null_count and not field_.nullable:
            raise SchemaError(
                f"{spec.name} v{spec.version}: column {field_.name} holds {col.null_count} "
                f"null(s) but is declared non-null"
            )
        if (pa.types.is_list(field_.type) and pa.types.is_list(col.type)
                and not field_.type.value_field.nullable):  # fmt: skip
            items = sum(chunk.flatten().null_count for chunk in col.chunks)
            if items:
                raise SchemaError(
                    f"{spec.name} v{spec.version}: column {field_.name} holds {items} null "
                    f"list item(s) but its items are declared non-null"
                )


def check_columns(spec: TableSpec, found: Iterable[str], absent: Iterable[str] = ()) -> None:
    """Refuse missing or extra columns; `absent`: columns an older version lacks (a
    `Migration`'s), not missing there."""
    found, absent = list(found), set(absent)
    missing = [n for n in spec.schema.names if n not in found and n not in absent]
    extra = [n for n in found if n not in spec.schema.names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing column(s) {missing}")
        if extra:
            parts.append(f"extra column(s) {extra}")
        raise SchemaError(f"{spec.name} v{spec.version}: " + "; ".join(parts))


def fingerprint_json(obj: Any) -> str:
    """Stable sha256 of a JSON-able object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
