"""What a round needs to know about its run: the decode settings, the rule, what a pass scores."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from decode.stream import DecodeSettings
from selection.policies import EDGE_MODES, SCORE_MODES
from selection.ranking import Levels
from selection.rules import RULES, Rule, online_rules, rule
from specrank.settings.errors import Refusal
from tree.pool import level_sizes


@dataclass(frozen=True)
class OnlineSettings:
    """A decoding run: the shared decode settings plus the rule and what each pass scores."""

    base: DecodeSettings = field(default_factory=DecodeSettings)
    rule: str = "draft"
    score: str = "tree"  # SCORE_MODES (selection.policies)
    record: bool = False  # build trace rows (TRACE_SCHEMA) for every round
    score_top_m: int = 100  # M of score=top_m (run.score_top_m)

    @property
    def entry(self) -> Rule:
        """The rule's entry in `selection.rules` (its routes, what it reads)."""
        return rule(self.rule)

    def check(self) -> None:
        self.base.check()
        if self.rule not in online_rules():
            raise Refusal(
                f"The 'run.rule' must be one of {list(online_rules())}. Got {self.rule!r} instead."
            )
        if self.score not in SCORE_MODES:
            raise Refusal(
                f"The 'run.score' must be one of {list(SCORE_MODES)}. Got {self.score!r} instead."
            )
        if self.score == "top_m" and self.score_top_m < 1:
            raise Refusal(f"The 'run.score_top_m' must be >= 1 under run.score=top_m. Got "
                          f"{self.score_top_m}.")  # fmt: skip
        if self.record and self.score not in EDGE_MODES:
            raise Refusal(
                "run.record_traces=true needs run.score=record or pool: a trace row holds the target "
                "probability of every pool edge, which only a pass over the expanded nodes gives"
            )
        if self.record and not self.entry.traces:
            raise Refusal(
                f"run.record_traces=true is not supported for run.rule={self.rule} (its rounds "
                "emit a tree leaf as the continuation, which the trace schema cannot express)"
            )
        self._check_coupling()

    def _check_coupling(self) -> None:
        """decode.verifier=coupling: rules that verify their pool tree as drafted, and no
        recording (the offline values assume a verifier that accepts c with p(c))."""
        if self.base.decode.verifier != "coupling":
            return
        if self.entry.online.draws_x1:
            raise Refusal(
                f"decode.verifier=coupling with run.rule={self.rule}: its rounds draw or hold "
                "target rows outside the drafted chain; use rule=draft or reranker"
            )
        if self.record:
            raise Refusal(
                "decode.verifier=coupling while recording traces: the traces' offline values "
                "assume a verifier that accepts a node with its target probability; record "
                "with exhaustive or eagle3"
            )


def for_rule(s: OnlineSettings, name: str, record_traces: bool) -> OnlineSettings:
    """`s` for the rule `name`: trace rows built when the run records traces, or when its
    scored set gives every pool edge and the rule has an offline value (realized vs
    expected needs each round's row). An unknown name is kept, for `check` to refuse."""
    entry = RULES.get(name)
    build = record_traces or (
        s.score in EDGE_MODES and entry is not None and entry.has_offline_value
    )
    return dataclasses.replace(s, rule=name, record=build)


def levels_of(s: DecodeSettings) -> Levels:
    """Pool-order index ranges of depths 1, 2, ...: fixed by the pool config (no device sync)."""
    bounds = [0, *itertools.accumulate(n for n, _ in level_sizes(s.pool))]
    return list(itertools.pairwise(bounds))
