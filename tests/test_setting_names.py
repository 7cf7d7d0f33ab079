"""No two settings share a leaf name across commands unless they mean the same thing.

Every setting and nested section of every section a command reads (`specrank.settings.cli.READS`,
`EVERY_COMMAND`) is grouped by its last name. A name held by two or more is allowed only
where `SAME` says why they are one thing. The list is exact: an entry that no longer names
a shared leaf fails too, so it cannot go stale. A rename leaves a
`specrank.settings.renames.RENAMED` entry, so the old name answers "did you mean" and old stores and
runs migrate (tests/test_renames.py).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from specrank.settings.cli import EVERY_COMMAND, READS
from specrank.settings.config import schema

_TRAINING = "the same knob of a drafter or target training loop (head.train, pocket_*.train)"
_ARCH = "the same architecture number of a trained transformer (head, pocket's target/drafter)"
_RECIPE = "the same knob of the drafter recipes (decode.train_head, decode.train_pocket.*)"

# the DSpark and Domino heads' knobs: pocket_dspark / pocket_domino and block_head
_HEAD_KNOBS = ("markov_rank", "markov_head_type", "confidence_with_markov", "ce_alpha", "l1_alpha",
               "confidence_alpha", "calibration_bins", "gru_hidden_dim", "emb_dim",
               "pure_draft_prefix_len", "lambda_base_start", "lambda_base_decay_ratio")  # fmt: skip

# leaf name -> why every setting or section of that name means the same thing
SAME: dict[str, str] = {
    "seed": "a seed of the command's randomness (the job's, or its recipe's or decoder's own)",
    "threads": "torch intra-op threads of a recipe",
    "export_dtype": "dtype of a shipped model's weights",
    "out_dir": "the folder a command writes what it makes into (a store, a shipped model)",
    "work_dir": "the folder a recipe keeps its intermediate files and checkpoints in",
    "progress": "show a progress bar while decoding",
    "prompts_per_shard": "consecutive prompts per trace-store shard, the unit a rerun resumes",
    "traces": "the trace store: where it is (paths.traces) and a stage's input, defaulting to it",
    "features": "the candidate table: paths.features, rerank's input, and the stage writing it",
    "fits": "the folder of kept fits: paths.fits and rerank.fits, defaulting to it",
    "name": "the label of a config group's choice (conf/model/<name>, conf/data/<name>)",
    "target": "the target model: its folder (model.target, pocket_*.target) or pocket's own",
    "drafter": "the drafter model: its folder (model.drafter) or pocket's own",
    "rule": "the selection rule (decode.run reads run.rule, refusing select.rule: cli.NOT_READ)",
    "budgets": "the budgets B (select.budget's values) a rule is measured at, online or offline",
    "score": "the scored-set policy, online (run) and offline (rerank), one vocabulary",
    "score_top_m": "M of score=top_m, online and offline",
    "seen_prompts": "what is done with prompts a loaded reranker was trained on",
    "draft_temperature": "the drafter's temperature T_d (synthetic drafter and real one)",
    "aux_layers": "target layers whose hidden states feed an EAGLE-3 head",
    "draft_vocab": "the draft vocabulary of an EAGLE-3 head (d2t / t2d)",
    "ttt_steps": "EAGLE-3 training-time-test steps",
    "ttt_decay": "EAGLE-3 training-time-test loss decay",
    "corpus": "what a drafter recipe trains on (head.corpus, pocket.corpus)",
    "heads": _ARCH,
    "kv_heads": _ARCH,
    "intermediate": _ARCH,
    "hidden": _ARCH,
    "layers": _ARCH,
    "max_positions": _ARCH,
    "train": _TRAINING,
    "batch": _TRAINING,
    "lr": _TRAINING,
    "steps": _TRAINING,
    "warmup": _TRAINING,
    "min_lr_ratio": _TRAINING,
    "max_minutes": _TRAINING,
    "eval_every": _TRAINING,
    "seq_len": _TRAINING,
    "weight_decay": _TRAINING,
    "code_share": _TRAINING,
    "anchors": _RECIPE,
    "block_size": _RECIPE,
    "decay_gamma": _RECIPE,
    "labels": _RECIPE,
    "target_layer_ids": _RECIPE,
    "code_chars": _RECIPE,
    "rollout_prompts": _RECIPE,
    "rollout_tokens": _RECIPE,
    "card_prompts": _RECIPE,
    "card_tokens": _RECIPE,
    "checkpoint_minutes": _TRAINING,
    **dict.fromkeys(_HEAD_KNOBS, _RECIPE),
}


def _nodes(value: Any, prefix: str) -> list[str]:
    """Dotted names of every setting and nested section of a section instance."""
    out = []
    for f in dataclasses.fields(value):
        name, inner = prefix + f.name, getattr(value, f.name)
        out.append(name)
        if dataclasses.is_dataclass(inner):
            out += _nodes(inner, name + ".")
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def names_by_leaf(root: type, read: set[str]) -> dict[str, list[str]]:
    """Every name of the sections (and top-level settings) in `read`, by its last part."""
    by_leaf: dict[str, list[str]] = defaultdict(list)
    for f in dataclasses.fields(root):
        if f.name not in read:
            continue
        section = _default(f)
        found = [f.name, *(_nodes(section, f.name + ".") if dataclasses.is_dataclass(section)
                           else [])]  # fmt: skip
        for name in found:
            by_leaf[name.rsplit(".", 1)[-1]].append(name)
    return dict(by_leaf)


def shared_leaves(by_leaf: dict[str, list[str]]) -> dict[str, list[str]]:
    return {leaf: names for leaf, names in by_leaf.items() if len(names) > 1}


def _read_sections() -> set[str]:
    return {*EVERY_COMMAND, *(s for reads in READS.values() for s in reads)}


def test_every_section_is_read_by_a_command():
    """The enumeration below covers the whole schema: no section escapes it."""
    fields = {f.name for f in dataclasses.fields(schema())}
    assert fields <= _read_sections(), fields - _read_sections()


def test_no_two_settings_share_a_leaf_name_unless_they_mean_the_same_thing():
    shared = shared_leaves(names_by_leaf(schema(), _read_sections()))
    unexplained = {leaf: names for leaf, names in shared.items()
                   if leaf not in SAME}  # fmt: skip
    assert not unexplained, (
        f"settings share a leaf name: {unexplained}. Rename the ones that mean different "
        "things (with a specrank.settings.renames.RENAMED entry), or add the leaf to SAME with why "
        "they are one thing"
    )


def test_the_allow_lists_name_only_shared_leaves():
    shared = shared_leaves(names_by_leaf(schema(), _read_sections()))
    stale = sorted(set(SAME) - set(shared))
    assert not stale, f"no longer shared, remove from SAME: {stale}"
    assert all(SAME.values())


# -- the check can fail: synthetic schemas --------------------------------------------------------


@dataclass
class _Pool:
    top_k: int = 10
    seed: int = 0


@dataclass
class _HeadData:
    top_k: int = 32


@dataclass
class _Head:
    seed: int = 0
    data: _HeadData = field(default_factory=_HeadData)


@dataclass
class _Data:
    name: str = "default"


@dataclass
class _Root:
    pool: _Pool = field(default_factory=_Pool)
    head: _Head = field(default_factory=_Head)
    data: _Data = field(default_factory=_Data)
    seed: int = 0


@pytest.mark.parametrize(
    ("read", "flagged"),
    [
        ({"pool", "head"}, {"top_k"}),  # a leaf of two sections (`seed` is allowed)
        ({"head", "data"}, {"data"}),  # a nested section named as a top-level one
        ({"pool", "head", "data", "seed"}, {"top_k", "data"}),
        ({"pool", "data", "seed"}, set()),  # only allowed names shared
        ({"pool"}, set()),
    ],
)
def test_a_shared_leaf_with_another_meaning_is_caught(read, flagged):
    shared = shared_leaves(names_by_leaf(_Root, read))
    assert {leaf for leaf in shared if leaf not in SAME} == flagged
