"""The metadata table (issue 7, RFC-45): file listings, column statistics and key filters, built
while writers keep writing, and reads that are the same with and without it.

Reads with the metadata table are compared with reads of the same table planned from the
timeline alone (`use_metadata_table=False`), whose correctness the rest of the suite shows; each
comparison also checks that the plan really used the metadata table. Crashes are real SIGKILLs
of child processes stopped at a chosen step (the `children` fixture, tests/children.py).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import nbcc
from nbcc import bloom
from nbcc.index_view import read_rows
from nbcc.metadata_table import COLUMN_STATS, FILES, KEY_FILTERS, KINDS, open_metadata_table, read_states
from nbcc.scan import ReadOptions, read_plan, read_schema
from nbcc.view import oldest_readable
from nbcc.schema import merge_commit_schemas, schema_from_json
from nbcc.timeline import DATA_ACTIONS, Timeline, read_commit_metadatas
from nbcc.writer import prepare
from test_pushdown import pushdown

SCHEMA = pa.schema([("id", pa.int64()), ("part", pa.string()), ("ts", pa.int64()), ("a", pa.string()),
                    ("b", pa.int64())])
WAIT_S = 120  # deadline for anything a child process must do


# -- helpers -------------------------------------------------------------------------------------

def rows(table: pa.Table) -> list[tuple]:
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)


def same_both_ways(t: nbcc.Table, expect_used: tuple[str, ...] = (FILES,), **kw) -> list[tuple]:
    """The rows of a read with the metadata table, asserted equal to the read without it; the
    plan must have used (at least) `expect_used`."""
    plan = t.plan(**kw)
    assert set(expect_used) <= set(plan.metadata_used), (kw, plan.metadata_used)
    assert t.plan(use_metadata_table=False, **kw).metadata_used == ()
    with_index = rows(t.read(**kw))
    without = rows(t.read(use_metadata_table=False, **kw))
    assert with_index == without, kw
    return with_index


def schema_from_commit_files(t: nbcc.Table) -> pa.Schema:
    """The created schema plus the columns the completed commits added, each commit's schema read
    from its own file (not from the metadata table, nor from the schema this process folded)."""
    metas = read_commit_metadatas(t.storage, Timeline.load(t.storage).completed())  # completion order
    schemas = [schema_from_json(m["schema"]) for m in metas.values() if m.get("schema") is not None]
    return merge_commit_schemas(t.config.schema, schemas)


def index_contents(t: nbcc.Table, instants: set[str] | None = None) -> dict[str, Any]:
    """What the metadata table holds, by kind, for comparing two builds (markers included);
    only entries of `instants` if given (entries of instants that never completed aside)."""
    mdt = open_metadata_table(t.storage)
    out = {}
    for kind in KINDS:
        got = read_rows(mdt, kind).to_pylist()
        keep = [r for r in got if instants is None or r["instant"] in instants]
        out[kind] = sorted((tuple(sorted(r.items())) for r in keep), key=repr)
    return out


def completed_instants(t: nbcc.Table) -> set[str]:
    return {i.instant for i in t.timeline() if i.state == "completed" and i.action in DATA_ACTIONS + ("commit",)}


def new_table(uri: str, merge_mode: str = "event_time", **kw) -> nbcc.Table:
    kw.setdefault("buckets", 2)
    ordering = None if merge_mode == "commit_time" else "ts"
    return nbcc.Table.create(uri, SCHEMA, "id", ordering_field=ordering, partition_by="part",
                             merge_mode=merge_mode, **kw)


def batch(keys, ts: int, rng: random.Random | None = None, partial: bool = False) -> pa.Table:
    out = []
    for k in keys:
        a, b = f"a{ts}-{k}", ts * 1000 + k
        if partial and rng is not None:  # each writer owns some columns: the other is "not provided"
            a, b = (a, None) if rng.random() < 0.5 else (None, b)
        out.append({"id": k, "part": "x" if k % 3 else "y", "ts": ts, "a": a, "b": b})
    return pa.Table.from_pylist(out, schema=SCHEMA)


# -- bloom filters ---------------------------------------------------------------------------------

def reference_hashes(key: str) -> tuple[int, int]:
    """format.md §18.3 written out with Python integers, one key at a time."""
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)
    p1 = p2 = 0
    for byte in key.encode():
        p1 = (p1 * 0x01000193 + byte) % 2**32
        p2 = (p2 * 0x5BD1E995 + byte) % 2**32
    return fmix(p1), fmix(p2 ^ 0x9E3779B9) | 1


def test_key_filters_hash_as_specified_and_never_miss_a_key():
    rng = random.Random(7)
    alphabet = "abz09-_é€😀"
    keys = [""] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(3000)] + ["k" * 700]
    h1, h2 = bloom.key_hashes(pa.array(keys))
    assert [(int(a), int(b)) for a, b in zip(h1, h2)] == [reference_hashes(k) for k in keys]
    sliced = pa.array(keys).slice(100, 50)  # an Arrow slice hashes like its values
    assert list(bloom.key_hashes(sliced)[0]) == list(h1[100:150])
    large = bloom.key_hashes(pa.array(keys, pa.large_string()))
    assert list(large[0]) == list(h1) and list(large[1]) == list(h2)

    members = pa.array([str(i) for i in range(50_000)])
    bits = bloom.build(members)
    assert len(bits) == bloom.filter_bytes(50_000)
    assert bloom.may_contain(bits, *bloom.key_hashes(members)).all()  # no false negatives
    others = pa.array([str(i) for i in range(50_000, 150_000)])
    false_positives = bloom.may_contain(bits, *bloom.key_hashes(others)).mean()
    assert false_positives < 0.02, false_positives  # about 1% by design


# -- random workloads ------------------------------------------------------------------------------

def compare_every_read(t: nbcc.Table, rng: random.Random, keys: list[int]) -> None:
    """Snapshot, read-optimized, time travel, incremental (both formats) and filtered reads,
    each with and without the metadata table."""
    same_both_ways(t)
    same_both_ways(t, query_type="read_optimized")
    same_both_ways(t, include_meta_columns=True)
    timeline = Timeline.load(t.storage)
    oldest = oldest_readable(t.storage, timeline)
    times = sorted({i.completion for i in timeline.completed() if i.completion >= oldest})
    for when in rng.sample(times, min(3, len(times))):
        same_both_ways(t, as_of=when)
        same_both_ways(t, as_of=when, query_type="read_optimized")
    for _ in range(2):
        begin, end = sorted(rng.sample(times, 2)) if len(times) > 1 else (times[0], times[0])
        same_both_ways(t, query_type="incremental", begin=begin, end=end)
        same_both_ways(t, query_type="incremental", begin=begin, incremental_format="cdc")
    point = rng.choice(keys)
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", point)])
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "in", rng.sample(keys, 3) + [10_000])])
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", point)], as_of=times[-1])
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", ">=", rng.randrange(20_000))])
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("a", "starts_with", "a1")])
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", "is_null")])
    same_both_ways(t, filter=[("part", "=", "y")])
    same_both_ways(t, (FILES, COLUMN_STATS), query_type="incremental", begin=times[0],
                   filter=[("b", "<", 9_000)])
    expected = schema_from_commit_files(t)
    assert t.schema() == expected and read_schema(t.storage, t.config, ReadOptions()) == expected


@pytest.mark.parametrize("merge_mode,seed", [("event_time", 1), ("commit_time", 2), ("partial_update", 3)])
def test_random_workloads_read_the_same_with_and_without_the_metadata_table(tmp_path, merge_mode, seed):
    rng = random.Random(seed)
    t = new_table(str(tmp_path / "t"), merge_mode)
    keys = list(range(24))
    indexed_at = rng.randint(2, 5)  # the index is built part-way: older commits by the indexer
    ts = 0
    ops = ["upsert"] * 10 + ["delete"] * 3 + ["compact"] * 2 + ["clean", "archive", "overwrite", "add_column"]
    rng.shuffle(ops)  # every kind of step, in a random order
    for step, op in enumerate(ops + ["upsert"]):
        ts += 1
        if op == "upsert":
            t.write(batch(rng.sample(keys, rng.randint(1, 8)), ts, rng, partial=merge_mode == "partial_update"))
        elif op == "delete":
            t.write(batch(rng.sample(keys, 3), ts).select(["id", "part"]), operation="delete")
        elif op == "compact":
            t.compact()
        elif op == "clean":
            t.clean(retain_commits=rng.randint(3, 6))
        elif op == "archive":
            t.archive(retain_commits=4)
        elif op == "overwrite":
            t.write(batch(rng.sample(keys, 6), ts), mode="overwrite")
        else:  # a write that adds a column: the schema comes from the index's markers
            data = batch(rng.sample(keys, 4), ts)
            t.write(data.append_column("c", pa.array([ts] * data.num_rows, pa.int64())))
        if step == indexed_at:
            assert set(t.build_index()["ready"]) == set(KINDS)
        if step > indexed_at and (step % 5 == 0 or step == len(ops)):
            compare_every_read(t, rng, keys)
    assert read_states(t.storage) == {k: "ready" for k in KINDS}
    # The index holds every completed instant's files; only those of cleaned files are gone.
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))


def rebuilt(tmp_path: Path, t: nbcc.Table) -> nbcc.Table:
    """The same table with its index dropped and built again from scratch."""
    t.drop_index(list(KINDS))
    assert all(read_rows(open_metadata_table(t.storage), k).num_rows == 0 for k in KINDS)
    t.build_index()
    return t


# -- planning without commit files; point lookups ---------------------------------------------------

def count_metadata_reads(monkeypatch, uri: str) -> list[str]:
    """Instants of the data table whose commit metadata is read (cached or not)."""
    import nbcc.scan as scan
    import nbcc.timeline as timeline

    real = timeline.read_commit_metadata
    seen: list[str] = []

    def counting(storage, instant):
        if storage.uri == uri and instant.action not in ("clean", "indexing"):
            seen.append(instant.instant)
        return real(storage, instant)

    monkeypatch.setattr(scan, "read_commit_metadata", counting)  # one commit file at a time
    monkeypatch.setattr(timeline, "read_commit_metadata", counting)  # read_commit_metadatas' reads
    return seen


def test_planning_with_the_files_partition_reads_no_commit_file(tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    t = new_table(uri, buckets=4)
    for ts in range(1, 31):
        t.write(batch([ts % 17, (ts * 7) % 23], ts))
        if ts % 10 == 0:
            t.compact()
    t.build_index()
    t.clean(retain_commits=5)
    for ts in range(31, 36):  # written by writers that add their own entries
        t.write(batch([ts % 11], ts))
    seen = count_metadata_reads(monkeypatch, uri)
    fresh = nbcc.Table.open(uri)
    plan = fresh.plan(filter=[("b", ">", 5000)])
    assert plan.metadata_used == (COLUMN_STATS, FILES) and seen == []
    as_of = fresh.timeline()[-3].completion
    assert fresh.plan(as_of=as_of).tasks and seen == []
    fresh.plan(use_metadata_table=False)
    assert len(seen) == len(completed_instants(fresh))  # the timeline path reads every commit


def test_a_warm_process_takes_the_newest_schemas_from_the_metadata_table_it_read(tmp_path, monkeypatch):
    """A process that knows the schema up to a few commits ago (its own writes looked it up)
    takes the newer commits' schemas from the metadata table it reads anyway, not from their
    commit files: Spark's schema look-up and a filtered plan read no commit file."""
    uri = str(tmp_path / "t")
    t = new_table(uri)
    for ts in range(1, 6):
        t.write(batch([ts, ts + 10], ts))
    t.build_index()
    assert t.schema().names == SCHEMA.names  # this process now knows every commit's schema
    for ts in range(6, 9):  # a few commits, the last adding column c
        data = batch([ts], ts)
        t.write(data.append_column("c", pa.array([ts] * data.num_rows, pa.int64())) if ts == 8 else data)
    seen = count_metadata_reads(monkeypatch, uri)
    assert read_schema(t.storage, t.config, ReadOptions()).names == SCHEMA.names + ["c"]
    plan = t.plan(filter=[("c", "=", 8)])
    assert plan.metadata_used and seen == []
    assert rows(read_plan(t.storage, plan)) == [(8, "x", 8, "a8-8", 8008, 8)]  # key 8 is in part x


def test_a_point_lookup_opens_only_files_that_may_hold_the_key(tmp_path):
    t = new_table(str(tmp_path / "t"), buckets=2)
    for ts in range(1, 41):  # 40 log files per partition and bucket, 4 keys each
        t.write(batch([(ts * 4 + j) % 160 for j in range(4)], ts))
    t.build_index()
    opened = {True: 0, False: 0}
    for key in range(0, 160, 7):
        for use in (True, False):
            plan = t.plan(filter=[("id", "=", key)], use_metadata_table=use)
            opened[use] += sum(len(task.files) for task in plan.tasks)
        same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", key)])
    assert opened[True] * 5 < opened[False], opened  # a key is in one or two files of ~40
    missing = t.plan(filter=[("id", "in", [1000, 1001])])
    assert missing.metadata_used and sum(len(x.files) for x in missing.tasks) <= 2  # false positives only
    assert t.read(filter=[("id", "in", [1000, 1001])]).num_rows == 0


def test_dropping_a_partition_makes_reads_fall_back(tmp_path):
    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 8):
        t.write(batch(range(ts, ts + 5), ts))
    t.build_index()
    assert t.plan(filter=[("id", "=", 3)]).metadata_used == (COLUMN_STATS, FILES, KEY_FILTERS)
    assert t.drop_index("key_filters") == {"dropped": [KEY_FILTERS], "cancelled": []}
    assert t.plan(filter=[("id", "=", 3)]).metadata_used == (COLUMN_STATS, FILES)
    assert read_rows(open_metadata_table(t.storage), KEY_FILTERS).num_rows == 0
    t.write(batch([3], 9))  # a writer now adds entries to files and column_stats only
    assert read_rows(open_metadata_table(t.storage), KEY_FILTERS).num_rows == 0
    same_both_ways(t, filter=[("id", "=", 3)])
    t.drop_index([FILES, COLUMN_STATS])
    assert read_states(t.storage) == {}
    assert "metadata_table" not in json.loads((tmp_path / "t" / ".nbcc" / "table.json").read_text())
    assert t.plan().metadata_used == () and t.plan(filter=[("b", ">", 1)]).metadata_used == ()
    assert rows(t.read()) == rows(t.read(use_metadata_table=False))
    assert t.drop_index(FILES) == {"dropped": [], "cancelled": []}
    t.build_index(FILES)  # built again from scratch, without the partitions still dropped
    assert read_states(t.storage) == {FILES: "ready"}
    same_both_ways(t)


@pytest.mark.parametrize("query", [{}, {"query_type": "read_optimized"}, {"filter": [("id", "in", [2, 3, 9])]}])
def test_a_clean_while_a_read_is_planned_never_makes_it_wrong(tmp_path, monkeypatch, query):
    """A clean that forgets files between a reader's two reads (metadata table, timeline
    listing), whichever comes first, must not change the rows the read returns."""
    import nbcc.scan as scan

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 7):
        t.write(batch(range(ts, ts + 6), ts))
    t.build_index()

    deleted: list[str] = []

    def interfere():  # the slices the reader is about to see are compacted and cleaned away
        t.compact()
        for ts in range(7, 10):
            t.write(batch(range(ts, ts + 3), ts))
        deleted.extend(name for _, name in t.clean(retain_commits=1)["deleted"])
        assert deleted

    armed = [True]
    real_index, real_load = scan._index_for, Timeline.load.__func__

    def after_first(result):
        if armed[0]:
            armed[0] = False
            interfere()
        return result

    monkeypatch.setattr(scan, "_index_for", lambda *a: after_first(real_index(*a)))
    monkeypatch.setattr(Timeline, "load", classmethod(
        lambda cls, storage: after_first(real_load(cls, storage)) if storage.uri == t.uri else real_load(cls, storage)))
    try:
        got = rows(t.read(**query))
    except nbcc.DataFileError as exc:
        # A file the plan named was deleted (format.md §14.3: such a read fails, never returns a
        # wrong result): the error must name one of the files the clean deleted.
        assert any(name in str(exc) for name in deleted), (str(exc), deleted)
        got = None
    monkeypatch.undo()
    assert not armed[0]
    expected = rows(t.read(use_metadata_table=False, **query))
    if got is not None:
        assert got == expected
    # Either way the table is intact: the same read, planned again, gives the right rows.
    assert rows(t.read(**query)) == expected


def test_bad_partition_names_and_options_are_clear_errors(tmp_path):
    t = new_table(str(tmp_path / "t"))
    t.write(batch([1], 1))
    for bad in ("bogus", ["files", "stats"], "", " , "):
        with pytest.raises(nbcc.InvalidOptionError, match="files, column_stats, key_filters"):
            t.build_index(bad)
        with pytest.raises(nbcc.InvalidOptionError, match="files, column_stats, key_filters"):
            t.drop_index(bad)
    with pytest.raises(nbcc.InvalidOptionError, match="use_metadata_table.*true or false"):
        t.read(use_metadata_table="maybe")
    with pytest.raises(nbcc.InvalidOptionError, match="use_metadata_table"):
        t.plan(use_metadata_table=2)
    assert read_states(t.storage) == {} and open_metadata_table(t.storage) is None  # nothing was started


def test_a_table_json_without_the_field_reads_and_keeps_other_keys(tmp_path):
    uri = tmp_path / "t"
    t = new_table(str(uri))
    t.write(batch([1, 2], 1))
    doc = json.loads((uri / ".nbcc" / "table.json").read_text())
    assert "metadata_table" not in doc  # written as before by tables that never built an index
    doc["someone_elses_key"] = {"kept": True}
    (uri / ".nbcc" / "table.json").write_text(json.dumps(doc))
    t = nbcc.Table.open(str(uri))
    assert t.config.metadata_table == {} and t.index_state()["partitions"] == {}
    assert t.plan().metadata_used == ()
    t.build_index([FILES])
    doc = json.loads((uri / ".nbcc" / "table.json").read_text())
    assert doc["metadata_table"] == {FILES: "ready"} and doc["someone_elses_key"] == {"kept": True}
    assert nbcc.Table.open(str(uri)).config.metadata_table == {FILES: "ready"}
    assert {k: doc[k] for k in ("record_key", "buckets")} == {"record_key": ["id"], "buckets": 2}


def test_services_keep_the_metadata_table_in_step(tmp_path):
    t = new_table(str(tmp_path / "t"))
    t.build_index()  # on an empty table: writers add every entry
    for ts in range(1, 13):
        t.write(batch(range(ts, ts + 4), ts))
    tc = t.compact()
    mdt = open_metadata_table(t.storage)
    files = read_rows(mdt, FILES)
    base_files = [n for n in files.column("name").to_pylist() if n and n.endswith(f"_{tc}.parquet")]
    assert base_files and tc in files.column("instant").to_pylist()  # a compaction indexes its base files
    for ts in range(13, 20):
        t.write(batch(range(ts, ts + 4), ts))
    deleted = {tuple(d) for d in t.clean(retain_commits=3)["deleted"]}
    assert deleted
    for kind in KINDS:  # a clean forgets the files it deleted
        left = {(r["partition"], r["name"]) for r in read_rows(mdt, kind).to_pylist() if r["name"]}
        assert not left & deleted, kind
    same_both_ways(t)
    t.archive(retain_commits=3)
    assert any(i.archived for i in t.timeline()) and any(i.archived for i in mdt.timeline())
    compare_every_read(t, random.Random(5), list(range(1, 24)))


def test_a_micro_batch_commit_indexes_after_completing_and_others_before(tmp_path, monkeypatch):
    """A stream's micro-batch may be completed by several runs (format.md §17): only the run
    that completed it indexes it. Any other commit indexes before completing."""
    import nbcc.metadata_table as metadata_table

    t = new_table(str(tmp_path / "t"))
    t.write(batch([1], 1))
    t.build_index()
    real = metadata_table.write_rows
    completed_when_indexed: dict[str, bool] = {}

    def spy(storage, rows_, maintain=True):
        instant = rows_[0]["instant"]
        completed_when_indexed[instant] = Timeline.load(storage).get(instant).is_completed
        return real(storage, rows_, maintain)

    monkeypatch.setattr(metadata_table, "write_rows", spy)
    for extra in (None, {"stream_id": "s1", "batch_id": 0}):
        data = batch([2, 3], 2)
        txn = t.begin_write(data.schema)
        writer = t.log_writer(txn, "0-0-0")
        writer.write(prepare(data, t.config, txn.schema, "upsert"))
        txn.commit(writer.close(), extra=extra)
        assert completed_when_indexed[txn.instant] is (extra is not None)
    same_both_ways(t)


# -- real processes: concurrent writers, kills ---------------------------------------------------------

PRELUDE = """
import json, sys, time
from pathlib import Path
import pyarrow as pa
import nbcc

SCHEMA = pa.schema([("id", pa.int64()), ("part", pa.string()), ("ts", pa.int64()), ("a", pa.string()),
                    ("b", pa.int64())])

def report(path, obj):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)

def hang():
    while True:
        time.sleep(60)

def wait_file(path):
    deadline = time.monotonic() + 120
    while not Path(path).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.005)

def rows_of(rows):
    return pa.Table.from_pylist(rows, schema=SCHEMA)
"""

# A writer process: waits for the gate, then makes its commits one after another (argv[4]: a JSON
# list of row lists), reporting each instant; any exception fails it (there is no retry). With
# argv[5] = "early", its first write begins at once, and completes only once "go" exists: it is
# in flight when the indexing is scheduled, which catch-up then waits for.
WRITER = PRELUDE + """
from nbcc.heartbeat import Heartbeat
from nbcc.writer import prepare
uri, work, me, commits = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
early = len(sys.argv) > 5 and sys.argv[5] == "early"
table = nbcc.Table.open(uri)
done = []
if early:
    data = rows_of(commits.pop(0))
    txn = table.begin_write(data.schema)
    with Heartbeat(table.storage, txn.instant, interval_s=0.5):
        writer = table.log_writer(txn, "0-0-0")
        writer.write(prepare(data, table.config, txn.schema, "upsert"))
        files = writer.close()
        report(work / "begun.json", {"instant": txn.instant})
        wait_file(work / "go")
        txn.commit(files)
    done.append(txn.instant)
wait_file(work / "gate")
for batch in commits:
    done.append(table.write(rows_of(batch)))
    report(work / f"writer-{me}-{len(done) - 1}.json", done)
"""

# A compaction process: waits for its gate, then schedules and runs a compaction.
COMPACTOR = PRELUDE + """
uri, work = sys.argv[1], Path(sys.argv[2])
table = nbcc.Table.open(uri)
wait_file(work / "compact-gate")
report(work / "compacted.json", {"tc": table.compact()})
"""

# The indexer: builds every partition; after scheduling it reports its instant and waits for the
# go-ahead before indexing anything, so that writes run on while it builds.
INDEXER = PRELUDE + """
import nbcc.indexing as indexing
uri, work = sys.argv[1], Path(sys.argv[2])
table = nbcc.Table.open(uri)
real = indexing.base_work

def held(storage, plan):
    report(work / "scheduled.json", plan)
    wait_file(work / "go")
    return real(storage, plan)

indexing.base_work = held
report(work / "indexed.json", table.build_index())
"""


def writer_batches(writer: int, commits: int) -> list[list[dict[str, Any]]]:
    """Overlapping keys; ts unique per (writer, commit), so the greatest ts wins each key."""
    rng = random.Random(f"mdt-writer-{writer}")
    out = []
    for c in range(commits):
        ts = 1000 + c * 10 + writer
        keys = rng.sample(range(60), 8)
        out.append([{"id": k, "part": "x" if k % 3 else "y", "ts": ts, "a": f"w{writer}c{c}", "b": ts} for k in keys])
    return out


def test_indexing_while_four_writers_and_a_compaction_run(tmp_path, children):
    uri = str(tmp_path / "t")
    t = new_table(uri, buckets=2)
    expected: dict[tuple[int, str], dict[str, Any]] = {}
    for ts in range(1, 9):  # commits from before the index: the indexer's base
        data = batch(range(ts * 3, ts * 3 + 6), ts)
        t.write(data)
        for r in data.to_pylist():
            expected[(r["id"], r["part"])] = r
    work = children.work
    commits = 6
    batches = {w: writer_batches(w, commits) for w in range(4)}
    writers = [children.start(WRITER, uri, str(work), str(w), json.dumps(batches[w]), "early" if w == 0 else "")
               for w in range(4)]
    early = children.wait_for(work / "begun.json", writers[0])["instant"]  # in flight from now on
    compactor = children.start(COMPACTOR, uri, str(work))
    indexer = children.start(INDEXER, uri, str(work))
    plan = children.wait_for(work / "scheduled.json", indexer)  # Ti is pending: partitions building
    assert plan["base_instant"] < early < plan["instant"]
    (work / "gate").write_text("go")
    for w in (1, 2, 3):  # they commit twice while the indexing has not even begun to build
        children.wait_for(work / f"writer-{w}-1.json", writers[w])
    (work / "compact-gate").write_text("go")
    (work / "go").write_text("go")
    for proc in writers + [compactor, indexer]:
        children.finish(proc)

    # Every write succeeded the first time, while the indexing was pending.
    instants = {w: json.loads((work / f"writer-{w}-{commits - 1}.json").read_text()) for w in range(4)}
    timeline = {i.instant: i for i in t.timeline()}
    indexing = timeline[plan["instant"]]
    assert indexing.action == "indexing" and indexing.state == "completed"
    during = [x for w in instants.values() for x in w if plan["instant"] < timeline[x].completion < indexing.completion]
    assert len(during) >= 6 and early in during, during
    assert all(timeline[x].state == "completed" for w in instants.values() for x in w)
    tc = json.loads((work / "compacted.json").read_text())["tc"]
    assert timeline[tc].state == "completed"
    assert set(json.loads((work / "indexed.json").read_text())["ready"]) == set(KINDS)

    for w, bs in batches.items():
        for b in bs:
            for r in b:
                cur = expected.get((r["id"], r["part"]))
                if cur is None or r["ts"] > cur["ts"]:
                    expected[(r["id"], r["part"])] = r
    want = rows(pa.Table.from_pylist(list(expected.values()), schema=SCHEMA))
    assert same_both_ways(t) == want
    for key in (0, 7, 33):
        same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", key)])
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", ">=", 1030)])
    # The finished index equals one rebuilt from scratch afterwards.
    before = index_contents(t)
    assert before == index_contents(rebuilt(tmp_path, t))


# The indexer stops for good (hangs, then is killed) after its second chunk of instants.
KILLED_INDEXER = PRELUDE + """
import nbcc.indexing as indexing
uri, work = sys.argv[1], Path(sys.argv[2])
indexing.CHUNK_INSTANTS = 4
real = indexing.index_instants
calls = []

def stalling(storage, kinds, instants, indexed=None):
    out = real(storage, kinds, instants, indexed)
    calls.append(list(instants))
    if len(calls) == 2:
        report(work / "stalled.json", {"indexed": calls})
        hang()
    return out

indexing.index_instants = stalling
nbcc.Table.open(uri).build_index()
sys.exit("the indexing finished although it was meant to stall")
"""


def test_indexer_killed_part_way_is_resumed_by_a_rerun(tmp_path, children, monkeypatch):
    uri = str(tmp_path / "t")
    t = new_table(uri)
    for ts in range(1, 21):
        t.write(batch([ts % 9, ts % 13 + 20], ts))
        if ts == 10:
            t.compact()
    proc = children.start(KILLED_INDEXER, uri, str(children.work))
    stalled = children.wait_for(children.work / "stalled.json", proc)
    children.kill(proc)
    first = [i for chunk in stalled["indexed"] for i in chunk]
    assert len(first) == 8

    pending = [i for i in t.timeline() if i.action == "indexing"]
    assert [i.state for i in pending] == ["inflight"]
    assert read_states(t.storage) == {k: "building" for k in KINDS}
    assert t.plan().metadata_used == ()  # not ready: reads go by the timeline
    assert rows(t.read()) == rows(t.read(use_metadata_table=False))
    writer_instant = t.write(batch([5], 30))  # writers add their entries while it is building
    mdt = open_metadata_table(t.storage)
    for kind in KINDS:
        assert writer_instant in set(read_rows(mdt, kind, ("name",)).column("instant").to_pylist())

    import nbcc.indexing as indexing

    real = indexing.index_instants
    again: list[str] = []

    def recording(storage, kinds, instants, indexed=None):
        todo = [i for i in instants if indexed is None or any(i not in indexed[k] for k in kinds)]
        again.extend(todo)
        return real(storage, kinds, instants, indexed)

    monkeypatch.setattr(indexing, "index_instants", recording)
    result = t.build_index()
    assert result["instants"] == [pending[0].instant]  # the same indexing, resumed
    assert not set(first) & set(again) and writer_instant not in again  # nothing indexed twice
    assert set(first) | set(again) | {writer_instant} == completed_instants(t)
    assert read_states(t.storage) == {k: "ready" for k in KINDS}
    same_both_ways(t)
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", 5)])
    before = index_contents(t)
    assert before == index_contents(rebuilt(tmp_path, t))


# A writer that writes its metadata table entries, then stops for good before completing.
KILLED_WRITER = PRELUDE + """
import nbcc.commit as commit
uri, work = sys.argv[1], Path(sys.argv[2])
real = commit.index_commit

def stalling(storage, metadata, maintain=True):
    done = real(storage, metadata, maintain)
    if storage.uri != uri:
        return done  # the metadata table's own commit
    assert done, "the entries were not written"
    report(work / "stalled.json", {"instant": metadata["instant"],
                                   "files": [f["partition"] + "/" + f["name"] for f in metadata["files"]]})
    hang()

commit.index_commit = stalling
nbcc.Table.open(uri).write(rows_of([{"id": k, "part": "x" if k % 3 else "y", "ts": 99, "a": "lost", "b": 99}
                                    for k in range(10)]))
sys.exit("the write completed although it was meant to stall")
"""


def test_a_writer_killed_after_its_entries_before_its_commit_is_never_read(tmp_path, children):
    uri = str(tmp_path / "t")
    t = new_table(uri, heartbeat_timeout_s=2)
    for ts in range(1, 6):
        t.write(batch(range(ts, ts + 4), ts))
    t.build_index()
    before = rows(t.read())
    proc = children.start(KILLED_WRITER, uri, str(children.work))
    lost = children.wait_for(children.work / "stalled.json", proc)
    children.kill(proc)
    mdt = open_metadata_table(t.storage)
    indexed_names = set(read_rows(mdt, FILES).column("name").to_pylist())
    assert {f.split("/", 1)[1] for f in lost["files"]} <= indexed_names  # its entries are there
    assert t.timeline()[-1].instant == lost["instant"] and t.timeline()[-1].state == "inflight"

    assert same_both_ways(t) == before  # ... and never read
    for key in range(10):
        plan = t.plan(filter=[("id", "=", key)])
        assert not {f"{x.partition}/{n}" for x in plan.tasks for n in x.files} & set(lost["files"])
        same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", key)])
    later = t.write(batch([1, 2], 50))
    assert same_both_ways(t, as_of=completion(t, later)) == rows(t.read())
    # Once its heartbeat (2 s) has expired, the cleaner rolls it back (and only it).
    deadline = time.monotonic() + 60
    while not (rolled_back := t.clean(retain_commits=50)["rolled_back"]):
        assert time.monotonic() < deadline, "the killed writer was never rolled back"
        time.sleep(0.2)
    assert rolled_back == [lost["instant"]]
    assert not any((tmp_path / "t" / f).exists() for f in lost["files"])
    same_both_ways(t)


def completion(t: nbcc.Table, instant: str) -> str:
    return next(i.completion for i in t.timeline() if i.instant == instant)


# A compaction that completes, then stops for good before indexing its base files.
KILLED_COMPACTION = PRELUDE + """
import nbcc.compaction as compaction
uri, work = sys.argv[1], Path(sys.argv[2])
real = compaction.index_commit

def stalling(storage, metadata):
    if storage.uri != uri:
        return real(storage, metadata)  # the metadata table's own compaction
    report(work / "stalled.json", {"tc": metadata["instant"]})
    hang()

compaction.index_commit = stalling
nbcc.Table.open(uri).compact()
sys.exit("the compaction indexed its files although it was meant to stall")
"""


def test_an_instant_completed_without_its_entries_is_read_from_its_commit_file(tmp_path, children, monkeypatch):
    uri = str(tmp_path / "t")
    t = new_table(uri)
    for ts in range(1, 8):
        t.write(batch(range(ts, ts + 5), ts))
    t.build_index()
    proc = children.start(KILLED_COMPACTION, uri, str(children.work))
    tc = children.wait_for(children.work / "stalled.json", proc)["tc"]
    children.kill(proc)
    assert next(i for i in t.timeline() if i.instant == tc).state == "completed"
    assert tc not in read_rows(open_metadata_table(t.storage), FILES).column("instant").to_pylist()
    seen = count_metadata_reads(monkeypatch, uri)
    assert t.plan().metadata_used == (FILES,) and seen == [tc]  # only the gap is read from its file
    same_both_ways(t)
    same_both_ways(t, query_type="read_optimized")
    t.clean(retain_commits=100)  # the services fill the gap in
    assert tc in read_rows(open_metadata_table(t.storage), FILES).column("instant").to_pylist()
    seen.clear()
    assert t.plan().metadata_used == (FILES,) and seen == []
    same_both_ways(t)


def test_catch_up_waits_for_writes_in_flight_and_a_timeout_aborts_cleanly(tmp_path):
    t = new_table(str(tmp_path / "t"))
    t.write(batch([1, 2], 1))
    data = batch([3, 4], 2)
    txn = t.begin_write(data.schema)  # in flight before the indexing is scheduled
    writer = t.log_writer(txn, "0-0-0")
    writer.write(prepare(data, t.config, txn.schema, "upsert"))
    files = writer.close()
    with pytest.raises(nbcc.NbccError, match=f"indexing \\d{{17}}: write {txn.instant} was still in flight.*resumes"):
        t.build_index(timeout_s=0.3)
    [pending] = t.index_state()["pending"]
    assert pending["base_instant"] < txn.instant < pending["instant"]
    assert read_states(t.storage) == {k: "building" for k in KINDS} and t.plan().metadata_used == ()
    txn.commit(files)  # it reads table.json as it commits: the partitions are building, so it adds its entries
    assert txn.instant in read_rows(open_metadata_table(t.storage), FILES).column("instant").to_pylist()
    result = t.build_index(timeout_s=5)
    assert result["instants"] == [pending["instant"]]  # resumed; nothing in flight any more
    assert read_states(t.storage) == {k: "ready" for k in KINDS}
    same_both_ways(t)


def markers(t: nbcc.Table, kind: str) -> set[str]:
    return {r["instant"] for r in read_rows(open_metadata_table(t.storage), kind).to_pylist() if r["name"] is None}


def rows_of_instant(t: nbcc.Table, instant: str) -> dict[str, list[dict[str, Any]]]:
    mdt = open_metadata_table(t.storage)
    return {k: [r for r in read_rows(mdt, k).to_pylist() if r["instant"] == instant] for k in KINDS}


def cleaned_entries(t: nbcc.Table, deleted: set[tuple[str, str]]) -> dict[str, set[tuple[str, str]]]:
    """Entries, by kind, of the files among `deleted`."""
    mdt = open_metadata_table(t.storage)
    return {k: {(r["partition"], r["name"]) for r in read_rows(mdt, k).to_pylist() if r["name"]} & deleted
            for k in KINDS}


def test_catch_up_indexes_a_write_that_read_table_json_before_the_indexing(tmp_path, monkeypatch):
    """A write in flight when the indexing is scheduled may have read table.json before it (no
    partitions in use then) and complete without entries: catch-up must index it itself."""
    import nbcc.commit as commit
    import nbcc.indexing as indexing

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 4):
        t.write(batch(range(ts, ts + 4), ts))
    data = batch([2, 3, 30], 9)
    txn = t.begin_write(data.schema)  # in flight when the indexing is scheduled
    writer = t.log_writer(txn, "0-0-0")
    writer.write(prepare(data, t.config, txn.schema, "upsert"))
    files = writer.close()
    ti = indexing.schedule(t.storage, t.clock, KINDS)
    plan = indexing.plan_of(t.storage, ti)
    assert plan["base_instant"] < txn.instant < ti

    real_index = commit.index_commit
    monkeypatch.setattr(commit, "index_commit", lambda storage, metadata, maintain=True: (
        False if metadata["instant"] == txn.instant else real_index(storage, metadata, maintain)))
    txn.commit(files)  # as if it read table.json before Ti: no entries of its own
    after = t.write(batch([4, 31], 10))  # began after Ti: it indexes itself
    assert all(txn.instant not in markers(t, k) and after in markers(t, k) for k in KINDS)

    real_instants = indexing.index_instants
    indexed_by_run: list[str] = []

    def recording(storage, kinds, instants, indexed=None):
        indexed_by_run.extend(i for i in instants if indexed is None or any(i not in indexed[k] for k in kinds))
        return real_instants(storage, kinds, instants, indexed)

    monkeypatch.setattr(indexing, "index_instants", recording)
    assert set(indexing.run(t.storage, t.clock, ti)) == set(KINDS)
    monkeypatch.undo()
    assert [i for i in indexed_by_run if i > plan["base_instant"]] == [txn.instant]  # catch-up's own work
    names = {f["name"] for f in files}
    for kind in KINDS:
        got = rows_of_instant(t, txn.instant)[kind]
        assert [r for r in got if r["name"] is None], kind  # its marker ...
        assert {r["name"] for r in got if r["name"]} == names, kind  # ... and an entry per file
    assert same_both_ways(t) == rows(t.read(use_metadata_table=False))
    assert 30 in {r[0] for r in same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", 30)])}
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", ">=", 9000)])
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))


def test_dropping_while_an_indexing_is_pending_cancels_it_and_blocks_builds_until_deleted(tmp_path, monkeypatch):
    import nbcc.indexing as indexing

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 5):
        t.write(batch(range(ts, ts + 4), ts))
    ti = indexing.schedule(t.storage, t.clock, KINDS)
    t.write(batch([1, 9], 5))  # adds its entries: the building partitions have rows to delete
    seen: dict[str, Any] = {}
    real_base, real_delete = indexing.base_work, indexing.delete_rows

    def dropped_meanwhile(storage, plan):  # the run has read its plan; then the drop comes
        seen["drop"] = t.drop_index(KINDS)
        return real_base(storage, plan)

    def while_deleting(mdt, kind, keys):  # the drop is between its two lock holds
        if "write" not in seen:
            assert t.index_state()["partitions"] == {k: "dropping" for k in KINDS}
            assert indexing.schedule(t.storage, t.clock, KINDS) is None  # no build reads old markers
            with pytest.raises(nbcc.CommitError, match="being dropped"):
                t.build_index()
            assert t.plan().metadata_used == ()
            seen["write"] = t.write(batch([2, 40], 6))  # adds no entries to a dropping partition
        return real_delete(mdt, kind, keys)

    monkeypatch.setattr(indexing, "base_work", dropped_meanwhile)
    monkeypatch.setattr(indexing, "delete_rows", while_deleting)
    with pytest.raises(nbcc.CommitError, match=f"indexing {ti} was cancelled"):
        indexing.run(t.storage, t.clock, ti)
    monkeypatch.undo()

    assert seen["drop"] == {"dropped": list(KINDS), "cancelled": [ti]}
    assert read_states(t.storage, dropping=True) == {} and t.index_state()["pending"] == []
    assert next(i for i in t.timeline() if i.instant == ti).state == "rolledback"
    timeline_dir = tmp_path / "t" / ".nbcc" / "timeline"
    assert sorted(n.name for n in timeline_dir.iterdir() if n.name.startswith(ti)) == [f"{ti}.indexing.rolledback"]
    assert all(read_rows(open_metadata_table(t.storage), k).num_rows == 0 for k in KINDS)
    assert t.plan().metadata_used == () and rows(t.read()) == rows(t.read(use_metadata_table=False))
    with pytest.raises(nbcc.CommitError, match="cancelled"):  # running it again fails the same way
        indexing.run(t.storage, t.clock, ti)
    assert set(t.build_index()["ready"]) == set(KINDS)  # built again from scratch
    assert seen["write"] in markers(t, FILES)
    same_both_ways(t)
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))


def test_metadata_table_upkeep_runs_after_the_data_commit_and_never_fails_it(tmp_path, monkeypatch, caplog):
    import nbcc.metadata_table as metadata_table

    t = new_table(str(tmp_path / "t"))
    t.write(batch([1], 1))
    t.build_index()
    mdt = open_metadata_table(t.storage)
    compactions = sum(1 for i in mdt.timeline() if i.action == "commit")
    real = metadata_table.upkeep
    states_seen: list[tuple[str, str]] = []

    def spy(mdt_, force=False):
        latest = [i for i in Timeline.load(t.storage).instants if i.action == "deltacommit"][-1]
        states_seen.append((latest.instant, latest.state))
        return real(mdt_, force)

    monkeypatch.setattr(metadata_table, "upkeep", spy)
    written = [t.write(batch([ts, ts + 1], ts)) for ts in range(2, 14)]
    assert states_seen == [(x, "completed") for x in written]  # once per write, after it completed
    assert sum(1 for i in mdt.timeline() if i.action == "commit") > compactions  # and it still compacts

    def failing(mdt_, force=False):
        raise RuntimeError("upkeep broke")

    monkeypatch.setattr(metadata_table, "upkeep", failing)
    with caplog.at_level("WARNING", logger="nbcc.metadata_table"):
        x = t.write(batch([50], 50))
    assert next(i for i in t.timeline() if i.instant == x).state == "completed"
    assert "upkeep broke" in caplog.text
    assert all(x in markers(t, k) for k in KINDS)  # its entries went in before it completed
    assert 50 in {r[0] for r in same_both_ways(t)}


def test_a_rolled_back_write_leaves_no_rows_in_the_metadata_table(tmp_path, monkeypatch):
    import nbcc.commit as commit
    from nbcc.metadata_table import index_commit

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 5):
        t.write(batch(range(ts, ts + 4), ts))
    t.build_index()
    captured: dict[str, Any] = {}
    real_index = commit.index_commit

    def capture(storage, metadata, maintain=True):
        if storage.uri == t.uri:
            captured.update(metadata)
        return real_index(storage, metadata, maintain)

    real_complete = commit.create_completed

    def crash(storage, *args):  # the data commit only: the metadata table's goes through
        if storage.uri == t.uri:
            raise nbcc.CommitError("simulated crash while completing")
        return real_complete(storage, *args)

    monkeypatch.setattr(commit, "index_commit", capture)
    monkeypatch.setattr(commit, "create_completed", crash)
    data = batch([1, 2, 60], 9)
    txn = t.begin_write(data.schema)
    writer = t.log_writer(txn, "0-0-0")
    writer.write(prepare(data, t.config, txn.schema, "upsert"))
    files = writer.close()
    with pytest.raises(nbcc.CommitError, match="simulated"):
        txn.commit(files)
    monkeypatch.undo()
    assert all(rows_of_instant(t, txn.instant).values())  # its entries went in before completing

    assert txn.rollback(files)  # a failed job's abort
    assert rows_of_instant(t, txn.instant) == {k: [] for k in KINDS}
    same_both_ways(t)
    assert index_commit(t.storage, captured)  # a slow writer's rows landing after its rollback ...
    assert all(rows_of_instant(t, txn.instant).values())
    t.clean(retain_commits=50)  # ... go at the next clean
    assert rows_of_instant(t, txn.instant) == {k: [] for k in KINDS}
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))


def test_an_indexer_racing_a_clean_keeps_no_entries_of_the_files_it_deleted(tmp_path, monkeypatch):
    import nbcc.indexing as indexing
    from nbcc.metadata_table import entries, write_rows
    from nbcc.timeline import read_commit_metadata

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 7):
        t.write(batch(range(ts, ts + 6), ts))
    t.compact()
    for ts in range(7, 10):
        t.write(batch(range(ts, ts + 3), ts))
    deleted: set[tuple[str, str]] = set()
    real = indexing.entries

    def clean_first(storage, metadata, kinds):  # after the indexer listed the timeline
        if not deleted:
            deleted.update(tuple(d) for d in t.clean(retain_commits=1)["deleted"])
            assert deleted
        return real(storage, metadata, kinds)

    monkeypatch.setattr(indexing, "entries", clean_first)
    assert set(t.build_index()["ready"]) == set(KINDS)
    monkeypatch.undo()
    assert cleaned_entries(t, deleted) == {k: set() for k in KINDS}
    compare_every_read(t, random.Random(11), list(range(1, 15)))

    # Entries of cleaned files written by anyone, at any time, go at the next clean.
    first = next(i for i in t.timeline() if i.action == "deltacommit")
    write_rows(t.storage, entries(t.storage, read_commit_metadata(t.storage, first), list(KINDS)), maintain=False)
    assert cleaned_entries(t, deleted)[FILES]
    t.clean(retain_commits=1)
    assert cleaned_entries(t, deleted) == {k: set() for k in KINDS}
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))


# -- a metadata table that fails, its caches, its upkeep ---------------------------------------------

def mdt_timeline_dir(tmp_path: Path) -> Path:
    return tmp_path / "t" / ".nbcc" / "metadata" / ".nbcc" / "timeline"


@pytest.mark.parametrize("failure", ["truncated commit file", "storage error"])
def test_a_metadata_table_that_cannot_be_read_leaves_reads_to_the_timeline(tmp_path, monkeypatch, caplog, failure):
    """The metadata table only makes reads cheaper: whatever fails in reading it, a read plans
    from the timeline and says so in a warning."""
    import nbcc.reader as reader

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 5):
        t.write(batch(range(ts, ts + 4), ts))
    t.build_index()
    t.write(batch([2, 40], 5))  # its entries: a delta commit of the metadata table no read has read yet
    if failure == "truncated commit file":
        last = sorted(n for n in mdt_timeline_dir(tmp_path).iterdir() if n.name.endswith(".deltacommit"))[-1]
        last.write_text('{"instant": "2026')
        expect = "deltacommit is damaged (not JSON"
    else:
        real = reader.read_columns

        def failing(storage, *args, **kw):
            if "/.nbcc/metadata" in storage.uri:
                raise nbcc.StorageError("s3 said 503 Slow Down")
            return real(storage, *args, **kw)

        monkeypatch.setattr(reader, "read_columns", failing)
        expect = "s3 said 503 Slow Down"
    with caplog.at_level("WARNING", logger="nbcc.index_view"):
        for kw in ({}, {"filter": [("id", "=", 40)]}, {"filter": [("b", ">=", 4000)]}):
            caplog.clear()
            assert rows(t.read(**kw)) == rows(t.read(use_metadata_table=False, **kw)), kw
            assert t.plan(**kw).metadata_used == ()
            assert "could not be read" in caplog.text and t.uri in caplog.text and expect in caplog.text
    assert 40 in {r[0] for r in rows(t.read())}


def test_a_null_count_not_recorded_is_unknown_not_zero(tmp_path):
    """Statistics of a writer that records min and max but no null count: an `is_null` filter
    must keep the file, as it does when planning from the commit files."""
    t = nbcc.Table.create(str(tmp_path / "t"), SCHEMA, "id", buckets=1, merge_mode="commit_time")
    data = pa.Table.from_pylist([{"id": 1, "part": "x", "ts": 1, "a": "a1", "b": 1},
                                 {"id": 2, "part": "x", "ts": 1, "a": None, "b": 2}], schema=SCHEMA)
    instant = t.write(data)
    timeline_dir = tmp_path / "t" / ".nbcc" / "timeline"
    [commit_file] = [n for n in timeline_dir.iterdir() if n.name.startswith(f"{instant}_")]
    meta = json.loads(commit_file.read_text())
    for f in meta["files"]:
        for st in f["stats"].values():
            st.pop("nulls", None)
    commit_file.write_text(json.dumps(meta))
    t.build_index()
    got = same_both_ways(t, (FILES, COLUMN_STATS), filter=[("a", "is_null")])
    assert got == [(2, "x", 1, None, 2)]
    assert same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", "is_not_null")]) == rows(data)


def count_metadata_file_reads(monkeypatch) -> list[str]:
    """Files of metadata tables read (by any table)."""
    import nbcc.reader as reader

    real, seen = reader.read_columns, []

    def counting(storage, partition, names, *args, **kw):
        if "/.nbcc/metadata" in storage.uri:
            seen.extend(names)
        return real(storage, partition, names, *args, **kw)

    monkeypatch.setattr(reader, "read_columns", counting)
    return seen


def test_planning_again_reads_no_metadata_file_however_many_tables_the_process_reads(tmp_path, monkeypatch):
    tables = []
    for j in range(3):
        t = new_table(str(tmp_path / f"t{j}"), buckets=2)
        t.write(batch([0, 1], 0))
        t.build_index()  # ends with a compaction of the metadata table
        for ts in range(1, 9):  # each a delta commit of the metadata table: a log file per partition
            t.write(batch([ts, ts + 20], ts))
        tables.append(t)
    seen = count_metadata_file_reads(monkeypatch)
    point = [("id", "=", 3)]  # every partition: files, column statistics, key filters
    for t in tables:
        assert t.plan(filter=point).metadata_used == (COLUMN_STATS, FILES, KEY_FILTERS)
    assert len(seen) > 3 * len(KINDS)  # the first plans read every table's metadata files
    for _ in range(2):
        for t in tables:
            seen.clear()
            assert t.plan(filter=point).metadata_used and seen == []
    tables[0].write(batch([3], 9))
    for t in tables:  # the new delta commit costs its own files, one per partition
        seen.clear()
        assert rows(t.read(filter=point)) == rows(t.read(filter=point, use_metadata_table=False))
        assert len(seen) == (len(KINDS) if t is tables[0] else 0), seen


def test_metadata_table_upkeep_cleans_and_archives_while_its_compaction_is_pending(tmp_path, monkeypatch):
    """A compaction of the metadata table left pending (its writer crashed) holds back only the
    next compaction: writers still clean the metadata table and archive its timeline."""
    import nbcc.metadata_table as metadata_table

    t = new_table(str(tmp_path / "t"))
    t.write(batch([1, 2], 1))
    t.build_index()
    for ts in range(2, 8):
        t.write(batch([ts], ts))
    mdt = open_metadata_table(t.storage)
    tc = mdt.schedule_compaction()  # and the compactor crashed: it stays requested
    assert tc is not None and tc in mdt.pending_compactions()
    monkeypatch.setattr(metadata_table, "ARCHIVE_ABOVE", 5)
    monkeypatch.setattr(metadata_table, "RETAIN_COMMITS", 2)
    for ts in range(8, 11):
        t.write(batch([ts], ts))
    actions = {}
    for i in mdt.timeline():
        actions.setdefault(i.action, []).append(i)
    assert any(i.state == "completed" for i in actions.get("clean", []))  # it was cleaned ...
    assert any(i.archived for i in mdt.timeline())  # ... and its timeline archived
    assert mdt.pending_compactions() == [tc]  # the compaction still waits for a service
    same_both_ways(t, (FILES, COLUMN_STATS), filter=[("b", ">=", 9000)])
    t.clean(retain_commits=20)  # a service finishes it
    assert mdt.pending_compactions() == []
    same_both_ways(t)


def test_dropping_the_partitions_stops_a_catch_up_that_waits_for_writes(tmp_path, monkeypatch):
    """Catch-up waits for writes in flight; a drop that cancels the indexing meanwhile stops it
    at its next round, not at its timeout."""
    import nbcc.indexing as indexing

    t = new_table(str(tmp_path / "t"))
    for ts in range(1, 4):
        t.write(batch(range(ts, ts + 4), ts))
    data = batch([3, 30], 9)
    txn = t.begin_write(data.schema)  # in flight past the indexing: catch-up waits for it
    writer = t.log_writer(txn, "0-0-0")
    writer.write(prepare(data, t.config, txn.schema, "upsert"))
    files = writer.close()
    ti = indexing.schedule(t.storage, t.clock, KINDS)
    real = indexing.index_instants

    def then_dropped(storage, kinds, instants, indexed=None):  # step 2's last chunk; then the drop
        done = real(storage, kinds, instants, indexed)
        assert t.drop_index(KINDS)["cancelled"] == [ti]
        return done

    monkeypatch.setattr(indexing, "index_instants", then_dropped)
    with pytest.raises(nbcc.CommitError, match=f"indexing {ti} was cancelled"):
        indexing.run(t.storage, t.clock, ti, timeout_s=3)  # old code: IndexingTimeoutError after 3 s
    monkeypatch.undo()
    timeline_dir = tmp_path / "t" / ".nbcc" / "timeline"
    assert sorted(n.name for n in timeline_dir.iterdir() if n.name.startswith(ti)) == [f"{ti}.indexing.rolledback"]
    assert t.index_state()["pending"] == [] and read_states(t.storage, dropping=True) == {}
    txn.commit(files)
    assert set(t.build_index()["ready"]) == set(KINDS)
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", 30)])


def test_distributed_build_tasks_index_only_the_partitions_an_instant_lacks(spark, tmp_path, monkeypatch):
    """A build of [files, key_filters] after an earlier one wrote the `files` entries of every
    instant (then its key_filters were dropped): its tasks write only key_filters entries."""
    import nbcc.indexing as indexing
    from pyspark_nbcc.helpers import build_index

    uri = str(tmp_path / "t")
    t = new_table(uri)
    for ts in range(1, 7):
        t.write(batch(range(ts, ts + 4), ts))
    first = indexing.schedule(t.storage, t.clock, [FILES, KEY_FILTERS])
    real = indexing.index_instants

    def then_dropped(storage, kinds, instants, indexed=None):
        done = real(storage, kinds, instants, indexed)
        t.drop_index(KEY_FILTERS)  # cancels the run; files keeps its entries, still building
        return done

    monkeypatch.setattr(indexing, "index_instants", then_dropped)
    with pytest.raises(nbcc.CommitError, match="cancelled"):
        indexing.run(t.storage, t.clock, first)
    monkeypatch.setattr(indexing, "index_instants", real)
    assert markers(t, FILES) == completed_instants(t) and not markers(t, KEY_FILTERS)
    mdt = open_metadata_table(t.storage)
    before = {i.instant for i in mdt.timeline()}
    assert set(build_index(spark, uri, [FILES, KEY_FILTERS])["ready"]) == {FILES, KEY_FILTERS}
    written = [i for i in Timeline.load(mdt.storage).completed() if i.action == "deltacommit" and i.instant not in before]
    metas = read_commit_metadatas(mdt.storage, written)
    kinds_written = {i: {f["partition"] for f in metas[i.instant]["files"]} for i in written}
    assert kinds_written and all(k == {"kind=key_filters"} for k in kinds_written.values()), kinds_written
    same_both_ways(t, (FILES, KEY_FILTERS), filter=[("id", "=", 5)])


# -- Spark --------------------------------------------------------------------------------------------

def test_spark_reads_the_same_rows_with_and_without_the_metadata_table(spark, tmp_path):
    from pyspark_nbcc.helpers import build_index

    uri = str(tmp_path / "t")
    t = new_table(uri, buckets=2)
    for ts in range(1, 13):
        t.write(batch(range(ts, ts + 6), ts))
        if ts == 6:
            t.compact()
    result = build_index(spark, uri)  # the Spark job: base instants indexed by tasks
    assert set(result["ready"]) == set(KINDS)
    assert index_contents(t) == index_contents(rebuilt(tmp_path, t))

    def spark_rows(df):
        return sorted((tuple(r) for r in df.collect()), key=repr)

    with pushdown(spark, True):
        for where in (None, "id = 7", "id IN (3, 9, 1000)", "b >= 8000", "part = 'y'"):
            got = {}
            for use in ("true", "false"):
                df = spark.read.format("nbcc").option("use_metadata_table", use).load(uri)
                got[use] = spark_rows(df if where is None else df.where(where))
            assert got["true"] == got["false"], where
            expected = rows(t.read(use_metadata_table=False))
            if where is None:
                assert got["true"] == expected
        # A Spark write adds its own entries (its commit runs in a Spark worker).
        data = batch([5, 6, 77], 50)
        spark.createDataFrame(data).write.format("nbcc").mode("append").save(uri)
        last = max((i for i in t.timeline() if i.action == "deltacommit"), key=lambda i: i.completion)
        assert last.instant in read_rows(open_metadata_table(t.storage), FILES).column("instant").to_pylist()
        df = spark.read.format("nbcc").load(uri)
        assert spark_rows(df) == same_both_ways(t)
        assert spark_rows(df.where("id = 77")) == rows(t.read(filter=[("id", "=", 77)], use_metadata_table=False))
        with pytest.raises(Exception, match="use_metadata_table.*true or false"):
            spark.read.format("nbcc").option("use_metadata_table", "sometimes").load(uri).collect()


def test_an_indexing_run_that_stalled_through_its_cancellation_and_archival_marks_nothing_ready(tmp_path):
    """A run of Ti stalls; a drop cancels Ti, archival moves its mark into the history, and a new
    indexing Ti2 of the same partition is scheduled. The stalled run must neither mark the
    partition ready (Ti2 has not built it) nor complete Ti."""
    import nbcc.indexing as indexing

    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    t = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    t.write(pa.table({"id": [1], "ts": [1]}, schema=schema))
    ti = indexing.schedule(t.storage, t.clock, [COLUMN_STATS])
    plan = indexing.plan_of(t.storage, ti)  # what the stalled run holds
    t.drop_index(COLUMN_STATS)
    for k in range(3):
        t.write(pa.table({"id": [10 + k], "ts": [1]}, schema=schema))
    t.archive(retain_commits=1)
    assert [(i.state, i.archived) for i in t.timeline() if i.instant == ti] == [("rolledback", True)]
    ti2 = indexing.schedule(t.storage, t.clock, [COLUMN_STATS])
    for step in (lambda: indexing._check_cancelled(t.storage, ti), lambda: indexing.complete(t.storage, t.clock, ti, plan)):
        with pytest.raises(nbcc.CommitError, match="cancelled"):
            step()
    assert read_states(t.storage, dropping=True) == {COLUMN_STATS: "building"}
    assert [i.state for i in t.timeline() if i.instant == ti2] == ["requested"]
    assert [(i.state, i.archived) for i in t.timeline() if i.instant == ti] == [("rolledback", True)]
