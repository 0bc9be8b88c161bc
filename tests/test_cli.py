"""The `nbcc` command (issue 4, "The nbcc command"): the installed console script once (a real
process: output and exit codes), then `nbcc.cli.main` in-process for every command.

Expected values come from what the tests wrote (the instants `table.write` returned, the files on
disk, the rows written) and, for what only the table knows (completion times, slice layout), from
the Python API the command is a front end to.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import nbcc
from nbcc.cli import build_parser, main
from nbcc.timeline import read_commit_metadata
from nbcc.writer import prepare

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = pa.schema([("id", pa.int64()), ("p", pa.string()), ("v", pa.int64())])
NBCC = Path(sys.executable).parent / "nbcc"


def batch(ids, version, parts=("a", "b")):
    return pa.table({"id": list(ids), "p": [parts[i % len(parts)] for i in ids], "v": [version] * len(ids)},
                    schema=SCHEMA)


def make_table(uri, options=None, commits=3, partitioned=True) -> tuple[nbcc.Table, list[str]]:
    table = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="v", partition_by="p" if partitioned else (),
                              buckets=2, storage_options=options)
    instants = [table.write(batch(range(8), version)) for version in range(commits)]
    return table, instants


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rows_of(out: str) -> list[list[str]]:
    """The rows of an aligned table (header dropped), split into cells."""
    lines = out.strip().splitlines()
    return [line.split() for line in lines[1:]]


def data_files(root: str) -> set[str]:
    """Every data file (base or log) under the table root, outside .nbcc/."""
    out = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".nbcc"]
        out.update(os.path.relpath(os.path.join(folder, f), root) for f in files if not f.startswith("."))
    return out


def snapshot(table: nbcc.Table, **read) -> list[dict]:
    return sorted(table.read(**read).to_pylist(), key=lambda r: r["id"])


def completion_of(table: nbcc.Table, instant: str) -> str:
    [inst] = [i for i in table.timeline() if i.instant == instant]
    return inst.completion


# -- the console script, in its own process -------------------------------------------------------

def test_console_script_prints_the_timeline(local_table):
    uri, _ = local_table
    table, written = make_table(uri)
    proc = subprocess.run([str(NBCC), "timeline", uri], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["INSTANT", "ACTION", "OPERATION", "STATE", "COMPLETION", "NOTE"]
    rows = rows_of(proc.stdout)
    assert [r[0] for r in rows] == written  # oldest first
    assert all(r[1:4] == ["deltacommit", "upsert", "completed"] for r in rows)
    assert rows == [[i.instant, i.action, "upsert", i.state, i.completion or "-", "-"] for i in table.timeline()]
    # aligned: every column starts at the same offset on every line
    header, *lines = proc.stdout.splitlines()
    for column, title in enumerate(["ACTION", "OPERATION", "STATE", "COMPLETION", "NOTE"], 1):
        start = header.index(title)
        for line, row in zip(lines, rows):
            assert line[start - 1] == " " and line[start:].split()[0] == row[column], (title, line)


def test_console_script_error_exits_1_with_a_message_and_no_traceback(tmp_path):
    proc = subprocess.run([str(NBCC), "timeline", str(tmp_path / "nothing-here")], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("nbcc: error: ")
    assert "not an nbcc table" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


# -- timeline and slices -------------------------------------------------------------------------

def test_timeline_json_and_pending_instants(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri)
    # What each completed instant did, including the two kinds of replacepartitions.
    table.write(batch([0], 5), operation="delete")
    table.write(batch([0], 6), mode="overwrite", partition_overwrite_mode="dynamic")
    table.delete_partitions([("p", "=", "b")])
    table.compact()
    table.clean(retain_commits=1)
    written = [i.instant for i in table.timeline()]
    txn = table.begin_write(SCHEMA)  # left inflight
    code, out, _ = run(capsys, "timeline", uri, "--json")
    assert code == 0
    listed = json.loads(out)
    assert [d["instant"] for d in listed] == written + [txn.instant]
    assert listed[-1]["state"] == "inflight" and listed[-1]["completion"] is None
    assert [(d["instant"], d["action"], d["state"], d["completion"]) for d in listed] == [
        (i.instant, i.action, i.state, i.completion) for i in table.timeline()]
    assert [(d["action"], d["operation"]) for d in listed] == [("deltacommit", "upsert")] * 3 + [
        ("deltacommit", "delete"), ("replacepartitions", "overwrite"), ("replacepartitions", "delete_partition"),
        ("commit", "compact"), ("clean", "clean"), ("deltacommit", None)]
    code, out, _ = run(capsys, "timeline", uri)
    assert rows_of(out)[-1] == [txn.instant, "deltacommit", "-", "inflight", "-", "-"]


def test_timeline_says_when_and_why_a_write_was_rolled_back(local_table, capsys):
    # The reason was only in the rollback mark's file: an operator saw "rolledback" and no more.
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    manual = table.begin_write(SCHEMA)
    table.rollback(manual.instant)
    expired = table.begin_write(SCHEMA)
    time.sleep(0.01)  # idle longer than 0 s: within its first millisecond it is not
    assert table.rollback_failed_writes(heartbeat_timeout_s=0) == [expired.instant]
    table.write(batch(range(8), 5))
    table.write(batch(range(8), 6))

    def notes() -> dict[str, tuple[str, str | None, str | None]]:
        code, out, _ = run(capsys, "timeline", uri, "--json")
        assert code == 0
        return {d["instant"]: (d["state"], d["rolled_back_at"], d["reason"]) for d in json.loads(out)}

    listed = notes()
    assert listed[manual.instant][0] == listed[expired.instant][0] == "rolledback"
    assert listed[manual.instant][2] == "a manual rollback (`nbcc rollback` or Table.rollback)"
    assert listed[expired.instant][2].startswith("heartbeat expired (")
    # Rolled back after it started, by the table's clock; every other instant has no note.
    assert all(listed[i.instant][1] > i.instant for i in (manual, expired))
    assert {v for k, v in listed.items() if k not in (manual.instant, expired.instant)} == {("completed", None, None)}
    code, out, _ = run(capsys, "timeline", uri)
    line = next(line for line in out.splitlines() if line.startswith(manual.instant))
    assert line.endswith(f"rolled back at {listed[manual.instant][1]}: a manual rollback (`nbcc rollback` or "
                         "Table.rollback)"), line
    assert out.splitlines()[0].split()[-1] == "NOTE"
    # Archived, the rollbacks keep their notes (the history holds the marks).
    code, _, err = run(capsys, "archive", uri, "--retain-commits", "1")
    assert code == 0, err
    archived = {d["instant"] for d in json.loads(run(capsys, "timeline", uri, "--json")[1]) if d["archived"]}
    assert {manual.instant, expired.instant} <= archived
    assert notes() == listed


def test_history_says_what_each_commit_did_latest_first(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)  # 8 rows each, ids 0-7: even ids in p=a, odd in p=b
    table.write(batch([1], 2), operation="delete", user_metadata="ticket 42")
    table.write(batch([0, 2], 3, parts=("a",)), mode="overwrite", replace_where="p = 'a'")
    table.write(batch([3], 4, parts=("c",)), mode="overwrite", replace_where=[("p", "in", ["c", "d"])])
    table.delete([("v", "=", 3)], user_metadata="cleanup job")  # ids 0 and 2
    table.delete_partitions([("p", "=", "c")])
    table.compact()
    restored = table.restore(completion_of(table, table.timeline()[2].instant))  # after the delete
    before = data_files(uri)
    table.clean(retain_commits=1)
    deleted = len(before - data_files(uri))
    history = table.history()

    completed = [i for i in table.timeline() if i.is_completed]
    assert [(c.instant, c.completion, c.action) for c in history] == [
        (i.instant, i.completion, i.action) for i in sorted(completed, key=lambda i: i.completion, reverse=True)]
    seen = [(c.operation, c.rows, c.files, c.partitions, c.parameters) for c in reversed(history)]
    assert seen[:7] == [
        ("upsert", 8, 2, ("p=a", "p=b"), {}),
        ("upsert", 8, 2, ("p=a", "p=b"), {}),
        ("delete", 1, 1, ("p=b",), {"user_metadata": "ticket 42"}),
        ("overwrite", 2, 1, ("p=a",), {"replace_where": "p = 'a'", "replaced_partitions": ["p=a"]}),
        ("overwrite", 1, 1, ("p=c",), {"replace_where": "p IN ('c', 'd')", "replaced_partitions": ["p=c"]}),
        ("delete", 2, 1, ("p=a",), {"user_metadata": "cleanup job", "condition": "v = 3"}),
        ("delete_partition", 0, 0, ("p=c",), {"condition": "p = 'c'", "replaced_partitions": ["p=c"]}),
    ]
    compaction, restore, clean = history[2], history[1], history[0]
    assert (compaction.action, compaction.operation, compaction.partitions) == ("commit", "compact", ("p=a", "p=b"))
    # p=b's ids 3, 5 and 7, and the delete of id 1, which has an ordering value (a base file keeps
    # such deletes: format.md §15.2); p=a's keys-only deletes left nothing.
    assert compaction.rows == 4
    assert (restore.instant, restore.operation, restore.parameters) == (
        restored, "restore", {"restored_as_of": completion_of(table, table.timeline()[2].instant)})
    assert restore.rows == 7 and restore.partitions == ("p=a", "p=b")  # ids 0-7 but 1
    # A restore is a replacecommit: it replaces every partition, those it writes no row to too.
    assert [c.replaces_table for c in history] == [c.action == "replacecommit" for c in history] and \
        restore.replaces_table
    # Who completed each commit: this process's user and machine.
    import getpass
    import socket
    assert {(c.user, c.host) for c in history} == {(getpass.getuser(), socket.gethostname())}
    assert (clean.action, clean.rows, clean.bytes, clean.files) == ("clean", None, None, deleted) and deleted > 0
    assert table.history(limit=2) == history[:2]
    with pytest.raises(nbcc.InvalidOptionError, match="limit must be a whole number of commits, 1 or more; got 0"):
        table.history(limit=0)

    code, out, _ = run(capsys, "history", uri)
    assert code == 0
    assert out.splitlines()[0].split() == ["COMPLETION", "INSTANT", "ACTION", "OPERATION", "ROWS", "FILES", "BYTES",
                                           "PARTITIONS", "BY", "PARAMETERS"]
    lines = out.splitlines()[1:]
    assert [line.split()[:9] for line in lines] == [
        [c.completion, c.instant, c.action, c.operation, "-" if c.rows is None else str(c.rows), str(c.files),
         "-" if c.bytes is None else str(c.bytes), "all" if c.action == "replacecommit" else str(len(c.partitions)),
         f"{getpass.getuser()}@{socket.gethostname()}"] for c in history]
    assert lines[-4].endswith("replace_where=p = 'a'")  # the partitions replaced are in PARTITIONS
    assert lines[-6].endswith("user_metadata=cleanup job; condition=v = 3") and lines[-1].endswith("-")
    code, out, _ = run(capsys, "history", uri, "--limit", "3", "--json")
    assert code == 0 and json.loads(out) == [c.to_dict() for c in history[:3]]
    assert json.loads(out)[2]["partitions"] == ["p=a", "p=b"]  # by name
    # Archived instants stay in the history.
    table.archive(retain_commits=1)
    assert any(i.archived for i in table.timeline()) and table.history() == history
    assert run(capsys, "history", uri, "--limit", "0")[0] == 2
    with pytest.raises(nbcc.InvalidOptionError, match="user_metadata must be text"):
        table.write(batch([1], 9), user_metadata=42)
    # Each commit is one line: a value with a line break or the separator is quoted.
    table.write(batch([1], 9), user_metadata="run 7\nretry; manual")
    code, out, _ = run(capsys, "history", uri, "--limit", "1")
    assert len(out.splitlines()) == 2 and out.splitlines()[1].endswith('user_metadata="run 7\\nretry; manual"')
    # A table without partition columns: PARTITIONS says so.
    flat, _ = make_table(uri + "-flat", commits=1, partitioned=False)
    code, out, _ = run(capsys, "history", flat.uri)
    assert out.splitlines()[1].split()[7] == "-"


def test_history_names_who_built_an_index(local_table, capsys):
    import getpass
    import socket

    uri, _ = local_table
    table, _ = make_table(uri, commits=1)
    table.build_index("files")
    [built] = [c for c in table.history() if c.action == "indexing"]
    assert (built.user, built.host) == (getpass.getuser(), socket.gethostname())
    code, out, _ = run(capsys, "history", uri)
    assert code == 0 and f"{getpass.getuser()}@{socket.gethostname()}" in \
        next(line for line in out.splitlines() if " indexing " in line)


def test_describe_shows_settings_columns_instants_how_far_back_reads_go_and_what_a_read_opens(local_table, capsys,
                                                                                                monkeypatch):
    uri, _ = local_table
    table, written = make_table(uri, commits=3)
    compaction = table.compact()
    wide = batch(range(4), 10).append_column("note", pa.array(["n"] * 4))  # a column added later
    written += [table.write(wide), table.write(batch(range(4), 11))]
    table.clean(retain_commits=2)
    pending = table.schedule_compaction()
    table.build_index("files")
    inflight = table.begin_write(SCHEMA)  # a write that has not finished

    code, out, err = run(capsys, "describe", uri, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert (d["record_key"], d["ordering_field"], d["merge_mode"], d["partition_by"], d["buckets"]) == (
        ["id"], "v", "event_time", ["p"], 2)
    assert [(c["name"], c["type"], c["nullable"]) for c in d["columns"]] == [
        ("id", "int64", False), ("p", "string", True), ("v", "int64", True), ("note", "string", True)]
    assert d["instants"]["deltacommit"] == {"completed": 5, "inflight": 1}
    assert (d["instants"]["commit"], d["instants"]["compaction"], d["instants"]["clean"]) == (
        {"completed": 1}, {"requested": 1}, {"completed": 1})
    assert d["latest_commit"] == {"instant": written[-1], "action": "deltacommit",
                                  "completion": completion_of(table, written[-1])}
    assert d["pending_compactions"] == [pending] and inflight.instant not in d["pending_compactions"]
    assert d["compactions_executing"] == []  # scheduled, and nothing executes it
    assert d["metadata_table"] == {"files": "ready"}
    # What a snapshot read opens: the compaction's base file of each file group, and the log files
    # of the two commits after it.
    files = data_files(uri)
    logs = {f for f in files if ".log." in f and (written[-2] in f or written[-1] in f)}
    bases = {f for f in files if f.endswith(".parquet") and compaction in f}
    assert d["snapshot_read"] == {"partitions": 2, "file_groups": len(bases), "base_files": len(bases),
                                  "log_files": len(logs), "bytes": sum(os.path.getsize(Path(uri, f)) for f in logs | bases)}

    # How far back reads go is what reads then accept, and no further.
    window = completion_of(table, written[-2])  # the clean kept the last 2 data commits
    assert d["oldest_as_of"] == window
    begin, cdc_begin = completion_of(table, written[-3]), completion_of(table, compaction)
    assert d["earliest_begin"] == {"latest_state": begin, "cdc": cdc_begin}
    assert table.read(as_of=window).num_rows == 8
    assert table.read(query_type="incremental", begin=begin).num_rows == 4
    assert table.read(query_type="incremental", begin=cdc_begin, incremental_format="cdc").num_rows == 4
    with pytest.raises(nbcc.NbccError, match=f"Use begin >= {begin}"):
        table.read(query_type="incremental", begin=completion_of(table, written[-4]))
    with pytest.raises(nbcc.NbccError, match=f"Use begin >= {cdc_begin}"):
        table.read(query_type="incremental", begin=begin, incremental_format="cdc")

    code, out, err = run(capsys, "describe", uri)
    assert code == 0, err
    lines = {line[:21].strip(): line[21:] for line in out.splitlines()[1:] if line[:21].strip()}
    assert lines["record key"] == "id" and lines["partition by"] == "p" and lines["buckets"] == "2 per partition"
    assert lines["oldest as_of"] == window and lines["pending compactions"] == pending
    assert lines["earliest begin"] == f"{begin} (cdc, or a range with an overwrite: {cdc_begin})"
    assert lines["snapshot read"].startswith(f"{len(bases)} file groups in 2 partitions: {len(bases)} base files, "
                                             f"{len(logs)} log files, ")
    assert "note  string" in out and "id  int64 not null" in out
    # The write in flight, with how long since its last heartbeat, and whether a clean would
    # take it for dead.
    [w] = d["writes_in_flight"]
    assert (w["instant"], w["action"]) == (inflight.instant, "deltacommit") and 0 <= w["idle_s"] < 60
    assert re.fullmatch(rf"{inflight.instant} deltacommit, last heartbeat [0-9.]+ s ago", lines["writes in flight"])
    later = nbcc.heartbeat._now_ms() + 400_000
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: later)
    code, out, err = run(capsys, "describe", uri)
    assert re.search(rf"writes in flight +{inflight.instant} deltacommit, last heartbeat 4\d\d(\.\d)? s ago \(past "
                     r"the 300 s timeout: the next clean rolls it back\)", out), out


def test_describe_a_table_without_commits(local_table, capsys):
    uri, _ = local_table
    nbcc.Table.create(uri, SCHEMA, "id")
    code, out, err = run(capsys, "describe", uri)
    assert code == 0, err
    assert "earliest (no clean deleted a commit's changes)" in out and "- (no commit yet)" in out
    assert "0 file groups: 0 base files, 0 log files, 0 bytes" in out  # no partitions to count


def test_slices_names_every_file_of_every_slice(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=3)
    code, out, _ = run(capsys, "slices", uri)
    assert code == 0
    assert out.splitlines()[0].split() == ["PARTITION", "FILE", "GROUP", "BASE", "INSTANT", "BASE", "FILE",
                                           "LOG", "FILES"]
    on_disk = {Path(f).name for f in data_files(uri)}
    printed = set(out.split())
    assert on_disk and on_disk <= printed  # every log file written is shown
    slices = table.file_slices()
    assert {s.partition for s in slices} == {"p=a", "p=b"}
    for s in slices:
        assert s.file_group_id in printed and s.base_instant in printed
        assert [name for name in out.split() if name in s.log_files] == list(s.log_files)  # in log order

    code, out, _ = run(capsys, "slices", uri, "--json")
    assert code == 0
    assert json.loads(out) == [{"partition": s.partition, "file_group": s.file_group_id,
                                "base_instant": s.base_instant, "base_file": s.base_file,
                                "log_files": list(s.log_files)} for s in slices]


def test_slices_as_of_shows_the_older_state(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=3, partitioned=False)
    first = completion_of(table, written[0])
    code, out, _ = run(capsys, "slices", uri, "--as-of", first, "--json")
    assert code == 0
    logs = [name for s in json.loads(out) for name in s["log_files"]]
    assert logs and all(written[0] in name for name in logs)  # only the first commit's files
    for bad in ("yesterday", "2026-11-20T10:00:00+24:00", "2026-11-20T10:00:00+01:60"):  # usage errors
        code, out, err = run(capsys, "slices", uri, "--as-of", bad)
        assert code == 2 and out == ""
        assert err.splitlines()[-1].startswith(f"nbcc slices: error: argument --as-of: {bad!r} is not a time; "
                                               "use a 17-digit instant time"), err
    code, out, _ = run(capsys, "slices", uri, "--as-of", f"{first[:4]}-{first[4:6]}-{first[6:8]}T23:59:59Z")
    assert code == 0 and out  # ISO-8601 is taken


# -- compaction ----------------------------------------------------------------------------------

def test_compact_completes_a_commit_and_keeps_the_snapshot(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=3)
    before = snapshot(table)
    code, out, err = run(capsys, "compact", uri)
    assert code == 0, err
    [commit] = [i for i in table.timeline() if i.action == "commit"]
    assert commit.is_completed and commit.instant > written[-1]
    assert commit.instant in out
    assert snapshot(table) == before
    slices = table.file_slices()
    assert slices and all(s.base_file and s.base_instant == commit.instant and not s.log_files for s in slices)
    assert err == ""  # no progress bar when stderr is not a terminal

    code, out, _ = run(capsys, "compact", uri)  # nothing new since
    assert code == 0 and out.strip() == "nothing to compact"


def test_compact_finishes_a_crashed_compaction_first(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    before = snapshot(table)
    tc = table.schedule_compaction()  # scheduled, never run: what a crash leaves
    assert table.pending_compactions() == [tc]
    code, out, err = run(capsys, "compact", uri, "--quiet")
    assert code == 0
    assert tc in err and "pending" in err  # the user is told
    assert tc in out
    assert table.pending_compactions() == []
    assert [i.instant for i in table.timeline() if i.action == "commit" and i.is_completed] == [tc]
    assert snapshot(table) == before


def test_compact_leaves_a_compaction_that_another_process_executes_and_runs_it_by_instant(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    before = snapshot(table)
    tc = table.schedule_compaction()
    nbcc.heartbeat.beat(table.storage, tc)  # its executor is running (or was killed just now)
    code, out, _ = run(capsys, "compact", uri, "--quiet")
    assert code == 0
    assert f"compaction {tc} is being executed by another process" in out
    assert f"nbcc compact {uri} --instant {tc}" in out and "300 s" in out  # what to do if it was killed
    assert "nothing to compact" not in out
    assert table.pending_compactions() == [tc]
    # describe tells an operator the same
    described = json.loads(run(capsys, "describe", uri, "--json")[1])
    assert [e["instant"] for e in described["compactions_executing"]] == [tc]
    line = next(line for line in run(capsys, "describe", uri)[1].splitlines() if line.startswith("pending compactions"))
    assert tc in line and "being executed (last heartbeat" in line
    code, out, _ = run(capsys, "compact", uri, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["compactions"] == []
    assert [e["instant"] for e in doc["executing_elsewhere"]] == [tc] and doc["executing_elsewhere"][0]["idle_s"] >= 0

    code, out, err = run(capsys, "compact", uri, "--quiet", "--instant", tc)  # as the message says
    assert code == 0 and tc in out
    assert f"warning: compaction {tc} has an execution whose last heartbeat is" in err
    assert table.pending_compactions() == []
    assert snapshot(table) == before


def test_compact_merges_file_groups_in_parallel_as_asked(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    before = snapshot(table)
    code, out, _ = run(capsys, "compact", uri, "--quiet", "--parallelism", "3")
    assert code == 0 and "completed at" in out
    assert all(s.base_file and not s.log_files for s in table.file_slices()) and snapshot(table) == before
    code, _, err = run(capsys, "compact", uri, "--parallelism", "0")
    assert code == 2 and "--parallelism: must be at least 1, got 0" in err
    table.write(batch([1], 7))
    code, _, err = run(capsys, "compact", uri, "--schedule-only", "--parallelism", "2")
    assert code == 1 and "--parallelism is for running compactions; --schedule-only runs none" in err
    assert table.pending_compactions() == []


def test_compact_schedule_only_then_run_by_instant(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    before = snapshot(table)
    code, out, _ = run(capsys, "compact", uri, "--schedule-only")
    assert code == 0
    tc = out.strip()
    assert table.pending_compactions() == [tc]
    table.write(batch([1, 2], 9))  # writers keep writing
    code, out, _ = run(capsys, "compact", uri, "--instant", tc)
    assert code == 0 and tc in out
    assert [i.instant for i in table.timeline() if i.action == "commit" and i.is_completed] == [tc]
    expected = {r["id"]: r for r in before}
    expected.update({r["id"]: r for r in batch([1, 2], 9).to_pylist()})
    assert snapshot(table) == sorted(expected.values(), key=lambda r: r["id"])

    written = table.write(batch([3], 10))
    code, _, err = run(capsys, "compact", uri, "--instant", written)
    assert code == 1 and "not a scheduled compaction" in err


def test_compact_schedule_only_says_when_a_compaction_is_pending(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    tc = run(capsys, "compact", uri, "--schedule-only")[1].strip()
    code, out, _ = run(capsys, "compact", uri, "--schedule-only")  # every file group is planned already
    assert code == 0
    assert out.strip() == (f"nothing new to compact: compaction {tc} is pending; run it with "
                           f"`nbcc compact {uri} --instant {tc}`")
    # With storage options (a local table ignores S3 ones), the command to copy needs them too.
    code, out, _ = run(capsys, "compact", uri, "--schedule-only", "--storage-option", "key=k")
    assert out.strip().endswith(f"--instant {tc}` (with the same --storage-option flags)")
    assert table.pending_compactions() == [tc]
    assert run(capsys, "compact", uri, "--instant", tc)[0] == 0  # the command it suggested
    assert table.pending_compactions() == []
    code, out, _ = run(capsys, "compact", uri, "--schedule-only")
    assert code == 0 and out.strip() == "nothing to compact"


def test_compact_runs_a_compaction_another_process_scheduled_while_it_ran(local_table, capsys, monkeypatch):
    # A writer with compaction_delta_commits schedules one between the run finishing the pending
    # compaction and scheduling its own, which then finds nothing new: the run executes the
    # writer's, and does not say "nothing to compact" while it is pending.
    import nbcc.compaction

    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    left = table.schedule_compaction()
    table.write(batch(range(8), 7))
    real, theirs = nbcc.compaction.schedule_compaction, []

    def writer_schedules_first(*args):
        if not theirs:
            theirs.append(real(*args))  # the writer's, just before ours
        return real(*args)

    monkeypatch.setattr(nbcc.compaction, "schedule_compaction", writer_schedules_first)
    code, out, err = run(capsys, "compact", uri, "--json", "-q")
    assert code == 0 and theirs[0] is not None
    assert [(c["instant"], c["ran"], c["was_pending"]) for c in json.loads(out)["compactions"]] == [
        (left, True, True), (theirs[0], True, True)]
    assert f"compaction {theirs[0]} is pending" in err
    assert table.pending_compactions() == [] and all(not s.log_files for s in table.file_slices())
    assert snapshot(table) == batch(range(8), 7).to_pylist()


def test_compact_clean_and_archive_print_json_for_schedulers(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=3)
    code, out, _ = run(capsys, "compact", uri, "--schedule-only", "--json")
    assert code == 0
    left = json.loads(out)["scheduled"]
    assert json.loads(run(capsys, "compact", uri, "--schedule-only", "--json")[1]) == {"scheduled": None,
                                                                                       "pending": [left]}
    # A new one scheduled beside a pending one (of other file groups): both are reported.
    other = nbcc.Table.create(uri + "-2", SCHEMA, "id", ordering_field="v", partition_by="p", buckets=2)
    other.write(batch(range(4), 1, parts=("a",)))
    first = json.loads(run(capsys, "compact", uri + "-2", "--schedule-only", "--json")[1])["scheduled"]
    other.write(batch(range(4), 1, parts=("b",)))
    again = json.loads(run(capsys, "compact", uri + "-2", "--schedule-only", "--json")[1])
    assert again["scheduled"] not in (None, first) and again["pending"] == [first]
    assert json.loads(run(capsys, "compact", uri + "-2", "--json", "-q", "--instant", again["scheduled"])[1]) == {
        "compactions": [{"instant": again["scheduled"], "completion": completion_of(other, again["scheduled"]),
                         "ran": True, "was_pending": True}]}
    table.write(batch([1], 9))
    code, out, _ = run(capsys, "compact", uri, "--json", "--quiet")
    assert code == 0
    done = {i.instant: i.completion for i in table.timeline() if i.action == "commit" and i.is_completed}
    ran = json.loads(out)["compactions"]
    assert ran == [{"instant": left, "completion": done[left], "ran": True, "was_pending": True},
                   {"instant": ran[1]["instant"], "completion": done[ran[1]["instant"]], "ran": True,
                    "was_pending": False}]
    assert json.loads(run(capsys, "compact", uri, "--json")[1]) == {"compactions": [], "executing_elsewhere": []}
    assert json.loads(run(capsys, "compact", uri, "--json", "--instant", left)[1]) == {"compactions": [
        {"instant": left, "completion": done[left], "ran": False, "was_pending": False}]}

    failed = table.begin_write(SCHEMA)
    for _ in range(3):
        table.write(batch(range(8), 10))
    before = data_files(uri)
    code, out, _ = run(capsys, "clean", uri, "--retain-commits", "1", "--heartbeat-timeout-s", "0", "--json",
                       "--quiet")
    assert code == 0
    cleaned = json.loads(out)
    deleted = {f"{p}/{n}" for p, n in cleaned["deleted"]}
    assert cleaned["rolled_back"] == [failed.instant] and deleted and deleted == before - data_files(uri)
    assert cleaned["instant"] in {i.instant for i in table.timeline() if i.action == "clean" and i.is_completed}
    assert cleaned["earliest_retained"] == table.timeline()[-2].completion  # the last data commit's

    code, out, _ = run(capsys, "archive", uri, "--retain-commits", "1", "--json")
    assert code == 0
    archived = json.loads(out)
    assert archived["archived"] == sum(i.archived for i in table.timeline()) > 0 and archived["finished"] == 0
    assert (Path(uri) / ".nbcc" / "history" / archived["file"]).is_file()
    assert json.loads(run(capsys, "archive", uri, "--json")[1]) == {"archived": 0, "file": None, "finished": 0}


def test_compact_instant_must_name_a_scheduled_compaction(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=2)
    failed = table.begin_write(SCHEMA)
    table.rollback(failed.instant)
    tc = table.compact()
    before = table.timeline()
    for bad in ("yesterday", "2026-11-21T10:30:00Z", "2026112110300012", "20261321103000123"):
        code, out, err = run(capsys, "compact", uri, "--instant", bad)  # usage errors: not an instant time
        assert code == 2 and out == "", bad
        assert err.splitlines()[-1] == ("nbcc compact: error: argument --instant: expected an instant time, the 17 "
                                        f"digits yyyyMMddHHmmssSSS that `nbcc timeline` prints; got {bad!r}")
    for bad, message in [("20000101000000000", f"no instant 20000101000000000 on the timeline of {uri}"),
                         (written[0], f"instant {written[0]} is a completed deltacommit, not a scheduled compaction"),
                         (failed.instant, f"instant {failed.instant} is a rolledback deltacommit, not a scheduled "
                                          "compaction")]:
        code, out, err = run(capsys, "compact", uri, "--instant", bad)
        assert code == 1 and out == "", bad
        assert err.startswith(f"nbcc: error: {message}"), err
    assert table.timeline() == before  # nothing was scheduled or run
    code, out, _ = run(capsys, "compact", uri, "--instant", tc)
    assert code == 0 and out.strip() == f"compaction {tc} is already completed (at {completion_of(table, tc)})"


# -- cleaning and archival -----------------------------------------------------------------------

def test_clean_deletes_files_and_time_travel_before_the_window_fails(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=3)
    assert run(capsys, "compact", uri, "-q")[0] == 0
    failed = table.begin_write(SCHEMA)  # a write that never finishes, leaving files
    writer = table.log_writer(failed, "0-0-0")
    writer.write(prepare(batch(range(6), 9), table.config, failed.schema, "upsert"))
    failed_files = {f"{f['partition']}/{f['name']}" for f in writer.close()}
    written += [table.write(batch(range(4), version)) for version in (10, 11)]
    before_files = data_files(uri)
    before_rows = snapshot(table)
    timeline = table.timeline()

    # A dry run changes nothing, and says what the clean then does.
    code, dry, err = run(capsys, "clean", uri, "--retain-commits", "2", "--heartbeat-timeout-s", "0", "--dry-run")
    assert code == 0, err
    assert (data_files(uri), table.timeline()) == (before_files, timeline)
    assert f"would roll back failed writes: {failed.instant}\n{len(failed_files)} files of theirs would be deleted:" in dry
    assert f"retained window would start at {completion_of(table, written[-2])}" in dry
    listed = {line.strip() for line in dry.splitlines() if line.startswith("  ")}

    code, out, err = run(capsys, "clean", uri, "--retain-commits", "2", "--heartbeat-timeout-s", "0")
    assert code == 0, err
    after_files = data_files(uri)
    deleted = before_files - after_files
    assert listed == deleted and failed_files < deleted
    assert f"{len(listed) - len(failed_files)} files would be deleted:" in dry
    assert deleted and after_files < before_files
    # The failed write's files are counted apart from the window's.
    assert f"rolled back failed writes: {failed.instant}\ndeleted {len(failed_files)} files of theirs\n" in out
    assert f"deleted {len(deleted - failed_files)} more files" in out
    window = completion_of(table, written[-2])  # the older of the last 2 data commits
    assert f"retained window starts at {window}" in out
    assert failed.instant in out  # rolled back: its heartbeat is older than 0 s
    assert [i.state for i in table.timeline() if i.instant == failed.instant] == ["rolledback"]
    assert snapshot(table) == before_rows

    too_old = completion_of(table, written[0])
    with pytest.raises(nbcc.NbccError):
        table.read(as_of=too_old)
    code, out, err = run(capsys, "slices", uri, "--as-of", too_old)
    assert code == 1 and out == ""
    assert err.startswith("nbcc: error: --as-of=") and window in err  # names the flag given
    assert run(capsys, "slices", uri, "--as-of", window)[0] == 0


def test_a_later_clean_that_retains_more_commits_keeps_the_window_where_it_is(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=5)
    window = completion_of(table, written[-2])
    assert run(capsys, "clean", uri, "--retain-commits", "2")[0] == 0
    clean_instants = [i.instant for i in table.timeline() if i.action == "clean"]

    # The last 4 commits start before the window, but what reads there needed is deleted:
    # the window stays, and the clean says so instead of promising reads it cannot serve.
    result = table.clean(retain_commits=4)
    assert result["earliest_retained"] == window
    assert result["retain_commits_start"] == completion_of(table, written[-4])
    assert [i.instant for i in table.timeline() if i.action == "clean"] == clean_instants  # nothing new
    code, out, _ = run(capsys, "clean", uri, "--retain-commits", "4")
    assert code == 0
    assert (f"retained window starts at {window}, where an earlier clean put it (the last 4 data commits start "
            f"at {completion_of(table, written[-4])}") in out
    assert run(capsys, "slices", uri, "--as-of", window)[0] == 0
    assert run(capsys, "slices", uri, "--as-of", completion_of(table, written[-4]))[0] == 1
    code, out, _ = run(capsys, "clean", uri, "--retain-commits", "10")
    assert "where an earlier clean put it (the table has 10 or fewer data commits" in out


def test_clean_by_hours_keeps_what_reads_as_of_any_time_in_them_need(local_table, capsys, monkeypatch):
    from nbcc.clock import parse_time
    uri, _ = local_table
    table, written = make_table(uri, commits=3)
    table.compact()  # the log files of the first 3 commits are then needed only by reads before it
    written += [table.write(batch(range(8), version)) for version in (3, 4, 5)]
    c = [completion_of(table, i) for i in written]
    # An hour after the fifth commit completed (less 1 ms): reads as of the hour's first moments
    # show the fourth commit's state, so the window starts at the fourth commit.
    monkeypatch.setattr(nbcc.clean, "_now_ms", lambda: parse_time(c[4]) - 1 + 3_600_000)
    before = data_files(uri)
    code, out, err = run(capsys, "clean", uri, "--retain-hours", "1")
    assert code == 0, err
    assert f"retained window starts at {c[3]} (the last 1 hour)" in out
    assert before - data_files(uri), "the clean deleted nothing"
    assert sorted(table.read(as_of=c[3]).to_pylist(), key=lambda r: r["id"]) == batch(range(8), 3).to_pylist()
    with pytest.raises(nbcc.NbccError, match="before the oldest state that can be read"):
        table.read(as_of=c[2])
    # Given both, the window keeps what either needs: here the last 4 commits reach further back.
    monkeypatch.setattr(nbcc.clean, "_now_ms", lambda: parse_time(c[5]) + 3_600_000)
    result = table.clean(retain_commits=4, retain_hours=1)
    assert (result["retain_commits_start"], result["earliest_retained"]) == (c[2], c[3])  # never moves back
    # No commit completed before the hours: every commit is retained.
    monkeypatch.setattr(nbcc.clean, "_now_ms", lambda: parse_time(c[0]) + 3_600_000)
    assert table.clean(retain_hours=2)["retain_commits_start"] is None
    code, out, _ = run(capsys, "clean", uri, "--retain-hours", "2")
    assert "retained window starts at %s, where an earlier clean put it (no data commit completed more than 2 " \
           "hours ago" % c[3] in out
    # Given both, the window keeps what either needs: the reason names the policy that keeps all.
    for argv, why in ((["--retain-commits", "2"], "no data commit completed more than 2 hours ago"),
                      (["--retain-commits", "20"], "the table has 20 or fewer data commits")):
        code, out, _ = run(capsys, "clean", uri, "--retain-hours", "2", *argv, "--dry-run")
        assert code == 0 and f"where an earlier clean put it ({why}, but" in out, (argv, out)
    for bad in ("-1", "nan", "week"):
        code, _, err = run(capsys, "clean", uri, "--retain-hours", bad)
        assert code == 2 and "expected a number of hours, 0 or more" in err
    with pytest.raises(nbcc.InvalidOptionError, match="retain_hours must be a number of hours, 0 or more"):
        table.clean(retain_hours=-2)


def test_clean_with_few_commits_deletes_nothing(local_table, capsys):
    uri, _ = local_table
    make_table(uri, commits=2)
    before = data_files(uri)
    code, out, _ = run(capsys, "clean", uri)
    assert code == 0
    assert out.splitlines() == ["rolled back failed writes: none",
                                "no retained window yet: the table has 10 or fewer data commits",
                                "deleted 0 files"]
    assert data_files(uri) == before


def test_clean_without_a_retained_window_still_reports_the_orphans_it_deletes(local_table, capsys):
    uri, _ = local_table
    make_table(uri, commits=2)
    before = data_files(uri)
    # A failed task attempt's file: a completed instant's log file that its commit does not list.
    log_file = Path(uri) / sorted(before)[0]
    name, _, token = log_file.name.rpartition("_")
    orphan = log_file.with_name(f"{name}_999-999-999")
    orphan.write_bytes(log_file.read_bytes())

    code, out, err = run(capsys, "clean", uri)
    assert code == 0, err
    assert not orphan.exists() and data_files(uri) == before
    assert "no retained window yet: the table has 10 or fewer data commits" in out
    assert out.splitlines()[-1] == "deleted 1 file"


def test_clean_warns_when_the_heartbeat_timeout_is_shorter_than_the_tables(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=1)
    live = table.begin_write(SCHEMA)  # a write whose writer is still running
    code, out, err = run(capsys, "clean", uri, "--heartbeat-timeout-s", "0")
    assert code == 0  # allowed: the operator may know the writers are dead
    assert err.strip() == ("nbcc: warning: --heartbeat-timeout-s 0 is below the table's heartbeat_timeout_s "
                           "(300 s): writes still running whose heartbeat is older than 0 s are rolled back, "
                           "and will fail to commit")
    assert live.instant in out
    with pytest.raises(nbcc.CommitError):  # what the warning said
        live.commit([])

    for timeout in ("300", "1000"):  # the table's setting or longer: no warning
        code, _, err = run(capsys, "clean", uri, "--heartbeat-timeout-s", timeout)
        assert code == 0 and err == ""



def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_a_usage_error(local_table, capsys):
    # nan and inf were taken, and made `clean` roll back nothing, silently.
    uri, _ = local_table
    table, _ = make_table(uri, commits=1)
    live = table.begin_write(SCHEMA)
    before = [(i.instant, i.state) for i in table.timeline()]
    for command, flag in (("clean", "--heartbeat-timeout-s"), ("index", "--timeout")):
        extra = ["--partitions", "files"] if command == "index" else []
        for value in ("nan", "inf", "Infinity", "-1", "-0.5", "abc"):
            code, out, err = run(capsys, command, uri, *extra, f"{flag}={value}")
            assert code == 2 and out == "", (flag, value)
            assert err.splitlines()[-1] == (f"nbcc {command}: error: argument {flag}: expected a number of "
                                            f"seconds, 0 or more (e.g. 30 or 2.5), got {value!r}")
    assert [(i.instant, i.state) for i in table.timeline()] == before  # nothing rolled back
    assert table.index_state()["partitions"] == {}  # nothing built
    live.commit([])

def test_archive_moves_instants_and_the_timeline_still_lists_them(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=6)
    before_rows = snapshot(table)
    active = Path(uri) / ".nbcc" / "timeline"
    before_active = len(list(active.iterdir()))
    _, listed_before, _ = run(capsys, "timeline", uri)

    code, out, err = run(capsys, "archive", uri, "--retain-commits", "2")
    assert code == 0, err
    moved = before_active - len(list(active.iterdir()))
    assert moved > 0
    assert out.startswith(f"archived {moved} instants into ")
    history_file = Path(out.strip().rsplit(" ", 1)[1])
    assert history_file.is_file() and history_file.parent == Path(uri) / ".nbcc" / "history"

    code, listed_after, _ = run(capsys, "timeline", uri)
    assert code == 0 and listed_after == listed_before
    assert [r[0] for r in rows_of(listed_after)] == written
    archived = [d["instant"] for d in json.loads(run(capsys, "timeline", uri, "--json")[1]) if d["archived"]]
    assert len(archived) == moved and archived == written[:moved]
    assert snapshot(table) == before_rows


# -- rollback ------------------------------------------------------------------------------------

def test_rollback_of_an_inflight_write(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    before = snapshot(table)
    txn = table.begin_write(SCHEMA)
    code, out, _ = run(capsys, "rollback", uri, txn.instant)
    assert code == 0 and txn.instant in out
    assert [i.state for i in table.timeline() if i.instant == txn.instant] == ["rolledback"]
    assert snapshot(table) == before
    with pytest.raises(nbcc.CommitError, match="was rolled back: a manual rollback"):  # the writer can no longer complete it
        txn.commit([])


def test_rollback_of_a_completed_or_unknown_instant_fails(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=2)
    code, out, err = run(capsys, "rollback", uri, written[0])
    assert code == 1 and out == ""
    assert err.startswith("nbcc: error: ") and written[0] in err and "completed" in err
    assert [i.state for i in table.timeline() if i.instant == written[0]] == ["completed"]

    unknown = "20000101000000000"
    code, _, err = run(capsys, "rollback", uri, unknown)
    assert code == 1 and unknown in err and "Traceback" not in err
    code, _, err = run(capsys, "rollback", uri, "2000-01-01")  # an ISO date names no instant: usage error
    assert code == 2 and err.splitlines()[-1].startswith("nbcc rollback: error: argument INSTANT: expected an "
                                                         "instant time")


def test_restore_undoes_later_writes_with_one_overwrite_and_keeps_them_readable(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=2)
    good = completion_of(table, written[-1])
    expected = snapshot(table)
    # Bad writes after it: an update, a new key, a delete, and a column added.
    table.write(pa.table({"id": [1, 20], "p": ["b", "a"], "v": [9, 9], "note": ["bad", "bad"]}))
    table.write(pa.table({"id": [2], "p": ["a"]}), operation="delete")
    bad = snapshot(table)
    last_bad = table.timeline()[-1].completion
    code, out, err = run(capsys, "restore", uri, "--as-of", good)
    assert code == 0 and err == "", err
    restore = table.timeline()[-1]
    assert restore.action == "replacecommit" and restore.instant in out and "8 rows" in out
    meta = read_commit_metadata(table.storage, restore)
    assert (meta["operation"], meta["restored_as_of"]) == ("restore", good)
    assert rows_of(run(capsys, "timeline", uri)[1])[-1][1:3] == ["replacecommit", "restore"]
    assert snapshot(table) == [{**r, "note": None} for r in expected]  # the added column stays, null
    assert sorted(table.read(as_of=last_bad).to_pylist(), key=lambda r: r["id"]) == bad  # kept
    # Later writes merge with the restored rows.
    table.write(batch([3], 5))
    assert {r["id"]: r["v"] for r in snapshot(table)}[3] == 5
    # A time before the oldest readable state is refused, and nothing is written.
    timeline = table.timeline()
    code, out, err = run(capsys, "restore", uri, "--as-of", "2001-01-01")
    assert code == 1 and out == "" and "is before the oldest state that can be read" in err
    assert table.timeline() == timeline
    code, _, err = run(capsys, "restore", uri)
    assert code == 2 and "--as-of" in err
    with pytest.raises(nbcc.InvalidOptionError, match="restore needs the time to restore, as_of"):
        table.restore(None)
    # Nothing to undo after the latest commit (Delta refuses a time past its latest version too).
    latest = timeline[-1].completion
    for when in (latest, "2999-01-01"):
        code, out, err = run(capsys, "restore", uri, "--as-of", when)
        assert code == 1 and out == "" and "no commit completed after it" in err, err
    assert table.timeline() == timeline


def test_delete_partitions_takes_every_partition_type_and_quoted_values(local_table, capsys):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("region", pa.string()), ("at", pa.timestamp("us", tz="UTC")),
                        ("amount", pa.decimal128(10, 2)), ("flag", pa.bool_())])
    table = nbcc.Table.create(uri, schema, "id", partition_by=["region", "at", "amount", "flag"], buckets=1)
    at = [dt.datetime(2026, 1, 1, h, tzinfo=dt.timezone.utc) for h in range(5)]
    table.write(pa.table({"id": [0, 1, 2, 3, 4], "region": ["eu west", "us", "eu,north", "us", None], "at": at,
                          "amount": [Decimal("0.50"), Decimal("1.50"), Decimal("2.00"), Decimal("0.50"), None],
                          "flag": [True, False, True, False, None]}, schema=schema))

    def deleted(*conditions) -> list[int]:
        before = {r["id"] for r in table.read().to_pylist()}
        code, out, err = run(capsys, "delete-partitions", uri, *[a for c in conditions for a in ("--where", c)])
        assert code == 0 and err == "", err
        return sorted(before - {r["id"] for r in table.read().to_pylist()})

    assert deleted("at < 2026-01-01T00:30:00Z") == [0]
    assert deleted('region in "eu,north", x') == [2]
    assert deleted("amount = 0.5", "flag == false") == [3]
    assert deleted("region not in 'eu west', x", "at >= 2026-01-01 01:00:00") == [1]  # not the null region
    assert deleted("amount is null") == [4]
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "amount = lots")
    assert code == 1 and "filter on 'amount' (decimal128(10, 2)): 'lots' is not a decimal number" in err
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "region = ")
    assert code == 2 and "give COLUMN OP VALUE" in err  # an empty value is a mistake, not ''
    # History records each condition as a condition that can be given again.
    conditions = [c.parameters["condition"] for c in reversed(table.history())
                  if c.operation == "delete_partition"]
    assert conditions == ["at < '2026-01-01T00:30:00Z'", "region IN ('eu,north', 'x')",
                          "amount = 0.5 AND flag = false", "region NOT IN ('eu west', 'x') AND at >= '2026-01-01 01:00:00'",
                          "amount IS NULL"]
    for condition in conditions:
        code, out, err = run(capsys, "delete-partitions", uri, "--dry-run", *[
            a for c in condition.split(" AND ") for a in ("--where", c.replace("IN (", "in ").rstrip(")"))])
        assert code == 0 and err == "", (condition, err)


def test_a_time_with_a_zone_matches_a_timestamp_column_without_one_at_its_utc_wall_time(local_table, capsys):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us"))])
    table = nbcc.Table.create(uri, schema, "id", buckets=1)
    table.write(pa.table({"id": [0, 1], "at": [dt.datetime(2026, 1, 1, 3), dt.datetime(2026, 1, 1, 5)]}, schema=schema))
    for condition in ("at = 2026-01-01T03:00:00Z", "at = 2026-01-01T04:00:00+01:00", "at = 2026-01-01 03:00:00"):
        code, out, err = run(capsys, "delete", uri, "--where", condition, "--dry-run")
        assert (code, out.strip()) == (0, "would delete 1 record"), (condition, err)


def test_delete_counts_first_with_dry_run_then_deletes_the_matching_records(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)  # ids 0-7, v=1, p alternating a/b
    table.write(batch([2, 3], 7))
    before, timeline = snapshot(table), table.timeline()
    code, out, err = run(capsys, "delete", uri, "--where", "v = 7", "--where", "id in 3, 4", "--dry-run")
    assert (code, err, out.strip()) == (0, "", "would delete 1 record")
    # Column names in any letter case, as SQL (and replaceWhere) take them.
    code, out, err = run(capsys, "delete", uri, "--where", "V = 7", "--where", "Id in 3, 4", "--dry-run")
    assert (code, err, out.strip()) == (0, "", "would delete 1 record")
    assert table.timeline() == timeline
    code, out, err = run(capsys, "delete", uri, "--where", "v >= 7")
    done = table.timeline()[-1]
    assert code == 0 and err == "" and done.action == "deltacommit" and done.instant in out
    assert "deleted 2 records" in out
    assert snapshot(table) == [r for r in before if r["id"] not in (2, 3)]
    timeline = table.timeline()
    code, out, err = run(capsys, "delete", uri, "--where", "v = 7")
    assert code == 0 and "nothing was written" in out and table.timeline() == timeline
    code, out, err = run(capsys, "delete", uri, "--where", "v = seven")
    assert code == 1 and out == "" and "'seven' is not an integer" in err
    assert table.timeline() == timeline


def test_update_counts_first_with_dry_run_then_sets_the_values_of_the_matching_records(local_table, capsys):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("p", pa.string()), ("note", pa.string()),
                        ("at", pa.timestamp("us", tz="UTC")), ("amount", pa.decimal128(10, 2))])
    table = nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=2)
    table.write(pa.table({"id": [0, 1, 2], "p": ["a", "b", "a"], "note": ["x", "y", "z"], "at": [None] * 3,
                          "amount": [Decimal("1.00")] * 3}, schema=schema))
    timeline = table.timeline()
    code, out, err = run(capsys, "update", uri, "--set", "note=done", "--where", "p = a", "--dry-run")
    assert (code, err, out.strip()) == (0, "", "would update 2 records")
    assert table.timeline() == timeline
    code, out, err = run(capsys, "update", uri, "--set", "note='it''s, done'", "--set", "AT=2026-11-27T10:00:00",
                         "--set", "amount=2.5", "--where", "p = a", "--where", "id != 2")
    assert code == 0 and err == "" and "updated 1 record of" in out
    at = dt.datetime(2026, 11, 27, 10, tzinfo=dt.timezone.utc)  # a time without a zone is UTC, as in --where
    assert snapshot(table) == [{"id": 0, "p": "a", "note": "it's, done", "at": at, "amount": Decimal("2.50")},
                               {"id": 1, "p": "b", "note": "y", "at": None, "amount": Decimal("1.00")},
                               {"id": 2, "p": "a", "note": "z", "at": None, "amount": Decimal("1.00")}]
    code, out, err = run(capsys, "update", uri, "--set", "note=NULL", "--where", "id = 1")
    assert code == 0 and snapshot(table)[1]["note"] is None
    code, out, err = run(capsys, "history", uri, "--limit", "1")
    assert "update" in out and "condition=id = 1; updates=note = NULL" in out
    timeline = table.timeline()
    for args, problem in [(("--set", "amount=lots"), "--set amount: 'lots' is not a value of type decimal128(10, 2)"),
                          (("--set", "id=5"), "update of column 'id': a record key column is not set"),
                          (("--set", "nope=1"), "update of column 'nope': the table has no such column")]:
        code, out, err = run(capsys, "update", uri, *args, "--where", "id = 1")
        assert code == 1 and problem in err, err
    code, out, err = run(capsys, "update", uri, "--set", "note", "--where", "id = 1")
    assert code == 2 and "give COLUMN=VALUE" in err
    code, out, err = run(capsys, "update", uri, "--set", "note=a", "--set", "NOTE=b", "--where", "id = 1")
    assert code == 1 and "--set names a column more than once" in err
    # NULL is null in --set; in a condition, SQL's = NULL matches nothing, so it is refused there.
    code, out, err = run(capsys, "update", uri, "--set", "note=x", "--where", "note = NULL")
    assert code == 2 and "NULL is not a value to compare with" in err and "'COL is null'" in err
    code, out, err = run(capsys, "update", uri, "--set", "note=x", "--where", "id = 99")
    assert code == 0 and "no record of" in out and "nothing was written" in out
    assert table.timeline() == timeline


def test_columns_whose_names_hold_spaces_are_named_in_backticks(local_table, capsys):
    # Names from a CSV header: `--where`, `--set` and replaceWhere take them as Spark SQL quotes them.
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("order day", pa.string()), ("unit price", pa.int64())])
    table = nbcc.Table.create(uri, schema, "id", partition_by="order day", buckets=2)
    table.write(pa.table({"id": [0, 1, 2], "order day": ["d1", "d2", "d2"], "unit price": [5, 6, 7]}, schema=schema))
    code, out, err = run(capsys, "update", uri, "--set", "`unit price`=9", "--where", "`order day` = d2",
                         "--where", "`unit price` > 6")
    assert code == 0 and err == "" and "updated 1 record of" in out
    assert [r["unit price"] for r in snapshot(table)] == [5, 6, 9]
    code, out, err = run(capsys, "history", uri, "--limit", "1")
    assert "condition=`order day` = 'd2' AND `unit price` > 6; updates=`unit price` = 9" in out, out
    code, out, err = run(capsys, "delete", uri, "--where", "`unit price` in 5, 6")
    assert code == 0 and [r["id"] for r in snapshot(table)] == [2]
    table.write(pa.table({"id": [3], "order day": ["d3"], "unit price": [1]}, schema=schema), mode="overwrite",
                replace_where="`order day` >= 'd2'")
    assert [(r["id"], r["order day"]) for r in snapshot(table)] == [(3, "d3")]
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "`order day` = d3")
    assert code == 0 and snapshot(table) == []
    # Without backticks the name is not one column: refused, nothing written.
    timeline = table.timeline()
    code, out, err = run(capsys, "delete", uri, "--where", "unit price = 5")
    assert code == 2 and "in backticks: `order date`" in err
    assert table.timeline() == timeline


def test_savepoint_keeps_a_state_through_cleans_until_delete_savepoint(local_table, capsys):
    uri, _ = local_table
    table, written = make_table(uri, commits=2)
    kept = completion_of(table, written[-1])
    expected = snapshot(table)
    code, out, err = run(capsys, "savepoint", uri, "--user-metadata", "month end")
    assert (code, out) == (0, f"{kept}\n") and f"delete-savepoint {uri} {kept}" in err  # the time alone, for scripts
    # A making of the same state cut short long ago left a pending file: --json prints the kept one.
    Path(uri, ".nbcc", "savepoints", f"{kept}_20000101000000000.pending.json").write_text(json.dumps(
        {"as_of": kept, "created": "20000101000000000", "user_metadata": "crashed"}))
    code, out, err = run(capsys, "savepoint", uri, "--json")  # the same state: the same savepoint
    assert code == 0 and {k: json.loads(out)[k] for k in ("as_of", "confirmed", "user_metadata")} == {
        "as_of": kept, "confirmed": True, "user_metadata": "month end"}
    assert run(capsys, "delete-savepoint", uri, kept, "--pending")[0] == 0
    assert run(capsys, "savepoint", uri, "--user-metadata", "month end")[0] == 0
    code, out, err = run(capsys, "savepoint", uri, "--as-of", written[0])  # before the first completion
    assert code == 1 and "no commit had completed by then" in err
    for v in range(2, 5):
        table.write(batch(range(8), v))
    table.compact()
    table.write(batch(range(8), 5))
    code, out, err = run(capsys, "clean", uri, "--retain-commits", "1")
    assert code == 0 and f"kept the files of the states of savepoint(s) {kept}" in out
    assert snapshot(table, as_of=kept) == expected
    code, out, err = run(capsys, "savepoints", uri)
    assert code == 0 and rows_of(out)[0][0] == kept and rows_of(out)[0][-2:] == ["month", "end"]
    code, out, err = run(capsys, "savepoints", uri, "--json")
    assert [(s["as_of"], s["user_metadata"]) for s in json.loads(out)] == [(kept, "month end")]
    code, out, err = run(capsys, "describe", uri)
    assert f"savepoints           {kept}" in out
    code, out, err = run(capsys, "delete-savepoint", uri, kept)
    assert code == 0 and f"deleted savepoint {kept}" in out
    code, out, err = run(capsys, "delete-savepoint", uri, kept)
    assert code == 1 and f"has no savepoint {kept}" in err
    run(capsys, "clean", uri, "--retain-commits", "1")
    code, out, err = run(capsys, "restore", uri, "--as-of", kept)
    assert code == 1 and "before the oldest state that can be read" in err and "savepoint" not in err  # none left


def test_delete_partitions_lists_first_with_dry_run_then_deletes_with_one_commit(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    table.write(pa.table({"id": [100], "p": [None], "v": [1]}, schema=SCHEMA))  # the null partition
    before, timeline = snapshot(table), table.timeline()
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "p < b", "--where", "p != z", "--dry-run")
    assert (code, err) == (0, "") and out.split() == ["would", "delete", "1", "partition", "p=a"]
    assert (snapshot(table), table.timeline()) == (before, timeline)
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "p in a, c", "--where", "p is not null")
    done = table.timeline()[-1]
    assert code == 0 and err == "" and done.action == "replacepartitions" and done.instant in out, err
    assert out.splitlines()[1:] == ["  p=a"]
    assert snapshot(table) == [r for r in before if r["p"] != "a"]
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "p is null")
    assert code == 0 and [r["p"] for r in snapshot(table)] == ["b"] * (len(before) - 1 - sum(r["p"] == "a" for r in before))
    timeline = table.timeline()
    code, out, err = run(capsys, "delete-partitions", uri, "--where", "p = a")
    assert code == 0 and "no partition" in out and "nothing was written" in out and table.timeline() == timeline
    for where, code_, problem in [("v < 3", 1, "are not partition columns"), ("p", 2, "give COLUMN OP VALUE"),
                                  ("nosuch = 1", 1, "filter column 'nosuch' is not in the table")]:
        code, out, err = run(capsys, "delete-partitions", uri, "--where", where)
        assert code == code_ and out == "" and problem in err, (where, err)
    assert table.timeline() == timeline
    assert run(capsys, "delete-partitions", uri)[0] == 2  # --where is required


# -- errors and options --------------------------------------------------------------------------

def test_a_uri_that_is_not_a_table(tmp_path, capsys):
    for command in (["timeline"], ["slices"], ["compact"], ["clean"], ["archive"], ["rollback"], ["restore"],
                    ["delete-partitions"], ["delete"]):
        argv = (command + [tmp_path / "empty"] + (["20240101000000000"] if command == ["rollback"] else [])
                + (["--as-of", "20240101000000000"] if command == ["restore"] else [])
                + (["--where", "p = a"] if command in (["delete-partitions"], ["delete"]) else []))
        code, out, err = run(capsys, *argv)
        assert code == 1, command
        assert out == "" and err.startswith("nbcc: error: ") and "not an nbcc table" in err


def test_usage_errors_exit_2(local_table, capsys):
    uri, _ = local_table
    make_table(uri, commits=1)
    assert run(capsys, "timeline", uri, "--storage-option", "no-equals-sign")[0] == 2
    assert run(capsys, "nosuchcommand", uri)[0] == 2
    assert run(capsys, "clean", uri, "--retain-commits", "0")[0] == 2
    assert run(capsys, "compact", uri, "--schedule-only", "--instant", "20240101000000000")[0] == 2
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"nbcc {nbcc.__version__}"
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--as-of also takes an ISO-8601 timestamp" in " ".join(out.split())


def test_readme_documents_every_command_and_option():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### The `nbcc` command"):readme.index("## Metadata table")]
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command, p in sub.choices.items():
        assert f"`{command} URI" in section, command
        for action in p._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"{flag}" in section, (command, flag)
    # The exit statuses, each as a whole number ("10 on" must not pass for "0 on"), in one sentence.
    text = " ".join(section.split())
    exits = text[text.index("Exit status:"):]
    exits = exits[:exits.index(". ")]
    assert re.findall(r"(?<!\d)(\d+) (?:when|on)\b", exits) == ["0", "1", "2", "130"], exits
    # the columns in the order `nbcc timeline` prints them
    assert "INSTANT, ACTION, OPERATION, STATE, COMPLETION" in section


def test_the_installed_package_has_the_version_nbcc_prints(capsys):
    """pyproject.toml takes the package's version from nbcc.__version__: what pip reports for
    the installed package is what `nbcc --version` prints."""
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"nbcc {version('pyspark-nbcc')}"


def test_timeline_on_s3_with_storage_options(s3_table, capsys):
    uri, options = s3_table
    table, written = make_table(uri, options, commits=2)
    code, out, err = run(capsys, "--storage-option", f"endpoint_url={options['endpoint_url']}",
                         "timeline", uri,
                         "--storage-option", f"key={options['key']}", "--storage-option", f"secret={options['secret']}")
    assert code == 0, err
    rows = rows_of(out)
    assert [r[0] for r in rows] == written
    assert rows == [[i.instant, i.action, "upsert", i.state, i.completion or "-", "-"] for i in table.timeline()]


def test_a_storage_option_of_the_wrong_name_or_form_is_bad_usage_not_a_traceback(capsys):
    # Refused before any request (the endpoint, a closed port, is never asked), as the README's
    # exit statuses say: a malformed --storage-option is bad usage.
    for option, message in (("config_kwargs=notjson", "storage option config_kwargs='notjson' is not a JSON object"),
                            ("client_kwargs=[1]", "storage option client_kwargs='[1]' is not a JSON object"),
                            ("anon=maybe", "storage option anon='maybe' is not a boolean; give true or false"),
                            ("endpoint=x", "unknown S3 storage option endpoint; the options are those of "
                                           "s3fs.S3FileSystem: ")):
        code, out, err = run(capsys, "timeline", "s3://b/t", "--storage-option", option,
                             "--storage-option", "endpoint_url=http://127.0.0.1:1")
        assert code == 2 and out == "", option
        assert err.splitlines()[-1].startswith(f"nbcc: error: --storage-option: {message}"), err
        assert "Traceback" not in err


# -- the metadata table -----------------------------------------------------------------------------

def test_index_builds_shows_and_drops_metadata_table_partitions(local_table, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=4)
    expected = snapshot(table)
    code, out, err = run(capsys, "index", uri)
    assert code == 0, err
    assert rows_of(out) == [["files", "-"], ["column_stats", "-"], ["key_filters", "-"]]

    code, out, err = run(capsys, "index", uri, "--partitions", "files,key_filters", "--quiet")
    assert code == 0, err
    [ti] = [i.instant for i in table.timeline() if i.action == "indexing"]
    first, *state = out.strip().splitlines()
    assert first == f"indexing instants run: {ti}"
    assert [line.split() for line in state[1:]] == [["files", "ready"], ["column_stats", "-"], ["key_filters", "ready"]]
    plan = table.plan(filter=[("id", "=", 3)])
    assert plan.metadata_used == ("files", "key_filters") and snapshot(table) == expected

    code, out, _ = run(capsys, "index", uri, "--partitions", "files")
    assert code == 0 and out.splitlines()[0] == "indexing instants run: none needed"
    code, out, _ = run(capsys, "index", uri, "--drop", "key_filters")
    assert code == 0 and out.splitlines()[0] == "dropped: key_filters"
    assert [line.split() for line in out.strip().splitlines()[2:]] == [["files", "ready"], ["column_stats", "-"],
                                                                      ["key_filters", "-"]]
    assert table.plan(filter=[("id", "=", 3)]).metadata_used == ("files",)
    code, out, _ = run(capsys, "index", uri, "--drop", "key_filters")
    assert code == 0 and out.splitlines()[0] == "nothing to drop: none of them was in use"
    assert snapshot(table) == expected


def test_index_shows_a_drop_that_stopped_part_way_and_how_to_finish_it(local_table, capsys, monkeypatch):
    import nbcc.indexing as indexing

    uri, _ = local_table
    table, _ = make_table(uri, commits=2)
    table.build_index(["files", "key_filters"])

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(indexing, "delete_rows", interrupted)
    assert run(capsys, "index", uri, "--drop", "files,key_filters")[0] == 130
    monkeypatch.undo()
    code, out, _ = run(capsys, "index", uri)
    assert code == 0 and rows_of(out)[:3] == [["files", "dropping"], ["column_stats", "-"], ["key_filters", "dropping"]]
    assert out.splitlines()[-1] == (f"dropping: files, key_filters (a drop that is running, or stopped part-way: "
                                    f"finish it with `nbcc index {uri} --drop files,key_filters`, then build again "
                                    "if wanted)")
    assert run(capsys, "index", uri, "--drop", "files,key_filters")[0] == 0  # as it says
    code, out, _ = run(capsys, "index", uri)
    assert rows_of(out) == [["files", "-"], ["column_stats", "-"], ["key_filters", "-"]]


def test_index_errors_are_clear(local_table, tmp_path, capsys):
    uri, _ = local_table
    table, _ = make_table(uri, commits=1)
    code, out, err = run(capsys, "index", uri, "--partitions", "files,bogus")
    assert code == 1 and out == ""
    assert err.strip() == ("nbcc: error: unknown metadata table partition 'bogus'; the partitions are "
                           "files, column_stats, key_filters")
    assert run(capsys, "index", uri, "--drop", " , ")[0] == 1
    assert run(capsys, "index", uri, "--partitions", "files", "--drop", "files")[0] == 2
    assert run(capsys, "index", uri, "--partitions", "files", "--timeout", "-1")[0] == 2
    code, _, err = run(capsys, "index", tmp_path / "nothing-here", "--partitions", "files")
    assert code == 1 and "not an nbcc table" in err

    for argv, given in ((["--timeout", "5"], "--timeout applies"), (["-q"], "-q/--quiet applies"),
                        (["--drop", "files", "--quiet"], "-q/--quiet applies"),
                        (["--timeout", "5", "-q"], "--timeout and -q/--quiet apply")):
        code, out, err = run(capsys, "index", uri, *argv)  # building options without building
        assert code == 2 and out == "", argv
        assert err.splitlines()[-1] == f"nbcc index: error: {given} only with --partitions (building partitions)"
    assert table.index_state()["partitions"] == {}

    txn = table.begin_write(SCHEMA)  # a write in flight: catch-up waits for it, then gives up
    code, out, err = run(capsys, "index", uri, "--partitions", "files", "--timeout", "0.2", "--quiet")
    assert code == 1 and err.startswith("nbcc: error: indexing ")
    assert f"write {txn.instant} was still in flight" in err and "resumes" in err
    code, out, _ = run(capsys, "index", uri)
    assert code == 0 and rows_of(out)[0] == ["files", "building"]
    assert "pending indexing" in out and "to resume it" in out


def test_python_filters_are_recorded_as_conditions_the_cli_reads_as_the_same_filter(tmp_path, capsys):
    # History spells a Python filter's values (dates, datetimes, datetime64, decimals, floats) as
    # conditions that `nbcc delete --where` takes back and matches the same records with.
    schema = pa.schema([("id", pa.int64()), ("d", pa.date32()), ("at", pa.timestamp("ms", tz="UTC")),
                        ("naive", pa.timestamp("us")), ("amount", pa.decimal128(10, 2)), ("x", pa.float64())])
    days = [dt.date(2026, 11, 18) + dt.timedelta(days=i) for i in range(6)]
    rows = pa.table({"id": range(6), "d": days,
                     "at": [dt.datetime(2026, 11, 20, 12, tzinfo=dt.timezone.utc) + dt.timedelta(hours=i * 7)
                            for i in range(6)],
                     "naive": [dt.datetime(2026, 11, 20, 0, 0, 0, 250 * i) for i in range(6)],
                     "amount": [Decimal(i) / 4 for i in range(6)], "x": [i / 3 for i in range(6)]}, schema=schema)
    filters = [[("d", ">=", dt.date(2026, 11, 21))], [("at", "<", dt.date(2026, 11, 21))],
               [("at", ">", dt.datetime(2026, 11, 21, 1, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))))],
               [("naive", "in", [np.datetime64("2026-11-20T00:00:00.000250"), dt.datetime(2026, 11, 20, 0, 0, 0, 750)])],
               [("amount", "<=", Decimal("0.75")), ("x", ">", 0.5)], [("d", "not_in", days[:2] + days[3:5])]]
    for i, spec in enumerate(filters):
        given, again = (nbcc.Table.create(str(tmp_path / f"{name}{i}"), schema, "id", buckets=2) for name in "ga")
        for table in (given, again):
            table.write(rows)
        matched = sorted(given.read(filter=spec).column("id").to_pylist())
        assert 0 < len(matched) < 6, spec
        given.delete(spec)
        condition = given.history(limit=1)[0].parameters["condition"]
        code, out, err = run(capsys, "delete", str(tmp_path / f"a{i}"), "--where", condition)
        assert code == 0 and err == "", (spec, condition, err)
        assert sorted(set(range(6)) - set(again.read().column("id").to_pylist())) == matched, (spec, condition)


def test_conditions_on_float_timestamp_and_decimal_columns_are_recorded_as_they_can_be_given_again(
        local_table, capsys):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("price", pa.float64()), ("at", pa.timestamp("ms", tz="UTC")),
                        ("amount", pa.decimal128(10, 2))])
    table = nbcc.Table.create(uri, schema, "id", buckets=2)
    at = [dt.datetime(2026, 11, 20, h, tzinfo=dt.timezone.utc) for h in range(4)]
    table.write(pa.table({"id": [0, 1, 2, 3], "price": [9.5, 10.25, float("nan"), None], "at": at,
                          "amount": [Decimal("3.25"), Decimal("2.00"), None, Decimal("1.50")]}, schema=schema))
    wheres = ["price > 10", "at >= '2026-11-20T02:00:00.000500Z'", "amount = 3.25"]
    for where in wheres:
        code, out, err = run(capsys, "delete", uri, "--where", where, "--dry-run")
        assert code == 0 and err == "" and "1 record" in out, (where, out, err)
        code, out, err = run(capsys, "delete", uri, "--where", where)
        assert code == 0 and err == "", (where, err)
    recorded = [c.parameters["condition"] for c in reversed(table.history()) if c.operation == "delete"]
    assert recorded == ["price > 10.0", "at >= '2026-11-20T02:00:00.000500Z'", "amount = 3.25"]
    assert table.read().column("id").to_pylist() == [2]  # the NaN price matched nothing
    for condition in recorded:  # given again: valid, and nothing left to delete
        code, out, err = run(capsys, "delete", uri, "--where", condition, "--dry-run")
        assert code == 0 and err == "" and "0 records" in out, (condition, out, err)
