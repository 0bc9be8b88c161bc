"""S3 requests and time of the reads, compaction, clean and writes of a merge-on-read table, on moto S3 (a
server process of its own on loopback, as bench/run.py's scenario 8).

    python bench/s3_requests.py                     # the installed nbcc
    PYTHONPATH=/other/checkout/connector python bench/s3_requests.py   # another version, to compare

Builds a table of `--buckets` file groups with `--commits` upserts of 2,000 rows each, then
prints, for a snapshot read, a point lookup (medians of 5), a compaction, a read of the
compacted table, an upsert (median of 5) and a clean, the seconds taken and the requests sent by
kind. Request counts do not depend on
the machine; moto answers in a few ms where S3 takes tens, so on S3 the request counts weigh more.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import uuid
from typing import Callable

import numpy as np
import pyarrow as pa
import s3fs

import nbcc
from run import moto_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--buckets", type=int, default=8)
    args = parser.parse_args()
    with moto_server() as endpoint:
        s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": endpoint}).mkdir("bench")
        options = {"key": "bench", "secret": "bench", "endpoint_url": endpoint}
        table = nbcc.Table.create(f"s3://bench/t-{uuid.uuid4().hex[:8]}",
                                  pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("p", pa.string())]), "id",
                                  ordering_field="ts", buckets=args.buckets, storage_options=options)
        rng = np.random.default_rng(1)
        for i in range(args.commits):
            table.write(pa.table({"id": rng.integers(0, 20_000, 2_000), "ts": np.full(2_000, i),
                                  "p": pa.array([f"v{i}"] * 2_000)}))
        calls: collections.Counter[str] = collections.Counter()
        real = table.storage.fs._call_s3

        async def counted(method, *a, **k):
            calls[method] += 1
            return await real(method, *a, **k)
        table.storage.fs._call_s3 = counted

        def measure(what: str, run: Callable[[], object], repeats: int = 5) -> None:
            times = []
            for _ in range(repeats):
                calls.clear()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            print(f"{what}: {statistics.median(times):.3f} s, {sum(calls.values())} requests {dict(sorted(calls.items()))}")

        measure(f"snapshot read ({args.commits} commits x {args.buckets} file groups)", table.read)
        measure("point lookup", lambda: table.read(filter=[("id", "=", 5)]))
        measure("compaction", table.compact, repeats=1)
        measure("snapshot read after compaction", table.read)
        writes = iter(range(args.commits, args.commits + 5))
        measure("upsert of 2,000 rows", lambda: table.write(pa.table({
            "id": rng.integers(0, 20_000, 2_000), "ts": np.full(2_000, next(writes)),
            "p": pa.array(["w"] * 2_000)})))
        # The upserts started new file slices: the log files compaction replaced are not needed.
        measure("clean of the log files compaction replaced", lambda: table.clean(retain_commits=1), repeats=1)


if __name__ == "__main__":
    main()
