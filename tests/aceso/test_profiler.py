"""The CPU profiler writes tables the reader and the model accept, with exact sizes."""
import os
import shutil

import pytest

from megatron.aceso.db import SHIPPED_DIR, OpDatabase
from megatron.aceso.model import ModelSpec, PerfModel, Plan, Stage
from megatron.aceso.profiler import MB, profile_gpt, stage_param_mb
from megatron.config.core import ModelConfig


def test_profile_tiny_gpt(tmp_path):
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=101, make_vocab_size_divisible_by=8)
    root = str(tmp_path)
    profile_gpt(cfg, root, size="tiny", mbs_values=(1, 2), repeats=1)
    shutil.copy(os.path.join(SHIPPED_DIR, "eurosys", "p2p_intra_node.csv"), root)
    db = OpDatabase(root, "gpt", "tiny")
    assert db.mbs_values == [1, 2] and db.tp_values == [1]
    assert db.op_names[0] == "encoder-embedding" and db.op_names[-1] == "gpt-post-process"
    assert len(db.op_names) == 13
    r1, r2 = db.ops(1, 1), db.ops(2, 1)
    hid = 16 * 1 * 32 * 4 / MB
    by = {r.name: r for r in r1}
    assert by["enc-1st-layernorm"].input_mb == pytest.approx(hid, rel=1e-3)
    assert by["enc-MLP-GEMM-1"].output_mb == pytest.approx(4 * hid, rel=1e-3)
    assert {r.name: r.output_mb * 2 for r in r2[:-1]} == pytest.approx(
        {r.name: r.output_mb * 2 * 2 for r in r1[:-1]}, rel=1e-3)  # outputs scale with mbs
    parts = stage_param_mb(cfg)
    layer_w = sum(r.weight_mb for r in r1 if r.name.startswith("enc-"))
    assert layer_w == pytest.approx(parts["layer"], rel=1e-3)
    assert by["encoder-embedding"].weight_mb == pytest.approx(parts["embedding"], rel=1e-3)
    assert by["enc-attention-core"].act_mb > 0 and all(r.fwd_us > 0 and r.bwd_us > 0 for r in r1)
    # the model prices a pipeline of the tiny GPT from these tables
    spec = ModelSpec("gpt", "tiny", (4,), 32, 16, 8)
    pm = PerfModel(db, spec, memory_limit_mb=1e6)
    assert pm.num_ops == 1 + 4 * 10 + 2  # core attention is one fused op here
    p = pm.predict(Plan("gpt-tiny", 2, 8, [Stage(0, 21, 1, 1), Stage(21, 43, 1, 1)]))
    assert p.iteration_ms > 0 and p.num_micro_batches == 4
    with pytest.raises(KeyError, match="no all_gather table"):  # DP needs collective tables
        pm.predict(Plan("gpt-tiny", 2, 8, [Stage(0, 21, 1, 1), Stage(21, 43, 1, 2)]))
