"""The pocket pair: a small target/drafter the project trains (`python -m decode.train_pocket`).

Stages (each a plain function in `recipes.pocket.recipe`): corpus -> tokenizer ->
target -> drafter -> export -> evaluate. The shipped result lives in
`models/pocket/` and loads like any Hugging Face checkpoint.
"""
