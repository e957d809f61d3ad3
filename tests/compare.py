"""How the tests compare parameters trained two ways (pipelined and in one process)."""

from __future__ import annotations

import torch

ADAM_RELATIVE_ERROR = 1e-5


def assert_close_after_adam(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """``actual`` within 1e-5 of ``expected`` relative to its norm.

    Adam divides each update by the root of that element's own squared-gradient average, so an
    element whose gradient is near zero moves by about ``lr`` whatever the gradient's size: the
    last-bit differences of another summation order (pipelined microbatches, a reduce-scatter,
    the global clipping norm) become absolute differences of ~1e-6 to 1e-5 in such elements,
    varying with the CPU's vector width. An element-wise ``atol`` then fails on one machine and
    passes on the next; the norm-relative error stays at the rounding level everywhere.
    """
    error = float((actual - expected).norm() / expected.norm().clamp_min(1e-12))
    assert error <= ADAM_RELATIVE_ERROR, f"{msg}: relative error {error:.2e}"
