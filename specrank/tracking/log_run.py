"""`python -m specrank.tracking.log_run <run folder> [--tracking-uri URI]`: log a finished run folder.

For a `rerank.train` or `decode.run` folder whose MLflow logging failed (the tracking
server was down): it logs the folder's `mlflow_run.json` as that run would have
(`specrank.tracking.run_record`), to the URI the run used unless `--tracking-uri` names another.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specrank.tracking.run_record import log_record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the run folder (Hydra's output dir of the run)")
    ap.add_argument("--tracking-uri", default=None, help="default: the URI the run used")
    args = ap.parse_args()
    print(f"MLflow run {log_record(args.folder, args.tracking_uri)} logged from {args.folder}")


if __name__ == "__main__":
    main()
