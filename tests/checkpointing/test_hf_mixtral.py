"""Hugging Face Mixtral <-> our MoE GPT (`convert.py --from-hf/--to-hf`), with transformers
4.46.3's own code on both ends (TRANSFORMERS4_PYTHONPATH, as CI installs it): its
`MixtralForCausalLM` writes a tiny random model with `save_pretrained` and computes the
reference logits; after `--from-hf` our single-process model gives the same logits; after
`--to-hf` transformers' `AutoModelForCausalLM` loads our folder and gives them again."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not os.environ.get("TRANSFORMERS4_PYTHONPATH"),
                                reason="set TRANSFORMERS4_PYTHONPATH to a transformers 4.x install (.ci/run)")

# transformers' side, run in its own process under transformers 4.46.3.
_WRITE = r"""
import sys, torch
from transformers import MixtralConfig, MixtralForCausalLM
out = sys.argv[1]
torch.manual_seed(0)
cfg = MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                    torch_dtype="float32")
m = MixtralForCausalLM(cfg).eval()
with torch.no_grad():  # every weight moves the logits (norms are 1 at init; the router's rows tiny)
    for name, p in m.named_parameters():
        p.add_(0.2 * torch.randn_like(p))
m.save_pretrained(out, safe_serialization=True)
tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    torch.save({"tokens": tokens, "logits": m(tokens).logits}, out + "/logits.pt")
"""
_READ = r"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True, torch_dtype=torch.float32).eval()
ref = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    print(type(m).__name__, "diff=%.3e" % (m(ref["tokens"]).logits - ref["logits"]).abs().max().item())
"""


def _tf4(code, *argv):
    env = dict(os.environ, PYTHONPATH=os.environ["TRANSFORMERS4_PYTHONPATH"], HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_mixtral_from_hf_and_back_gives_transformers_logits(tmp_path):
    pytest.importorskip("safetensors")
    from tools.checkpoint import convert
    from tools.checkpoint.hf_gpt2 import our_logits
    from tools.checkpoint.reshard import read_full_model
    hf, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    _tf4(_WRITE, hf)
    ref = torch.load(hf / "logits.pt", weights_only=True)
    assert convert.main(["--from-hf", "--load", str(hf), "--save", str(ours), "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    config, full, _ = read_full_model(str(ours))
    moe = config["model"]["moe"]
    assert (moe["num_experts"], moe["router_topk"], moe["router_pre_softmax"]) == (4, 2, False)
    assert full["decoder.layers.1.mlp.experts.weight1"].shape == (4, 32, 32)
    diff = (our_logits(config["model"], full, ref["tokens"]) - ref["logits"]).abs().max().item()
    assert diff < 1e-5, diff
    assert convert.main(["--to-hf", "--load", str(ours), "--save", str(back)]) == 0
    out = _tf4(_READ, back, hf / "logits.pt")
    assert out.startswith("MixtralForCausalLM"), out
    assert float(out.split("diff=")[1]) < 1e-5, out


def test_mixtral_export_refuses_what_mixtral_cannot_hold(tmp_path):
    from megatron.config.core import ModelConfig
    from tools.checkpoint import hf_mixtral
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=100, ffn_hidden_size=16,
             swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
             moe=dict(num_experts=4, router_topk=2, router_pre_softmax=True))
    with pytest.raises(ValueError, match="--moe-router-pre-softmax"):
        hf_mixtral.to_hf({"model": m}, {})
    m["moe"] = dict(num_experts=4, shared_expert_intermediate_size=16)
    with pytest.raises(ValueError, match="shared-expert"):
        hf_mixtral._check(ModelConfig(**m))
