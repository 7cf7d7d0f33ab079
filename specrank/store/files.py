"""Files that are never half-written, and a free-space check before a long write.

`atomic_write` writes a file through a temp name and a rename, so a kill leaves either the
old file or the new one, never a part; an OSError (a full disk) is raised again naming the
file. `check_free_space` refuses a stage before it starts when its estimate of what it
will write exceeds what the disk holds free, with both figures.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from specrank.runtime import faults


class DiskSpaceError(OSError):
    """Not enough free space for what a stage is about to write."""


def named_os_error(err: OSError, path: Path | str, what: str = "cannot write") -> OSError:
    """`err` again, its message naming `path` (pyarrow's and pandas' do not always)."""
    return type(err)(err.errno, f"{path}: {what} ({err.strerror or err})")


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` then `tmp` renamed to `path`: readers see the whole file or none of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        faults.point("table_write", path)
        os.replace(tmp, path)
    except OSError as err:
        raise named_os_error(err, path) from err
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _existing(folder: Path) -> Path:
    """`folder`, or its nearest ancestor that exists (where it will be created)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return folder


def mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def check_free_space(folder: Path, need: float, what: str, setting: str) -> None:
    """Refuse when the disk of `folder` has less free space than `need` bytes (an estimate)."""
    free = shutil.disk_usage(_existing(folder)).free
    if free < need:
        raise DiskSpaceError(
            f"{what}: about {mb(need)} will be written to {folder}, but its disk has "
            f"{mb(free)} free; free some space or set {setting} to another disk"
        )
