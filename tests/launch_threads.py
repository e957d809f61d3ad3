"""A script whose launching process runs a multi-threaded op before ``fit`` under
``start_method="fork"``: run by tests/test_launchers.py (``python tests/launch_threads.py``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_mmpp import ModulePlacement as P  # noqa: E402
from lightning_mmpp import MultiModulePipelineStrategy  # noqa: E402
from tests.models import MultiModalModel, make_loader  # noqa: E402

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


class ReportsThreads(L.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"WORKER THREADS {torch.get_num_threads()}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    torch.nn.Conv2d(3, 8, 3)(torch.randn(4, 3, 64, 64)).sum().item()  # an OpenMP team in this process
    strategy = MultiModulePipelineStrategy({"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}, TOPOLOGY,
                                           num_microbatches=2, start_method="fork")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[ReportsThreads()])
    trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, 8, 32))
    print(f"FIT DONE AT STEP {trainer.global_step}", flush=True)
