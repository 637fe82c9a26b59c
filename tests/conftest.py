"""Suite-wide set-up.

The suite runs every parallel layout on CPU with gloo, in ranks forked from the pytest process.
On a machine with a GPU, autograd starts per-device worker threads in the parent at its first
backward, and forked children can then no longer run autograd ("Unable to handle autograd's
threading in combination with fork-based multiprocessing"). So the CPU suite hides the GPUs
from itself (before torch is imported) and runs the same on every machine; set
MEGATRON_TEST_CUDA=1 to keep them visible for GPU-only tests.
"""
import os

if os.environ.get("MEGATRON_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
