"""T5 checkpoints written by Megatron-LM's own T5 code (tests/fixtures/megatron/*_t5_*, made by
make_t5_fixtures.py from NVIDIA/Megatron-LM core_v0.9.0) load here with the source's logits and
train; what this project writes for T5 in Megatron's legacy format has Megatron's structure."""
import argparse
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpointing import megatron_legacy as L
from megatron.checkpointing import megatron_t5 as T
from megatron.checkpointing.megatron_write import write_full as _write_full
from megatron.checkpointing.safety import UnsafeCheckpointError
from megatron.checkpointing.torch_format import _atomic_write_bytes
from tests.checkpointing.test_checkpoint_megatron_legacy import _tree

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
VOCAB = 101  # NullTokenizer: Megatron's --vocab-size 100 plus its end-of-document id
CASES = [("mcore_t5_tp1", "core", 1, 1), ("mcore_t5_tp2", "core", 2, 1), ("mcore_t5_pp2", "core", 1, 2),
         ("legacy_t5_tp1", "legacy", 1, 1)]


def write_full(*a, **k):
    return _write_full(*a, atomic_write=_atomic_write_bytes, **k)


def _fields(args):
    mf = L.model_fields(args)
    mf.pop("num_query_groups")
    mf.update(vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1)  # Megatron's padded rows kept
    return mf


def _logits(stage, ref):
    """Our T5 stage's logits [b, s_dec, 100] on the fixture's tokens and masks."""
    from megatron.models.t5 import t5_masks
    enc_mask, dec_mask, cross_mask = t5_masks(ref)
    stage.eval()
    with torch.no_grad():
        x = stage.encoder_final_layernorm(stage.encoder(stage._embed(ref["text_enc"]), enc_mask))
        y = stage.decoder_final_layernorm(stage.decoder(stage._embed(ref["text_dec"]), dec_mask, x, cross_mask))
        logits = F.linear(y, stage.output_weight(), stage.lm_head_bias).transpose(0, 1)
    stage.train()
    return logits[..., :ref["logits"].shape[-1]]


def _diff(logits, ref):
    """Largest difference on the decoder's real tokens (padding rows are undefined in Megatron)."""
    return (logits - ref["logits"])[ref["dec_valid"]].abs().max().item()


def _single_stage(fields, full):
    from megatron.config.core import ModelConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.models.t5 import T5Stage
    m = ModelConfig(**{**fields, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    stage = T5Stage(m, ParallelState(), encoder_layers=(0, m.encoder_num_layers),
                    decoder_layers=(0, m.decoder_num_layers), pre_process=True, pre_process_decoder=True,
                    post_process=True, encoder_end=True, seed=0)
    stage.load_state_dict(full)
    return stage


@pytest.mark.parametrize("name,fmt,tp,pp", CASES)
def test_megatron_t5_fixture_gives_the_source_logits(name, fmt, tp, pp):
    root = os.path.join(FIX, name)
    args, full, meta = L.read_full(root)
    assert L.is_t5(args) and meta["format"] == fmt and (meta["tp"], meta["pp"]) == (tp, pp)
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 3 and meta["opt_param_scheduler"]["num_steps"] == 3
    fields = _fields(args)
    assert (fields["model_type"], fields["encoder_num_layers"], fields["decoder_num_layers"]) == ("t5", 2, 2)
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    assert _diff(_logits(_single_stage(fields, full), ref), ref) < 1e-5


def test_pp2_source_takes_the_decoders_lm_head():
    """Megatron-Core at PP 2 (encoder on rank 0) also builds an LM head on the encoder's rank,
    which never trains; the model's bias is the decoder rank's."""
    it = os.path.join(FIX, "mcore_t5_pp2", "iter_0000003")
    enc, dec = (L.safe_load_megatron(os.path.join(it, d, "model_optim_rng.pt"))["model"]["lm_head.output_layer.bias"]
                for d in ("mp_rank_00_000", "mp_rank_00_001"))
    assert not torch.equal(enc, dec)
    _, full, _ = L.read_full(os.path.join(FIX, "mcore_t5_pp2"))
    assert torch.equal(full["lm_head_bias"], dec)
    assert full.keys() == L.read_full(os.path.join(FIX, "mcore_t5_tp1"))[1].keys()


def test_core_and_legacy_names_meet():
    """Both of Megatron's T5 classes give this project's names, the same set."""
    _, core, _ = L.read_full(os.path.join(FIX, "mcore_t5_tp1"))
    _, legacy, _ = L.read_full(os.path.join(FIX, "legacy_t5_tp1"))
    assert core.keys() == legacy.keys()
    assert {"lm_head_bias", "embedding.position_embeddings", "encoder_final_layernorm.weight",
            "decoder.layers.1.pre_cross_attn_layernorm.bias", "decoder.layers.0.inter_attention.key_value.weight",
            "decoder_final_layernorm.bias"} <= core.keys()


def test_our_t5_writer_produces_megatrons_legacy_structure(tmp_path):
    src = os.path.join(FIX, "legacy_t5_tp1")
    args, full, _ = L.read_full(src)
    theirs = L.safe_load_megatron(os.path.join(src, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
    model = _fields(args)
    out = write_full(str(tmp_path), model, full, {"iteration": 0, "consumed_samples": 0}, 1, 1, norm_names="norm")
    assert open(tmp_path / L.TRACKER).read() == "release"
    ours = L.safe_load_megatron(os.path.join(out, "mp_rank_00", "model_optim_rng.pt"))
    assert ours["checkpoint_version"] == 3.0
    assert _tree(ours["model"]) == _tree(theirs["model"])
    for field in ("num_layers", "encoder_num_layers", "decoder_num_layers", "hidden_size", "num_attention_heads",
                  "ffn_hidden_size", "kv_channels", "max_position_embeddings", "seq_length", "encoder_seq_length",
                  "decoder_seq_length", "padded_vocab_size", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "add_position_embedding", "position_embedding_type"):
        assert getattr(ours["args"], field) == getattr(theirs["args"], field), field
    assert set(ours["rng_state"][0]) == set(theirs["rng_state"][0])
    margs, again, _ = L.read_full(str(tmp_path))
    assert L.is_t5(margs)  # without Megatron's ModelType enum, which this project cannot pickle
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def test_t5_writer_and_reader_agree_at_tp2_pp2(tmp_path):
    args, full, _ = L.read_full(os.path.join(FIX, "mcore_t5_tp2"))
    write_full(str(tmp_path), _fields(args), full, {"iteration": 7, "consumed_samples": 56}, 2, 2, release=False)
    it = tmp_path / "iter_0000007"
    first = L.safe_load_megatron(str(it / "mp_rank_00_000" / "model_optim_rng.pt"))
    last = L.safe_load_megatron(str(it / "mp_rank_01_001" / "model_optim_rng.pt"))
    # Megatron's split: the encoder (and its final norm) on rank 0; rank 1 embeds the decoder's tokens.
    assert set(first["model"]["language_model"]) == {"embedding", "encoder"} and "lm_head" not in first["model"]
    assert "final_norm.weight" in first["model"]["language_model"]["encoder"]
    assert set(last["model"]["language_model"]) == {"embedding", "decoder"} and "lm_head" in last["model"]
    assert "word_embeddings_for_head" not in last["model"]  # the split rank is the last: it has the table
    assert last["args"].pipeline_model_parallel_split_rank == 1
    _, again, meta = L.read_full(str(tmp_path))
    assert (meta["tp"], meta["pp"], meta["iteration"]) == (2, 2, 7)
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def test_t5_pp3_last_stage_holds_the_tied_head(tmp_path):
    args, full, _ = L.read_full(os.path.join(FIX, "mcore_t5_tp1"))
    model = dict(_fields(args), decoder_num_layers=2)
    write_full(str(tmp_path), model, full, {"iteration": 1}, 1, 3, release=False, split=1)
    last = L.safe_load_megatron(str(tmp_path / "iter_0000001" / "mp_rank_00_002" / "model_optim_rng.pt"))
    assert set(last["model"]) == {"language_model", "lm_head", "word_embeddings_for_head"}
    _, again, _ = L.read_full(str(tmp_path))
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)


def test_what_megatrons_t5_cannot_hold_is_refused(tmp_path):
    args, full, _ = L.read_full(os.path.join(FIX, "mcore_t5_tp1"))
    for change, words in ((dict(position_embedding_type="relative"), "learned_absolute"),
                          (dict(untie_embeddings_and_output_weights=True), "untie")):
        with pytest.raises(L.MegatronCheckpointError, match=words):
            write_full(str(tmp_path / "x"), dict(_fields(args), **change), full, {}, 1, 1)


def test_unknown_t5_entries_are_named():
    with pytest.raises(L.MegatronCheckpointError, match="decoder.layers.0.retriever"):
        T.convert_core_t5({"decoder.layers.0.retriever.weight": torch.zeros(1)}, "f.pt")
    with pytest.raises(L.MegatronCheckpointError, match="differ"):
        T.convert_core_t5({"lm_head.output_layer.bias": torch.zeros(2), "output_layer.bias": torch.ones(2)}, "f.pt")
    with pytest.raises(L.MegatronCheckpointError, match="not a tensor"):
        T.convert_legacy_t5({"lm_head": {"bias": [1.0]}}, "f.pt")


def test_a_t5_file_cannot_carry_code(tmp_path):
    """A T5 fixture file with one callable planted in its args is refused, nothing runs."""
    src = os.path.join(FIX, "mcore_t5_tp1", "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    state = L.safe_load_megatron(src)
    state["args"].tokenizer_model = os.system
    root = tmp_path / "ckpt"
    (root / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    (root / L.TRACKER).write_text("3")
    torch.save(state, str(root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        L.read_full(str(root))


# ---- through --load and convert.py -----------------------------------------------------------
def _cfg(world, load, tp=1, pp=1, split=None, iters=5, save=None, fmt="torch", **ckpt):
    from tests.training.test_t5_parity import tiny_t5_config
    cfg = tiny_t5_config(world=world, tp=tp, pp=pp, split=split, pos="learned_absolute", iters=iters, mbs=1, gbs=2,
                         enc_seq=8, dec_seq=8)
    cfg.model = dataclasses.replace(cfg.model, ffn_hidden_size=64, max_position_embeddings=8,
                                    make_vocab_size_divisible_by=16)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, load=load, save=save, ckpt_format=fmt, **ckpt)
    return cfg


def _load_and_train(rank, world, name, tp, pp, split):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.resume_harness import make_trainer
    root = os.path.join(FIX, name)
    t = make_trainer(_cfg(world, root, tp=tp, pp=pp, split=split))
    assert load_checkpoint(t)
    out = {"iteration": t.iteration, "consumed": t.consumed_samples, "steps": t.lr_scheduler.num_steps}
    if world == 1:
        ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
        out["diff"] = _diff(_logits(t.stages[0], ref), ref)
    losses = [h["loss"] for h in t.train()]
    out.update(after=t.iteration, losses=losses)
    return out


@pytest.mark.parametrize("name,world,tp,pp,split", [("mcore_t5_tp2", 1, 1, 1, None), ("mcore_t5_pp2", 1, 1, 1, None),
                                                     ("legacy_t5_tp1", 2, 2, 1, None),
                                                     ("mcore_t5_tp1", 2, 1, 2, 1)])
def test_load_megatron_t5_checkpoint_and_train(name, world, tp, pp, split):
    from tests.dist_harness import run_distributed
    res = run_distributed(_load_and_train, world, name, tp, pp, split, timeout_s=600)
    for r in res:
        assert (r["iteration"], r["consumed"], r["steps"], r["after"]) == (3, 3, 3, 5)
    losses = res[-1]["losses"]  # the last pipeline stage's (earlier stages report none)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    if world == 1:
        assert res[0]["diff"] < 1e-5


def test_convert_t5_from_and_to_megatron(tmp_path):
    from tools.checkpoint import convert
    from tools.checkpoint.reshard import read_full_model
    src = os.path.join(FIX, "mcore_t5_tp2")
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert.main(["--from-megatron", "--load", src, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "2", "--target-pipeline-model-parallel-split-rank",
                         "1"]) == 0
    config, mid, _ = read_full_model(ours, None)
    assert config["model"]["model_type"] == "t5" and config["model"]["vocab_size"] == VOCAB
    assert mid["lm_head_bias"].shape[0] == VOCAB
    ref = torch.load(os.path.join(src, "logits.pt"), weights_only=True)
    fields = dict(config["model"], vocab_size=VOCAB)
    padded = {k: (torch.cat([v, v.new_zeros(112 - VOCAB, *v.shape[1:])]) if k in
                  ("embedding.word_embeddings.weight", "lm_head_bias") else v) for k, v in mid.items()}
    assert _diff(_logits(_single_stage(dict(fields, vocab_size=112, make_vocab_size_divisible_by=1), padded), ref),
                 ref) < 1e-5
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "1"]) == 0
    _, a, _ = L.read_full(src)
    margs, b, meta = L.read_full(back)
    assert meta["release"] and a.keys() == b.keys() and L.is_t5(margs)
    for k in a:
        n = VOCAB if k in ("embedding.word_embeddings.weight", "lm_head_bias") else None
        assert torch.equal(a[k][:n], b[k][:n]), k


def _train_save(rank, world, root):
    from megatron.checkpointing.torch_format import save_checkpoint
    from tests.parity_utils import shards
    from tests.resume_harness import make_trainer
    t = make_trainer(_cfg(world, None, pp=2, split=1, iters=2, save=root, fmt="megatron-legacy"))
    t.train()
    save_checkpoint(t)
    return shards(t)


def _load_tp2(rank, world, root):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import shards
    from tests.resume_harness import make_trainer
    import torch.distributed as dist
    t = make_trainer(_cfg(world, root, tp=2, iters=3))
    assert load_checkpoint(t)
    out = shards(t), t.iteration, t.consumed_samples
    dist.barrier()  # rank 0 hosts the job's store: it may not leave while rank 1 still builds its trainer
    return out


def test_ckpt_format_megatron_legacy_writes_megatrons_t5_files(tmp_path):
    from tests.dist_harness import run_distributed
    from tests.parity_utils import assemble
    root = str(tmp_path / "ckpt")
    saved = assemble(run_distributed(_train_save, 2, root, timeout_s=600))
    it_dir = os.path.join(root, "iter_0000002")
    assert sorted(os.listdir(it_dir)) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
    first = L.safe_load_megatron(os.path.join(it_dir, "mp_rank_00_000", "model_optim_rng.pt"))
    last = L.safe_load_megatron(os.path.join(it_dir, "mp_rank_00_001", "model_optim_rng.pt"))
    assert set(first["model"]["language_model"]) == {"embedding", "encoder"}
    assert set(last["model"]) == {"language_model", "lm_head"}
    assert set(last["model"]["language_model"]) == {"embedding", "decoder"}
    assert "layers.0.post_inter_attention_norm.weight" in last["model"]["language_model"]["decoder"]
    a = first["args"]
    assert isinstance(a, argparse.Namespace) and L.is_t5(a)
    assert (a.iteration, a.consumed_train_samples, a.encoder_num_layers, a.decoder_num_layers,
            a.pipeline_model_parallel_split_rank) == (2, 4, 2, 2, 1)
    (got, iteration, consumed), (got1, _, _) = run_distributed(_load_tp2, 2, root, timeout_s=600)
    got = assemble([got, got1])
    assert (iteration, consumed) == (2, 4)
    assert got.keys() == saved.keys(), set(got) ^ set(saved)
    for k in saved:
        n = VOCAB if k == "lm_head_bias" else None  # padded to 112 rows at TP1, 128 at TP2
        assert torch.equal(got[k][:n], saved[k][:n]), k


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PYTHONPATH"),
                    reason="set MEGATRON_LM_PYTHONPATH to a Megatron-LM core_v0.9.0 checkout (and its deps, e.g. "
                           "/tmp/mlm:/tmp/deps) to have Megatron's own load_checkpoint read our T5 files")
def test_megatrons_own_load_checkpoint_reads_our_t5(tmp_path):
    """Megatron's legacy fixture -> this project -> Megatron's legacy format at TP2 -> Megatron's
    own load_checkpoint and forward: the fixture's logits."""
    import re
    import subprocess
    import sys
    from tools.checkpoint import convert
    src = os.path.join(FIX, "legacy_t5_tp1")
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert.main(["--from-megatron", "--load", src, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "1"]) == 0
    env = dict(os.environ, PYTHONPATH=os.environ["MEGATRON_LM_PYTHONPATH"])
    out = subprocess.run([sys.executable, os.path.join(FIX, "make_t5_fixtures.py"), "--out", str(tmp_path),
                          "--name", "check", "--legacy", "--tp", "2", "--load", back, "--expect",
                          os.path.join(src, "logits.pt")], env=env, capture_output=True, text=True, timeout=900)
    m = re.search(r"megatron_load_max_abs_logit_diff=(\S+)", out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    assert float(m.group(1)) < 1e-5


def test_megatron_legacy_t5_run_is_checked_before_training():
    """A T5 run that Megatron's T5 cannot hold is refused at configuration, not at its first save."""
    from megatron.config.core import ConfigError
    with pytest.raises(ConfigError, match="--position-embedding-type learned_absolute"):
        from tests.training.test_t5_parity import tiny_t5_config
        cfg = tiny_t5_config(world=1)  # relative positions, this project's T5 default
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, ckpt_format="megatron-legacy")
        type(cfg)(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    ok = _cfg(1, None, fmt="megatron-legacy")  # learned positions: accepted
    assert type(ok)(**{f.name: getattr(ok, f.name) for f in dataclasses.fields(ok)}).checkpoint.ckpt_format \
        == "megatron-legacy"


def _load_with_optimizer_entry(rank, world, root):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.resume_harness import make_trainer
    t = make_trainer(_cfg(world, root))
    assert load_checkpoint(t)
    return t.iteration, t.optimizer.param_states()


def test_megatron_t5_optimizer_state_is_left_unread_with_a_note(tmp_path, capfd):
    """Megatron's optimizer order is rebuilt for GPT only: a T5 file's optimizer entry must not
    refuse the load (or be mapped onto the wrong parameters); the weights load, the optimizer
    starts fresh and the log says why."""
    import shutil

    from megatron.checkpointing.megatron_legacy import safe_load_megatron
    from tests.dist_harness import run_distributed
    root = tmp_path / "t5"
    shutil.copytree(os.path.join(FIX, "mcore_t5_tp1"), root)
    path = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load_megatron(str(path))
    # Re-saved here, Megatron's enum would pickle as this project's stand-in, which no loader allows;
    # T5 is then told by its layer counts, as for files this project writes.
    del state["args"].model_type
    state["optimizer"] = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                          "param_groups": [{"params": [0], "lr": 1e-3}]}
    torch.save(state, path)
    (iteration, states), = run_distributed(_load_with_optimizer_entry, 1, str(root), timeout_s=300)
    assert iteration == 3 and not states
    assert "T5 optimizer state is not read" in capfd.readouterr().err
