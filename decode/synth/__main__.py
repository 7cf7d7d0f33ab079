"""`python -m decode.synth`: synthetic traces (see `decode.synth.job`)."""

from decode.synth.job import main

main()
