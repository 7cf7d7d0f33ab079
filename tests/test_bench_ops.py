"""`bench.bench_ops` at debug size: the counter counts exactly, the stages come from the
decoder's clocks, and the printed blocks and ratios have their documented form. Timings are
never asserted."""

from __future__ import annotations

import json
import re
import sys

import torch

import decode.round as online_round
from bench.bench_ops import (
    ROOT,
    OpCounter,
    count_ops,
    decode_rounds,
    load_kind,
    main,
    stage_marks,
)
from pairs.prompts import encode_prompt

LINE = re.compile(r"^(\w+) B=(\d+): (\d+) ops$")


def test_a_known_function_counts_its_aten_ops_exactly():
    def three() -> None:
        (torch.ones(3) + 1).sum()  # ones, add, sum

    def loop(k: int) -> None:
        x = torch.zeros(2)  # 1 op
        for _ in range(k):
            x = x * 2  # k ops

    assert count_ops(three) == 3
    assert [count_ops(lambda k=k: loop(k)) for k in (0, 1, 5)] == [1, 2, 6]
    assert count_ops(lambda: None) == 0


def test_the_stages_follow_the_decoders_clock():
    counter = OpCounter(("a", "b", "c"))
    x = torch.ones(2)
    with stage_marks(counter), counter:
        clock = online_round.StageClock(torch.device("cpu"))  # what decode_round builds
        x = x + 1  # a: 1
        clock.mark()
        clock.mark()  # b: none
        x = x + 1
        x = x * 3  # c: 2
        clock.mark()
        x.sum()  # after the round's last mark: outside
    assert counter.rounds == [[1, 0, 2]] and counter.outside == 1
    assert online_round.StageClock.__name__ == "StageClock"  # the decoder's clock restored
    assert len(clock.durations_ms()) == 3


def test_every_op_of_a_decode_is_in_one_stage_or_outside_the_rounds():
    pair = load_kind("standalone")
    ids = encode_prompt(pair.tokenizer, "Name three colours.")
    total, counter = OpCounter(()), OpCounter(online_round.STAGES)
    with total, stage_marks(counter), counter:  # total: outermost, sees every op
        rounds = decode_rounds(pair, [ids], 8, 8)
    assert len(counter.rounds) == len(rounds) > 1
    assert all(r[0] > 0 and r[4] > 0 for r in counter.rounds)  # draft, verify
    assert counter.outside > 0  # the prefill
    assert sum(map(sum, counter.rounds)) + counter.outside == total.outside


def _blocks(out: str) -> dict[tuple[str, int], list[str]]:
    """(kind, B) -> the lines of its block, the `<kind> B=<b>: <n> ops` line first."""
    lines, blocks, key = out.splitlines(), {}, None
    for line in lines:
        m = LINE.match(line)
        if m:
            key = (m[1], int(m[2]))
            blocks[key] = [line]
        elif key is not None and line.startswith("  "):
            blocks[key].append(line)
        else:
            key = None
    return blocks


def test_eagle3_rounds_count_by_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)
    out = tmp_path / "ops.json"
    argv = ["--kinds", "eagle3", "--budgets", "8", "59", "--prompts", "1", "--tokens", "8"]
    run = main([*argv, "--json", str(out)])["current"][0]
    text = capsys.readouterr().out
    blocks = _blocks(text)
    assert list(blocks) == [("eagle3", 8), ("eagle3", 59)]
    res = {r["budget"]: r for r in run["results"]}
    for (_, b), lines in blocks.items():
        assert lines[0] == f"eagle3 B={b}: {res[b]['ops']['draft']:.0f} ops"
        assert [ln.split()[0] for ln in lines[2:]] == [*online_round.STAGES, "round"]
    for r in res.values():
        assert r["rounds"] == len(r["per_round_ops"]) > 0
        assert min(r["ops"][s] for s in ("draft", "select", "verify", "bookkeeping")) > 0
        assert r["ops"]["root_pass"] == r["ops"]["features"] == 0  # rule=draft has neither
    # the pool does not depend on the budget: the draft stage is the same, or grows with it
    assert res[59]["ops"]["draft"] >= res[8]["ops"]["draft"]
    assert json.loads(out.read_text())["results"][0]["ops"] == res[8]["ops"]


def test_a_baseline_tree_prints_ratios(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = ["--kinds", "standalone", "--budgets", "8", "--prompts", "1", "--tokens", "2",
            "--baseline", ".", "--repeats", "1", "--json", str(tmp_path / "ops.json")]  # fmt: skip
    runs = main(argv)
    text = capsys.readouterr().out
    assert [ln.split()[2] for ln in text.splitlines() if ln.startswith("run ")] == [
        "baseline", "current"]  # fmt: skip
    (lines,) = _blocks(text).values()
    assert LINE.match(lines[0]) and lines[1].split()[:7] == [
        "stage", "ops", "ms", "base", "ops", "base", "ms"]  # fmt: skip
    # the same code counts the same ops: every stage's ops ratio is exactly 1
    assert [ln.split()[5] for ln in lines[2:]] == ["1.000"] * (len(online_round.STAGES) + 1)
    assert "x: current / baseline" in text
    # the same code drafts the same pools: compared round by round, bit for bit
    assert re.search(r"^standalone B=8: pools and emitted tokens bit for bit the baseline's in "
                     r"all \d+ rounds$", text, re.M)  # fmt: skip
    assert all(len(run["results"][0]["pools"]) == len(run["results"][0]["emitted"]) > 0
               for tree in runs.values() for run in tree)  # fmt: skip
    saved = json.loads((tmp_path / "ops.json").read_text())
    assert set(saved) == {"baseline", "current"} and saved == json.loads(json.dumps(runs))
