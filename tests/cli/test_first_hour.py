"""The first hour of a new user (issue 23): what they see for a bad data or tokenizer path, a
mismatched tokenizer, a TP run started with plain python, a mistyped flag and Ctrl-C."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron.cli.arguments import parse_args
from megatron.checkpointing.torch_format import _TMP_PREFIX
from megatron.config.core import ConfigError
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.cli.startup_checks import check_inputs, token_id_range

ROOT = Path(__file__).resolve().parents[2]
SP4K = str(ROOT / "data" / "tokenizers" / "kjv_sp4k.model")  # SentencePiece, 4096 pieces
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **extra)
    return env


def _dataset(prefix, top_id, n=2000, dtype=np.uint16):
    """A .bin/.idx pair whose largest token id is `top_id`."""
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    ids = np.arange(n) % (top_id + 1)
    for doc in np.array_split(ids, 10):
        b.add_item(doc)
        b.end_document()
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def _check_error(argv):
    cfg = parse_args(MODEL + argv, world_size=1)
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_data_prefix_names_the_files_and_a_close_match(tmp_path):
    good = _dataset(tmp_path / "corpus_text_document", 50)
    msg = _check_error(["--data-path", str(tmp_path / "corpus_txt_document"), "--vocab-size", "64"])
    assert "corpus_txt_document.bin and" in msg and "not found" in msg and f"did you mean {good}?" in msg
    msg = _check_error(["--data-path", "no/such/dir/x", "--vocab-size", "64"])
    assert "folder no/such/dir does not exist" in msg and "tools/preprocess_data.py" in msg


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_data_path_with_suffix_asks_for_the_prefix(tmp_path, suffix):
    prefix = _dataset(tmp_path / "c", 50)
    msg = _check_error(["--data-path", prefix + suffix, "--vocab-size", "64"])
    assert "without the suffix" in msg and msg.endswith(f"--data-path {prefix}")


def test_weighted_blend_and_targets_path_are_checked(tmp_path):
    a = _dataset(tmp_path / "a", 50)
    msg = _check_error(["--data-path", "30", a, "70", str(tmp_path / "b"), "--vocab-size", "64"])
    assert msg.startswith(f"--data-path {tmp_path / 'b'}:")
    msg = _check_error(["--data-path", a, "--targets-data-path", a + ".idx", "--tokens-per-global-batch", "64",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"])
    assert msg.startswith(f"--targets-data-path {a}.idx:") and "without the suffix" in msg


@pytest.mark.parametrize("flags,needle", [
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "nope.model"],
     "--tokenizer-model nope.model: file not found"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"],
     "--vocab-file v.json: file not found"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(ROOT / "data/gpt2/gpt2-vocab.json.gz"),
      "--merge-file", "m.txt"], "--merge-file m.txt: file not found"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file is required for GPT2BPETokenizer"),
])
def test_missing_tokenizer_file_is_named(tmp_path, flags, needle):
    msg = _check_error(["--data-path", _dataset(tmp_path / "c", 50)] + flags)
    assert needle in msg, msg


def test_tokenizer_that_does_not_match_the_data_is_refused(tmp_path):
    prefix = _dataset(tmp_path / "gpt2ish", 50256, n=60000, dtype=np.int32)
    msg = _check_error(["--data-path", prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
                        "--tokenizer-model", SP4K])
    assert f"--data-path {prefix}: max token id 50256 >= the vocabulary size 4096" in msg
    assert f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {SP4K}" in msg
    assert "all 60000 tokens checked" in msg
    msg = _check_error(["--data-path", prefix, "--vocab-size", "1000"])
    assert "the vocabulary size 1000 of --vocab-size 1000" in msg
    ok = parse_args(MODEL + ["--data-path", _dataset(tmp_path / "small", 4095), "--tokenizer-type",
                             "GPTSentencePieceTokenizer", "--tokenizer-model", SP4K], world_size=1)
    check_inputs(ok)  # ids 0..4095 fit a 4096-piece vocabulary


def test_large_token_files_are_sampled(monkeypatch):
    import megatron.cli.startup_checks as sc
    monkeypatch.setattr(sc, "FULL_SCAN_TOKENS", 1000)
    monkeypatch.setattr(sc, "SAMPLE_WINDOW", 10)
    monkeypatch.setattr(sc, "SAMPLE_WINDOWS", 5)
    tokens = np.zeros(100000, dtype=np.uint16)
    tokens[-1] = 7  # the last window is always read
    assert token_id_range(tokens) == (0, 7, 50)
    assert token_id_range(np.arange(500, dtype=np.int32)) == (0, 499, 500)  # small: every token


def _run(argv, timeout=120, **env):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))


def test_entry_point_reports_a_data_error_in_one_line(tmp_path):
    prefix = _dataset(tmp_path / "c", 50)
    r = _run(["pretrain_gpt.py", *MODEL, "--data-path", prefix + ".bin", "--vocab-size", "64"])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --data-path {prefix}.bin: give the prefix of the .bin/.idx pair, without the "
        f"suffix: --data-path {prefix}"]


def test_plain_python_with_tensor_parallelism_says_use_torchrun(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(MODEL + ["--mock-data", "--vocab-size", "64", "--tensor-model-parallel-size", "2"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "run it with `torchrun --nproc-per-node 2 pretrain_gpt.py ...`" in err[0]


def test_mistyped_flags_get_did_you_mean(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(MODEL + ["--mock-data", "--vocab-size", "64", "--global-batchsize", "8", "--lr_warmup_iters", "2"],
                   world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "did you mean --global-batch-size / --lr-warmup-iters?" in err[0]


def test_fused_kernel_build_is_announced_once_per_node(tmp_path):
    code = "from megatron import fused_kernels as f; f.load(); f.load()"
    # /bin/false as the compiler: the build starts (and is announced), then fails fast -> fallback
    r = _run(["-c", code], CXX="/bin/false", MEGATRON_FUSED_KERNELS_DIR=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert lines[0].startswith(f"building fused kernels (one-time, ~30 s on 2 idle cores) in {tmp_path}")
    assert lines[1].startswith("WARNING: megatron fused kernels unavailable")
    r = _run(["-c", code], CXX="/bin/false", MEGATRON_FUSED_KERNELS_DIR=str(tmp_path / "other"), LOCAL_RANK="1",
             MEGATRON_FUSED_KERNELS_WAIT="0.5")
    assert "building fused kernels" not in r.stderr  # other local ranks wait for local rank 0 quietly


def _interrupt(cmd, save, timeout=180):
    """Start `cmd` in its own process group, wait for a checkpoint and the next training log line,
    Ctrl-C it (SIGINT to the whole group, as a terminal does); return (exit code, stdout, stderr)."""
    out, err = save.parent / "out.txt", save.parent / "err.txt"
    tracker = save / "latest_checkpointed_iteration.txt"

    def started():
        logged = [ln for ln in out.read_text().splitlines() if ln.startswith(" iteration ")]
        return tracker.exists() and len(logged) >= 2

    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=fo, stderr=fe, env=_env(), start_new_session=True)
        deadline = time.time() + timeout
        while not started() and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert p.poll() is None and started(), (out.read_text(), err.read_text())
        os.killpg(p.pid, signal.SIGINT)
        try:
            code = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return code, out.read_text(), err.read_text()


TRAIN = MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "100000", "--mock-data",
                 "--vocab-size", "64", "--log-interval", "1", "--save-interval", "1", "--eval-iters", "0"]


def test_ctrl_c_single_process_one_line_exit_130(tmp_path):
    save = tmp_path / "ckpt"
    code, out, err = _interrupt([sys.executable, "pretrain_gpt.py", *TRAIN, "--save", str(save)], save)
    assert code == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert err.startswith("interrupted at iteration ") and f"last checkpoint: iteration {saved} in {save}" in err
    assert not [f for f in save.rglob("*") if f.name.startswith(_TMP_PREFIX)]  # nothing half-written left


def test_ctrl_c_under_torchrun_one_line_from_the_workers(tmp_path):
    """torchrun's own reaction to SIGINT is not ours: it logs 'Received 2 death signal' lines, raises
    its SignalException (a traceback of its own) and exits 1. What its workers print is ours:
    one line for the node, no worker traceback."""
    save = tmp_path / "ckpt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    code, out, err = _interrupt(torchrun + ["pretrain_gpt.py", *TRAIN, "--save", str(save)], save)
    assert code != 0
    ours = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(ours) == 1 and "last checkpoint: iteration" in ours[0], err
    assert "[rank0]" not in err and "[rank1]" not in err and "KeyboardInterrupt" not in err, err
    assert "Connection closed by peer" not in err


def test_sigint_handler_ignores_torchruns_forwarded_copy():
    from megatron.training import interrupt
    before = signal.getsignal(signal.SIGINT)
    interrupt.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        assert interrupt.received()
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's copy, milliseconds later: ignored
        time.sleep(0.05)
    finally:
        interrupt.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt.install()  # a process started with SIGINT ignored keeps ignoring it
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_missing_cost_model_file_is_named(tmp_path):
    msg = _check_error(["--mock-data", "--vocab-size", "64", "--terapipe", "--terapipe-cost-model", "nope.json"])
    assert msg.startswith("--terapipe-cost-model nope.json: file not found")
    msg = _check_error(["--data-path", _dataset(tmp_path / "i", 50), "--targets-data-path", _dataset(tmp_path / "t", 50),
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--tokens-per-global-batch", "64",
                        "--dynapipe", "--dynapipe-cost-model", "nope.json", "--dynapipe-cost-model-any"])
    assert msg.startswith("--dynapipe-cost-model nope.json: file not found")


def test_ctrl_c_during_a_checkpoint_save_waits_for_it():
    from megatron.training import interrupt
    interrupt.install()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler runs here and only notes it
                done.append("the save finished")
        assert done == ["the save finished"] and interrupt.received()
    finally:
        interrupt.uninstall()


def test_data_path_without_a_tokenizer_is_one_line_before_any_process_group(tmp_path):
    """What the user types: torchrun with --data-path and no --tokenizer-type. One line from
    rank 0 (no traceback from every rank), exit 2, before the ranks build a process group."""
    prefix = _dataset(tmp_path / "c", 50)
    r = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py", *MODEL,
              "--pipeline-model-parallel-size", "2", "--data-path", prefix], timeout=300)
    mine = [x for x in r.stderr.splitlines() if x.startswith("pretrain_gpt.py") and "error" in x]
    # torchrun's failure summary follows, and ends with the same line (cli/parser.py tell_torchrun)
    assert [x for x in r.stderr.strip().splitlines() if set(x.strip()) != {"="}][-1].strip() == f"traceback : {mine[0]}"
    assert r.returncode != 0 and "Traceback (most recent call last):\n  File \"" + str(ROOT) not in r.stderr
    assert mine == ["pretrain_gpt.py: error: --data-path needs --tokenizer-type (with the tokenizer's files, e.g. "
                    "GPTSentencePieceTokenizer --tokenizer-model FILE) or --vocab-size: the vocabulary size is "
                    "unknown"]
    assert "ConfigError" not in r.stderr and "process group" not in r.stderr.lower()
