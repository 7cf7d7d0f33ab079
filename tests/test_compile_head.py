"""bench.compile_head at debug size: compiled drafting emits eager drafting's tokens (slow: it compiles)."""

from __future__ import annotations

import pytest

from bench.compile_head import main


@pytest.mark.slow
def test_compiled_head_drafts_the_eager_tokens(capsys):
    main(["--prompts", "1", "--tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "compiled/eager" in out or "eager only" in out
