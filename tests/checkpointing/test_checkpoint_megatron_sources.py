"""More Megatron-LM sources (issue #39): checkpoints written by real Megatron code with
pipeline parallelism (core_v0.9.0, TP2 x PP2 and interleaved virtual stages) and a Llama-style GPT
(core_v0.9.0's legacy classes: RMSNorm, SwiGLU, RoPE, no biases, GQA, untied output) and by
transformers 4.46.3's own GPT-2 -> Megatron converter (`release/`, SimpleNamespace args, vocabulary
padded 100 -> 256 with copies of the last row), each loaded here at another TP/PP than the
source's with the source's logits (within 1e-5), then trained; and by the DynaPipe fork's own
`save_checkpoint` (Megatron v2.x/v3 era legacy GPT, `*_layernorm` names, TP2)."""
import os

import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.megatron_logits import gpt_logits

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")

# fixture -> (the source's TP, PP, virtual stages per rank, iteration / consumed samples it holds)
SOURCES = {"mcore_gpt_tp2_pp2": (2, 2, 1, 3), "mcore_gpt_pp2_vp2": (1, 2, 2, 3), "legacy_llama_tp2": (2, 1, 1, 3),
           "hf_tool_gpt2_tp2_pp2": (2, 2, 1, 0), "dynapipe_gpt_tp2": (2, 1, 1, 3)}


def _present(name):
    return os.path.exists(os.path.join(FIX, name, "logits.pt"))


def _run_cfg(world, root, tp=1, pp=1, iters=5):
    import dataclasses
    from tests.parity_utils import tiny_config
    args, _, _ = L.read_full(root)
    f = L.model_fields(args)
    arch = dict(ffn_hidden_size=f["ffn_hidden_size"], max_position_embeddings=f["max_position_embeddings"],
                swiglu=f["swiglu"], normalization=f["normalization"], add_bias_linear=f["add_bias_linear"],
                position_embedding_type=f["position_embedding_type"], layernorm_epsilon=f["layernorm_epsilon"],
                num_query_groups=f["num_query_groups"])
    cfg = tiny_config(world=world, tp=tp, pp=pp, layers=f["num_layers"], hidden=f["hidden_size"],
                      heads=f["num_attention_heads"], seq=8, mbs=1, gbs=2, iters=iters, load=root,
                      untie=f["untie_embeddings_and_output_weights"], arch=arch)
    # The run's tokenizer: NullTokenizer's --vocab-size + 1, or the HF model's orig_vocab_size.
    cfg.model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=16, vocab_size=L.tokenizer_vocab_size(args))
    return cfg


def _load_and_train(rank, world, name, tp, pp):
    from megatron.checkpointing.torch_format import load_checkpoint
    from tests.parity_utils import make_trainer
    root = os.path.join(FIX, name)
    t = make_trainer(_run_cfg(world, root, tp=tp, pp=pp))
    assert load_checkpoint(t)
    out = {"iteration": t.iteration, "consumed": t.consumed_samples, "steps": t.lr_scheduler.num_steps}
    if pp == 1:  # the loaded model's logits against the ones Megatron's own forward computed
        ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
        out["diff"] = (gpt_logits(t, ref["tokens"])[..., :ref["logits"].shape[-1]] - ref["logits"]).abs().max().item()
    t.train()
    out["after"] = t.iteration
    out["finite"] = all(torch.isfinite(p).all().item() for s in t.stages.values() for p in s.parameters())
    return out


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_layout_and_logits(name):
    """read_full joins the source's TP shards and pipeline stages; one process gives its logits."""
    if not _present(name):
        pytest.skip(f"fixture {name} not generated")
    from tools.checkpoint.hf_gpt2 import our_logits
    root = os.path.join(FIX, name)
    args, full, meta = L.read_full(root)
    tp, pp, vp, it = SOURCES[name]
    assert (meta["tp"], meta["pp"]) == (tp, pp)
    assert (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) == vp
    assert meta["iteration"] == it and meta["consumed_samples"] == it and meta["release"] == (it == 0)
    n = args.num_layers
    assert {int(k.split(".")[2]) for k in full if k.startswith("decoder.layers.")} == set(range(n))
    f = L.model_fields(args)
    f.update(vocab_size=args.padded_vocab_size, make_vocab_size_divisible_by=1, model_type="gpt")
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    out = our_logits(f, full, ref["tokens"])[..., :ref["logits"].shape[-1]]
    assert (out - ref["logits"]).abs().max().item() < 1e-5


# (fixture, our world size, our TP, our PP): always a layout other than the source's.
CASES = [("mcore_gpt_tp2_pp2", 1, 1, 1), ("mcore_gpt_tp2_pp2", 2, 1, 2), ("mcore_gpt_pp2_vp2", 2, 2, 1),
         ("legacy_llama_tp2", 1, 1, 1), ("legacy_llama_tp2", 2, 1, 2), ("hf_tool_gpt2_tp2_pp2", 2, 2, 1),
         ("dynapipe_gpt_tp2", 1, 1, 1), ("dynapipe_gpt_tp2", 2, 1, 2)]


@pytest.mark.parametrize("name,world,tp,pp", CASES)
def test_load_at_another_layout_and_train(name, world, tp, pp):
    if not _present(name):
        pytest.skip(f"fixture {name} not generated")
    from tests.dist_harness import run_distributed
    res = run_distributed(_load_and_train, world, name, tp, pp, timeout_s=600)
    it = SOURCES[name][3]
    for r in res:
        assert (r["iteration"], r["consumed"], r["steps"], r["after"]) == (it, it, it, 5) and r["finite"]
        if pp == 1:
            assert r["diff"] < 1e-5


HF_TOOL = os.path.join(FIX, "hf_tool_gpt2_tp2_pp2")


def test_hf_tool_output_round_trips_without_hand_edits(tmp_path):
    """transformers' GPT-2 -> Megatron output -> ours (`--from-megatron`, no --vocab-size: the
    converter's orig_vocab_size is the tokenizer's) -> `--to-megatron` gives the converter's own
    files back tensor for tensor (padded rows included: both pad with copies of the last row),
    and `--to-hf` gives transformers' logits (vocab_size 100, the padding cut as its converter does)."""
    from tools.checkpoint import convert
    ours, back, hf = str(tmp_path / "ours"), str(tmp_path / "back"), str(tmp_path / "hf")
    assert convert.main(["--from-megatron", "--load", HF_TOOL, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "2"]) == 0
    for sub in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        theirs = L._flatten(L.safe_load_megatron(os.path.join(HF_TOOL, "release", sub, "model_optim_rng.pt"))["model"])
        mine = L.safe_load_megatron(os.path.join(back, "release", sub, "model_optim_rng.pt"))
        assert (mine["args"].orig_vocab_size, mine["args"].padded_vocab_size) == (100, 256)
        mine = L._flatten(mine["model"])
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs), sub
    assert convert.main(["--to-hf", "--load", ours, "--save", hf]) == 0
    import json
    transformers = pytest.importorskip("transformers")
    assert json.load(open(os.path.join(hf, "config.json")))["vocab_size"] == 100
    model = transformers.GPT2LMHeadModel.from_pretrained(hf, local_files_only=True, torch_dtype=torch.float32)
    model.eval()
    ref = torch.load(os.path.join(HF_TOOL, "logits.pt"), weights_only=True)
    with torch.no_grad():
        assert (model(ref["tokens"]).logits - ref["logits"]).abs().max().item() < 1e-5


def test_simple_namespace_args_cannot_carry_code(tmp_path):
    import types
    from megatron.checkpointing.safety import UnsafeCheckpointError
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": types.SimpleNamespace(num_layers=2, evil=os.system)}, path)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        L.safe_load_megatron(path)
    torch.save({"args": types.SimpleNamespace(num_layers=2, orig_vocab_size=100)}, path)
    assert L.safe_load_megatron(path)["args"].orig_vocab_size == 100
