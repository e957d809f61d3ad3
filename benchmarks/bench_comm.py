"""Communicator benchmark: ``MultiModuleCommunicator.exchange`` against raw ``send``/``recv`` (gloo, CPU).

    python benchmarks/bench_comm.py

Two processes, rank 0 -> rank 1 (a module with ``pp=2``). Each step sends one forward payload
``{"h": float32 [8, S, 512], "ids": int64 [8, S], "mask": bool [8, S]}``:

* ``exchange``: the communicator packs the leaves into one buffer and sends one message per
  step (metadata only on the first step, then cached);
* ``raw``: ``torch.distributed.send``/``recv`` of the same three tensors into pre-allocated
  buffers (the lower bound: no packing, no metadata, but three messages).

Both loops run in the same processes, back to back, between barriers; the time is the slower
rank's. MB/s counts payload bytes (headers and alignment padding not included). Ratios are
the meaningful numbers: absolute throughput depends on the machine's loopback and load.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_mmpp.engine.comm import FORWARD, MessageKey, MultiModuleCommunicator  # noqa: E402
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

SEQ_LENS = (256, 16)  # 256: the large payload (~4 MiB); 16: a small one, where per-message cost shows
METADATA_STEPS = 100


def make_payload(seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return {
        "h": torch.randn(8, seq, 512, generator=g),
        "ids": torch.randint(0, 32000, (8, seq), generator=g),
        "mask": torch.rand(8, seq, generator=g) > 0.1,
    }


def timed(rank: int, fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world_size: int) -> dict:
    layout = PipelineLayout({"a": ModulePlacement(pp=2)}, {"a": []})
    key = MessageKey(FORWARD, "a", "a", 0)
    rows = []
    for seq in SEQ_LENS:
        payload = make_payload(seq)
        nbytes = sum(t.numel() * t.element_size() for t in payload.values())
        iters = 40 if seq >= 128 else 400
        comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"))

        def via_exchange() -> None:
            if rank == 0:
                comm.exchange({key: payload}, ())
            else:
                got = comm.exchange({}, (key,))[key]
                assert got["h"].shape == payload["h"].shape

        buffers = [torch.empty_like(t) for t in payload.values()]

        def via_raw() -> None:
            if rank == 0:
                for tensor in payload.values():
                    dist.send(tensor, 1)
            else:
                for buffer in buffers:
                    dist.recv(buffer, 0)

        for fn in (via_exchange, via_raw):  # warm up both paths
            for _ in range(3):
                fn()
        comm.wait_sends()
        t_raw = timed(rank, via_raw, iters)
        t_exchange = timed(rank, lambda: (via_exchange(), comm.wait_sends()), iters)
        if rank == 1:  # exactness of what arrived, once
            assert all(torch.equal(a, b) for a, b in zip(comm.exchange({}, (key,))[key].values(), payload.values()))
        else:
            comm.exchange({key: payload}, ())
            comm.wait_sends()
        rows.append({"seq": seq, "bytes": nbytes, "iters": iters, "raw": t_raw, "exchange": t_exchange})

    # Metadata over METADATA_STEPS steps of unchanged shapes, on a fresh communicator.
    comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"))
    payload = make_payload(SEQ_LENS[-1])
    for _ in range(METADATA_STEPS):
        if rank == 0:
            comm.exchange({key: payload}, ())
        else:
            comm.exchange({}, (key,))
    comm.wait_sends()
    dist.barrier()
    return {"rows": rows, "metadata": comm.stats.metadata_exchanges, "messages": comm.stats.as_dict()}


def main() -> None:
    results = run_distributed(worker, 2, timeout=300)
    print("MultiModuleCommunicator.exchange vs raw send/recv, gloo on CPU, 2 processes, rank 0 -> rank 1")
    print("payload: {'h': float32 [8, S, 512], 'ids': int64 [8, S], 'mask': bool [8, S]}\n")
    header = f"{'S':>5} {'payload':>10} {'steps':>6} {'raw MB/s':>10} {'exchange MB/s':>14} {'exchange/raw':>13} {'raw ms/step':>12} {'exch ms/step':>13}"
    print(header)
    print("-" * len(header))
    for index, row in enumerate(results[0]["rows"]):
        t_raw = max(r["rows"][index]["raw"] for r in results)
        t_ex = max(r["rows"][index]["exchange"] for r in results)
        mb = row["bytes"] * row["iters"] / 1e6
        print(
            f"{row['seq']:>5} {row['bytes'] / 2**20:>8.2f}Mi {row['iters']:>6} {mb / t_raw:>10.0f} {mb / t_ex:>14.0f} "
            f"{t_raw / t_ex:>12.2f}x {1e3 * t_raw / row['iters']:>12.3f} {1e3 * t_ex / row['iters']:>13.3f}"
        )
    print(
        f"\nmetadata exchanges over {METADATA_STEPS} steps of unchanged shapes (1 channel): "
        f"rank 0 sent {results[0]['metadata']}, rank 1 received {results[1]['metadata']} (expected 1 each)"
    )
    stats0, stats1 = results[0]["messages"], results[1]["messages"]
    print(
        f"P2P messages over those {METADATA_STEPS} steps: rank 0 sent {stats0['messages_sent']}, rank 1 received "
        f"{stats1['messages_received']} (1 per step + 2 for the first step's length and spec)"
    )


if __name__ == "__main__":
    main()
