"""Megatron-LM's optimizer and RNG state resume here (fixtures by make_optim_fixtures.py from
NVIDIA/Megatron-LM core_v0.9.0): after --load, one more step on the batch Megatron took as its
4th gives the logits Megatron computed after that step; a fresh optimizer does not."""
import argparse
import os
import random

import numpy as np
import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from megatron.checkpointing import megatron_optim as O
from megatron.checkpointing.safety import UnsafeCheckpointError

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")


class _Batch:
    """The stored global batch at positions consumed .. consumed + gbs - 1 of a dataset."""

    def __init__(self, batch: torch.Tensor, consumed: int):
        self.batch, self.consumed = batch, consumed

    def __len__(self):
        return self.consumed + self.batch.shape[0]

    def __getitem__(self, i):
        return {"text": self.batch[i - self.consumed].numpy()}


def _padded(root):
    return L.safe_load_megatron(os.path.join(root, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))[
        "args"].padded_vocab_size


def _cfg(world, root, tp, gbs, dist_opt, **ckpt):
    import dataclasses
    from tests.parity_utils import tiny_config
    cfg = tiny_config(world=world, tp=tp, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=gbs, iters=4, load=root,
                      arch=dict(ffn_hidden_size=64, max_position_embeddings=8))
    # Megatron's padded rows take part in its softmax; this project's loss covers --vocab-size
    # columns only: the whole padded table is the vocabulary here (as test_checkpoint_megatron_legacy).
    cfg.model = dataclasses.replace(cfg.model, vocab_size=_padded(root), make_vocab_size_divisible_by=1)
    cfg.training = dataclasses.replace(cfg.training, lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_iters=10,
                                       lr_decay_style="cosine", weight_decay=0.01, clip_grad=1.0,
                                       use_distributed_optimizer=dist_opt)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, **ckpt)
    return cfg


def _step4(rank, world, name, tp, dist_opt, ckpt):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, shards
    root = os.path.join(FIX, name)  # (an absolute `name` stays as it is)
    ref = torch.load(os.path.join(root, "step4.pt"), weights_only=True)
    gbs = ref["batch"].shape[0]
    t = make_trainer(_cfg(world, root, tp, gbs, dist_opt, **ckpt))
    assert load_checkpoint(t)
    rng = (random.random(), float(np.random.rand()), torch.rand(1).item())
    t.batch_source.dataset = _Batch(ref["batch"], t.consumed_samples)
    out = t.train_step()
    return {"loss": out["loss"], "shards": shards(t), "iteration": t.iteration, "rng": rng}


def _run(name, world, tp, dist_opt=False, **ckpt):
    from tests.dist_harness import run_distributed
    from tests.parity_utils import assemble
    from tools.checkpoint.hf_gpt2 import our_logits
    res = run_distributed(_step4, world, name, tp, dist_opt, ckpt, timeout_s=600)
    root = os.path.join(FIX, name)
    args, _, _ = L.read_full(root)
    full = assemble([r["shards"] for r in res])
    fields = L.model_fields(args)
    fields.pop("num_query_groups")
    fields.update(vocab_size=101, make_vocab_size_divisible_by=1)
    ref = torch.load(os.path.join(root, "step4.pt"), weights_only=True)
    logits = our_logits(fields, full, ref["tokens"])[..., :ref["logits"].shape[-1]]
    loss = [r["loss"] for r in res if r["loss"] == r["loss"]][-1]
    return (logits - ref["logits"]).abs().max().item(), abs(loss - ref["loss"]), res


@pytest.mark.parametrize("name,world,tp,dist_opt", [
    ("optim_gpt_tp1", 1, 1, False),     # FP32Optimizer -> ours at TP1
    ("optim_gpt_tp2", 2, 2, False),     # TP2 source (one optimizer per TP rank) -> ours at TP2
    ("optim_gpt_tp2", 1, 1, True),      # ... -> ours at TP1 with the distributed optimizer
    ("distopt_gpt_dp2", 2, 1, True),    # distrib_optim.pt (DP 2) -> ours at DP2, distributed
    ("distopt_gpt_dp2", 2, 2, False),   # ... -> ours at TP2, plain optimizer
    ("optim_legacy_gpt_tp1", 1, 1, False),  # legacy model's nested names
])
def test_step_after_load_matches_megatrons_next_step(name, world, tp, dist_opt):
    diff, dloss, res = _run(name, world, tp, dist_opt)
    assert res[0]["iteration"] == 4
    assert dloss < 1e-5, dloss
    assert diff < 1e-5, diff


def test_a_fresh_optimizer_does_not_match():
    diff, dloss, _ = _run("optim_gpt_tp1", 1, 1, no_load_optim=True)
    assert diff > 1e-3  # the weights and the loss before the step are Megatron's; the step is not
    assert dloss < 1e-5


def test_rng_state_is_megatrons_unless_no_load_rng():
    st = L.safe_load_megatron(os.path.join(FIX, "optim_gpt_tp1", "iter_0000003", "mp_rank_00",
                                           "model_optim_rng.pt"))["rng_state"][0]
    random.setstate(st["random_rng_state"])
    np.random.set_state(st["np_rng_state"])
    torch.set_rng_state(st["torch_rng_state"])
    want = (random.random(), float(np.random.rand()), torch.rand(1).item())
    _, _, res = _run("optim_gpt_tp1", 1, 1)
    assert res[0]["rng"] == want
    _, _, res = _run("optim_gpt_tp1", 1, 1, no_load_rng=True)
    assert res[0]["rng"] != want


def test_bf16_main_params_and_moments_are_read():
    """Float16OptimizerWithFloat16Params: the fp32 main params replace the bf16 weights."""
    c = O.Collector()
    args, full, meta = L.read_full(os.path.join(FIX, "optim_gpt_bf16"), on_state=c)
    assert args.bf16
    states, step = c.full(args, 1, 1)
    assert step == 3.0 and set(states) == {"exp_avg", "exp_avg_sq", "param"}
    w = full["embedding.word_embeddings.weight"]
    assert w.dtype == torch.bfloat16 and states["param"]["embedding.word_embeddings.weight"].dtype == torch.float32
    assert torch.equal(states["param"]["embedding.word_embeddings.weight"].to(torch.bfloat16), w)


def test_group_order_is_megatrons():
    st = L.safe_load_megatron(os.path.join(FIX, "optim_gpt_tp1", "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    groups = O.group_order([st["model"]])
    assert [len(g) for g in groups] == [len(g["params"]) for g in st["optimizer"]["param_groups"]] == [10, 18]
    # Megatron-Core registers linear_proj before linear_qkv: the order is the module's, not alphabetical.
    names = [n for _, _, n, _ in groups[0]]
    assert names.index("decoder.layers.0.self_attention.linear_proj.weight") < \
        names.index("decoder.layers.0.self_attention.linear_qkv.weight")


def _copy(tmp_path, name):
    import shutil
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), dst)
    return dst


def test_a_misordered_optimizer_is_refused(tmp_path):
    root = _copy(tmp_path, "optim_gpt_tp1")
    path = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    st = L.safe_load_megatron(str(path))
    st["args"].model_type = None  # the local stand-in enum would not pickle under Megatron's name
    st["optimizer"]["param_groups"][0]["params"].append(st["optimizer"]["param_groups"][1]["params"].pop())
    torch.save(st, path)
    with pytest.raises(L.MegatronCheckpointError, match="not Megatron's default grouping"):
        L.read_full(str(root), on_state=O.Collector())
    L.read_full(str(root), on_state=O.Collector(read_optim=False))  # --no-load-optim: not even parsed


def test_distrib_optim_of_the_wrong_size_is_refused(tmp_path):
    root = _copy(tmp_path, "distopt_gpt_dp2")
    path = root / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"
    st = torch.load(path, weights_only=True)
    buf = next(iter(st[0].values()))
    for k in ("param", "exp_avg", "exp_avg_sq"):
        buf[k] = buf[k][:-64]
    buf["numel_unpadded"] -= 64
    torch.save(st, path)
    with pytest.raises(L.MegatronCheckpointError, match="layout not understood"):
        L.read_full(str(root), on_state=O.Collector())


def test_a_hostile_distrib_optim_is_refused(tmp_path):
    root = _copy(tmp_path, "distopt_gpt_dp2")
    path = root / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))
    torch.save({"buckets_coalesced": True, 0: {"x": Boom()}}, path)
    with pytest.raises(UnsafeCheckpointError):
        L.read_full(str(root), on_state=O.Collector())
    assert not (tmp_path / "ran").exists()
    torch.save({"buckets_coalesced": True, 0: {"x": np.array([argparse.Namespace()], dtype=object)}}, path)
    with pytest.raises(UnsafeCheckpointError):
        L.read_full(str(root), on_state=O.Collector())


def test_buffer_layout_pads_each_parameter_to_64_and_drops_bucket_ends():
    names = [("a", 10, False), ("b", 100, False), ("c", 3, False)]
    off, total = O.buffer_offsets(names, dp=2, bucket_size=None)
    assert off == {"c": 0, "b": 64, "a": 192} and total == 202
    off, total = O.buffer_offsets(names, dp=2, bucket_size=50)  # b fills a bucket: a starts the next
    assert off == {"c": 0, "b": 64, "a": 164} and total == 174


def _load_save(rank, world, name, tp, dist_opt, save):
    """Megatron's fixture -> ours (optimizer resumed) -> --ckpt-format megatron-legacy at iteration 3."""
    import dataclasses
    from megatron.checkpointing.torch_format import load_checkpoint, save_checkpoint
    from tests.parity_utils import make_trainer
    root = os.path.join(FIX, name)
    gbs = torch.load(os.path.join(root, "step4.pt"), weights_only=True)["batch"].shape[0]
    cfg = _cfg(world, root, tp, gbs, dist_opt)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, save=save, ckpt_format="megatron-legacy")
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    save_checkpoint(t)
    return t.iteration


@pytest.mark.parametrize("name,world,tp,dist_opt", [("optim_gpt_tp1", 1, 1, False), ("distopt_gpt_dp2", 2, 1, True)])
def test_our_megatron_legacy_files_carry_the_optimizer(tmp_path, name, world, tp, dist_opt):
    """What --ckpt-format megatron-legacy writes holds Megatron's FP32Optimizer state in Megatron's
    group order (checked against the legacy model Megatron itself saved), and resumes to the
    same 4th step."""
    from tests.dist_harness import run_distributed
    save = str(tmp_path / "ours")
    assert run_distributed(_load_save, world, name, tp, dist_opt, save, timeout_s=600) == [3] * world
    ours = L.safe_load_megatron(os.path.join(save, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    theirs = L.safe_load_megatron(os.path.join(FIX, "optim_legacy_gpt_tp1", "iter_0000003", "mp_rank_00",
                                               "model_optim_rng.pt"))
    strip = [n.replace("layernorm", "norm") for n, _ in O._named(ours["model"])]
    assert strip == [n for n, _ in O._named(theirs["model"])]  # the legacy model's named-parameter order
    og, tg = ours["optimizer"], theirs["optimizer"]
    if dist_opt:  # Megatron-Core's form: param groups (with `step`) here, the state in distrib_optim.pt
        mega = L.safe_load_megatron(os.path.join(FIX, name, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
        assert set(og) == {"optimizer"} and set(og["optimizer"]) == {"param_groups"}
        assert [set(g) for g in og["optimizer"]["param_groups"]] == \
            [set(g) for g in mega["optimizer"]["optimizer"]["param_groups"]]
        d = L.safe_load_megatron(os.path.join(save, "iter_0000003", "mp_rank_00", "distrib_optim.pt"))
        m = L.safe_load_megatron(os.path.join(FIX, name, "iter_0000003", "mp_rank_00", "distrib_optim.pt"))
        assert list(d[0]) == list(m[0]) and d[0][list(d[0])[0]]["numel_unpadded"] == 21504
    else:
        assert [(len(g["params"]), g["wd_mult"]) for g in og["param_groups"]] == \
            [(len(g["params"]), g["wd_mult"]) for g in tg["param_groups"]]
        assert set(og["param_groups"][0]) == set(tg["param_groups"][0])
    assert ours["opt_param_scheduler"]["num_steps"] == 3 * ours["args"].global_batch_size
    # Read back by this project: the same 4th step as Megatron's.
    import shutil
    for f in ("step4.pt", "logits.pt"):
        shutil.copy(os.path.join(FIX, name, f), save)
    diff, dloss, _ = _run(save, world, 1)
    assert diff < 1e-5 and dloss < 1e-5


def test_v2_split_layout_starts_the_optimizer_fresh_and_says_so(tmp_path):
    """Megatron v2.x (the DynaPipe fork) with --use-distributed-optimizer: model_rng.pt holds no
    optimizer; its mp_rank_XX_DDD/optim.pt files are not read (no fixture: the fork's optimizer
    needs apex)."""
    root = _copy(tmp_path, "optim_gpt_tp1")
    sub = root / "iter_0000003" / "mp_rank_00"
    st = L.safe_load_megatron(str(sub / "model_optim_rng.pt"))
    st.pop("optimizer")
    st["args"].model_type = None
    torch.save(st, sub / "model_rng.pt")
    os.remove(sub / "model_optim_rng.pt")
    c = O.Collector()
    args, _, meta = L.read_full(str(root), on_state=c)
    assert c.split and c.full(args, 1, 1) == ({}, 0.0)
    trainer = argparse.Namespace(cfg=argparse.Namespace(checkpoint=argparse.Namespace(no_load_optim=False,
                                                                                       no_load_rng=True)))
    optim, _ = O.resume(trainer, c, args, meta, ("fresh", "seed"), None)
    assert "optim.pt) are not read" in optim


def _moments(t):
    from tests.parity_utils import _global_name
    st = t.optimizer.param_states()
    return {_global_name(s, n): st[id(p)]["exp_avg_sq"].clone() for s in t.stages.values()
            for n, p in s.named_parameters() if not getattr(p, "shared_embedding", False)}


def _train_save_pp2(rank, world, root, dist_opt):
    import dataclasses
    from megatron.checkpointing.torch_format import save_checkpoint
    from tests.parity_utils import make_trainer, tiny_config
    cfg = tiny_config(world=world, pp=2, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=2, iters=2, save=root)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, ckpt_format="megatron-legacy")
    cfg.training = dataclasses.replace(cfg.training, use_distributed_optimizer=dist_opt)
    t = make_trainer(cfg)
    t.train()
    save_checkpoint(t)
    return _moments(t)


def _load_pp1(rank, world, root):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, tiny_config
    t = make_trainer(tiny_config(world=world, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=2, iters=3, load=root))
    assert load_checkpoint(t)
    return _moments(t)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_our_pp2_optimizer_reads_back_at_pp1(tmp_path, dist_opt):
    """Our PP2 megatron-legacy files (the tied head's copy on the last stage; with the distributed
    optimizer its own grad-buffer bucket, as Megatron lays it out) read back at PP1: every moment."""
    from tests.dist_harness import run_distributed
    root = str(tmp_path / "ckpt")
    saved = {}
    for r in run_distributed(_train_save_pp2, 2, root, dist_opt, timeout_s=600):
        saved.update(r)
    assert os.path.exists(os.path.join(root, "iter_0000002", "mp_rank_00_001",
                                       "distrib_optim.pt")) == dist_opt
    (got,) = run_distributed(_load_pp1, 1, root, timeout_s=600)
    assert got.keys() == saved.keys()
    for k in saved:  # vocabulary rows: the run's 101 of the table's padded rows
        n = min(saved[k].shape[0], got[k].shape[0]) if "word_embeddings" in k else None
        assert torch.equal(got[k][:n], saved[k][:n]), k
