"""`python -m decode.synth_traces`: the entry point of the synthetic-trace recipe
(`recipes.synth`)."""
