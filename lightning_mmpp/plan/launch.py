"""Run a function on ``world_size`` local processes, for calibration and plan validation (torch).

:func:`run_local` starts one process per rank on this machine (see :func:`start_method`: ``fork``
where that is safe, cheap and needs nothing pickled; ``spawn`` otherwise), sets the torch.distributed /
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

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["rank_threads", "run_local", "start_method"]


def rank_threads(world_size: int) -> int:
    """Intra-op threads of one of ``world_size`` local CPU ranks: the cores shared out, as
    Lightning does for its own CPU processes."""
    return max(1, (os.cpu_count() or 1) // world_size)


def start_method(world_size: int, device: str) -> str:
    """How :func:`run_local` starts its ``world_size`` processes on ``device``.

    ``"spawn"`` on CUDA (a CUDA context does not survive a fork) and on CPU where a rank gets
    more than one intra-op thread: a forked process hangs in its first OpenMP parallel region
    once its parent has run one (GNU libgomp's thread pool does not survive a fork; torch's
    DataLoader workers run one thread for the same reason), and the parent here has usually
    just profiled the model on several threads. ``"fork"`` otherwise: one thread per rank never
    starts an OpenMP team, and a fork is cheap and pickles nothing."""
    if device.startswith("cuda") or rank_threads(world_size) > 1:
        return "spawn"
    return "fork"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(conn: Any, work: Any, rank: int, world_size: int, port: int, device: str) -> None:
    """One rank: ``work`` is ``(fn, args)``, pickled (bytes) for a spawned process so that a
    failure to rebuild it comes back as this rank's traceback."""
    try:
        fn, args = pickle.loads(work) if isinstance(work, bytes) else work
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

    ``fn`` and ``args`` must pickle, and rebuild in a fresh process, where the processes are
    spawned (:func:`start_method`): on CUDA, and on CPU where a rank gets several threads; the
    results always.

    Raises:
        PipelineConfigError: ``fn`` or ``args`` do not pickle and the processes are spawned.
        RuntimeError: a rank raised or died, or the deadline passed (the tracebacks included).
    """
    method = start_method(world_size, device)
    work: Any = (fn, args)
    if method == "spawn":
        try:
            work = pickle.dumps(work)
        except Exception as err:  # noqa: BLE001 - any pickling failure, named below
            raise PipelineConfigError(
                f"measuring on {world_size} local process(es) on {device} starts fresh processes (spawn"
                + ("" if device.startswith("cuda") else f": each rank runs {rank_threads(world_size)} threads, which a "
                   "forked process cannot after its parent did")
                + f"), so the function and its arguments must pickle; {type(err).__name__}: {err}. Define the "
                "model class (or the make_model factory) at module level of an importable module, not inside a "
                "function or as a lambda."
            ) from err
    ctx = multiprocessing.get_context(method)
    port = _free_port()
    procs, conns = [], {}
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(child, work, rank, world_size, port, device), daemon=True)
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
