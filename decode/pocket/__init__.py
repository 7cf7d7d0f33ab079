"""`python -m decode.pocket` and `python -m decode.pocket.eagle3`: the entry points of the pocket
recipes (`recipes.pocket`), kept at their command names."""
