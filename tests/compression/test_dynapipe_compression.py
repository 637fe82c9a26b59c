"""DynaPipe (variable micro-batch shapes) with Optimus-CC: compressed backpropagation with lazy
error propagation, PowerSGD over DP, the fused embedding sync and its low-rank variant. At
full rank (tests/compression/lossless.py) every compression is exact, so the losses, the first
step's gradients and the parameters equal plain --dynapipe's on the same batches; the
simulator charges the compressed messages at the bytes the executor sends."""
import dataclasses

import numpy as np
import pytest

from megatron.config.core import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.training.test_dynapipe_training import VOCAB, _write
    d = tmp_path_factory.mktemp("dyncomp")
    rng = np.random.RandomState(0)
    lin = np.clip(rng.lognormal(2.6, 0.8, 200).astype(int), 2, 60)
    lout = np.clip(rng.lognormal(1.8, 0.7, 200).astype(int), 1, 30)
    _write(str(d / "in"), [rng.randint(0, VOCAB, k) for k in lin])
    _write(str(d / "out"), [rng.randint(0, VOCAB, k) for k in lout])
    return str(d / "in"), str(d / "out")


def _run(rank, world, data, pp, comp=None, lossless=False, training=None):
    import tests.training.test_dynapipe_training as T
    from tests.compression import lossless as L
    if lossless:
        L.lossless()
    counts = L.counting()
    orig = T._cfg

    def cfg(*a, **k):
        c = orig(*a, **k)
        if training:
            c = dataclasses.replace(c, training=dataclasses.replace(c.training, **training))
        # replace() validates again: the combination must pass the configuration's checks.
        return dataclasses.replace(c, compression=CompressionConfig(**comp)) if comp else c

    T._cfg = cfg
    try:
        out = T._train(rank, world, "gpt", data, "dynapipe", pp)
    finally:
        T._cfg = orig
    return dict(out, counts=counts)


def _shapes(outs):
    last = [o for o in outs if o["is_last"]][0]
    return {tuple(s) for i in last["info"] for s in i["microbatch_shapes"]}


@pytest.fixture(scope="module")
def plain_pp2(data):
    return run_distributed(_run, 2, data, 2)


def test_compressed_backprop_with_lep_at_full_rank_equals_plain_dynapipe(data, plain_pp2):
    outs = run_distributed(_run, 2, data, 2, dict(inter_grad_comp=True, inter_grad_comp_rank=64,
                                                  use_error_feedback=True), True)
    assert len(_shapes(outs)) > 1  # micro-batches of several shapes, each message compressed
    assert outs[1]["counts"]["pipeline"] > 0
    assert_parity(plain_pp2, outs, codec_roundings=1)


@pytest.fixture(scope="module")
def plain_pp2_dp2(data):
    return run_distributed(_run, 4, data, 2)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_powersgd_and_fused_embedding_sync_at_full_rank_equal_plain_dynapipe(data, plain_pp2_dp2, dist_opt):
    # PP2 x DP2: PowerSGD with error feedback over DP, the fused first/last-stage x DP embedding
    # sync and its low-rank reducer, all on the plans DynaPipe cuts per DP group; optionally with
    # the distributed optimizer (which clips its shard, not .grad: gradients are not compared).
    comp = dict(grad_comp=True, grad_comp_rank=64, use_error_feedback=True, emb_comm_opt=True,
                emb_grad_comp=True, emb_grad_comp_rank=64, emb_use_error_feedback=True)
    outs = run_distributed(_run, 4, data, 2, comp, True, dict(use_distributed_optimizer=dist_opt))
    assert all(o["counts"]["reducer"] > 0 for o in outs)
    assert_parity(plain_pp2_dp2, outs, compare_grads=not dist_opt, codec_roundings=1)


def test_fused_embedding_sync_alone_is_exact_on_dynapipe(data, plain_pp2_dp2):
    # PP2 x DP2: one all-reduce over the first and last stage of both DP groups, whose DynaPipe
    # plans differ; no codec, so the plain bounds hold.
    assert_parity(plain_pp2_dp2, run_distributed(_run, 4, data, 2, dict(emb_comm_opt=True)))


def test_simulator_charges_compressed_gradients_at_their_wire_bytes():
    from megatron.compression.pipeline import wire_dtypes, wire_shapes
    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    from megatron.pipeline.p2p import DTYPES
    h, r = 32, 4
    kw = dict(cost_model_path="cost_models/cpu_tiny_gpt.json", model_kind="gpt", num_layers=4, hidden_size=h,
              pipeline_parallel=2, data_parallel=1, tensor_parallel=1, memory_limit_mb=1e6, dtype="float32",
              activation_bytes=4)
    plain = DynaPipePlanner(DynaPipeConfig(**kw))
    comp = DynaPipePlanner(DynaPipeConfig(grad_compress_rank=r, **kw))
    mbs, seqs = np.array([[1.0, 2.0, 3.0]]), np.array([[8.0], [16.0], [64.0]])
    sc, sp = comp.stage_costs("none", mbs, seqs), plain.stage_costs("none", mbs, seqs)
    assert "grad_comm" not in sp
    lat = comp.cfg.link_latency_ms
    to_ms = 8 / (comp.cfg.bandwidth_gbps * 1e6)
    for i, s in enumerate(seqs[:, 0]):
        for j, b in enumerate(mbs[0]):
            shape = [(int(s), int(b), h)]
            wire = sum(int(np.prod(x)) * DTYPES[d].itemsize for x, d in
                       zip(wire_shapes(shape, r), wire_dtypes(shape, r, "float32")))
            for stage in range(2):
                assert sc["grad_comm"][stage, i, j] == pytest.approx(wire * to_ms + lat, rel=1e-9)
                # an uncompressed gradient costs what an activation does
                assert sp["comm"][stage, i, j] == pytest.approx(int(s) * int(b) * h * 4 * to_ms + lat, rel=1e-9)
    # 8 x 1 tokens: factors (8 + 32) x 4 = 160 values < 256, compressed; 64 x 3: 4x smaller wire
    assert sc["grad_comm"][0, 2, 2] - lat < (sp["comm"][0, 2, 2] - lat) / 4
