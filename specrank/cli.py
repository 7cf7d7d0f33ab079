"""Short command-line aliases for Hydra overrides (`traces=<dir>` for `features.traces=<dir>`).

Hydra only knows full paths into the schema; a few entry points document a
shorter form. Rewriting argv before `@hydra.main` parses it keeps Hydra's own
parsing (and its errors) for everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


def expand_short_overrides(argv: list[str], aliases: Mapping[str, str]) -> list[str]:
    """Replace `alias=value` by `full.key=value` for the given aliases; leave the rest."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{aliases[key]}={value}" if sep and key in aliases else arg)
    return out


def unknown_key_message(argv: list[str], schema: type) -> str | None:
    """A "Did you mean" message for the first `a.b=v` override whose key the schema lacks.

    Hydra's own error names the key but not the valid ones; difflib over the
    fields of the section the key points into supplies the closest. Group choices
    (`model=pocket`), appends (`+a.b=v`), deletions (`~a`) and `hydra.*` are left
    to Hydra.
    """
    import difflib

    from omegaconf import DictConfig, OmegaConf

    root = OmegaConf.structured(schema)
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or "." not in key or key.startswith(("-", "+", "~", "hydra")):
            continue
        node, seen = root, []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
                break  # a value (or an open dict): nothing more to check
            keys = list(node.keys())  # not `part in node`: that is False for MISSING values
            if part not in keys:
                where = ".".join(seen) or "the config"
                close = difflib.get_close_matches(part, keys, n=3)
                hint = f" Did you mean {' or '.join(repr('.'.join([*seen, c])) for c in close)}?"
                valid = ", ".join(sorted(keys))
                return (
                    f"Key '{part}' is not in '{where}' (override {arg!r}).{hint if close else ''} "
                    f"Valid keys: {valid}"
                )
            node = node._get_node(part)
            seen.append(part)
    return None


def run_entry_point(main: Callable[[], None], aliases: Mapping[str, str] | None = None) -> None:
    """`python -m <stage>`: expand short aliases, refuse unknown keys with suggestions, run."""
    import sys

    from specrank.config import schema

    argv = expand_short_overrides(sys.argv[1:], aliases or {})
    message = unknown_key_message(argv, schema())
    if message:
        sys.exit(f"error: {message}")
    sys.argv = [sys.argv[0], *argv]
    main()
