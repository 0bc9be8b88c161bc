"""The soak test of issue 6, short: tests/soak.py (all of it is described there) for 15 s on local
disk and on the moto S3 server, and on (at most 90 s) until every writer, service and reader has
done its part: on a slow machine 15 s on moto S3 made 12 commits, and the cleaner may then find
nothing to delete. `make soak` runs it for longer.

It must end with no failed commit, no atomicity violation, every read equal to the reference
state at its `as_of`, the final snapshot (Python API, and Spark with and without as_of) equal to
the reference, and every kind of writer and service having done its part (the cleaner deleted
files and archived instants, the savepointer made savepoints and read as of them). Throughput is printed, never asserted.

The checks themselves are tested first, on hand-made reads that break them."""

from __future__ import annotations

import pyarrow as pa

import soak
from soak import COLUMNS, PRIVATE_PER_COMMIT, Reference, check_read, commit_rows, state_digest

SECONDS = 15
MAX_SECONDS = 90
KEYS = 500
# The cleaner's smallest window (it widens it to cover every read in progress): 15 s on moto S3
# makes only tens of commits, and the default of 10 would leave little or nothing to clean and
# archive.
RETAIN_COMMITS = 3


# -- the checks catch what they must -------------------------------------------------------------

def _read_of(commits: dict[str, tuple[int, int]], completion: dict[str, str], keys: int = 50) -> pa.Table:
    """What a correct read shows after the given commits ({instant: (slot, seq)}), with the meta
    columns, folded like the table does (greatest ts wins, deletes drop the key)."""
    best: dict[int, tuple[dict, str]] = {}
    for instant in sorted(commits, key=completion.get):
        for row in commit_rows(*commits[instant], keys):
            cur = best.get(row["id"])
            if cur is None or row["ts"] > cur[0]["ts"]:
                best[row["id"]] = (row, instant)
    rows = [{**{c: r[c] for c in COLUMNS}, "_nbcc_commit_time": i, "_nbcc_completion_time": completion[i]}
            for r, i in best.values() if not r["_nbcc_is_deleted"]]
    return pa.Table.from_pylist(rows)


def test_check_read_catches_partial_missing_and_uncommitted_commits():
    completion = {"20260101000000001": "20260101000000002", "20260101000000003": "20260101000000005",
                  "20260101000000004": "20260101000000006"}
    commits = {"20260101000000001": (0, 0), "20260101000000003": (1, 0), "20260101000000004": (0, 1)}
    as_of = "20260101000000006"
    good = _read_of(commits, completion)
    assert check_read(good, as_of, completion) == []

    # One private row of commit 1-0 missing: the commit is partly visible.
    ids = good.column("id").to_pylist()
    private_of_1_0 = [n for n, (k, t) in enumerate(zip(ids, good.column("tag").to_pylist()))
                      if k >= soak.PRIVATE_BASE and t == "1-0"]
    assert len(private_of_1_0) == PRIVATE_PER_COMMIT
    partial = good.take([n for n in range(good.num_rows) if n != private_of_1_0[0]])
    assert any("partly visible" in p for p in check_read(partial, as_of, completion))

    # A commit completed by as_of that the read does not show at all.
    earlier = {i: c for i, c in completion.items() if i != "20260101000000004"}
    without = _read_of({i: commits[i] for i in earlier}, earlier)
    assert any("invisible" in p for p in check_read(without, as_of, completion))

    # Rows of a commit that had not completed by as_of (in flight, or completed later).
    assert any("no data commit completed" in p for p in check_read(good, "20260101000000005", earlier))

    # A key twice.
    assert any("twice" in p for p in check_read(pa.concat_tables([good, good.slice(0, 1)]), as_of, completion))


def test_reference_digests_follow_the_winners_and_tell_states_apart():
    commits = [("20260101000000002", "20260101000000001", commit_rows(0, 0, 50)),
               ("20260101000000005", "20260101000000003", commit_rows(1, 0, 50))]
    ref = Reference(commits, COLUMNS)
    assert ref.at("20260101000000001") == (0, 0)
    assert ref.at("20260101000000004") == state_digest(Reference(commits[:1], COLUMNS).final, COLUMNS)
    assert ref.at(ref.latest) == state_digest(ref.final, COLUMNS)
    assert ref.matches(ref.final) == ["20260101000000005"]
    changed = [dict(r) for r in ref.final]
    changed[0]["payload"] += "!"
    assert ref.matches(changed) == [] and ref.matches(ref.final[1:]) == []


# -- the soak --------------------------------------------------------------------------------------

def test_soak(spark, any_table, tmp_path):
    uri, options = any_table
    storage = "s3" if uri.startswith("s3://") else "local"
    summary = soak.run_soak(spark, uri, options, tmp_path / "soak", seconds=SECONDS, max_seconds=MAX_SECONDS, keys=KEYS,
                            retain_commits=RETAIN_COMMITS, storage_name=storage)
    print("\n" + soak.summary_line(summary))

    assert summary["problems"] == [], "\n".join(summary["problems"])
    assert summary["failed_commits"] == 0
    assert summary["atomicity_violations"] == 0 and summary["reads_off_reference"] == 0
    assert summary["final_matches_reference"]
    # Every kind of writer, service and reader took part.
    assert all(n >= 1 for n in summary["writer_commits_by_slot"].values()), summary["writer_commits_by_slot"]
    assert summary["stream_commits"] >= 2  # the warm-up batch and at least one during the load
    assert summary["compactions"] >= 1 and summary["cleans"] >= 1
    # ... and the services did their work: files deleted, instants moved to the history files
    # (the final snapshot above was read after that).
    assert summary["files_cleaned"] > 0 and summary["instants_archived"] > 0, \
        (summary["files_cleaned"], summary["instants_archived"])
    assert all(n >= 2 for n in summary["reads"].values())
    assert summary["savepoints_made"] >= 1 and summary["savepoint_reads"] >= 1
