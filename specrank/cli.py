"""Short command-line aliases for Hydra overrides (`traces=<dir>` for `features.traces=<dir>`).

Hydra only knows full paths into the schema; a few entry points document a
shorter form. Rewriting argv before `@hydra.main` parses it keeps Hydra's own
parsing (and its errors) for everything else.
"""

from __future__ import annotations

from collections.abc import Mapping


def expand_short_overrides(argv: list[str], aliases: Mapping[str, str]) -> list[str]:
    """Replace `alias=value` by `full.key=value` for the given aliases; leave the rest."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{aliases[key]}={value}" if sep and key in aliases else arg)
    return out
