"""`python -m decode.pocket` and its `.eagle3`, `.block`, `.dspark`, `.domino`: old names of
`python -m decode.train_pocket` and its sub-commands, kept as aliases (`specrank.settings.renames`)."""
