"""Finished fits kept on disk, so a long `rerank.train` that is stopped resumes (`rerank.fits`).

One fit is one law x feature set x half. When it is done its model is saved in the
project's format (`rerank.fit.persist`: loading cannot execute anything), beside the
held-out half's phat (`.npy`, read without pickle) and its fitting time, under a key that
names everything the fit and the prediction read:

  the training rows' fingerprint (features and labels: `FittedReranker.train_fingerprint`),
  the predicted rows' fingerprint, the model kind, law, feature set and features, the task
  categories, the capacity, seed, token-prior split and pseudo-count, the prediction route,
  and the sample weights' digest.

A rerun with the same store and settings finds the key and takes the saved fit instead of
refitting; the model loads through `load_reranker`'s checks (its training fingerprint
included), and the phat is the one the first run computed, so the results are equal.
A fit is written to a temporary folder and renamed when complete: a run killed while
writing leaves nothing that a rerun would take.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rerank.fit.out_of_fold import SavedFit
from rerank.fit.persist import load_reranker, save_reranker
from specrank.runtime import faults
from specrank.settings.errors import Refusal

PHAT_FILE = "phat.npy"
FIT_FILE = "fit.json"
MODEL_DIR = "model"


@dataclass(frozen=True)
class FitFolder:
    """The folder of finished fits (`rerank.fits`); one subfolder per fit key."""

    root: Path

    def load(self, key: str, n_rows: int, features: list[str], fingerprint: str) -> SavedFit | None:
        """The saved fit of `key`, or None when there is none. A saved fit that does not
        match what this run would fit (features, training fingerprint, row count) is
        refused by name, not refitted silently."""
        folder = self.root / key
        if not folder.is_dir():
            return None
        model = load_reranker(folder / MODEL_DIR, features, fingerprint)
        phat = np.load(folder / PHAT_FILE, allow_pickle=False)
        if phat.shape != (n_rows,):
            raise Refusal(
                f"{folder / PHAT_FILE}: expected {n_rows} held-out predictions, found "
                f"{phat.shape}; remove {folder} to fit it again"
            )
        seconds = float(json.loads((folder / FIT_FILE).read_text())["seconds"])
        return SavedFit(model, phat, seconds)

    def save(self, key: str, fit: SavedFit) -> None:
        """Write the fit under `key`, whole or not at all (a temp folder, then a rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        try:
            save_reranker(fit.model, tmp / MODEL_DIR, extra={"fit_key": key})
            np.save(tmp / PHAT_FILE, np.asarray(fit.phat, dtype=np.float64), allow_pickle=False)
            (tmp / FIT_FILE).write_text(json.dumps({"seconds": fit.seconds}))
            os.replace(tmp, self.root / key)  # atomic: a rerun sees the whole fit or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (self.root / key).is_dir():  # not a concurrent writer's identical fit
                raise
        faults.point("fit_saved", self.root / key)
