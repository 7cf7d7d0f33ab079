"""Settings and commands that were renamed, and the one place old names are mapped to new ones.

A setting keeps one name across every command (`run.score_top_m` online is the M of
`rerank.score_top_m` offline), and no two settings share a leaf name unless they mean the
same thing (tests/test_setting_names.py): names that meant other things were renamed for
what they are. An old name on the command line is refused with the new one
(`specrank.settings.cli.checked_argv`); a trace store whose manifest was written under an old name
is read as if written under the new one (`specrank.store.shard_store`), and a logged run's
parameters are shown under the new names (`rerank.report.runs`).

An entry renames a setting or a whole sub-section: every name under `rerank.model` moves
under `rerank.booster` (`rerank.model.kind` -> `rerank.booster.kind`), the longest entry
that matches a name winning (`head.data.top_k` has its own). An entry without a dot is a
config group (`rerank_model=lgbm` -> `booster=lgbm`): no top-level setting was renamed.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Mapping
from typing import Any

# old dotted name -> new dotted name (a setting, or a sub-section and all under it); an old
# name without a dot is a config group
RENAMED: dict[str, str] = {
    "run.top_m": "run.score_top_m",
    "select.top_m": "select.record_top_m",
    "rerank.top_m": "rerank.draft_top_m",
    "data.chunks": "data.prompt_chunks",
    "data.chunk": "data.prompt_chunk",
    # `model` is the language-model pair's section; the reranker's estimator is a booster
    "rerank.model": "rerank.booster",
    "rerank_model": "booster",
    # `data` is the suites' section; the head's is the corpus it trains on
    "head.data": "head.corpus",
    # `pool.top_k` is the children per expanded node
    "head.data.top_k": "head.corpus.target_top_k",
    # `parallel.workers` are Ray workers; these are the evaluation's threads
    "rerank.workers": "rerank.eval_threads",
    # `pocket.eval.prompts` are the suite prompts of the pocket models' entropy figure
    "synth_job.prompts": "synth_job.toy_prompts",
    # `pocket.corpus.heldout_prompts` are the prompts written to the held-out file; these are
    # the suite prompts decoded for a semi-AR drafter's card
    "pocket_dspark.heldout_prompts": "pocket_dspark.card_prompts",
    "pocket_dspark.heldout_tokens": "pocket_dspark.card_tokens",
    "pocket_domino.heldout_prompts": "pocket_domino.card_prompts",
    "pocket_domino.heldout_tokens": "pocket_domino.card_tokens",
    # every other `steps` counts optimizer steps; these are the pool's expansion steps
    "pool.steps": "pool.expand_steps",
}


def new_name(name: str) -> str | None:
    """The new name of `name` (a dotted setting or section name, or a config group), or None
    when neither it nor a section above it was renamed."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        new = RENAMED.get(".".join(parts[:cut]))
        if new is not None:
            return ".".join([new, *parts[cut:]])
    return None


def renamed_message(key: str, arg: str) -> str | None:
    """ "Did you mean" for an override of a renamed setting or config group, or None."""
    old = key.lstrip("+~")
    new = new_name(old)
    if new is None:
        return None
    if "." not in old:  # a config group: the whole override, its choice kept
        _, sep, choice = arg.partition("=")
        return (
            f"The config group '{old}' was renamed (override {arg!r}). "
            f"Did you mean '{new}{sep}{choice}'?"
        )
    return f"'{old}' was renamed (override {arg!r}). Did you mean '{new}'?"


def _plain(value: Any) -> Any:
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _move(old_parent: dict, old_key: str, new_parent: dict, new_key: str) -> None:
    """Move `old_parent[old_key]` to `new_parent[new_key]`; where both hold sections, their
    settings one by one. A value already under the new name is kept (it is the newer)."""
    if new_key not in new_parent:
        new_parent[new_key] = old_parent.pop(old_key)
        return
    old, new = old_parent[old_key], new_parent[new_key]
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old):
            _move(old, key, new, key)
        if not old:
            del old_parent[old_key]


def migrated_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config (sections of settings, as manifests and logged runs hold them) with every old
    name moved to its new one; a config without old names is returned equal."""
    out = _plain(config)
    # the longest first: `head.data.top_k` moves before the rest of `head.data` follows it
    for old in sorted((k for k in RENAMED if "." in k), key=lambda k: -k.count(".")):
        *path, old_key = old.split(".")
        *new_path, new_key = RENAMED[old].split(".")
        parent = out
        for part in path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old_key not in parent:
            continue
        target = out
        for part in new_path:
            target = target.setdefault(part, {})
        _move(parent, old_key, target, new_key)
    return out


def migrated_params(params: Mapping[str, str]) -> dict[str, str]:
    """Flat `section.key` parameters (a logged run's) under the new names."""
    return {new_name(k) or k: v for k, v in params.items()}


# -- commands -------------------------------------------------------------------------------------

# old module -> new module, for every renamed entry point (`python -m <old>` still runs)
NEW_NAMES = {
    "decode.pocket": "decode.train_pocket",
    "decode.pocket.eagle3": "decode.train_pocket.eagle3",
    "decode.pocket.block": "decode.train_pocket.block",
    "decode.pocket.dspark": "decode.train_pocket.dspark",
    "decode.pocket.domino": "decode.train_pocket.domino",
    "decode.synth": "decode.synth_traces",
    "specrank.log_run": "specrank.tracking.log_run",
    "specrank.settings_doc": "specrank.settings.settings_doc",
}


def notice(old: str) -> str:
    """The line an old name prints before it runs the new command."""
    return f"python -m {old} is now python -m {NEW_NAMES[old]}; the old name will be removed"


def run_renamed(old: str) -> None:
    """Run `python -m <old>` as its new name: the notice on stderr, then the new module as
    `__main__` with `sys.argv[1:]` unchanged."""
    print(notice(old), file=sys.stderr)
    runpy.run_module(NEW_NAMES[old], run_name="__main__", alter_sys=True)
