"""T5 checkpoints Megatron-Core wrote with `--ckpt-format torch_dist` (tests/fixtures/megatron/
mcore_t5_dist_*, made by make_t5_fixtures.py --format torch_dist from NVIDIA/Megatron-LM
core_v0.9.0): the encoder's and decoder's layer stacks split with their own layer counts, T5's
names, the source's logits, and --load at another layout then training on."""
import dataclasses
import os
import pickle
import shutil

import pytest
import torch

from megatron.checkpointing import dist_reader
from megatron.checkpointing import mcore_dist as D
from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.test_checkpoint_megatron_t5 import _diff, _fields, _load_and_train, _logits, _single_stage

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
IT = "iter_0000003"


@pytest.mark.parametrize("name,tp", [("mcore_t5_dist_tp1", 1), ("mcore_t5_dist_tp2", 2)])
def test_t5_torch_dist_fixture_gives_the_source_logits(name, tp):
    root = os.path.join(FIX, name)
    assert D.detect(root) and not L.detect(root)
    args, full, meta = D.read_full(root)
    assert L.is_t5(args) and meta["format"] == "core torch_dist" and (meta["tp"], meta["pp"]) == (tp, 1)
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 3 and meta["opt_param_scheduler"]["num_steps"] == 3
    fields = _fields(args)
    assert (fields["model_type"], fields["encoder_num_layers"], fields["decoder_num_layers"]) == ("t5", 2, 2)
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    assert _diff(_logits(_single_stage(fields, full), ref), ref) < 1e-5


def test_t5_torch_dist_names_match_the_torch_format():
    """The same Megatron model saved in both formats (the fixture script's seeds and perturbation
    are the same) reads to the same tensors under the same names."""
    _, dist, _ = D.read_full(os.path.join(FIX, "mcore_t5_dist_tp2"))
    _, flat, _ = L.read_full(os.path.join(FIX, "mcore_t5_tp2"))
    assert dist.keys() == flat.keys()
    assert {"decoder.layers.1.inter_attention.key_value.weight", "decoder.layers.1.pre_cross_attn_layernorm.bias",
            "encoder.layers.1.input_layernorm.weight", "lm_head_bias", "encoder_final_layernorm.bias"} <= dist.keys()
    assert all(torch.equal(dist[k], flat[k]) for k in dist)


def _copy(tmp_path, name="mcore_t5_dist_tp1"):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIX, name), root)
    return str(root), str(root / IT)


def _save_args(it_dir, **changes):
    common = L.safe_load_megatron(os.path.join(it_dir, "common.pt"))
    common["args"].model_type = None  # (re-saved, the stand-in enum would be named first)
    for k, v in changes.items():
        setattr(common["args"], k, v)
    torch.save(common, os.path.join(it_dir, "common.pt"))


def test_a_stack_that_disagrees_with_its_block_count_is_refused(tmp_path):
    """The decoder's stack is split by args.decoder_num_layers, not the encoder's count."""
    root, it_dir = _copy(tmp_path)
    _save_args(it_dir, decoder_num_layers=3)
    with pytest.raises(L.MegatronCheckpointError, match="decoder_num_layers / num_layers is 3") as e:
        D.read_full(root)
    assert "\n" not in str(e.value) and "decoder.layers." in str(e.value)


def test_an_unknown_t5_layer_entry_is_named(tmp_path):
    root, it_dir = _copy(tmp_path)
    md = dist_reader.read_metadata(it_dir)
    old, new = "decoder.layers.cross_attention.linear_q.bias", "decoder.layers.cross_attention.linear_z.bias"
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {(dataclasses.replace(i, fqn=new) if i.fqn == old else i): v for i, v in md.storage_data.items()}
    with open(os.path.join(it_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(L.MegatronCheckpointError, match="unknown Megatron-Core T5 layer parameter") as e:
        D.read_full(root)
    assert "\n" not in str(e.value) and ".metadata" in str(e.value)


@pytest.mark.parametrize("name,world,tp,pp,split", [("mcore_t5_dist_tp2", 1, 1, 1, None),
                                                     ("mcore_t5_dist_tp1", 2, 2, 1, None),
                                                     ("mcore_t5_dist_tp2", 2, 1, 2, 1)])
def test_load_t5_torch_dist_checkpoint_and_train(name, world, tp, pp, split):
    from tests.dist_harness import run_distributed
    res = run_distributed(_load_and_train, world, name, tp, pp, split, timeout_s=600)
    for r in res:
        assert (r["iteration"], r["consumed"], r["steps"], r["after"]) == (3, 3, 3, 5)
    losses = res[-1]["losses"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    if world == 1:
        assert res[0]["diff"] < 1e-5


def test_convert_t5_torch_dist_from_megatron(tmp_path):
    """`convert.py --from-megatron` of the torch_dist folder at TP1 x PP2 (split 1) gives the
    same model as from the same Megatron model's `torch` folder."""
    from tools.checkpoint import convert
    from tools.checkpoint.reshard import read_full_model
    outs = {}
    for name in ("mcore_t5_dist_tp2", "mcore_t5_tp2"):
        out = str(tmp_path / name)
        assert convert.main(["--from-megatron", "--load", os.path.join(FIX, name), "--save", out,
                             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2",
                             "--target-pipeline-model-parallel-split-rank", "1"]) == 0
        outs[name] = read_full_model(out, None)
    (c1, a, _), (c2, b, _) = outs["mcore_t5_dist_tp2"], outs["mcore_t5_tp2"]
    assert c1["model"]["model_type"] == "t5" and c1["model"] == c2["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
