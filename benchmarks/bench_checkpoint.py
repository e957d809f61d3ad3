"""What checkpoint integrity costs: save and load of a large checkpoint with and without CRC32.

One process (a layout of two colocated modules on one rank), so the numbers measure the file
work, not the collectives. Three ways of writing/reading the same model state (weights and
Adam state, ``--mb`` MiB of weights, so three times that on disk):

* ``dcp``: plain ``torch.distributed.checkpoint.save`` / ``load`` of the same flat dict (no
  staging directory, no manifest, no safe index reader): the floor;
* ``ours, no crc``: :func:`lightning_mmpp.state.checkpoint.save_checkpoint` / ``load_checkpoint``
  with the CRC32 replaced by the file size only (staging directory, atomic publish, manifest,
  safe reading, all kept);
* ``ours``: the real thing (CRC32 of every file at save, of every file read at load); the
  time spent inside the CRC32 computation is also measured directly, which is robust to the
  noise of a shared machine (fsync times vary by seconds).

Loads read from the page cache (the file was just written), which is the worst case for the
relative cost of checksums: from a cold disk or a network file system the read itself
dominates. Prints the median of ``--repeats`` runs of each.

    python benchmarks/bench_checkpoint.py --mb 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

from lightning_mmpp.state import checkpoint as ckpt  # noqa: E402
from lightning_mmpp.model import checkpoint_files  # noqa: E402
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout  # noqa: E402

CPU = torch.device("cpu")
TOPOLOGY = {"enc": ["llm"], "llm": []}


class Model(nn.Module):
    def __init__(self, mb: int, layers: int = 8) -> None:
        super().__init__()
        width = int((mb * 2**20 / 4 / (layers + 2)) ** 0.5)
        self.enc = nn.Sequential(*(nn.Linear(width, width) for _ in range(2)))
        self.llm = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _size_only(path: Path) -> checkpoint_files.FileRecord:
    return checkpoint_files.FileRecord(size=path.stat().st_size, crc32=0)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MiB of fp32 weights (Adam state doubles it again)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    layout = PipelineLayout(
        {"enc": ModulePlacement(rank_offset=0), "llm": ModulePlacement(rank_offset=0)}, TOPOLOGY
    )
    model = Model(args.mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    checkpoint = {
        "state_dict": ckpt.model_state_dict(model),
        "optimizer_states": [ckpt.optimizer_state_by_name(model, opt)],
        "global_step": 1,
    }
    flat = {f"model/{k}": v for k, v in checkpoint["state_dict"].items()}
    for name, state in checkpoint["optimizer_states"][0]["state"].items():
        flat.update({f"optim/0/{name}/{k}": v for k, v in state.items()})
    weights_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    root.mkdir(parents=True, exist_ok=True)
    path = root / "ckpt"
    real_record = checkpoint_files.file_record

    crc_seconds = [0.0]

    def timed_record(file: Path) -> checkpoint_files.FileRecord:
        start = time.perf_counter()
        try:
            return real_record(file)
        finally:
            crc_seconds[0] += time.perf_counter() - start

    def use_crc(on: bool) -> None:
        record = timed_record if on else _size_only
        checkpoint_files.file_record = record
        ckpt.file_record = record

    def dcp_save() -> None:
        shutil.rmtree(path, ignore_errors=True)
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)

    def dcp_load() -> None:
        dest = {k: torch.empty_like(v) for k, v in flat.items()}
        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)

    def our_save() -> None:
        ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=0, device=CPU)

    def our_load() -> None:
        loaded = ckpt.load_checkpoint(
            path, model=model, optimizers=[opt], layout=layout, rank=0, device=CPU, fitting=True
        )
        ckpt.load_optimizer_states(model, [opt], loaded["optimizer_states"], CPU)

    variants = (
        ("dcp", False, dcp_save, dcp_load),
        ("ours, no crc", False, our_save, our_load),
        ("ours", True, our_save, our_load),
    )
    times: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label, *_ in variants}
    crc_in: dict[str, list[float]] = {"save": [], "load": []}
    disk = 0.0
    try:
        for _ in range(args.repeats):  # variants interleaved, so that drift in the machine's load hits all
            for label, crc, save, load in variants:
                use_crc(crc)
                crc_seconds[0] = 0.0
                times[label][0].append(_timed(save))
                if crc:
                    crc_in["save"].append(crc_seconds[0])
                    crc_seconds[0] = 0.0
                times[label][1].append(_timed(load))
                if crc:
                    crc_in["load"].append(crc_seconds[0])
                disk = sum(f.stat().st_size for f in path.iterdir()) / 2**20
                shutil.rmtree(path, ignore_errors=True)
    finally:
        use_crc(True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = [(label, statistics.median(s), statistics.median(l), disk) for label, (s, l) in times.items()]

    data = bytes(64 << 20)
    crc_rate = 64 / 2**10 / _timed(lambda: zlib.crc32(data))
    print(f"weights {weights_mb:.0f} MiB, on disk {rows[-1][3]:.0f} MiB, median of {args.repeats}; "
          f"zlib.crc32 alone: {crc_rate:.2f} GiB/s")
    base_save, base_load = rows[1][1], rows[1][2]
    print(f"{'':14} {'save s':>8} {'load s':>8} {'save/no crc':>12} {'load/no crc':>12}")
    for label, save_s, load_s, _ in rows:
        print(f"{label:14} {save_s:8.2f} {load_s:8.2f} {save_s / base_save:12.2f} {load_s / base_load:12.2f}")
    save_crc, load_crc = statistics.median(crc_in["save"]), statistics.median(crc_in["load"])
    print(f"time inside CRC32 (ours): save {save_crc:.2f} s = {save_crc / rows[2][1]:.0%} of the save, "
          f"load {load_crc:.2f} s = {load_crc / rows[2][2]:.0%} of the load")


if __name__ == "__main__":
    main()
