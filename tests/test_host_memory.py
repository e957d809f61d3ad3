"""The host memory a CPU step frees stays mapped for the next step (glibc's malloc thresholds)."""

from __future__ import annotations

import multiprocessing as mp
import resource

import pytest
import torch

from lightning_mmpp.engine.host_memory import (GLIBC_DEFAULT_THRESHOLD, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD,
                                                 KeptHostMemory, _glibc)

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")


def _step_faults(rounds: int = 10) -> int:
    """Minor page faults of ``rounds`` steps' worth of allocations: eight 4 MiB tensors, written
    and freed together (a step's activations), after one round to warm up."""

    def one_round() -> None:
        tensors = [torch.ones(1 << 20) for _ in range(8)]
        del tensors

    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one_round()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _faults_as_found_kept_released(queue) -> None:
    # glibc's starting thresholds (128 KiB), as a fresh process has them: this test's process
    # may have grown them already by what it freed before (glibc raises them up to 32 / 64 MiB)
    libc = _glibc()
    libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
    memory = KeptHostMemory()
    found = _step_faults()
    kept = memory.keep()
    again = memory.keep()  # idempotent
    faults_kept = _step_faults()
    holding = _resident_bytes()  # the last round's 32 MiB, freed and kept
    memory.release()
    queue.put((found, kept, again, faults_kept, holding - _resident_bytes(), memory.kept))


@pytest.mark.timeout(60)
def test_kept_host_memory_takes_no_page_faults_and_release_hands_memory_back():
    # process-wide and one way (glibc stops growing its thresholds once one is set): in a child
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_faults_as_found_kept_released, args=(queue,))
    child.start()
    try:
        found, kept, again, faults_kept, released, still_kept = queue.get(timeout=50)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    # 10 rounds of 32 MiB are 81,920 pages: at glibc's starting thresholds every 4 MiB block is
    # mapped when allocated and unmapped when freed, so they fault again
    assert kept and not again and not still_kept
    assert found > 20_000, found  # (fewer where free blocks of the parent's heap serve some rounds)
    assert faults_kept < found / 20, (faults_kept, found)
    assert released > 16 * 2**20, released  # the kept free memory goes back to the operating system


def test_release_without_keep_does_nothing():
    memory = KeptHostMemory()
    memory.release()
    assert not memory.kept
