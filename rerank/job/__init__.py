"""The stages of `rerank.train`: fitting, evaluation, what the run logs."""
