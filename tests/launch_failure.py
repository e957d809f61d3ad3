"""A training script whose loss rank fails at step 2: run by tests/test_launchers.py under
Lightning's own launchers (``python tests/launch_failure.py fork|spawn|popen``)."""

import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402

from lightning_mmpp import ModulePlacement as P  # noqa: E402
from lightning_mmpp import MultiModulePipelineStrategy  # noqa: E402
from tests.models import MultiModalModel, make_loader  # noqa: E402

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


class FailsAtStep2(MultiModalModel):
    def pipeline_loss(self, module, output, batch):
        if self.trainer.global_step == 2:
            print(f"FAILING AT {time.time():.3f}", flush=True)
            raise ValueError("boom at the loss rank")
        return super().pipeline_loss(module, output, batch)


if __name__ == "__main__":
    strategy = MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, num_microbatches=2,
                                           start_method=sys.argv[1], timeout=timedelta(minutes=30))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    try:
        trainer.fit(FailsAtStep2(TOPOLOGY), make_loader(TOPOLOGY, 8, 64))
    finally:
        print(f"LAUNCHER ENDS AT {time.time():.3f}", flush=True)
