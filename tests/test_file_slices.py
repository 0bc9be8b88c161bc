"""File slicing by completion time (RFC-66): `nbcc.build_file_slices`.

Every expected slice here is written out by hand from RFC-66's rule: per file group the barriers
are the base files' instants; a committed log joins the slice of the greatest barrier below its
completion time; without a base file, the instant of the earliest-completed log is the barrier;
files of instants with no completion time belong to no slice.
"""

from __future__ import annotations

import random

from nbcc import FileSlice, build_file_slices
from nbcc.filenames import base_file_name, log_file_name

FG = "00000000-0000-0000-0000-000000000000"
FG2 = "00000001-0000-0000-0000-000000000000"


def t(n: int) -> str:
    """A real 17-digit time: 2024-05-01 10:00:00.000 UTC plus n milliseconds."""
    return f"20240501100000{n:03d}"


def log(instant: int, version: int = 1, token: str = "0-1-0", fg: str = FG) -> str:
    return log_file_name(fg, t(instant), version, token)


def base(instant: int, token: str = "0-9-0", fg: str = FG) -> str:
    return base_file_name(fg, token, t(instant))


def summary(result: dict[str, list[FileSlice]]) -> dict[str, list[tuple]]:
    return {fg: [(s.base_instant, s.base_file, list(s.log_files)) for s in slices]
            for fg, slices in result.items()}


def slices_of(names, completions, **kw):
    names = list(names)
    random.Random(len(names)).shuffle(names)  # the listing order must not matter
    return build_file_slices(names, completions, **kw)


def test_rfc66_demo():
    # fg_t10: base at t10 (completed at t15); l1, l2 complete before t60; fg_t60: base written by
    # a compaction at t60; l3 completes after it.
    fg_t10, fg_t60 = base(10), base(60)
    l1, l2, l3 = log(20), log(40), log(70)
    completions = {t(10): t(15), t(20): t(30), t(40): t(50), t(60): t(65), t(70): t(80)}
    result = slices_of([fg_t10, l1, l2, fg_t60, l3], completions)
    assert summary(result) == {FG: [(t(60), fg_t60, [l3]), (t(10), fg_t10, [l1, l2])]}
    newest = result[FG][0]
    assert newest.file_group_id == FG
    assert newest.file_names() == [fg_t60, l3]


def test_a_log_that_started_before_the_compaction_but_completed_after_it_joins_the_new_slice():
    fg_t10, fg_t60 = base(10), base(60)
    l1, l2, l3 = log(20), log(40), log(70)
    late = log(55)  # instant t55 < t60, completed at t90 > t60
    completions = {t(10): t(15), t(20): t(30), t(40): t(50), t(55): t(90), t(60): t(65), t(70): t(80)}
    result = slices_of([fg_t10, l1, l2, fg_t60, l3, late], completions)
    # In the new slice, log order (by instant) puts t55 before t70.
    assert summary(result) == {FG: [(t(60), fg_t60, [late, l3]), (t(10), fg_t10, [l1, l2])]}


def test_a_log_completing_after_the_compaction_instant_but_before_its_completion_joins_the_new_slice():
    # The barrier is the base file's instant (t60), not the compaction's completion (t95).
    fg_t10, fg_t60 = base(10), base(60)
    l1, l2 = log(20), log(62)
    completions = {t(10): t(15), t(20): t(30), t(60): t(95), t(62): t(70)}
    assert summary(slices_of([fg_t10, fg_t60, l1, l2], completions)) == {
        FG: [(t(60), fg_t60, [l2]), (t(10), fg_t10, [l1])]
    }


def test_without_a_base_file_the_barrier_is_the_earliest_completed_log_not_the_earliest_instant():
    a = log(20)  # started first, completed last
    b = log(30)
    c = log(35)
    completions = {t(20): t(90), t(30): t(40), t(35): t(60)}
    result = slices_of([a, b, c], completions)
    assert summary(result) == {FG: [(t(30), None, [a, b, c])]}
    assert result[FG][0].file_names() == [a, b, c]


def test_pending_and_failed_files_belong_to_no_slice():
    fg_t10 = base(10)
    committed = log(20)
    pending = log(30)   # completion None: still running, or failed
    unknown = log(40)   # instant not on the timeline at all (rolled back, or never started)
    completions = {t(10): t(15), t(20): t(25), t(30): None}
    assert summary(slices_of([fg_t10, committed, pending, unknown], completions)) == {
        FG: [(t(10), fg_t10, [committed])]
    }


def test_a_failed_first_log_does_not_hide_the_later_committed_logs_of_its_bucket():
    # Hudi #19774: the first log of the bucket failed; later logs committed.
    failed = log(10)
    l2, l3 = log(20), log(30, token="1-1-0")
    for completions in ({t(10): None, t(20): t(25), t(30): t(35)},
                        {t(20): t(25), t(30): t(35)}):
        result = slices_of([failed, l2, l3], completions)
        assert summary(result) == {FG: [(t(20), None, [l2, l3])]}


def test_only_pending_files_give_no_slice():
    assert build_file_slices([log(10), log(20)], {t(10): None}) == {}
    assert build_file_slices([], {}) == {}


def test_a_base_file_of_an_incomplete_compaction_is_ignored():
    fg_t10, fg_t60 = base(10), base(60)
    l1, l3 = log(20), log(70)
    for completions in ({t(10): t(15), t(20): t(30), t(60): None, t(70): t(80)},
                        {t(10): t(15), t(20): t(30), t(70): t(80)}):
        result = slices_of([fg_t10, l1, fg_t60, l3], completions)
        assert summary(result) == {FG: [(t(10), fg_t10, [l1, l3])]}


def test_log_order_within_a_slice_is_instant_then_version_then_token():
    fg_t10 = base(10)
    expected = [
        log(20, 1, "2-0-0"),
        log(20, 1, "10-0-0"),
        log(20, 2, "0-0-0"),
        log(20, 9, "0-0-0"),
        log(20, 10, "0-0-0"),
        log(30, 1, "0-0-0"),
    ]
    completions = {t(10): t(15), t(20): t(40), t(30): t(35)}
    result = slices_of([fg_t10] + expected, completions)
    assert summary(result) == {FG: [(t(10), fg_t10, expected)]}


def test_several_file_groups_are_sliced_independently():
    a_base, a_log = base(10, fg=FG), log(20, fg=FG)
    b_log1, b_log2 = log(20, fg=FG2, token="1-1-0"), log(30, fg=FG2)
    b_base = base(50, fg=FG2)
    b_log3 = log(60, fg=FG2)
    completions = {t(10): t(12), t(20): t(25), t(30): t(35), t(50): t(55), t(60): t(65)}
    result = slices_of([a_base, a_log, b_log1, b_log2, b_base, b_log3], completions, partition="d=1")
    assert summary(result) == {
        FG: [(t(10), a_base, [a_log])],
        FG2: [(t(50), b_base, [b_log3]), (t(20), None, [b_log1, b_log2])],
    }
    assert {s.partition for slices in result.values() for s in slices} == {"d=1"}
    assert {s.file_group_id for s in result[FG2]} == {FG2}


def test_logs_completing_before_every_base_file_form_an_older_slice_without_base():
    old1, old2 = log(3), log(5)  # completed at t8 and t6, before the base file's t10
    fg_t10 = base(10)
    newer = log(20)
    completions = {t(3): t(8), t(5): t(6), t(10): t(12), t(20): t(25)}
    result = slices_of([old1, old2, fg_t10, newer], completions)
    # The older slice's barrier is its earliest-completed log (t5, completed at t6).
    assert summary(result) == {FG: [(t(10), fg_t10, [newer]), (t(5), None, [old1, old2])]}


def test_three_base_files_split_logs_by_completion_time():
    b10, b40, b70 = base(10), base(40), base(70)
    l20, l30, l50, l60, l80 = log(20), log(30), log(50), log(60), log(80)
    completions = {
        t(10): t(11), t(40): t(41), t(70): t(71),
        t(20): t(22),   # before t40 -> t10 slice
        t(30): t(45),   # after t40 -> t40 slice
        t(50): t(75),   # after t70 -> t70 slice
        t(60): t(65),   # between t40 and t70 -> t40 slice
        t(80): t(85),
    }
    result = slices_of([b10, b40, b70, l20, l30, l50, l60, l80], completions)
    assert summary(result) == {
        FG: [(t(70), b70, [l50, l80]), (t(40), b40, [l30, l60]), (t(10), b10, [l20])]
    }


def test_a_log_published_after_a_plan_that_does_not_list_it_joins_the_plans_slice():
    # l_late completed at t55 < t60, but its completed file landed after compaction t60 was
    # planned (its put outlasted the lock's lease), so the plan lists only l1 and l2. Behind the
    # base file at t60 its rows would be lost: it joins the slice of t60, pending or completed.
    fg_t10, fg_t60 = base(10), base(60)
    l1, l2, late, l3 = log(20), log(40), log(50), log(70)
    plans = {t(60): {FG: [l1, l2]}}

    def planned(fg, tc):
        return plans[tc].get(fg, []) if tc in plans else None
    completions = {t(10): t(15), t(20): t(30), t(40): t(45), t(50): t(55), t(60): t(65), t(70): t(80)}
    completed = build_file_slices([fg_t10, l1, l2, late, fg_t60, l3], completions, planned_logs=planned)
    assert summary(completed) == {FG: [(t(60), fg_t60, [late, l3]), (t(10), fg_t10, [l1, l2])]}
    pending = build_file_slices([fg_t10, l1, l2, late], {**completions, t(60): None},
                                pending_compactions={FG: t(60)}, planned_logs=planned)
    assert summary(pending) == {FG: [(t(60), None, [late]), (t(10), fg_t10, [l1, l2])]}
    # A plan that lists it, or one that cannot be read (None), leaves it where its time puts it.
    plans[t(60)][FG].append(late)
    assert summary(build_file_slices([fg_t10, l1, l2, late, fg_t60, l3], completions, planned_logs=planned)) == {
        FG: [(t(60), fg_t60, [l3]), (t(10), fg_t10, [l1, l2, late])]}
    assert summary(build_file_slices([fg_t10, l1, l2, late, fg_t60, l3], completions,
                                     planned_logs=lambda fg, tc: None)) == {
        FG: [(t(60), fg_t60, [l3]), (t(10), fg_t10, [l1, l2, late])]}


def test_a_log_published_late_with_no_base_file_before_it_joins_the_plans_slice():
    # The group's first compaction: the late log would fall in the "older" slice.
    fg_t60 = base(60)
    l1, late = log(20), log(50)
    completions = {t(20): t(30), t(50): t(55), t(60): t(65)}
    got = build_file_slices([l1, late, fg_t60], completions, planned_logs=lambda fg, tc: [l1])
    assert summary(got) == {FG: [(t(60), fg_t60, [late]), (t(20), None, [l1])]}
