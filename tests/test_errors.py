"""Bad input gets a clear error that says what is wrong, and nothing is written or lost."""

from __future__ import annotations

import json
import os
import shutil
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

import nbcc
from nbcc.errors import DataFileError, InvalidOptionError, SchemaError, TableConfigError, TableNotFoundError

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("ts", pa.int64())])


def _files(root: str) -> set[str]:
    """Every file under the table root (data and metadata), relative to it."""
    out = set()
    for folder, _, names in os.walk(root):
        for n in names:
            out.add(os.path.relpath(os.path.join(folder, n), root))
    return {f for f in out if not f.startswith(".nbcc/lock/")}  # lock state moves with every time issued


@pytest.fixture
def table(local_table):
    uri, _ = local_table
    t = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=2)
    t.write(pa.table({"id": [1, 2], "name": ["a", "b"], "ts": [1, 1]}))
    return t


def _unchanged(table, before_files, before_rows):
    assert _files(table.uri) == before_files
    assert table.read().sort_by("id").to_pylist() == before_rows


def test_create_without_record_key(local_table):
    uri, _ = local_table
    with pytest.raises(SchemaError, match="record_key is required"):
        nbcc.Table.create(uri, SCHEMA, None)
    assert not Path(uri).exists()


def test_null_record_key_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="record key column 'id' has 1 null"):
        table.write(pa.table({"id": [3, None], "name": ["c", "d"], "ts": [1, 1]}))
    _unchanged(table, files, rows)


def test_missing_ordering_field_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="ordering_field column 'ts'"):
        table.write(pa.table({"id": [3], "name": ["c"]}))
    _unchanged(table, files, rows)


def test_null_ordering_value_in_upsert_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="ordering_field 'ts' has 1 null"):
        table.write(pa.table({"id": [3, 4], "name": ["c", "d"], "ts": [1, None]}))
    _unchanged(table, files, rows)


def test_changed_type_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="column 'name' has type int64 in the data but string in the table"):
        table.write(pa.table({"id": [3], "name": [5], "ts": [1]}))
    _unchanged(table, files, rows)


def test_missing_non_nullable_column_writes_nothing(local_table):
    uri, _ = local_table
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("must", pa.string(), nullable=False)])
    t = nbcc.Table.create(uri, schema, "id")
    t.write(pa.table({"id": [1], "must": ["x"]}, schema=schema))
    files = _files(uri)
    with pytest.raises(SchemaError, match="column 'must' .*not nullable.* missing"):
        t.write(pa.table({"id": [2]}))
    assert _files(uri) == files


def test_null_in_non_nullable_column_writes_nothing(local_table):
    uri, _ = local_table
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("must", pa.string(), nullable=False)])
    t = nbcc.Table.create(uri, schema, "id")
    files = _files(uri)
    with pytest.raises(SchemaError, match="column 'must' is not nullable"):
        t.write(pa.table({"id": [1, 2], "must": ["x", None]}))
    assert _files(uri) == files


def test_new_nullable_column_is_added_and_older_rows_read_null(table):
    table.write(pa.table({"id": [3], "name": ["c"], "ts": [1], "extra": [2.5]}))
    got = table.read().sort_by("id")
    assert got.schema.names == ["id", "name", "ts", "extra"]
    assert got.column("extra").to_pylist() == [None, None, 2.5]


def test_reserved_column_name_is_refused(table):
    with pytest.raises(SchemaError, match="reserved prefix '_nbcc_'"):
        table.write(pa.table({"id": [3], "name": ["c"], "ts": [1], "_nbcc_commit_time": ["x"]}))


def test_reading_a_uri_that_is_not_a_table(tmp_path):
    with pytest.raises(TableNotFoundError, match="is not an nbcc table"):
        nbcc.Table.open(str(tmp_path))


def _data_files(table):
    return [(s.partition, n) for s in table.file_slices() for n in s.file_names()]


def test_missing_committed_file_fails_the_read_and_names_it(table):
    _, name = _data_files(table)[0]
    os.remove(os.path.join(table.uri, name))
    with pytest.raises(DataFileError, match=f"{name} is missing"):
        table.read()


def test_corrupt_committed_file_fails_the_read_and_names_it(table):
    _, name = _data_files(table)[0]
    path = os.path.join(table.uri, name)
    Path(path).write_bytes(Path(path).read_bytes()[: 40])
    with pytest.raises(DataFileError, match=f"{name} cannot be read"):
        table.read()


def _rolled_back_once(table, before_files):
    """The write after `before_files` was undone at once: its only trace is its rolled-back mark."""
    marks = _files(table.uri) - before_files
    assert len(marks) == 1 and next(iter(marks)).endswith(".deltacommit.rolledback"), marks
    assert table.timeline()[-1].state == "rolledback"


def test_stream_that_fails_part_way_is_rolled_back_at_once(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()

    def batches():
        yield pa.record_batch({"id": [10, 11], "name": ["x", "y"], "ts": [5, 5]})
        yield pa.record_batch({"id": [12, None], "name": ["z", "w"], "ts": [5, 5]})

    with pytest.raises(SchemaError, match="null"):
        table.write(batches(), max_log_file_bytes=1)  # a file per batch: the first one was written
    _rolled_back_once(table, files)
    assert [i.state for i in table.timeline()] == ["completed", "rolledback"]
    assert table.read().sort_by("id").to_pylist() == rows
    table.write(pa.table({"id": [10], "name": ["x"], "ts": [5]}))  # the table takes writes as before
    assert len(table.read()) == len(rows) + 1


def test_a_write_that_cannot_take_the_lock_is_left_to_the_cleaner(table, caplog):
    # Rolling back needs the lock too: trying would keep the caller waiting as long again (and
    # then log that the rollback failed).
    from nbcc.clock import TimeGenerator

    table.clock = TimeGenerator(table.storage, lease_ms=table.config.lock_lease_ms, timeout_ms=300)
    holder = TimeGenerator(table.storage, lease_ms=60_000).locked()

    def batches():
        yield pa.record_batch({"id": [10], "name": ["x"], "ts": [5]})
        holder.__enter__()  # another process takes the lock and keeps it past the write's timeout

    try:
        with pytest.raises(nbcc.LockTimeoutError):
            table.write(batches())
    finally:
        holder.__exit__(None, None, None)
    assert [i.state for i in table.timeline()] == ["completed", "inflight"]
    assert "rolling it back failed" not in caplog.text  # no rollback was tried
    assert table.rollback_failed_writes(heartbeat_timeout_s=0) == [table.timeline()[-1].instant]


def test_a_commit_refused_at_completion_is_rolled_back_at_once(table):
    # Two writers add column x with different types: the one completing later is refused.
    files = _files(table.uri)

    def batches():
        yield pa.record_batch({"id": [10], "name": ["x"], "ts": [5], "x": [1]})
        nbcc.Table.open(table.uri).write(pa.table({"id": [20], "name": ["o"], "ts": [5], "x": ["s"]}))
        yield pa.record_batch({"id": [11], "name": ["y"], "ts": [5], "x": [2]})

    with pytest.raises(SchemaError, match="column 'x' was added as string by commit .* as int64"):
        table.write(batches())
    # In instant order: the first commit, the refused write, the other writer's commit.
    assert [i.state for i in table.timeline()] == ["completed", "rolledback", "completed"]
    assert sorted(table.read().column("id").to_pylist()) == [1, 2, 20]
    added = {f for f in _files(table.uri) - files if not f.startswith(".nbcc/")}
    assert added and all(table.timeline()[2].instant in f for f in added)  # only the other writer's files


def test_values_that_cannot_be_converted_write_nothing(local_table):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("t", pa.timestamp("ns")),
                        ("s", pa.struct([pa.field("a", pa.int64(), nullable=False)]))])
    t = nbcc.Table.create(uri, schema, "id")
    files = _files(uri)
    far = pa.array([0, 32503680000], pa.timestamp("s"))  # the year 3000: past timestamp[ns]
    with pytest.raises(SchemaError, match=r"column 't': its timestamp\[s\] values cannot be stored as the "
                                          r"table's timestamp\[ns\]"):
        t.write(pa.table({"id": [1, 2], "t": far}))
    with pytest.raises(SchemaError, match="column 's': .*field 'a' .* has nulls"):
        t.write(pa.table({"id": [1], "s": pa.array([{"a": None}], pa.struct([("a", pa.int64())]))}))
    assert _files(uri) == files and t.timeline() == []


def test_duplicate_column_names_are_refused(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    data = pa.Table.from_arrays([pa.array([3]), pa.array(["c"]), pa.array([1]), pa.array(["d"])],
                                names=["id", "name", "ts", "name"])
    with pytest.raises(SchemaError, match=r"column name\(s\) \['name'\] appear more than once in the data"):
        table.write(data)
    _unchanged(table, files, rows)


def test_columns_of_types_parquet_lacks_are_stored_plain(table):
    # pandas categoricals, Polars strings and embedding arrays: stored as string and list.
    table.write(pa.table({"id": [3], "name": pa.array(["c"]).dictionary_encode(), "ts": [1],
                          "tag": pa.array(["t"], pa.string_view()),
                          "vec": pa.array([[1.0, 2.0]], pa.list_(pa.float32(), 2))}))
    assert table.schema().field("tag").type == pa.string()
    assert table.schema().field("vec").type == pa.list_(pa.float32())
    got = table.read().sort_by("id").to_pylist()
    assert got[-1] == {"id": 3, "name": "c", "ts": 1, "tag": "t", "vec": [1.0, 2.0]}


def test_a_schema_with_types_parquet_lacks_creates_a_table_of_their_plain_types(local_table):
    uri, _ = local_table
    data = pa.table({"id": [1], "tag": pa.array(["t"]).dictionary_encode(),
                     "vec": pa.array([[1.0, 2.0]], pa.list_(pa.float32(), 2))})
    t = nbcc.Table.open_or_create(uri, data.schema, record_key="id")  # a first write's path
    assert t.schema() == pa.schema([pa.field("id", pa.int64(), nullable=False), ("tag", pa.string()),
                                    ("vec", pa.list_(pa.float32()))])
    t.write(data)
    assert t.read().to_pylist() == [{"id": 1, "tag": "t", "vec": [1.0, 2.0]}]


def test_a_new_column_without_a_type_or_of_a_type_nbcc_cannot_store_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="column 'note' has type null .* give it a type"):
        table.write(pa.table({"id": [3], "name": ["c"], "ts": [1], "note": [None]}))
    with pytest.raises(SchemaError, match="column 'gap' has type month_day_nano_interval, which nbcc cannot store"):
        table.write(pa.table({"id": [3], "name": ["c"], "ts": [1],
                              "gap": pa.array([pa.MonthDayNano([1, 2, 3])], pa.month_day_nano_interval())}))
    # Arrow has decimals of a negative scale, Parquet not: the write failed after its instant began.
    with pytest.raises(SchemaError, match=r"column 'n' holds decimal256\(3, -1\), a decimal with a negative "
                                          r"scale, which Parquet cannot store; cast it to decimal256\(4, 0\)"):
        table.write(pa.table({"id": [3], "name": ["c"], "ts": [1],
                              "n": pa.array([[Decimal(100)]], pa.list_(pa.decimal256(3, -1)))}))
    _unchanged(table, files, rows)
    with pytest.raises(SchemaError, match=r"'d' holds decimal128\(5, -2\).* cast it to decimal128\(7, 0\)"):
        nbcc.Table.create(table.uri + "-negative", pa.schema([("id", pa.int64()), ("d", pa.decimal128(5, -2))]), "id")
    table.write(pa.table({"id": [3], "name": [None], "ts": [1]}))  # all None into a typed column: fine
    assert table.read().sort_by("id").to_pylist()[-1] == {"id": 3, "name": None, "ts": 1}


def test_a_delete_flag_that_is_not_boolean_writes_nothing(table, tmp_path):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="'_nbcc_is_deleted' has type int64; it must be boolean"):
        table.write(pa.table({"id": [1], "name": ["a"], "ts": [2], "_nbcc_is_deleted": [1]}))
    # A first write (open_or_create) with a bad flag creates no table.
    other = str(tmp_path / "first")
    with pytest.raises(SchemaError, match="'_nbcc_is_deleted' has type string; it must be boolean"):
        nbcc.Table.open_or_create(other, pa.schema([("id", pa.int64()), ("_nbcc_is_deleted", pa.string())]),
                                  record_key="id")
    with pytest.raises(nbcc.TableNotFoundError):
        nbcc.Table.open(other)
    _unchanged(table, files, rows)
    table.write(pa.table({"id": [1], "name": ["z"], "ts": [2], "_nbcc_is_deleted": [None]}))  # untyped: none deleted
    assert table.read().sort_by("id").column("name").to_pylist() == ["z", "b"]


def test_composite_key_values_that_would_make_one_key_text_for_two_keys_write_nothing(local_table):
    # (`x,k2:y`, `z`) and (`x`, `y,k2:z`) would both be `k1:x,k2:y,k2:z`, which incremental and
    # change reads select records by.
    uri, _ = local_table
    schema = pa.schema([("k1", pa.string()), ("k2", pa.string()), ("v", pa.int64())])
    t = nbcc.Table.create(uri, schema, ["k1", "k2"], buckets=1)
    t.write(pa.table({"k1": ["a,b", "c:d"], "k2": ["k1:e", "f"], "v": [1, 2]}, schema=schema))  # ',' and ':' are fine
    files = _files(uri)
    for k1, k2, column in [("x,k2:y", "z", "k1"), ("x", "y,k2:z", "k2")]:
        with pytest.raises(SchemaError, match=f"record key column '{column}' has 1 value.* containing ',k2:'"):
            t.write(pa.table({"k1": [k1], "k2": [k2], "v": [3]}, schema=schema))
    with pytest.raises(SchemaError, match="record key column 'k1' has 1 value.* containing ',k2:'"):
        t.write(pa.table({"k1": pa.array(["x,k2:y"]).dictionary_encode(), "k2": ["z"], "v": [3]}))
    assert _files(uri) == files


def test_a_delete_adds_no_columns(table):
    table.write(pa.table({"id": [1], "junk": ["x"]}), operation="Delete")  # any case, as the Spark option
    assert table.schema().names == ["id", "name", "ts"]
    assert table.read().column("id").to_pylist() == [2]


@pytest.mark.parametrize("settings, error, message", [
    (dict(schema=pa.schema([("id", pa.int64()), ("a", pa.string()), ("a", pa.int64())])), SchemaError,
     r"column name\(s\) \['a'\] appear more than once in the schema"),
    (dict(record_key=["id", "id"]), InvalidOptionError, r"record_key names a column more than once"),
    (dict(record_key=1), InvalidOptionError, "column names must be a string .* or a list of strings; got 1"),
    (dict(partition_by="a/b", schema=pa.schema([("id", pa.int64()), ("a/b", pa.string())])), SchemaError,
     "partition column 'a/b': .* may not be empty, contain '/' or '='"),
    (dict(partition_by="p", schema=pa.schema([("id", pa.int64()), ("p", pa.list_(pa.int64()))])), SchemaError,
     "partition column 'p' has type list<item: int64>; partition by a string, integer"),
    (dict(schema=pa.schema([("id", pa.int64()), ("n", pa.null())])), SchemaError, "column 'n' has type null"),
    (dict(buckets=2.7), InvalidOptionError, "option 'buckets' must be a positive integer, got 2.7"),
    (dict(lock_lease_ms=5), InvalidOptionError, "option 'lock_lease_ms' must be an integer of at least 1000"),
    (dict(schema={"id": "int64"}), InvalidOptionError, "schema must be a pyarrow.Schema"),
])
def test_create_refuses_settings_that_would_make_a_broken_table(local_table, settings, error, message):
    uri, _ = local_table
    args = {"schema": SCHEMA, "record_key": "id", **settings}
    with pytest.raises(error, match=message):
        nbcc.Table.create(uri, args.pop("schema"), args.pop("record_key"), **args)
    assert not Path(uri).exists()


def test_a_damaged_table_json_names_the_table_and_the_problem(table):
    config = Path(table.uri, ".nbcc", "table.json")
    good = config.read_text()
    for damaged, problem in [("{", "is not a JSON object"), (good.replace('"buckets": 2', '"buckets": 0'),
                             "option 'buckets' must be a positive integer, got 0"),
                             (good.replace('"record_key"', '"key"'), "lacks the required field 'record_key'")]:
        config.write_text(damaged)
        with pytest.raises(TableConfigError, match=f"the nbcc table at {table.uri} cannot be opened: .*{problem}"):
            nbcc.Table.open(table.uri)


def test_a_damaged_timeline_file_names_the_file_and_the_problem(table, capsys):
    from nbcc.cli import main

    table.compact()
    table.write(pa.table({"id": [3], "name": ["c"], "ts": [1]}))
    expected = table.read().sort_by("id").to_pylist()
    timeline = Path(table.uri, ".nbcc", "timeline")
    [commit] = sorted(timeline.glob("*.commit"))
    [plan] = sorted(timeline.glob("*.compaction.requested"))
    latest = sorted(timeline.glob("*.deltacommit"))[-1]
    for path, damaged, problem in [(latest, "garbage", "not JSON: Expecting value"), (latest, "", "empty"),
                                   (latest, '{"files": {}}', "no list 'files'"), (commit, "[]", "a JSON list, not an object"),
                                   (plan, '{"instant": "2026', "not JSON: Unterminated string")]:
        good = path.read_bytes()
        path.write_text(damaged)
        nbcc.timeline._CACHE.clear()  # as in a new process: this one read the good file
        with pytest.raises(nbcc.TimelineFileError) as caught:
            table.read()
        message = str(caught.value)
        assert message.startswith(f"{table.uri}/.nbcc/timeline/{path.name} is damaged ({problem}")
        assert "Put the file back from a backup" in message
        assert main(["describe", table.uri]) == 1
        assert capsys.readouterr().err == f"nbcc: error: {message}\n"
        path.write_bytes(good)
        assert table.read().sort_by("id").to_pylist() == expected
    # A pending indexing's plan (a write in flight held its catch-up back).
    table.begin_write(table.schema())
    with pytest.raises(nbcc.NbccError, match="still in flight"):
        table.build_index("files", timeout_s=0.2)
    [indexing] = sorted(timeline.glob("*.indexing.requested"))
    indexing.write_text("")
    assert main(["index", table.uri]) == 1
    assert capsys.readouterr().err.startswith(f"nbcc: error: {table.uri}/.nbcc/timeline/{indexing.name} is damaged "
                                              f"(empty); it holds the plan of indexing {indexing.name[:17]}")


@pytest.mark.parametrize("version", [6, 0, "2"])
def test_a_table_of_another_format_version_is_refused_and_the_message_says_so(table, version):
    # format.md §3: `format_version` is 1 (2 once a dynamic partition overwrite began, 3 once a
    # partition deletion did, 4 once a type widening did, 5 once a savepoint was made), and a
    # reader MUST refuse any other value.
    config = Path(table.uri, ".nbcc", "table.json")
    doc = json.loads(config.read_text())
    assert doc["format_version"] == 1
    before_files, before_rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    config.write_text(json.dumps({**doc, "format_version": version}, indent=2))
    with pytest.raises(nbcc.NbccError) as err:
        nbcc.Table.open(table.uri)
    message = str(err.value)
    assert f"format version {version} is not supported" in message, message
    assert "supports 1 to 5" in message and table.uri in message, message
    config.write_text(json.dumps(doc, indent=2))
    _unchanged(nbcc.Table.open(table.uri), before_files, before_rows)


def test_write_arguments_are_parsed_like_options(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    for bad, message in [({"compaction_delta_commits": -1}, "'compaction_delta_commits' must be a positive integer"),
                         ({"max_log_file_bytes": "abc"}, "'max_log_file_bytes' must be a positive integer"),
                         ({"compaction_inline": "no"}, "'compaction_inline' must be true or false")]:
        with pytest.raises(InvalidOptionError, match=message):
            table.write(pa.table({"id": [3], "name": ["c"], "ts": [1]}), **bad)
    _unchanged(table, files, rows)
    table.write(pa.table({"id": [3], "name": ["c"], "ts": [1]}), compaction_delta_commits="2",
                compaction_inline="false")
    assert [(i.action, i.state) for i in table.timeline()][-1] == ("compaction", "requested")  # not run


def test_table_service_arguments_of_the_wrong_type_are_refused(table):
    # Python arguments have their types: "5" or 2.5 commits was taken as 5 or 2 by clean and
    # refused by history; a heartbeat timeout of -1 rolled back a write that was still running.
    table.write(pa.table({"id": [3], "name": ["c"], "ts": [1]}))
    live = table.begin_write(SCHEMA)  # a write whose writer is still running
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    calls = [
        (lambda: table.clean(retain_commits="1"), "retain_commits must be a whole number of data commits, 1 or more; got '1'"),
        (lambda: table.clean(retain_commits=1.5), "retain_commits must be a whole number of data commits, 1 or more; got 1.5"),
        (lambda: table.clean(retain_commits=True), "retain_commits must be a whole number of data commits, 1 or more; got True"),
        (lambda: table.clean(heartbeat_timeout_s=-1), "heartbeat_timeout_s must be a number of seconds, 0 or more; got -1"),
        (lambda: table.clean(heartbeat_timeout_s="0"), "heartbeat_timeout_s must be a number of seconds, 0 or more; got '0'"),
        (lambda: table.clean(retain_hours=float("nan")), "retain_hours must be a number of hours, 0 or more; got nan"),
        (lambda: table.rollback_failed_writes(heartbeat_timeout_s=-1), "heartbeat_timeout_s must be a number of seconds"),
        (lambda: table.archive(retain_commits="1"), "retain_commits must be a whole number of data commits, 1 or more; got '1'"),
        (lambda: table.archive(retain_commits=0), "retain_commits must be a whole number of data commits, 1 or more; got 0"),
        (lambda: table.history(limit="5"), "limit must be a whole number of commits, 1 or more; got '5'"),
        (lambda: table.build_index(timeout_s="60"), "timeout_s must be a number of seconds, 0 or more; got '60'"),
    ]
    for call, message in calls:
        with pytest.raises(InvalidOptionError) as err:
            call()
        assert str(err.value) == message or str(err.value).startswith(message), (message, str(err.value))
    _unchanged(table, files, rows)
    live.commit([])  # not rolled back
    assert [i.state for i in table.timeline()] == ["completed"] * 3
    # NumPy's whole numbers are whole numbers.
    import numpy as np
    assert len(table.history(limit=np.int64(2))) == 2
    assert table.clean(retain_commits=np.int64(1), heartbeat_timeout_s=np.float64(300))["rolled_back"] == []


def test_option_that_contradicts_the_table(table):
    with pytest.raises(InvalidOptionError, match="buckets=4 differs from the table's buckets=2"):
        nbcc.Table.open_or_create(table.uri, SCHEMA, buckets=4)
    with pytest.raises(InvalidOptionError, match="lock_lease_ms=60000 differs from the table's lock_lease_ms=30000"):
        nbcc.Table.open_or_create(table.uri, SCHEMA, lock_lease_ms=60000)
    # The same settings in any form create accepts match.
    nbcc.Table.open_or_create(table.uri, SCHEMA, record_key="id", buckets="2", merge_mode="EVENT_TIME",
                              ordering_field="ts")
    nbcc.Table.open_or_create(table.uri, SCHEMA, record_key=["id"])


def test_option_that_contradicts_a_table_with_no_commit_says_it_may_be_deleted(local_table):
    uri, _ = local_table
    nbcc.Table.create(uri, SCHEMA, "id", buckets=2)
    with pytest.raises(InvalidOptionError, match=r"buckets=4 differs .* no commit yet: if a failed first write "
                                                 r"left it and nothing writes it now, delete "):
        nbcc.Table.open_or_create(uri, SCHEMA, buckets=4)
    nbcc.Table.open(uri).write(pa.table({"id": [1], "name": ["a"], "ts": [1]}))
    with pytest.raises(InvalidOptionError, match="buckets=4 differs") as e:
        nbcc.Table.open_or_create(uri, SCHEMA, buckets=4)
    assert "delete" not in str(e.value)  # a table with rows is never to be deleted for an option


def test_unknown_table_option_is_an_error_for_a_new_or_an_existing_table(table, tmp_path):
    for uri in (table.uri, str(tmp_path / "new")):
        with pytest.raises(InvalidOptionError, match=r"unknown table option\(s\): partiton_by\. Valid table "
                                                     r"options: record_key, .*partition_by"):
            nbcc.Table.open_or_create(uri, SCHEMA, record_key="id", partiton_by="name")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("kind, options, hint", [
    ("streaming write", {"orderingfield": "ts"}, "orderingfield: did you mean ordering_field?"),
    ("write", {"recordKey": "id"}, "recordKey: did you mean record_key?"),
    ("write", {"partitionBy": "day"}, "partitionBy: did you mean partition_by?"),
    ("read", {"versionAsOf": "3"}, "versionAsOf: nbcc's is as_of (a time: nbcc has no version numbers)"),
    ("streaming read", {"startingtimestamp": "2026-11-01"}, "startingtimestamp: nbcc's is begin"),
    ("write", {"hoodie.datasource.write.precombine.field": "ts"},
     "hoodie.datasource.write.precombine.field: nbcc's is ordering_field"),
])
def test_an_unknown_option_names_the_option_meant(kind, options, hint):
    # Spark hands options over in lower case: a camel-cased or Delta/Hudi name arrives unlike ours.
    from nbcc.config import READ_OPTIONS, STREAM_READ_OPTIONS, STREAM_WRITE_OPTIONS, WRITE_OPTIONS, parse_options

    specs = {"write": WRITE_OPTIONS, "read": READ_OPTIONS, "streaming write": STREAM_WRITE_OPTIONS,
             "streaming read": STREAM_READ_OPTIONS}[kind]
    with pytest.raises(InvalidOptionError) as err:
        parse_options(options, specs, kind)
    assert str(err.value).startswith(f"unknown {kind} option(s): {next(iter(options))}. Valid {kind} options: ")
    assert str(err.value).endswith(f". {hint}")


# -- through Spark -----------------------------------------------------------------------------

def test_spark_unknown_option_lists_valid_ones_and_writes_nothing(spark, tmp_path):
    uri = str(tmp_path / "t")
    df = spark.createDataFrame([(1, "a")], "id long, name string")
    # Spark lowercases option names; the list spells them as users know them.
    with pytest.raises(Exception, match=r"unknown write option\(s\): recordkey\. Valid write options: "
                                        r".*partitionOverwriteMode.*record_key"):
        df.write.format("nbcc").mode("append").option("recordkey", "id").save(uri)
    assert not Path(uri).exists()
    df.write.format("nbcc").mode("append").option("record_key", "id").save(uri)
    with pytest.raises(Exception, match=r"unknown read option\(s\): as_of_typo"):
        spark.read.format("nbcc").option("as_of_typo", "1").load(uri).collect()


def test_spark_first_write_without_record_key(spark, tmp_path):
    uri = str(tmp_path / "t")
    with pytest.raises(Exception, match="record_key is required"):
        spark.createDataFrame([(1, "a")], "id long, name string").write.format("nbcc").mode("append").save(uri)
    assert not Path(uri, ".nbcc").exists()


def test_spark_failed_first_write_then_other_options(spark, tmp_path):
    uri = str(tmp_path / "t")

    def writer(df, buckets):
        df.write.format("nbcc").mode("append").option("record_key", "id").option("buckets", buckets).save(uri)

    with pytest.raises(Exception, match="record key column 'id' has 1 null"):
        writer(spark.createDataFrame([(1, "a"), (None, "b")], "id long, name string"), 4)
    good = spark.createDataFrame([(1, "a")], "id long, name string")
    with pytest.raises(Exception, match=r"buckets=8 differs from the table's buckets=4.* no commit yet.* delete "):
        writer(good, 8)
    shutil.rmtree(uri)  # as the error says
    writer(good, 8)
    assert nbcc.Table.open(uri).config.buckets == 8
    assert [r.id for r in spark.read.format("nbcc").load(uri).collect()] == [1]


def test_spark_first_write_sets_the_lock_lease_and_heartbeat_timeout(spark, tmp_path):
    uri = str(tmp_path / "t")
    df = spark.createDataFrame([(1, "a")], "id long, name string")
    with pytest.raises(Exception, match="option 'lock_lease_ms' must be an integer of at least 1000"):
        df.write.format("nbcc").mode("append").option("record_key", "id").option("lock_lease_ms", "5").save(uri)
    assert not Path(uri).exists()
    (df.write.format("nbcc").mode("append").option("record_key", "id").option("lock_lease_ms", "5000")
       .option("heartbeat_timeout_s", "60").save(uri))
    config = nbcc.Table.open(uri).config
    assert (config.lock_lease_ms, config.heartbeat_timeout_s) == (5000, 60)
    with pytest.raises(Exception, match="heartbeat_timeout_s=30 differs from the table's heartbeat_timeout_s=60"):
        df.write.format("nbcc").mode("append").option("heartbeat_timeout_s", "30").save(uri)
    assert nbcc.Table.open(uri).read().num_rows == 1


def test_spark_read_of_a_uri_that_is_not_a_table(spark, tmp_path):
    with pytest.raises(Exception, match="is not an nbcc table"):
        spark.read.format("nbcc").load(str(tmp_path)).collect()


def test_spark_catalog_tables_are_refused_with_the_sql_way_that_works(spark, table):
    """Spark passes a Python data source no location or options for a catalog table: each way of
    making or using one fails and says to use a temporary view, and nothing is written."""
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(Exception, match=r"CREATE TEMPORARY VIEW <name> USING nbcc OPTIONS \(path '<uri>'\)"):
        spark.sql(f"CREATE TABLE nbcc_catalog_a USING nbcc LOCATION '{table.uri}'")
    assert not spark.catalog.tableExists("nbcc_catalog_a")
    spark.sql("CREATE TABLE nbcc_catalog_b (id long, name string, ts long) USING nbcc")  # Spark asks nbcc nothing
    try:
        for statement in ("INSERT INTO nbcc_catalog_b VALUES (9, 'z', 1)", "SELECT * FROM nbcc_catalog_b"):
            with pytest.raises(Exception, match=r"no table path: .*USING nbcc OPTIONS \(path '<uri>'\); an nbcc table cannot be a catalog table"):
                spark.sql(statement).collect()
        with pytest.raises(Exception, match=r"no table path: .*an nbcc table cannot be a catalog table"):
            spark.createDataFrame([(9, "z", 1)], "id long, name string, ts long").write.format("nbcc").saveAsTable("nbcc_catalog_c")
        query = (spark.readStream.format("rate").load().selectExpr("value AS id").writeStream.format("nbcc")
                 .option("checkpointLocation", str(Path(table.uri).parent / "ck")).toTable("nbcc_catalog_d"))
        with pytest.raises(Exception, match=r"no table path: .*an nbcc table cannot be a catalog table"):
            query.awaitTermination(120)
            query.stop()
    finally:
        spark.sql("DROP TABLE IF EXISTS nbcc_catalog_b")
        spark.sql("DROP TABLE IF EXISTS nbcc_catalog_d")
    _unchanged(table, files, rows)


def test_spark_write_failing_in_a_task_is_rolled_back(spark, table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    bad = spark.createDataFrame([(3, "c", 1), (None, "d", 1)], "id long, name string, ts long")
    with pytest.raises(Exception, match="record key column 'id' has 1 null"):
        bad.write.format("nbcc").mode("append").save(table.uri)
    # abort rolled the instant back at once: no data file left, the same rows, and the instant
    # marked rolled back on the timeline (its only trace).
    marks = _files(table.uri) - files
    assert len(marks) == 1 and next(iter(marks)).endswith(".deltacommit.rolledback")
    assert [i.state for i in table.timeline()] == ["completed", "rolledback"]
    assert table.read().sort_by("id").to_pylist() == rows


def test_spark_read_of_a_missing_file_names_it(spark, table):
    _, name = _data_files(table)[0]
    os.remove(os.path.join(table.uri, name))
    with pytest.raises(Exception, match=f"{name} is missing"):
        spark.read.format("nbcc").load(table.uri).collect()


def test_buckets_beyond_the_file_group_id_digits_are_refused_before_the_table_exists(local_table):
    # A file group id holds the bucket as 8 digits: more than 10**8 buckets made a table.json
    # that no write could then use (every write failed naming a bucket, not the option).
    uri, _ = local_table
    with pytest.raises(InvalidOptionError, match="option 'buckets' must be at most 100000000 .* got 1099511627776"):
        nbcc.Table.create(uri, pa.schema([("id", pa.string())]), "id", buckets=2**40)
    assert not Path(uri).exists()
    table = nbcc.Table.create(uri, pa.schema([("id", pa.string())]), "id", buckets=10**8)
    table.write(pa.table({"id": ["id1", "user_001", "zzzzzzzzzz"]}))  # buckets 104085, 66504543, 81274332
    assert sorted(table.read().column("id").to_pylist()) == ["id1", "user_001", "zzzzzzzzzz"]


def test_spark_buckets_beyond_the_limit_are_refused_before_the_table_exists(spark, tmp_path):
    uri = str(tmp_path / "t")
    df = spark.createDataFrame([("id1",)], "id string")
    with pytest.raises(Exception, match="option 'buckets' must be at most 100000000"):
        df.write.format("nbcc").mode("append").option("record_key", "id").option("buckets", str(2**40)).save(uri)
    assert not Path(uri).exists()


def test_a_table_path_that_is_a_file_is_refused_and_the_file_kept(tmp_path):
    # Creating a table there raised a raw NotADirectoryError naming `<path>/.nbcc`.
    path = tmp_path / "report.csv"
    path.write_text("a,b\n")
    schema = pa.schema([("id", pa.int64())])
    message = f"{path} is a file, not a folder; give a folder path for the table"
    with pytest.raises(InvalidOptionError, match=message):
        nbcc.Table.create(str(path), schema, "id")
    with pytest.raises(InvalidOptionError, match=message):
        nbcc.Table.open_or_create(str(path), schema, record_key="id")
    with pytest.raises(TableNotFoundError, match=f"{path} is not an nbcc table: {path} is a file, not a folder"):
        nbcc.Table.open(str(path))
    with pytest.raises(InvalidOptionError, match=rf"{path} is a file, not a folder \(it is on the table path "):
        nbcc.Table.create(str(path / "t"), schema, "id")
    assert [p.name for p in tmp_path.iterdir()] == ["report.csv"] and path.read_text() == "a,b\n"


def test_spark_save_to_a_path_that_is_a_file_is_refused_and_the_file_kept(spark, tmp_path):
    path = tmp_path / "report.csv"
    path.write_text("a,b\n")
    df = spark.createDataFrame([(1,)], "id long")
    with pytest.raises(Exception, match=f"{path} is a file, not a folder; give a folder path for the table"):
        df.write.format("nbcc").mode("append").option("record_key", "id").save(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["report.csv"] and path.read_text() == "a,b\n"


def _folders(root: str) -> set[str]:
    return {os.path.relpath(folder, root) for folder, _, _ in os.walk(root) if "/.nbcc" not in folder + "/"}


def test_a_partition_value_too_long_for_a_folder_name_is_refused_before_anything_is_written(local_table):
    # Past 255 bytes (column name, '=' and the percent-encoded value) opening the first file
    # failed with a raw "File name too long", leaving the folders made on the way.
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("p", pa.string()), ("q", pa.string())])
    table = nbcc.Table.create(uri, schema, "id", partition_by=["p", "q"], buckets=1)
    table.write(pa.table({"id": [1], "p": ["a"], "q": ["b"]}, schema=schema))
    files, folders, rows = _files(uri), _folders(uri), table.read().sort_by("id").to_pylist()
    fits = "x" * 253  # "q=" + 253 bytes: 255
    for value, size in [("x" * 254, 256), ("é" * 43, 260)]:  # 2 UTF-8 bytes, 6 encoded: %C3%A9
        bad = pa.table({"id": [2, 3], "p": ["a", "b"], "q": [fits, value]}, schema=schema)
        with pytest.raises(SchemaError, match=f"partition column 'q' has a value whose folder name .* is {size} bytes; "
                                              "a folder name may have at most 255 bytes"):
            table.write(bad)
        # A stream is checked chunk by chunk after its instant began: it is rolled back.
        with pytest.raises(SchemaError, match="partition column 'q'"):
            table.write(bad.to_reader())
        assert _folders(uri) == folders
    assert table.read().sort_by("id").to_pylist() == rows
    assert {f for f in _files(uri) - files if not f.endswith(".rolledback")} == set()
    table.write(pa.table({"id": [2], "p": ["a"], "q": [fits]}, schema=schema))
    assert table.read(filter=[("id", "=", 2)]).column("q").to_pylist() == [fits]


def test_spark_write_of_a_partition_value_too_long_for_a_folder_name_is_refused(spark, tmp_path):
    uri = str(tmp_path / "t")
    # One task: another task's rows could still be landing when the job's abort rolls back.
    df = spark.createDataFrame([(1, "a"), (2, "y" * 300)], "id long, p string").coalesce(1)
    with pytest.raises(Exception, match="partition column 'p' has a value whose folder name .* is 302 bytes"):
        df.write.format("nbcc").mode("append").option("record_key", "id").option("partition_by", "p").save(uri)
    assert _folders(uri) == {"."}  # the chunk was refused whole: not even "p=a" was made
    assert nbcc.Table.open(uri).read().num_rows == 0
