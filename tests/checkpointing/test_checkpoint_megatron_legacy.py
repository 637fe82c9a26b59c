"""Checkpoints written by Megatron-LM's own code (tests/fixtures/megatron, made by
make_fixtures.py from NVIDIA/Megatron-LM core_v0.9.0) load here with the source's logits, and
what this project writes in Megatron's legacy format has the same structure as Megatron's."""
import argparse
import os

import numpy as np
import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from megatron.checkpointing.megatron_write import write_full as _write_full
from megatron.checkpointing.safety import UnsafeCheckpointError
from megatron.checkpointing.torch_format import _atomic_write_bytes
from tests.checkpointing.megatron_logits import FIX


def write_full(*a, **k):
    return _write_full(*a, atomic_write=_atomic_write_bytes, **k)


def _fields(args):
    mf = L.model_fields(args)
    mf.pop("num_query_groups")
    # Megatron's padded rows are part of its model: keep the whole table as the vocabulary.
    mf.update(vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1)
    return mf


@pytest.mark.parametrize("name,fmt", [("mcore_gpt_tp1", "core"), ("legacy_gpt_tp1", "legacy")])
def test_megatron_fixture_gives_the_source_logits(name, fmt):
    from tools.checkpoint.hf_gpt2 import our_logits
    root = os.path.join(FIX, name)
    args, full, meta = L.read_full(root)
    assert isinstance(args, argparse.Namespace) and meta["format"] == fmt
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 3
    assert meta["opt_param_scheduler"]["num_steps"] == 3 and meta["checkpoint_version"] == 3.0
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    out = our_logits(_fields(args), full, ref["tokens"])[..., :ref["logits"].shape[-1]]
    assert (out - ref["logits"]).abs().max().item() < 1e-5


def _tree(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_tree(v, f"{prefix}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = tuple(v.shape)
    return out


def test_our_writer_produces_megatrons_legacy_structure(tmp_path):
    src = os.path.join(FIX, "legacy_gpt_tp1")
    args, full, meta = L.read_full(src)
    theirs = L.safe_load_megatron(os.path.join(src, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    model = _fields(args)
    model.update(model_type="gpt")
    # The fixture comes from core_v0.9.0, whose legacy model spells its norms `*_norm`.
    out = write_full(str(tmp_path), model, full, {"iteration": 0, "consumed_samples": 0}, 1, 1, norm_names="norm")
    assert open(tmp_path / L.TRACKER).read() == "release" and out.endswith("release")
    assert os.listdir(os.path.join(out, "mp_rank_00")) == ["model_optim_rng.pt"]  # no sidecar beside it
    ours = L.safe_load_megatron(os.path.join(out, "mp_rank_00", "model_optim_rng.pt"))
    assert {"args", "checkpoint_version", "iteration", "model", "rng_state"} <= set(ours)
    assert ours["checkpoint_version"] == 3.0
    assert _tree(ours["model"]) == _tree(theirs["model"])
    for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                  "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "kv_channels"):
        assert getattr(ours["args"], field) == getattr(theirs["args"], field), field
    assert set(ours["rng_state"][0]) == set(theirs["rng_state"][0])
    # What it wrote reads back to the same tensors.
    _, again, _ = L.read_full(str(tmp_path))
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def test_writer_and_reader_agree_at_tp2_pp2(tmp_path):
    args, full, _ = L.read_full(os.path.join(FIX, "mcore_gpt_tp1"))
    model = _fields(args)
    model.update(model_type="gpt", num_layers=2)
    sched = {"max_lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 2, "decay_iters": 10, "decay_style": "cosine",
             "num_steps": 7}
    write_full(str(tmp_path), model, full, {"iteration": 7, "consumed_samples": 56, "opt_param_scheduler": sched},
                 2, 2, release=False)
    assert sorted(os.listdir(tmp_path / "iter_0000007")) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001",
                                                           "mp_rank_01_000", "mp_rank_01_001"]
    last = L.safe_load_megatron(str(tmp_path / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"))
    assert "word_embeddings_for_head" in last["model"]  # the tied head on the last stage, as Megatron
    assert set(last["opt_param_scheduler"]) == {"max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                                                "lr_decay_style", "num_steps", "start_wd", "end_wd",
                                                "wd_incr_steps", "wd_incr_style"}
    margs, again, meta = L.read_full(str(tmp_path))
    assert (meta["tp"], meta["pp"], meta["iteration"], meta["consumed_samples"]) == (2, 2, 7, 56)
    assert margs.consumed_train_samples == 56
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def _save(tmp_path, obj):
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save(obj, path)
    return path


def test_a_namespace_cannot_carry_code(tmp_path):
    path = _save(tmp_path, {"args": argparse.Namespace(num_layers=2, evil=os.system)})
    with pytest.raises(UnsafeCheckpointError, match="system"):
        L.safe_load_megatron(path)


def test_a_numpy_array_cannot_carry_code(tmp_path):
    obj_array = np.array([os.system], dtype=object)
    path = _save(tmp_path, {"rng_state": [{"np_rng_state": ("MT19937", obj_array, 0, 0, 0.0)}]})
    with pytest.raises(UnsafeCheckpointError):
        L.safe_load_megatron(path)
    # A plain uint32 array (numpy's RNG state) loads.
    ok = _save(tmp_path, {"rng_state": [{"np_rng_state": np.random.get_state()}]})
    assert L.safe_load_megatron(ok)["rng_state"][0]["np_rng_state"][1].dtype == np.uint32


def test_a_pickle_calling_a_function_is_refused(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))
    path = _save(tmp_path, {"args": argparse.Namespace(x=1), "model": {}, "boom": Boom()})
    with pytest.raises(UnsafeCheckpointError):
        L.safe_load_megatron(path)
    assert not (tmp_path / "ran").exists()


def test_model_type_enum_loads_as_a_value(tmp_path):
    # What Megatron-Core's args hold: megatron.core.enums.ModelType.encoder_or_decoder (value 1).
    state = L.safe_load_megatron(os.path.join(FIX, "mcore_gpt_tp1", "iter_0000003", "mp_rank_00",
                                              "model_optim_rng.pt"))
    assert state["args"].model_type == L.ModelType.encoder_or_decoder


def _run_cfg(world, load, tp=1, iters=5, **ckpt):
    import dataclasses
    from tests.parity_utils import tiny_config
    cfg = tiny_config(world=world, tp=tp, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=1, iters=iters, load=load,
                      arch=dict(ffn_hidden_size=64, max_position_embeddings=8))
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=16)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, **ckpt)
    return cfg


def _load_and_train(rank, world, name, tp):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer
    root = os.path.join(FIX, name)
    t = make_trainer(_run_cfg(world, root, tp=tp))
    assert load_checkpoint(t)
    out = {"iteration": t.iteration, "consumed": t.consumed_samples, "steps": t.lr_scheduler.num_steps}
    if world == 1:  # the loaded model's logits against the ones Megatron computed
        from tests.checkpointing.megatron_logits import fixture_logit_diff
        out["diff"] = fixture_logit_diff(t, root)
    t.train()
    out["after"] = t.iteration
    return out


@pytest.mark.parametrize("name,world,tp", [("mcore_gpt_tp2", 1, 1), ("legacy_gpt_tp1", 2, 2)])
def test_load_megatron_checkpoint_and_train(name, world, tp):
    from tests.dist_harness import run_distributed
    res = run_distributed(_load_and_train, world, name, tp, timeout_s=600)
    for r in res:
        assert (r["iteration"], r["consumed"], r["steps"], r["after"]) == (3, 3, 3, 5)
    if world == 1:
        assert res[0]["diff"] < 1e-5


def _finetune(rank, world):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer
    t = make_trainer(_run_cfg(world, os.path.join(FIX, "mcore_gpt_tp1"), iters=2, finetune=True))
    assert load_checkpoint(t)
    return t.iteration, t.consumed_samples


def test_finetune_starts_counters_at_zero():
    from tests.dist_harness import run_distributed
    assert run_distributed(_finetune, 1, timeout_s=600) == [(0, 0)]


def test_convert_from_and_to_megatron(tmp_path):
    from tools.checkpoint import convert
    src = os.path.join(FIX, "mcore_gpt_tp2")
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert.main(["--from-megatron", "--load", src, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "2"]) == 0
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "1"]) == 0
    _, a, _ = L.read_full(src)
    _, b, meta = L.read_full(back)
    assert meta["release"] and a.keys() == b.keys()
    vocab = 101  # NullTokenizer: Megatron's --vocab-size 100 plus its end-of-document id
    for k in a:
        n = vocab if "word_embeddings" in k else None
        assert torch.equal(a[k][:n], b[k][:n]), k


def _train_save(rank, world, root):
    import dataclasses
    from megatron.checkpointing.torch_format import save_checkpoint
    from tests.parity_utils import make_trainer, shards, tiny_config
    cfg = tiny_config(world=world, pp=2, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=2, iters=2, save=root)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, ckpt_format="megatron-legacy")
    t = make_trainer(cfg)
    t.train()
    save_checkpoint(t)
    return shards(t)


def _load_tp1(rank, world, root):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, shards, tiny_config
    t = make_trainer(tiny_config(world=world, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=2, iters=3, load=root))
    assert load_checkpoint(t)
    return shards(t), t.iteration, t.consumed_samples


def test_ckpt_format_megatron_legacy_writes_megatrons_files(tmp_path):
    from tests.dist_harness import run_distributed
    from tests.parity_utils import assemble
    root = str(tmp_path / "ckpt")
    saved = assemble(run_distributed(_train_save, 2, root, timeout_s=600))
    it_dir = os.path.join(root, "iter_0000002")
    assert sorted(os.listdir(it_dir)) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
    first = L.safe_load_megatron(os.path.join(it_dir, "mp_rank_00_000", "model_optim_rng.pt"))
    last = L.safe_load_megatron(os.path.join(it_dir, "mp_rank_00_001", "model_optim_rng.pt"))
    assert set(first["model"]["language_model"]) == {"embedding", "encoder"}
    assert "word_embeddings_for_head" in last["model"] and set(last["model"]["language_model"]) == {"encoder"}
    assert "final_layernorm.weight" in last["model"]["language_model"]["encoder"]
    a = first["args"]
    assert (a.iteration, a.consumed_train_samples, a.pipeline_model_parallel_size, a.padded_vocab_size) \
        == (2, 4, 2, 104)
    assert isinstance(first["rng_state"], list) and "np_rng_state" in first["rng_state"][0]
    assert first["opt_param_scheduler"]["num_steps"] == 2 * 2  # Megatron counts samples: iterations x batch
    # Read back at another layout (PP2 -> PP1) through --load: the same weights and counters.
    (got, iteration, consumed), = run_distributed(_load_tp1, 1, root, timeout_s=600)
    got = assemble([got])
    assert (iteration, consumed) == (2, 4)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    # A flipped byte is caught by the manifest.
    path = os.path.join(it_dir, "mp_rank_00_001", "model_optim_rng.pt")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(L.MegatronCheckpointError, match="corrupted"):
        L.read_full(root)


# transformers' convert_megatron_gpt2_checkpoint.py and Megatron-LM's load_checkpoint are run on our
# files as their users run them (the script's command line, GPT-2 tokenizer flags) in
# tests/checkpointing/test_megatron_tools_read_ours.py.


def test_model_type_with_a_foreign_value_is_refused(tmp_path, monkeypatch):
    import enum
    import sys
    import types
    fake = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        bogus = 99
    ModelType.__module__, ModelType.__qualname__ = "megatron.core.enums", "ModelType"
    fake.ModelType = ModelType
    monkeypatch.setitem(sys.modules, "megatron.core.enums", fake)
    path = _save(tmp_path, {"args": argparse.Namespace(model_type=ModelType.bogus)})
    monkeypatch.delitem(sys.modules, "megatron.core.enums")
    with pytest.raises((UnsafeCheckpointError, ValueError)):
        L.safe_load_megatron(path)


def test_megatron_without_bias_gelu_fusion_computes_exact_gelu():
    """The fixtures ran with --no-bias-gelu-fusion: Megatron's MLP then uses the exact (erf) GeLU,
    and its args say so; the tanh form (its fused kernel's, HF GPT-2's) lands measurably further off."""
    from tools.checkpoint.hf_gpt2 import our_logits
    root = os.path.join(FIX, "mcore_gpt_tp1")
    args, full, _ = L.read_full(root)
    assert args.bias_gelu_fusion is False and L.model_fields(args)["activation_func"] == "gelu-erf"
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    n = ref["logits"].shape[-1]
    exact = (our_logits(_fields(args), full, ref["tokens"])[..., :n] - ref["logits"]).abs().max().item()
    tanh = (our_logits({**_fields(args), "activation_func": "gelu"}, full, ref["tokens"])[..., :n]
            - ref["logits"]).abs().max().item()
    assert exact < 5e-7 and tanh > 3 * exact, (exact, tanh)
