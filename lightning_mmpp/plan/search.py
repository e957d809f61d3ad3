"""Search placements for a profiled model: the fastest layouts that fit in memory (pure Python).

A candidate is a set of *groups* (modules colocated on the same ranks, with one ``pp``, ``dp``
and ``tp``; a group takes ``pp * dp * tp`` ranks), optional *attachments* (a ``pp=1`` module
beside the first stage of its only downstream module, or the last stage of its only upstream
one, with that module's dp and tp), the microbatch count and the schedule. ``tp`` is searched
over ``plan_placements(tp_options=...)`` (default: 1 only); every module on a group's ranks
must allow the group's tp (modules sharing a rank share its tp). Split points balance each module's stages by measured time.
``shard`` / ``recompute`` are switched on per module only where a rank would not fit in memory.
Virtual stages (``virtual_stages = v``) are searched over ``plan_placements(virtual_options=...)``
(default: 1 only): a group with ``v > 1`` splits each module into ``pp * v`` stages balanced by
time, stage ``s`` on the group's position ``s % pp`` (V-shaped for ``zbv``, the layout's own
rule), and its candidates run ``interleaved_1f1b`` (``zbv`` where a split-backward schedule is
listed); the engine runs such modules without tp and sharding, so the search gives them neither.

Pruning: a rank runs all its microbatches, so a candidate's step takes at least the busiest
rank's compute (its *busy bound*), plus the forward path before that rank can start and the
backward path after it ends. Candidates are enumerated depth-first over the groups with that
bound (a remaining group gets at most the ranks left), below a threshold that starts near the
perfect balance ``total work / world_size`` and grows until the k best *simulated* plans are
below it; candidates are simulated in order of their bound and skipped once the bound exceeds
the k-th best step. The result is the same as simulating every candidate of the space
(``exhaustive=True`` does that, for tests). With virtual stages the busy bound is unchanged (a
rank still runs all its chunks' work) and the path bounds drop what holds only under 1F1B's
in-flight limit.

Scoring: :func:`lightning_mmpp.core.schedule.build_schedule` and
:func:`lightning_mmpp.core.simulator.simulate` (``mode="overlap"``) with the per-stage costs of
:class:`~lightning_mmpp.plan.costs.CostModel`, on the layout with every dp set to 1 (replicas
are symmetric, so the timing is the same and the simulation much smaller); then the dp
gradient sums after each stage's last backward; memory from the microbatches each unit held in
flight in the simulation (per chunk with virtual stages: a rank's chunks add their peaks, an
upper bound of their joint peak).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_mmpp.core.actions import Phase
from lightning_mmpp.core.balance import balanced_split
from lightning_mmpp.core.kinds import ScheduleName, SimulatorMode
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.plan.calibration import Calibration, read_json, write_json
from lightning_mmpp.plan.costs import (CostModel, LayerProfile, ModelProfile, ModuleProfile, in_lockstep,
                                      step_overhead_seconds)
from lightning_mmpp.core.simulator import DeadlockError, simulate
from lightning_mmpp.plan.lockstep import LOCKSTEP_SCHEDULES, LockstepTiming, time_lockstep
from lightning_mmpp.plan.sharing import host_bound_seconds, planned_schedule, shared_step_seconds, shares_cores

__all__ = ["Plan", "chain_profile", "format_bytes", "plan_placements", "plans_table"]

MAX_MICROBATCHES = 128


@dataclass
class Plan:
    """One proposed layout and what the simulator predicts for it.

    ``placements`` and ``topology`` go to ``MultiModulePipelineStrategy`` as they are (see
    :meth:`snippet`); ``peak_memory_bytes`` has one entry per rank.
    """

    placements: dict[str, ModulePlacement]
    topology: dict[str, list[str]]
    num_microbatches: int
    schedule: ScheduleName
    step_time_s: float
    peak_memory_bytes: tuple[float, ...]
    bubble_fraction: float
    batch_size: int
    lower_bound_s: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.peak_memory_bytes)

    @property
    def max_memory_bytes(self) -> float:
        return max(self.peak_memory_bytes)

    def layout(self) -> PipelineLayout:
        """The :class:`~lightning_mmpp.core.placement.PipelineLayout` of this plan (chunks
        V-shaped under ``"zbv"``, as the strategy builds it)."""
        return PipelineLayout(self.placements, self.topology, v_shape=ScheduleName.parse(self.schedule).v_shape)

    def describe(self) -> str:
        """A compact one-line form, e.g. ``vision 1x2 @0 | audio 1x1 @2 | llm 2x1x2 @3 [4]``
        (``pp x dp``, ``x tp`` when ``tp > 1``, `` v2`` for ``virtual_stages=2``, ``@`` the first
        rank, then the split points)."""
        parts = []
        for name, p in self.placements.items():
            flags = "".join(f" {f}" for f in ("shard", "recompute") if getattr(p, f))
            split = f" {list(p.split_points)}" if p.split_points else ""
            tp = f"x{p.tp}" if p.tp > 1 else ""
            v = f" v{p.virtual_stages}" if p.virtual_stages > 1 else ""
            parts.append(f"{name} {p.pp}x{p.dp}{tp}{v} @{p.rank_offset}{split}{flags}")
        return " | ".join(parts)

    def snippet(self) -> str:
        """Python code that builds the strategy for this plan."""
        lines = ["from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy", "",
                 "strategy = MultiModulePipelineStrategy(", "    placements={"]
        for name, p in self.placements.items():
            args = [f"pp={p.pp}", f"dp={p.dp}", *([f"tp={p.tp}"] if p.tp > 1 else []),
                    *([f"virtual_stages={p.virtual_stages}"] if p.virtual_stages > 1 else []),
                    f"rank_offset={p.rank_offset}"]
            if p.split_points:
                args.append(f"split_points={tuple(p.split_points)!r}")
            args += [f"{f}=True" for f in ("shard", "recompute") if getattr(p, f)]
            lines.append(f"        {name!r}: ModulePlacement({', '.join(args)}),")
        lines += ["    },", f"    topology={self.topology!r},", f"    num_microbatches={self.num_microbatches},",
                  f"    schedule={self.schedule!r},", ")",
                  f"# Trainer(devices={self.world_size}, strategy=strategy), global batch {self.batch_size}: "
                  f"predicted step {self.step_time_s * 1e3:.1f} ms, peak {format_bytes(self.max_memory_bytes)} per rank"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-serialisable summary (:meth:`from_dict` reads it back)."""
        return {
            "placements": {name: {"pp": p.pp, "dp": p.dp, "tp": p.tp, "virtual_stages": p.virtual_stages,
                                  "rank_offset": p.rank_offset,
                                  "split_points": list(p.split_points) if p.split_points else None,
                                  "shard": p.shard, "recompute": p.recompute}
                           for name, p in self.placements.items()},
            "topology": self.topology, "num_microbatches": self.num_microbatches, "schedule": self.schedule,
            "step_time_s": self.step_time_s, "peak_memory_bytes": list(self.peak_memory_bytes),
            "bubble_fraction": self.bubble_fraction, "batch_size": self.batch_size, "world_size": self.world_size,
            "lower_bound_s": self.lower_bound_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan :meth:`to_dict` wrote (extra keys, such as a measured step, are ignored)."""
        placements = {}
        for name, p in data["placements"].items():
            fields = dict(p)
            if fields.get("split_points") is not None:
                fields["split_points"] = tuple(fields["split_points"])
            placements[name] = ModulePlacement(**fields)
        return cls(placements=placements, topology={m: list(d) for m, d in data["topology"].items()},
                   num_microbatches=data["num_microbatches"], schedule=ScheduleName.parse(data["schedule"]),
                   step_time_s=data["step_time_s"], peak_memory_bytes=tuple(data["peak_memory_bytes"]),
                   bubble_fraction=data["bubble_fraction"], batch_size=data["batch_size"],
                   lower_bound_s=data.get("lower_bound_s", 0.0))

    def to_json(self, path: Optional[str | os.PathLike] = None) -> str:
        """The plan as JSON text (:meth:`to_dict`); also written to ``path`` when given."""
        return write_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "Plan":
        """Read a plan from a JSON file path, or from JSON text (:meth:`to_json`)."""
        return cls.from_dict(read_json(source))


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style text."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plans_table(plans: Sequence[Plan]) -> str:
    """A text table of plans, best first."""
    rows = [("#", "step ms", "vs best", "bubble", "peak/rank", "m", "schedule",
             "layout (module pp x dp [x tp] [v chunks per rank] @first rank)")]
    best = plans[0].step_time_s if plans else 1.0
    for i, p in enumerate(plans):
        rows.append((str(i + 1), f"{p.step_time_s * 1e3:.1f}", f"{p.step_time_s / best:.2f}x",
                     f"{p.bubble_fraction:.0%}", format_bytes(p.max_memory_bytes), str(p.num_microbatches),
                     p.schedule, p.describe()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# --- candidates -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    modules: tuple[str, ...]
    pp: int
    dp: int
    tp: int = 1
    v: int = 1  # virtual stages of every module of the group


@dataclass(frozen=True)
class _Structure:
    groups: tuple[_Group, ...]
    beside: tuple[tuple[str, str, int], ...]  # (module, host module, host stage)
    busy: float  # busiest rank's compute per step (seconds), the bound the enumeration uses
    virtual: bool = False  # some group has virtual stages (its candidates run interleaved_1f1b or zbv)


@dataclass
class _Space:
    """Everything the enumeration needs about a profile, computed once."""

    profile: ModelProfile
    world_size: int
    no_backward: frozenset[str]
    order: tuple[str, ...]  # modules in topological order
    upstream: dict[str, list[str]]
    dp_options: tuple[int, ...]
    memory_limit: Optional[float]
    allow_shard: bool
    tp_options: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per module; absent: (1,)
    v_options: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per module; absent: (1,)
    v_shapes: tuple[bool, ...] = (False,)  # chunk orders the schedules of virtual candidates use
    splits: dict[tuple, list[range]] = field(default_factory=dict)
    layer_rates: dict[tuple[str, int], tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    layer_work: dict[tuple[str, int], tuple[float, ...]] = field(default_factory=dict)
    module_totals: dict[tuple[str, int], float] = field(default_factory=dict)
    smallest_static: float = math.inf  # least static bytes of a shape rejected for memory
    shares_cores: bool = False  # ranks outnumber their host's cores: plans are re-timed sharing them

    def tps(self, module: str) -> tuple[int, ...]:
        """The tp sizes ``module`` may have."""
        return self.tp_options.get(module, (1,))

    def vs(self, module: str) -> tuple[int, ...]:
        """The virtual stage counts ``module`` may have."""
        return self.v_options.get(module, (1,))

    def rates(self, module: str, tp: int = 1) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds per profiled batch of every layer on one rank, the parts
        that scale with the samples (each microbatch also pays the fixed part, and tp the
        latencies of its all-reduces: the bounds built on these stay below the cost model's), a
        split layer's over ``tp`` ranks plus the bytes part of its tp all-reduces
        (:meth:`tp_seconds_per_byte`); backward 0 where the module does not train. Computed once."""
        key = (module, tp)
        rates = self.layer_rates.get(key)
        if rates is None:
            layers = self.profile.modules[module].layers
            trains = module not in self.no_backward
            # the bytes part of a split layer's tp all-reduces on the profiled batch, forward and backward
            comm = [self.tp_seconds_per_byte(tp) * layer.tp_allreduces * layer.output_bytes_per_sample
                    * self.profile.profile_batch_size for layer in layers]
            forward = tuple(layer.forward_rate_floor() / layer.split_by(tp) + c for layer, c in zip(layers, comm))
            backward = tuple(layer.backward_rate_floor() / layer.split_by(tp) + c if trains else 0.0
                             for layer, c in zip(layers, comm))
            rates = self.layer_rates[key] = (forward, backward)
        return rates

    def work(self, module: str, tp: int = 1) -> list[float]:
        """Seconds per sample of every layer on one rank (forward, plus backward when it
        trains), a split layer's over ``tp`` ranks plus the bytes part of its tp all-reduces:
        the parts of :meth:`rates` (a new list; computed once)."""
        key = (module, tp)
        work = self.layer_work.get(key)
        if work is None:
            forward, backward = self.rates(module, tp)
            batch = self.profile.profile_batch_size
            work = self.layer_work[key] = tuple((f + b) / batch for f, b in zip(forward, backward))
        return list(work)

    def module_work(self, module: str, tp: int = 1) -> float:
        """``sum(work(module, tp))``, computed once."""
        key = (module, tp)
        total = self.module_totals.get(key)
        if total is None:
            total = self.module_totals[key] = sum(self.work(module, tp))
        return total

    def tp_seconds_per_byte(self, tp: int) -> float:
        """A lower bound of the cost model's tp all-reduce per byte of activation over ``tp``
        ranks: the ring's bytes over the bandwidth (0 where a calibrated per-call part is
        negative, so that the bound stays below every charge)."""
        if tp <= 1:
            return 0.0
        cal = self.profile.calibration
        steps = 2 * (tp - 1)
        if cal is None:
            return steps / tp / self.profile.bandwidth_bytes_per_s
        if cal.allreduce_call_s + steps * cal.allreduce_latency_s < 0:
            return 0.0
        return steps / tp / cal.allreduce_bandwidth

    def split(self, module: str, pp: int, extra: tuple[float, float] = (0.0, 0.0), tp: int = 1) -> list[range]:
        """Stages of ``module`` balanced by time; ``extra`` is the work per sample of modules
        placed beside its first and last stage, which those stages then carry fewer layers for."""
        key = (module, pp, extra, tp)
        if key not in self.splits:
            if (extra == (0.0, 0.0) and tp == 1) or pp == 1:
                self.splits[key] = CostModel.split(self.profile, module, pp)
            else:
                work = self.work(module, tp)
                work[0] += extra[0]
                work[-1] += extra[1]
                self.splits[key] = balanced_split(work, pp)
        return self.splits[key]

    def stage_work(self, module: str, pp: int, extra: tuple[float, float] = (0.0, 0.0), tp: int = 1) -> list[float]:
        work = self.work(module, tp)
        return [sum(work[i] for i in r) for r in self.split(module, pp, extra, tp)]

    def beside_work(self, host: str, attached: Iterable[tuple[str, bool]], tp: int = 1) -> tuple[float, float]:
        """Work per sample of the modules beside ``host``'s first and last stage
        (``(module, at_first)`` pairs; those of other hosts are left out by the caller), at the host's ``tp``."""
        first = sum(self.module_work(m, tp) for m, at_first in attached if at_first)
        last = sum(self.module_work(m, tp) for m, at_first in attached if not at_first)
        return first, last

    def static_floor(self, module: str, pp: int, dp: int, extra: tuple[float, float] = (0.0, 0.0),
                     tp: int = 1, shardable: bool = True) -> list[float]:
        """Smallest static bytes per stage of ``module`` at ``pp x dp x tp`` (sharded when
        possible: ``shardable`` and ``dp > 1``)."""
        layers = self.profile.modules[module].layers
        factor = self.profile.state_bytes_per_param_byte
        out = []
        for r in self.split(module, pp, extra, tp):
            state = sum(layers[i].param_bytes / layers[i].split_by(tp)
                        * (factor if layers[i].trainable and module not in self.no_backward else 1.0) for i in r)
            if shardable and self.allow_shard and dp > 1:
                state = state / dp + max(layers[i].param_bytes / layers[i].split_by(tp) for i in r)
            out.append(state)
        return out


def _set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [(first,), *partition]
        for i in range(len(partition)):
            yield [*partition[:i], (first, *partition[i]), *partition[i + 1:]]


def _groupings(space: _Space, colocate: bool) -> Iterator[tuple[list[tuple[str, ...]], dict[str, tuple[str, str]]]]:
    """``(groups of modules, {attached module: (host, "first" | "last")})`` choices."""
    topo = space.profile.topology
    attachable: dict[str, list[tuple[str, str]]] = {}
    if colocate:
        for module in space.order:
            hosts = []
            if len(topo[module]) == 1:
                hosts.append((topo[module][0], "first"))
            if len(space.upstream[module]) == 1:
                hosts.append((space.upstream[module][0], "last"))
            if hosts:
                attachable[module] = hosts
    names = list(attachable)
    choices = [[None, *attachable[n]] for n in names]
    seen = set()
    for picks in itertools.product(*choices):
        beside = {n: pick for n, pick in zip(names, picks) if pick is not None}
        if any(host in beside for host, _ in beside.values()):
            continue
        rest = [m for m in space.order if m not in beside]
        if not rest:
            continue
        partitions = _set_partitions(rest) if colocate else iter([[(m,) for m in rest]])
        for groups in partitions:
            key = (tuple(sorted(groups)), tuple(sorted(beside.items())))
            if key not in seen:
                seen.add(key)
                yield groups, beside


def _group_tps(space: _Space, modules: tuple[str, ...], attached: dict[str, tuple[str, str]]) -> list[int]:
    """The tp sizes a group may have: every module on its ranks (its own and those beside its
    stages) shares it, so each of them must allow it."""
    on_ranks = [*modules, *(a for a, (host, _) in attached.items() if host in modules)]
    return sorted(set.intersection(*(set(space.tps(m)) for m in on_ranks)))


def _group_options(space: _Space, modules: tuple[str, ...], attached: dict[str, tuple[str, str]],
                   uniform_pp: Optional[int]) -> list[tuple[int, int, int, int, float]]:
    """``(pp, dp, tp, virtual stages, busy seconds per step)`` of every feasible shape of a group."""
    profile = space.profile
    max_pp = min(len(profile.modules[m].layers) for m in modules)
    options: list[tuple[int, int, int, int, float]] = []
    plain = all(1 in space.vs(m) for m in modules)  # virtual_options may rule v=1 out
    for tp in _group_tps(space, modules, attached) if plain else ():
        extra = {m: space.beside_work(m, [(a, where == "first") for a, (h, where) in attached.items() if h == m], tp)
                 for m in modules}
        for pp in range(1, min(max_pp, space.world_size // tp) + 1):
            if uniform_pp is not None and pp != uniform_pp:
                continue
            per_stage = _stage_sums((space.stage_work(m, pp, extra[m], tp) for m in modules), pp)
            for m, (host, where) in attached.items():
                if host in modules:
                    per_stage[0 if where == "first" else pp - 1] += space.module_work(m, tp)
            for dp in space.dp_options:
                if pp * dp * tp > space.world_size:
                    break
                if space.memory_limit is not None:
                    static = _stage_sums((space.static_floor(m, pp, dp, extra[m], tp) for m in modules), pp)
                    for m, (host, where) in attached.items():
                        if host in modules:
                            static[0 if where == "first" else pp - 1] += space.static_floor(m, 1, dp, tp=tp)[0]
                    if max(static) > space.memory_limit:
                        space.smallest_static = min(space.smallest_static, max(static))
                        continue
                options.append((pp, dp, tp, 1, max(per_stage) * profile.batch_size / dp))
    return options + _virtual_options(space, modules, attached, uniform_pp)


def _stage_sums(rows: Iterable[Sequence[float]], stages: int) -> list[float]:
    """The element-wise sum of ``rows`` (one value per stage each: a group's modules)."""
    out = [0.0] * stages
    for row in rows:
        for stage, value in enumerate(row):
            out[stage] += value
    return out


@functools.lru_cache(maxsize=None)
def _positions(pp: int, v: int, v_shape: bool) -> tuple[int, ...]:
    """The rank position of each of the ``pp * v`` stages of a module (the layout's own rule)."""
    placement = ModulePlacement(pp=pp, virtual_stages=v)
    return tuple(placement.position(stage, v_shape) for stage in range(pp * v))


def _per_position(per_stage: Sequence[float], pp: int, v: int, v_shape: bool) -> list[float]:
    """``per_stage`` (one value per stage of ``pp * v``) summed over the stages of each rank position."""
    out = [0.0] * pp
    for position, value in zip(_positions(pp, v, v_shape), per_stage):
        out[position] += value
    return out


def _virtual_options(space: _Space, modules: tuple[str, ...], attached: dict[str, tuple[str, str]],
                     uniform_pp: Optional[int]) -> list[tuple[int, int, int, int, float]]:
    """``(pp, dp, 1, v, busy)`` of the group's shapes with ``v > 1`` virtual stages: every module
    of the group allows ``v``, ``pp >= 2``, at least one layer per stage (``pp * v`` of each
    module), tp 1 and no sharding (the engine runs neither with virtual stages), no module
    beside the group's stages (a search restriction). The busy bound and the static floor are
    the least over the chunk orders searched (interleaved, V-shaped), so they bound both."""
    allowed = set.intersection(*(set(space.vs(m)) for m in modules)) - {1}
    if not allowed or any(host in modules for host, _ in attached.values()):
        return []
    if 1 not in _group_tps(space, modules, attached):
        return []
    profile = space.profile
    min_layers = min(len(profile.modules[m].layers) for m in modules)
    options = []
    for v in sorted(allowed):
        for pp in range(2, min(min_layers // v, space.world_size) + 1):
            if uniform_pp is not None and pp != uniform_pp:
                continue
            stages = pp * v
            per_stage = _stage_sums((space.stage_work(m, stages) for m in modules), stages)
            busy = min(max(_per_position(per_stage, pp, v, shape)) for shape in space.v_shapes)
            for dp in space.dp_options:
                if pp * dp > space.world_size:
                    break
                if space.memory_limit is not None:
                    static = _stage_sums((space.static_floor(m, stages, dp, shardable=False) for m in modules), stages)
                    least = min(max(_per_position(static, pp, v, shape)) for shape in space.v_shapes)
                    if least > space.memory_limit:
                        space.smallest_static = min(space.smallest_static, least)
                        continue
                options.append((pp, dp, 1, v, busy * profile.batch_size / dp))
    return options


def _structures(space: _Space, threshold: float, colocate: bool, uniform: bool) -> Iterator[_Structure]:
    """Every structure whose busy bound is below ``threshold`` (depth-first, with bounds)."""
    world = space.world_size
    for groups, attached in _groupings(space, colocate):
        pps = range(1, world + 1) if uniform else [None]
        for uniform_pp in pps:
            options = [_group_options(space, g, attached, uniform_pp) for g in groups]
            if any(not o for o in options):
                continue
            # best[j][r]: least busy of group j with at most r ranks
            best = []
            for opts in options:
                row = [math.inf] * (world + 1)
                for pp, dp, tp, _, busy in opts:
                    row[pp * dp * tp] = min(row[pp * dp * tp], busy)
                for r in range(1, world + 1):
                    row[r] = min(row[r], row[r - 1])
                best.append(row)
            n = len(groups)
            chosen: list[tuple[int, int, int, int, float]] = []

            def dfs(j: int, left: int, bound: float) -> Iterator[_Structure]:
                if j == n:
                    if left == 0:
                        beside = tuple((m, h, where) for m, (h, where) in attached.items())
                        shapes = tuple(_Group(g, pp, dp, tp, v) for g, (pp, dp, tp, v, _) in zip(groups, chosen))
                        yield _Structure(shapes, _resolve_beside(beside, groups, chosen), bound,
                                         any(g.v > 1 for g in shapes))
                    return
                remaining = n - j - 1
                for option in options[j]:
                    pp, dp, tp, _, busy = option
                    size = pp * dp * tp
                    rest = left - size
                    if rest < remaining or (remaining == 0 and rest != 0):
                        continue
                    b = max(bound, busy)
                    if remaining:
                        b = max(b, max(best[k][rest - remaining + 1] for k in range(j + 1, n)))
                    if b >= threshold:
                        continue
                    chosen.append(option)
                    yield from dfs(j + 1, rest, b)
                    chosen.pop()

            yield from dfs(0, world, 0.0)


def _resolve_beside(beside: tuple[tuple[str, str, str], ...], groups: list[tuple[str, ...]],
                    chosen: list[tuple[int, int, int, int, float]]) -> tuple[tuple[str, str, int], ...]:
    pp_of = {m: option[0] for g, option in zip(groups, chosen) for m in g}
    return tuple((m, host, 0 if where == "first" else pp_of[host] - 1) for m, host, where in beside)


def _placements(space: _Space, structure: _Structure, collapse: bool = False,
                flags: Optional[dict[str, tuple[bool, bool]]] = None) -> dict[str, ModulePlacement]:
    """The placements of a structure (every dp and tp 1 with ``collapse``: one unit per tp
    group), in declaration order."""
    flags = flags or {}
    by_module: dict[str, ModulePlacement] = {}
    cursor = 0
    groups = sorted(structure.groups, key=lambda g: min(space.order.index(m) for m in g.modules))
    for group in groups:
        dp, tp = (1, 1) if collapse else (group.dp, group.tp)
        for m in group.modules:
            extra = space.beside_work(m, [(a, stage == 0) for a, host, stage in structure.beside if host == m],
                                      group.tp)
            split = tuple(r.start for r in space.split(m, group.pp * group.v, extra, group.tp)[1:]) or None
            shard, recompute = flags.get(m, (False, False))
            by_module[m] = ModulePlacement(pp=group.pp, dp=dp, rank_offset=cursor, split_points=split,
                                           shard=shard and not collapse, recompute=recompute, tp=tp,
                                           virtual_stages=group.v)
        cursor += group.pp * dp * tp
    for m, host, stage in structure.beside:
        h = by_module[host]
        shard, recompute = flags.get(m, (False, False))
        by_module[m] = ModulePlacement(pp=1, dp=h.dp, rank_offset=h.rank_offset + stage * h.dp * h.tp,  # type: ignore[operator]
                                       shard=shard and not collapse and h.dp > 1, recompute=recompute, tp=h.tp)
    return {m: by_module[m] for m in space.profile.modules}


def _dp_of(structure: _Structure) -> dict[str, int]:
    """Every module's dp in ``structure`` (a module beside another has its host's)."""
    dp = {m: g.dp for g in structure.groups for m in g.modules}
    for m, host, _ in structure.beside:
        dp[m] = dp[host]
    return dp


def _tp_of(structure: _Structure) -> dict[str, int]:
    """Every module's tp in ``structure`` (a module beside another has its host's)."""
    tp = {m: g.tp for g in structure.groups for m in g.modules}
    for m, host, _ in structure.beside:
        tp[m] = tp[host]
    return tp


def _one_sample_path(space: _Space, dp: dict[str, int], tp: dict[str, int]) -> float:
    """Compute seconds per sample of the global batch along the longest module path (forward and
    backward of every layer on it, each module's share divided by its dp): times
    ``batch / m`` it is the round trip of one microbatch, which no schedule overlaps."""
    longest: dict[str, float] = {}
    for module in space.order:
        before = max((longest[u] for u in space.upstream[module]), default=0.0)
        longest[module] = before + space.module_work(module, tp[module]) / dp[module]
    return max(longest.values(), default=0.0)


@dataclass(frozen=True)
class _FillBound:
    """A structure's compute-only path bound as a function of ``m`` (see :func:`_fill_bound`):
    per rank ``busy + fill / m``, per trained stage ``backward + trip / m`` (1F1B and GPipe)."""

    ranks: tuple[tuple[float, float, float], ...]  # (busy, fill path + drain path, fill path) per step
    stages: tuple[tuple[float, float], ...]  # (all backwards, head + forward + round trip + tail) per step

    def at(self, m: int, schedule: ScheduleName) -> float:
        """The bound for ``m`` microbatches under ``schedule`` (seconds, without the step overhead).
        The per-stage term holds for any schedule with fused backwards (interleaved_1f1b too):
        a stage's first backward waits for a round trip, whatever its in-flight limit."""
        if schedule.split_backward:  # the last compute may be a W nothing waits for
            return max(busy + head / m for busy, _, head in self.ranks)
        bound = max(busy + path / m for busy, path, _ in self.ranks)
        return max(bound, max((backward + trip / m for backward, trip in self.stages), default=0.0))


def _fill_bound(space: _Space, structure: _Structure, v_shape: bool = False) -> _FillBound:
    """:func:`_path_bound` on the structure's compute alone (no transfers, collectives,
    framework overhead or flags, which only add to every cost; an in-flight limit of ``m``, the
    most it can be), in closed form in ``m``: a stage's compute per microbatch is its compute
    per step over ``m``. Every term of the path bound is a sum, max or min of nonnegative
    costs, so this is at most the cost model's bound for any flags: it rules out candidates
    whose fill and drain alone exceed the step to beat, before their cost model is built.

    With virtual stages the chain runs over a module's ``pp * v`` stages and each rank sums the
    stages at its position (``v_shape``: the V-shaped chunk order)."""
    profile = space.profile
    scale = profile.batch_size / profile.profile_batch_size
    pp_of = {m: g.pp * g.v for g in structure.groups for m in g.modules}  # stages
    position = {m: _positions(g.pp, g.v, v_shape) for g in structure.groups for m in g.modules}
    dp_of = {m: g.dp for g in structure.groups for m in g.modules}
    tp_of = _tp_of(structure)
    where: dict[str, tuple[int, int]] = {}  # module -> (group, first stage's position)
    for i, g in enumerate(structure.groups):
        for m in g.modules:
            where[m] = (i, 0)
    attached: dict[str, list[tuple[str, bool]]] = {}
    for m, host, stage in structure.beside:
        pp_of[m], dp_of[m], position[m] = 1, dp_of[host], (0,)
        where[m] = (where[host][0], stage)
        attached.setdefault(host, []).append((m, stage == 0))
    forward: dict[tuple[str, int], float] = {}
    backward: dict[tuple[str, int], float] = {}
    for m in space.order:
        tp = tp_of[m]
        extra = space.beside_work(m, attached.get(m, []), tp)
        # the parts that scale with the samples (a split layer's over tp ranks, with the bytes
        # of its tp all-reduces); the fixed parts per microbatch and the latencies only add
        forward_rates, backward_rates = space.rates(m, tp)
        for s, r in enumerate(space.split(m, pp_of[m], extra, tp)):
            forward[(m, s)] = sum(forward_rates[r.start:r.stop]) * scale / dp_of[m]
            backward[(m, s)] = sum(backward_rates[r.start:r.stop]) * scale / dp_of[m]
    head: dict[tuple[str, int], float] = {}
    tail: dict[tuple[str, int], float] = {}
    for m in space.order:
        for s in range(pp_of[m]):
            preds = [(m, s - 1)] if s else [(u, pp_of[u] - 1) for u in space.upstream[m]]
            head[(m, s)] = max((head[q] + forward[q] for q in preds), default=0.0)
            tail[(m, s)] = max((tail[q] + backward[q] for q in preds), default=0.0)
    trip: dict[tuple[str, int], float] = {}
    for m in reversed(space.order):
        for s in reversed(range(pp_of[m])):
            succs = [(m, s + 1)] if s + 1 < pp_of[m] else [(d, 0) for d in profile.topology[m]]
            trip[(m, s)] = max((trip[q] + forward[q] + backward[q] for q in succs), default=0.0)
    by_rank: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for m in space.order:
        group, first = where[m]
        for s in range(pp_of[m]):
            by_rank.setdefault((group, first + position[m][s]), []).append((m, s))
    ranks = []
    for keys in by_rank.values():
        busy = sum(forward[k] + backward[k] for k in keys)
        fill = min(head[k] for k in keys)
        ranks.append((busy, fill + min(tail[k] for k in keys), fill))
    stages = tuple((backward[k], head[k] + forward[k] + trip[k] + tail[k])
                   for k in forward if k[0] not in space.no_backward)
    return _FillBound(tuple(ranks), stages)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dp_ok(dp: dict[str, int], topology: dict[str, list[str]]) -> bool:
    """Whether every bridge's dp sizes divide one another."""
    for up, downs in topology.items():
        for down in downs:
            a, b = dp[up], dp[down]
            if max(a, b) % min(a, b):
                return False
    return True


def _path_bound(cost: CostModel, layout: PipelineLayout, schedule: ScheduleName = ScheduleName.ONE_F_ONE_B,
                no_backward: frozenset[str] = frozenset()) -> float:
    """A lower bound of the simulated step (without the step's closing metrics all-reduce),
    maximised over ranks: busy time + the forward path before the rank's first compute + (the
    backward path or the gradient sum) after its last.

    Under the schedules with fused backwards each stage also waits for its first backward: it
    runs at most ``limit`` forwards (1F1B's in-flight limit; all ``m`` under GPipe and
    interleaved_1f1b, whose limits are not 1F1B's) before the gradient of microbatch 0 has made
    the round trip through every downstream stage, and all ``m`` backwards and the remaining
    forwards come after, so per stage: fill path + one forward + round trip + the rest of its
    own work + (drain path or gradient sum). Stages count a module's ``pp * virtual_stages``
    chunks; a rank's busy time sums all it holds."""
    topo = layout.topology
    split = schedule.split_backward
    stages = {module: p.num_stages for module, p in cost.placements.items()}
    head: dict[tuple[str, int], float] = {}
    tail: dict[tuple[str, int], float] = {}
    for module in topo.order:
        for s in range(stages[module]):
            if s > 0:
                preds = [(module, s - 1)]
            else:
                preds = [(u, stages[u] - 1) for u in topo.upstream(module)]
            head[(module, s)] = max((head[p] + cost.forward(*p) for p in preds), default=0.0)
            tail[(module, s)] = max((tail[p] + cost.backward(*p) for p in preds), default=0.0)
    trip: dict[tuple[str, int], float] = {}  # forward + backward of the longest path after the stage
    for module in reversed(topo.order):
        pp = stages[module]
        for s in reversed(range(pp)):
            succs = [(module, s + 1)] if s + 1 < pp else [(d, 0) for d in topo.downstream(module)]
            trip[(module, s)] = max((trip[n] + cost.forward(*n) + cost.backward(*n) for n in succs), default=0.0)
    bound = 0.0
    for rank in range(layout.world_size):
        slots = layout.slots(rank)
        busy = sum(cost.m * (cost.forward(s.module, s.stage) + cost.backward(s.module, s.stage)) for s in slots)
        # after the rank's last compute (some slot's last backward) come that slot's gradient
        # sum (of all the module's chunks on the rank: one sum after the last of them) and,
        # unless the backward is split (zero_bubble, zbv: the last compute may be a W that
        # nothing upstream waits for), the upstream backward path
        sums: dict[str, float] = {}
        if layout.virtual:
            # each module's work on the rank starts at its earliest chunk's fill path and its
            # gradient sum follows the last of it (the simulations of timed schedules are
            # costly: the tighter bound skips more of them)
            work: dict[str, float] = {}
            first: dict[str, float] = {}
            for s in slots:
                sums[s.module] = sums.get(s.module, 0.0) + cost.stage(s.module, s.stage).sync_s
                work[s.module] = work.get(s.module, 0.0) + cost.m * (cost.forward(s.module, s.stage)
                                                                     + cost.backward(s.module, s.stage))
                first[s.module] = min(first.get(s.module, math.inf), head[(s.module, s.stage)])
            bound = max(bound, *(first[m] + work[m] + sums[m] for m in sums))
            after = min(sums.values())
        else:
            after = min(cost.stage(s.module, s.stage).sync_s for s in slots)
        if not split:
            after = max(after, min(tail[(s.module, s.stage)] for s in slots))
        bound = max(bound, busy + min(head[(s.module, s.stage)] for s in slots) + after)
        if split:
            continue
        for slot in slots:  # each stage's own chain: its first backward waits for the round trip
            if slot.module in no_backward:
                continue
            key = (slot.module, slot.stage)
            f, b = cost.forward(*key), cost.backward(*key)
            limit = min(cost.m, layout.depth - layout.stage_index(slot.module, slot.stage)) \
                if schedule is ScheduleName.ONE_F_ONE_B else cost.m
            own = head[key] + f + trip[key] + cost.m * b + (cost.m - limit) * f
            bound = max(bound, own + max(tail[key], sums.get(slot.module, cost.stage(*key).sync_s)))
    return bound


class _Evaluator:
    """Flags, bounds and simulation of candidates, with a schedule cache."""

    def __init__(self, space: _Space, allow_recompute: bool) -> None:
        self.space = space
        self.allow_recompute = allow_recompute
        self.layouts: dict = {}
        self.stage_costs: dict = {}  # CostModel's memo, shared by every candidate
        # every plan uses every rank; the bounds charge the smaller of the lockstep and the
        # pipelined per-step cost, a simulated plan its own
        self.metrics_s = min(step_overhead_seconds(space.profile, space.world_size, lockstep)
                             for lockstep in (True, False))
        self.smallest_peak: Optional[tuple[float, str]] = None

    def choose_flags(
        self, structure: _Structure, m: int, schedule: ScheduleName
    ) -> Optional[tuple[dict, CostModel, float]]:
        """The fewest shard / recompute flags under which every rank fits (analytically), the
        cost model and its lower bound; ``None`` when nothing fits."""
        space = self.space
        flags: dict[str, tuple[bool, bool]] = {name: (False, False) for name in space.profile.modules}
        v_shape = structure.virtual and schedule.v_shape
        layout = self.collapsed(structure, v_shape)  # replicas of a stage have equal costs, bounds and memory
        while True:
            placements = _placements(space, structure, flags=flags)
            cost = CostModel(space.profile, placements, m, space.no_backward, memo=self.stage_costs, v_shape=v_shape)
            if space.memory_limit is None:
                return flags, cost, self._bound(cost, layout, schedule)
            inflight = {(r, s.module, s.chunk): cost.inflight_bound(layout, s.module, s.stage, schedule)
                        for r in range(layout.world_size) for s in layout.slots(r)}
            peaks = cost.peak_memory(layout, inflight)
            worst = max(range(len(peaks)), key=peaks.__getitem__)
            if peaks[worst] <= space.memory_limit:
                return flags, cost, self._bound(cost, layout, schedule)
            upgraded = self._upgrade(flags, layout, cost, worst)
            if not upgraded:
                self._note_peak(peaks[worst], placements)
                return None

    def _bound(self, cost: CostModel, layout: PipelineLayout, schedule: ScheduleName) -> float:
        """A lower bound of the candidate's step: its critical path, and where ranks share a
        host's cores, the host's core work over its cores."""
        bound = _path_bound(cost, layout, schedule, self.space.no_backward)
        if self.space.shares_cores:
            bound = max(bound, host_bound_seconds(self.space.profile, cost, self.space.no_backward,
                                                       self.space.world_size))
        return bound + self.metrics_s

    def collapsed(self, structure: _Structure, v_shape: bool = False) -> PipelineLayout:
        """The structure's layout with every dp 1 (one rank per stage position), chunks V-shaped
        with ``v_shape``, cached."""
        key = (structure.groups, structure.beside, v_shape)
        layout = self.layouts.get(key)
        if layout is None:
            layout = PipelineLayout(_placements(self.space, structure, collapse=True), self.space.profile.topology,
                                    v_shape=v_shape)
            self.layouts[key] = layout
        return layout

    def _upgrade(self, flags: dict, layout: PipelineLayout, cost: CostModel, rank: int) -> bool:
        """Switch on the flag that saves the most bytes on ``rank``; False when none is left.
        Every schedule runs both (the engine shards under zero_bubble too; the cost model
        charges its ``W`` a second gather); a module with virtual stages is never sharded (the
        engine refuses it)."""
        best = None
        for slot in layout.slots(rank):
            shard, recompute = flags[slot.module]
            stage = cost.stage(slot.module, slot.stage)
            dp = cost.placements[slot.module].dp
            if not shard and self.space.allow_shard and dp > 1 and cost.placements[slot.module].virtual_stages == 1:
                saving = stage.static_bytes * (1 - 1 / dp)
                if best is None or saving > best[0]:
                    best = (saving, slot.module, (True, recompute))
            if not recompute and self.allow_recompute and slot.module not in self.space.no_backward:
                saving = stage.activation_bytes  # at least one microbatch's worth
                if best is None or saving > best[0]:
                    best = (saving, slot.module, (shard, True))
        if best is None:
            return False
        flags[best[1]] = best[2]
        return True

    def _note_peak(self, peak: float, placements: dict[str, ModulePlacement]) -> None:
        if self.smallest_peak is None or peak < self.smallest_peak[0]:
            desc = ", ".join(f"{n} {p.pp}x{p.dp}{f'x{p.tp}' if p.tp > 1 else ''}"
                             f"{f' v{p.virtual_stages}' if p.virtual_stages > 1 else ''}"
                             f"{' shard' if p.shard else ''}{' recompute' if p.recompute else ''}"
                             for n, p in placements.items())
            self.smallest_peak = (peak, desc)

    def _simulate_timed(self, small: PipelineLayout, m: int, schedule: ScheduleName,
                        cost: CostModel) -> Optional[LockstepTiming]:
        """zero_bubble, interleaved_1f1b and zbv, built and simulated; the same quantities as
        :func:`time_lockstep`, but the microbatches in flight keyed by ``(rank, module, chunk)``.

        zero_bubble's order is built on the candidate's mean phase costs (a chunk's times its
        ``virtual_stages``: a whole stage's). interleaved_1f1b and zbv are built as the engine
        builds them (:func:`build_schedule` with its default phase costs), so the prediction is
        of the action lists that run (not cached: candidates rarely share a collapsed layout and
        ``m``, and a search holds thousands of them)."""
        space = self.space
        built = planned_schedule(small, m, schedule, cost, space.no_backward)
        try:
            result = simulate(built, small, cost.forward, cost.backward, mode=SimulatorMode.OVERLAP, latency=0.0,
                              input_cost=cost.input, weight_cost=cost.weight, blocking_sync_cost=cost.blocking_sync)
        except DeadlockError:
            return None
        last_backward: dict[tuple[int, str], float] = {}
        held: dict[tuple[int, str, int], int] = {}
        peak: dict[tuple[int, str, int], int] = {}
        finish = [0.0] * small.world_size
        for rank, start, end, action in sorted(result.computes, key=lambda c: c[1]):
            finish[rank] = max(finish[rank], end)
            unit = (rank, action.module, action.chunk)
            if action.module in space.no_backward:
                continue
            if action.phase is Phase.FORWARD:
                held[unit] = held.get(unit, 0) + 1
                peak[unit] = max(peak.get(unit, 0), held[unit])
            elif action.phase in (Phase.BACKWARD, Phase.BACKWARD_WEIGHT):
                held[unit] = held.get(unit, 0) - 1
                last_backward[unit[:2]] = max(last_backward.get(unit[:2], 0.0), end)
        return LockstepTiming(result.step_time, result.busy, tuple(finish), last_backward, peak)

    def simulate(self, structure: _Structure, m: int, schedule: ScheduleName, flags: dict, cost: CostModel,
                 bound: float) -> Optional[Plan]:
        space = self.space
        topology = space.profile.topology
        placements = cost.placements
        layout = PipelineLayout(placements, topology, v_shape=cost.v_shape)
        small = self.collapsed(structure, cost.v_shape)
        chunked = schedule not in LOCKSTEP_SCHEDULES  # peaks keyed (rank, module, chunk)
        if schedule in LOCKSTEP_SCHEDULES:
            timing = time_lockstep(small, m, schedule, cost.forward, cost.backward, space.no_backward,
                                   cost.blocking_sync)
        else:
            timing = self._simulate_timed(small, m, schedule, cost)
            if timing is None:
                return None
        # a rank's step ends with its gradient sums (those not run inside the last backward),
        # each started after its module's last backward there (of all its chunks) and run one
        # after the other (colocated modules' collectives queue on the rank), then its closing
        # work (the optimizer step, the gradients' copies for their sums), which also waits for
        # the step's metrics sum: every rank's pipeline done (the engine returns from the step,
        # and Lightning steps the optimizer, only then)
        finish = list(timing.finish)
        syncs: dict[int, list[tuple[float, float]]] = {}
        for (rank, module), end in timing.last_backward.items():
            seconds = sum(cost.stage(module, s.stage).trailing_sync_s for s in small.chunk_slots(rank, module))
            syncs.setdefault(rank, []).append((end, seconds))
        for rank, queue in syncs.items():
            done = 0.0
            for end, seconds in sorted(queue):
                done = max(done, end) + seconds
            finish[rank] = max(finish[rank], done)
        step = max(timing.step_time, *(
            max(finish[r], timing.step_time) + sum(cost.stage(s.module, s.stage).closing_s for s in small.slots(r))
            for r in range(small.world_size)))
        step += step_overhead_seconds(space.profile, space.world_size, in_lockstep(placements, space.world_size))
        if space.shares_cores:
            # never shorter than the step above: the ranks' core parts only slow down
            step = shared_step_seconds(space.profile, placements, m, schedule, cost, space.no_backward, layout)
        inflight = {}
        weights = []
        held: Mapping[tuple, int] = timing.peak_in_flight
        for rank in range(layout.world_size):
            for slot in layout.slots(rank):
                lead = small.rank_of(slot.module, slot.stage, 0)
                key = (lead, slot.module, slot.chunk) if chunked else (lead, slot.module)
                inflight[(rank, slot.module, slot.chunk)] = held.get(key, 0)
        for rank in range(small.world_size):
            p = placements[small.slots(rank)[0].module]
            weights.append(p.dp * p.tp)
        peaks = cost.peak_memory(layout, inflight)
        if space.memory_limit is not None and max(peaks) > space.memory_limit:
            self._note_peak(max(peaks), placements)
            return None
        busy = sum(w * b for w, b in zip(weights, timing.busy))
        bubble = 1.0 - busy / (step * layout.world_size) if step > 0 else 0.0
        return Plan(placements=dict(placements), topology={k: list(v) for k, v in topology.items()},
                    num_microbatches=m, schedule=schedule, step_time_s=step, peak_memory_bytes=tuple(peaks),
                    bubble_fraction=bubble, batch_size=space.profile.batch_size, lower_bound_s=bound)


def _plan_key(plan: Plan) -> tuple:
    return tuple(sorted(plan.placements.items())), plan.num_microbatches, plan.schedule


def _microbatch_options(batch: int, lcm_dp: int, given: Optional[int]) -> list[int]:
    if given is not None:
        return [given] if batch % (given * lcm_dp) == 0 else []
    if batch % lcm_dp:
        return []
    return [m for m in _divisors(batch // lcm_dp) if m <= MAX_MICROBATCHES]


def plan_placements(
    profile: ModelProfile,
    world_size: int,
    num_microbatches: Optional[int] = None,
    memory_limit_bytes: Optional[float] = None,
    schedules: Sequence[ScheduleName | str] = (ScheduleName.ONE_F_ONE_B,),
    top_k: int = 5,
    *,
    batch_size: Optional[int] = None,
    allow_colocation: bool = True,
    allow_shard: bool = True,
    allow_recompute: bool = True,
    uniform: bool = False,
    exhaustive: bool = False,
    tolerance: float = 0.03,
    calibration: Optional[Calibration] = None,
    tp_options: Sequence[int] | Mapping[str, Sequence[int]] = (1,),
    virtual_options: Sequence[int] | Mapping[str, Sequence[int]] = (1,),
) -> list[Plan]:
    """The ``top_k`` fastest placements of ``profile`` on ``world_size`` ranks, best first.

    Args:
        profile: measured costs (:func:`lightning_mmpp.plan.profile_model` or a JSON file).
        world_size: ranks the plan must use, all of them.
        num_microbatches: fixed microbatch count; ``None`` tries every divisor of the batch
            (up to 128) that the dp sizes allow.
        memory_limit_bytes: the most a rank may hold; plans predicted above it are rejected.
        schedules: schedule names to try (``"1f1b"``, ``"gpipe"``, ``"zero_bubble"``).
        top_k: how many plans to return.
        batch_size: global batch per step (default: ``profile.batch_size``).
        allow_colocation: also try modules sharing ranks (same pp / dp / offset, or a pp=1
            module beside its neighbour's first or last stage).
        allow_shard, allow_recompute: may switch on ``shard`` / ``recompute`` where memory needs it.
        uniform: only layouts where every module has the same pp and no colocation (a baseline).
        exhaustive: simulate every candidate instead of pruning by bounds (for checks).
        tolerance: once ``top_k`` plans are known, skip a candidate whose lower bound times
            ``1 + tolerance`` reaches the best plan's step: the returned top plan is then within
            ``1 + tolerance`` of the best of an exhaustive search, and the others are the best
            of the candidates simulated. 0 returns exactly the exhaustive top ``top_k`` (slower:
            many layouts sit within a few percent of each other).
        calibration: this machine's measured framework, link and collective costs
            (:func:`lightning_mmpp.plan.calibrate`); overrides the profile's own. ``None``: the
            profile's (none unless ``profile_model(..., calibration=...)`` attached one).
        tp_options: the tensor-parallel sizes the search may give a module: a sequence, e.g.
            ``(1, 2, 4)``, for every module whose profile is ``tp_capable`` (its model has the
            ``pipeline_parallelize`` hook; the other modules keep tp=1), or ``{module: sizes}``
            for the named modules only (the others keep tp=1), e.g. ``{"llm": (1, 2)}``. The
            default ``(1,)`` searches no tensor parallelism. Give only sizes the hook supports
            (e.g. dividing the attention heads): the planner cannot check that.
        virtual_options: the virtual stage counts (``ModulePlacement.virtual_stages``) the
            search may give a module: a sequence, e.g. ``(1, 2)``, for every module (each gets
            the counts it has layers for: ``v > 1`` needs ``pp >= 2`` and at least ``pp * v``
            layers), or ``{module: counts}`` for the named modules only, e.g. ``{"llm": (1, 2)}``.
            The default ``(1,)`` searches none. A candidate with a module at ``v > 1`` runs
            ``"interleaved_1f1b"`` in place of the listed ``"1f1b"`` / ``"gpipe"``, and ``"zbv"``
            in place of ``"zero_bubble"`` (both when both are listed); such a module has tp 1,
            is never sharded (the engine runs neither with virtual stages) and hosts no
            ``pp=1`` module beside its stages. Colocated modules share their ``v``.

    Raises:
        PipelineConfigError: bad arguments, or no plan fits the memory limit (the message says
            the smallest predicted peak and what would fit).
    """
    schedule_names = _check_plan_args(world_size, schedules, tolerance)
    if batch_size is not None:
        profile = replace(profile, batch_size=batch_size)
    if calibration is not None:
        profile = replace(profile, calibration=calibration)
    space = _make_space(profile, world_size, memory_limit_bytes, allow_shard)
    space.tp_options = _tp_options(profile, tp_options)
    space.v_options = _parse_virtual_options(profile, virtual_options)
    space.v_shapes = tuple(dict.fromkeys(s.v_shape for s in _virtual_schedules(schedule_names)))
    evaluator = _Evaluator(space, allow_recompute)
    search = _Search(evaluator, top_k, tolerance, exhaustive)
    # the least work per rank of each module over its tp sizes: a lower bound of a perfect balance
    total = sum(min(space.module_work(m, tp) for tp in space.tps(m)) for m in profile.modules) * profile.batch_size
    perfect = total / world_size
    for factor in [math.inf] if exhaustive else [1.15, 1.5, 2.5, 5.0, math.inf]:
        # no higher than the bound the plans found so far rule out: structures at or above it
        # are hopeless, so enumerating them (the bulk of a search with tp) is skipped
        threshold = min(perfect * factor, search.cutoff())
        search.run(search.candidates(threshold, schedule_names, num_microbatches,
                                     colocate=allow_colocation and not uniform, uniform=uniform))
        # structures not enumerated yet have a busiest rank (so a step) of at least ``threshold``
        if search.hopeless(threshold):
            break
    if not search.best:
        _raise_nothing_fits(space, evaluator, memory_limit_bytes, world_size)
    return search.best[:top_k]


def _module_options(profile: ModelProfile, options: Sequence[int] | Mapping[str, Sequence[int]], arg: str,
                    what: str) -> tuple[dict[str, tuple[int, ...]], bool]:
    """``({module: sorted values}, whether given per module)`` from ``plan_placements(arg=...)``:
    a sequence for every module or ``{module: values}``; :class:`PipelineConfigError` for a value
    that is not an integer >= 1 (``what`` names them, with an example) or an unknown module."""
    def values_of(values: Any, where: str) -> tuple[int, ...]:
        if isinstance(values, (int, str)) or not isinstance(values, Iterable):
            values = (values,)
        values = tuple(values)
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise PipelineConfigError(f"{arg}{where}={values!r}: give {what}.")
        return tuple(sorted(set(values)))

    if isinstance(options, Mapping):
        unknown = [m for m in options if m not in profile.modules]
        if unknown:
            raise PipelineConfigError(f"{arg} names modules {unknown} that the profile does not have; "
                                      f"its modules are {list(profile.modules)}.")
        return {m: values_of(v, f"[{m!r}]") for m, v in options.items()}, True
    values = values_of(options, "")
    return {m: values for m in profile.modules}, False


def _tp_options(profile: ModelProfile,
                options: Sequence[int] | Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """``{module: tp sizes}`` from ``plan_placements(tp_options=...)``; :class:`PipelineConfigError`
    for a bad size, an unknown module, or tp > 1 for a module its profile says cannot split."""
    chosen, named = _module_options(profile, options, "tp_options",
                                    "tensor-parallel sizes, integers >= 1, e.g. (1, 2, 4)")
    if not named:
        return {m: values if profile.modules[m].tp_capable else (1,) for m, values in chosen.items()}
    for m, values in chosen.items():
        if max(values) > 1 and not profile.modules[m].tp_capable:
            raise PipelineConfigError(
                f"tp_options[{m!r}]={values}: module {m!r} cannot be split (its profile has tp_capable=False: "
                "the model has no pipeline_parallelize hook). Add the hook and profile again, or give it (1,).")
    return chosen


def _virtual_schedules(schedules: Sequence[ScheduleName]) -> list[ScheduleName]:
    """What a candidate with virtual stages runs for the listed ``schedules``: ``"zbv"`` for the
    split-backward ones (``"zero_bubble"``, ``"zbv"``), ``"interleaved_1f1b"`` for the others
    (``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``), each once, in the order listed."""
    return list(dict.fromkeys(ScheduleName.ZBV if s.split_backward else ScheduleName.INTERLEAVED_1F1B
                              for s in schedules))


def _parse_virtual_options(profile: ModelProfile,
                           options: Sequence[int] | Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """``{module: virtual stage counts}`` from ``plan_placements(virtual_options=...)``;
    :class:`PipelineConfigError` for a bad count, an unknown module, or a named module with
    too few layers for two stages of ``v`` chunks. A sequence gives every module the counts it
    has layers for (``2 * v`` at least)."""
    chosen, named = _module_options(profile, options, "virtual_options",
                                    "virtual stage counts, integers >= 1, e.g. (1, 2)")
    if not named:
        return {m: tuple(v for v in values if v == 1 or 2 * v <= len(profile.modules[m].layers))
                for m, values in chosen.items()}
    for m, values in chosen.items():
        layers = len(profile.modules[m].layers)
        if 2 * max(values) > layers:
            raise PipelineConfigError(
                f"virtual_options[{m!r}]={values}: virtual_stages={max(values)} needs pp >= 2 and a layer per "
                f"stage, at least {2 * max(values)} layers, but {m!r} has {layers}. Give it counts up to "
                f"{max(1, layers // 2)}, or leave it out of virtual_options.")
    return chosen


def _check_plan_args(world_size: int, schedules: Sequence[ScheduleName | str], tolerance: float) -> list[ScheduleName]:
    """The schedules parsed; :class:`PipelineConfigError` for a bad world size, schedule or tolerance."""
    if not 0 <= tolerance < 1:
        raise PipelineConfigError(f"tolerance={tolerance!r}: give a fraction in [0, 1), e.g. 0.02.")
    if not isinstance(world_size, int) or world_size < 1:
        raise PipelineConfigError(f"world_size={world_size!r}: give the number of ranks, an integer >= 1.")
    return [ScheduleName.parse(name) for name in schedules]


def _make_space(profile: ModelProfile, world_size: int, memory_limit: Optional[float], allow_shard: bool) -> _Space:
    topology = PipelineLayout({m: ModulePlacement() for m in profile.modules}, profile.topology).topology
    return _Space(profile=profile, world_size=world_size,
                  no_backward=topology.no_backward_modules(profile.frozen_modules()),
                  order=topology.order, upstream={m: list(topology.upstream(m)) for m in profile.modules},
                  dp_options=tuple(d for d in _divisors(profile.batch_size) if d <= world_size),
                  memory_limit=memory_limit, allow_shard=allow_shard,
                  shares_cores=shares_cores(profile, world_size))


# (lower bound, order, level, structure, microbatches, schedule, (flags, cost model, bound) from level 2)
_Candidate = tuple[float, int, int, _Structure, int, ScheduleName, Optional[tuple]]


class _Search:
    """The best plans so far, and the candidates already queued (over every threshold)."""

    def __init__(self, evaluator: _Evaluator, top_k: int, tolerance: float, exhaustive: bool) -> None:
        self.evaluator = evaluator
        self.space = evaluator.space
        self.top_k = top_k
        self.tolerance = tolerance
        self.exhaustive = exhaustive
        self.best: list[Plan] = []
        self.evaluated: set = set()
        self.seen_plans: set = set()
        self.fill_bounds: dict = {}

    def cutoff(self) -> float:
        """The least bound :meth:`hopeless` rules out now (``inf`` until ``top_k`` plans are
        known, and in an exhaustive search); the plans found later only lower it."""
        if self.exhaustive or len(self.best) < self.top_k:
            return math.inf
        cutoff = self.best[self.top_k - 1].step_time_s
        if self.tolerance > 0:
            cutoff = min(cutoff, self.best[0].step_time_s / (1 + self.tolerance))
        return cutoff

    def hopeless(self, bound: float) -> bool:
        """Whether a candidate whose step is at least ``bound`` can be skipped."""
        best, top_k = self.best, self.top_k
        if self.exhaustive or len(best) < top_k:
            return False
        return bound >= best[top_k - 1].step_time_s or (
            self.tolerance > 0 and bound * (1 + self.tolerance) >= best[0].step_time_s
        )

    def candidates(self, threshold: float, schedules: Sequence[ScheduleName], num_microbatches: Optional[int],
                   colocate: bool, uniform: bool) -> list[_Candidate]:
        """Every new (structure, microbatches, schedule) whose busiest rank is below ``threshold``, at level 0."""
        space = self.space
        profile = space.profile
        queue: list[_Candidate] = []
        schedules = list(dict.fromkeys(schedules))
        virtual_schedules = _virtual_schedules(schedules)
        for structure in _structures(space, threshold, colocate, uniform):
            # a structure met below an earlier threshold queued all its candidates then: one
            # look-up per structure (tp multiplies the structures; a key per candidate cost 15% of the search)
            seen = (structure.groups, structure.beside)
            if seen in self.evaluated:
                continue
            self.evaluated.add(seen)
            dp = _dp_of(structure)
            if not _dp_ok(dp, profile.topology):
                continue
            lcm_dp = math.lcm(*dp.values())
            path = _one_sample_path(space, dp, _tp_of(structure))
            for m in _microbatch_options(profile.batch_size, lcm_dp, num_microbatches):
                for schedule in virtual_schedules if structure.virtual else schedules:
                    # microbatch 0 alone crosses the longest path forward and back (whole
                    # backwards: zero_bubble and zbv may defer the weight halves off the path):
                    # few microbatches are ruled out here, before any cost model is built
                    fused = not schedule.split_backward
                    bound = max(structure.busy, path * profile.batch_size / m) if fused else structure.busy
                    queue.append((bound, len(queue), 0, structure, m, schedule, None))
        return queue

    def run(self, queue: list[_Candidate]) -> None:
        """Best first over lower bounds, refined lazily: level 0 is the structure's busiest rank
        and one microbatch's round trip (free from the enumeration), level 1 the path bound on
        the structure's compute alone (:func:`_fill_bound`, once per structure), level 2 the
        cost model's path bound with the shard / recompute flags memory needs (built only for
        candidates that level 1 cannot rule out), then the simulation."""
        heapq.heapify(queue)
        count = len(queue)
        while queue:
            bound, _, level, structure, m, schedule, chosen = heapq.heappop(queue)
            if self.hopeless(bound):
                break
            if level == 0:
                fill = self.fill_bound(structure, structure.virtual and schedule.v_shape).at(m, schedule) \
                    + self.evaluator.metrics_s
                heapq.heappush(queue, (max(bound, fill), count, 1, structure, m, schedule, None))
                count += 1
                continue
            if level == 1:
                chosen = self.evaluator.choose_flags(structure, m, schedule)
                if chosen is not None:
                    heapq.heappush(queue, (max(bound, chosen[2]), count, 2, structure, m, schedule, chosen))
                    count += 1
                continue
            flags, cost, _ = chosen
            plan = self.evaluator.simulate(structure, m, schedule, flags, cost, bound)
            if plan is not None and _plan_key(plan) not in self.seen_plans:
                self.seen_plans.add(_plan_key(plan))
                self.best.append(plan)
                self.best.sort(key=lambda p: (p.step_time_s, p.max_memory_bytes))

    def fill_bound(self, structure: _Structure, v_shape: bool = False) -> _FillBound:
        """:func:`_fill_bound` of ``structure`` (chunks V-shaped with ``v_shape``), computed once."""
        key = (structure.groups, structure.beside, v_shape)
        bound = self.fill_bounds.get(key)
        if bound is None:
            bound = self.fill_bounds[key] = _fill_bound(self.space, structure, v_shape)
        return bound


def _raise_nothing_fits(space: _Space, evaluator: _Evaluator, limit: Optional[float], world_size: int) -> None:
    profile = space.profile
    if limit is None:
        raise PipelineConfigError(
            f"no placement of modules {list(profile.modules)} fits {world_size} rank(s) with a global batch of "
            f"{profile.batch_size}: every module needs at least one rank and the dp sizes must divide the batch. "
            "Use more ranks or a batch divisible by more dp sizes."
        )
    state = sum(layer.param_bytes * (profile.state_bytes_per_param_byte if layer.trainable and m not in
                                     space.no_backward else 1.0)
                for m, mod in profile.modules.items() for layer in mod.layers)
    ranks_needed = max(world_size + 1, math.ceil(state / limit))
    if evaluator.smallest_peak is not None:
        least, desc = evaluator.smallest_peak
        seen = f"the smallest predicted peak is {format_bytes(least)} per rank ({desc})"
    else:
        least = space.smallest_static if space.smallest_static < math.inf else state
        seen = (f"every layout needs at least {format_bytes(least)} on some rank for parameters, gradients and "
                "optimizer state alone")
    levers = "with shard=True (dp >= 2) and recompute=True already tried" if space.allow_shard else \
        "allow shard=True (dp >= 2) to split parameters and optimizer state"
    if all(space.tps(m) == (1,) for m in profile.modules) and any(mod.tp_capable for mod in profile.modules.values()):
        levers += "; tensor parallelism would split layers over ranks: try tp_options=(1, 2, 4) (CLI --tp 1 2 4)"
    raise PipelineConfigError(
        f"no placement on {world_size} rank(s) fits memory_limit {format_bytes(limit)}: {seen}, {levers}. "
        f"Raise the limit to at least {format_bytes(least)}, use more ranks (parameters, gradients and optimizer "
        f"state total {format_bytes(state)}: at least {ranks_needed} ranks at this limit), fewer samples per "
        "microbatch (a smaller batch or more microbatches), or a smaller model."
    )


def chain_profile(profile: ModelProfile, name: str = "chain") -> ModelProfile:
    """The model as one chain of layers in topological order (parallel modules run one after
    the other): the only layout a single-chain pipeline such as ``torch.distributed.pipelining``
    can run. A baseline for the planner."""
    order = PipelineLayout({m: ModulePlacement() for m in profile.modules}, profile.topology).topology.order
    layers = [replace(layer, name=f"{m}.{layer.name}") for m in order
              for layer in ([profile.modules[m].inputs] if profile.modules[m].inputs is not None else [])
              + profile.modules[m].layers]  # a module's pipeline_inputs: a layer without parameters before its own
    for i, layer in enumerate(layers[:-1]):  # a stage boundary carries what every later module still needs
        layers[i] = replace(layer, output_bytes_per_sample=max(layer.output_bytes_per_sample,
                                                               layers[i + 1].input_bytes_per_sample))
    losses = [profile.modules[m].loss for m in order if profile.modules[m].loss is not None]
    return replace(profile, modules={name: ModuleProfile(layers, loss=_summed_losses(losses))}, topology={name: []})


def _summed_losses(losses: Sequence[LayerProfile]) -> Optional[LayerProfile]:
    """The losses of several sinks as one, as a chain's last stage runs them all in turn."""
    if len(losses) <= 1:
        return losses[0] if losses else None
    summed: dict[str, Any] = {f: sum(getattr(x, f) or 0.0 for x in losses)
                              for f in ("forward_s", "backward_s", "input_grad_s", "forward_fixed_s", "backward_fixed_s",
                                        "activation_bytes_per_sample")}
    # the curves added up at the fractions any of them was measured at
    forward_at = sorted({f for x in losses for f, _ in x.forward_points})
    backward_at = sorted({f for x in losses for f, _ in x.backward_points})
    summed["forward_points"] = tuple((f, sum(x.forward_seconds(f) for x in losses)) for f in forward_at)
    summed["backward_points"] = tuple((f, sum(x.backward_seconds(f) for x in losses)) for f in backward_at)
    work = sum(x.forward_s + x.backward_s for x in losses)
    busy = sum((x.forward_s + x.backward_s) * x.cpu_share for x in losses)
    return replace(losses[0], name="pipeline_loss", cpu_share=busy / work if work > 0 else 0.0, **summed)

