"""Run a function on ``world_size`` local processes, for calibration and plan validation (torch).

:func:`run_local` starts one process per rank on this machine (``fork`` on CPU, cheap;
``spawn`` on CUDA, where a CUDA context does not survive a fork), sets the torch.distributed /
torchelastic environment variables so that a Lightning ``Trainer`` inside recognises its rank
(``TorchElasticEnvironment``) and initialises the process group itself, runs
``fn(rank, world_size, *args)`` and returns the per-rank results. One overall deadline; on the
first failure or at the deadline every worker is killed and the failing ranks' tracebacks are
raised, so a measurement never hangs. Hand-written because ``torch.multiprocessing.spawn``
neither sets the environment Lightning needs nor returns results, and Lightning's own launcher
re-runs the user's script.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["rank_threads", "run_local"]


def rank_threads(world_size: int) -> int:
    """Intra-op threads of one of ``world_size`` local CPU ranks: the cores shared out, as
    Lightning does for its own CPU processes."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(conn: Any, fn: Callable[..., Any], rank: int, world_size: int, port: int, device: str,
            args: tuple[Any, ...]) -> None:
    try:
        os.environ.update({
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
            "TORCHELASTIC_RUN_ID": f"mmpp-plan-{port}",
        })
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import logging
        import warnings

        import torch

        torch.set_num_threads(rank_threads(world_size))
        for name in ("lightning.pytorch", "lightning.fabric"):  # one banner per rank and fit otherwise
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="lightning")
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(result))
        conn.close()
    finally:
        os._exit(0)


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
              timeout: float = 300.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, each on its own process (see the module docstring).

    ``fn`` and ``args`` must pickle when ``device`` is CUDA (spawned workers); results always.

    Raises:
        RuntimeError: a rank raised or died, or the deadline passed (the tracebacks included).
    """
    ctx = multiprocessing.get_context("spawn" if device.startswith("cuda") else "fork")
    port = _free_port()
    procs, conns = [], {}
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(child, fn, rank, world_size, port, device, args), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns[parent] = rank
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while conns and not failures:
            ready = multiprocessing.connection.wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failures.update({r: f"no result after {timeout:.0f} s; killed" for r in conns.values()})
                break
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "error", f"died (exit code {procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = payload
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5.0)
    if failures:
        raise RuntimeError("\n".join(f"rank {r}: {text}" for r, text in sorted(failures.items())))
    return [results[r] for r in range(world_size)]
