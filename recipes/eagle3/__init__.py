"""An EAGLE-3 head for any causal-LM target (`python -m decode.train_head`): the target's
states captured once, then training-time-test training on them (`recipes.eagle3.fit`)."""
