"""`python -m bench.bench_store`: what verifying shard hashes costs readers, against parsing.

Every `ShardStore.dataset()` call checks each shard's sha256 against its
completion marker. This times, on the same cached synthetic trace store and in
the same run: hashing every shard; the full read (`dataset().to_table()`,
hashing included); and the read the evaluator does (`POOL_COLUMNS` only).
The ratio hash / parse says what the check adds to a reader.

    python -m bench.bench_store                 # 200 prompts x 100 rounds (20,000 rounds)
    python -m bench.bench_store --prompts 1402 --rounds 261   # paper scale (cached by bench_extract)
"""

from __future__ import annotations

import argparse
import os
import time

from bench.bench_extract import paper_traces
from selection.pool_batch import POOL_COLUMNS
from specrank.store.tables import sha256_file
from specrank.store.trace_schema import trace_store


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    store = trace_store(paper_traces(args.prompts, args.rounds))
    files = [store.root / f"shard-{sid}.parquet" for sid in store.done_shards()]
    size = sum(f.stat().st_size for f in files)
    hash_s = _best(lambda: [sha256_file(f) for f in files], args.repeats)
    full_s = _best(lambda: store.dataset().to_table(), args.repeats)
    pool_s = _best(lambda: store.dataset().to_table(columns=POOL_COLUMNS), args.repeats)
    print(f"store: {len(files)} shards, {size / 2**20:,.0f} MiB; load {os.getloadavg()[0]:.2f}")
    print(f"hash every shard      : {hash_s:7.2f} s ({size / 2**20 / hash_s:,.0f} MiB/s)")
    print(f"full read (with hash) : {full_s:7.2f} s  -> hashing is {hash_s / full_s:.0%} of it")
    print(f"pool columns (w/ hash): {pool_s:7.2f} s  -> hashing is {hash_s / pool_s:.0%} of it")


if __name__ == "__main__":
    main()
