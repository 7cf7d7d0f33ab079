"""Rule families and styles shared by every figure (`rerank.report.plots`) and the notebook.

A family is a panel of the gain-vs-budget figure. A rule's family is its entry's in
`selection.rules`; a name the registry does not know (a variant a later run logged,
`rows_lgbm_es`, `root_draw_v2`, or the notebook's model-kind-free `rows`) takes the family
of the longest known name it extends (`p` claims `p_<anything>`), and otherwise goes to
"other" rather than vanishing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from rerank.fit.models import FEATURE_SETS
from selection.rules import BASELINE, RULES
from selection.rules import rule as rule_entry


@dataclass(frozen=True)
class Family:
    key: str
    title: str


FAMILIES = (  # panels, in figure order; the baseline (draft) is the zero line, not a panel
    Family("exact", "exact target rows"),
    Family("learned", "learned rerankers"),
    Family("calibrators", "calibration controls"),
    # apart: a substitution at -70% would squash the mixtures near 0 in a shared panel
    Family("substitutions", "direct substitutions"),
    Family("mixtures", "geometric mixtures with draft"),
    Family("draw", "draw rules"),
)
OTHER = Family("other", "other rules")
_BY_KEY = {f.key: f for f in FAMILIES}
# names a variant may extend: the fixed rules, the feature sets, the templates' prefixes
_PREFIXES = {n: r.family for n, r in RULES.items()} | dict.fromkeys(FEATURE_SETS, "learned") | {
    "sub": "substitutions", "mix": "mixtures"}  # fmt: skip


def family_of(rule: str) -> Family:
    """The panel of `rule`: its registry entry's family, else the longest name it extends."""
    try:
        return _BY_KEY.get(rule_entry(rule).family, OTHER)
    except ValueError:
        pass
    claims = [p for p in _PREFIXES if rule == p or rule.startswith(p + "_")]
    return _BY_KEY.get(_PREFIXES[max(claims, key=len)], OTHER) if claims else OTHER


# Colour-blind-safe qualitative colours (Okabe-Ito, then tab10 extras): distinct at a glance.
COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
          "#8C564B", "#7F7F7F", "#BCBD22")  # fmt: skip
# Filled, clearly different shapes; 7 is coprime with 10 colours, so (colour, marker)
# pairs stay unique for the first 70 rules of a panel.
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")


def group_rules(rules: Iterable[str]) -> list[tuple[Family, list[str]]]:
    """Rules by family, families in `FAMILIES` order (then "other"), rules in given order.

    The baseline is left out; empty families are dropped.
    """
    groups: dict[str, list[str]] = {}
    for rule in dict.fromkeys(rules):
        if rule != BASELINE:
            groups.setdefault(family_of(rule).key, []).append(rule)
    return [(f, groups[f.key]) for f in (*FAMILIES, OTHER) if f.key in groups]


@dataclass(frozen=True)
class Style:
    color: str
    marker: str
    linestyle: str

    def kwargs(self) -> dict[str, str]:
        return {"color": self.color, "marker": self.marker, "linestyle": self.linestyle}


def styles(names: Sequence[str]) -> dict[str, Style]:
    """One style per name, no two sharing colour and marker (for up to 70 names)."""
    return {
        name: Style(
            COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)], LINESTYLES[i % len(LINESTYLES)]
        )
        for i, name in enumerate(names)
    }


def budget_axis(ax: Axes, budgets: Sequence[int]) -> None:
    """Log-scaled x axis with ticks exactly at the evaluated budgets, labelled as integers."""
    budgets = sorted({int(b) for b in budgets})
    ax.set_xscale("log")
    ax.set_xticks(budgets, [str(b) for b in budgets], fontsize=7,
                  rotation=90 if len(budgets) > 6 else 0)  # fmt: skip
    ax.minorticks_off()  # no "2x10^1" labels between the evaluated budgets
    if len(budgets) == 1:
        ax.set_xlim(budgets[0] / 1.5, budgets[0] * 1.5)
    else:
        ax.set_xlim(budgets[0] / 1.15, budgets[-1] * 1.15)


def padded_range(low: float, high: float, include_zero: bool = True) -> tuple[float, float]:
    """(low, high) widened by 6% each way, including 0 so the zero line is always in view."""
    if include_zero:
        low, high = min(low, 0.0), max(high, 0.0)
    span = high - low or max(abs(high), 1.0)
    return low - 0.06 * span, high + 0.06 * span


def new_figure(width: float, height: float) -> Figure:
    """A figure outside pyplot: `savefig` renders it with Agg whatever the session's backend,
    and a notebook's inline backend is left alone (no `matplotlib.use` at import)."""
    # constrained layout keeps the suptitle clear of the panel titles
    return Figure(figsize=(width, height), layout="constrained")


def save(fig: Figure, path: object) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")
