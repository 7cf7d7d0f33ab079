"""Renamed settings: an old name on the command line answers with the new one; a store written
under an old name still opens; a logged run's parameters show under the new names."""

from __future__ import annotations

import pytest

from specrank.cli import checked_argv
from specrank.errors import Refusal
from specrank.renames import RENAMED, migrated_config, migrated_params
from specrank.tables import SchemaError
from specrank.trace_schema import trace_store


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_is_refused_with_the_new_one(old, new):
    with pytest.raises(Refusal, match=rf"'{old}' was renamed .*Did you mean '{new}'\?"):
        checked_argv([f"{old}=5"], {}, None)
    assert checked_argv([f"{new}=5"], {}, None) == [f"{new}=5"]


def test_a_store_written_under_an_old_name_opens_under_the_new_one(tmp_path):
    old = {"select": {"budget": 8, "top_m": 64}, "run": {"top_m": 100, "rule": "draft"}}
    store = trace_store(tmp_path / "traces")
    store.open_for_writing(old, {"target": "t"})
    new = {"select": {"budget": 8, "record_top_m": 64},
           "run": {"score_top_m": 100, "rule": "draft"}}  # fmt: skip
    assert migrated_config(old) == new
    trace_store(tmp_path / "traces").open_for_writing(new, {"target": "t"})
    other = {**new, "select": {"budget": 8, "record_top_m": 32}}
    with pytest.raises(SchemaError, match=r"select\.record_top_m"):
        trace_store(tmp_path / "traces").open_for_writing(other, {"target": "t"})


def test_logged_parameters_show_under_the_new_names():
    params = {"rerank.top_m": "0", "rerank.score_top_m": "100", "seed": "0"}
    assert migrated_params(params) == {"rerank.draft_top_m": "0", "rerank.score_top_m": "100",
                                       "seed": "0"}  # fmt: skip
