"""tools/checkpoint/convert.py on T5: re-split between TP/PP layouts (encoder/decoder split rank)
bit for bit, resume with the same losses, and the Hugging Face T5ForConditionalGeneration
round trip with logits parity (skipped without transformers/safetensors)."""
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron.config.core import ModelConfig
from tests.dist_harness import run_distributed
from tests.training.test_t5_parity import VOCAB, _assemble, _shards, tiny_t5_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
# What HF T5 can hold: relative positions, RMSNorm, no linear biases (GeLU-tanh or gated SiLU FFN).
HF_ARCH = dict(normalization="RMSNorm", add_bias_linear=False, kv_channels=16, ffn_hidden_size=64)


def _cfg(world, tp=1, pp=1, split=None, arch=None, save=None, load=None, iters=2):
    cfg = tiny_t5_config(world=world, tp=tp, pp=pp, split=split, iters=iters)
    if arch:
        cfg.model = ModelConfig(**{**dataclasses.asdict(cfg.model), **arch})
    cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.no_load_optim = save, load, True
    return cfg


def _trainer(cfg):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.t5_builder import build_t5_trainer
    p = cfg.parallel
    ps = initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                   timedelta(minutes=p.distributed_timeout_minutes))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    return build_t5_trainer(cfg, ps, torch.device("cpu"))


def _train_save(rank, world, ckpt, kw):
    from megatron.checkpointing.torch_format import save_checkpoint
    t = _trainer(_cfg(world, save=ckpt, **kw))
    t.train()
    save_checkpoint(t)
    return _shards(t, "param")


def _resume(rank, world, ckpt, kw, steps=2):
    """Load `ckpt` (fresh optimizer, as a converted checkpoint has none) and train `steps` more."""
    from megatron.checkpointing.torch_format import load_checkpoint
    t = _trainer(_cfg(world, load=ckpt, iters=2 + steps, **kw))
    assert load_checkpoint(t)
    params, copies = _shards(t, "param")
    losses = [t.train_step()["loss"] for _ in range(steps)]
    return {"params": params, "copies": copies, "losses": losses, "iteration": t.iteration,
            "is_last": rank == world - 1}


def _tool(*args, cli=False):
    """Run convert.py: as a command (cli=True) or, faster (transformers imported once), its main()."""
    args = [str(a) for a in args]
    if cli:
        return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300)
    from tools.checkpoint import convert
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = convert.main(args)
        except SystemExit as e:
            rc = e.code
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def _convert(src, dst, tp, pp, split=None, cli=False):
    extra = ["--target-pipeline-model-parallel-split-rank", split] if split is not None else []
    r = _tool("--load", src, "--save", dst, "--target-tensor-parallel-size", tp,
              "--target-pipeline-parallel-size", pp, *extra, cli=cli)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _check_copies(out):
    """Every tied copy (split-rank embedding, last-stage LM head) equals the word embedding."""
    params, copies = _assemble([o["params"] for o in out]), _assemble([o["copies"] for o in out])
    for name, t in copies.items():
        orig = "embedding.word_embeddings.weight" if "word_embeddings" in name or "output_layer" in name \
            else name.split(":", 1)[1]
        assert torch.equal(t, params[orig]), name
    return params


def _last(outs):
    return [o for o in outs if o["is_last"]][0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A T5 trained 2 iterations at TP2 x PP2 (split 1) and saved: (folder, full parameters)."""
    a = str(tmp_path_factory.mktemp("t5") / "a")
    main, _ = zip(*run_distributed(_train_save, 4, a, dict(tp=2, pp=2, split=1)))
    return a, _assemble(list(main))


def _same(got, full):
    assert set(got) == set(full)
    for name in full:
        assert torch.equal(got[name], full[name]), name


def test_t5_tp2pp2_to_tp1_and_back_is_bit_identical_and_resumes(trained, tmp_path):
    a, full = trained
    b, c = str(tmp_path / "b"), str(tmp_path / "c")
    kw = dict(tp=2, pp=2, split=1)
    assert "TP 2 x PP 2 -> TP 1 x PP 1" in _convert(a, b, 1, 1, cli=True)
    (single,) = run_distributed(_resume, 1, b, {})
    _same(_check_copies([single]), full)
    _convert(b, c, 2, 2, split=1)
    back = run_distributed(_resume, 4, c, kw)
    _same(_check_copies(back), full)
    # Resuming: the original layout (fresh optimizer) and the round-tripped one train identically;
    # the TP1 copy follows within fp32 rounding of the different reduction order.
    orig = run_distributed(_resume, 4, a, kw)
    assert _last(orig)["iteration"] == _last(back)["iteration"] == single["iteration"] == 4
    assert _last(back)["losses"] == _last(orig)["losses"]
    assert single["losses"] == pytest.approx(_last(orig)["losses"], rel=1e-5)


def test_t5_reshard_moves_the_split_rank(trained, tmp_path):
    """TP2 x PP2 (split 1) -> PP4 with the decoder from rank 2; a split that does not divide the
    encoder layers is refused naming the flag."""
    a, full = trained
    b = str(tmp_path / "b")
    _convert(a, b, 1, 4, split=2)
    _same(_check_copies(run_distributed(_resume, 4, b, dict(pp=4, split=2), 0)), full)
    r = _tool("--load", a, "--save", str(tmp_path / "c"), "--target-tensor-parallel-size", 1,
              "--target-pipeline-parallel-size", 4, "--target-pipeline-model-parallel-split-rank", 3)
    assert r.returncode == 1 and "--encoder-num-layers" in r.stderr, r.stderr


# -- Hugging Face ------------------------------------------------------------------------------
def _hf_model(folder, ffn="gated-silu", scale=False, seed=0, untied=False):
    """A small random HF T5 saved to `folder`: tiny_t5_config's sizes except d_kv = 16 (a power of 4,
    so folding 1/sqrt(d_kv) into the query weights is exact both ways) and d_ff = 64. `untied`
    writes an lm_head.weight of its own, as T5 v1.1 / Flan-T5 checkpoints have (transformers 5
    builds T5 with the head tied but loads a differing lm_head.weight untied)."""
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    c = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                 feed_forward_proj=ffn, **({} if scale else {"tie_word_embeddings": False}))
    model = T5ForConditionalGeneration(c)
    with torch.no_grad():  # HF initialises norms to 1; make them matter
        for n, prm in model.named_parameters():
            if "layer_norm" in n:
                prm.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    if untied:
        path = os.path.join(folder, "model.safetensors")
        sd = load_file(path)
        sd["lm_head.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(seed + 7))
        save_file(sd, path, metadata={"format": "pt"})


def _diff(r):
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split("max_abs_logit_diff=")[1].split()[0])


def _from_hf(hf, out, *extra):
    return _tool("--load", hf, "--save", out, "--from-hf", "--verify", "--target-tensor-parallel-size", 2,
                 "--target-pipeline-parallel-size", 2, "--make-vocab-size-divisible-by", 8,
                 "--encoder-seq-length", 16, "--decoder-seq-length", 8, *extra)


# HF feed_forward_proj (and whether lm_head is its own table) -> our model fields.
HF_FFN = {"gated_silu": ("gated-silu", False, dict(swiglu=True)),
          "gelu_tanh": ("gelu_pytorch_tanh", False, {}),
          "relu_t5": ("relu", False, dict(activation_func="relu")),  # the original T5
          "gated_gelu_untied_flan_t5": ("gated-gelu", True, dict(gated_linear_unit=True,
                                                                 untie_embeddings_and_output_weights=True))}


@pytest.mark.parametrize("name", sorted(HF_FFN))
def test_t5_hugging_face_round_trip_and_logits(tmp_path, name):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from tools.checkpoint.reshard import read_full_model
    ffn, untied, fields = HF_FFN[name]
    gated = ffn.startswith("gated")
    hf0, ours, hf1, again = (str(tmp_path / x) for x in ("hf0", "ours", "hf1", "again"))
    _hf_model(hf0, ffn, untied=untied)
    assert _diff(_from_hf(hf0, ours)) < 1e-4  # HF -> ours TP2 x PP2 (split 1)
    (cfg, _, _) = read_full_model(ours)
    for k, v in fields.items():
        assert cfg["model"][k] == v, k
    arch = dict(HF_ARCH, **fields)
    if gated:  # the converted checkpoint loads and trains in our T5 at TP2 x PP2
        out = run_distributed(_resume, 4, ours, dict(tp=2, pp=2, split=1, arch=arch), 1)
        assert _last(out)["iteration"] == 1 and _last(out)["losses"][0] > 0
        _check_copies(out)
    r = _tool("--load", ours, "--save", hf1, "--to-hf", "--verify", cli=name == "gated_silu")  # the CLI once
    assert _diff(r) < 1e-4 and "T5ForConditionalGeneration" in r.stdout
    a, b = load_file(os.path.join(hf0, "model.safetensors")), load_file(os.path.join(hf1, "model.safetensors"))
    for k in a:  # HF -> ours -> HF is bit-identical
        assert torch.equal(a[k], b[k]), k
    assert set(b) - set(a) <= {"lm_head.weight"}
    assert torch.equal(b["lm_head.weight"], a["lm_head.weight"] if untied else a["shared.weight"])
    with open(os.path.join(hf1, "config.json")) as f:
        assert json.load(f)["feed_forward_proj"] == ffn
    assert _diff(_from_hf(hf1, again)) < 1e-4  # ours (TP2 x PP2) -> HF -> ours is bit-identical
    (_, x, _), (_, y, _) = read_full_model(ours), read_full_model(again)
    _same(y, x)


def test_t5_hugging_face_scaled_head_is_folded(tmp_path):
    """An HF T5 that scales the decoder output by d_model**-0.5 (original T5 configs) imports with
    the factor folded into the decoder's final norm, and exports back without it."""
    pytest.importorskip("transformers")
    hf0, ours, hf1 = (str(tmp_path / x) for x in ("hf0", "ours", "hf1"))
    _hf_model(hf0, "relu", scale=True, seed=1)  # the original T5: ReLU, scaled tied head
    assert _diff(_from_hf(hf0, ours)) < 1e-4
    assert _diff(_tool("--load", ours, "--save", hf1, "--to-hf", "--verify")) < 1e-4


def test_t5_to_hf_refuses_what_hf_cannot_express(trained, tmp_path):
    """Our trained default T5 (LayerNorm, biases, one relative-bias table per layer, an LM-head
    bias) cannot be written as HF T5: one line names every difference, nothing is written."""
    pytest.importorskip("transformers")
    a, _ = trained
    out = str(tmp_path / "hf")
    r = _tool("--load", a, "--save", out, "--to-hf")
    assert r.returncode == 1, r.stdout
    msg = r.stderr.strip()
    assert len(msg.splitlines()) == 1 and "cannot express this T5" in msg
    for what in ("--normalization LayerNorm", "linear biases", "--disable-bias-linear",
                 "per-layer relative attention bias tables", "non-zero LM-head bias"):
        assert what in msg, msg
    assert not os.path.exists(out)


@pytest.mark.parametrize("ffn", ["gelu", "gated-gelu_fast", "silu"])
def test_t5_from_hf_refuses_an_activation_we_do_not_compute(ffn):
    """HF's plain "gelu" is the exact erf GeLU (ours is the tanh one): refused naming it."""
    from tools.checkpoint import hf_t5
    with pytest.raises(ValueError, match=f"feed_forward_proj '{ffn}'.*relu, gated-relu"):
        hf_t5.from_hf({"feed_forward_proj": ffn}, {})
