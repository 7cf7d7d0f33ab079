"""The settings: the root schema, checks, refusals, renames, the command line and its docs."""
