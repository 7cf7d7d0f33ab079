"""The project's one error type for a refused setting or input.

A `Refusal` is raised where a setting, a file or an input is not what a command needs; its
message names the setting or file, what was expected and what was found. The entry points
catch it (`specrank.settings.cli.run_entry_point`, and `specrank.settings.cli.exits_on_refusal` under each
`@hydra.main`), print the message and exit with status 2, with no stack trace: the user's
input is at fault, not the code. Any other exception is a fault in the code and keeps its
trace. It subclasses `ValueError`, so callers that catch a bad value as `ValueError` keep
working.
"""

from __future__ import annotations


class Refusal(ValueError):
    """A setting or input refused, with a message naming it, what was expected and found."""
