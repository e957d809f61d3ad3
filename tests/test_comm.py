"""Tests for lightning_mmpp.engine.comm on real processes (gloo on CPU), plus a world of 1 in-process.

Each launch costs a second or two, so every distributed test runs several layouts in one launch.
Payloads are deterministic functions of (module, stage, replica, microbatch, step), so every
receiver can compute exactly what it must get, and every gradient is a deterministic function of
what the consumer received, so the producer checks it exactly (``torch.equal``) too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import pytest
import torch

from lightning_mmpp.engine.comm import BACKWARD, FORWARD, MessageKey, MultiModuleCommunicator
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.engine.payload import concat_payloads, flatten_payload, split_payload
from lightning_mmpp.core.placement import ModulePlacement as P
from lightning_mmpp.core.placement import PipelineLayout

try:
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    from dist import run_distributed  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(60)

MB = 8  # microbatch size: divisible by every dp used below
CPU = torch.device("cpu")


class KeyedCommunicator(MultiModuleCommunicator):
    """The communicator with per-module convenience calls that derive the message keys.

    The runtime passes explicit keys from the schedule to :meth:`exchange`; these wrappers let
    the tests below drive hand-written GPipe / 1F1B orders the same way.
    """

    def send_forward(self, outputs: Mapping[str, Any], microbatch: int) -> None:
        """Send the output of this rank's stage of each module in ``outputs`` to all its consumers."""
        self.exchange(self._forward_send_keys(outputs, microbatch), ())

    def recv_forward(self, modules: Iterable[str], microbatch: int) -> dict[str, dict[str, Any]]:
        """Receive the inputs of this rank's stage of each module: ``{dst_module: {src_module: payload}}``."""
        keys = self._forward_recv_keys(modules, microbatch)
        return self._by_dst(keys, self.exchange({}, [k for ks in keys.values() for k in ks]))

    def send_backward(self, grads: Mapping[str, Mapping[str, Any]], microbatch: int) -> None:
        """Send input gradients ``{dst_module: {src_module: grad}}`` back to their producers."""
        self.exchange(self._backward_send_keys(grads, microbatch), ())

    def recv_backward(self, modules: Iterable[str], microbatch: int) -> dict[str, dict[str, Any]]:
        """Receive output gradients of this rank's stage of each module: ``{src_module: {dst_module: grad}}``."""
        keys = self._backward_recv_keys(modules, microbatch)
        return self._by_src(keys, self.exchange({}, [k for ks in keys.values() for k in ks]))

    def send_forward_recv_backward(
        self,
        outputs: Mapping[str, Any],
        microbatch: int,
        grad_modules: Optional[Iterable[str]] = None,
        grad_microbatch: Optional[int] = None,
    ) -> dict[str, dict[str, Any]]:
        """Send outputs of ``microbatch`` and receive output gradients of ``grad_microbatch`` in one exchange.

        ``grad_modules`` defaults to the modules of ``outputs``, ``grad_microbatch`` to ``microbatch``.
        Returns ``{src_module: {dst_module: grad}}``.
        """
        modules = list(outputs) if grad_modules is None else list(grad_modules)
        keys = self._backward_recv_keys(modules, microbatch if grad_microbatch is None else grad_microbatch)
        received = self.exchange(self._forward_send_keys(outputs, microbatch), [k for ks in keys.values() for k in ks])
        return self._by_src(keys, received)

    def send_backward_recv_forward(
        self,
        grads: Mapping[str, Mapping[str, Any]],
        microbatch: int,
        input_modules: Optional[Iterable[str]] = None,
        input_microbatch: Optional[int] = None,
    ) -> dict[str, dict[str, Any]]:
        """Send input gradients of ``microbatch`` and receive inputs of ``input_microbatch`` in one exchange.

        ``input_modules`` defaults to the modules of ``grads``, ``input_microbatch`` to ``microbatch``.
        Returns ``{dst_module: {src_module: payload}}``.
        """
        modules = list(grads) if input_modules is None else list(input_modules)
        keys = self._forward_recv_keys(modules, microbatch if input_microbatch is None else input_microbatch)
        received = self.exchange(self._backward_send_keys(grads, microbatch), [k for ks in keys.values() for k in ks])
        return self._by_dst(keys, received)

    def _forward_send_keys(self, outputs: Mapping[str, Any], microbatch: int) -> dict[MessageKey, Any]:
        sends: dict[MessageKey, Any] = {}
        for module, payload in outputs.items():
            for dst in self._distinct(self.layout.forward_targets(self._slot(module))):
                sends[MessageKey(FORWARD, module, dst, microbatch)] = payload
        return sends

    def _forward_recv_keys(self, modules: Iterable[str], microbatch: int) -> dict[str, list[MessageKey]]:
        return {
            module: [
                MessageKey(FORWARD, src, module, microbatch)
                for src in self._distinct(self.layout.forward_sources(self._slot(module)))
            ]
            for module in modules
        }

    def _backward_send_keys(self, grads: Mapping[str, Mapping[str, Any]], microbatch: int) -> dict[MessageKey, Any]:
        sends: dict[MessageKey, Any] = {}
        for dst, per_src in grads.items():
            self._slot(dst)
            for src, grad in per_src.items():
                sends[MessageKey(BACKWARD, src, dst, microbatch)] = grad
        return sends

    def _backward_recv_keys(self, modules: Iterable[str], microbatch: int) -> dict[str, list[MessageKey]]:
        return {
            module: [
                MessageKey(BACKWARD, module, dst, microbatch)
                for dst in self._distinct(self.layout.forward_targets(self._slot(module)))
            ]
            for module in modules
        }

    @staticmethod
    def _by_dst(keys: Mapping[str, list[MessageKey]], received: Mapping[MessageKey, Any]) -> dict[str, dict[str, Any]]:
        return {module: {k.src_module: received[k] for k in ks} for module, ks in keys.items()}

    @staticmethod
    def _by_src(keys: Mapping[str, list[MessageKey]], received: Mapping[MessageKey, Any]) -> dict[str, dict[str, Any]]:
        return {module: {k.dst_module: received[k] for k in ks} for module, ks in keys.items()}


# --- deterministic payloads and gradients ------------------------------------------------------


def stage_output(module: str, stage: int, replica: int, mb: int, step: int, batch: int, variant: int = 0) -> dict:
    """The output of one stage: float (grad / no grad), fp16, bf16, int64, bool and None leaves."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{module}/{stage}/{replica}/{mb}/{step}/{variant}".encode()))
    out: dict[str, Any] = {
        "h": torch.randn(batch, 4, generator=g).requires_grad_(),
        "aux": (
            torch.randn(batch, 3, generator=g).half().requires_grad_(),
            None,
            [torch.randint(0, 100, (batch, 2), generator=g), torch.rand(batch, generator=g) > 0.5],
        ),
        "bf": torch.randn(batch, 2, generator=g).to(torch.bfloat16),
        "none": None,
    }
    if variant:
        out["extra"] = torch.randn(batch, 5, generator=g).requires_grad_()
    return out


def grad_of(payload: Any, drop_half: bool = False, zero_fill: bool = False) -> Any:
    """``3x - 1`` at leaves that require grad, None elsewhere; ``drop_half``: no grad for the fp16 leaf.

    With ``zero_fill`` the dropped grad is zeros: what the producer must receive.
    """
    leaves, spec = flatten_payload(payload, "grad_of")
    grads = []
    for leaf in leaves:
        if leaf is None or not leaf.requires_grad:
            grads.append(None)
        elif drop_half and leaf.dtype == torch.float16:
            grads.append(torch.zeros_like(leaf.detach()) if zero_fill else None)
        else:
            grads.append(leaf.detach() * 3 - 1)
    return spec.unflatten(grads)


def assert_exact(got: Any, expected: Any, flags: bool = True, what: str = "") -> None:
    got_leaves, got_spec = flatten_payload(got, "got")
    exp_leaves, exp_spec = flatten_payload(expected, "expected")
    assert got_spec.treespec == exp_spec.treespec, f"{what}: structure {got_spec.describe()} != {exp_spec.describe()}"
    for i, (a, b) in enumerate(zip(got_leaves, exp_leaves)):
        if b is None:
            assert a is None, f"{what}: leaf {i} should be None"
            continue
        assert a is not None, f"{what}: leaf {i} is None"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: leaf {i} {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert torch.equal(a.detach(), b.detach()), f"{what}: leaf {i} values differ"
        if flags:
            assert a.requires_grad == b.requires_grad, f"{what}: leaf {i} requires_grad {a.requires_grad}"
            assert a.is_leaf, f"{what}: leaf {i} should be a fresh leaf tensor"


def batch_of(layout: PipelineLayout, module: str) -> int:
    return MB // layout.placements[module].dp


def expected_input(layout: PipelineLayout, rank: int, src: str, dst: str, mb: int, step: int) -> Any:
    """What this rank's stage of ``dst`` must receive from ``src``, from the producers' identities."""
    slot = layout.slot(rank, dst)
    peers = sorted((p for m, p in layout.forward_sources(slot) if m == src), key=lambda p: p.chunk)
    parts = []
    for peer in peers:
        s = layout.slot(peer.rank, src)
        full = stage_output(src, s.stage, s.replica, mb, step, batch_of(layout, src))
        if len(peers) == 1 and peer.num_chunks > 1:  # fan-out: our chunk of the producer's output
            full = split_payload(full, peer.num_chunks, 0)[peer.chunk]
        parts.append(full)
    return parts[0] if len(parts) == 1 else concat_payloads(parts, 0)


def channels_of(layout: PipelineLayout, rank: int) -> int:
    """Forward channels with a remote peer that this rank is an end of."""
    channels = set()
    for slot in layout.slots(rank):
        for module, peer in layout.forward_targets(slot):
            if peer.rank != rank:
                channels.add((rank, peer.rank, slot.module, module))
        for module, peer in layout.forward_sources(slot):
            if peer.rank != rank:
                channels.add((peer.rank, rank, module, slot.module))
    return len(channels)


def run_gpipe(layout: PipelineLayout, rank: int, steps: int = 2, microbatches: int = 2,
              direct_leaf_bytes: Optional[int] = None) -> dict:
    """All forwards then all backwards; one exchange per direction and microbatch on each rank."""
    comm = KeyedCommunicator(layout, rank, CPU)
    if direct_leaf_bytes is not None:
        comm.direct_leaf_bytes = direct_leaf_bytes
    slots = layout.slots(rank)
    recv_mods = [s.module for s in slots if layout.forward_sources(s)]
    send_mods = [s.module for s in slots if layout.forward_targets(s)]
    checks = 0
    for step in range(steps):
        sent: dict[int, dict[str, Any]] = {}
        received: dict[int, dict[str, dict[str, Any]]] = {}
        for k in range(microbatches):
            if recv_mods:
                received[k] = comm.recv_forward(recv_mods, k)
                for dst, per_src in received[k].items():
                    assert list(per_src) == list(layout.topology.upstream(dst)) or layout.slot(rank, dst).stage > 0
                    for src, payload in per_src.items():
                        assert_exact(payload, expected_input(layout, rank, src, dst, k, step), what=f"{src}->{dst}")
                        checks += 1
            if send_mods:
                sent[k] = {
                    s.module: stage_output(s.module, s.stage, s.replica, k, step, batch_of(layout, s.module))
                    for s in slots
                    if s.module in send_mods
                }
                comm.send_forward(sent[k], k)
        for k in range(microbatches):
            drop = k == 1  # microbatch 1: the consumer gives no grad for the fp16 leaf -> zeros arrive
            if send_mods:
                grads = comm.recv_backward(send_mods, k)
                for src, per_dst in grads.items():
                    assert per_dst, f"no consumers for {src}"
                    for dst, grad in per_dst.items():
                        expected = grad_of(sent[k][src], drop_half=drop, zero_fill=True)
                        assert_exact(grad, expected, flags=False, what=f"grad {src}<-{dst}")
                        checks += 1
            if recv_mods:
                comm.send_backward(
                    {d: {u: grad_of(p, drop_half=drop) for u, p in per.items()} for d, per in received[k].items()}, k
                )
    comm.wait_sends()
    assert comm.pending_backward() == 0
    assert comm.stats.metadata_exchanges == channels_of(layout, rank), comm.stats
    return {"checks": checks, **comm.stats.as_dict()}


def run_layouts(rank: int, world_size: int, layouts: list[tuple[dict, dict]],
                direct_leaf_bytes: Optional[int] = None) -> list[dict]:
    results = []
    for placements, topology in layouts:
        layout = PipelineLayout(placements, topology)
        assert layout.world_size == world_size
        results.append(run_gpipe(layout, rank, direct_leaf_bytes=direct_leaf_bytes))
    return results


def check_gpipe_results(results: list[list[dict]], layouts: list[tuple[dict, dict]]) -> None:
    for index, (placements, topology) in enumerate(layouts):
        layout = PipelineLayout(placements, topology)
        per_rank = [r[index] for r in results]
        for rank, stats in enumerate(per_rank):
            has_edges = any(layout.forward_sources(s) or layout.forward_targets(s) for s in layout.slots(rank))
            assert stats["checks"] > 0 or not has_edges, (index, rank, stats)
            assert stats["local_handovers"] == 0
        assert sum(s["bytes_sent"] for s in per_rank) == sum(s["bytes_received"] for s in per_rank)
        assert sum(s["messages_sent"] for s in per_rank) == sum(s["messages_received"] for s in per_rank)


# --- world of 2 -----------------------------------------------------------------------------------


def one_f_one_b_colocated(rank: int, steps: list[tuple[int, int, int]], microbatches: int = 3) -> dict:
    """Two colocated pp=2 modules 'a' and 'b' (ranks 0 -> 1), 1F1B with combined exchanges.

    ``steps``: per step ``(variant of a, batch of a, batch of b)``; a change of either
    changes the spec of that module's channel only.
    """
    layout = PipelineLayout({"a": P(pp=2, rank_offset=0), "b": P(pp=2, rank_offset=0)}, {"a": [], "b": []})
    comm = KeyedCommunicator(layout, rank, CPU)
    metadata: list[int] = []
    steady: Optional[dict] = None

    def outputs(k: int, step: int, variant: int, batch_a: int, batch_b: int) -> dict:
        return {
            "a": stage_output("a", 0, 0, k, step, batch_a, variant),
            "b": stage_output("b", 0, 0, k, step, batch_b),
        }

    for step, (variant, batch_a, batch_b) in enumerate(steps):
        before = comm.stats.as_dict()
        if rank == 0:
            sent = {0: outputs(0, step, variant, batch_a, batch_b)}
            comm.send_forward(sent[0], 0)
            grads = {}
            for i in range(1, microbatches):
                sent[i] = outputs(i, step, variant, batch_a, batch_b)
                grads[i - 1] = comm.send_forward_recv_backward(sent[i], i, grad_microbatch=i - 1)
            grads[microbatches - 1] = comm.recv_backward(["a", "b"], microbatches - 1)
            for k, per_src in grads.items():
                for module in ("a", "b"):
                    assert list(per_src[module]) == [module]
                    assert_exact(per_src[module][module], grad_of(sent[k][module]), flags=False, what=f"grad {module}")
        else:
            got = comm.recv_forward(["a", "b"], 0)
            for i in range(microbatches):
                expected = outputs(i, step, variant, batch_a, batch_b)
                for module in ("a", "b"):
                    assert_exact(got[module][module], expected[module], what=f"{module} mb{i} step{step}")
                grads = {m: {m: grad_of(got[m][m])} for m in ("a", "b")}
                if i + 1 < microbatches:
                    got = comm.send_backward_recv_forward(grads, i, input_microbatch=i + 1)
                else:
                    comm.send_backward(grads, i)
        metadata.append(comm.stats.metadata_exchanges)
        if step == 1:
            after = comm.stats.as_dict()
            steady = {name: after[name] - before[name] for name in after}
    comm.wait_sends()
    assert comm.pending_backward() == 0
    return {"metadata": metadata, "steady": steady}


def colocated_upstream(rank: int) -> dict:
    """'a' and 'b' colocated on rank 0 both feed 'c' on rank 1."""
    layout = PipelineLayout(
        {"a": P(rank_offset=0), "b": P(rank_offset=0), "c": P()}, {"a": ["c"], "b": ["c"], "c": []}
    )
    return run_gpipe(layout, rank)


def world2(rank: int, world_size: int) -> dict:
    chain = run_gpipe(PipelineLayout({"a": P(pp=2)}, {"a": []}), rank, steps=3, microbatches=3)
    # 10 unchanged steps, then 'a' gains a leaf, stays so, then 'b' changes batch size.
    schedule = [(0, MB, MB)] * 10 + [(1, MB, MB), (1, MB, MB), (1, MB, 4)]
    ofob = one_f_one_b_colocated(rank, schedule)
    upstream = colocated_upstream(rank)
    return {"chain": chain, "1f1b": ofob, "upstream": upstream}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_world2_chain_1f1b_metadata_colocated_upstream():
    results = run_distributed(world2, 2, timeout=45)
    for rank, result in enumerate(results):
        assert result["chain"]["checks"] > 0
        assert result["chain"]["metadata_exchanges"] == 1
        # Metadata once per channel (2 channels: a and b) for 10 steps, +1 when 'a' changes, +1 for 'b'.
        assert result["1f1b"]["metadata"] == [2] * 10 + [3, 3, 4], (rank, result["1f1b"]["metadata"])
        steady = result["1f1b"]["steady"]
        # Steady state: one message per (channel, microbatch) forward and one per gradient, no metadata.
        assert steady["metadata_exchanges"] == 0
        fwd, bwd = ("messages_sent", "messages_received") if rank == 0 else ("messages_received", "messages_sent")
        assert steady[fwd] == 2 * 3 and steady[bwd] == 2 * 3, steady
        assert result["upstream"]["metadata_exchanges"] == 2  # channels a->c and b->c
    assert results[0]["chain"]["bytes_sent"] == results[1]["chain"]["bytes_received"]
    assert results[1]["chain"]["bytes_sent"] == results[0]["chain"]["bytes_received"]
    assert results[0]["upstream"]["checks"] > 0 and results[1]["upstream"]["checks"] > 0


# --- world of 3: fan-in, fan-out, two upstream modules, structure errors ----------------------------

WORLD3_LAYOUTS = [
    ({"v": P(dp=2), "llm": P()}, {"v": ["llm"], "llm": []}),  # fan-in 2 -> 1
    ({"enc": P(), "dec": P(dp=2)}, {"enc": ["dec"], "dec": []}),  # fan-out 1 -> 2
    ({"v": P(), "a": P(), "llm": P()}, {"v": ["llm"], "a": ["llm"], "llm": []}),  # two upstream into one
    ({"enc": P(), "x": P(), "y": P()}, {"enc": ["x", "y"], "x": [], "y": []}),  # one output, two consumers
]


def fan_in_structure_error(rank: int) -> Optional[str]:
    """Replica 1 of 'v' returns an extra key: the consumer must raise a clear error."""
    layout = PipelineLayout({"v": P(dp=2), "llm": P()}, {"v": ["llm"], "llm": []})
    comm = KeyedCommunicator(layout, rank, CPU)
    if rank < 2:
        out = {"h": torch.ones(4, 2)}
        if rank == 1:
            out["x"] = torch.ones(4)
        comm.send_forward({"v": out}, 0)
        comm.wait_sends()
        return None
    with pytest.raises(PipelineConfigError) as info:
        comm.recv_forward(["llm"], 0)
    return str(info.value)


def world3(rank: int, world_size: int) -> dict:
    return {"gpipe": run_layouts(rank, world_size, WORLD3_LAYOUTS), "error": fan_in_structure_error(rank)}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_world3_fan_in_fan_out_two_upstream():
    results = run_distributed(world3, 3, timeout=45)
    check_gpipe_results([r["gpipe"] for r in results], WORLD3_LAYOUTS)
    message = results[2]["error"]
    assert "different structure" in message and "fan-in from 'v' (dp=2) to 'llm' (dp=1)" in message
    assert "['x']" in message and "ranks [0, 1]" in message


def world3_direct(rank: int, world_size: int) -> list[dict]:
    return run_layouts(rank, world_size, WORLD3_LAYOUTS, direct_leaf_bytes=16)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_world3_fan_in_fan_out_with_every_leaf_direct():
    """The same exchanges with every leaf of >= 16 bytes sent as a transfer of its own (as a
    leaf of >= 1 MiB is by default): fan-in, fan-out, spec changes and gradients alike."""
    results = run_distributed(world3_direct, 3, timeout=45)
    check_gpipe_results(results, WORLD3_LAYOUTS)


# --- world of 5: fan-in 4 -> 1, fan-out 1 -> 4, the design's example layout -------------------------

WORLD5_LAYOUTS = [
    ({"v": P(dp=4), "llm": P()}, {"v": ["llm"], "llm": []}),
    ({"enc": P(), "dec": P(dp=4)}, {"enc": ["dec"], "dec": []}),
    (
        {"vision": P(dp=2), "audio": P(), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    ),
    ({"v": P(pp=2, dp=2), "llm": P()}, {"v": ["llm"], "llm": []}),
]


def world5(rank: int, world_size: int) -> list[dict]:
    return run_layouts(rank, world_size, WORLD5_LAYOUTS)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_world5_fan_in_4_fan_out_4_design_layout():
    results = run_distributed(world5, 5, timeout=75)
    check_gpipe_results(results, WORLD5_LAYOUTS)


# --- world of 1: colocated modules, local handover -------------------------------------------------


def test_world1_colocated_local_handover_moves_no_bytes():
    layout = PipelineLayout(
        {"a": P(rank_offset=0), "b": P(rank_offset=0), "c": P(rank_offset=0)},
        {"a": ["c"], "b": ["c"], "c": []},
    )
    comm = KeyedCommunicator(layout, 0, CPU)  # no process group needed
    fwd = {m: MessageKey(FORWARD, m, "c", 0) for m in ("a", "b")}
    bwd = {m: MessageKey(BACKWARD, m, "c", 0) for m in ("a", "b")}
    for step in range(3):
        outs = {m: stage_output(m, 0, 0, 0, step, MB) for m in ("a", "b")}
        got = comm.exchange({fwd[m]: outs[m] for m in outs}, list(fwd.values()))
        for m in ("a", "b"):
            assert_exact(got[fwd[m]], outs[m], what=m)
            assert got[fwd[m]]["h"] is not outs[m]["h"]
            assert got[fwd[m]]["h"].data_ptr() == outs[m]["h"].data_ptr()  # no copy
        # The consumer runs autograd on what it got; its input grads go back as objects.
        loss = sum((got[fwd[m]]["h"] * 3).sum() + got[fwd[m]]["aux"][0].float().sum() for m in ("a", "b"))
        loss.backward()
        grads = {
            m: {"h": got[fwd[m]]["h"].grad, "aux": (None, None, [None, None]), "bf": None, "none": None}
            for m in ("a", "b")
        }
        back = comm.exchange({bwd[m]: grads[m] for m in grads}, list(bwd.values()))
        for m in ("a", "b"):
            assert torch.equal(back[bwd[m]]["h"], torch.full((MB, 4), 3.0))
            assert back[bwd[m]]["h"].data_ptr() == grads[m]["h"].data_ptr()  # handed over, not copied
            assert torch.equal(back[bwd[m]]["aux"][0], torch.zeros(MB, 3, dtype=torch.float16))  # missing -> zeros
            assert back[bwd[m]]["bf"] is None and back[bwd[m]]["aux"][2] == [None, None]
    stats = comm.stats
    assert stats.bytes_sent == stats.bytes_received == stats.messages_sent == stats.messages_received == 0
    assert stats.metadata_exchanges == 0 and stats.rounds == 0
    assert stats.local_handovers == 3 * 4
    assert comm.pending_backward() == 0
    # Convenience API on the same layout.
    outs = {m: stage_output(m, 0, 0, 1, 0, MB) for m in ("a", "b")}
    comm.send_forward(outs, 1)
    inputs = comm.recv_forward(["c"], 1)
    assert set(inputs) == {"c"} and set(inputs["c"]) == {"a", "b"}
    comm.send_backward({"c": {m: grad_of(inputs["c"][m]) for m in ("a", "b")}}, 1)
    grads = comm.recv_backward(["a", "b"], 1)
    for m in ("a", "b"):
        assert_exact(grads[m]["c"], grad_of(outs[m]), flags=False)
    comm.reset_stats()
    assert comm.stats.local_handovers == 0


def test_world1_errors_name_module_stage_and_path():
    layout = PipelineLayout({"a": P(rank_offset=0), "c": P(rank_offset=0)}, {"a": ["c"], "c": []})
    comm = KeyedCommunicator(layout, 0, CPU)
    with pytest.raises(PipelineConfigError) as info:
        comm.send_forward({"a": {"h": torch.ones(2), "names": ["x", "y"]}}, 0)
    assert "module 'a' stage 0 output" in str(info.value) and "['names'][0]" in str(info.value)
    # The failed exchange left no trace: nothing waits for the consumer, nothing for backward.
    assert comm.pending_backward() == 0 and comm.stats.local_handovers == 0
    with pytest.raises(RuntimeError, match="not sent yet"):
        comm.recv_forward(["c"], 0)
    with pytest.raises(RuntimeError, match="without a forward"):
        comm.recv_backward(["a"], 7)
    with pytest.raises(ValueError, match="does not go to"):
        comm.exchange({MessageKey(FORWARD, "c", "a", 0): torch.ones(1)}, [])
    with pytest.raises(PipelineConfigError, match="unknown module"):
        comm.recv_forward(["zzz"], 0)
    with pytest.raises(PipelineConfigError, match="outside the layout"):
        MultiModuleCommunicator(layout, 3, CPU)


def test_fan_out_split_error_raises_before_any_message():
    # Rank 0 of a 5-rank layout, in this single process: the error comes from planning, before P2P.
    layout = PipelineLayout({"vision": P(), "llm": P(dp=4)}, {"vision": ["llm"], "llm": []})
    comm = KeyedCommunicator(layout, 0, CPU)
    with pytest.raises(PipelineConfigError) as info:
        comm.send_forward({"vision": {"h": torch.ones(6, 2)}}, 0)
    assert str(info.value).startswith(
        "cannot split the batch dim of size 6 of leaf ['h'] into 4 chunks for fan-out from 'vision' (dp=1) to 'llm' (dp=4)"
    )
    assert comm.stats.messages_sent == 0 and comm.pending_backward() == 0
    with pytest.raises(RuntimeError, match="not initialised"):
        comm.send_forward({"vision": {"h": torch.ones(8, 2)}}, 0)
