"""The reranker as an acceptance estimator at depth 1, beside the estimators serving engines ship.

A first-level candidate c is accepted under verification of the whole first level when the
target's first token X1 is c: at T=0 when c is the target's argmax, at T>0 with
probability p(c) (the candidate table's label). Every estimator of that event is judged
per law, on two candidate sets (`CANDIDATE_SETS`): the drafter's top first-level candidate
(the chain's first token, which the engines' estimators score) and every first-level
candidate. The estimators, all held out:
- the run's learned rerankers and its calibration controls (the rank control, the isotonic
  q1 map): their cross-fitted predictions (`rerank.fit.predict`);
- the draft probability q(c), as it is;
- vLLM's logistic model on the drafter's confidence (`rerank.report.acceptance_vllm`):
  `vllm_logit_q` and `vllm_margin` fitted on the training half (the run's halves), and
  `vllm_online`, vLLM's own online refit over the prompts in recording order;
- DSpark's calibrated confidence (`dspark_confidence`, the `top` set only): the drafter's
  own estimate of its first draft token's acceptance, as recorded (the trace's
  `draft_confidence`, `pairs.semiar.drafter`); present for a law when every one of its
  rounds holds one, absent otherwise (the report says why: `DSPARK_NOTE`). Nothing is
  fitted on it.

Labels: AUROC of the realized event X1 = c (`rerank.evaluate.acceptance_events`); the
Brier score, ECE and log-loss against the realized event (`event`) and, at T>0, against the
exact p(c) the trace holds (`exact`; at T=0 the two are the same 0/1 label). Each figure has
a 95% paired prompt-bootstrap interval, and so has each estimator's difference from the
reference reranker (`advantage`: the reference's AUROC minus the estimator's, the
estimator's loss minus the reference's; above 0 where the reference is better), from the
same resamples (`rerank.report.acceptance_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.report.acceptance_metrics import (
    CLIP,
    ECE_BINS,
    LOWER_IS_BETTER,
    METRICS,
    PromptWeights,
    metric_draws,
)
from rerank.report.acceptance_vllm import (
    DSPARK_NOTE,
    DSPARK_PRESENT,
    VLLM_SOURCE,
    crossfit_logistic,
    logit_q_feature,
    margin_feature,
    online_refit,
)
from specrank.statistics.bootstrap import percentile_interval
from specrank.statistics.laws import law_columns, law_kind, law_name
from specrank.tracking.train_runs import metric_key

CANDIDATE_SETS = {"top": "the drafter's top first-level candidate (the chain's first token)",
                  "all": "every first-level candidate"}  # fmt: skip
# what the report reads of each first-level candidate (the job gathers them)
ACCEPTANCE_ROW_COLUMNS = [
    *ROUND_KEYS, "cand_index", "token", "task", "fold", "draft_prob", "draft_rank",
    "margin_top_sibling", "label_is_argmax", "label_target_prob", "event", "root_entropy",
    "order", "draft_confidence",
]  # fmt: skip
VLLM_FITTED = ("vllm_logit_q", "vllm_margin")  # fitted on the training half
VLLM_ONLINE = "vllm_online"
DSPARK = "dspark_confidence"  # the drafter's recorded confidence, `top` set only
CONFIDENCE_COLUMN = "draft_confidence"  # the report rows' (the trace's) column it reads
TABLE_COLUMNS = ["law", "target_temperature", "candidates", "estimator", "metric", "label",
                 "reference", "n", "prompts", "events"] + [
    f"{k}{x}" for k in ("value", "advantage") for x in ("", "_lo", "_hi", "_nonfinite", "_note")
]  # fmt: skip


@dataclass
class LawSet:
    """One law's candidate set: its rows of the frame (recording order) and every estimator's
    prediction on them."""

    temperature: float
    candidates: str  # a key of CANDIDATE_SETS
    rows: np.ndarray  # positions in the frame
    preds: dict[str, np.ndarray]

    @property
    def law(self) -> str:
        return law_name(self.temperature)


def law_label(frame: pd.DataFrame, temperature: float) -> np.ndarray:
    """The exact probability that X1 = c under the law: the argmax label at T=0, p(c) at T>0."""
    if law_kind(temperature) == "greedy":
        return frame["label_is_argmax"].to_numpy(np.float64)
    return frame["label_target_prob"].to_numpy(np.float64)


def _vllm_preds(part: pd.DataFrame, crossfit: bool) -> dict[str, np.ndarray]:
    """The vLLM estimators on one law's set (rows in recording order)."""
    logit_q = logit_q_feature(part["draft_prob"].to_numpy())
    step = pd.factorize(part["order"].to_numpy())[0]  # the rounds' numbers, in order
    out = {VLLM_ONLINE: online_refit(logit_q, part["event"].to_numpy(), step)}
    if crossfit:
        fold = part["fold"].to_numpy()
        label = law_label(part, float(part["temperature"].iloc[0]))
        margin = margin_feature(part["margin_top_sibling"].to_numpy())
        out["vllm_logit_q"] = crossfit_logistic(logit_q, label, fold)
        out["vllm_margin"] = crossfit_logistic(margin, label, fold)
    return out


def dspark_preds(part: pd.DataFrame) -> dict[str, np.ndarray]:
    """DSpark's recorded confidence on one law's `top` set, when every round holds one
    (a frame without the column, or with a null on any round: none)."""
    if CONFIDENCE_COLUMN not in part or part.empty:
        return {}
    values = part[CONFIDENCE_COLUMN].to_numpy(np.float64)
    return {DSPARK: values} if np.isfinite(values).all() else {}


def law_sets(frame: pd.DataFrame, fitted: Sequence[str], crossfit: bool = True) -> list[LawSet]:
    """Every law's two candidate sets with their estimators: draft_prob, the `fitted` columns
    (held-out predictions of the run), vLLM's (`crossfit`: its training-half fits too,
    which need both halves) and, on the `top` set, DSpark's recorded confidence where the
    law's rounds all hold one (`dspark_preds`)."""
    out = []
    temps = frame["temperature"].to_numpy()
    for t in np.unique(temps):
        law_rows = np.flatnonzero(temps == t)
        order = law_rows[np.lexsort((frame["cand_index"].to_numpy()[law_rows],
                                     frame["order"].to_numpy()[law_rows]))]  # fmt: skip
        for name in CANDIDATE_SETS:
            rows = order if name == "all" else order[frame["draft_rank"].to_numpy()[order] == 0]
            part = frame.iloc[rows]
            preds = {c: part[c].to_numpy(np.float64) for c in ["draft_prob", *fitted]}
            preds |= _vllm_preds(part, crossfit)
            if name == "top":
                preds |= dspark_preds(part)
            out.append(LawSet(float(t), name, rows, preds))
    return out


def set_labels(frame: pd.DataFrame, ls: LawSet) -> dict[str, np.ndarray]:
    """The labels the losses are taken against: the event, and at T>0 the exact p(c) too."""
    part = frame.iloc[ls.rows]
    labels = {"event": part["event"].to_numpy(np.float64)}
    if law_kind(ls.temperature) == "sampling":
        labels["exact"] = part["label_target_prob"].to_numpy(np.float64)
    return labels


def _advantage(metric: str, ref: np.ndarray, est: np.ndarray) -> np.ndarray:
    return est - ref if LOWER_IS_BETTER[metric] else ref - est


def set_table(frame: pd.DataFrame, ls: LawSet, reference: str, n_resamples: int, seed: int
              ) -> list[dict]:  # fmt: skip
    """The table rows of one law's set: every estimator, metric and label."""
    part = frame.iloc[ls.rows]
    weights = PromptWeights.of(part["prompt_id"].to_numpy(), n_resamples, seed)
    labels, event = set_labels(frame, ls), part["event"].to_numpy(bool)
    draws = {name: metric_draws(pred, event, labels, weights) for name, pred in ls.preds.items()}
    head = {**law_columns(ls.temperature), "candidates": ls.candidates,
            "reference": reference, "n": len(ls.rows), "prompts": weights.n_prompts,
            "events": int(event.sum())}  # fmt: skip
    rows = []
    for name, by_metric in draws.items():
        for (metric, label), (point, resampled) in by_metric.items():
            rec = head | {"estimator": name, "metric": metric, "label": label}
            rec |= percentile_interval(point, resampled).columns("value")
            ref_point, ref_draws = draws[reference][(metric, label)]
            adv = percentile_interval(_advantage(metric, np.asarray(ref_point), np.asarray(point)),
                                      _advantage(metric, ref_draws, resampled))  # fmt: skip
            rows.append(rec | adv.columns("advantage"))
    return rows


def acceptance_table(frame: pd.DataFrame, sets: list[LawSet], reference: str,
                     n_resamples: int, seed: int) -> pd.DataFrame:  # fmt: skip
    """One row per law, candidate set, estimator, metric and label (`TABLE_COLUMNS`)."""
    rows = [r for ls in sets for r in set_table(frame, ls, reference, n_resamples, seed)]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def acceptance_metrics(table: pd.DataFrame) -> dict[str, float]:
    """MLflow metrics: `acceptance/<law>/<set>/<metric>_<label>/<estimator>` and the
    reference's advantage over each other estimator with its interval
    (`acceptance_adv`, `acceptance_adv_lo`, `acceptance_adv_hi`)."""
    out = {}
    for r in table.itertuples():
        parts = (r.law, r.candidates, f"{r.metric}_{r.label}", r.estimator)
        out[metric_key("acceptance", *parts)] = r.value
        if r.estimator != r.reference:
            for key, v in (("", r.advantage), ("_lo", r.advantage_lo), ("_hi", r.advantage_hi)):
                out[metric_key(f"acceptance_adv{key}", *parts)] = v
    return out


_FORMAT = {"auroc": "{:.3f}", "brier": "{:.4f}", "ece": "{:.4f}", "log_loss": "{:.3f}"}
_TITLE = {"auroc": "AUROC", "brier": "Brier", "ece": "ECE", "log_loss": "log-loss"}


def acceptance_cell(r: Mapping) -> str:
    """A figure of the table as printed: the value, then the reference's advantage and its
    interval ("0.861 +0.023 [+0.011, +0.035]"; the reference's own row: the value alone)."""
    fmt = _FORMAT[r["metric"]]
    value = fmt.format(r["value"])
    if r["estimator"] == r["reference"]:
        return value
    if not (np.isfinite(r["advantage_lo"]) and np.isfinite(r["advantage_hi"])):
        return f"{value} {fmt.format(r['advantage'])} [n/a]"
    signed = fmt.replace("{:", "{:+")
    return (f"{value} {signed.format(r['advantage'])} [{signed.format(r['advantage_lo'])}, "
            f"{signed.format(r['advantage_hi'])}]")  # fmt: skip


def _block(part: pd.DataFrame, label: str) -> list[str]:
    """One candidate set's lines for one label: an estimator per line, a metric per column."""
    metrics = [m for m in METRICS if not (m == "auroc" and label != "event")]
    cells = {(r["estimator"], r["metric"]): acceptance_cell(r)  # AUROC's label is the event
             for r in part[part["label"] == label].to_dict("records")}  # fmt: skip
    header = f"{'estimator':<16}" + "".join(f"{_TITLE[m] + ' (' + label + ')':>40}"
                                            for m in metrics)  # fmt: skip
    lines = [header]
    for name in dict.fromkeys(part["estimator"]):
        texts = [cells.get((name, m), "-") for m in metrics]
        lines.append(f"{name:<16}" + "".join(f"{t:>40}" for t in texts))
    return lines


def acceptance_text(table: pd.DataFrame, notes: Sequence[str] = ()) -> str:
    """The printed report: per law and candidate set, each estimator's figures and the
    reference's advantage with its 95% paired interval."""
    if table.empty:
        return ""
    ref = table["reference"].iloc[0]
    lines = [f"\n\n== acceptance estimators at depth 1 (X1 = c): value, then {ref}'s advantage "
             f"[95% paired prompt bootstrap] (AUROC: {ref} - estimator; losses: estimator - "
             f"{ref}; > 0: {ref} is better) =="]  # fmt: skip
    for (law, cands), part in table.groupby(["law", "candidates"], sort=False):
        r = part.iloc[0]
        lines.append(f"\n{law}, {CANDIDATE_SETS[cands]}: {r['n']:,} candidates, "
                     f"{r['events']:,} events, {r['prompts']} prompts")  # fmt: skip
        for label in dict.fromkeys(part["label"]):
            lines += _block(part, label)
    lines += [f"ECE: {ECE_BINS} equal-width bins on [0, 1]; log-loss clips predictions to "
              f"[{CLIP:g}, 1 - {CLIP:g}]; event: X1 = c as recorded; exact: p(c) (T>0).",
              f"vllm_*: vLLM's logistic model on the drafter's confidence ({VLLM_SOURCE}); "
              f"vllm_logit_q / vllm_margin fitted on the training half, vllm_online refitted "
              f"online over the prompts in recording order.", dspark_note(table), *notes]  # fmt: skip
    return "\n".join(lines)


def dspark_note(table: pd.DataFrame) -> str:
    """What the report says of DSpark's confidence: what it is where evaluated (at which
    laws), else why not (`DSPARK_NOTE`)."""
    laws = list(dict.fromkeys(table.loc[table["estimator"] == DSPARK, "law"]))
    if not laws:
        return DSPARK_NOTE
    missing = [law for law in dict.fromkeys(table["law"]) if law not in laws]
    why = f"; not at {', '.join(missing)}: {DSPARK_NOTE.split(': ', 1)[1]}" if missing else ""
    return f"{DSPARK_PRESENT} ({', '.join(laws)}){why}"
