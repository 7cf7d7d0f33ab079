"""`python -m decode.synth`: the entry point of the synthetic-trace recipe (`recipes.synth`)."""
