"""Typed settings of `python -m rerank.train` (the `rerank:` section; `mlflow:` is specrank.settings.config's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrank.settings.fields import setting
from specrank.statistics.bootstrap import DEFAULT_RESAMPLES

# docs/method.md#rule-values: the default budgets and the sweep reported on request.
DEFAULT_BUDGETS = [8, 59]
SWEEP_BUDGETS = [2, 4, 8, 12, 16, 24, 32, 48, 59, 80, 100, 150, 200]
# docs/method.md#cross-fitting: calibration controls, and the draft-rank control (calibrate.rank_control)
CALIBRATORS = ("iso_q1", "per_depth", "rank_control")


@dataclass
class BoosterConfig:
    """The rerankers' gradient-boosted trees (docs/method.md#cross-fitting): chosen with the
    `booster` config group."""

    # At paper scale LightGBM gives the same rule values as HGB, 1.5x faster, in less memory.
    kind: str = setting(
        "lgbm",
        "lgbm | hgb: LightGBM, or scikit-learn's HistGradientBoosting (the paper's; "
        "experiment=paper)",
    )
    n_threads: int | None = setting(
        None,
        "threads in all (null: every core); the cross-fitting folds fit at once, each with an "
        "equal share",
    )
    # Early-stopped at learning rate 0.1: half the paper's trees, so fits and predictions take
    # about half the time, for the same rule values (docs/benchmarks.md).
    n_iter: int = setting(
        400, "boosting iterations at most (the paper: 400 at learning rate 0.05; experiment=paper)"
    )
    learning_rate: float = setting(0.1, "shrinkage per iteration (the paper: 0.05)")
    max_leaves: int = setting(63, "leaves per tree at most")
    early_stopping: bool = setting(
        True,
        "choose the iterations by early stopping on a prompt-grouped inner split of each "
        "training half, n_iter the most (false: always n_iter)",
    )
    patience: int = setting(10, "iterations without a better held-out loss before stopping")
    validation_share: float = setting(
        0.2, "early stopping: share of the training half's prompts held out, per task"
    )
    refit: bool = setting(
        False,
        "early stopping: refit the whole training half at the chosen iteration count (false: "
        "keep the model fitted on the inner split)",
    )
    fit_nodes: int = setting(
        1,
        "LightGBM's distributed training: each half's fit on this many Ray Train workers, each "
        "reading its share of the training prompts (launcher=ray, kind=lgbm); 1: one process",
    )


@dataclass
class RerankConfig:
    """The training job (`python -m rerank.train`): which rerankers and controls it fits by
    cross-fitting, which rules and budgets it evaluates on the recorded pools, and what it
    reports."""

    traces: str = setting(
        "${paths.traces}", "trace store read (pools and exact target probabilities)"
    )
    features: str = setting("${paths.features}", "candidate table of the same traces")
    booster: BoosterConfig = field(default_factory=BoosterConfig)
    # rows_matched gained +0.0% over rows_extra under score=tree at every law and budget of
    # `make run` (docs/benchmarks.md): a set whose paired gain over its parent stays under
    # 0.5% everywhere is not fitted by default.
    feature_sets: list[str] = setting(
        ["base", "rows", "rows_extra"],
        "the rerankers fitted (docs/method.md#features): base, rows (the paper's), rows_extra "
        "(rank, entropy and top-1 mass of each row, argmax vs the drafter's top) and "
        "rows_matched (adds the matched and token-only rows, which only a decoder scoring the "
        "emitted address holds)",
    )
    calibrators: list[str] = setting(
        list(CALIBRATORS),
        "calibration controls fitted beside the rerankers: iso_q1 (the first draft factor "
        "through an isotonic map), per_depth (every factor, a map per depth), rank_control "
        "(the mean label at each draft rank: what the draft ranking alone gives)",
    )
    # 10 is as good as iso_q1 in held-out squared error on the default suite, so a gain over
    # it is not flattered by a weak control.
    rank_q_bins: int = setting(
        10,
        "equal-count draft-probability bins within each draft rank of the rank control "
        "(1: the rank alone)",
    )
    substitutions: list[str] = setting(
        ["cache", "same", "prev"],
        "retained rows whose probability replaces the first draft factor as rules "
        "(docs/method.md#retained-rows): the token-keyed cache, same-token and preceding rows",
    )
    mixture_weights: list[float] = setting(
        [0.25, 0.5, 0.75],
        "candidate weights w of the geometric mixtures (1 - w) log q + w log r of each "
        "substituted row; w is chosen on the other half",
    )
    halves: str = setting(
        "seeded",
        "seeded | even_odd: the cross-fitting halves, a seeded split stratified by task (any "
        "ids), or the paper's even and odd prompt numbers (refused unless every task's halves "
        "are balanced)",
    )
    prior_split: str = setting(
        "prompt",
        "prompt | row: how a training row's token prior leaves out labels: of its own prompt "
        "too, as for held-out rows, or the paper's alternation by row (experiment=paper)",
    )
    # On the learning curves of bench/learning_curve.py more rows still lowered held-out loss.
    train_share: float = setting(
        1.0,
        "share of each half's training prompts the models are fitted on (stratified by task); "
        "they still predict the whole other half. A memory and time lever; 1.0: all",
    )
    budgets: list[int] = setting(list(DEFAULT_BUDGETS), "the budgets B every rule is evaluated at")
    comparisons: list[str] | None = setting(
        None,
        "paired gains reported with their own intervals, as rule_a:rule_b; null: the default "
        "comparisons among this run's rules; a list given must name evaluated rules only",
    )
    sweep: bool = setting(
        False,
        f"also evaluate the budget sweep ({', '.join(map(str, SWEEP_BUDGETS))}) up to the "
        "pool's size or rerank.draft_top_m",
    )
    draft_top_m: int = setting(
        0,
        "restrict every rule to the M candidates draft ranks highest (0: the whole pool); "
        "formerly rerank.top_m",
    )
    # Under top_m, frontier and pool a set reading the matched row (rows_matched) is
    # simulated on its own trees, fitted on draft's at budgets[0] (rerank.evaluate.matched).
    score: str = setting(
        "tree",
        "tree | top_m | frontier | record | pool: the scored-set policy of the decoder the "
        "figures are for (as run.score): what each pass scores beside its tree, in the rule's "
        "own order; experiment=paper: top_m",
    )
    score_top_m: int = setting(
        100, "M of score=top_m: the same M as run.score_top_m online (the policy of run.score)"
    )
    reports: bool = setting(
        True,
        "report tables beside the rule values: retained-row agreement, coverage of scored "
        "sets, draw-rule tree sizes",
    )
    acceptance: bool = setting(
        True,
        "the acceptance-estimator report (docs/acceptance.md): rerankers, draft q, the controls "
        "and vLLM's logistic estimator judged as estimators of depth-1 acceptance",
    )
    n_resamples: int = setting(DEFAULT_RESAMPLES, "paired prompt-bootstrap resamples")
    calibration_edges: int = setting(
        2_000_000, "pool edges sampled per half to fit the per-depth maps"
    )
    # two batches in flight at 2048 rounds hold about 1.3 GB at paper scale
    chunk_rounds: int = setting(2048, "rounds per evaluation batch: bounds memory")
    # a batch's Python steps hold the GIL while the others compute, so one more than cores
    eval_threads: int | None = setting(
        None,
        "batches evaluated at once, one thread each (null: one per core, and one more); "
        "formerly rerank.workers",
    )
    fits: str | None = setting(
        None,
        "folder where finished fits (law x feature set x half) are kept; a rerun with the same "
        "store and settings takes them instead of refitting. null: none kept "
        "(`python -m rerank.train` keeps them under paths.fits)",
    )


@dataclass
class TransferConfig:
    """`python -m rerank.transfer`: saved rerankers evaluated on a trace store, not refitted.

    The store and every evaluation setting (budgets, substitutions, resamples, ...) come
    from the `rerank` section, as `rerank.train` reads them.
    """

    rerankers: str = setting(
        "latest",
        "saved rerankers: a rerank.train run folder's `rerankers/` (holding "
        "`<set>_<kind>_T<t>_fold<k>/`), an MLflow URI (`runs:/<run id>/rerankers`), or "
        "latest: the newest such folder under outputs/",
    )
    fold: int = setting(
        0,
        "which cross-fitting half's models: fold k was fitted on half 1 - k (on another suite "
        "neither has seen its prompts)",
    )
    seen_prompts: str = setting(
        "skip",
        "skip | refuse: prompts a loaded model was trained on: evaluate only the others (on "
        "the training store with fold k: exactly half k), or fail naming them",
    )


SECTIONS = {"rerank": RerankConfig, "transfer": TransferConfig}  # see specrank.settings.config
