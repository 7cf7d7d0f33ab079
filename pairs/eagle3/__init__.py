"""EAGLE-3 drafters: a head that drafts from the target's own hidden states (EAGLE-3 paper).

layout.py   head checkpoints on disk: config variants, weight key layouts, checks
save.py     writing a head in each of those layouts (tests, the pocket head)
head.py     the head as a torch module (fc, decoder layer(s), norm, draft lm_head, d2t)
capture.py  the target's auxiliary hidden states, taken from the passes decoding runs anyway
drafter.py  loading against a target; per-prompt state (head KV cache, features)
pool.py     pool growth with the head (the same pool as `tree.pool`, docs/method.md#pool)
"""
