"""Typed settings of `python -m rerank.train` (the `rerank:` section; `mlflow:` is specrank.config's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrank.bootstrap import DEFAULT_RESAMPLES

# docs/method.md#rule-values: the default budgets and the sweep reported on request.
DEFAULT_BUDGETS = [8, 59]
SWEEP_BUDGETS = [2, 4, 8, 12, 16, 24, 32, 48, 59, 80, 100, 150, 200]
# docs/method.md#cross-fitting: calibration controls, and the draft-rank control (calibrate.rank_control)
CALIBRATORS = ("iso_q1", "per_depth", "rank_control")


@dataclass
class RerankModelConfig:
    """Gradient-boosted reranker (docs/method.md#cross-fitting): chosen with the `rerank_model` config group."""

    # lgbm (LightGBM) | hgb (scikit-learn HistGradientBoosting, the paper's: experiment=paper).
    # At paper scale LightGBM gives the same rule values, 1.5x faster, in less memory.
    kind: str = "lgbm"
    # Threads in all (None: every core). The cross-fitting folds fit at once, with an
    # equal share each (rerank.fit.halves.fold_workers): one thread per fit on two cores.
    n_threads: int | None = None
    # Capacity (rerank.boosting.Capacity). The paper fits 400 iterations at learning rate
    # 0.05 with <= 63 leaves (experiment=paper); by default the iterations are chosen by
    # early stopping on a prompt-grouped inner split of each training half, n_iter the most,
    # at learning rate 0.1: half the trees, so the fits and their predictions take about
    # half the time, for the same rule values (at paper scale every learned rule's gain
    # within 0.06 points of 0.05's, held-out squared error at most 0.8% higher; docs/benchmarks.md).
    n_iter: int = 400
    learning_rate: float = 0.1
    max_leaves: int = 63
    early_stopping: bool = True
    patience: int = 10  # iterations without a better held-out loss before stopping
    validation_share: float = 0.2  # share of the training half's prompts held out, per task
    refit: bool = False  # refit the whole half at the chosen count (else keep the inner model)
    # LightGBM's own distributed training: each half's fit on this many Ray Train workers,
    # each reading the rows of its share of the training prompts (rerank.on_nodes; with
    # launcher=ray, kind=lgbm). 1: each fit in one process.
    fit_nodes: int = 1


@dataclass
class RerankConfig:
    traces: str = "${paths.traces}"  # trace store (pools, exact target probabilities)
    features: str = "${paths.features}"  # candidate table of the same traces
    model: RerankModelConfig = field(default_factory=RerankModelConfig)
    # The paper's base and rows (docs/method.md#features); rows_extra adds the row features the paper lacks (rank under
    # each row, its entropy and top-1 mass, argmax vs the drafter's top). rows_matched adds
    # the matched row and the token-only rows, which the default decoder (score=tree) never
    # holds: there it reads what rows_extra reads and gained +0.0% over it at every law and
    # budget of `make run` (docs/benchmarks.md), so it is not fitted by default; it is a setting for
    # a decoder that scores the emitted address (score=record, top_m, frontier or pool).
    # The rule: a set whose paired gain over its parent stays under 0.5% everywhere
    # is not fitted by default
    # (rows_extra over rows: +0.6% [+0.3, +0.9] greedy at B=8, so it stays).
    feature_sets: list[str] = field(default_factory=lambda: ["base", "rows", "rows_extra"])
    calibrators: list[str] = field(default_factory=lambda: ["iso_q1", "per_depth", "rank_control"])
    # Draft-probability bins (equal-count) within each draft rank of the rank control. 1 is the
    # rank alone; 10 is as good as iso_q1 in held-out squared error on the default suite
    # (greedy 0.0418 vs 0.0455 at 1; sampling 0.0101 vs 0.0177), so a gain over it is not
    # flattered by a weak control.
    rank_q_bins: int = 10
    substitutions: list[str] = field(default_factory=lambda: ["cache", "same", "prev"])
    mixture_weights: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    # Cross-fitting halves (rerank.crossfit.prompt_halves): seeded = a seeded split
    # stratified by task (works for any ids); even_odd = the paper's prompt numbers,
    # refused unless every task's halves are balanced (|n0 - n1| <= max(1, n // 10)).
    halves: str = "seeded"
    # How the token prior of a training row leaves out labels (rerank.fit.token_prior):
    # prompt = of its own prompt too, as for held-out rows; row = the paper's alternation
    # by row (experiment=paper), which may keep labels of the same token and prompt.
    prior_split: str = "prompt"
    # Each half's models are fitted on this share of its training prompts, stratified by
    # task (rerank.fit.crossfit.prompt_subsample), and predict the whole other half: a
    # memory and time lever at 10x the paper's rounds. 1.0 (none) by default: on the
    # learning curves of bench/learning_curve.py more rows still lowered held-out loss.
    train_share: float = 1.0
    budgets: list[int] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    # Paired gains of rule_a over rule_b with their own intervals (rerank.report.comparisons), as
    # "rule_a:rule_b". None: the defaults among this run's rules (the paper's claims and ours,
    # from the registries: rerank.report.comparisons.DEFAULT_COMPARISONS); a list given is checked strictly (every rule must be evaluated by the run).
    comparisons: list[str] | None = None
    sweep: bool = False  # evaluate the SPEC budget sweep too
    top_m: int = 0  # restrict every rule to the M highest-ranked candidates (0: whole pool)
    # The scored-set policy of the decoder the figures are for (the words of run.score,
    # selection.policies): what each round's pass scores beside its tree, in the rule's own
    # order. It sets App. D.10's decoder without a root pass (root_if_covered: its own trees'
    # coverage) and draft_scored (draft's tree as large as the pass's scored prefixes).
    # tree = the default decoder's (run.score=tree); experiment=paper: top_m with M = 100.
    # Under top_m, frontier and pool a set reading the matched row (rows_matched) is
    # simulated on its own trees, fitted on draft's at budgets[0] (rerank.evaluate.matched).
    score: str = "tree"
    score_top_m: int = 100  # M of score=top_m (App. D.10's M = 100)
    # Report tables beside the rule values (rerank.evaluate.reports): retained-row agreement, coverage of
    # scored sets, draw-rule tree sizes, from the evaluation's own pass over the traces.
    reports: bool = True
    # The acceptance-estimator report (rerank.job.acceptance, docs/acceptance.md): the run's
    # rerankers, q, the controls and vLLM's logistic estimator judged as estimators of X1 = c
    # at depth 1 (AUROC, Brier, ECE, log-loss with paired intervals), and its calibration dump.
    acceptance: bool = True
    n_resamples: int = DEFAULT_RESAMPLES  # paired prompt-bootstrap resamples
    calibration_edges: int = 2_000_000  # pool edges sampled per half to fit per-depth maps
    # rounds per evaluation batch: bounds memory (two batches in flight at 2048 rounds hold
    # about 1.3 GB at paper scale)
    chunk_rounds: int = 2048
    # batches evaluated at once, one thread each (None: one per core and one more: a batch's
    # Python steps hold the GIL while the others compute; `bench.pool_pass` on 2 cores,
    # 40 k rounds, medians of 3: 15.1 s at 2 workers, 13.8 s at 3)
    workers: int | None = None
    # Finished fits (law x feature set x half) are kept here, and a rerun with the same store
    # and settings takes them instead of refitting (rerank.fit.resume); null: none kept.
    # `python -m rerank.train` keeps them under paths.fits.
    fits: str | None = None


@dataclass
class TransferConfig:
    """`python -m rerank.transfer`: saved rerankers evaluated on a trace store, not refitted.

    The store and every evaluation setting (budgets, substitutions, resamples, ...) come
    from the `rerank` section, as `rerank.train` reads them.
    """

    # A folder of saved rerankers (a rerank.train run folder's `rerankers/`, holding
    # <set>_<kind>_T<t>_fold<k>/), an MLflow URI of one (runs:/<run id>/rerankers), or
    # latest: the newest such folder under outputs/.
    rerankers: str = "latest"
    # Which cross-fitting half's models: fold k was fitted on half 1 - k. On another suite
    # either fold has seen none of its prompts; fold 0 by default.
    fold: int = 0
    # Prompts a loaded model was trained on (the store it was fitted on): skip = evaluate
    # only the others (on the training store with fold k: exactly half k, out of fold);
    # refuse = fail naming them.
    seen_prompts: str = "skip"


SECTIONS = {"rerank": RerankConfig, "transfer": TransferConfig}  # see specrank.config
