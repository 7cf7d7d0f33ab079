"""bench.verify_cost: every pass sees the same cache, and the command runs on the pocket target."""

from __future__ import annotations

from bench.verify_cost import main, time_passes
from tests.tiny_models import one_thread, tiny_pair


def test_passes_are_timed_per_token_count_on_the_same_cache(tmp_path):
    target = tiny_pair(tmp_path, "llama").target
    with one_thread():
        out = time_passes(
            target, [1, 3, 5], context=12, reps=2, seed=0, caches=("dynamic", "static")
        )
    assert set(out) == {(k, n) for k in ("dynamic", "static") for n in (1, 3, 5)}
    assert all(0 < r["head_ms"] < r["ms"] for r in out.values())


def test_the_command_prints_the_ratio_to_a_one_token_step(capsys):
    main(["--model", "pocket", "--tokens", "3", "--reps", "1", "--context", "16",
          "--cache", "dynamic", "static"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pocket target") and "x 1.00" in lines[2]
    assert [tuple(x.split()[:2]) for x in lines[2:]] == [
        ("dynamic", "1"),
        ("dynamic", "3"),
        ("static", "1"),
        ("static", "3"),
    ]
