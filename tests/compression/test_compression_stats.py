"""--log-compression-stats: the numbers it reports, and that it changes nothing in training."""
import pytest
import torch

from megatron.compression import lowrank
from megatron.compression.pipeline import PipelineGradCompressor
from megatron.compression.stats import CompressionStats, format_line, merge, summary
from megatron.config.core import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, shards, tiny_config


def test_recorded_values_are_the_defined_ratios():
    st = CompressionStats()
    true = torch.tensor([[3.0, 4.0]])  # norm 5
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # P^T P - I = diag(0, 3): orth error 3
    st.record(1, "pp_grad", raw_bytes=400, sent_bytes=100, seconds=0.002, true=true, decoded=true * 1.5,
              residual=torch.tensor([6.0, 8.0]), p=p)
    st.record(1, "pp_grad", raw_bytes=400, sent_bytes=100, seconds=0.004, true=true, decoded=true,
              residual=torch.zeros(2), p=torch.eye(2))
    snap = st.snapshot()
    assert st.acc == {}  # the window resets
    s = summary(snap[(1, "pp_grad")])
    assert s["ratio"] == 4.0
    assert s["sent_err"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert s["residual"] == pytest.approx(1.0)  # (2 + 0) / 2
    assert s["orth"] == pytest.approx(1.5)
    assert s["ms"] == pytest.approx(3.0)
    # Replicas merge by (stage, kind); kinds without a residual show none.
    other = {(1, "pp_grad"): snap[(1, "pp_grad")], (0, "dp"): {"n": 1, "raw": 10, "sent": 5, "s": 0.0}}
    m = merge([snap, other, None])
    assert m[(1, "pp_grad")]["n"] == 4 and summary(m[(1, "pp_grad")])["sent_err"] == pytest.approx(0.25)
    line = format_line(7, m)
    assert line.startswith(" compression stats (iteration 7) | stage 0 dp: 2.0x 0.00 ms x1 | stage 1 pp_grad: 4.0x")
    assert "residual" not in line.split("|")[1]


def test_pipeline_codec_reports_exact_messages_as_exact_and_lep_residuals():
    torch.manual_seed(0)
    low = torch.randn(16, 2, 3) @ torch.randn(3, 32)  # rank 3 as a (32 x 32) matrix
    comp = PipelineGradCompressor(lazy_error_propagation=True, seed=1)
    comp.stats = CompressionStats()
    comp.encode(1, [low], 4)
    s = summary(comp.stats.snapshot()[(1, "pp_grad")])
    assert s["sent_err"] < 1e-5 and s["residual"] < 1e-5 and s["orth"] < 1e-5
    assert s["ratio"] == pytest.approx(32 * 32 / ((32 + 32) * 4))
    full = torch.randn(16, 2, 32)
    comp.encode(1, [full], 4)
    comp.encode(1, [full], 4)
    s = summary(comp.stats.snapshot()[(1, "pp_grad")])
    # A full-rank gradient loses most of itself at rank 4; the residual is kept (LEP).
    assert 0.5 < s["sent_err"] and 0.5 < s["residual"]


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)

    def flush(self):
        pass


def _train(rank, world, stats_on):
    cfg = tiny_config(world=world, pp=2, iters=4)
    cfg.compression = CompressionConfig(inter_grad_comp=True, inter_grad_comp_rank=2, use_error_feedback=True,
                                        log_compression_stats=stats_on)
    cfg.logging.log_interval = 2
    t = make_trainer(cfg)
    lines, writer = [], _Writer()
    if t.compression_stats is not None:
        report = t.compression_stats.report

        def spy(iteration, group, is_logger, _writer):
            lines.append(report(iteration, group, is_logger, writer))
        t.compression_stats.report = spy
    hist = t.train()
    return [h["loss"] for h in hist], shards(t, "param"), lines, writer.scalars


def test_stats_change_nothing_and_report_on_the_logging_rank_only():
    off = run_distributed(_train, 2, False)
    on = run_distributed(_train, 2, True)
    assert off[1][0] == on[1][0]  # losses live on the last pipeline rank
    for (_, pa, _, _), (_, pb, _, _) in zip(off, on):
        for name in pa:
            assert torch.equal(pa[name][0], pb[name][0]), name
    assert off[1][2] == []  # flag off: no report at all
    assert on[0][2] == [None, None]  # reported at iterations 2 and 4, printed by the last rank
    lines, scalars = on[1][2], on[1][3]
    assert len(lines) == 2 and all("stage 1 pp_grad:" in line and "residual" in line for line in lines)
    assert scalars["compression/stage1/pp_grad/ratio"][1] == 4
    assert scalars["compression/stage1/pp_grad/sent_err"][0] > 0
