"""Typed settings of `python -m features.extract` (the `features:` config section)."""

from __future__ import annotations

from dataclasses import dataclass

from specrank.settings.fields import setting


@dataclass
class FeaturesConfig:
    """Where the candidate-table extraction reads and writes.

    Both default to the shared `paths` section, so a plain `python -m
    features.extract` turns `paths.traces` into `paths.features`. On the command
    line `traces=<dir>` and `out=<dir>` are short for `features.traces=<dir>`
    and `features.out=<dir>` (see `features.extract`).
    """

    traces: str = setting(
        "${paths.traces}", "trace store to read (any folder written by decode.record/synth)"
    )
    out: str = setting("${paths.features}", "candidate store to write (one shard per trace shard)")


SECTIONS = {"features": FeaturesConfig}  # see specrank.settings.config
