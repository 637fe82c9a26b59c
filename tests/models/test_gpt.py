"""GPT stage model: packed sequences never see each other; recompute levels agree."""
import numpy as np
import torch

from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.data.packing import pack_samples
from megatron.models.gpt import GPTStage


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=50,
                      make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTStage(cfg, ParallelState(), layer_start=0, layer_end=2, pre_process=True, post_process=True, seed=3)


def _alone(model, s):
    t = torch.from_numpy(s).unsqueeze(0)
    (loss,) = model({"tokens": t[:, :-1], "labels": t[:, 1:]}, [])
    return loss[0]


def test_packed_samples_equal_samples_alone():
    model = _model().eval()
    rng = np.random.RandomState(1)
    samples = [rng.randint(0, 50, n) for n in (7, 12, 5)]
    rows = {k: torch.from_numpy(v) for k, v in pack_samples(samples, 32).items()}
    assert rows["tokens"].shape[0] == 1  # all three share one row
    (loss,) = model(rows, [])
    pos = 0
    for s in samples:
        want = _alone(model, s)
        got = loss[0, pos:pos + len(s) - 1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        pos += len(s)


def test_recompute_levels_give_identical_gradients():
    model = _model()
    t = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(2))
    grads = []
    for level in ("none", "selective", "full"):
        model.zero_grad()
        model.recompute = level
        (loss,) = model({"tokens": t[:, :-1], "labels": t[:, 1:]}, [])
        loss.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
