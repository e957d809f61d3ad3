"""The action IR: text and CSV forms that round-trip, validation of hand-edited schedules, and
the pure-Python layers importing no torch (single process, fast)."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mmpp.core.actions import (
    Compute,
    Direction,
    Exchange,
    MessageKey,
    Phase,
    Schedule,
    ScheduleParseError,
    Transfer,
    parse_action,
    parse_transfer,
)
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import ModulePlacement as P
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.core.schedule import build_schedule, load_schedule
from lightning_mmpp.core.simulator import validate_schedule

try:
    from tests.test_schedule import random_layouts
except ImportError:  # tests/ itself on sys.path
    from test_schedule import random_layouts  # type: ignore[no-redef]


def chain(pp: int) -> PipelineLayout:
    return PipelineLayout({"a": P(pp=pp)}, {"a": []})


def fwd(src: str, dst: str, k: int, peer: int) -> Transfer:
    return Transfer(MessageKey(Direction.FORWARD, src, dst, k), peer)


def bwd(src: str, dst: str, k: int, peer: int) -> Transfer:
    return Transfer(MessageKey(Direction.BACKWARD, src, dst, k), peer)


# --- text form of single actions -------------------------------------------------------------


@pytest.mark.parametrize(
    "action, text",
    [
        (Compute(Phase.FORWARD, "llm", 3), "F3:llm"),
        (Compute(Phase.BACKWARD, "llm", 0), "B0:llm"),
        (Compute(Phase.BACKWARD_INPUT, "vision_enc", 12), "I12:vision_enc"),
        (Compute(Phase.BACKWARD_WEIGHT, "m0", 7), "W7:m0"),
        (Exchange((), ()), "X(send[] recv[])"),
        (Exchange((fwd("a", "a", 0, 1),), ()), "X(send[a->a#0@1] recv[])"),
        (
            Exchange((fwd("enc", "llm", 2, 3), bwd("llm", "llm", 1, 5)), (bwd("enc", "llm", 0, 3),)),
            "X(send[enc->llm#2@3 llm<-llm#1@5] recv[enc<-llm#0@3])",
        ),
    ],
)
def test_action_text_round_trip(action, text):
    assert str(action) == text
    assert parse_action(text) == action


def test_transfer_text_and_mirror():
    t = bwd("vision", "llm", 1, 2)
    assert str(t) == "vision<-llm#1@2"
    assert parse_transfer("vision<-llm#1@2") == t
    assert t.mirror(7) == bwd("vision", "llm", 1, 7)
    assert (t.direction, t.src_module, t.dst_module, t.microbatch) == (Direction.BACKWARD, "vision", "llm", 1)


@pytest.mark.parametrize("text", ["F:a", "Q1:a", "F1:", "F-1:a", "X(send[a->a#0] recv[])", "X(send[] )", "a->b#0@1"])
def test_bad_action_text(text):
    with pytest.raises(ScheduleParseError, match="not an action|not a transfer"):
        parse_action(text)


def test_message_key_requires_a_direction():
    with pytest.raises(TypeError, match="Direction"):
        MessageKey("forward", "a", "b", 0)  # type: ignore[arg-type]


# --- whole schedules: text and CSV ------------------------------------------------------------


@settings(max_examples=40, deadline=None, database=None)
@given(random_layouts(), st.integers(1, 6), st.sampled_from(["1f1b", "gpipe", "zero_bubble"]), st.booleans())
def test_schedule_text_and_csv_round_trip(data, m, name, forward_only):
    layout = PipelineLayout(*data)
    schedule = build_schedule(layout, m, name, forward_only=forward_only)
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_text(str(schedule)) == schedule
    assert Schedule.from_csv(schedule.to_csv()) == schedule


def test_text_form_example():
    schedule = build_schedule(chain(2), 1)
    assert schedule.to_text().splitlines() == [
        "schedule name=1f1b num_microbatches=1 forward_only=false world_size=2",
        "rank 0: F0:a X(send[a->a#0@1] recv[]) X(send[] recv[a<-a#0@1]) B0:a",
        "rank 1: X(send[] recv[a->a#0@0]) F0:a B0:a X(send[a<-a#0@0] recv[])",
    ]
    lines = schedule.to_csv().splitlines()
    assert lines[0] == "# schedule name=1f1b num_microbatches=1 forward_only=false world_size=2"
    assert lines[1] == "rank,index,action,module,microbatch,sends,recvs"
    assert lines[2] == "0,0,F,a,0,,"
    assert lines[3] == "0,1,X,,,a->a#0@1,"


def test_bad_schedule_text():
    with pytest.raises(ScheduleParseError, match="starts with 'schedule"):
        Schedule.from_text("rank 0: F0:a")
    with pytest.raises(ScheduleParseError, match="world_size=2 but ranks \\[0\\]"):
        Schedule.from_text("schedule name=x num_microbatches=1 forward_only=true world_size=2\nrank 0: F0:a")
    with pytest.raises(ScheduleParseError, match="listed twice"):
        Schedule.from_text("schedule name=x num_microbatches=1 forward_only=true world_size=1\nrank 0: F0:a\nrank 0:")
    with pytest.raises(ScheduleParseError, match="bad schedule header"):
        Schedule.from_text("schedule name=x forward_only=true world_size=1\nrank 0: F0:a")
    with pytest.raises(ScheduleParseError, match="CSV line 3"):
        Schedule.from_csv("# schedule name=x num_microbatches=1 forward_only=true world_size=1\n"
                          "rank,index,action,module,microbatch,sends,recvs\n0,0,F,a,zero,,\n")
    with pytest.raises(ScheduleParseError, match="first line"):
        Schedule.from_csv("rank,index,action,module,microbatch,sends,recvs\n")


# --- hand edits, validated before use ---------------------------------------------------------


def _write(tmp_path, schedule: Schedule, edit=None, name="s.csv") -> str:
    text = schedule.to_csv() if name.endswith(".csv") else schedule.to_text()
    lines = text.splitlines()
    if edit is not None:
        lines = edit(lines)
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_load_schedule_round_trips_and_accepts_a_valid_hand_edit(tmp_path):
    layout = PipelineLayout({"a": P(pp=2), "b": P()}, {"a": ["b"], "b": []})
    for name in ("1f1b", "gpipe", "zero_bubble"):
        schedule = build_schedule(layout, 3, name)
        assert load_schedule(_write(tmp_path, schedule), layout) == schedule
        assert load_schedule(_write(tmp_path, schedule, name="s.txt"), layout) == schedule
    # one rank alone: run both forwards before the first backward (GPipe order by hand)
    single = PipelineLayout({"a": P()}, {"a": []})
    schedule = build_schedule(single, 2, "1f1b")
    assert [str(a) for a in schedule.for_rank(0)] == ["F0:a", "B0:a", "F1:a", "B1:a"]

    def reorder(lines):
        header, columns, rows = lines[0], lines[1], lines[2:]
        return [header, columns, rows[0], rows[2].replace("0,2,", "0,1,"), rows[1].replace("0,1,", "0,2,"), rows[3]]

    edited = load_schedule(_write(tmp_path, schedule, reorder), single)
    assert [str(a) for a in edited.for_rank(0)] == ["F0:a", "F1:a", "B0:a", "B1:a"]


@pytest.mark.parametrize(
    "edit, match",
    [
        # drop rank 0's backward of microbatch 0
        (lambda rows: [r for r in rows if r != "0,3,B,a,0,,"], "never completes the backward of microbatch 0"),
        # rank 1 forwards before its input arrives
        (lambda rows: [r.replace("1,1,F", "1,-1,F") for r in rows], "before its inputs arrive"),
        # rank 0 runs its backward before the gradient arrives
        (lambda rows: [r.replace("0,3,B", "0,1.5,B") for r in rows], "before its gradients arrive"),
        # a transfer the layout does not prescribe
        (lambda rows: [r.replace("a->a#0@1", "a->a#0@0") for r in rows], "never posts the other end|differ from"),
        # a compute repeated
        (lambda rows: rows + ["0,9,B,a,0,,"], "twice"),
        # a module the rank does not hold
        (lambda rows: [r.replace("0,0,F,a", "0,0,F,z") for r in rows], "holds no stage of 'z'"),
    ],
)
def test_load_schedule_rejects_broken_hand_edits(tmp_path, edit, match):
    layout = chain(2)
    schedule = build_schedule(layout, 1)

    def apply(lines):
        return lines[:2] + edit(lines[2:])

    with pytest.raises(PipelineConfigError, match=match):
        load_schedule(_write(tmp_path, schedule, apply), layout)


def test_validate_rejects_a_deadlock_and_wrong_phases():
    layout = chain(2)
    # rank 1 receives the gradient exchange before the forward one: both ranks wait forever
    t = fwd("a", "a", 0, 1)
    schedule = Schedule("hand", 1, True, ((Compute(Phase.FORWARD, "a", 0), Exchange((t,), ())),
                                           (Exchange((), (t.mirror(0),)), Compute(Phase.FORWARD, "a", 0))))
    validate_schedule(schedule, layout)
    text = build_schedule(layout, 1).to_text().replace(
        "rank 1: X(send[] recv[a->a#0@0]) F0:a B0:a X(send[a<-a#0@0] recv[])",
        "rank 1: X(send[a<-a#0@0] recv[]) X(send[] recv[a->a#0@0]) F0:a B0:a",
    )
    with pytest.raises(PipelineConfigError, match="sends a<-a#0@0 \\(action 0\\) before computing it"):
        validate_schedule(Schedule.from_text(text), layout)
    # a lone W on a stage that must send input gradients upstream
    text = build_schedule(layout, 1, "zero_bubble").to_text().replace(
        "I0:a X(send[a<-a#0@0] recv[]) W0:a", "W0:a X(send[a<-a#0@0] recv[])"
    )
    with pytest.raises(PipelineConfigError, match="without its I"):
        validate_schedule(Schedule.from_text(text), layout)
    # a backward in a forward-only schedule
    text = build_schedule(layout, 1, forward_only=True).to_text() + " B0:a"
    with pytest.raises(PipelineConfigError, match="runs no backward"):
        validate_schedule(Schedule.from_text(text), layout)
    with pytest.raises(PipelineConfigError, match="it has 2 ranks, the layout 3"):
        validate_schedule(build_schedule(layout, 1), chain(3))
