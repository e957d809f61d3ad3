"""Schedule benchmark on the simulator's virtual clock (no processes, runs in seconds).

    python benchmarks/bench_schedule.py

Every number comes from :func:`lightning_mmpp.core.simulator.simulate`; ratios compare schedules
measured in this one run. Costs are per (module, stage) and microbatch: forward ``tf``,
backward ``tb`` (1 and 2 unless a table says otherwise), no transfer latency.

Two completion models for exchanges (see the simulator): ``eager`` (sends are buffered; the
timing model of gloo / NCCL) and ``rendezvous`` (a send waits for its receive; the strict
model used to prove deadlock freedom). Step times below are eager unless marked ``rdv``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from collections.abc import Iterator, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout  # noqa: E402
from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering, ScheduleName, SimulatorMode  # noqa: E402
from lightning_mmpp.core.schedule import PhaseCosts, ZeroBubbleMemory, build_schedule  # noqa: E402
from lightning_mmpp.core.simulator import SimulationResult, simulate  # noqa: E402

from common import chain, section, two_encoders  # noqa: E402
from common import table as common_table  # noqa: E402

P = ModulePlacement
TF, TB = 1.0, 2.0
VIRTUAL_CHOICES = (1, 2, 2, 3)  # virtual_stages of a random module: 1, 2 (twice as likely) or 3


def vision_audio() -> PipelineLayout:
    """vision (dp=2) and audio (dp=1) -> llm (pp=2): ranks 0-1 vision, 2 audio, 3-4 llm."""
    return PipelineLayout(
        {"vision": P(dp=2), "audio": P(dp=1), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )


def two_heads() -> PipelineLayout:
    """enc -> head (a sink) and enc + vis (pp=2) -> llm; aux -> head. A small layout, found by a
    random search, where ALAP costs step time."""
    return PipelineLayout(
        {"enc": P(), "aux": P(), "head": P(), "vis": P(pp=2), "llm": P()},
        {"enc": ["head", "llm"], "aux": ["head"], "head": [], "vis": ["llm"], "llm": []},
    )


def random_placements(
    rng: random.Random, virtual_stages: Sequence[int] = (1,)
) -> tuple[dict[str, ModulePlacement], dict[str, list[str]]]:
    """A random DAG of 2-6 modules, pp 1-3, dp in {1, 2, 4}, some modules colocated; each
    module's virtual_stages drawn from ``virtual_stages`` (no draw when there is one choice)."""
    n = rng.randint(2, 6)
    names = [f"m{i}" for i in range(n)]
    topology = {m: [names[j] for j in range(i + 1, n) if rng.random() < 0.5] for i, m in enumerate(names)}
    groups: list[list[str]] = []
    sizes: list[tuple[int, int]] = []
    for name in names:
        if groups and rng.random() < 0.25:
            rng.choice(groups).append(name)
        else:
            groups.append([name])
            sizes.append((rng.randint(1, 3), rng.choice([1, 2, 4])))
    order = list(range(len(groups)))
    rng.shuffle(order)
    placements, cursor = {}, 0
    for g in order:
        pp, dp = sizes[g]
        for name in groups[g]:
            v = rng.choice(virtual_stages) if len(virtual_stages) > 1 else virtual_stages[0]
            placements[name] = P(pp=pp, dp=dp, rank_offset=cursor, virtual_stages=v)
        cursor += pp * dp
    return placements, topology


SCHEDULE_KINDS = ("1f1b", "gpipe", "zero_bubble", "interleaved_1f1b", "zbv")


def schedule_cases(
    rng: random.Random, layouts: int, max_microbatches: int
) -> Iterator[tuple[PipelineLayout, int, str, frozenset[str]]]:
    """``(layout, m, kind, no_backward_modules)`` for every schedule kind on ``layouts`` random
    DAGs with virtual stages (m from 1 to ``max_microbatches``), each plain, with V-shaped chunks
    and with some modules frozen: the family the schedule builders are timed and pinned on."""
    for _ in range(layouts):
        placements, topology = random_placements(rng, VIRTUAL_CHOICES)
        m = rng.randint(1, max_microbatches)
        frozen = rng.sample(sorted(placements), rng.randint(0, len(placements) - 1))
        for v_shape, chosen in ((False, ()), (True, ()), (False, frozen)):
            layout = PipelineLayout(placements, topology, v_shape=v_shape)
            no_backward = layout.no_backward_modules(chosen)
            for kind in SCHEDULE_KINDS:
                yield layout, m, kind, no_backward


def random_layout(rng: random.Random) -> PipelineLayout:
    """A random DAG of 2-6 modules, pp 1-3, dp in {1, 2, 4}, some modules colocated."""
    return PipelineLayout(*random_placements(rng))


def run(layout, m, name=ScheduleName.ONE_F_ONE_B, numbering=DEFAULT_NUMBERING, mode=SimulatorMode.EAGER, tf=TF,
        tb=TB) -> SimulationResult:
    return simulate(build_schedule(layout, m, name, numbering=numbering), layout, tf, tb, mode=mode)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """common.table, with whole virtual-clock times printed without decimals."""
    return common_table(headers, [[int(v) if isinstance(v, float) and v.is_integer() else v for v in r] for r in rows])


def bench_chain() -> None:
    pp = 4
    section(f"(a) chain pp={pp}, tf={TF:g}, tb={TB:g}: step time vs ideal (m+P-1)(tf+tb)")
    rows = []
    exact = True
    for m in (4, 8, 16):
        ideal = (m + pp - 1) * (TF + TB)
        for name in (ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE):
            eager = run(chain(pp), m, name)
            rdv = run(chain(pp), m, name, mode=SimulatorMode.RENDEZVOUS)
            exact &= eager.step_time == ideal == rdv.step_time
            rows.append((
                m, name, ideal, eager.step_time, eager.step_time / ideal, rdv.step_time / ideal,
                eager.bubble_fraction, (pp - 1) / (m + pp - 1), eager.peak_stashed,
            ))
    print(table(
        ["m", "schedule", "ideal", "step", "step/ideal", "rdv/ideal", "bubble", "(P-1)/(m+P-1)", "peak stash/rank"],
        rows,
    ))
    print(
        f"-> both schedules {'hit' if exact else 'MISS'} the ideal in both completion models; the bubble is "
        "the textbook (P-1)/(m+P-1). 1F1B stashes min(m, P-s) microbatches on stage s, GPipe m on every "
        "stage: same time, 1F1B's memory does not grow with m."
    )


def bench_numbering() -> None:
    m = 8
    section(f"(b) stage numbering ASAP vs ALAP, 1F1B, m={m}")
    costs = {
        "uniform": (TF, TB),
        # llm stages three times as expensive as encoder stages
        "llm x3": (lambda mod, s: TF * (3 if mod == "llm" else 1), lambda mod, s: TB * (3 if mod == "llm" else 1)),
    }
    rows = []
    verdict = []
    for label, make in (("two_encoders", two_encoders), ("vision_audio", vision_audio), ("two_heads", two_heads)):
        layout = make()
        for cost_name, (tf, tb) in costs.items():
            res = {}
            for numbering in (Numbering.ASAP, Numbering.ALAP):
                eager = run(layout, m, numbering=numbering, tf=tf, tb=tb)
                rdv = run(layout, m, numbering=numbering, tf=tf, tb=tb, mode=SimulatorMode.RENDEZVOUS)
                res[numbering] = (eager, rdv)
                rows.append((
                    label, cost_name, numbering, eager.step_time, rdv.step_time,
                    eager.bubble_fraction, eager.peak_stashed, sum(eager.peak_stashed),
                ))
            (ae, ar), (le, lr) = res["asap"], res["alap"]
            verdict.append((label, cost_name, le.step_time / ae.step_time, lr.step_time / ar.step_time,
                            sum(le.peak_stashed) / sum(ae.peak_stashed)))
    print("ranks: two_encoders = enc_a s0, enc_a s1, enc_b, llm s0, llm s1;"
          " vision_audio = vision r0, vision r1, audio, llm s0, llm s1;"
          " two_heads = enc, aux, head, vis s0, vis s1, llm")
    print(table(["layout", "costs", "numbering", "step", "rdv step", "bubble", "peak stash/rank", "total"], rows))
    print()
    print(table(["layout", "costs", "ALAP/ASAP step", "ALAP/ASAP rdv", "ALAP/ASAP stash"],
                [(a, b, c, d, e) for a, b, c, d, e in verdict]))
    print(
        "-> two_encoders: ALAP moves enc_b from global stage 0 to 1, so it stashes one microbatch less "
        f"(ALAP/ASAP total stash {verdict[0][4]:.3f}) at the same step time (ratio {verdict[0][2]:.3f}). "
        "vision_audio: both encoders have pp=1, so the two numberings coincide (dp does not enter the "
        "numbering); identical rows are expected. two_heads: the counter-example, where ALAP throttles enc "
        f"and aux to a warmup of 2 and the step gets slower (ratio {verdict[4][2]:.3f}) while saving stash "
        f"(ratio {verdict[4][4]:.3f})."
    )

    n, m_max = 200, 9
    rng = random.Random(0)
    time_ratios, stash_ratios = [], []
    for _ in range(n):
        layout = random_layout(rng)
        m = rng.randint(1, m_max)
        asap = run(layout, m, numbering=Numbering.ASAP)
        alap = run(layout, m, numbering=Numbering.ALAP)
        time_ratios.append(alap.step_time / asap.step_time)
        stash_ratios.append(sum(alap.peak_stashed) / sum(asap.peak_stashed))
    print()
    print(f"random DAGs (seed 0, {n} layouts, 2-6 modules, pp 1-3, dp 1/2/4, some colocated, m 1-{m_max}), "
          "ALAP / ASAP, eager, uniform costs:")
    rows = []
    for label, ratios in (("step time", time_ratios), ("total stash", stash_ratios)):
        rows.append((
            label, sum(r < 1 - 1e-9 for r in ratios), sum(abs(r - 1) <= 1e-9 for r in ratios),
            sum(r > 1 + 1e-9 for r in ratios), min(ratios), sum(ratios) / n, max(ratios),
        ))
    print(table(["ALAP/ASAP", "lower", "equal", "higher", "min", "mean", "max"], rows))
    t = rows[0]
    print(
        f"-> ALAP {'never stashes more' if rows[1][6] <= 1 + 1e-9 else 'sometimes stashes MORE'} in total "
        f"(max ratio {rows[1][6]:.3f}); its step time equals ASAP's in "
        f"{t[2]}/{n} layouts, is lower in {t[1]} and higher in {t[3]} (worst {t[6]:.3f}, mean {t[5]:.4f}). "
        "ALAP stays the default for the memory it saves; a layout where the step-time loss matters can "
        "pass numbering='asap'."
    )


def bench_memory() -> None:
    section("(c) memory: peak stashed microbatches per rank, 1F1B (ALAP) vs GPipe, two_encoders")
    rows = []
    for m in (4, 8, 16):
        layout = two_encoders()
        f = run(layout, m, "1f1b")
        g = run(layout, m, "gpipe")
        rows.append((m, f.peak_stashed, g.peak_stashed, sum(f.peak_stashed), sum(g.peak_stashed),
                     sum(f.peak_stashed) / sum(g.peak_stashed), f.step_time, g.step_time, f.step_time / g.step_time))
    print("ranks: enc_a s0, enc_a s1, enc_b, llm s0, llm s1 (depth 4)")
    print(table(["m", "1f1b stash", "gpipe stash", "1f1b total", "gpipe total", "1f1b/gpipe",
                 "1f1b step", "gpipe step", "step ratio"], rows))
    same_time = all(r[-1] == 1.0 for r in rows)
    print(
        f"-> 1F1B holds at most depth - index microbatches per stage ({' '.join(map(str, rows[-1][1]))} with "
        "ALAP), independent of m; GPipe holds all m on every rank, so the ratio falls as 1/m"
        + (" at equal step time." if same_time else "; the step times differ (last column).")
    )


ZB_RULES = {
    "zb max": ZeroBubbleMemory("max"),
    "zb max w=0.5": ZeroBubbleMemory("max", weight_fraction=0.5),
    "zb stage": ZeroBubbleMemory("stage"),
    "zb stage w=0.5": ZeroBubbleMemory("stage", weight_fraction=0.5),
}


def zero_bubble_rows(layout: PipelineLayout, m: int) -> dict[str, SimulationResult]:
    """1F1B and every zero-bubble memory rule on ``layout``, costs F = I = W = 1 (fused B = 2)."""
    out = {"1f1b": simulate(build_schedule(layout, m, "1f1b"), layout, 1.0, 2.0, mode=SimulatorMode.EAGER)}
    for label, memory in ZB_RULES.items():
        schedule = build_schedule(layout, m, "zero_bubble", memory=memory)
        out[label] = simulate(schedule, layout, 1.0, 2.0, mode=SimulatorMode.EAGER, weight_stash=memory.weight_fraction)
    return out


def bench_zero_bubble() -> None:
    m = 8
    section(f"(d) zero bubble vs 1F1B, F = I = W = 1 (fused B = 2), m={m}, eager")
    print("bubble = step - busiest rank's compute; stash = peak microbatches held per rank (F until its last "
          "backward piece); 'units' weighs a microbatch between its I and its W by w")
    layouts = {"chain P=4": chain(4), "two_encoders": two_encoders(), "vision_audio": vision_audio(),
               "two_heads": two_heads()}
    rows = []
    ratios: dict[str, list[float]] = {label: [] for label in ZB_RULES}
    for name, layout in layouts.items():
        res = zero_bubble_rows(layout, m)
        base = res["1f1b"]
        for label, r in res.items():
            ratio = r.bubble / base.bubble if base.bubble else 1.0
            if label != "1f1b":
                ratios[label].append(ratio)
            rows.append((name, label, r.step_time, r.bubble, r.step_time / base.step_time, ratio, r.peak_stashed,
                         max(r.peak_stash_units)))
    print(table(["layout", "schedule", "step", "bubble", "step/1f1b", "bubble/1f1b", "stash per rank",
                 "max units"], rows))

    n, m_max = 200, 9
    rng = random.Random(0)
    stats: dict[str, dict[str, list[float]]] = {
        label: {"bubble": [], "step": [], "stash": [], "over_bound": []} for label in ZB_RULES
    }
    for _ in range(n):
        layout = random_layout(rng)
        mm = rng.randint(1, m_max)
        res = zero_bubble_rows(layout, mm)
        base = res["1f1b"]
        for label in ZB_RULES:
            r = res[label]
            stats[label]["bubble"].append(r.bubble / base.bubble if base.bubble > 1e-9 else 1.0)
            stats[label]["step"].append(r.step_time / base.step_time)
            stats[label]["stash"].append(max(r.peak_stash_units) / max(base.peak_stashed))
            stats[label]["over_bound"].append(max(r.peak_stash_units) > one_f_one_b_bound(layout, mm) + 1e-9)
    print()
    print(f"random DAGs (seed 0, {n} layouts as in (b), m 1-{m_max}) and the four layouts above (m={m}):")
    rows = []
    for label in ZB_RULES:
        st = stats[label]
        rows.append((label, sum(ratios[label]) / len(ratios[label]), sum(st["bubble"]) / n, max(st["bubble"]),
                     sum(st["step"]) / n, max(st["step"]), sum(x > 1 + 1e-9 for x in st["step"]),
                     sum(st["stash"]) / n, max(st["stash"]), sum(st["over_bound"])))
    print(table(["rule", "layouts: bubble/1f1b", "random: mean bubble/1f1b", "max", "mean step/1f1b", "max",
                 "slower than 1f1b", "worst-rank stash/1f1b mean", "max", "over 1f1b bound"], rows))
    best = rows[0]
    print(f"-> the default rule (ZB-H1, 'max') keeps {best[1]:.2f} of 1F1B's bubble on the four layouts and "
          f"{best[2]:.2f} on average over the random DAGs; its step was longer than 1F1B's in {best[6]} of {n}. "
          f"Its worst rank holds no more than 1F1B's bound for its worst rank (sum of min(m, depth - index); "
          f"exceeded in {best[9]} of {n}), on average {best[7]:.3f}x what 1F1B's worst rank held in the "
          f"simulation (up to {best[8]:.2f}x where 1F1B stays below its bound). 'stage' keeps each unit at its "
          "own 1F1B bound and removes less of the bubble.")


def one_f_one_b_bound(layout: PipelineLayout, m: int) -> int:
    """1F1B's bound on the microbatches its fullest rank holds: sum of min(m, depth - index)."""
    return max(
        sum(min(m, layout.depth - layout.stage_index(s.module, s.stage)) for s in layout.slots(rank))
        for rank in range(layout.world_size)
    )


def bench_virtual_stages() -> None:
    """interleaved_1f1b and zbv against 1F1B: the 4-stage chain of the issue and random DAGs."""
    section("virtual stages: interleaved_1f1b and zbv against 1f1b (simulator, eager)")
    equal = PhaseCosts(forward=1.0, input=0.5, weight=0.5)  # F = B, I = W = B / 2
    rows, results = [], {}
    for name, v in (("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2), ("zbv", 2)):
        layout = PipelineLayout({"a": P(pp=4, virtual_stages=v)}, {"a": []}, v_shape=name == "zbv")
        r = simulate(build_schedule(layout, 8, name, costs=equal), layout, 1.0, 1.0, mode=SimulatorMode.EAGER)
        results[name] = r
        rows.append((name, v, r.step_time, r.bubble, r.bubble / results["1f1b"].bubble, max(r.peak_stash_units),
                     r.peak_stash_units))
    print("chain pp=4, m=8, F = B (I = W = B/2), costs of a whole stage (a chunk costs 1/v):")
    print(table(["schedule", "v", "step", "bubble", "bubble/1f1b", "fullest rank (stages' mb)", "per rank"], rows))
    print(f"-> interleaved_1f1b keeps {rows[2][4]:.3f} of 1F1B's bubble (issue: <= 1/2), zbv {rows[3][4]:.3f} "
          f"(issue: <= 1/3) holding at most {rows[3][5]:.2f} stages' microbatches on a rank (1F1B's fullest: "
          f"{rows[0][5]:.2f}).")
    n, m_max = 200, 9
    rng = random.Random(0)
    ratios: dict[str, list[float]] = {"interleaved_1f1b": [], "zbv": []}
    same: list[float] = []  # interleaved_1f1b / 1f1b, both on the virtual layout
    longer: list[int] = []
    for i in range(n):
        placements, topology = random_placements(rng, VIRTUAL_CHOICES)
        m = rng.randint(1, m_max)
        plain = PipelineLayout({k: dataclasses.replace(p, virtual_stages=1) for k, p in placements.items()}, topology)
        base = run(plain, m).step_time
        for name in ratios:
            layout = PipelineLayout(placements, topology, v_shape=name == "zbv")
            step = run(layout, m, name).step_time
            ratios[name].append(step / base)
            if name == "interleaved_1f1b":
                same.append(step / run(layout, m).step_time)
                if step > base + 1e-9:
                    longer.append(i)
    print()
    print(f"random DAGs (seed 0, {n} layouts as above, virtual_stages from {VIRTUAL_CHOICES}, m 1-{m_max}, "
          "F=1 B=2): step / 1F1B's step on the same placements without virtual stages (the last row: on the "
          "same layout, virtual stages included)")
    rows = [(name, *counts(r)) for name, r in ratios.items()]
    rows.append(("interleaved_1f1b / 1f1b on the virtual layout", *counts(same)))
    print(table(["schedule", "shorter", "equal", "longer", "min", "mean", "max"], rows))
    print(f"interleaved_1f1b longer than 1F1B without virtual stages on layouts {longer}; "
          "python benchmarks/bound_schedule.py checks whether any schedule of those layouts can match 1F1B.")


def counts(ratios: Sequence[float]) -> tuple[int, int, int, float, float, float]:
    """How many ratios are below, at and above 1, and their min, mean and max."""
    return (sum(x < 1 - 1e-9 for x in ratios), sum(abs(x - 1) <= 1e-9 for x in ratios),
            sum(x > 1 + 1e-9 for x in ratios), min(ratios), sum(ratios) / len(ratios), max(ratios))


def main() -> None:
    print("$ python benchmarks/bench_schedule.py")
    bench_chain()
    bench_numbering()
    bench_memory()
    bench_zero_bubble()
    bench_virtual_stages()


if __name__ == "__main__":
    main()
