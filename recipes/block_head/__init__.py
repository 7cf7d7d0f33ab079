"""Block-family drafters (DFlash block, DSpark, Domino) for a real target, trained on the
EAGLE-3 head recipe's capture (`python -m decode.train_head model=<target>_<kind>`)."""
