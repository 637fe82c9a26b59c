"""Checkpoints Megatron-Core wrote with `--ckpt-format torch_dist` (tests/fixtures/megatron/
mcore_gpt_dist_*, made by make_fixtures.py from NVIDIA/Megatron-LM core_v0.9.0) load here with the
source's logits at another TP, train on, convert; forged folders are refused in one line."""
import dataclasses
import os
import pickle
import shutil

import pytest
import torch

from megatron.checkpointing import dist_reader
from megatron.checkpointing import mcore_dist as D
from megatron.checkpointing import megatron_legacy as L
from megatron.checkpointing.safety import UnsafeCheckpointError
from tests.checkpointing.test_checkpoint_megatron_legacy import _run_cfg

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
IT = "iter_0000003"


def _fields(args):
    mf = L.model_fields(args)
    mf.pop("num_query_groups")
    mf.update(vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1)
    return mf


# (folder, Megatron's TP, PP, virtual stages): the interleaved one has 4 layers, 1 per virtual stage.
SOURCES = [("mcore_gpt_dist_tp1", 1, 1, None), ("mcore_gpt_dist_tp2", 2, 1, None), ("mcore_gpt_dist_pp2", 1, 2, None),
           ("mcore_gpt_dist_tp2_pp2_vpp", 2, 2, 2), ("mcore_gpt_dist_tp2_optim", 2, 1, None)]


@pytest.mark.parametrize("name,tp,pp,vpp", SOURCES)
def test_torch_dist_fixture_gives_the_source_logits(name, tp, pp, vpp):
    from tools.checkpoint.hf_gpt2 import our_logits
    root = os.path.join(FIX, name)
    assert D.detect(root) and not L.detect(root)
    args, full, meta = D.read_full(root)
    assert (meta["format"], meta["tp"], meta["pp"], meta["iteration"], meta["consumed_samples"]) == \
        ("core torch_dist", tp, pp, 3, 3)
    assert args.virtual_pipeline_model_parallel_size == vpp
    assert meta["optimizer_tensors"] == (32 if name.endswith("_optim") else 0)  # exp_avg + exp_avg_sq of 16
    assert meta["opt_param_scheduler"]["num_steps"] == 3 and meta["checkpoint_version"] == 3.0
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    out = our_logits(_fields(args), full, ref["tokens"])[..., :ref["logits"].shape[-1]]
    assert (out - ref["logits"]).abs().max().item() < 1e-5
    if pp == 1 and not name.endswith("_optim"):  # the same seed's model in Megatron's torch format: equal
        _, flat, _ = L.read_full(os.path.join(FIX, name.replace("_dist", "")))
        assert flat.keys() == full.keys() and all(torch.equal(flat[k], full[k]) for k in full)
    if vpp:  # layer order matters: Megatron's interleaved stages hold layers 0, 2 (rank 0) and 1, 3 (rank 1)
        swap = {k: full[k.replace("layers.1.", "layers.2.")] if "layers.1." in k else
                full[k.replace("layers.2.", "layers.1.")] if "layers.2." in k else v for k, v in full.items()}
        assert (our_logits(_fields(args), swap, ref["tokens"])[..., :100] - ref["logits"]).abs().max().item() > 1e-3


def _load_and_train(rank, world, name, tp, pp, layers):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, shards, tiny_config
    root = os.path.join(FIX, name)
    cfg = tiny_config(world=world, tp=tp, pp=pp, layers=layers, hidden=32, heads=4, seq=8, mbs=1, gbs=1, iters=5,
                      load=root, arch=dict(ffn_hidden_size=64, max_position_embeddings=8))
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=16)
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    out = {"iteration": t.iteration, "consumed": t.consumed_samples, "steps": t.lr_scheduler.num_steps,
           "shards": shards(t)}
    if world == 1:  # the loaded model's logits against the ones Megatron computed
        from tests.checkpointing.megatron_logits import fixture_logit_diff
        out["diff"] = fixture_logit_diff(t, root)
    t.train()
    out["after"] = t.iteration
    return out


# (folder, our world, TP, PP): each Megatron layout loaded at another layout of ours.
@pytest.mark.parametrize("name,world,tp,pp", [("mcore_gpt_dist_tp2", 1, 1, 1), ("mcore_gpt_dist_tp2_pp2_vpp", 1, 1, 1),
                                              ("mcore_gpt_dist_pp2", 2, 2, 1), ("mcore_gpt_dist_tp1", 2, 1, 2)])
def test_load_torch_dist_checkpoint_and_train(name, world, tp, pp):
    from tests.dist_harness import run_distributed
    from tests.parity_utils import VOCAB, assemble
    _, full, _ = D.read_full(os.path.join(FIX, name))
    layers = 1 + max(int(k.split(".")[2]) for k in full if k.startswith("decoder.layers."))
    res = run_distributed(_load_and_train, world, name, tp, pp, layers, timeout_s=600)
    for r in res:
        assert (r["iteration"], r["consumed"], r["steps"], r["after"]) == (3, 3, 3, 5)
    if world == 1:
        assert res[0]["diff"] < 1e-5
    got = assemble([r["shards"] for r in res])  # what every rank loaded, joined again
    assert got.keys() == full.keys()
    for k, v in full.items():
        assert torch.equal(got[k], v[:VOCAB] if "word_embeddings" in k else v), k


def test_convert_from_megatron_torch_dist(tmp_path):
    from tools.checkpoint import convert
    from tools.checkpoint.reshard import read_full_model
    ours = str(tmp_path / "ours")
    assert convert.main(["--from-megatron", "--load", os.path.join(FIX, "mcore_gpt_dist_tp2"), "--save", ours,
                         "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]) == 0
    config, got, meta = read_full_model(ours, None)
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 3
    _, want, _ = D.read_full(os.path.join(FIX, "mcore_gpt_dist_tp2"))
    vocab = 101  # NullTokenizer: Megatron's --vocab-size 100 plus its end-of-document id
    head = got.pop("output_layer.weight")  # our PP2 keeps the tied head's copy on the last stage
    assert torch.equal(head[:vocab], want["embedding.word_embeddings.weight"][:vocab])
    assert got.keys() == want.keys()
    for k in want:
        n = vocab if "word_embeddings" in k else None
        assert torch.equal(got[k][:n], want[k][:n]), k


# ---- forged folders -------------------------------------------------------------------------
def _copy(tmp_path, name="mcore_gpt_dist_tp2"):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIX, name), root)
    return str(root), str(root / IT)


def _index(it_dir):
    return dist_reader.read_metadata(it_dir)


def _write_index(it_dir, md):
    with open(os.path.join(it_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _refused(root, exc=L.MegatronCheckpointError, match=None):
    with pytest.raises(exc, match=match) as e:
        D.read_full(root)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


class _Boom:
    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_pickled_object_in_the_index_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    md = _index(it_dir)
    md.planner_data = _Boom(tmp_path / "ran")
    _write_index(it_dir, md)
    msg = _refused(root, match="refused to load")
    assert ".metadata" in msg and "system" in msg
    assert not (tmp_path / "ran").exists()


def test_a_pickled_object_in_common_pt_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    common = L.safe_load_megatron(os.path.join(it_dir, "common.pt"))
    common["args"].model_type = None  # (re-saved, the stand-in enum would be named first)
    common["evil"] = _Boom(tmp_path / "ran")
    torch.save(common, os.path.join(it_dir, "common.pt"))
    msg = _refused(root, UnsafeCheckpointError, match="common.pt")
    assert "system" in msg and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/passwd", "__0_0.distcp/../../x"])
def test_a_chunk_outside_the_folder_is_refused(tmp_path, path):
    root, it_dir = _copy(tmp_path)
    shutil.copy(os.path.join(it_dir, "__0_0.distcp"), tmp_path / "outside.distcp")
    md = _index(it_dir)
    idx = next(i for i in md.storage_data if i.fqn == "embedding.word_embeddings.weight")
    md.storage_data[idx] = dataclasses.replace(md.storage_data[idx], relative_path=path)
    _write_index(it_dir, md)
    _refused(root, match="not a plain file of the checkpoint folder")


def test_a_linked_shard_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    shard = os.path.join(it_dir, "__1_1.distcp")
    os.replace(shard, tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", shard)
    _refused(root, match="__1_1.distcp: a link or a file outside the checkpoint folder; refused")


def test_a_chunk_of_the_wrong_size_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    md = _index(it_dir)
    name = "decoder.layers.self_attention.linear_qkv.weight"
    idx = next(i for i in md.storage_data if i.fqn == name)
    # A shard file of the folder whose record holds a [1, 10, 32] tensor where the index declares [1, 48, 32].
    with open(os.path.join(it_dir, "__7_0.distcp"), "wb") as f:
        torch.save(torch.zeros(1, 10, 32), f)
    size = os.path.getsize(os.path.join(it_dir, "__7_0.distcp"))
    md.storage_data[idx] = dataclasses.replace(md.storage_data[idx], relative_path="__7_0.distcp", offset=0,
                                               length=size)
    _write_index(it_dir, md)
    msg = _refused(root, match=r"holds torch.float32 \(1, 10, 32\), the index declares")
    assert "__7_0.distcp" in msg and name in msg


def test_a_truncated_shard_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    shard = os.path.join(it_dir, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    _refused(root, match="truncated")


def test_overlapping_chunks_are_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    md = _index(it_dir)
    entry = md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"]  # [2, 32, 32], TP on dim 2
    i = next(i for i, c in enumerate(entry.chunks) if tuple(c.offsets) == (0, 0, 16))
    # Same element count, inside the shape, but over half of its neighbour: columns 24..31 never written.
    entry.chunks[i] = dataclasses.replace(entry.chunks[i], offsets=torch.Size([0, 0, 8]))
    _write_index(it_dir, md)
    _refused(root, match="overlap")


def test_unknown_byte_entries_and_other_backends_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    root, it_dir = _copy(tmp_path)
    md = _index(it_dir)
    md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"] = BytesStorageMetadata()
    _write_index(it_dir, md)
    _refused(root, match="byte .pickled object. entry where only tensors are expected")
    root, it_dir = _copy(tmp_path / "b")
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch"}')
    _refused(root, match="zarr")


def test_a_parameter_without_a_counterpart_here_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    md = _index(it_dir)
    old, new = "decoder.layers.mlp.linear_fc2.bias", "decoder.layers.mlp.experts.linear_fc2.bias"
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {(dataclasses.replace(i, fqn=new) if i.fqn == old else i): v for i, v in md.storage_data.items()}
    _write_index(it_dir, md)
    _refused(root, match="unknown Megatron-Core layer parameter 'mlp.experts.linear_fc2.bias'")


def _load_hostile(rank, world, root):
    from megatron.checkpointing.torch_format import CheckpointError, load_checkpoint
    from tests.parity_utils import make_trainer
    t = make_trainer(_run_cfg(world, root))
    try:
        load_checkpoint(t)
    except CheckpointError as e:
        return str(e)
    return None


def test_load_refuses_a_forged_folder_in_one_line(tmp_path):
    from tests.dist_harness import run_distributed
    root, it_dir = _copy(tmp_path)
    common = L.safe_load_megatron(os.path.join(it_dir, "common.pt"))
    common["args"].model_type = None  # (re-saved, the stand-in enum would be named first)
    common["evil"] = _Boom(tmp_path / "ran")
    torch.save(common, os.path.join(it_dir, "common.pt"))
    msg, = run_distributed(_load_hostile, 1, root, timeout_s=600)
    assert msg is not None and "\n" not in msg and "common.pt" in msg and "refused" in msg
    assert not (tmp_path / "ran").exists()


# ---- Adam's moments (mcore_gpt_dist_tp2_optim: Megatron-Core's optimizer after one step) ----
OPTIM = "mcore_gpt_dist_tp2_optim"


def _load_optim(rank, world, tp, distributed, no_load_optim):
    from megatron.checkpointing.dist_format import _dim, _params
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, tiny_config
    cfg = tiny_config(world=world, tp=tp, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=world // tp, iters=5,
                      load=os.path.join(FIX, OPTIM), arch=dict(ffn_hidden_size=64, max_position_embeddings=8))
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=16)
    cfg.training = dataclasses.replace(cfg.training, use_distributed_optimizer=distributed)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, no_load_optim=no_load_optim)
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    states = t.optimizer.param_states()  # whole over DP (collective for the distributed optimizer)
    out = {k: {} for k in ("exp_avg", "exp_avg_sq")}
    steps = set()
    if t.ps.dp_rank == 0:
        for key, p, here in _params(t):
            if here and id(p) in states:
                steps.add(float(states[id(p)]["step"]))
                for k in out:
                    out[k][key] = (states[id(p)][k].detach().clone(), _dim(p), t.ps.tp_rank)
    t.train()
    return {"moments": out, "steps": steps, "after": t.iteration, "n_states": len(states)}


def _megatron_moments():
    """The oracle: torch's own DCP loader on the (trusted, committed) fixture, Megatron's names."""
    import torch.distributed.checkpoint as dcp
    it_dir = os.path.join(FIX, OPTIM, IT)
    index = dist_reader.tensor_index(dist_reader.read_metadata(it_dir))
    sd = {k: torch.empty(s, dtype=d) for k, (s, d) in index.items() if k.startswith("optimizer.state.")}
    dcp.load(sd, checkpoint_id=it_dir, no_dist=True)
    return sd


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the oracle's single-process DCP load
@pytest.mark.parametrize("world,tp,distributed", [(1, 1, False), (2, 1, True)])
def test_adam_moments_from_megatron_load_at_another_layout(world, tp, distributed):
    from tests.dist_harness import run_distributed
    from tests.parity_utils import VOCAB, assemble
    res = run_distributed(_load_optim, world, tp, distributed, False, timeout_s=600)
    assert all(r["after"] == 5 for r in res) and res[0]["steps"] == {1.0}
    theirs = _megatron_moments()
    for k in ("exp_avg", "exp_avg_sq"):
        ours = assemble([r["moments"][k] for r in res])
        m = f"optimizer.state.{k}."
        assert torch.equal(ours["decoder.layers.1.self_attention.query_key_value.weight"],
                           theirs[m + "decoder.layers.self_attention.linear_qkv.weight"][1])
        assert torch.equal(ours["decoder.layers.0.mlp.dense_4h_to_h.weight"],
                           theirs[m + "decoder.layers.mlp.linear_fc2.weight"][0])
        assert torch.equal(ours["embedding.word_embeddings.weight"],
                           theirs[m + "embedding.word_embeddings.weight"][:VOCAB])
        assert torch.equal(ours["final_layernorm.weight"], theirs[m + "decoder.final_layernorm.weight"])
        assert len(ours) == 28 and all(v.abs().sum() > 0 for v in ours.values())


def test_no_load_optim_leaves_the_optimizer_fresh():
    from tests.dist_harness import run_distributed
    res, = run_distributed(_load_optim, 1, 1, False, True, timeout_s=600)
    assert res["n_states"] == 0 and res["after"] == 5


def test_pretrain_gpt_loads_megatrons_torch_dist_folder(tmp_path):
    """What a user types: Megatron's folder as --load of pretrain_gpt.py, matching model flags."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    argv = [sys.executable, "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--ffn-hidden-size", "64", "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "101",
            "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--load", os.path.join(FIX, OPTIM),
            "--save", str(tmp_path / "ours"), "--log-interval", "1"]
    r = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"loaded Megatron-LM checkpoint (core torch_dist model, TP 2 x PP 1) {os.path.join(FIX, OPTIM)} at " \
           f"iteration 3; Adam's moments and step (1) come from Megatron's optimizer" in r.stderr
    assert "iteration        4/       5" in r.stdout and "saved checkpoint at iteration 5" in r.stdout


def test_common_pt_with_wrong_counters_is_refused(tmp_path):
    root, it_dir = _copy(tmp_path)
    path = os.path.join(it_dir, "common.pt")
    common = L.safe_load_megatron(path)
    common["args"].model_type = None
    common["iteration"] = "3"
    torch.save(common, path)
    _refused(root, match="common.pt: iteration is '3', not a count")
    common["iteration"], common["args"].num_layers = 3, -2
    torch.save(common, path)
    _refused(root, match="common.pt: args.num_layers is '-2', not a layer count")


def _one_more_step(rank, world, no_load_optim):
    """Load Megatron's checkpoint at TP1, take the step Megatron took after its save (same lr,
    batch, loss over the same padded vocabulary of 128), return the logits afterwards."""
    import torch.nn.functional as F
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer, tiny_config
    nxt = torch.load(os.path.join(FIX, OPTIM, "next_step.pt"), weights_only=True)
    cfg = tiny_config(world=1, layers=2, hidden=32, heads=4, seq=8, mbs=1, gbs=1, iters=5,
                      load=os.path.join(FIX, OPTIM), arch=dict(ffn_hidden_size=64, max_position_embeddings=8))
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=32)  # 101 -> 128 rows, as Megatron's TP2
    cfg.training = dataclasses.replace(cfg.training, clip_grad=0.0, weight_decay=0.01)  # the fixture's optimizer
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, no_load_optim=no_load_optim)
    t = make_trainer(cfg)
    assert load_checkpoint(t)
    t.optimizer.lr_scheduler.lr = lambda step=None, **_: nxt["lr"]
    stage = t.stages[0]

    def logits(tok):
        pos = torch.arange(tok.shape[1]).unsqueeze(0).expand_as(tok)
        x = stage.final_layernorm(stage.decoder(stage.embedding(tok, pos), None))
        return F.linear(x, stage.output_weight()).transpose(0, 1)

    stage.train()
    t.optimizer.zero_grad()
    out = logits(nxt["batch"])
    F.cross_entropy(out.reshape(-1, out.shape[-1]), nxt["batch"].reshape(-1)).backward()
    assert t.optimizer.step()[0]
    stage.eval()
    with torch.no_grad():
        return (logits(nxt["tokens"])[..., :100] - nxt["logits"]).abs().max().item()


def test_resumed_adam_takes_megatrons_next_step():
    """Megatron's own next step after its save is the oracle: with its moments and step loaded,
    ours lands on the same weights (logits within 1e-5); restarted Adam does not."""
    from tests.dist_harness import run_distributed
    resumed, = run_distributed(_one_more_step, 1, False, timeout_s=600)
    fresh, = run_distributed(_one_more_step, 1, True, timeout_s=600)
    assert resumed < 1e-5 < fresh, (resumed, fresh)
