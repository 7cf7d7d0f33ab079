"""Saved rerankers in formats that loading cannot execute.

A saved reranker is a folder:

    model.txt | model.skops   LightGBM's own text model, or scikit-learn via `skops.io`
    reranker.json             sidecar: kind, law, feature list, task categories,
                              candidate schema version, training-data fingerprint,
                              the capacity settings and the iterations the model
                              holds (chosen by early stopping, or the fixed count),
                              the model file's sha256, the token-prior table, and a
                              sha256 of the sidecar's own content

Why not pickle/joblib: unpickling runs arbitrary code, so a model file from
an MLflow store or a colleague would be a program. LightGBM's text format is
parsed, not executed; skops only rebuilds types on an explicit allow-list
(`TRUSTED_SKOPS_TYPES`; anything else is refused before loading).

`load_reranker` refuses, listing every difference it finds: a model file or
sidecar whose hash does not match (edited or corrupted), another candidate
schema version, a feature list or training fingerprint other than expected.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightgbm as lgb
import sklearn

from features.schema import CANDIDATE_VERSION
from rerank.fit.boosting import Capacity
from rerank.fit.models import LAWS, FittedReranker
from rerank.fit.token_prior import TokenPrior
from selection.rules import MODEL_KINDS
from specrank.settings.errors import Refusal
from specrank.store.tables import sha256_file

FORMAT = "specrank.reranker"
FORMAT_VERSION = 1
SIDECAR = "reranker.json"
MODEL_FILES = {"lgbm": "model.txt", "hgb": "model.skops"}
# Types a fitted HistGradientBoosting{Classifier,Regressor} holds beyond skops'
# defaults (checked with skops 0.16 / scikit-learn 1.9). Extend only after
# reading what the new type can do on construction.
TRUSTED_SKOPS_TYPES = frozenset(
    {
        "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
        "functools.partial",  # holds the fitted input validator below
        "sklearn.utils.validation.check_array",
    }
)


class RerankerLoadError(ValueError):
    """A saved reranker was refused; ``differences`` lists every reason."""

    def __init__(self, path: Path, differences: Sequence[str]) -> None:
        self.path = path
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(f"refusing saved reranker {path}:\n{lines}")


def _content_sha(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "sidecar_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_reranker(
    model: FittedReranker,
    path: str | Path,
    extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` into the folder ``path``; return the folder.

    ``extra`` (JSON-able, e.g. fold, source store fingerprint) is stored as is.
    An existing non-empty folder is refused unless ``overwrite``.
    """
    if model.kind not in MODEL_KINDS:
        raise ValueError(f"model.kind must be one of {MODEL_KINDS}; got {model.kind!r}")
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace")
    path.mkdir(parents=True, exist_ok=True)
    model_file = path / MODEL_FILES[model.kind]
    if model.kind == "lgbm":
        model.estimator.save_model(str(model_file))
    else:
        _skops_io().dump(model.estimator, model_file)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": model.kind,
        "law": model.law,
        "feature_set": model.feature_set,
        "features": list(model.features),
        "categories": list(model.categories),
        "candidate_schema_version": CANDIDATE_VERSION,
        "train_fingerprint": model.train_fingerprint,
        "train_prompts": list(model.train_prompts),
        "seed": model.seed,
        "capacity": vars(model.capacity),  # the settings, early stopping's included
        "n_iter": model.n_iter,  # the iterations the model holds (early stopping: chosen)
        "model_file": model_file.name,
        "model_sha256": sha256_file(model_file),
        "token_prior": model.token_prior.to_dict(),
        "libraries": {
            "scikit-learn": sklearn.__version__,
            "lightgbm": lgb.__version__,
            "skops": importlib.metadata.version("skops"),
        },
        "extra": dict(extra or {}),
    }
    meta["sidecar_sha256"] = _content_sha(meta)
    (path / SIDECAR).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return path


def _list_diff(expected: Sequence[str], found: Sequence[str]) -> list[str]:
    expected, found = list(expected), list(found)
    out = []
    missing = [f for f in expected if f not in found]
    extra = [f for f in found if f not in expected]
    if missing:
        out.append(f"features expected but not in the model: {missing}")
    if extra:
        out.append(f"features in the model but not expected: {extra}")
    if not missing and not extra and expected != found:
        out.append(f"feature order differs: expected {expected}, model has {found}")
    return out


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The sidecar of the saved reranker in folder ``path`` (unverified)."""
    file = Path(path) / SIDECAR
    if not file.exists():
        raise Refusal(f"{path}: no {SIDECAR} (not a folder written by save_reranker)")
    try:
        meta = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RerankerLoadError(
            Path(path),
            [f"{SIDECAR} is not valid JSON ({err}): truncated or corrupt; refit or re-save"],
        ) from err
    if not isinstance(meta, dict):
        raise RerankerLoadError(Path(path), [f"{SIDECAR} must hold a JSON object"])
    return meta


def load_reranker(
    path: str | Path,
    expected_features: Sequence[str] | None = None,
    expected_fingerprint: str | None = None,
) -> FittedReranker:
    """Load and verify a reranker saved by `save_reranker`; refuse any mismatch.

    Everything is checked before the model file is parsed; all differences
    are reported together (`RerankerLoadError.differences`).
    """
    # The checks run in a fixed order (sidecar, hash, format, features, fingerprint)
    # and report every difference together; nothing loads before them.
    path = Path(path)
    meta = read_sidecar(path)
    _check_format(path, meta)
    kind = meta.get("kind")
    model_file = path / str(meta.get("model_file"))
    diffs = _sidecar_differences(meta, kind)
    diffs += _model_file_differences(meta, kind, model_file)
    diffs += _expectation_differences(meta, expected_features, expected_fingerprint)
    if diffs:
        raise RerankerLoadError(path, diffs)

    estimator = _load_estimator(path, kind, model_file)
    features = list(meta["features"])
    _check_model_features(path, kind, estimator, features)
    loaded = FittedReranker(
        kind=kind,
        law=meta["law"],
        feature_set=meta["feature_set"],
        features=features,
        categories=list(meta["categories"]),
        estimator=estimator,
        token_prior=TokenPrior.from_dict(meta["token_prior"]),
        train_fingerprint=meta["train_fingerprint"],
        seed=int(meta["seed"]),
        capacity=Capacity(**meta["capacity"]),
        train_prompts=tuple(meta["train_prompts"]),
    )
    # sidecars written before early stopping carry no count (their models hold n_iter)
    if "n_iter" in meta and meta["n_iter"] != loaded.n_iter:
        raise RerankerLoadError(
            path,
            [f"the model holds {loaded.n_iter} iterations; the sidecar records {meta['n_iter']}"],
        )
    return loaded


def _check_format(path: Path, meta: Mapping[str, Any]) -> None:
    """Refuse another format at once: nothing else in the sidecar can be read then."""
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise RerankerLoadError(
            path,
            [
                f"format: expected {FORMAT!r} version {FORMAT_VERSION}, found "
                f"{meta.get('format')!r} version {meta.get('format_version')!r}"
            ],
        )


def _sidecar_differences(meta: Mapping[str, Any], kind: Any) -> list[str]:
    """The sidecar's own hash, and a kind and law this code knows."""
    diffs = []
    if meta.get("sidecar_sha256") != _content_sha(meta):
        diffs.append(f"{SIDECAR} was modified after saving (content sha256 does not match)")
    if kind not in MODEL_KINDS or meta.get("law") not in LAWS:
        diffs.append(
            f"kind/law: expected one of {MODEL_KINDS} / {LAWS}, found {kind!r} / {meta.get('law')!r}"
        )
    return diffs


def _model_file_differences(meta: Mapping[str, Any], kind: Any, model_file: Path) -> list[str]:
    """The model file's name for ``kind``, its presence and its recorded hash."""
    if kind in MODEL_KINDS and meta.get("model_file") != MODEL_FILES[kind]:
        return [f"model file: expected {MODEL_FILES[kind]!r}, found {meta.get('model_file')!r}"]
    if not model_file.is_file():
        return [f"model file {model_file.name} is missing"]
    got = sha256_file(model_file)
    if got != meta.get("model_sha256"):
        return [
            f"model file {model_file.name} was modified or corrupted: sha256 {got[:16]}... "
            f"!= recorded {str(meta.get('model_sha256'))[:16]}..."
        ]
    return []


def _expectation_differences(
    meta: Mapping[str, Any],
    expected_features: Sequence[str] | None,
    expected_fingerprint: str | None,
) -> list[str]:
    """The candidate schema version, and the caller's features and fingerprint when given."""
    diffs = []
    if meta.get("candidate_schema_version") != CANDIDATE_VERSION:
        diffs.append(
            f"candidate schema version: expected {CANDIDATE_VERSION}, "
            f"found {meta.get('candidate_schema_version')!r}"
        )
    if expected_features is not None:
        diffs += _list_diff(expected_features, meta.get("features", []))
    if expected_fingerprint is not None and meta.get("train_fingerprint") != expected_fingerprint:
        diffs.append(
            f"training-data fingerprint: expected {expected_fingerprint}, "
            f"found {meta.get('train_fingerprint')}"
        )
    return diffs


def _check_model_features(path: Path, kind: str, estimator: Any, features: list[str]) -> None:
    """The parsed model's input count and stored feature order must be the sidecar's."""
    n_model = estimator.num_feature() if kind == "lgbm" else int(estimator.n_features_in_)
    if n_model != len(features):
        raise RerankerLoadError(
            path, [f"the model has {n_model} inputs; the sidecar lists {len(features)} features"]
        )
    # The feature order stored in the model itself (LightGBM: its feature names; HGB: the
    # list fit_estimator attached) must be the sidecar's: a swap would silently move columns.
    in_model = (
        estimator.feature_name()
        if kind == "lgbm"
        else getattr(estimator, "specrank_features_", None)
    )
    if in_model is None:
        raise RerankerLoadError(path, ["the model file stores no feature names to check"])
    if list(in_model) != features:
        raise RerankerLoadError(path, _list_diff(features, list(in_model)))


def _load_estimator(path: Path, kind: str, model_file: Path) -> Any:
    if kind == "lgbm":
        return lgb.Booster(model_file=str(model_file))
    sio = _skops_io()
    untrusted = set(sio.get_untrusted_types(file=model_file))
    unexpected = sorted(untrusted - TRUSTED_SKOPS_TYPES)
    if unexpected:
        raise RerankerLoadError(
            path, [f"{model_file.name} holds types outside the allow-list: {unexpected}"]
        )
    return sio.load(model_file, trusted=sorted(untrusted))


def _skops_io() -> Any:
    """`skops.io`, imported on first use: importing it takes about 3 s (it walks
    scikit-learn's types), which every command that merely imports this module (a
    `--cfg job` included) would pay, and only HGB models need it."""
    import skops.io

    return skops.io
