"""The schedules the builders produce, pinned: a change to how a schedule is built (a faster
builder, a refactor) must not change a single action unless it means to.

The layouts are the benchmark's random DAG family (``benchmarks/bench_schedule.py``), with
virtual stages, V-shaped chunks and frozen modules; every schedule kind is built on each and the
text of every rank's actions is hashed. A deliberate change of a schedule updates ``DIGEST``
(print it with ``python tests/test_schedule_golden.py``) and says why in its commit.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_schedule import schedule_cases  # noqa: E402

from lightning_mmpp.core.schedule import build_schedule  # noqa: E402

DIGEST = "7ea463f3cb51bd416a19d1fe951ccd522933b53d2129eeac663e4a00460d8286"


def schedules_digest(layouts: int = 6, seed: int = 2026) -> str:
    """sha256 over the actions of every schedule kind on ``layouts`` random layouts, each plain,
    V-shaped and with some modules frozen (an error a builder raises is hashed by its type)."""
    digest = hashlib.sha256()
    for layout, m, name, no_backward in schedule_cases(random.Random(seed), layouts, max_microbatches=6):
        try:
            schedule = build_schedule(layout, m, name, no_backward_modules=no_backward)
        except Exception as err:  # noqa: BLE001 - which layouts a kind refuses is pinned too
            digest.update(f"{name}: {type(err).__name__}\n".encode())
            continue
        for rank, actions in enumerate(schedule.actions):
            digest.update(f"{name} {rank}: {' '.join(str(a) for a in actions)}\n".encode())
    return digest.hexdigest()


def test_the_builders_produce_the_pinned_schedules():
    assert schedules_digest() == DIGEST


if __name__ == "__main__":
    print(schedules_digest())
