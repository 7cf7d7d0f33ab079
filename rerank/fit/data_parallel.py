"""One law x feature set's cross-fit with each LightGBM fit spread over several nodes
(`rerank.booster.fit_nodes`): LightGBM's own distributed training (`tree_learner=data`), each
node holding the rows of a share of the training prompts, which it reads itself.

What the fit task (the process that runs the cross-fit) holds of the law's rows: their keys
and labels (prompt, task, round, candidate, token, label), never a feature. From them it
computes everything that reads labels across prompts, so no node needs another node's rows:
the halves, early stopping's inner split, every token prior (a training row's prior holds
labels of the other alternation part, `rerank.fit.token_prior`) and the fit keys
(`rerank.fit.resume`). A node is given its prompts and, aligned with the rows it reads for
them, each row's role (training or held out) and token prior (`NodeShare`); it checks that it
read the rows the fit task meant (their keys' digest) and builds its Dataset in row blocks.

Training (`train_share`, the same call on every node). LightGBM spans its network across the
nodes before any Dataset is built (the Datasets are handed to `lgb.train` unbuilt), so the bin
boundaries are found once, from every node's sample, and every node grows the same trees.
Early stopping: LightGBM computes a metric on each node's own held-out rows only, so its own
callback would stop the nodes at different iterations, and they would wait on each other.
After each iteration every node hands its held-out loss to `combine`, which returns the loss
over every node's held-out rows (the nodes' mean losses weighed by their rows, summed in node
order), the same value on every node; each stops where LightGBM's callback would stop on that
curve (`_StopTogether`). The fit task then keeps the count that callback keeps
(`early_stopping_count`) and cuts the model there (`refit=True`: refits the whole half at that
count).

On one node this is the single-process fit, the same trees
(`tests/test_data_parallel.py`). On several, the bins come from a sample spread over the
nodes and the histograms are summed in another order, so the trees differ a little; the
tolerance is stated and tested on a local Ray cluster (`tests/test_fit_nodes.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import lightgbm as lgb
import numpy as np
import pandas as pd

from rerank.fit.boosting import Capacity, _cut, lgbm_params
from rerank.fit.design import (
    CATEGORICAL,
    TOKEN_PRIOR,
    BlockDataset,
    DesignColumns,
    DesignRows,
    shared_strings,
)
from rerank.fit.fingerprints import digest_rows, fold_fit_keys, hash_rows
from rerank.fit.folds import check_grouped, inner_validation, train_prompts, training_masks
from rerank.fit.halves import frame_folds
from rerank.fit.models import (
    BATCH_ROUTE,
    LABEL_OF_LAW,
    FittedReranker,
    feature_list,
    law_labels,
)
from rerank.fit.out_of_fold import CrossfitResult, LawFits, SavedFit, _taken, predict_blocks
from rerank.fit.token_prior import (
    DEFAULT_PSEUDO_COUNT,
    PriorColumn,
    prior_groups,
    split_priors,
    token_prior_features,
)
from specrank.settings.errors import Refusal
from specrank.statistics.laws import law_kind

_KEYS = ("prompt_id", "task", "round_index", "cand_index", "token")  # what the fit task reads
TRAIN, HELD = 1, 2  # a row's role on its node (0: not read)


def key_columns(law: str) -> list[str]:
    """What the fit task reads of a law's rows: the keys and the law's label."""
    return [*_KEYS, LABEL_OF_LAW[law]]


def _hashed_columns(law: str) -> list[str]:
    """The columns a fit's fingerprint hashes here: the keys and the label (the features are
    the candidate table's, named by its fingerprint in the fit key)."""
    return [c for c in key_columns(law) if c != "task"]


@dataclass(frozen=True)
class NodeShare:
    """One node's rows: every row of `prompts`, in the store's order."""

    prompts: tuple[str, ...]
    role: np.ndarray  # int8 per row: TRAIN or HELD (prediction shares: TRAIN)
    prior: np.ndarray  # float32 per row: its token prior
    digest: str  # of the rows' keys and labels (`_hashed_columns`), checked by the node


@dataclass(frozen=True)
class NodeFit:
    """What every node of one fit trains with."""

    features: tuple[str, ...]
    categories: tuple[str, ...]
    law: str
    capacity: Capacity  # its learning rate, leaves and patience (where there are held-out rows)
    n_iter: int  # the iterations this fit trains at most
    seed: int
    n_threads: int


@dataclass(frozen=True)
class NodeResult:
    model: str  # LightGBM's model text (every node holds the same trees)
    curve: np.ndarray  # held-out loss over every node's held-out rows, after each iteration


Combine = Callable[[int, float, float], float]  # (iteration, this node's loss, its rows) -> all


class _StopTogether:
    """LightGBM's early stopping on the loss over every node's held-out rows (`combine`), so
    every node stops at the same iteration (module doc)."""

    order = 30  # after record_evaluation's (20)

    def __init__(self, combine: Combine, held: float, metric: str, patience: int) -> None:
        self.combine, self.held, self.metric, self.patience = combine, held, metric, patience
        self.curve: list[float] = []

    def __call__(self, env: lgb.callback.CallbackEnv) -> None:
        mine = next(r[2] for r in env.evaluation_result_list if r[1] == self.metric)
        self.curve.append(self.combine(env.iteration, mine, self.held))
        kept = early_stopping_count(np.asarray(self.curve), self.patience)
        if env.iteration + 1 - kept >= self.patience:
            raise lgb.callback.EarlyStopException(kept - 1, env.evaluation_result_list)


def train_share(rows: pd.DataFrame, share: NodeShare, spec: NodeFit, network: dict,
                combine: Combine) -> NodeResult:  # fmt: skip
    """Train on one node's rows (`rows`: what it read for `share.prompts`); `network`:
    LightGBM's network parameters (machines, ports; {} on one node); `combine`: the held-out
    loss over every node's held-out rows, from this node's (module doc)."""
    _check_read(rows, share, spec.law)
    features = list(spec.features)
    design = DesignColumns(rows, features, spec.categories, share.prior)
    y = law_labels(rows, spec.law)
    params = {**lgbm_params(spec.law, spec.capacity, spec.seed, spec.n_threads),
              "tree_learner": "data", "pre_partition": True, **network}  # fmt: skip
    cat_idx = [j for j, f in enumerate(features) if f in CATEGORICAL]

    def dataset(role: int, reference: lgb.Dataset | None = None) -> lgb.Dataset:
        index = np.flatnonzero(share.role == role)
        # not built here: lgb.train spans the network first, then bins (module doc)
        return BlockDataset([DesignRows(design, index)], label=y[index], feature_name=features,
                            categorical_feature=cat_idx, params=params, reference=reference)  # fmt: skip

    data = dataset(TRAIN)
    n_held = int((share.role == HELD).sum())
    if not n_held:
        booster = lgb.train(params, data, num_boost_round=spec.n_iter)
        return NodeResult(booster.model_to_string(), np.empty(0))
    stop = _StopTogether(combine, float(n_held), params["metric"], spec.capacity.patience)
    booster = lgb.train(params, data, num_boost_round=spec.n_iter,
                        valid_sets=[dataset(HELD, data)], valid_names=["held"],
                        callbacks=[stop])  # fmt: skip
    return NodeResult(booster.model_to_string(), np.asarray(stop.curve, np.float64))


def _check_read(rows: pd.DataFrame, share: NodeShare, law: str) -> None:
    columns = _hashed_columns(law)
    if (
        len(rows) != len(share.role)
        or digest_rows(columns, hash_rows(rows, columns)) != share.digest
    ):
        raise Refusal(
            f"a node read {len(rows)} rows for its {len(share.prompts)} prompts, not the "
            f"{len(share.role)} rows the fit task holds for them (keys or labels differ): the "
            f"candidate table (rerank.features) must be the same files at the same path on "
            f"every node"
        )


def early_stopping_count(curve: np.ndarray, patience: int) -> int:
    """The iterations LightGBM's early stopping callback keeps for this held-out loss curve:
    the first lowest loss, among the iterations trained until `patience` pass without a
    lower one."""
    best, best_i = np.inf, 0
    for i, loss in enumerate(curve):
        if loss < best:
            best, best_i = loss, i
        elif i - best_i >= patience:
            break
    return best_i + 1


def node_prompts(prompt_codes: np.ndarray, mask: np.ndarray, nodes: int) -> list[np.ndarray]:
    """The prompt codes of the rows in `mask` dealt to `nodes` nodes whole, in turn (in order
    of first appearance): each node's rows are then a sample of every part of the store, as
    the bin boundaries it finds for its share of the features must be (module doc);
    refused when a node would get none."""
    codes, first = np.unique(prompt_codes[mask], return_index=True)
    codes = codes[np.argsort(first)]
    if codes.size < nodes:
        raise Refusal(
            f"rerank.booster.fit_nodes={nodes}: {codes.size} prompt(s) to deal to {nodes} nodes; "
            f"each node needs one (expected a training half of >= {nodes} prompts)"
        )
    return [codes[k::nodes] for k in range(nodes)]


def node_shares(prompt_codes: np.ndarray, names: np.ndarray, row_hashes: np.ndarray,
                law: str, rows: Sequence[np.ndarray], role: np.ndarray,
                prior: np.ndarray) -> list[NodeShare]:  # fmt: skip
    """A `NodeShare` per node, of its rows (`rows`, a mask each: the rows of its prompts):
    their roles and priors, in row order."""
    shares = []
    for mine in rows:
        first = np.unique(prompt_codes[mine], return_index=True)[1]
        shares.append(NodeShare(
            tuple(str(p) for p in names[prompt_codes[mine][np.sort(first)]]),
            role[mine].astype(np.int8), prior[mine].astype(np.float32),
            digest_rows(_hashed_columns(law), row_hashes[mine]),
        ))  # fmt: skip
    return shares


class NodeRunner(Protocol):
    """Runs one fit's nodes (`rerank.on_nodes.RayNodes`; one node in this process: tests)."""

    def train(self, shares: list[NodeShare], spec: NodeFit) -> list[NodeResult]: ...

    def predict(self, model: FittedReranker, shares: list[NodeShare]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class _Half:
    """What the fit task knows of one law's rows (`key_columns`) for one cross-fit."""

    law: str
    codes: np.ndarray  # each row's prompt, as a code into `names`
    names: np.ndarray
    tasks: np.ndarray
    tokens: np.ndarray
    y: np.ndarray
    hashes: np.ndarray  # per row, of `_hashed_columns`


def crossfit_on_nodes(keys: pd.DataFrame, settings: LawFits, temperature: float,
                      feature_set: str, folds: dict[str, int], nodes: int, runner: NodeRunner,
                      store: str) -> CrossfitResult:  # fmt: skip
    """`LawFits.crossfit` with each half's fit trained on `nodes` nodes by `runner`.

    `keys`: the law's rows' `key_columns`, in the store's order (what every node reads in);
    `store`: the candidate table's fingerprint, in the fit keys in place of the features.
    """
    law = law_kind(temperature)
    if settings.kind != "lgbm":
        raise Refusal(f"rerank.booster.fit_nodes={nodes} trains LightGBM only; "
                         f"rerank.booster.kind is {settings.kind!r}")  # fmt: skip
    fold = frame_folds(keys, folds)
    prompt_ids = shared_strings(keys["prompt_id"])
    codes, names = pd.factorize(keys["prompt_id"])  # by its categories, not per row
    half = _Half(law, codes, np.asarray(names, dtype=object), shared_strings(keys["task"]),
                 keys["token"].to_numpy(np.int64), law_labels(keys, law),
                 hash_rows(keys, _hashed_columns(law)))  # fmt: skip
    check_grouped(prompt_ids, fold)
    features = feature_list(feature_set)
    masks = training_masks(fold, prompt_ids, half.tasks, settings.train_share, settings.seed)
    route = BATCH_ROUTE["lgbm"]
    fit_keys, prints = fold_fit_keys(
        _hashed_columns(law), half.hashes, masks, None, kind="lgbm", law=law,
        feature_set=feature_set, features=features, categories=list(settings.categories),
        capacity=vars(settings.capacity), seed=settings.seed, prior_split=settings.prior_split,
        pseudo_count=DEFAULT_PSEUDO_COUNT, route=route, fit_nodes=nodes, store=store,
    )  # fmt: skip
    saved = _taken(settings.fits, fit_keys, [int(p.sum()) for _, _, p in masks], features,
                   prints, f"{feature_set} {law}")  # fmt: skip
    by_prompt = prior_groups(settings.prior_split, prompt_ids)
    phat = np.full(len(keys), np.nan, dtype=np.float64)
    for i, (_, train, predict) in enumerate(masks):
        if saved[i] is None:
            prior, full = token_prior_features(half.tokens, half.y, train, DEFAULT_PSEUDO_COUNT,
                                               by_prompt)  # fmt: skip
            t0 = time.perf_counter()
            est = _fit_half(half, train, prior, by_prompt is not None, features, settings, nodes,
                            runner)  # fmt: skip
            model = FittedReranker(
                kind="lgbm", law=law, feature_set=feature_set, features=features,
                categories=list(settings.categories), estimator=est, token_prior=full,
                train_fingerprint=prints[i][0], seed=settings.seed, capacity=settings.capacity,
                train_prompts=train_prompts(prompt_ids[train]),
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            rows = [np.isin(codes, g) for g in node_prompts(codes, predict, nodes)]
            shares = node_shares(codes, half.names, half.hashes, law, rows,
                                 np.full(len(keys), TRAIN, np.int8), prior)  # fmt: skip
            phat_half = np.full(len(keys), np.nan, dtype=np.float64)
            for mine, part in zip(rows, runner.predict(model, shares), strict=True):
                phat_half[mine] = part
            saved[i] = SavedFit(model, phat_half[predict], seconds)
            if settings.fits is not None:
                settings.fits.save(fit_keys[i], saved[i])
        phat[predict] = saved[i].phat
    models, seconds = zip(*((f.model, f.seconds) for f in saved), strict=True)
    return CrossfitResult(phat, fold.astype(np.int8), models, seconds)


def _fit_half(half: _Half, train: np.ndarray, prior: np.ndarray, by_prompt: bool,
              features: list[str], settings: LawFits, nodes: int,
              runner: NodeRunner) -> lgb.Booster:  # fmt: skip
    """One half's LightGBM model (a Booster) trained on `nodes` nodes, chosen by early
    stopping as `rerank.fit.boosting.fit_estimator` chooses it."""
    capacity = settings.capacity
    role = np.zeros(len(train), np.int8)
    row_prior = prior.copy()
    rows = np.flatnonzero(train)
    if capacity.early_stopping:
        prompts = half.names[half.codes[rows]]  # the strings: the split orders them
        held = inner_validation(prompts, capacity.validation_share, settings.seed,
                                half.tasks[rows])  # fmt: skip
        column = PriorColumn(features.index(TOKEN_PRIOR), half.tokens, DEFAULT_PSEUDO_COUNT,
                             by_prompt)  # fmt: skip
        p_in, p_held = split_priors(column, half.y[rows], rows, held,
                                    prompts if by_prompt else None)  # fmt: skip
        role[rows[~held]], row_prior[rows[~held]] = TRAIN, p_in
        role[rows[held]], row_prior[rows[held]] = HELD, p_held
    else:
        role[rows] = TRAIN
    spec = NodeFit(tuple(features), tuple(settings.categories), half.law, capacity,
                   capacity.n_iter, settings.seed, settings.n_threads or 1)  # fmt: skip

    def trained(role: np.ndarray, prior: np.ndarray, spec: NodeFit) -> list[NodeResult]:
        groups = [np.union1d(*pair) for pair in zip(
            node_prompts(half.codes, role == TRAIN, nodes),
            node_prompts(half.codes, role == HELD, nodes) if (role == HELD).any()
            else [np.empty(0, np.int64)] * nodes, strict=True)]  # fmt: skip
        rows = [np.isin(half.codes, g) for g in groups]
        return runner.train(node_shares(half.codes, half.names, half.hashes, half.law, rows,
                                        role, prior), spec)  # fmt: skip

    results = trained(role, row_prior, spec)
    booster = lgb.Booster(model_str=results[0].model)
    if not capacity.early_stopping:
        return booster
    if any(not np.array_equal(r.curve, results[0].curve) for r in results):
        raise RuntimeError("the nodes of one fit recorded different held-out losses")
    chosen = early_stopping_count(results[0].curve, capacity.patience)
    if not capacity.refit:
        return _cut(booster, "lgbm", chosen)
    role[rows] = TRAIN
    return lgb.Booster(model_str=trained(role, prior, replace(spec, n_iter=chosen))[0].model)


def predict_share(rows: pd.DataFrame, share: NodeShare, model: FittedReranker,
                  n_threads: int) -> np.ndarray:  # fmt: skip
    """phat of one share of the predicted half (`rows`: what a node read for it)."""
    _check_read(rows, share, model.law)
    design = DesignColumns(rows, model.features, model.categories, share.prior)
    return predict_blocks(model, DesignRows(design, np.arange(len(rows))), n_threads,
                          BATCH_ROUTE["lgbm"])  # fmt: skip


def _own_loss(_iteration: int, loss: float, _held: float) -> float:
    """`Combine` on one node: the loss over every node's held-out rows is its own."""
    return loss


@dataclass(frozen=True)
class InProcess:
    """One node, in this process (LightGBM's network needs a process per node): the
    single-process fit run through the nodes' code."""

    read: Callable[[tuple[str, ...]], pd.DataFrame]  # a share's rows, by its prompts
    n_threads: int = 1

    def train(self, shares: list[NodeShare], spec: NodeFit) -> list[NodeResult]:
        if len(shares) != 1:
            raise ValueError(f"{len(shares)} nodes in one process; it runs one")
        return [train_share(self.read(shares[0].prompts), shares[0], spec, {}, _own_loss)]

    def predict(self, model: FittedReranker, shares: list[NodeShare]) -> list[np.ndarray]:
        return [predict_share(self.read(s.prompts), s, model, self.n_threads) for s in shares]
