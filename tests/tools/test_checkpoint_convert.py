"""tools/checkpoint/convert.py: re-split GPT checkpoints between TP/PP layouts, bit for bit."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, make_trainer, shards, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
ARCHES = {"gpt2": {}, "llama": dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                                    position_embedding_type="rope", num_query_groups=2)}


def _train_save(rank, world, ckpt, kw):
    t = make_trainer(tiny_config(world=world, iters=2, save=ckpt, **kw))
    t.train()
    save_checkpoint(t)
    return shards(t, "param"), t.history_loss if hasattr(t, "history_loss") else None


def _load_params(rank, world, ckpt, kw):
    t = make_trainer(tiny_config(world=world, iters=3, load=ckpt, **kw))
    assert load_checkpoint(t)
    out = shards(t, "param")
    step = t.train_step()  # a converted checkpoint trains on (fresh optimizer)
    return out, step["loss"], t.iteration


def _convert(src, dst, tp, pp):
    r = subprocess.run([sys.executable, TOOL, "--load", src, "--save", dst, "--target-tensor-parallel-size",
                        str(tp), "--target-pipeline-parallel-size", str(pp)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_tp2pp2_to_tp1_and_back_is_bit_identical(tmp_path, arch):
    kw = dict(tp=2, pp=2, arch=ARCHES[arch])
    a, b, c = (str(tmp_path / x) for x in "abc")
    saved = run_distributed(_train_save, 4, a, kw)
    full = assemble([p for p, _ in saved])
    assert "TP 2 x PP 2 -> TP 1 x PP 1" in _convert(a, b, 1, 1)
    ((single, loss1, it),) = run_distributed(_load_params, 1, b, dict(arch=ARCHES[arch]))
    assert it == 3  # resumed at iteration 2, stepped once
    got = assemble([single])
    assert set(got) == set(full)
    for name in full:
        assert torch.equal(got[name], full[name]), name
    _convert(b, c, 2, 2)
    back = run_distributed(_load_params, 4, c, kw)
    again = assemble([p for p, _, _ in back])
    for name in full:
        assert torch.equal(again[name], full[name]), name
    # The resumed step's loss (computed on the loaded weights) is the original layout's, exactly for
    # the round trip and within fp32 rounding of the other reduction order at TP1.
    orig = run_distributed(_load_params, 4, a, kw)
    orig_loss = next(loss for _, loss, _ in orig if loss == loss)
    assert next(loss for _, loss, _ in back if loss == loss) == orig_loss
    assert loss1 == pytest.approx(orig_loss, rel=1e-5)


def test_refuses_bad_targets_and_existing_output(tmp_path):
    a = str(tmp_path / "a")
    run_distributed(_train_save, 1, a, {})
    r = subprocess.run([sys.executable, TOOL, "--load", a, "--save", a, "--target-tensor-parallel-size", "1",
                        "--target-pipeline-parallel-size", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "already holds a checkpoint" in r.stderr
    r = subprocess.run([sys.executable, TOOL, "--load", a, "--save", str(tmp_path / "b"),
                        "--target-tensor-parallel-size", "3", "--target-pipeline-parallel-size", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "does not divide" in r.stderr


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_hugging_face_round_trip_and_logits(tmp_path, arch):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    a, hf, back = (str(tmp_path / x) for x in ("a", "hf", "back"))
    kw = dict(tp=2, pp=2, arch=ARCHES[arch])
    saved = run_distributed(_train_save, 4, a, kw)
    full = assemble([p for p, _ in saved])
    r = subprocess.run([sys.executable, TOOL, "--load", a, "--save", hf, "--to-hf", "--verify"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    diff = float(r.stdout.split("max_abs_logit_diff=")[1].split()[0])
    assert diff < 1e-4, r.stdout
    # Special token ids name tokens inside the vocabulary (GPT2Config's default 50256 would not).
    assert "within the vocabulary" not in r.stdout + r.stderr, r.stderr
    with open(os.path.join(hf, "config.json")) as f:
        hf_config = json.load(f)
    for k in ("bos_token_id", "eos_token_id"):
        assert hf_config.get(k) is None or 0 <= hf_config[k] < hf_config["vocab_size"], hf_config
    assert ("LlamaForCausalLM" if arch == "llama" else "GPT2LMHeadModel") in r.stdout
    r = subprocess.run([sys.executable, TOOL, "--load", hf, "--save", back, "--from-hf", "--verify",
                        "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                        "--make-vocab-size-divisible-by", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("max_abs_logit_diff=")[1].split()[0]) < 1e-4
    again = assemble([p for p, _, _ in run_distributed(_load_params, 4, back, kw)])
    for name in full:  # ours -> HF -> ours is bit-identical
        assert torch.equal(again[name], full[name]), name


def test_gpt2_export_names_the_tokenizers_end_of_text():
    """bos/eos in the exported GPT-2 config: the training tokenizer's eod, GPT-2's 50256 when the
    vocabulary holds it, else None (never an id outside the vocabulary)."""
    from tools.checkpoint.hf_gpt2 import boundary_token_id
    assert boundary_token_id({"data": {}}, 50257) == 50256
    assert boundary_token_id({"data": {}}, 128) is None
    assert boundary_token_id({"data": {"tokenizer_type": "NullTokenizer"}}, 128) == 127
    missing = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/nonexistent/vocab.json", "merge_file": "x"}
    assert boundary_token_id({"data": missing}, 50257) == 50256
    assert boundary_token_id({"data": dict(missing, tokenizer_type="SentencePieceTokenizer")}, 50257) is None
