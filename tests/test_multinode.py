"""Multi-node launches on one machine: two ``torchrun`` agents (c10d rendezvous) of two processes
each, and a faked SLURM allocation (Lightning's ``SLURMEnvironment``).

The torchrun test trains ``tests/launch_multinode.py``'s 4-rank layout (enc_a dp=2 on node 0,
llm pp=2 on node 1) and checks the layout each rank got, the loss of every step on every rank
(identical, and equal to single-process training), and an exact resume from a checkpoint.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_mmpp import MultiModulePipelineStrategy
from tests import launch_multinode as job
from tests.dist import free_port, run_distributed
from tests.models import MultiModalModel, make_loader

ROOT = Path(__file__).resolve().parents[1]
NODES, PER_NODE = 2, 2
EXPECTED_SLOTS = {0: [("enc_a", 0, 0)], 1: [("enc_a", 0, 1)], 2: [("llm", 0, 0)], 3: [("llm", 1, 0)]}


def _tagged(token: str) -> list[int]:
    """Every process whose environment holds ``token`` (the agents and the ranks they started,
    wherever they were re-parented)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except OSError:  # gone, or not ours
            pass
    return found


def _run_agents(out: Path, timeout: float) -> list[str]:
    """Start two torchrun agents, wait for both (no polling: pidfds), end every process on a
    failure or at the deadline; return their outputs. Raises AssertionError on a failure."""
    token = f"mmpp-multinode-{uuid.uuid4().hex}"
    port = free_port()
    logs = [open(out / f"agent{i}.log", "w+") for i in range(NODES)]
    agents: list[subprocess.Popen] = []
    try:
        for i in range(NODES):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                   "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", token,
                   "--rdzv-conf", "join_timeout=60,close_timeout=10", "--local-addr", "127.0.0.1",
                   "--max-restarts", "0", "--monitor-interval", "0.2", "-m", "tests.launch_multinode", str(out)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                   "PYTHONWARNINGS": "ignore", "MMPP_TEST_AGENT": f"agent{i}", "MMPP_TEST_TOKEN": token}
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
        selector = selectors.DefaultSelector()
        pidfds = {os.pidfd_open(a.pid): a for a in agents}
        for fd in pidfds:
            selector.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        running = set(pidfds)
        failed = False
        while running and not failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                running.discard(key.fd)
                selector.unregister(key.fd)
                failed |= pidfds[key.fd].wait() != 0
        selector.close()
        for fd in pidfds:
            os.close(fd)
    finally:
        for pid in _tagged(token):  # a failed or hung launch: end the agents and every rank
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in agents:
            agent.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [a.returncode for a in agents]
    report = "\n".join(f"----- agent{i} (exit {codes[i]}) -----\n{o[-4000:]}" for i, o in enumerate(outputs))
    assert running == set() and codes == [0] * NODES, f"the torchrun agents failed or hung:\n{report}"
    return outputs


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two epochs of single-process training on the same data."""

    class Losses(L.Callback):
        losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

    model = MultiModalModel(job.TOPOLOGY, optimizer="adam")
    losses = Losses()
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
              callbacks=[losses]).fit(model, make_loader(job.TOPOLOGY, job.BATCH, job.BATCH * job.EPOCH))
    return losses.losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="waits on pidfds and reads /proc to end every process")
def test_two_torchrun_agents_train_a_4_rank_layout_and_resume(tmp_path):
    _run_agents(tmp_path, timeout=200)
    results = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(NODES * PER_NODE)}
    ref_losses, ref_params = _reference()
    for rank, result in results.items():
        env = result["env"]
        assert result["cluster_environment"] == "TorchElasticEnvironment", result["cluster_environment"]
        assert (result["global_rank"], result["world_size"]) == (rank, 4) and env["RANK"] == str(rank)
        assert (result["node_rank"], result["local_rank"]) == divmod(rank, PER_NODE), result
        assert env["GROUP_RANK"] == str(rank // PER_NODE)
        assert result["slots"] == EXPECTED_SLOTS[rank]
        assert {name.split(".")[0] for name in result["params"]} == {EXPECTED_SLOTS[rank][0][0]}
        # the loss of every step, on every rank, equals single-process training's
        assert result["losses"] == results[0]["losses"] and len(ref_losses) == 2 * job.EPOCH
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # the second epoch resumed from the checkpoint after the first == two epochs straight, bit for bit
        assert result["resumed_losses"] == result["losses"][job.EPOCH:]
        assert result["resumed_params"].keys() == result["params"].keys()
        for name, value in result["params"].items():
            assert torch.equal(result["resumed_params"][name], value), f"rank {rank}: {name} not resumed exactly"
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    # each "node" is one agent: ranks 0-1 under one, ranks 2-3 under the other
    agents = [{results[r]["env"]["MMPP_TEST_AGENT"] for r in ranks} for ranks in ((0, 1), (2, 3))]
    assert all(len(a) == 1 for a in agents) and agents[0] != agents[1], agents
    held = set().union(*(r["params"] for r in results.values()))
    assert held == set(ref_params), set(ref_params) ^ held


# --- SLURM ------------------------------------------------------------------------------------

_ELASTIC_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "TORCHELASTIC_RUN_ID")


def _slurm_env(rank: int, port: int) -> dict[str, str]:
    """What ``srun`` sets for task ``rank`` of ``sbatch --nodes=2 --ntasks-per-node=2`` (the
    variables Lightning's SLURMEnvironment reads), with the main address on this machine."""
    node, local = divmod(rank, PER_NODE)
    return {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "mmpp-train", "SLURM_NTASKS": str(NODES * PER_NODE),
        "SLURM_NTASKS_PER_NODE": str(PER_NODE), "SLURM_JOB_NUM_NODES": str(NODES), "SLURM_NNODES": str(NODES),
        "SLURM_NODELIST": "gpu-node[17-18]", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def _slurm_trainer() -> L.Trainer:
    strategy = MultiModulePipelineStrategy(job.PLACEMENTS, job.TOPOLOGY, num_microbatches=job.M,
                                           timeout=timedelta(seconds=60))
    return L.Trainer(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, logger=False,
                     max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


def test_a_slurm_allocation_assigns_ranks_to_modules(monkeypatch):
    """In one process, task by task: the Trainer resolves SLURM's variables to the global rank,
    and the layout gives that rank its module stage."""
    for name in _ELASTIC_VARS:
        monkeypatch.delenv(name, raising=False)
    for rank in range(NODES * PER_NODE):
        for name, value in _slurm_env(rank, 29500).items():
            monkeypatch.setenv(name, value)
        trainer = _slurm_trainer()
        strategy = trainer.strategy
        assert isinstance(strategy.cluster_environment, SLURMEnvironment)
        assert strategy.cluster_environment.main_address == "127.0.0.1"
        assert (strategy.global_rank, strategy.world_size) == (rank, NODES * PER_NODE)
        assert (strategy.node_rank, strategy.local_rank) == divmod(rank, PER_NODE)
        slots = strategy.layout.slots(strategy.global_rank)
        assert [(s.module, s.stage, s.replica) for s in slots] == EXPECTED_SLOTS[rank]
    # without MASTER_ADDR the main address is the first node of the allocation
    monkeypatch.delenv("MASTER_ADDR")
    assert SLURMEnvironment().main_address == "gpu-node17"


def _slurm_task(rank: int, world: int) -> dict[str, Any]:
    for name in _ELASTIC_VARS:  # what run_distributed set for torchrun: this task is srun's
        os.environ.pop(name, None)
    os.environ.update(_slurm_env(rank, int(os.environ["MASTER_PORT"])))
    trainer = _slurm_trainer()
    model = MultiModalModel(job.TOPOLOGY, optimizer="adam")
    trainer.fit(model, make_loader(job.TOPOLOGY, job.BATCH, job.BATCH * job.EPOCH))
    return {"environment": type(trainer.strategy.cluster_environment).__name__,
            "global_rank": trainer.strategy.global_rank,
            "modules": sorted({n.split(".")[0] for n, p in model.named_parameters() if p.numel()}),
            "loss": float(trainer.callback_metrics["train_loss"])}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_srun_tasks_train_the_modules_slurm_assigns_them():
    """Four processes started like ``srun`` would (SLURM variables only): each trains the module
    its SLURM_PROCID is given, and all report the same loss."""
    results = run_distributed(_slurm_task, NODES * PER_NODE, timeout=100, init_pg=False)
    for rank, result in enumerate(results):
        assert result["environment"] == "SLURMEnvironment" and result["global_rank"] == rank, result
        assert result["modules"] == [EXPECTED_SLOTS[rank][0][0]], result
    assert len({r["loss"] for r in results}) == 1, results
