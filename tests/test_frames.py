"""`specrank.store.frames.scanned_frame` gives the frame Arrow's whole-table conversion gives."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from specrank.store.frames import scanned_frame


@pytest.fixture
def dataset(tmp_path):
    rng = np.random.default_rng(0)
    for i, n in enumerate((7, 5, 9)):
        count = pa.array(rng.integers(0, 9, n).astype(np.int32),
                         mask=None if i < 2 else np.arange(n) % 3 == 1)  # fmt: skip
        pq.write_table(pa.table({
            "prompt": pa.array([f"p{i}-{j % 3}" for j in range(n)]),
            "law": pa.array(np.arange(n) % 2, pa.float32()),
            "x": pa.array(rng.normal(size=n).astype(np.float32)),
            "count": count,  # nulls only in the last file: float64 from its first batch on
            "flag": pa.array(rng.random(n) < 0.5),
            "cand": pa.array(np.arange(n, dtype=np.int16)),
        }), tmp_path / f"part-{i}.parquet")  # fmt: skip
    return ds.dataset(tmp_path, format="parquet")


@pytest.mark.parametrize("law", [None, 0.0, 1.0])
def test_the_frame_of_a_scan_in_batches_is_the_whole_table_s(dataset, law):
    where = None if law is None else pc.field("law") == pa.scalar(law, pa.float32())
    want = dataset.to_table(filter=where).to_pandas(strings_to_categorical=True)
    got = scanned_frame(dataset.scanner(filter=where, batch_size=2))
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got["count"].dtype == np.float64 and got["cand"].dtype == np.int16
    assert list(got["prompt"].cat.categories) == list(want["prompt"].cat.categories)


def test_a_scan_without_rows_gives_the_columns_and_no_rows(dataset):
    none = pc.field("law") == pa.scalar(7.0, pa.float32())
    got = scanned_frame(dataset.scanner(filter=none, columns=["prompt", "x"]))
    assert list(got.columns) == ["prompt", "x"] and len(got) == 0
