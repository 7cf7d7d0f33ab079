"""`python -m features.extract`: trace store -> candidate table, one shard per trace shard.

    python -m features.extract                          # paths.traces -> paths.features
    python -m features.extract traces=<dir> out=<dir>   # short for features.traces=... features.out=...

Streaming: one trace shard in memory at a time. Resumable: shards already in
the output store are skipped. The output manifest records the source trace
store's fingerprint, so a rerun against changed traces is refused rather than
mixing two sources in one table. Parallel by shard: processes started on the
same stores split the shards between them through the store's claims, e.g.
`for i in 1 2; do python -m features.extract & done; wait` (bench/bench_scaling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import hydra
import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from features.config import FeaturesConfig
from features.from_trace import TRACE_COLUMNS, candidate_table
from features.schema import candidate_store
from specrank.settings.cli import exits_on_refusal, expand_short_overrides, run_entry_point
from specrank.settings.config import register_configs
from specrank.settings.errors import Refusal
from specrank.settings.paths import CONF_DIR, project_path
from specrank.store.claims import ShardRun
from specrank.store.files import check_free_space
from specrank.store.shard_store import ShardStore
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import trace_store


@dataclass
class ExtractReport:
    shards_written: int
    shards_skipped: int
    rounds: int  # in the shards written by this call
    candidates: int  # rows written by this call
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.candidates / self.seconds if self.seconds > 0 else float("nan")


# Candidate-table bytes per trace byte on disk: 0.16 measured on synthetic traces; 0.5 is a
# margin for pools with more first-level candidates per round.
CANDIDATE_BYTES_PER_TRACE_BYTE = 0.5


def extract(traces: Path, out: Path, log: Callable[[str], None] = print) -> ExtractReport:
    """Write the candidate table of the trace store `traces` into the store `out`."""
    source, files = _finished_trace_shards(traces)
    target = _open_candidate_store(source, out)
    start = time.perf_counter()
    shard_files = {
        Path(path).name.removeprefix("shard-").removesuffix(".parquet"): path for path in files
    }
    todo = target.pending(list(shard_files))
    need = CANDIDATE_BYTES_PER_TRACE_BYTE * sum(Path(shard_files[s]).stat().st_size for s in todo)
    check_free_space(out, need, "features.extract", "features.out (paths.features)")
    report = ExtractReport(0, len(shard_files) - len(todo), 0, 0, 0.0)
    run = _write_shards(target, todo, shard_files, traces, report, log, start)
    report.shards_skipped += run.skipped  # finished meanwhile by another extract process
    report.seconds = time.perf_counter() - start
    log(
        f"features.extract: {report.rounds:,} rounds -> {report.candidates:,} candidates in "
        f"{report.seconds:.1f} s ({report.rows_per_s:,.0f} rows/s); {report.shards_written} shard(s) "
        f"written, {report.shards_skipped} already done; table at {out}"
    )
    return report


def _finished_trace_shards(traces: Path) -> tuple[ShardStore, list[str]]:
    """The trace store at `traces` and its finished shard files; refuse an unreadable or empty one."""
    source = trace_store(traces)
    try:
        files = source.dataset().files  # checks the trace table name and schema version
    except SchemaError as err:
        raise SchemaError(f"features.extract: the trace store cannot be read: {err}") from err
    if not files:
        raise Refusal(
            f"features.extract: the trace store {traces} holds no finished shards; "
            f"record traces first (python -m decode.record)"
        )
    return source, files


def _open_candidate_store(source: ShardStore, out: Path) -> ShardStore:
    """The candidate store at `out`, opened with the source trace store's identity."""
    manifest = source.manifest()
    target = candidate_store(out)
    target.open_for_writing(
        config={
            "source_table": "trace",
            # the store's own (a v3 store reads as v4: its candidate tables stay resumable)
            "source_schema_version": manifest.get("schema_version"),
            "source_fingerprint": source.fingerprint(),
            "source_config_fingerprint": manifest.get("config_fingerprint"),
        },
        models=manifest.get("models", {}),
    )
    return target


def _write_shards(
    target: ShardStore,
    todo: list[str],
    shard_files: dict[str, str],
    traces: Path,
    report: ExtractReport,
    log: Callable[[str], None],
    start: float,
) -> ShardRun:
    """Build and write the candidate shards of `todo`, counting them into `report`."""
    last_log = start
    # Read the next pending shard on a thread while this one is processed (Parquet
    # decoding and numpy both release the GIL); at most two shards are in memory at
    # once. Several extract processes may share the stores (claims split the shards
    # between them): a prefetched shard another process took is dropped.
    with ThreadPoolExecutor(max_workers=1) as reader:
        ahead: dict = {}
        position = {sid: i for i, sid in enumerate(todo)}

        def prefetch(after: int) -> None:
            nxt = next((s for s in todo[after:] if not target.is_done(s)), None)
            if nxt is not None:
                ahead[nxt] = reader.submit(_read_trace_shard, shard_files[nxt])

        prefetch(0)

        def build(shard_id: str) -> pa.Table:
            read = ahead.pop(shard_id, None)
            ahead.clear()
            trace = read.result() if read is not None else _read_trace_shard(shard_files[shard_id])
            prefetch(position[shard_id] + 1)
            report.rounds += trace.num_rows
            try:
                return candidate_table(trace)
            except (SchemaError, ValueError) as err:
                raise type(err)(
                    f"features.extract: trace shard {shard_id} of {traces}: {err}"
                ) from err

        def progress(shard_id: str, table: pa.Table) -> None:
            nonlocal last_log
            report.shards_written += 1
            report.candidates += table.num_rows
            if time.perf_counter() - last_log > 10:
                last_log = time.perf_counter()
                log(
                    f"features.extract: {report.shards_written}/{len(todo)} shards, "
                    f"{report.candidates / (last_log - start):,.0f} rows/s"
                )

        return target.write_pending(todo, build, after=progress)


def _read_trace_shard(path: str) -> pa.Table:
    return pq.read_table(path, columns=TRACE_COLUMNS)


# Bare `traces=` / `out=` on the command line (the documented short form) mean
# the fields of the `features` section; Hydra itself only knows the long form.
_SHORT_OVERRIDES = {"traces": "features.traces", "out": "features.out"}


def _expand_short_overrides(argv: list[str]) -> list[str]:
    return expand_short_overrides(argv, _SHORT_OVERRIDES)


register_configs()  # the root schema `config_schema` that conf/extract.yaml builds on


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="extract")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    conf: FeaturesConfig = OmegaConf.to_object(cfg.features)
    extract(project_path(conf.traces), project_path(conf.out))


if __name__ == "__main__":
    run_entry_point(main, _SHORT_OVERRIDES, stage="features.extract")
