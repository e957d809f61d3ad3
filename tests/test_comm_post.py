"""MultiModuleCommunicator.post / take: receives completed where they are consumed, in any order,
across posts, with specs that change on the way (the extra rounds of a changed spec)."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpp.core.actions import Direction, MessageKey
from lightning_mmpp.engine.comm import MultiModuleCommunicator
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

F, B = Direction.FORWARD, Direction.BACKWARD
SHAPES = {0: (2, 3), 1: (4, 3), 2: (4, 3), 3: (2, 3), 4: (2, 3)}  # 1 and 3 change the channel's spec


def _two_stages(rank: int, static_specs: bool = False) -> MultiModuleCommunicator:
    """This rank's communicator on a module ``a`` in two stages (ranks 0 and 1)."""
    layout = PipelineLayout({"a": ModulePlacement(pp=2)}, {"a": []})
    return MultiModuleCommunicator(layout, rank, torch.device("cpu"), static_specs=static_specs)


def _value(k: int) -> dict:
    torch.manual_seed(k)
    return {"h": torch.randn(*SHAPES[k], requires_grad=True), "k": torch.tensor([k])}


def _run(rank: int, world: int) -> dict:
    comm = _two_stages(rank)
    fwd = {k: MessageKey(F, "a", "a", k) for k in SHAPES}
    bwd = {k: MessageKey(B, "a", "a", k) for k in SHAPES}
    posts = [[0], [1], [2, 3], [4]]  # microbatches per post; 2 and 3 share one
    out: dict = {}
    if rank == 0:
        for ks in posts:
            comm.post({fwd[k]: _value(k) for k in ks}, [])
        comm.post({}, [bwd[k] for k in SHAPES])
        out["grads"] = {k: comm.take(bwd[k])["h"] for k in reversed(SHAPES)}
    else:
        for ks in posts:  # nothing taken in between: each post completes the previous group first
            comm.post({}, [fwd[k] for k in ks])
        got = {k: comm.take(fwd[k]) for k in reversed(SHAPES)}
        out["ok"] = {k: torch.equal(got[k]["h"], _value(k)["h"].detach()) and got[k]["h"].requires_grad
                     and not got[k]["k"].requires_grad for k in SHAPES}
        comm.post({bwd[k]: {"h": torch.full(SHAPES[k], float(k)), "k": None} for k in SHAPES}, [])
        out["posted_left"] = comm.posted()
    comm.wait_sends()
    out["metadata"] = comm.stats.metadata_exchanges
    out["pooled_sizes"] = [size for size, _ in comm._recv_buffers.buffers.values()]
    return out


@pytest.mark.timeout(60)
def test_takes_in_any_order_across_posts_with_changing_specs():
    sender, receiver = run_distributed(_run, 2, timeout=60)
    assert receiver["ok"] == {k: True for k in SHAPES}, receiver
    assert receiver["posted_left"] == []
    assert {k: torch.equal(g, torch.full(SHAPES[k], float(k))) for k, g in sender["grads"].items()} == \
        {k: True for k in SHAPES}
    assert sender["metadata"] == receiver["metadata"] == 3  # first use, then the changes at 1 and 3
    # one receive channel per rank (forward on 1, backward on 0): buffers of one size kept, not of every size
    assert len(sender["pooled_sizes"]) == len(receiver["pooled_sizes"]) == 1


def _misuse(rank: int, world: int) -> list:
    comm = _two_stages(rank)
    errors = []
    try:
        comm.take(MessageKey(F, "a", "a", 0))
    except RuntimeError as err:
        errors.append(str(err))
    return errors


@pytest.mark.timeout(60)
def test_take_without_post_names_the_message():
    for errors in run_distributed(_misuse, 2, timeout=60):
        assert len(errors) == 1 and "without a post()" in errors[0] and "mb0" in errors[0]


# --- the runtime: overlapped (posted, taken where consumed) == blocking ---------------------------


class _Hooks:
    def pipeline_inputs(self, module, batch, upstream):
        return batch if not upstream else sum(upstream.values())

    def pipeline_loss(self, output, batch):
        return output.square().mean()


def _runtime_grads(rank: int, world: int) -> dict:
    from torch import nn

    from lightning_mmpp.model.partition import StageRunner
    from lightning_mmpp.engine.runtime import PipelineRuntime
    from lightning_mmpp.core.schedule import build_schedule

    layout = PipelineLayout({"enc": ModulePlacement(), "llm": ModulePlacement(pp=2)}, {"enc": ["llm"], "llm": []})
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    # rows changing every other microbatch: a spec change follows many receives posted ahead
    varying = [torch.randn(3 + k // 2 % 2, 8, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    out: dict = {}
    for overlap, static, ahead in ((True, False, 2), (False, False, 2), (True, True, 2), (True, True, 0),
                                   (True, "varying", 2), (False, "varying", 2)):
        torch.manual_seed(0)
        stages = {"enc": nn.Linear(8, 8), "llm": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))}
        slot = layout.slots(rank)[0]
        layer = stages[slot.module] if slot.module == "enc" else stages["llm"][slot.stage]
        runner = StageRunner(slot.module, slot.stage, [layer], ["0"])
        comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"), static_specs=static is True)
        runtime = PipelineRuntime(layout, rank, comm, {slot.module: runner}, _Hooks(), overlap=overlap,
                                  receive_ahead=ahead)
        batches = varying if static == "varying" else data
        for name in ("1f1b", "gpipe", "zero_bubble"):
            runtime.run(build_schedule(layout, 6, name), lambda module, k: batches[k])
        out[(overlap, static, ahead)] = {n: p.grad.clone() for n, p in layer.named_parameters()}
        out[("ahead", overlap, static, ahead)] = comm.stats.receives_ahead
        if ahead:
            out[("metadata", static)] = comm.stats.metadata_exchanges
        if static is False:  # an evaluation step: its forward specs wait for no backward
            runtime.run(build_schedule(layout, 6, "gpipe", forward_only=True), lambda module, k: data[k])
            out[("left after eval", overlap)] = comm.pending_backward()
    return out


@pytest.mark.timeout(60)
def test_overlapped_runtime_matches_blocking():
    """... and with static shapes (headers checked once per step) too, with and without
    receives posted ahead of their exchange."""
    for rank, out in enumerate(run_distributed(_runtime_grads, 3, timeout=60)):
        blocking = out[(False, False, 2)]
        for mode in ((True, False, 2), (True, True, 2), (True, True, 0)):
            assert out[mode].keys() == blocking.keys()
            assert all(torch.equal(out[mode][n], blocking[n]) for n in blocking), (rank, mode)
        varying = out[(False, "varying", 2)]
        assert all(torch.equal(out[(True, "varying", 2)][n], varying[n]) for n in varying), rank
        assert not all(torch.equal(varying[n], blocking[n]) for n in blocking)  # other data: other grads
        assert out[("metadata", True)] == out[("metadata", False)]  # only the first message of a channel
        assert out[("metadata", "varying")] > out[("metadata", False)]  # the changes travelled
        assert out[("ahead", True, "varying", 2)] > 0, (rank, out)
        # posted ahead: gradients (ranks 0, 1) and forward inputs (ranks 1, 2), with or without
        # static shapes; never in blocking mode or with receive_ahead=0
        assert out[("ahead", False, False, 2)] == out[("ahead", True, True, 0)] == 0, (rank, out)
        assert out[("ahead", True, False, 2)] > 0 and out[("ahead", True, True, 2)] > 0, (rank, out)
        # the runtime ends every step with the communicator's finish_step
        assert [v for k, v in out.items() if k[0] == "left after eval"] == [0, 0], (rank, out)


def _ahead(rank: int, world: int) -> dict:
    """``post_ahead`` on two stages: what it takes ahead and what it leaves to ``post``."""
    out: dict = {}
    for static in (False, True):
        comm = _two_stages(rank, static_specs=static)
        fwd = {k: MessageKey(F, "a", "a", k) for k in range(3)}
        bwd = {k: MessageKey(B, "a", "a", k) for k in range(3)}
        value = {k: torch.full((2, 3), float(k), requires_grad=True) for k in range(3)}
        if rank == 0:
            out[("grad before its forward", static)] = comm.post_ahead(bwd[0])
            comm.post({fwd[0]: value[0]}, [])
            out[("grad after its forward", static)] = comm.post_ahead(bwd[0])
            comm.post({fwd[1]: value[1], fwd[2]: value[2]}, [bwd[1]])  # posted in its exchange
            out[("grad 2", static)] = comm.post_ahead(bwd[2])
            out[("twice", static)] = comm.post_ahead(bwd[2])
            out[("grads", static)] = [comm.take(bwd[k]).sum().item() for k in (2, 0, 1)]
        else:
            out[("first, no spec", static)] = comm.post_ahead(fwd[0])
            comm.post({}, [fwd[0]])
            got = [comm.take(fwd[0])]
            out[("next, spec cached", static)] = ahead = comm.post_ahead(fwd[1])
            comm.post({}, [fwd[2]] if ahead else [fwd[1], fwd[2]])
            got += [comm.take(fwd[k]) for k in (2, 1)]
            out[("inputs", static)] = [g.sum().item() for g in got]
            comm.post({bwd[k]: torch.full((2, 3), 10.0 + k) for k in (2, 0, 1)}, [])
        comm.wait_sends()
        out[("counted", static)] = comm.stats.receives_ahead
    return out


@pytest.mark.timeout(60)
def test_receives_posted_ahead_only_where_planned():
    """A gradient is posted ahead once its forward was sent; a forward input once its channel's
    spec is cached (static shapes or not); the same message never twice; the payloads are the same."""
    sender, receiver = run_distributed(_ahead, 2, timeout=60)
    for static in (False, True):
        assert sender[("grad before its forward", static)] is False
        assert sender[("grad after its forward", static)] is True and sender[("grad 2", static)] is True
        assert sender[("twice", static)] is False
        assert sender[("grads", static)] == [6 * 12.0, 6 * 10.0, 6 * 11.0]
        assert sender[("counted", static)] == 2
        assert receiver[("first, no spec", static)] is False
        assert receiver[("next, spec cached", static)] is True
        assert receiver[("inputs", static)] == [0.0, 6 * 2.0, 6 * 1.0]
        assert receiver[("counted", static)] == 1


def _ahead_changing(rank: int, world: int) -> dict:
    """Forward receives posted ahead while specs change: 'a' and 'b' on rank 0 feed 'c' on rank 1
    (two channels from one peer); a changed spec's further parts follow on their own tag."""
    layout = PipelineLayout({"a": ModulePlacement(), "b": ModulePlacement(rank_offset=0), "c": ModulePlacement()},
                            {"a": ["c"], "b": ["c"], "c": []})
    comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"))
    a = {k: MessageKey(F, "a", "c", k) for k in range(6)}
    b = {k: MessageKey(F, "b", "c", k) for k in range(6)}
    # a's rows per microbatch (b's: one more): a changes at 1, 3 and 5; at most the last message of a
    # channel in one post may change its spec (the receiver plans them all with the spec it knows)
    rows = {0: 2, 1: 4, 2: 4, 3: 2, 4: 2, 5: 5}

    def value(src: str, k: int) -> torch.Tensor:
        return torch.full((rows[k] + (src == "b"), 3), 10.0 * k + (src == "b"))

    out: dict = {}
    if rank == 0:
        for ks in ({"a": [0], "b": [0]}, {"a": [1], "b": [1]}, {"a": [2, 3]}, {"a": [4, 5]}, {"b": [2]}):
            comm.post({(a if src == "a" else b)[k]: value(src, k) for src in ks for k in ks[src]}, [])
        comm.wait_sends()
        return out
    comm.post({}, [a[0], b[0]])
    got = {("a", 0): comm.take(a[0]), ("b", 0): comm.take(b[0])}
    # the receives of one peer in the order of its sends (canonical within a post)
    out["a1 ahead"] = comm.post_ahead(a[1])  # planned with a's cached spec, which changes: stale
    out["b1 ahead"] = comm.post_ahead(b[1])  # another channel: taken ahead while a1 may need more parts
    out["a2 ahead"] = comm.post_ahead(a[2])  # refused: a1 may bring a new spec for a2
    got[("b", 1)] = comm.take(b[1])  # a1's further parts come first on the pair: a1 completed first
    out["a1 whole before its take"] = all(m.done for _, (_, m) in comm._inbox[a[1]][0])
    comm.post({}, [a[2], a[3]])
    comm.post({}, [a[4], a[5]])  # a3 may change a's spec again: completed first
    out["b2 ahead"] = comm.post_ahead(b[2])
    for src, k in [("b", 2), ("a", 5), ("a", 3), ("a", 4), ("a", 2), ("a", 1)]:
        got[(src, k)] = comm.take((a if src == "a" else b)[k])
    out["equal"] = {key: torch.equal(t, value(*key)) for key, t in got.items()}
    out["open left"] = dict(comm._open)
    out["counted"] = comm.stats.receives_ahead
    out["metadata"] = comm.stats.metadata_exchanges
    comm.wait_sends()
    return out


@pytest.mark.timeout(60)
def test_forward_receives_posted_ahead_while_specs_change():
    """Without static shapes a forward receive is posted ahead on a channel whose earlier
    messages are whole; when its sender's spec changed, the further parts (on their own tag)
    complete it, in the sender's order across groups, and every payload arrives intact."""
    _, receiver = run_distributed(_ahead_changing, 2, timeout=60)
    assert receiver["a1 ahead"] is True and receiver["b1 ahead"] is True and receiver["a2 ahead"] is False
    assert receiver["a1 whole before its take"] is True and receiver["b2 ahead"] is True
    assert receiver["equal"] == {key: True for key in receiver["equal"]} and len(receiver["equal"]) == 9
    assert receiver["open left"] == {}
    assert receiver["counted"] == 3
    assert receiver["metadata"] == 6  # a: first use, 1, 3, 5; b: first use, 1


def _static(rank: int, world: int) -> dict:
    from lightning_mmpp.errors import ExchangeMismatchError, PipelineConfigError

    comm = _two_stages(rank, static_specs=True)
    key = [MessageKey(F, "a", "a", k) for k in range(4)]
    out: dict = {}
    if rank == 0:
        comm.post({key[0]: torch.ones(4, 3)}, [])
        comm.post({key[1]: torch.full((4, 3), 2.0)}, [])
        try:  # a changed shape raises before anything is posted
            comm.post({key[2]: torch.ones(5, 3)}, [])
        except PipelineConfigError as err:
            out["error"] = str(err)
        comm.wait_sends()
        return out
    comm.post({}, [key[0]])
    out["first"] = torch.equal(comm.take(key[0]), torch.ones(4, 3))
    comm.finish_step()  # the first message of the channel was read: nothing deferred
    comm.post({}, [key[3]])  # the peer sent microbatch 1: same size, so only the header tells
    out["taken"] = comm.take(key[3]).sum().item()
    try:
        comm.finish_step()
    except ExchangeMismatchError as err:
        out["mismatch"] = str(err)
    return out


@pytest.mark.timeout(60)
def test_static_shapes_refuse_a_changed_shape_and_check_headers_once_per_step():
    sender, receiver = run_distributed(_static, 2, timeout=60)
    assert "changed from [float32[4, 3]] to [float32[5, 3]]" in sender["error"]
    assert "static_shapes=False" in sender["error"]
    assert receiver["first"] and receiver["taken"] == 24.0  # taken unread: microbatch 1's data
    assert "exchanged different messages or in a different order" in receiver["mismatch"]


def _reuse(rank: int, world: int) -> dict:
    comm = _two_stages(rank)
    keys = [MessageKey(F, "a", "a", k) for k in range(4)]
    values = [torch.full((64, 64), float(k)) for k in range(4)]
    out: dict = {}
    if rank == 0:
        pointers = []
        for key, value in zip(keys, values):
            comm.post({key: value}, [])
            pointers.append(next(iter(comm._send_buffers.values())).data_ptr())
        comm.wait_sends()
        out["pointers"] = pointers
    else:
        for key in keys:
            comm.post({}, [key])
        out["ok"] = [torch.equal(comm.take(key), value) for key, value in zip(keys, values)]
    return out


@pytest.mark.timeout(60)
def test_a_channel_packs_into_the_same_send_buffer_once_its_send_completed():
    sender, receiver = run_distributed(_reuse, 2, timeout=60)
    assert receiver["ok"] == [True] * 4
    assert len(set(sender["pointers"][1:])) == 1, sender["pointers"]  # the first message allocates it


def _recv_reuse(rank: int, world: int) -> dict:
    comm = _two_stages(rank)
    keys = [MessageKey(F, "a", "a", k) for k in range(5)]
    values = [torch.full((64, 64), float(k)) for k in range(5)]
    out: dict = {}
    if rank == 0:
        for key, value in zip(keys, values):
            comm.post({key: value}, [])
        comm.wait_sends()
        return out
    pointers = []
    kept, alias = None, None
    for k, key in enumerate(keys):
        comm.post({}, [key])
        payload = comm.take(key)
        pointers.append(payload.data_ptr())
        out[f"ok{k}"] = torch.equal(payload, values[k])
        if k == 0:
            kept = payload  # still held: its buffer must not be lent again
        if k == 1:
            alias = payload.detach()[1:]  # no view of the payload, but the same memory
        del payload
    out["kept_intact"] = torch.equal(kept, values[0]) and torch.equal(alias, values[1][1:])
    out["pointers"] = pointers
    out["pooled"] = [len(buffers) for _, buffers in comm._recv_buffers.buffers.values()]
    return out


@pytest.mark.timeout(60)
def test_a_channel_receives_into_a_buffer_nothing_references_any_more():
    _, receiver = run_distributed(_recv_reuse, 2, timeout=60)
    assert all(receiver[f"ok{k}"] for k in range(5)) and receiver["kept_intact"]
    first, second, *later = receiver["pointers"]
    # the payload of message 0 and an alias of message 1's are alive: their buffers stay theirs
    assert len({first, second, later[0]}) == 3, receiver["pointers"]
    assert len(set(later)) == 1, receiver["pointers"]  # 2, 3, 4 reuse one buffer, freed each time
    assert receiver["pooled"] == [3]  # the channel's peak: messages 0 and 1's buffers and the reused one


# --- large leaves travel as their own transfers (no copy into the packed buffer) ------------------

BIG = {0: (512, 512), 1: (600, 512), 2: (600, 512), 3: (512, 512), 4: (8, 8)}  # 4: small again (packed)


def _big_value(k: int) -> dict:
    torch.manual_seed(100 + k)
    big = torch.randn(*BIG[k])
    if k == 3:
        big = big.t()  # not contiguous: sent from one contiguous copy
    return {"big": big.requires_grad_(), "h": torch.randn(2, 3, requires_grad=True), "k": torch.tensor([k])}


def _run_direct(rank: int, world: int) -> dict:
    comm = _two_stages(rank)
    fwd = {k: MessageKey(F, "a", "a", k) for k in BIG}
    bwd = {k: MessageKey(B, "a", "a", k) for k in BIG}
    out: dict = {}
    if rank == 0:
        for ks in ([0], [1], [2, 3], [4]):
            comm.post({fwd[k]: _big_value(k) for k in ks}, [])
        comm.post({}, [bwd[k] for k in BIG])
        grads = {k: comm.take(bwd[k]) for k in reversed(BIG)}
        out["grads"] = {k: torch.equal(g["big"], torch.full(BIG[k][::-1] if k == 3 else BIG[k], float(k)))
                        and torch.equal(g["h"], torch.full((2, 3), -float(k))) and g["k"] is None
                        for k, g in grads.items()}
    else:
        for ks in ([0], [1], [2, 3], [4]):
            comm.post({}, [fwd[k] for k in ks])
        got = {k: comm.take(fwd[k]) for k in reversed(BIG)}
        out["ok"] = {k: all(torch.equal(got[k][n], _big_value(k)[n].detach()) for n in ("big", "h", "k"))
                     and got[k]["big"].requires_grad and not got[k]["k"].requires_grad for k in BIG}
        comm.post({bwd[k]: {"big": torch.full(tuple(got[k]["big"].shape), float(k)),
                            "h": torch.full((2, 3), -float(k)), "k": None} for k in BIG}, [])
    comm.wait_sends()
    out["metadata"] = comm.stats.metadata_exchanges
    return out


@pytest.mark.timeout(60)
def test_large_leaves_travel_direct_across_spec_changes():
    """A leaf of at least DIRECT_LEAF_BYTES is its own transfer beside the packed small leaves,
    forward and backward, through spec changes (the stale part of an old spec with a direct leaf
    keeps the parts matched) and back to a small, packed leaf."""
    sender, receiver = run_distributed(_run_direct, 2, timeout=60)
    assert receiver["ok"] == {k: True for k in BIG}, receiver
    assert sender["grads"] == {k: True for k in BIG}, sender
    assert sender["metadata"] == receiver["metadata"] == 4  # first use, then the changes at 1, 3 and 4


def test_wire_layout_and_wire_tensor_share_memory():
    from lightning_mmpp.engine.payload import DIRECT_LEAF_BYTES, direct_leaf, flatten_payload, wire_tensor

    big = torch.randn(DIRECT_LEAF_BYTES // 4)
    _, spec = flatten_payload({"a": torch.ones(3), "big": big, "none": None}, "test")
    wire = spec.wire(grad=False)
    assert wire.direct_indices == (1,) and wire.packed.indices == (0,)
    assert wire.sizes == [wire.packed.nbytes, DIRECT_LEAF_BYTES]
    sent = wire_tensor(big, torch.device("cpu"))
    assert sent.data_ptr() == big.data_ptr() and sent.dtype == torch.uint8  # no copy
    assert torch.equal(direct_leaf(sent.clone(), wire.direct_metas[0]), big)
    below = torch.randn(DIRECT_LEAF_BYTES // 4 - 1)
    _, small = flatten_payload(below, "test")
    assert small.wire(grad=False).direct_indices == () and small.wire(grad=False).packed.indices == (0,)
    assert spec.wire(grad=False, direct_bytes=1 << 40).direct_indices == ()  # a threshold above every leaf: all packed


def _same_channel_twice(rank: int, world: int) -> dict:
    """Two messages of one channel in one exchange: fine unless an earlier one changes the spec."""
    from lightning_mmpp.errors import PipelineConfigError

    comm = _two_stages(rank)
    fwd = {k: MessageKey(F, "a", "a", k) for k in range(4)}
    out: dict = {}
    if rank == 0:
        for ks in ([0, 1], [2, 3]):  # the first use is a change too; microbatch 2 changes the spec
            try:
                comm.post({fwd[k]: torch.full((2 + (k == 2), 3), float(k)) for k in ks}, [])
            except PipelineConfigError as err:
                out.setdefault("errors", []).append(str(err))
        comm.post({fwd[0]: torch.zeros(2, 3)}, [])
        comm.post({fwd[1]: torch.ones(2, 3), fwd[2]: torch.full((3, 3), 2.0)}, [])  # the change comes last: fine
        comm.wait_sends()
        return out
    comm.post({}, [fwd[0]])
    comm.post({}, [fwd[1], fwd[2]])
    out["got"] = [comm.take(fwd[k]).tolist() for k in (2, 1, 0)]
    return out


@pytest.mark.timeout(60)
def test_a_changed_spec_followed_on_its_channel_in_one_exchange_raises_on_the_sender():
    sender, receiver = run_distributed(_same_channel_twice, 2, timeout=60)
    assert len(sender["errors"]) == 2, sender
    assert all("follows, in the same exchange" in e and "separate exchanges" in e for e in sender["errors"])
    assert "microbatch 1" in sender["errors"][0] and "microbatch 3" in sender["errors"][1]
    assert receiver["got"] == [[[2.0] * 3] * 3, [[1.0] * 3] * 2, [[0.0] * 3] * 2]


FAN_AND_COLOCATED = {
    "fan-in": PipelineLayout({"v": ModulePlacement(dp=2), "llm": ModulePlacement(pp=2)}, {"v": ["llm"], "llm": []}),
    "colocated": PipelineLayout({"v": ModulePlacement(), "a": ModulePlacement(), "llm": ModulePlacement(rank_offset=0)},
                                {"v": ["llm"], "a": ["llm"], "llm": []}),
}


def _ahead_fan_in_and_colocated(rank: int, world: int, name: str) -> dict:
    from torch import nn

    from lightning_mmpp.core.actions import Exchange
    from lightning_mmpp.core.schedule import build_schedule
    from lightning_mmpp.engine.runtime import PipelineRuntime
    from lightning_mmpp.model.partition import StageRunner

    layout = FAN_AND_COLOCATED[name]
    schedule = build_schedule(layout, 6, "1f1b")
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    out: dict = {"remote keys": len({t.key for a in schedule.for_rank(rank) if isinstance(a, Exchange)
                                     for t in a.recvs if t.peer != rank})}
    for ahead in (2, 0):
        torch.manual_seed(0)
        runners = {s.module: StageRunner(s.module, s.stage, [nn.Linear(8, 8)], ["0"]) for s in layout.slots(rank)}
        comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"))
        runtime = PipelineRuntime(layout, rank, comm, runners, _Hooks(), receive_ahead=ahead)
        for _ in range(2):  # the second step: every channel's spec cached
            comm.reset_stats()
            runtime.run(schedule, lambda module, k: data[k])
        out[ahead] = {m: r.layers[0].weight.grad.clone() for m, r in runners.items()}
        out[("ahead", ahead)] = comm.stats.receives_ahead
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(FAN_AND_COLOCATED))
def test_every_remote_receive_posted_ahead_on_fan_in_and_colocated_layouts(name):
    """A fan-in key (one message per replica) is posted ahead once, with all its peers, and a key
    from a colocated module (nothing to post) does not hold back the receives after it: in a
    steady step every key from another rank goes ahead; the gradients equal those without."""
    for rank, out in enumerate(run_distributed(_ahead_fan_in_and_colocated, FAN_AND_COLOCATED[name].world_size,
                                               name, timeout=60)):
        assert out[("ahead", 2)] == out["remote keys"] > 0 and out[("ahead", 0)] == 0, (rank, out)
        assert all(torch.equal(out[2][m], out[0][m]) for m in out[0]), rank
