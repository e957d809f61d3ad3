"""The module DAG: validation, order, and stage numbering.

Pure Python: nothing here touches torch.distributed.

Two stage numberings are computed for every ``(module, pp stage)``:

* **as soon as possible** (ASAP, Megatron's numbering): the longest pp-weighted path through
  the module's upstream modules, plus the stage's own index. A source module starts at 0.
* **as late as possible** (ALAP): ``depth`` minus the longest pp-weighted path from the stage
  to a sink (the stage itself included). A short branch is pushed right up against the module
  it feeds, so it warms up fewer microbatches.

Example: ``a`` (pp=2) and ``b`` (pp=1) feed ``llm`` (pp=2). ASAP: ``a`` = 0, 1; ``b`` = 0;
``llm`` = 2, 3; depth 4. ALAP moves ``b`` to 1. The 1F1B schedule bounds the microbatches a
stage holds in flight by ``depth - index``, so the numbering decides how many activations a
short branch stashes (see :mod:`lightning_mmpp.core.schedule`).

ALAP is the default everywhere (:data:`~lightning_mmpp.core.kinds.DEFAULT_NUMBERING`): the
schedules, the runtime, the planner and the placement table use it unless a caller passes
``numbering="asap"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering
from lightning_mmpp.errors import PipelineConfigError


@dataclass(frozen=True)
class StageNumbering:
    """Global stage indices of every (module, pp stage) under one pp assignment."""

    asap: Mapping[tuple[str, int], int]
    alap: Mapping[tuple[str, int], int]
    depth: int

    def index(self, module: str, stage: int, numbering: Numbering | str = DEFAULT_NUMBERING) -> int:
        """The global index of ``module``'s stage ``stage`` under ``numbering`` (ALAP by default)."""
        table = self.asap if Numbering.parse(numbering) is Numbering.ASAP else self.alap
        return table[(module, stage)]


class ModuleTopology:
    """A validated DAG ``{module: [downstream modules]}`` whose sinks hold the loss."""

    def __init__(self, edges: Mapping[str, Iterable[str]]) -> None:
        if not isinstance(edges, Mapping) or not edges:
            raise PipelineConfigError(
                "topology must be a non-empty dict {module: [downstream modules]}, "
                "e.g. {'vision': ['llm'], 'llm': []}."
            )
        downstream: dict[str, tuple[str, ...]] = {}
        for module, targets in edges.items():
            if not isinstance(module, str) or not module.isidentifier():
                raise PipelineConfigError(
                    f"topology key {module!r} is not a valid module name; use the name of the "
                    "LightningModule attribute that holds the module's layers."
                )
            if isinstance(targets, str):
                raise PipelineConfigError(
                    f"topology[{module!r}] is the string {targets!r}; give a list of downstream "
                    f"modules instead: {{{module!r}: [{targets!r}]}}."
                )
            try:
                targets = tuple(targets)
            except TypeError:
                targets = None
            if targets is None or not all(isinstance(t, str) for t in targets):
                raise PipelineConfigError(
                    f"topology[{module!r}] is {edges[module]!r}; give a list of downstream module names, "
                    f"[] for a sink: {{{module!r}: []}}."
                )
            if len(set(targets)) != len(targets):
                raise PipelineConfigError(
                    f"topology[{module!r}] lists a downstream module twice: {list(targets)}; list each "
                    f"downstream module once: {list(dict.fromkeys(targets))}."
                )
            downstream[module] = targets
        for module, targets in downstream.items():
            for target in targets:
                if target == module:
                    raise PipelineConfigError(
                        f"module {module!r} lists itself as downstream; remove {module!r} from topology[{module!r}]."
                    )
                if target not in downstream:
                    raise PipelineConfigError(
                        f"topology[{module!r}] names unknown module {target!r}; add {target!r} as a key of "
                        f"the topology (with its own downstream list, [] for a sink) or remove it."
                    )
        self._downstream = downstream
        self._upstream: dict[str, tuple[str, ...]] = {
            m: tuple(u for u in downstream if m in downstream[u]) for m in downstream
        }
        self._order = self._topological_order()  # a DAG always has a sink: no separate check

    def _topological_order(self) -> tuple[str, ...]:
        indegree = {m: len(self._upstream[m]) for m in self._downstream}
        position = {m: i for i, m in enumerate(self._downstream)}
        ready = [m for m in self._downstream if indegree[m] == 0]
        order: list[str] = []
        while ready:
            # the earliest-declared ready module: the order equals the declaration order
            # whenever that is already topological
            module = min(ready, key=position.__getitem__)
            ready.remove(module)
            order.append(module)
            for target in self._downstream[module]:
                indegree[target] -= 1
                if indegree[target] == 0:
                    ready.append(target)
        if len(order) != len(self._downstream):
            cycle = self._find_cycle({m for m in self._downstream if m not in order})
            raise PipelineConfigError(
                f"topology has a cycle: {' -> '.join(cycle)}; modules must form a DAG, so remove one of these edges."
            )
        return tuple(order)

    def _find_cycle(self, remaining: set[str]) -> list[str]:
        # Every module left over by Kahn's algorithm has an upstream module that is also left
        # over (a downstream one it may not have), so walk upstream until a module repeats.
        start = min(remaining, key=list(self._downstream).index)
        path = [start]
        seen = {start}
        current = start
        while True:
            current = next(u for u in self._upstream[current] if u in remaining)
            if current in seen:
                cycle = (path[path.index(current):] + [current])[::-1]  # downstream direction
                # start the cycle at its earliest-declared module, for a stable message
                ring = cycle[:-1]
                first = min(range(len(ring)), key=lambda i: list(self._downstream).index(ring[i]))
                ring = ring[first:] + ring[:first]
                return ring + [ring[0]]
            path.append(current)
            seen.add(current)

    # --- structure -------------------------------------------------------------------------

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules in declaration order."""
        return tuple(self._downstream)

    @property
    def order(self) -> tuple[str, ...]:
        """A topological order (sources first), stable with respect to declaration order."""
        return self._order

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(m for m in self._order if not self._upstream[m])

    @property
    def sinks(self) -> tuple[str, ...]:
        return tuple(m for m in self._order if not self._downstream[m])

    def downstream(self, module: str) -> tuple[str, ...]:
        return self._downstream[module]

    def upstream(self, module: str) -> tuple[str, ...]:
        """Upstream modules in declaration order."""
        return self._upstream[module]

    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple((u, d) for u in self._order for d in self._downstream[u])

    def no_backward_modules(self, frozen: Iterable[str]) -> frozenset[str]:
        """The modules that run no backward: frozen (no trainable parameter) with every upstream
        module also running none.

        A frozen module fed by a trainable one still runs a backward, to carry gradients
        through to it. The result is closed upstream: every upstream module of a member is a
        member, so no gradient ever has to reach one.
        """
        frozen = set(frozen)
        unknown = sorted(frozen - set(self._downstream))
        if unknown:
            raise ValueError(f"unknown module(s) {unknown}; the topology has {list(self._downstream)}")
        closed: set[str] = set()
        for module in self._order:
            if module in frozen and all(u in closed for u in self._upstream[module]):
                closed.add(module)
        return frozenset(closed)

    # --- stage numbering -------------------------------------------------------------------

    def stage_numbering(self, pp: Mapping[str, int]) -> StageNumbering:
        """Global stage indices (ASAP and ALAP) and the total depth for pp sizes ``pp``."""
        missing = [m for m in self._order if m not in pp]
        if missing:
            raise PipelineConfigError(f"no pp size given for module(s) {missing}.")
        start: dict[str, int] = {}
        for module in self._order:
            start[module] = max((start[u] + pp[u] for u in self._upstream[module]), default=0)
        depth = max(start[m] + pp[m] for m in self.sinks)
        tail: dict[str, int] = {}  # longest pp-weighted path from the module's first stage to a sink
        for module in reversed(self._order):
            tail[module] = pp[module] + max((tail[d] for d in self._downstream[module]), default=0)
        asap = {(m, s): start[m] + s for m in self._order for s in range(pp[m])}
        alap = {(m, s): depth - (tail[m] - s) for m in self._order for s in range(pp[m])}
        return StageNumbering(asap=asap, alap=alap, depth=depth)

    def __repr__(self) -> str:
        return f"ModuleTopology({ {m: list(d) for m, d in self._downstream.items()} })"
