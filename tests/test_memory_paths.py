"""The job's memory-saving paths give what the plain pandas calls gave (issue 31 point 1)."""

from __future__ import annotations

import ctypes.util
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rerank.evaluate import joined
from rerank.evaluate.joined import joined_columns, joined_rows, law_major_order, law_spans
from rerank.fit.design import codes_in, same_values, shared_strings
from rerank.fit.halves import frame_folds, prompt_folds
from specrank.runtime import memory
from specrank.runtime.memory import GrowthTrim, heap_retained, return_freed_heap

VALUES = ["p2", "p0", None, "p1", "p0", "p2", "p9"]


@pytest.mark.parametrize("dtype", ["str", "object", "category"])
def test_shared_strings_are_the_column_with_one_string_per_value(dtype):
    column = pd.Series(VALUES, dtype=dtype)
    got = shared_strings(column)
    assert got.dtype == object
    assert [None if pd.isna(v) else v for v in got] == VALUES
    same = [i for i, v in enumerate(VALUES) if v == "p0"]
    assert got[same[0]] is got[same[1]]  # one object per distinct value


@pytest.mark.parametrize("dtype", ["str", "object", "category"])
def test_codes_in_are_the_indexer_of_every_row(dtype):
    column = pd.Series(VALUES, dtype=dtype)
    categories = ["p0", "p1", "p2"]  # p9 and the missing row are not among them
    want = pd.Index(categories).get_indexer(column.astype(str))
    np.testing.assert_array_equal(codes_in(column, categories), want)
    assert codes_in(column, categories).tolist() == [2, 0, -1, 1, 0, 2, -1]


def test_frame_folds_map_each_prompt_and_refuse_one_outside_the_map():
    frame = pd.DataFrame({"prompt_id": pd.Series(["a", "b", "a", "c"], dtype="str")})
    got = frame_folds(frame, {"a": 1, "b": 0, "c": 1})
    assert got.dtype == np.int8 and got.tolist() == [1, 0, 1, 1]
    with pytest.raises(ValueError, match="outside the fold map"):
        frame_folds(frame, {"a": 1, "b": 0})


def test_prompt_folds_of_an_arrow_column_in_chunks_with_their_own_dictionaries():
    # the per-depth maps' path: each chunk dictionary-encoded on its own, "z" in no fold
    ids = pa.chunked_array([["b", "a", "z"], ["a", "c", "b", "b"]])
    column = pc.dictionary_encode(ids).to_pandas()
    got = prompt_folds(column, {"a": 0, "b": 1, "c": 1})
    assert got.tolist() == [1, 0, -1, 0, 1, 1, 1]


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _touch_and_free(mb: int) -> None:
    block = np.ones(mb << 17)  # float64: 8 bytes each, every page touched
    del block


def _chunks(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three chunks' temperatures (two laws, interleaved) and [R, 3] values."""
    rng = np.random.default_rng(seed)
    temps = [rng.choice(np.array([1.0, 0.0], np.float32), n) for n in (5, 0, 7)]
    return temps, [rng.normal(size=(len(t), 3)) for t in temps]


def test_joined_rows_are_the_concatenation_taken_in_order_and_free_the_parts():
    temps, parts = _chunks()
    order = law_major_order(np.concatenate(temps))
    want = np.concatenate(parts)
    np.testing.assert_array_equal(joined_rows(list(parts), None), want)
    held = list(parts)
    np.testing.assert_array_equal(joined_rows(held, order), want[order])
    assert held == []  # every part popped once placed


def test_law_spans_give_the_rows_groupby_gives_in_its_order():
    temps, parts = _chunks(1)
    frame = pd.DataFrame(np.concatenate(parts), columns=list("abc"))
    frame["temperature"] = np.concatenate(temps)
    order = law_major_order(frame["temperature"].to_numpy())
    values = [{c: p[:, j] for j, c in enumerate("abc")} for p in parts]
    joined = joined_columns(values, order)
    assert all(v == {} for v in values)
    spans = law_spans(frame["temperature"].to_numpy()[order])
    groups = list(frame.groupby("temperature"))
    assert [t for t, _ in spans] == [float(t) for t, _ in groups] == [0.0, 1.0]
    for (_, span), (_, part) in zip(spans, groups, strict=True):
        got = joined.iloc[span]
        np.testing.assert_array_equal(got.to_numpy(), part[list("abc")].to_numpy())
        # the same values in the same order: the same sums, bit for bit
        assert got.mean().tolist() == part[list("abc")].mean().tolist()
    with pytest.raises(ValueError, match="law by law"):
        law_spans(np.array([1.0, 0.0]))


GLIBC = pytest.mark.skipif(
    ctypes.util.find_library("c") is None or not os.path.exists("/proc/self/statm"),
    reason="needs glibc's mallopt and /proc",
)


@GLIBC
def test_the_heap_is_kept_inside_the_pass_and_returned_after_it():
    with heap_retained():
        before = _resident_mb()
        _touch_and_free(256)
        kept = _resident_mb() - before  # freed, but kept for the next chunk
    returned = _resident_mb() - before
    _touch_and_free(256)
    after = _resident_mb() - before  # glibc's defaults: mapped for itself, unmapped when freed
    assert kept > 200 and returned < 100 and after < 100, (kept, returned, after)
    assert return_freed_heap()


@GLIBC
def test_parts_made_in_the_pass_are_returned_as_they_are_joined(monkeypatch):
    """The parts come from the pass's kept heap, where a freed part stays resident until a
    trim: joining 256 MB of them must not hold them beside the joined array."""
    with heap_retained():
        parts = [np.ones(2**21) for _ in range(16)]  # 16 MB each, on the kept heap
    monkeypatch.setattr(joined, "TRIM_BYTES", 64 * 2**20)
    resident, trim = [], joined.release_freed_heap
    monkeypatch.setattr(
        joined, "release_freed_heap", lambda: (trim(), resident.append(_resident_mb()))
    )
    start = _resident_mb()
    out = joined_rows(parts)
    assert out.shape == (16 * 2**21,) and parts == []
    assert len(resident) == 4  # every 64 MB freed, the last with the last part
    # each trim finds what was placed so far (touched in `out`) and none of the parts freed
    assert max(resident) - start < 32, [round(r - start) for r in resident]


def test_same_values_compare_categoricals_whose_categories_differ():
    got = pd.Series(["p1", "p0", "p1"], dtype="category")  # one law's prompts
    want = pd.Series(["p0", "p1", "p2", "p1"], dtype="category").iloc[[1, 0, 2]]
    np.testing.assert_array_equal(
        same_values(got, want.reset_index(drop=True)), [True, True, False]
    )
    missing = pd.Series(["p1", None, "p1"], dtype="category")
    np.testing.assert_array_equal(same_values(missing, got), [True, False, True])
    as_str = pd.Series(["p1", "p0", "p9"], dtype="str")
    np.testing.assert_array_equal(same_values(got, as_str), [True, True, False])


@pytest.mark.parametrize("n", [0, 1, 2, 5, 6, 1001])
def test_the_row_agreement_median_is_numpy_s_in_float64(n):
    from rerank.evaluate.row_agreement import _mean64, _median64

    values = np.random.default_rng(n).random(n).astype(np.float32)
    values[: n // 3] = values[0] if n else values[:0]  # ties
    want = np.median(values.astype(np.float64)) if n else np.nan
    assert _median64(values) == want or (np.isnan(want) and np.isnan(_median64(values)))
    mean = _mean64(values)
    assert mean == values.astype(np.float64).mean() if n else np.isnan(mean)
    if n:
        assert np.isnan(_median64(np.append(values, np.float32(np.nan))))


@GLIBC
def test_a_growth_trim_returns_the_kept_heap_past_its_bound_only():
    """Freed blocks on the kept heap stay resident: the pass's trim returns them once resident
    memory has grown past the bound since the last return, and counts anew from there."""
    with heap_retained():
        trim = GrowthTrim(128 * 2**20)
        start = _resident_mb()
        _touch_and_free(48)  # kept, under the bound
        assert not trim() and _resident_mb() - start > 40
        _touch_and_free(256)  # kept, past it
        assert _resident_mb() - start > 200
        assert trim() and trim.trims == 1
        assert _resident_mb() - start < 32  # returned
        _touch_and_free(48)
        assert not trim()  # the bound counts from the return


def test_a_growth_trim_without_procfs_returns_the_heap_every_few_calls(monkeypatch):
    returns = []
    monkeypatch.setattr(memory, "resident_bytes", lambda: None)
    monkeypatch.setattr(memory, "release_freed_heap", lambda: returns.append(1))
    trim = GrowthTrim(2**20, fallback_every=3)
    assert [trim() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert len(returns) == trim.trims == 2


def test_a_crossfit_returns_no_heap_between_its_fits_and_predictions(monkeypatch):
    """The held-out predictions follow both halves' fits with no return of the heap between
    them (the job keeps it from its entry point), so they reuse the fits' freed blocks."""
    from rerank.fit import out_of_fold
    from rerank.fit.halves import prompt_halves
    from tests.candidate_frames import FAST, make_candidate_frame

    events: list[str] = []

    class Libc:  # every return of the heap ends in malloc_trim (specrank.runtime.memory)
        def malloc_trim(self, pad):
            events.append("trim")

        def mallopt(self, *args):
            return 1

    fit, predict = out_of_fold.fit_estimator, out_of_fold.predict_blocks
    monkeypatch.setattr(memory, "_libc", lambda: Libc())
    monkeypatch.setattr(out_of_fold, "fit_estimator",
                        lambda *a, **k: events.append("fit") or fit(*a, **k))  # fmt: skip
    monkeypatch.setattr(out_of_fold, "predict_blocks",
                        lambda *a, **k: events.append("predict") or predict(*a, **k))  # fmt: skip
    frame = make_candidate_frame(n_prompts=8, rounds=3, temperature=1.0, seed=3)
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    out_of_fold.crossfit_predict(
        frame, "base", "hgb", "sampling", folds, n_threads=1, capacity=FAST
    )
    assert events == ["fit", "fit", "predict", "predict"]
