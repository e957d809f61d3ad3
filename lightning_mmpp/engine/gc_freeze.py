"""Keep Python's cyclic garbage collector off the objects that live for the whole run.

A training process holds hundreds of thousands of long-lived Python objects by the time its
first step runs: the model's modules and parameters, Lightning's trainer, loops and callbacks,
torch's and the engine's bookkeeping (410,000 once torch, Lightning and the README example's
model are imported and built, before the Trainer adds its own). Every full (oldest-generation) collection walks all of them, and the
interpreter starts one whenever enough objects have survived the younger collections, which a
step's autograd graphs, payload dicts and metric tensors bring about sooner or later. Such a
collection stops its rank, and every peer waits for it at the next exchange. The step's median
does not move; its mean does. Measured on the README example (2 ranks on a 2-core VM, through
``Trainer.fit``, ``benchmarks/bench_gc.py``):

* 60 steps: each rank paused once for 300-315 ms (350 ms in a 400-step run). The step from
  start to start took 20.2-21.1 ms with the collector as it was, against 10.4-11.4 ms with this
  freeze.
* 390 steps: 12.9 ms against 11.7 ms.
* Pure dp at batch 256: no full collection ran in 190 steps, and the freeze changed nothing.

:class:`FrozenHeap` collects the young generations and then freezes (:func:`gc.freeze`): the objects alive at that
point move to the permanent generation, which no collection walks, and collections keep running
on what the steps create. :meth:`FrozenHeap.release` unfreezes them at the end of the run, so they
can be collected again. The freeze is process-wide. Where something else has frozen objects
already (a parent that froze before forking), :class:`FrozenHeap` leaves the process as it
found it and does nothing. torchtitan takes another road to the same end: it disables automatic
collection and collects the young generation every N steps.
"""

from __future__ import annotations

import gc

__all__ = ["FrozenHeap"]

# collected before the freeze: the young generations only. A full collection walks, and writes
# the collector's header of, every object in the process; in a rank forked from a parent (the
# test suite's, ``start_method="fork"``) that copies every page of the parent's heap the rank
# shares: test_equivalence.py took 72 s with a full collection before each fit's freeze, against
# 33 s with none. Garbage already in the oldest generation when training starts is frozen with
# the rest until teardown.
YOUNG_GENERATIONS = 1


class FrozenHeap:
    """Freeze the objects alive now (:meth:`freeze`), unfreeze them later (:meth:`release`);
    both idempotent. Not thread-safe: call from the main thread."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> bool:
        """Collect the young generations, then freeze every object alive; ``False`` (and
        nothing done) where this heap is frozen already or another freeze holds objects."""
        if self.frozen or gc.get_freeze_count() > 0:
            return False
        gc.collect(YOUNG_GENERATIONS)
        gc.freeze()
        self.frozen = True
        return True

    def release(self) -> None:
        """Unfreeze what :meth:`freeze` froze (nothing if it froze nothing)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
