"""Profiler on CPU for a tiny model: file format, plausibility of times, memory vs analytic counts."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.config.core import ModelConfig
from megatron.planner.cost.cost_model import CostModel
from megatron.profiling.profiler import ProfileSpec, run_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H, HEADS, FFN, VOCAB = 32, 4, 128, 256
MBS, SEQ = [1, 8], [16, 128]


def _spec(**kw):
    model = ModelConfig(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
                        num_layers=2, seq_length=max(SEQ))
    args = dict(model=model, tps=[1], micro_batch_sizes=MBS, seq_lengths=SEQ, layers=2, warmup=1, iters=5)
    args.update(kw)
    return ProfileSpec(**args)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cm") / "tiny.json"
    run_profile(_spec(attention_split=True)).save(path)
    return CostModel.load(path), json.loads(path.read_text())


def test_file_round_trips_through_cost_model(gpt):
    cm, doc = gpt
    assert cm.kind == "gpt" and cm.tps() == [1] and cm.levels(1) == ["none", "selective", "full"]
    assert CostModel.from_dict(cm.to_dict()).to_dict() == cm.to_dict()
    for rc in cm.levels(1):
        for comp in ("encoder", "postprocess"):
            g = doc["profiles"][["none", "selective", "full"].index(rc)]["components"][comp]
            assert g["mbs"] == MBS and g["seq"] == SEQ
            for q in ("forward_ms", "backward_ms", "stored_mb", "peak_mb"):
                assert all(v is not None and v > 0 for row in g[q] for v in row), (rc, comp, q)


def test_split_backward_halves_are_timed_at_recompute_none(gpt):
    """input_grad_ms / weight_grad_ms (the zero-bubble B and W) are measured per shape where
    the split runs (layers without recompute; the head, never recomputed, at every level),
    and are absent elsewhere rather than made up."""
    cm, doc = gpt
    for prof in doc["profiles"]:
        for comp in ("encoder", "postprocess"):
            g = prof["components"][comp]
            has = "input_grad_ms" in g and "weight_grad_ms" in g
            assert has == (prof["recompute"] == "none" or comp == "postprocess"), (prof["recompute"], comp)
    for comp in ("encoder", "postprocess"):
        q = cm.layer(comp, 1, "none", MBS[-1], SEQ[-1])
        b, w, whole = float(q["input_grad_ms"]), float(q["weight_grad_ms"]), float(q["backward_ms"])
        assert b > 0 and w > 0
        # the two halves run the whole backward's kernels once each (the boundaries' weight
        # side again): far from 2x the whole, far from nothing, on a busy machine too
        assert 0.3 * whole < b + w < 3.0 * whole, (comp, b, w, whole)


def test_time_grows_from_smallest_to_largest_shape(gpt):
    cm, _ = gpt
    for comp in ("encoder", "postprocess"):
        total = lambda m, s: sum(float(cm.layer(comp, 1, rc, m, s)["forward_ms"] + cm.layer(comp, 1, rc, m, s)["backward_ms"])
                                 for rc in cm.levels(1))
        # 64x the tokens: noise from a shared CPU cannot close that gap.
        assert total(MBS[-1], SEQ[-1]) > 2 * total(MBS[0], SEQ[0]), comp


def test_stored_memory_matches_analytic_counts(gpt):
    cm, _ = gpt
    for m in MBS:
        for s in SEQ:
            sbh = s * m * H * 4 / 1e6  # one fp32 [s, b, h] tensor, MB
            st = {rc: float(cm.layer("encoder", 1, rc, m, s)["stored_mb"]) for rc in cm.levels(1)}
            # Full recompute keeps only the layer input.
            assert st["full"] == pytest.approx(sbh, rel=1e-3, abs=1e-4)
            # Selective still keeps every GEMM/LN/GeLU input: input, LN1 out, QKV (3), context,
            # residual, LN2 out, 4h pre- and post-GeLU (4 + 4) = 16 hidden-sized tensors at least.
            assert st["selective"] >= 16 * sbh * 0.999
            # Without recompute the attention probabilities [b, heads, s, s] are kept as well.
            probs = m * HEADS * s * s * 4 / 1e6
            assert st["none"] >= st["selective"] + probs * 0.999
            for rc in st:
                assert float(cm.layer("encoder", 1, rc, m, s)["peak_mb"]) >= st[rc] * 0.999


def test_parameter_memory_is_four_bytes_per_parameter(gpt):
    cm, doc = gpt
    layer = 2 * 2 * H + (3 * H * H + 3 * H) + (H * H + H) + (H * FFN + FFN) + (FFN * H + H)
    emb = VOCAB * H + max(SEQ) * H  # 256 is already a multiple of 128: no vocabulary padding
    p = doc["parameters"]["1"]
    assert p["encoder"] == {"count": layer, "bytes": 4 * layer}
    assert p["embedding"] == {"count": emb, "bytes": 4 * emb}
    # The format's model_state_mb is 16-bit parameter memory (the planner scales it).
    assert cm.param_mb("encoder", 1) == pytest.approx(2 * layer / 1e6, abs=1e-4)
    assert cm.param_mb("embedding", 1) == pytest.approx(2 * emb / 1e6, abs=1e-4)


def test_shapes_past_the_cap_are_infeasible(tmp_path):
    spec = _spec(micro_batch_sizes=[1, 2, 4], seq_lengths=[16, 32], recompute=["full"], warmup=0, iters=1,
                 max_tokens=40)
    cm = CostModel.from_dict(run_profile(spec).to_dict())
    assert math.isfinite(float(cm.layer("encoder", 1, "full", 2, 16)["forward_ms"]))
    for m, s in ((4, 16), (2, 32), (4, 32)):
        assert all(np.isinf(v) for v in cm.layer("encoder", 1, "full", m, s).values()), (m, s)


def test_t5_decoder_on_two_tensor_parallel_ranks():
    model = ModelConfig(model_type="t5", hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                        vocab_size=VOCAB, encoder_num_layers=1, decoder_num_layers=1, encoder_seq_length=32,
                        decoder_seq_length=16)
    spec = ProfileSpec(model=model, tps=[2], micro_batch_sizes=[2], seq_lengths=[32], decoder_seq_lengths=[16],
                       recompute=["full"], layers=1, warmup=0, iters=1)
    cm = CostModel.from_dict(run_profile(spec).to_dict())
    d = cm.layer("decoder", 2, "full", 2, 32, 16)
    # The decoder layer owns its [dec, b, h] input; the shared encoder output is not counted.
    assert float(d["stored_mb"]) == pytest.approx(16 * 2 * H * 4 / 1e6, abs=1e-4)
    assert float(d["forward_ms"]) > 0 and math.isfinite(float(cm.postprocess(2, "full", 2, 16)["backward_ms"]))
    p = cm.to_dict()["parameters"]["2"]
    half = (3 * H * H + 3 * H) // 2 + H * H // 2 + H + 2 * (H * FFN // 2) + FFN // 2 + H + 2 * H * 2
    cross = H * H // 2 + H // 2 + 2 * H * H // 2 + H + H * H // 2 + H + 2 * H
    assert p["encoder"]["count"] == half and p["decoder"]["count"] == half + cross


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "cm.json"
    base = [sys.executable, "-m", "megatron.profiling.profile_model", "--hidden-size", "32",
            "--num-attention-heads", "4", "--vocab-size", "100", "--micro-batch-sizes", "1,2",
            "--seq-lengths", "16", "--recompute", "none,full", "--num-layers-profiled", "1",
            "--warmup", "0", "--iters", "1", "--device", "cpu", "--quiet"]
    r = subprocess.run(base + ["--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cm = CostModel.load(out)
    assert cm.levels(1) == ["none", "full"] and cm.name == "cm"
    bad = subprocess.run(base + ["--tp", "3", "--output", str(tmp_path / "x.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tp" in bad.stderr and not (tmp_path / "x.json").exists()


def test_cli_profiles_the_architecture_and_training_refuses_another(tmp_path):
    from megatron.cli.arguments import _check_cost_model_matches
    from megatron.config.core import ConfigError
    out = tmp_path / "llama.json"
    cmd = [sys.executable, "-m", "megatron.profiling.profile_model", "--hidden-size", "32",
           "--num-attention-heads", "4", "--vocab-size", "100", "--micro-batch-sizes", "1",
           "--seq-lengths", "16", "--recompute", "none", "--num-layers-profiled", "1", "--warmup", "0",
           "--iters", "1", "--device", "cpu", "--quiet", "--swiglu", "--normalization", "RMSNorm",
           "--disable-bias-linear", "--position-embedding-type", "rope", "--group-query-attention",
           "--num-query-groups", "2", "--output", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    saved = CostModel.load(out).model
    assert saved["swiglu"] and saved["normalization"] == "RMSNorm" and saved["num_query_groups"] == 2
    llama = dict(hidden_size=32, num_attention_heads=4, vocab_size=100, num_layers=2, seq_length=16,
                 ffn_hidden_size=128, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                 position_embedding_type="rope", num_query_groups=2)
    _check_cost_model_matches(str(out), ModelConfig(**llama))  # the same architecture: accepted
    with pytest.raises(ConfigError, match="swiglu True vs False"):
        _check_cost_model_matches(str(out), ModelConfig(**dict(llama, swiglu=False)))


def test_attention_split_measured_with_the_varlen_kernel(gpt):
    """attention_split=True (--attention-split): the per-document attention term is measured
    (packed rows of 1 vs 4 documents, variable-length kernel) and stored in the file."""
    import torch

    from megatron.fused_kernels import ops
    from megatron.planner.cost.attention_cost import AttentionCost
    if not ops.use_fused(torch.zeros(1)):
        pytest.skip("no variable-length kernel built on this machine")
    cm, doc = gpt
    ac = AttentionCost(cm)
    for rc in ("none", "selective", "full"):
        for q in ("forward_ms", "backward_ms"):
            sp = ac.split(1, rc, "encoder", q)
            assert sp.source.startswith("doc_quad measured") and sp.coef["doc_quad"] >= 0.0
    assert doc["version"] == 2 and "attention_split" in doc["profiles"][0]["components"]["encoder"]
    # packed rows are priced with it: never above the dense row
    one = ac.packed_layer("encoder", 1, "none", 1, 128, quad=128.0 ** 2)["forward_ms"]
    many = ac.packed_layer("encoder", 1, "none", 1, 128, quad=4 * 32.0 ** 2)["forward_ms"]
    assert float(many) <= float(one) <= float(cm.layer("encoder", 1, "none", 1, 128)["forward_ms"])
