"""The offline half of `bench.bench_drafters`: does a learned reranker help when the pool
comes from this drafter kind?

Per kind: the fitting prompts recorded as `decode.record` does (the default tree pool, B =
59, `run.score=record`, both laws, T_d = 0, so the pairs 0|0 and 1|0), cached under the
bench's cache folder; their candidate table (`features.extract`); then `rerank.train`'s
job in this process (`train_and_evaluate`: its default rerankers cross-fitted by prompt
halves, every rule evaluated, paired prompt-bootstrap intervals) at the bench's budgets.
Only its summary is read here; its tables and MLflow run stay in the cache folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from decode.recording import record_traces
from decode.stream import DecodeSettings
from features.extract import extract
from pairs.models import ModelPair
from pairs.prompts import Prompt
from rerank.config import RerankConfig
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from specrank.statistics.bootstrap import ci_text
from tree.config import DecodeConfig, PoolConfig, SelectConfig

# the rules printed: the oracle-free ceiling (root), the learned rerankers, a calibration control
SHOWN = ("root", "base_lgbm", "rows_lgbm", "rows_extra_lgbm", "iso_q1")
RECORD_BUDGET = 59


def kind_store(pair: ModelPair, kind: str, fit: list[Prompt], max_new: int, cache: Path) -> Path:
    """The kind's trace store and candidate table (recorded once, then reused). Returns the
    folder holding `traces/` and `features/`, named for the kind, the prompts (their number
    and a digest of their ids: another --prompts takes other fitting prompts) and the new
    tokens. The drafter's weights are not: after retraining a kind, delete its folder."""
    ids = hashlib.sha256("\n".join(p.id for p in fit).encode()).hexdigest()[:8]
    root = cache / f"{kind}-{len(fit)}x{max_new}-{ids}"
    traces, features = root / "traces", root / "features"
    if (features / "manifest.json").exists():
        return root
    for temperature in (0.0, 1.0):
        dec = DecodeConfig(temperature=temperature, max_new_tokens=max_new, draft_temperature=0.0)
        s = DecodeSettings(PoolConfig(), SelectConfig(budget=RECORD_BUDGET), dec)
        # as decode.record's manifest: the sections that shape a round, the temperature a
        # shard key (one store holds both laws)
        sections = {k: asdict(getattr(s, k)) for k in ("pool", "select", "decode")}
        del sections["decode"]["temperature"]
        manifest = {**sections, "bench": "bench.bench_drafters", "drafter_kind": kind}
        record_traces(traces, pair, fit, s, 4, manifest, progress=False)
    extract(traces, features, log=lambda _: None)
    return root


def offline_gains(
    pairs: dict[str, ModelPair], fit: list[Prompt], max_new: int, budgets: list[int],
    cache: Path, n_resamples: int,
) -> pd.DataFrame:  # fmt: skip
    """One row per kind, law, budget (drafted nodes) and shown rule: the gain in expected
    accepted tokens over draft, with its interval (rerank.train's summary columns)."""
    parts = []
    for kind, pair in pairs.items():
        root = kind_store(pair, kind, fit, max_new, cache)
        rerank = RerankConfig(traces=str(root / "traces"), features=str(root / "features"),
                              budgets=budgets, n_resamples=n_resamples, fits=None)  # fmt: skip
        tracking = MlflowConfig(tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                experiment="bench_drafters")  # fmt: skip
        result = train_and_evaluate(rerank, tracking, {"bench": "drafters", "kind": kind}, 0,
                                    root / "train")  # fmt: skip
        s = result.summary
        s = s[s["rule"].isin(SHOWN) & (s["weighting"] == "round")]
        parts.append(s.assign(kind=kind))
    cols = ["kind", "law", "pair", "budget", "rule", "accepted", "gain", "gain_lo", "gain_hi",
            "prompts", "rounds"]  # fmt: skip
    out = pd.concat(parts, ignore_index=True)
    return out[[c for c in cols if c in out]]


def offline_text(gains: pd.DataFrame) -> str:
    """Per law and budget (the paper's B = drafted + 1), each kind's gains over draft."""
    lines = ["\n== offline, on traces recorded with each kind (cross-fitted; relative gain in "
             "expected accepted tokens over draft, rule / draft - 1 [paired 95% CI])"]  # fmt: skip
    for (law, b), part in gains.groupby(["law", "budget"], sort=False):
        pair = part["pair"].iloc[0] if "pair" in part else ""
        lines.append(f"  {law} {pair} B={b + 1} ({b} drafted):")
        for kind, rows in part.groupby("kind", sort=False):
            n = int(rows["prompts"].iloc[0])
            cells = [f"{r['rule']} {ci_text(r['gain'], r['gain_lo'], r['gain_hi'])}"
                     for _, r in rows.iterrows()]  # fmt: skip
            lines.append(f"    {kind:<11} ({n} prompts) " + ", ".join(cells))
    return "\n".join(lines)
