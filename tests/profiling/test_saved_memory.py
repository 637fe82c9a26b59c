"""measure_saved: storages kept for backward, counted once, checkpoint inputs included."""
import torch
from torch.utils.checkpoint import checkpoint

from megatron.profiling.saved_memory import measure_saved

N = 1000  # fp32 elements: 4000 bytes per tensor


def _x():
    # a non-leaf, like a layer's input: autograd's gradient accumulator holds a leaf input alive
    return [torch.randn(N).requires_grad_() * 1.0]


def test_saved_tensors_counted_once_and_output_excluded():
    # sin saves its input (x * 2); the view shares its storage; x itself is not needed
    m = measure_saved(lambda x: (x * 2).view(10, 100).sin().cos(), _x)
    assert m.kept_bytes == m.saved_bytes == 2 * 4 * N   # x*2 (for sin) and sin's result (for cos)
    assert m.peak_bytes >= 4 * 4 * N                     # x, x*2, sin, cos alive together


def test_checkpoint_keeps_only_its_inputs():
    def fn(x):
        h = x * 2
        return checkpoint(lambda t: t.sin().sin().sin(), h, use_reentrant=False)
    m = measure_saved(fn, _x)
    assert m.kept_bytes == 4 * N                         # h only; the sines are rebuilt in backward


def test_parameters_are_not_activations():
    w = torch.nn.Parameter(torch.randn(N))
    m = measure_saved(lambda x: (x * w).sum(), _x, params=[w])
    assert m.kept_bytes == 4 * N                         # x (saved for w's grad), not w
    assert w.grad is not None


def test_working_set_of_one_operator():
    from megatron.profiling.saved_memory import measure_working_set
    w = torch.nn.Parameter(torch.randn(N))
    # forward: x * w (saved x is the input, already live) makes its output only
    ws = measure_working_set(lambda x: x * w, _x, params=[w])
    assert ws.forward_bytes == 4 * N
    # backward: incoming gradient, gradient of x, and w's gradient before it is added into the
    # existing w.grad (made first, as from a step's second micro-batch on)
    assert 3 * 4 * N <= ws.backward_bytes <= 4 * 4 * N
    assert w.grad is not None
