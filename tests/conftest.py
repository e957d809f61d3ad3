import os
import sys

import torch

# Workers are forked from the test process. An OpenMP pool that ran in the parent can leave
# a forked child hanging at its first parallel region, so the whole suite runs single-threaded
# (2 cores, more ranks than cores: one thread per process is the fastest anyway).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
