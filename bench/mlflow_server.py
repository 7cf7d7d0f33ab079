"""A real `mlflow server` on a free localhost port (tests and the fault soak).

SQLite backend and proxied artifacts under a folder; started in its own process group and
stopped by it (SIGTERM, then SIGKILL), so no worker outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

READY_TIMEOUT_S = 120  # server start-up is ~5-20 s on a loaded 2-core machine
STOP_TIMEOUT_S = 20
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it and its uvicorn worker), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):  # the group already exited
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # the worker exits just after the parent
    if group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A tracking server on a free localhost port; yields (base URL, process); always stopped."""
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log_path = root / "server.log"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", HOST, "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    # No background job runner (its extra processes are not needed to track runs).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://{HOST}:{port}"
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"mlflow server exited with code {proc.returncode} before answering on "
                        f"{url}/health; log tail:\n{_log_tail(log_path)}"
                    )
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"mlflow server on {url}: expected /health to answer 200 within "
                        f"{READY_TIMEOUT_S} s; it did not. Log tail:\n{_log_tail(log_path)}"
                    )
                time.sleep(0.25)
            yield url, proc
        finally:
            stop_server(proc)
