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


def _wants_float64(item) -> bool:
    # MEGATRON_PARITY_DTYPE=float32 runs them in float32 (timing, or to see the fp32 path): they
    # then compare the first step only, under the float32 bound.
    if os.environ.get("MEGATRON_PARITY_DTYPE", "float64") == "float32":
        return False
    return item.get_closest_marker("parity") is not None and item.get_closest_marker("fp32") is None


def pytest_runtest_setup(item):
    """Parity tests run in float64: the model's dtype is torch's default dtype and forked ranks
    inherit it, so their roundoff sits orders of magnitude below bounds that no summation order
    can reach (tests/parity_utils.py). A test marked `fp32` keeps float32 (the fp32 path itself,
    mixed precision: autocast leaves float64 tensors alone). A hook, not a fixture: it must be in
    force before the module-scoped fixtures that train the references."""
    import torch
    torch.set_default_dtype(torch.float64 if _wants_float64(item) else torch.float32)


def pytest_runtest_teardown(item, nextitem):
    """Module fixtures finalised after the last test train nothing; the next test's setup sets its
    own dtype, so only the end of the session needs float32 back."""
    if nextitem is None:
        import torch
        torch.set_default_dtype(torch.float32)
