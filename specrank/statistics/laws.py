"""The decoding law of a temperature, named once for every stage.

law_kind(T): "greedy" (T = 0: argmax verification, 0/1 labels, classifiers)
             or "sampling" (T > 0: target sampling, probability labels, regressors)
law_name(T): the law in tables, plots and metric keys: "greedy", "sampling" (T = 1),
             "sampling_T0.7" (any other T > 0, so two sampling laws never share a name)
"""

from __future__ import annotations

LAW_KINDS = ("greedy", "sampling")


def law_kind(temperature: float) -> str:
    """Which estimator and label a temperature's rounds take (see module doc)."""
    if temperature < 0:
        raise ValueError(f"A temperature must be >= 0. Got {temperature} instead.")
    return "greedy" if temperature == 0 else "sampling"


def law_name(temperature: float) -> str:
    """The law's label in every report and metric key (see module doc)."""
    kind = law_kind(temperature)
    if kind == "greedy" or float(temperature) == 1.0:
        return kind
    return f"{kind}_T{float(temperature):g}"


def pair_label(target_temperature: float, draft_temperature: float | None) -> str:
    """The paper's temperature pair T_t|T_d ("1|0"); null drafting (deterministic top-k) is
    T_d = 0, as the paper labels today's runs 0|0 and 1|0."""
    return f"{float(target_temperature):g}|{float(draft_temperature or 0.0):g}"


def pair_key(target_temperature: float, draft_temperature: float | None) -> str:
    """The pair as MLflow keys accept it ("t1_d0"; '|' is not allowed, '.' becomes 'p')."""
    t, d = pair_label(target_temperature, draft_temperature).split("|")
    return f"t{t}_d{d}".replace(".", "p")


def law_columns(temperature: float) -> dict[str, str | float]:
    """The law as the columns of a report row: its name and its temperatures (the target's;
    a drafter temperature joins here once the drafter has its own)."""
    return {"law": law_name(temperature), "target_temperature": float(temperature)}
