"""A fitted reranker inside the online decoder: loading with checks, round features, fast phat.

Per round (R = 1), before verification:

    retained rows  -> first-level log-probs (same maths as decode.retained.retained_stats)
    pool + context -> RoundArrays.one_round -> features.first_level.first_level_features
                      (the very functions features.extract runs on a trace shard)
    features       -> design matrix X [n1, F] float32 (= rerank.models.design_matrix)
    X              -> phat -> log phat [n1] float32 on the decoding device

so the reranker sees exactly the inputs it was trained on, and the selector
then ranks by log phat(x1) + log q(x2) + ... like the offline evaluator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from decode import retained as R
from decode.forest import ForestError, forest_from_hgb, forest_from_lightgbm
from decode.forest_eval import (
    CompiledForest,
    TorchForest,
    compile_forest,
    link,
    prepare,
    walk_numpy,
)
from decode.pool_growth import Pool
from decode.prompts import Prompt
from decode.round_record import HostPool
from decode.run_config import PREDICTORS, SEEN_PROMPTS
from decode.speculative import Stream
from features.first_level import FEATURE_DTYPES, first_level_features
from features.rounds import RoundArrays
from features.schema import ROW_FEATURES
from rerank.models import FEATURE_SETS, PHAT_FLOOR, TOKEN_PRIOR, FittedReranker, feature_list
from rerank.persist import RerankerLoadError, load_reranker, read_sidecar

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
MLFLOW_SCHEMES = ("runs:/", "models:/", "mlflow-artifacts:/")
# Inputs the online decoder can compute: every first-level feature, the task, the prior.
ONLINE_FEATURES = frozenset(FEATURE_DTYPES) | {"task", TOKEN_PRIOR}


def law_of_temperature(temperature: float) -> str:
    return "greedy" if temperature == 0 else "sampling"


def reranker_folder(source: str, tracking_uri: str) -> Path:
    """A local folder for `run.reranker`: the path itself, or an MLflow artifact downloaded."""
    if source.startswith(MLFLOW_SCHEMES):
        import mlflow  # only runs that name an MLflow URI pay for the import

        from rerank.tracking import resolve_tracking_uri

        uri = resolve_tracking_uri(tracking_uri)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=uri))
    path = Path(source)
    path = path if path.is_absolute() else PROJECT_ROOT / path
    if not path.is_dir():
        raise FileNotFoundError(
            f"run.reranker: no such folder '{source}' (expected a folder written by "
            f"rerank.persist.save_reranker, or an MLflow URI like runs:/<id>/rerankers/<name>)"
        )
    return path


def load_online_reranker(
    source: str | None, temperature: float, tracking_uri: str
) -> FittedReranker:
    """Load `run.reranker` with every check: integrity, feature list, law, computable inputs."""
    if not source:
        raise ValueError("run.rule=reranker needs run.reranker=<folder or MLflow URI>; got none")
    path = reranker_folder(source, tracking_uri)
    meta = read_sidecar(path)
    feature_set = meta.get("feature_set")
    if feature_set not in FEATURE_SETS:
        raise RerankerLoadError(
            path, [f"feature_set: expected one of {list(FEATURE_SETS)}, found {feature_set!r}"]
        )
    # The saved list must be today's definition of its feature set (order included).
    model = load_reranker(path, expected_features=feature_list(feature_set))
    missing = [f for f in model.features if f not in ONLINE_FEATURES]
    if missing:
        raise RerankerLoadError(path, [f"features the online decoder cannot compute: {missing}"])
    law = law_of_temperature(temperature)
    if model.law != law:
        kind = {"greedy": "classifier saved for T=0", "sampling": "regressor saved for T>0"}
        raise ValueError(
            f"run.reranker: {source} holds a {model.law} model, but decode.temperature="
            f"{temperature} decodes under the {law} law; use the {kind[law]}"
        )
    return model


def unseen_prompts(model: FittedReranker, prompts: list[Prompt], seen: str) -> list[Prompt]:
    """The prompts to decode with `model`, given `run.seen_prompts` (SPEC §8: no leakage).

    Online gains on the reranker's training prompts are in-sample; the saved
    model lists them, so the check is exact. refuse: fail if any is among the
    run's prompts; skip: drop them; allow: decode everything.
    """
    if seen not in SEEN_PROMPTS:
        raise ValueError(
            f"The 'run.seen_prompts' must be one of {list(SEEN_PROMPTS)}. Got {seen!r} instead."
        )
    if seen == "allow":
        return prompts
    if not model.train_prompts:
        raise ValueError(
            "run.reranker: the model lists no training prompts, so nothing shows it never saw "
            "the prompts this run decodes; refit it from a table with prompt ids, or set "
            "run.seen_prompts=allow"
        )
    trained = set(model.train_prompts)
    kept = [p for p in prompts if p.id not in trained]
    n_seen = len(prompts) - len(kept)
    if n_seen and seen == "refuse":
        example = [p.id for p in prompts if p.id in trained][:3]
        raise ValueError(
            f"run.reranker: the model was trained on {n_seen} of the {len(prompts)} prompts "
            f"this run decodes (e.g. {example}); its gains there would be in-sample. Set "
            f"run.seen_prompts=skip to decode only the others, or run.seen_prompts=allow"
        )
    if not kept:
        raise ValueError(
            f"run.seen_prompts=skip: the model was trained on all {len(prompts)} prompts of "
            f"this run; nothing is left to decode"
        )
    if n_seen:
        log.info("run.seen_prompts=skip: %d of %d prompts left out", n_seen, len(prompts))
    return kept


def forest_of(model: FittedReranker):
    """The model's trees as a `decode.forest.Forest` (raises ForestError if not exact)."""
    if model.kind == "lgbm":
        return forest_from_lightgbm(model.estimator)
    return forest_from_hgb(model.estimator)


def uses_rows(model: FittedReranker) -> bool:
    """Whether the model reads retained-row features (then the decoder keeps the rows)."""
    return any(f in ROW_FEATURES for f in model.features)


# -- retained rows at the first level (what decode.retained.trace_fields records) ---------------


def first_level_rows(
    cache: R.TokenKeyedCache,
    prev: R.PrevRows | None,
    root: int,
    first_tokens: Tensor,
    law_temperature: float,
    round_index: int,
) -> dict:
    """`fl_*` arrays [n1] (None where a row is absent), `cache_age`, `prev_tree_root_count`.

    The same ops as `retained_stats` on the rows the features read (cache, same-token,
    preceding), so the values are bitwise those a recorded trace holds.
    """
    rows, names, age = [], [], None
    hit = cache.lookup(root)
    if hit is not None:
        rows.append(hit[0][None])
        names.append("cache")
        age = round_index - hit[1]
    if prev is not None:
        if prev.same is not None:
            rows.append(prev.rows[prev.same][None])
            names.append("same")
        rows.append(prev.rows[prev.preceding][None])
        names.append("prev")
    out = {"fl_cache_logprob": None, "fl_same_logprob": None, "fl_prev_logprob": None}
    if rows:
        logp = torch.log_softmax(torch.cat(rows).float() / law_temperature, dim=-1)  # [k, V]
        fl = logp[:, first_tokens].cpu().numpy()  # [k, n1]
        for name, values in zip(names, fl, strict=True):
            out[f"fl_{name}_logprob"] = values
    if out["fl_prev_logprob"] is not None:  # the continuation's entry is missing, not -inf
        tokens = first_tokens.cpu().numpy()
        out["fl_prev_logprob"] = np.where(tokens == root, np.nan, out["fl_prev_logprob"])
    out["cache_age"] = age
    out["prev_tree_root_count"] = None if prev is None else prev.tree_root_count
    return out


@dataclass
class RoundContext:
    """What a round's features read besides the pool and the rows."""

    root: int
    prompt_length: int
    round_index: int
    tokens_before: int
    prev_accepted: int | None


def round_features(pool_host: dict[str, np.ndarray], ctx: RoundContext, rows: dict) -> dict:
    """SPEC §7 features of the round's first-level candidates: name -> [n1] (FEATURE_DTYPES)."""
    ra = RoundArrays.one_round(
        cand_token=pool_host["token"],
        cand_parent=pool_host["parent"],
        cand_depth=pool_host["depth"],
        cand_draft_logprob=pool_host["draft_logprob"],
        cand_expanded=pool_host["expanded"],
        root_token=ctx.root,
        prompt_length=ctx.prompt_length,
        round_index=ctx.round_index,
        tokens_before=ctx.tokens_before,
        prev_accepted=ctx.prev_accepted,
        **rows,
    )
    return first_level_features(ra)


def pool_to_host(pool: Pool) -> dict[str, np.ndarray]:
    """The pool arrays the features read, in one transfer per dtype."""
    ints = torch.stack([pool.token, pool.parent, pool.depth]).cpu().numpy()
    return {
        "token": ints[0],
        "parent": ints[1],
        "depth": ints[2],
        "draft_logprob": pool.draft_logprob.cpu().numpy(),
        "expanded": pool.expanded.cpu().numpy(),
    }


def reranker_first_factor(
    stream: Stream,
    task: str,
    pool: Pool,
    predictor: OnlinePredictor,
    ctx: RoundContext,
    law_temp: float,
    rows_needed: bool,
) -> tuple[Tensor, dict]:
    """log phat [n1] for this round's first-level candidates, and the features it came from."""
    host = pool_to_host(pool)  # host sync: the features are numpy
    first = pool.token[: pool.n_first]
    rows = {"fl_cache_logprob": None, "fl_same_logprob": None, "fl_prev_logprob": None}
    rows |= {"cache_age": None, "prev_tree_root_count": None}
    if rows_needed:
        rows = first_level_rows(
            stream.row_cache, stream.prev, ctx.root, first, law_temp, ctx.round_index
        )
    feats = round_features(host, ctx, rows)
    X = predictor.design(feats, host["token"][: pool.n_first], task)
    return predictor.first_logprob(X), feats


def update_retained(
    stream: Stream, host: HostPool, path: np.ndarray, cont: int, logits: Tensor, round_index: int
) -> None:
    """Keep this round's rows for the next round's row features (as round_trace_fields does)."""
    rr = R.RoundRows(
        stream.tokens[-1], host.token, host.parent, host.rank, host.in_tree, host.batch_row,
        path.tolist(), cont,
    )  # fmt: skip
    keep, prev = R.retained_batch_rows(rr)
    prev.rows = logits.index_select(0, torch.as_tensor(keep, device=logits.device))
    toks, rows = R.cache_writes(rr)
    stream.row_cache.store(
        toks, logits.index_select(0, torch.as_tensor(rows, device=logits.device)), round_index
    )
    stream.prev = prev


# -- prediction -----------------------------------------------------------------------------------


class OnlinePredictor:
    """Design matrix and phat for one round's first-level candidates, on the fastest exact route."""

    def __init__(
        self, model: FittedReranker, device: torch.device, predictor: str = "auto"
    ) -> None:
        if predictor not in PREDICTORS:
            raise ValueError(
                f"The 'run.predictor' must be one of {list(PREDICTORS)}. Got {predictor!r} instead."
            )
        self.model, self.device = model, device
        self.uses_rows = uses_rows(model)
        self.compiled: CompiledForest | None = None
        self.torch_forest: TorchForest | None = None
        self.route = "library"
        if predictor == "auto" and device.type == "cpu" and model.kind == "lgbm":
            return  # LightGBM's own C predictor: ~0.2 ms for 10 rows x 400 trees on a CPU
        if predictor == "library":
            return
        try:
            self.compiled = compile_forest(forest_of(model))
        except ForestError as err:
            if predictor == "forest":
                raise
            log.warning("run.predictor=auto: the library's predictor is used (%s)", err)
            return
        self.route = "forest"
        if device.type != "cpu":
            self.torch_forest = TorchForest(self.compiled, device)

    def design(self, features: dict[str, np.ndarray], tokens: np.ndarray, task: str) -> np.ndarray:
        """X [n1, F] float32, column for column what `rerank.models.design_matrix` builds."""
        m = self.model
        n = tokens.shape[0]
        X = np.empty((n, len(m.features)), dtype=np.float32)
        for j, name in enumerate(m.features):
            if name == TOKEN_PRIOR:
                X[:, j] = m.token_prior.transform(tokens)
            elif name == "task":  # index in the model's categories; NaN for an unknown task
                X[:, j] = m.categories.index(task) if task in m.categories else np.nan
            else:
                X[:, j] = features[name]
        return X

    def first_logprob(self, X: np.ndarray) -> Tensor:
        """log phat (phat clipped to [PHAT_FLOOR, 1] like predict_matrix) [n1] float32 on the device."""
        if self.torch_forest is not None:
            Xv = torch.from_numpy(prepare(self.compiled, X)).to(self.device, non_blocking=True)
            phat = link(self.compiled, self.torch_forest.raw(Xv))
            return torch.log(phat.clamp(PHAT_FLOOR, 1.0)).float()
        if self.compiled is not None:  # numpy walk (CPU)
            raw = walk_numpy(self.compiled, prepare(self.compiled, X))
            phat = np.clip(link(self.compiled, raw), PHAT_FLOOR, 1.0)
        else:
            phat = self.model.predict_matrix(X, n_threads=1)
        return torch.from_numpy(np.log(phat).astype(np.float32)).to(self.device)
