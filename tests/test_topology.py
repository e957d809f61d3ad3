"""Unit tests for lightning_mmpp.core.topology: validation, order, stage numbering (single process)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.topology import ModuleTopology, StageNumbering


def config_error(edges) -> str:
    with pytest.raises(PipelineConfigError) as info:
        ModuleTopology(edges)
    return str(info.value)


# --- validation ------------------------------------------------------------------------------


def test_config_error_is_a_value_error():
    assert issubclass(PipelineConfigError, ValueError)


def test_cycle_of_two_modules_shows_the_path():
    msg = config_error({"a": ["b"], "b": ["a"]})
    assert "cycle: a -> b -> a" in msg
    assert "DAG" in msg and "remove one of these edges" in msg


def test_cycle_of_three_modules_shows_the_path():
    msg = config_error({"a": ["b"], "b": ["c"], "c": ["a"]})
    assert "cycle: a -> b -> c -> a" in msg
    assert "remove one of these edges" in msg


def test_cycle_path_starts_at_earliest_declared_module_of_the_cycle():
    msg = config_error({"c": ["a"], "a": ["b"], "b": ["c"]})
    assert "cycle: c -> a -> b -> c" in msg


def test_cycle_behind_a_source_names_only_the_cycle():
    msg = config_error({"src": ["x"], "x": ["y"], "y": ["x"]})
    assert "cycle: x -> y -> x" in msg
    assert "src" not in msg


def test_cycle_with_a_module_downstream_of_it():
    # Regression: the module 'a' below the cycle has no downstream module inside the cycle;
    # walking downstream from it used to leak a bare StopIteration instead of the message.
    msg = config_error({"x": ["y"], "y": ["x", "a"], "a": []})
    assert "cycle: x -> y -> x" in msg
    msg = config_error({"a": [], "x": ["y", "a"], "y": ["z"], "z": ["x"]})
    assert "cycle: x -> y -> z -> x" in msg


def test_unknown_downstream_module():
    msg = config_error({"vision": ["llm"]})
    assert "topology['vision'] names unknown module 'llm'" in msg
    assert "add 'llm' as a key" in msg and "[] for a sink" in msg


def test_self_loop():
    msg = config_error({"a": ["a"], "b": []})
    assert "module 'a' lists itself as downstream" in msg
    assert "remove 'a' from topology['a']" in msg


def test_string_instead_of_list():
    msg = config_error({"vision": "llm", "llm": []})
    assert "topology['vision'] is the string 'llm'" in msg
    assert "{'vision': ['llm']}" in msg


def test_duplicate_downstream():
    msg = config_error({"a": ["b", "c", "b"], "b": [], "c": []})
    assert "topology['a'] lists a downstream module twice" in msg
    assert "list each downstream module once: ['b', 'c']" in msg


@pytest.mark.parametrize("edges", [{}, [], None, [("a", [])]])
def test_empty_or_not_a_dict(edges):
    msg = config_error(edges)
    assert "non-empty dict" in msg and "{'vision': ['llm'], 'llm': []}" in msg


@pytest.mark.parametrize("name", ["my-module", "", "1st", "a b", 3, ("a",)])
def test_bad_module_name(name):
    msg = config_error({name: []})
    assert f"topology key {name!r} is not a valid module name" in msg
    assert "LightningModule attribute" in msg


@pytest.mark.parametrize("targets", [None, 3, ["b", 3], [["b"]]])
def test_downstream_that_is_not_a_list_of_names(targets):
    msg = config_error({"a": targets, "b": []})
    assert f"topology['a'] is {targets!r}" in msg
    assert "list of downstream module names" in msg and "{'a': []}" in msg


def test_any_iterable_of_names_is_accepted():
    topo = ModuleTopology({"a": ("b",), "b": iter(["c"]), "c": set()})
    assert topo.order == ("a", "b", "c")
    assert topo.downstream("b") == ("c",)


def test_stage_numbering_needs_every_pp():
    topo = ModuleTopology({"a": ["b"], "b": []})
    with pytest.raises(PipelineConfigError, match=re.escape("no pp size given for module(s) ['b']")):
        topo.stage_numbering({"a": 1})


# --- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edges",
    [
        {"a": []},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
        {"b": ["c"], "a": [], "c": []},
        {"s1": ["x"], "s2": ["y"], "y": [], "x": []},
        {"z": ["y", "x"], "y": ["x"], "x": []},
        {"p": [], "q": ["r"], "r": [], "s": []},
    ],
)
def test_order_equals_declaration_order_when_that_is_topological(edges):
    topo = ModuleTopology(edges)
    assert topo.order == tuple(edges)
    assert topo.modules == tuple(edges)


@pytest.mark.parametrize(
    "edges, order",
    [
        ({"llm": [], "vision": ["llm"]}, ("vision", "llm")),
        ({"llm": [], "audio": ["llm"], "vision": ["llm"]}, ("audio", "vision", "llm")),
        ({"c": [], "b": ["c"], "a": ["b"]}, ("a", "b", "c")),
        # Declared sinks first: each step takes the earliest-declared ready module.
        ({"x": [], "y": [], "a": ["y"], "b": ["x"]}, ("a", "y", "b", "x")),
        ({"d": [], "m": ["d"], "s2": ["m"], "s1": ["m"]}, ("s2", "s1", "m", "d")),
    ],
)
def test_order_is_topological_and_stable(edges, order):
    topo = ModuleTopology(edges)
    assert topo.order == order
    assert topo.modules == tuple(edges)


def test_sources_sinks_upstream_downstream():
    topo = ModuleTopology(
        {"vision": ["llm"], "audio": ["llm", "aux"], "llm": ["gen", "head"], "aux": [], "gen": [], "head": []}
    )
    assert topo.sources == ("vision", "audio")
    assert topo.sinks == ("aux", "gen", "head")
    assert topo.upstream("llm") == ("vision", "audio")
    assert topo.upstream("vision") == ()
    assert topo.upstream("aux") == ("audio",)
    assert topo.downstream("audio") == ("llm", "aux")
    assert topo.downstream("gen") == ()
    assert topo.edges() == (
        ("vision", "llm"),
        ("audio", "llm"),
        ("audio", "aux"),
        ("llm", "gen"),
        ("llm", "head"),
    )


def test_upstream_is_in_declaration_order():
    topo = ModuleTopology({"llm": [], "b": ["llm"], "a": ["llm"]})
    assert topo.upstream("llm") == ("b", "a")


def test_single_module_is_source_and_sink():
    topo = ModuleTopology({"m": []})
    assert topo.sources == topo.sinks == topo.order == ("m",)


def test_repr():
    assert repr(ModuleTopology({"a": ("b",), "b": []})) == "ModuleTopology({'a': ['b'], 'b': []})"


# --- stage numbering -------------------------------------------------------------------------


def test_design_example_asap_and_alap():
    topo = ModuleTopology({"a": ["llm"], "b": ["llm"], "llm": []})
    n = topo.stage_numbering({"a": 2, "b": 1, "llm": 2})
    assert isinstance(n, StageNumbering)
    assert n.depth == 4
    assert n.asap == {("a", 0): 0, ("a", 1): 1, ("b", 0): 0, ("llm", 0): 2, ("llm", 1): 3}
    assert n.alap == {("a", 0): 0, ("a", 1): 1, ("b", 0): 1, ("llm", 0): 2, ("llm", 1): 3}
    assert n.index("b", 0) == 1  # ALAP: the numbering the schedules and the runtime use
    assert n.index("b", 0, "asap") == n.index("b", 0, Numbering.ASAP) == 0
    assert n.index("b", 0, "alap") == 1


def test_alap_is_the_one_default_numbering():
    assert DEFAULT_NUMBERING is Numbering.ALAP and DEFAULT_NUMBERING == "alap"
    n = ModuleTopology({"a": ["llm"], "b": ["llm"], "llm": []}).stage_numbering({"a": 2, "b": 1, "llm": 2})
    assert n.index("b", 0) == n.index("b", 0, DEFAULT_NUMBERING) == n.alap[("b", 0)]
    with pytest.raises(PipelineConfigError, match=r"unknown stage numbering 'middle'; choose one of \['alap', 'asap'\]"):
        n.index("b", 0, "middle")


def test_single_module():
    n = ModuleTopology({"m": []}).stage_numbering({"m": 3})
    assert n.depth == 3
    assert n.asap == n.alap == {("m", 0): 0, ("m", 1): 1, ("m", 2): 2}


def test_chain_of_three_modules():
    n = ModuleTopology({"a": ["b"], "b": ["c"], "c": []}).stage_numbering({"a": 1, "b": 2, "c": 3})
    assert n.depth == 6
    expected = {("a", 0): 0, ("b", 0): 1, ("b", 1): 2, ("c", 0): 3, ("c", 1): 4, ("c", 2): 5}
    assert n.asap == expected
    assert n.alap == expected  # a chain has no slack


def test_diamond():
    # s -> l (pp=3) -> t ; s -> r (pp=1) -> t
    topo = ModuleTopology({"s": ["l", "r"], "l": ["t"], "r": ["t"], "t": []})
    n = topo.stage_numbering({"s": 1, "l": 3, "r": 1, "t": 2})
    assert n.depth == 6
    assert n.asap == {("s", 0): 0, ("l", 0): 1, ("l", 1): 2, ("l", 2): 3, ("r", 0): 1, ("t", 0): 4, ("t", 1): 5}
    # the short branch r is pushed right before t
    assert n.alap == {("s", 0): 0, ("l", 0): 1, ("l", 1): 2, ("l", 2): 3, ("r", 0): 3, ("t", 0): 4, ("t", 1): 5}


def test_diamond_with_two_sources():
    topo = ModuleTopology({"v": ["llm"], "a": ["enc"], "enc": ["llm"], "llm": []})
    n = topo.stage_numbering({"v": 1, "a": 2, "enc": 1, "llm": 1})
    assert n.depth == 4
    assert n.asap == {("v", 0): 0, ("a", 0): 0, ("a", 1): 1, ("enc", 0): 2, ("llm", 0): 3}
    assert n.alap == {("v", 0): 2, ("a", 0): 0, ("a", 1): 1, ("enc", 0): 2, ("llm", 0): 3}


def test_multiple_sinks_depth_is_longest_path_to_any_sink():
    # a feeds a long sink b (pp=3) and a short sink c (pp=1)
    topo = ModuleTopology({"a": ["b", "c"], "b": [], "c": []})
    n = topo.stage_numbering({"a": 1, "b": 3, "c": 1})
    assert n.depth == 4
    assert n.asap == {("a", 0): 0, ("b", 0): 1, ("b", 1): 2, ("b", 2): 3, ("c", 0): 1}
    assert n.alap == {("a", 0): 0, ("b", 0): 1, ("b", 1): 2, ("b", 2): 3, ("c", 0): 3}


def test_alap_of_stages_on_a_short_sink_branch():
    topo = ModuleTopology({"a": ["b", "c"], "b": [], "c": []})
    n = topo.stage_numbering({"a": 2, "b": 1, "c": 3})
    assert n.depth == 5
    assert [n.asap[("b", 0)], n.alap[("b", 0)]] == [2, 4]
    assert [n.alap[("c", s)] for s in range(3)] == [2, 3, 4]
    assert [n.alap[("a", s)] for s in range(2)] == [0, 1]


def test_disconnected_modules():
    n = ModuleTopology({"a": [], "b": []}).stage_numbering({"a": 3, "b": 1})
    assert n.depth == 3
    assert n.asap[("b", 0)] == 0 and n.alap[("b", 0)] == 2


def test_sink_fed_by_a_middle_module_and_a_source():
    # x -> y -> z and x -> z: z waits for the longer path
    n = ModuleTopology({"x": ["y", "z"], "y": ["z"], "z": []}).stage_numbering({"x": 2, "y": 2, "z": 1})
    assert n.depth == 5
    assert n.asap[("z", 0)] == 4 == n.alap[("z", 0)]


# --- properties on random DAGs ---------------------------------------------------------------


@st.composite
def random_dags(draw):
    n = draw(st.integers(2, 6))
    names = [f"m{i}" for i in range(n)]
    edges = {m: [names[j] for j in range(i + 1, n) if draw(st.booleans())] for i, m in enumerate(names)}
    perm = draw(st.permutations(names))  # declaration order need not be topological
    pp = {m: draw(st.integers(1, 3)) for m in names}
    return {m: edges[m] for m in perm}, pp


@settings(max_examples=100, deadline=None, database=None)
@given(random_dags())
def test_random_dag_order_and_numbering(data):
    edges, pp = data
    topo = ModuleTopology(edges)
    position = {m: i for i, m in enumerate(edges)}
    order = topo.order
    assert sorted(order) == sorted(edges)
    where = {m: i for i, m in enumerate(order)}
    for u, d in topo.edges():
        assert where[u] < where[d]
    # stable: every step takes the earliest-declared module whose upstream modules are done
    done: set[str] = set()
    for m in order:
        ready = [x for x in edges if x not in done and all(u in done for u in topo.upstream(x))]
        assert m == min(ready, key=position.__getitem__)
        done.add(m)
    if all(where[m] == position[m] for m in edges):
        assert order == tuple(edges)
    assert topo.sources == tuple(m for m in order if not topo.upstream(m))
    assert topo.sinks == tuple(m for m in order if not topo.downstream(m))
    for m in edges:
        assert topo.upstream(m) == tuple(u for u in edges if m in edges[u])

    n = topo.stage_numbering(pp)
    assert set(n.asap) == set(n.alap) == {(m, s) for m in edges for s in range(pp[m])}
    for key in n.asap:
        assert 0 <= n.asap[key] <= n.alap[key] < n.depth
    for m in edges:
        for s in range(1, pp[m]):
            assert n.asap[(m, s)] == n.asap[(m, s - 1)] + 1
            assert n.alap[(m, s)] == n.alap[(m, s - 1)] + 1
    for u, d in topo.edges():
        assert n.asap[(d, 0)] >= n.asap[(u, pp[u] - 1)] + 1
        assert n.alap[(d, 0)] >= n.alap[(u, pp[u] - 1)] + 1
    for m in topo.sources:
        assert n.asap[(m, 0)] == 0
    for m in topo.sinks:
        assert n.alap[(m, pp[m] - 1)] == n.depth - 1
    assert n.depth == max(n.asap[(m, pp[m] - 1)] for m in topo.sinks) + 1


# --- which modules run a backward ---------------------------------------------------------------


def test_no_backward_modules_closed_upstream():
    # enc_a (frozen) and enc_b feed proj (frozen, a middle module), which feeds llm
    topo = ModuleTopology({"enc_a": ["proj"], "enc_b": ["proj"], "proj": ["llm"], "llm": []})
    assert topo.no_backward_modules(set()) == frozenset()
    assert topo.no_backward_modules({"enc_a"}) == {"enc_a"}
    # a frozen middle module with a trainable upstream module still runs its backward
    assert topo.no_backward_modules({"proj"}) == frozenset()
    assert topo.no_backward_modules({"enc_a", "proj"}) == {"enc_a"}
    # with everything upstream frozen as well, it runs none
    assert topo.no_backward_modules({"enc_a", "enc_b", "proj"}) == {"enc_a", "enc_b", "proj"}
    assert topo.no_backward_modules(topo.modules) == frozenset(topo.modules)
    with pytest.raises(ValueError, match="unknown module"):
        topo.no_backward_modules({"vision"})


@settings(max_examples=100, deadline=None, database=None)
@given(st.data())
def test_no_backward_modules_random(data):
    n = data.draw(st.integers(1, 7))
    names = [f"m{i}" for i in range(n)]
    edges = {m: [names[j] for j in range(i + 1, n) if data.draw(st.booleans())] for i, m in enumerate(names)}
    topo = ModuleTopology(edges)
    frozen = {m for m in names if data.draw(st.booleans())}
    result = topo.no_backward_modules(frozen)

    def trainable_ancestor(module: str) -> bool:
        return any(u not in frozen or trainable_ancestor(u) for u in topo.upstream(module))

    assert result == {m for m in frozen if not trainable_ancestor(m)}
    assert all(set(topo.upstream(m)) <= result for m in result)  # closed upstream
