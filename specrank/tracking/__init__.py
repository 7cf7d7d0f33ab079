"""MLflow: what a run logs, the run record beside its outputs, logging a finished folder."""
