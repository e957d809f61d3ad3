"""Run a function on N real processes (gloo on CPU) for distributed tests.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` workers. Each worker sets the
torch.distributed / torchelastic environment variables (so Lightning's
``TorchElasticEnvironment`` recognises it), optionally initialises a gloo process group,
runs ``fn(rank, world_size, *args)`` and sends the (picklable) return value or the formatted
traceback back to the parent through a pipe. The parent enforces one overall deadline and
kills every worker on the first failure or on timeout, so a deadlock fails in seconds instead
of hanging the test session. Workers leave with ``os._exit`` so nothing lingers.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["free_port", "run_distributed"]

# Seconds the parent keeps collecting reports after the first failure, so that the
# tracebacks of ranks that fail as a consequence (or independently) are shown too.
_FAILURE_GRACE_S = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    conn: multiprocessing.connection.Connection,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    timeout: float,
    init_pg: bool,
) -> None:
    status, payload = "error", "worker did not run"
    try:
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0",
                "NODE_RANK": "0",
                "TORCHELASTIC_RUN_ID": f"mmpp-test-{port}",
            }
        )
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname says
        torch.set_num_threads(1)
        if init_pg:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        status, payload = "ok", fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, payload = "error", traceback.format_exc()
    try:
        try:
            conn.send_bytes(_dumps((status, payload)))
        except Exception:  # the return value does not pickle
            conn.send_bytes(_dumps(("error", "could not send the return value back:\n" + traceback.format_exc())))
        conn.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def _dumps(obj: Any) -> bytes:
    """Serialise with torch.save: tensors travel by value (no shared-memory handles that die
    with the worker)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    init_pg: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked processes.

    Args:
        fn: the per-rank function; its return value must pickle.
        world_size: number of processes.
        *args: extra arguments passed to ``fn`` on every rank.
        timeout: overall deadline in seconds for all ranks together; also the gloo
            process-group timeout.
        init_pg: initialise a gloo process group before calling ``fn``. Pass ``False`` when
            ``fn`` lets a Lightning ``Trainer`` initialise it (the environment is set up).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        AssertionError: if any rank raised, died, or the deadline passed; the message holds
            the traceback of every failing rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unmarked = os.environ.get("MMPP_TEST_UNMARKED")
    if unmarked:
        raise AssertionError(f"{unmarked} launches processes: mark it @pytest.mark.distributed")
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[multiprocessing.connection.Connection, int] = {}
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(child_conn, fn, rank, world_size, port, args, timeout, init_pg),
            name=f"mmpp-rank{rank}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns[parent_conn] = rank

    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                reason = (
                    "killed: still running when another rank had failed"
                    if failures
                    else f"no result after {timeout:.0f} s (deadlock or hang?); killed"
                )
                for rank in range(world_size):
                    if rank not in results and rank not in failures:
                        failures[rank] = reason
                break
            ready = multiprocessing.connection.wait(list(conns) + list(sentinels), timeout=deadline - now)
            for obj in ready:
                if obj in conns:
                    rank = conns.pop(obj)
                    try:
                        status, payload = _loads(obj.recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=1.0)
                        status, payload = "error", (
                            f"process exited (code {procs[rank].exitcode}) without reporting a result; "
                            "a native abort (e.g. a gloo size mismatch) prints its reason to stderr"
                        )
                    obj.close()
                    if status == "ok":
                        results[rank] = payload
                    else:
                        failures[rank] = payload
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    # A report may still sit in the pipe: read it before declaring a crash.
                    conn = next((c for c, r in conns.items() if r == rank), None)
                    if conn is not None and conn.poll(0.5):
                        continue
                    if conn is not None:
                        conns.pop(conn).close()
                    if rank not in results and rank not in failures:
                        code = procs[rank].exitcode
                        failures[rank] = f"process exited with code {code} without reporting a result"
            if failures and time.monotonic() < deadline:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.join(timeout=5)
        for conn in conns:
            conn.close()

    if failures:
        report = "\n".join(
            f"----- rank {rank} -----\n{failures[rank]}" for rank in sorted(failures)
        )
        raise AssertionError(f"{len(failures)} of {world_size} rank(s) failed:\n{report}")
    return [results[rank] for rank in range(world_size)]
