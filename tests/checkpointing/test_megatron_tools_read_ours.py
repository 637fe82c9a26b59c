"""Outside tools read this project's Megatron-format GPT files the way their users run them:
a GPT-2 user's flags (--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file), Megatron-LM's
own load_checkpoint, transformers' convert_megatron_gpt2_checkpoint.py as a script.

The tools are not dependencies: Megatron-LM comes from MEGATRON_LM_PYTHONPATH (a core_v0.9.0
checkout and its deps, tests/fixtures/megatron/README.md), transformers 4.x (whose converter
transformers 5 dropped) from TRANSFORMERS4_PYTHONPATH (e.g. `pip install --target DIR --no-deps
transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.2`); each test skips, saying so,
when its tool is absent."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.gpt2_files import VOCAB, write_gpt2_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(ROOT, "tests", "fixtures", "megatron")
# make_fixtures.py's Megatron model (--load): 2 layers, h 32, 4 heads, ffn 64, seq 8, erf GeLU, no dropout
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "8", "--max-position-embeddings", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--activation-func", "gelu-erf"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MEGATRON_NO_FUSED_KERNELS="1")


def _train(tmp, name, extra):
    """pretrain_gpt.py as a GPT-2 user runs it (mock data, the GPT-2 tokenizer's files): one iteration."""
    vocab, merges = write_gpt2_files(str(tmp / "gpt2"))
    save = str(tmp / name)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--mock-data", "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--train-iters", "1",
           "--save", save, *extra]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return save, vocab, merges, out.stdout


def _convert(*argv):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), *argv],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _model_file(root):
    it = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    folder = "release" if it == "release" else f"iter_{int(it):07d}"
    return os.path.join(root, folder, "mp_rank_00", "model_optim_rng.pt")


def _expected_logits(root, path):
    """This project's forward of the written weights on fixed tokens: what the tools must compute."""
    from tools.checkpoint.hf_gpt2 import our_logits
    args, full, _ = L.read_full(root)
    fields = L.model_fields(args)
    fields.pop("num_query_groups", None)
    fields["vocab_size"] = L.tokenizer_vocab_size(args)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.save({"tokens": tokens, "logits": our_logits(fields, full, tokens)[..., :VOCAB].contiguous()}, path)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A --ckpt-format megatron-legacy run, and a default-format run converted with --to-megatron."""
    tmp = tmp_path_factory.mktemp("tools")
    legacy, vocab, merges, _ = _train(tmp, "legacy", ["--ckpt-format", "megatron-legacy"])
    ours, _, _, log = _train(tmp, "ours", [])
    converted = str(tmp / "converted")
    _convert("--to-megatron", "--load", ours, "--save", converted, "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    return dict(tmp=tmp, legacy=legacy, converted=converted, ours=ours, vocab=vocab, merges=merges, log=log)


@pytest.mark.parametrize("which", ["legacy", "converted"])
def test_megatron_args_name_the_tokenizer_and_its_files(written, which):
    args = L.safe_load_megatron(_model_file(written[which]))["args"]
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == \
        ("GPT2BPETokenizer", written["vocab"], written["merges"])
    # Megatron's check_checkpoint_args compares these with its own run when --vocab-file is given
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by, args.max_position_embeddings) == (50304, 128, 8)


def test_a_run_without_a_tokenizer_is_megatrons_null_tokenizer(tmp_path):
    from tools.checkpoint import convert
    src = os.path.join(FIX, "mcore_gpt_tp1")
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert.main(["--from-megatron", "--load", src, "--save", ours, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    assert convert.main(["--to-megatron", "--load", ours, "--save", back, "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0
    args = L.safe_load_megatron(_model_file(back))["args"]
    # NullTokenizer adds its end-of-document id to --vocab-size: the model's 101 rows are --vocab-size 100
    assert (args.tokenizer_type, args.vocab_size, L.tokenizer_vocab_size(args)) == ("NullTokenizer", 100, 101)


def test_default_format_says_outside_tools_cannot_read_it(written):
    """The torch format has Megatron's file names, not its contents: the log and a file beside the
    tracker name the converter command (the one the `converted` fixture ran)."""
    assert "convert.py --to-megatron --load " + written["ours"] in written["log"]
    note = open(os.path.join(written["ours"], "README_MEGATRON_TOOLS.txt")).read()
    assert "KeyError: 'language_model'" in note and "--to-megatron" in note


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PYTHONPATH"),
                    reason="set MEGATRON_LM_PYTHONPATH to a Megatron-LM core_v0.9.0 checkout and its deps (see "
                           "tests/fixtures/megatron/README.md) to run Megatron's own load_checkpoint on our files")
@pytest.mark.parametrize("which", ["legacy", "converted"])
def test_megatrons_load_checkpoint_with_gpt2_flags(written, which):
    """Megatron-LM's load_checkpoint with --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file
    (its check_checkpoint_args compares tokenizer_type, padded vocabulary and positions), then
    Megatron's forward: our logits."""
    tmp = written["tmp"]
    expect = _expected_logits(written[which], str(tmp / f"{which}_logits.pt"))
    env = dict(os.environ, PYTHONPATH=os.environ["MEGATRON_LM_PYTHONPATH"])
    out = subprocess.run([sys.executable, os.path.join(FIX, "make_fixtures.py"), "--out", str(tmp), "--name",
                          f"check_{which}", "--legacy", "--load", written[which], "--expect", expect,
                          "--vocab-file", written["vocab"], "--merge-file", written["merges"]],
                         env=env, capture_output=True, text=True, timeout=900)
    m = re.search(r"megatron_load_max_abs_logit_diff=(\S+)", out.stdout)
    assert m, out.stdout[-2000:] + out.stderr[-2000:]
    assert float(m.group(1)) < 1e-5


def _hf_cache_with(folder, vocab, merges):
    """transformers' converter asks the Hub for openai-community/gpt2's tokenizer; offline, GPT-2's
    vocab.json and merges.txt (data/gpt2) stand in the cache under that name."""
    snap = os.path.join(folder, "hub", "models--openai-community--gpt2", "snapshots", "0" * 40)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(folder, "hub", "models--openai-community--gpt2", "refs"), exist_ok=True)
    open(os.path.join(folder, "hub", "models--openai-community--gpt2", "refs", "main"), "w").write("0" * 40)
    shutil.copy(vocab, os.path.join(snap, "vocab.json"))
    shutil.copy(merges, os.path.join(snap, "merges.txt"))
    open(os.path.join(snap, "config.json"), "w").write('{"model_type": "gpt2"}')
    open(os.path.join(snap, "tokenizer_config.json"), "w").write(
        '{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", '
        '"unk_token": "<|endoftext|>"}')
    return folder


@pytest.mark.skipif(not os.environ.get("TRANSFORMERS4_PYTHONPATH"),
                    reason="set TRANSFORMERS4_PYTHONPATH to a transformers 4.x install (its "
                           "convert_megatron_gpt2_checkpoint.py; transformers 5 dropped it), see this file's docstring")
@pytest.mark.parametrize("which", ["legacy", "converted"])
def test_transformers_converter_script_reads_our_file(written, which):
    from transformers import GPT2LMHeadModel
    tmp = written["tmp"]
    work = tmp / f"hf_{which}"
    work.mkdir()
    shutil.copy(_model_file(written[which]), work / "model_optim_rng.pt")
    env = dict(os.environ, PYTHONPATH=os.environ["TRANSFORMERS4_PYTHONPATH"], HF_HUB_OFFLINE="1",
               HF_HOME=_hf_cache_with(str(tmp / f"hf_home_{which}"), written["vocab"], written["merges"]),
               # transformers 4.46's converter predates torch 2.6's weights_only default
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    out = subprocess.run([sys.executable, "-m", "transformers.models.megatron_gpt2.convert_megatron_gpt2_checkpoint",
                          str(work / "model_optim_rng.pt")], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ref = torch.load(_expected_logits(written[which], str(tmp / f"hf_{which}_logits.pt")), weights_only=True)
    hf = GPT2LMHeadModel.from_pretrained(str(work)).eval()
    with torch.no_grad():
        diff = (hf(ref["tokens"]).logits[..., :VOCAB] - ref["logits"]).abs().max().item()
    assert diff < 1e-5


def test_use_checkpoint_args_takes_the_model_from_megatrons_args(capsys):
    """--use-checkpoint-args with a Megatron-LM checkpoint: its args give the model (sizes, GeLU
    form, NullTokenizer vocabulary), as Megatron's load_args_from_checkpoint gives them."""
    from megatron.cli.arguments import parse_args
    cfg = parse_args(["--use-checkpoint-args", "--load", os.path.join(FIX, "mcore_gpt_tp1"), "--mock-data"],
                     world_size=1)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length) == (2, 32, 4, 64, 8)
    assert (m.activation_func, cfg.data.tokenizer_type, m.vocab_size) == ("gelu-erf", "NullTokenizer", 100)
    assert "note: --use-checkpoint-args: hidden_size = 32 from" in capsys.readouterr().out


def test_use_checkpoint_args_with_our_checkpoint_keeps_typed_sizes(written, capsys):
    """Typed sizes win (Megatron fills only unset ones); architecture choices follow the checkpoint."""
    from megatron.cli.arguments import parse_args
    cfg = parse_args(["--use-checkpoint-args", "--load", written["ours"], "--mock-data", "--vocab-file",
                      written["vocab"], "--merge-file", written["merges"], "--seq-length", "4",
                      "--activation-func", "gelu"], world_size=1)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (2, 32, 4)
    assert (cfg.model.activation_func, cfg.data.tokenizer_type) == ("gelu-erf", "GPT2BPETokenizer")
