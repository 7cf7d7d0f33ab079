"""`python -m decode.synth`: the old name of `python -m decode.synth_traces`, kept as an alias
(`specrank.settings.renames`)."""
