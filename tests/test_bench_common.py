"""The online benches' warm-up count (`bench.common.warmup_count`)."""

import pytest

from bench.common import warmup_count


def test_one_warmup_prompt_on_a_cpu_and_every_prompt_on_cuda():
    assert warmup_count(None, "cpu", 12) == 1
    assert warmup_count(None, "cuda", 12) == 12
    assert warmup_count(None, "cuda:0", 4) == 4
    assert warmup_count(None, "cpu", 0) == 0


def test_a_given_count_wins_and_is_capped_at_the_prompts():
    assert warmup_count(3, "cpu", 12) == 3
    assert warmup_count(0, "cuda", 12) == 0
    assert warmup_count(20, "cpu", 12) == 12


def test_a_negative_count_is_refused_by_name():
    with pytest.raises(ValueError, match="--warmup-prompts: expected >= 0, got -1"):
        warmup_count(-1, "cpu", 12)
