"""Megatron-Core MoE GPT checkpoints written by Megatron-LM core_v0.9.0's own code
(tests/fixtures/megatron/mcore_moe_*: 4 SequentialMLP SwiGLU experts, top-2, `--ckpt-format
torch` with `mp_rank_00[_EEE]` folders and `torch_dist`, written at EP 1 and EP 2): read here,
they give Megatron's own logits, and `--load` fills a run at another EP / PP layout."""
import os
import shutil

import pytest
import torch

from megatron.checkpointing import mcore_dist as D
from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.megatron_logits import FIX, fixture_logit_diff

# fixture -> (reader, EP rank folders of the torch format)
SOURCES = {"mcore_moe_ep1": (L, 1), "mcore_moe_ep2": (L, 2), "mcore_moe_dist_ep1": (D, 1),
           "mcore_moe_dist_ep2": (D, 2)}


def _present(name):
    return os.path.exists(os.path.join(FIX, name, "logits.pt"))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_moe_fixture_gives_megatrons_logits(name):
    if not _present(name):
        pytest.skip(f"fixture {name} not generated")
    from tools.checkpoint.hf_gpt2 import our_logits
    reader, ep = SOURCES[name]
    root = os.path.join(FIX, name)
    args, full, meta = reader.read_full(root)
    assert (args.num_experts, args.expert_model_parallel_size, meta["iteration"]) == (4, ep, 3)
    w1 = full["decoder.layers.1.mlp.experts.weight1"]
    assert w1.shape == (4, 32, 32) and full["decoder.layers.1.mlp.router.weight"].shape == (4, 32)
    assert all((w1[i] - w1[j]).abs().max() > 0.01 for i in range(4) for j in range(i))  # no expert repeated
    f = L.model_fields(args)
    f.update(vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1, model_type="gpt")
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    out = our_logits(f, full, ref["tokens"])[..., :ref["logits"].shape[-1]]
    assert (out - ref["logits"]).abs().max().item() < 1e-5  # measured 3.0e-7 (EP 1), 2.4e-7 (EP 2; torch_dist the same)


def _load(rank, world, name, pp, ep):
    import dataclasses
    from megatron.checkpointing.torch_format import load_checkpoint
    from megatron.config.moe import MoEConfig
    from tests.parity_utils import make_trainer, tiny_config
    root = os.path.join(FIX, name)
    moe = MoEConfig(num_experts=4, router_topk=2, expert_model_parallel_size=ep, token_dispatcher_type="alltoall")
    arch = dict(ffn_hidden_size=16, max_position_embeddings=8, swiglu=True, add_bias_linear=False, moe=moe)
    cfg = tiny_config(world=world, pp=pp, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=2, iters=4, load=root,
                      arch=arch)
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=16, vocab_size=101)
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    out = {"iteration": t.iteration, "diff": fixture_logit_diff(t, root) if pp == 1 else None}
    t.train()
    out["finite"] = all(torch.isfinite(p).all().item() for s in t.stages.values() for p in s.parameters())
    return out


# (fixture, world, PP, EP): a layout other than the source's
CASES = [("mcore_moe_ep2", 1, 1, 1), ("mcore_moe_ep1", 2, 1, 2), ("mcore_moe_dist_ep2", 2, 2, 1)]


@pytest.mark.parametrize("name,world,pp,ep", CASES)
def test_load_moe_at_another_layout_and_train(name, world, pp, ep):
    if not _present(name):
        pytest.skip(f"fixture {name} not generated")
    from tests.dist_harness import run_distributed
    for r in run_distributed(_load, world, name, pp, ep, timeout_s=300):
        assert r["iteration"] == 3 and r["finite"]
        if pp == 1:
            assert r["diff"] < 1e-5


def test_a_missing_expert_rank_folder_is_named(tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(os.path.join(FIX, "mcore_moe_ep2"), root)
    (root / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt").rename(root / "elsewhere.pt")
    # one EP file left: read as EP rank 1 only, refused with the folders it found
    with pytest.raises(L.MegatronCheckpointError, match="do not cover"):
        L.read_full(str(root))


def test_a_dense_run_refuses_an_moe_checkpoint_naming_the_flag():
    from megatron.checkpointing.megatron_moe import mismatches
    from megatron.config.moe import MoEConfig
    args, _, _ = L.read_full(os.path.join(FIX, "mcore_moe_ep1"))
    assert mismatches(args, None) == ["--num-experts: checkpoint has 4, this run is dense"]
    assert mismatches(args, MoEConfig(num_experts=4, router_topk=1, router_pre_softmax=True)) == [
        "--moe-router-topk: checkpoint has 2, this run has 1",
        "--moe-router-pre-softmax: checkpoint has False, this run has True"]


def test_rank_folder_links_are_refused(tmp_path):
    from megatron.safe_paths import UnsafePathError
    root = tmp_path / "ck"
    shutil.copytree(os.path.join(FIX, "mcore_moe_ep2"), root)
    sub = root / "iter_0000003" / "mp_rank_00_001"
    (sub / "model_optim_rng.pt").unlink()
    os.symlink(root / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt", sub / "model_optim_rng.pt")
    with pytest.raises(UnsafePathError):
        L.read_full(str(root))


def test_megatrons_moe_optimizer_state_is_left_unread_and_said_so():
    """An MoE file's optimizer state (its experts split over EP files) is not mapped yet: the
    collector skips it, and the resume line says the optimizer starts fresh and why."""
    from megatron.checkpointing.megatron_optim import Collector
    collect = Collector()
    path = os.path.join(FIX, "mcore_moe_ep1", "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    state = L.safe_load_megatron(path)
    state["optimizer"] = {"state": {}, "param_groups": []}  # as if Megatron had saved one
    collect((0, 0), path, state)
    assert collect.moe and collect.missing == [path]
