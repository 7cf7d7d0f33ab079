"""`python -m decode.train_pocket`, `.eagle3`, `.block`, `.dspark` and `.domino`: the entry points
of the pocket recipes (`recipes.pocket`), kept at their command names."""
