"""Bytes per stage/module boundary with tensor parallelism: one copy per tp group.

    python benchmarks/bench_tp_boundary.py

The test model (``tests.models.TensorParallelModel``) on ``enc_a -> llm``, once as
``enc_a: P(), llm: P(pp=2)`` (3 ranks) and once with ``tp=2`` on both modules (6 ranks). For the
second training step of each (specs cached, so no metadata) it prints every rank's
point-to-point bytes and the bytes relayed inside its tp group, next to the payload bytes the
step must move across each boundary (activations forward, their gradients back, m = 2
microbatches of 4 samples). A tp lead moves what the rank it stands for moves without tp; the
other rank of its group moves nothing point-to-point and receives the lead's payload by one
broadcast inside the group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table  # noqa: E402
from lightning_mmpp.core.placement import ModulePlacement as P  # noqa: E402
from tests.dist import run_distributed  # noqa: E402
from tests.models import HIDDEN, SEQ  # noqa: E402
from tests.test_tensor_parallel import boundary_bytes  # noqa: E402

M, MICROBATCH = 2, 4


def main() -> None:
    enc = MICROBATCH * HIDDEN * 4  # enc_a output [mb, HIDDEN] float32; its gradient the same
    lm_fwd = MICROBATCH * SEQ * HIDDEN * 4 + MICROBATCH * SEQ * 8  # {"h": float32, "ids": int64}
    lm_bwd = MICROBATCH * SEQ * HIDDEN * 4  # the gradient of "h" (ids carry none)
    print(f"payload per step: enc_a->llm {M * enc} B forward + {M * enc} B back; llm stage 0->1 "
          f"{M * lm_fwd} B forward + {M * lm_bwd} B back (headers: 16 B per message, leaves 16-B aligned)")
    for name, placements, world in (
        ("tp=1", {"enc_a": P(), "llm": P(pp=2)}, 3),
        ("tp=2", {"enc_a": P(tp=2), "llm": P(pp=2, tp=2)}, 6),
    ):
        result = run_distributed(boundary_bytes, world, placements, M, M * MICROBATCH, timeout=120)
        print(f"\n{name}")
        print(table(["rank", "p2p sent B", "p2p received B", "relayed in tp group B"],
                    [[r, x["sent"], x["received"], x["relayed"]] for r, x in enumerate(result)]))


if __name__ == "__main__":
    main()
