"""`bench.pool_pass.same_values`: two trees' rule values compared column by name."""

import pandas as pd

from bench.pool_pass import same_values


def test_columns_are_matched_by_name_and_a_missing_or_changed_one_counts(tmp_path):
    a = pd.DataFrame({"draft@B8": [1.0, 2.0], "root@B8": [3.0, 4.0], "task": ["x", "y"]})
    a.to_parquet(tmp_path / "a.parquet")
    a[["root@B8", "task", "draft@B8"]].to_parquet(tmp_path / "reordered.parquet")
    assert same_values(tmp_path / "a.parquet", tmp_path / "reordered.parquet") == (2, 2)
    a.assign(**{"root@B8": [3.0, 4.5]}).to_parquet(tmp_path / "changed.parquet")
    assert same_values(tmp_path / "a.parquet", tmp_path / "changed.parquet") == (1, 2)
    a.drop(columns="root@B8").to_parquet(tmp_path / "fewer.parquet")
    assert same_values(tmp_path / "a.parquet", tmp_path / "fewer.parquet") == (1, 2)
