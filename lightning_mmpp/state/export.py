"""Export a pipeline checkpoint directory to one ordinary Lightning ``.ckpt`` file.

    python -m lightning_mmpp.state.export CKPT_DIR OUT.ckpt [--unsafe-load]

The result loads with ``MyModule.load_from_checkpoint(OUT.ckpt)`` on one process, without the
strategy, or resumes a single-process ``Trainer.fit(model, ckpt_path=OUT.ckpt)``. See
:mod:`lightning_mmpp.state.checkpoint` for both formats.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from lightning_mmpp.state.checkpoint import export_checkpoint

__all__ = ["export_checkpoint", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mmpp.state.export",
        description="Turn a MultiModulePipelineStrategy checkpoint directory into one Lightning .ckpt file.",
    )
    parser.add_argument("checkpoint_dir", help="the checkpoint directory (e.g. checkpoints/epoch=0-step=3.ckpt)")
    parser.add_argument("out", help="the .ckpt file to write")
    parser.add_argument(
        "--unsafe-load", action="store_true",
        help="also unpickle objects other than tensors and plain Python data (numbers, strings, lists, tuples, "
        "dicts) in meta.pt (Lightning's loop, callback and hyper-parameter state) and in non-tensor DCP entries, "
        "i.e. torch.load(weights_only=False): this can run arbitrary code stored in those files. Needed only when "
        "an on_save_checkpoint hook or a hyper-parameter stored such objects; use it only for checkpoints you "
        "trust. The index (.metadata) and RNG files are always read with the safe loader, and every file is still "
        "checked against the manifest.",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint_dir, args.out, weights_only=False if args.unsafe_load else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
