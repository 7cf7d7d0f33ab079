"""The design's row layouts: LightGBM's row blocks, the float32 rows and HGB's column-major
copy, each fitting and predicting what the rows' own matrix gives."""

from __future__ import annotations

import numpy as np

from tests.candidate_frames import make_candidate_frame


def test_a_fit_from_row_blocks_is_the_fit_from_the_matrix(monkeypatch) -> None:
    # The bin sample is read in one gather (BlockDataset, in place of LightGBM's private
    # row-by-row sample) and the rest pushed in blocks; the model must be the one a Dataset
    # of the rows' float32 matrix gives, bit for bit.
    import lightgbm as lgb

    from rerank.fit import boosting
    from rerank.fit import design as design_module
    from rerank.fit.boosting import Capacity, fit_estimator, lgbm_params
    from rerank.fit.design import DesignColumns, DesignRows, design_matrix
    from rerank.fit.models import feature_list

    monkeypatch.setattr(design_module, "_SAMPLE_BLOCK", 97)  # many blocks, odd edges
    monkeypatch.setattr(DesignRows, "batch_size", 500)
    # bins from a sample of the rows (as every fit above 200k rows has), one sampled row
    # at a time from the blocks
    monkeypatch.setattr(boosting, "lgbm_params",
                        lambda *a: {**lgbm_params(*a), "bin_construct_sample_cnt": 900})  # fmt: skip
    frame = make_candidate_frame(n_prompts=30, rounds=20, temperature=0.0, seed=4)
    features, cats = feature_list("rows"), sorted(frame["task"].unique())
    prior = np.random.default_rng(1).random(len(frame)).astype(np.float32)
    y = frame["label_is_argmax"].to_numpy().astype(np.float64)
    rows = np.flatnonzero(np.random.default_rng(2).random(len(frame)) < 0.7)
    cap = Capacity(n_iter=15, learning_rate=0.1, max_leaves=15)
    design = DesignColumns(frame, features, cats, prior)
    # the override is the method LightGBM calls (a rename there would bypass it)
    assert "_Dataset__sample" in vars(lgb.Dataset)
    calls = []
    own = design_module.BlockDataset._Dataset__sample
    monkeypatch.setattr(design_module.BlockDataset, "_Dataset__sample",
                        lambda self, **kw: calls.append(kw["total_nrow"]) or own(self, **kw))  # fmt: skip
    est = fit_estimator(design, y, features, "lgbm", "greedy", cap, 3, 1, rows=rows)
    assert calls == [len(rows)] * 2  # the run of columns before the prior, and the prior's
    X = design_matrix(frame, features, cats, prior)[rows]
    assert np.isnan(X).any()  # missing features travel as NaN through the blocks
    # LightGBM's own sample of the rows: `seed` alone, no data_random_seed given
    params = {k: v for k, v in boosting.lgbm_params("greedy", cap, 3, 1).items()
              if k != "data_random_seed"}  # fmt: skip
    cat_idx = [features.index("task")]
    ref = lgb.train(params, lgb.Dataset(X, label=y[rows], feature_name=features,
                                        categorical_feature=cat_idx, params=params), 15)  # fmt: skip
    assert est.model_to_string() == ref.model_to_string()


def test_design_rows_serve_any_row_and_block_with_their_own_prior(monkeypatch) -> None:
    from rerank.fit import design as design_module
    from rerank.fit.design import DesignColumns, DesignRows, design_matrix
    from rerank.fit.models import feature_list

    monkeypatch.setattr(design_module, "_SAMPLE_BLOCK", 7)
    frame = make_candidate_frame(n_prompts=6, rounds=5, temperature=1.0, seed=2)
    features, cats = feature_list("base"), sorted(frame["task"].unique())
    X = design_matrix(frame, features, cats, np.arange(len(frame), dtype=np.float32))
    index = np.array([5, 3, 40, 41, 42, 0, 59, 17])
    own = -np.arange(index.size, dtype=np.float32)  # a prior of these rows' own
    rows = DesignRows(DesignColumns(frame, features, cats, np.arange(len(frame), dtype=np.float32)),
                      index, own, features.index("token_prior"))  # fmt: skip
    want = X[index]
    want[:, features.index("token_prior")] = own
    for i in [0, 1, 2, 7, 3, 4, 5, 6]:  # forward, with gaps and a step back
        row = rows[i]
        assert row.dtype == np.float64
        np.testing.assert_array_equal(row, want[i].astype(np.float64))
    np.testing.assert_array_equal(rows[2:6], want[2:6])
    np.testing.assert_array_equal(rows.matrix(), want)
    column_major = rows.column_major()
    assert column_major.dtype == np.float64 and column_major.flags.f_contiguous
    np.testing.assert_array_equal(column_major, want.astype(np.float64))
    # a float64 prior is rounded to float32 as the float32 rows round it
    j, prior64 = features.index("token_prior"), own.astype(np.float64) + 1 / 3
    third = DesignRows(rows.design, index, prior64, j)
    np.testing.assert_array_equal(third.column_major(), third.matrix().astype(np.float64))
    assert not np.array_equal(third.column_major()[:, j], prior64)


def test_hgb_fits_the_column_major_rows_as_it_fits_the_float32_rows() -> None:
    # scikit-learn's own fit on the rows' float32 matrix (the layout it copied three times)
    from sklearn.ensemble import HistGradientBoostingRegressor

    from rerank.fit.boosting import Capacity, fit_estimator
    from rerank.fit.design import DesignColumns, design_matrix
    from rerank.fit.models import feature_list

    frame = make_candidate_frame(n_prompts=30, rounds=20, temperature=1.0, seed=4)
    features, cats = feature_list("rows"), sorted(frame["task"].unique())
    prior = np.random.default_rng(1).random(len(frame))  # float64: rounded as the rows are
    y = frame["label_target_prob"].to_numpy().astype(np.float64)
    rows = np.flatnonzero(np.random.default_rng(2).random(len(frame)) < 0.7)
    cap = Capacity(n_iter=15, learning_rate=0.1, max_leaves=15)
    est = fit_estimator(DesignColumns(frame, features, cats, prior), y, features, "hgb",
                        "sampling", cap, 3, 1, rows=rows)  # fmt: skip
    X = design_matrix(frame, features, cats, prior.astype(np.float32))
    assert X.dtype == np.float32 and np.isnan(X).any()
    ref = HistGradientBoostingRegressor(
        max_iter=15, learning_rate=0.1, max_leaf_nodes=15, early_stopping=False,
        categorical_features=[f == "task" for f in features], random_state=3,
    ).fit(X[rows], y[rows])  # fmt: skip
    for ours, theirs in zip(est._predictors, ref._predictors, strict=True):
        np.testing.assert_array_equal(ours[0].nodes, theirs[0].nodes)
    np.testing.assert_array_equal(est.predict(X), ref.predict(X))
