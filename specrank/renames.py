"""Settings that were renamed, and the one place old names are mapped to new ones.

A setting keeps one name across every command (`run.score_top_m` online is the M of
`rerank.score_top_m` offline); names that meant other things were renamed for what they
restrict. An old name on the command line is refused with the new one
(`specrank.cli.checked_argv`); a trace store whose manifest was written under an old name
is read as if written under the new one (`specrank.shard_store`), and a logged run's
parameters are shown under the new names (`rerank.report.runs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# old dotted name -> new dotted name (the same section)
RENAMED: dict[str, str] = {
    "run.top_m": "run.score_top_m",
    "select.top_m": "select.record_top_m",
    "rerank.top_m": "rerank.draft_top_m",
    "data.chunks": "data.prompt_chunks",
    "data.chunk": "data.prompt_chunk",
}


def renamed_message(key: str, arg: str) -> str | None:
    """ "Did you mean" for an override of a renamed setting, or None."""
    new = RENAMED.get(key.lstrip("+~"))
    if new is None:
        return None
    return f"'{key}' was renamed (override {arg!r}). Did you mean '{new}'?"


def migrated_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config (sections of settings, as manifests and logged runs hold them) with every old
    name moved to its new one; a config without old names is returned equal."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    for old, new in RENAMED.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        part = out.get(section)
        if isinstance(part, dict) and old_key in part and new_key not in part:
            part[new_key] = part.pop(old_key)
    return out


def migrated_params(params: Mapping[str, str]) -> dict[str, str]:
    """Flat `section.key` parameters (a logged run's) under the new names."""
    return {RENAMED.get(k, k): v for k, v in params.items()}
