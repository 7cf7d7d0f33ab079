"""`python -m decode.pocket`, `.eagle3` and `.block`: the entry points of the pocket
recipes (`recipes.pocket`), kept at their command names."""
