import numpy as np
import pytest

from megatron.data.samplers import MegatronPretrainingSampler, TokenBudgetSampler
from megatron.data.supervised_dataset import SupervisedDataset, build_supervised_datasets

from .util import make_dataset


def test_pretraining_sampler_dp_and_resume():
    full = [list(MegatronPretrainingSampler(20, 0, 2, r, 2)) for r in range(2)]
    assert full[0][:2] == [[0, 1], [4, 5]] and full[1][:2] == [[2, 3], [6, 7]]
    assert sorted(i for rank in full for b in rank for i in b) == list(range(20))
    resumed = list(MegatronPretrainingSampler(20, 8, 2, 1, 2))
    assert resumed == full[1][2:]
    assert list(MegatronPretrainingSampler(7, 0, 2, 0, 2, drop_last=False))[-1] == [4, 5]
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)


def test_token_budget_sampler():
    lengths = [30, 50, 200, 10, 10, 60, 5]
    s = TokenBudgetSampler(lengths, tokens_per_global_batch=100, max_seq_length=64)
    batches = list(s)
    # 200 counts as 64: [30+50] [64+10+10] [60+5]; adding the next sample would exceed 100
    assert batches == [[0, 1], [2, 3, 4], [5, 6]]
    for b in batches:
        assert sum(min(lengths[i], 64) for i in b) <= 100
    assert s.consumed_samples == 7
    r = TokenBudgetSampler(lengths, 100, 64, consumed_samples=2)
    assert list(r) == batches[1:]
    with pytest.raises(ValueError, match="--tokens-per-global-batch"):
        TokenBudgetSampler(lengths, 10, 64)


def test_supervised_dataset(tmp_path):
    inputs = [[[1, 2, 3]], [[4], [5, 6]], []]  # the last document is empty
    targets = [[[7]], [[8, 9]], [[10]]]
    a = make_dataset(str(tmp_path / "x_inputs_document"), inputs)
    b = make_dataset(str(tmp_path / "x_targets_document"), targets)
    ds = SupervisedDataset(a, b)
    assert ds.input_lengths.tolist() == [3, 3, 0] and ds.target_lengths.tolist() == [1, 2, 1]
    assert ds[1]["inputs"].tolist() == [4, 5, 6] and ds[1]["targets"].tolist() == [8, 9]
    assert ds[2]["inputs"].dtype == np.int64 and ds[2]["inputs"].size == 0
    train, valid, _ = build_supervised_datasets([a], [b], "2,1,0")
    assert len(train) == 2 and valid[0]["targets"].tolist() == [10]
    c = make_dataset(str(tmp_path / "y"), targets[:2])
    with pytest.raises(ValueError, match="same preprocess_data.py run"):
        SupervisedDataset(a, c)
