"""examples/*.sh and *.sbatch launch what they say: each script runs under bash with stand-ins
for torchrun / srun / scontrol that record the command, and the recorded pretrain_*.py flags
parse with the project's own parser and config validation at the world size torchrun would
start (nnodes x nproc_per_node). Files the flags name inside the repository must exist."""
import glob
import os
import re
import subprocess

import pytest

from megatron.cli.arguments import build_parser, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.sh")) + glob.glob(
    os.path.join(ROOT, "examples", "*.sbatch")) if not p.endswith("demo_cpu.sh"))
FAKES = {
    "torchrun": 'printf "%s\\0" "$@" > "$CAPTURE"\n',
    "srun": 'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',  # drop srun's options
    "scontrol": 'echo node001; echo node002\n',
}


def _launch(script, tmp_path):
    """The torchrun argv the script would run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", open(script).read(), re.M)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CAPTURE=str(tmp_path / "argv"),
               MASTER_ADDR="node001", SLURM_JOB_NODELIST="node[001-002]", SLURM_JOB_ID="42",
               SLURM_SUBMIT_DIR=ROOT, SLURM_NNODES=nodes.group(1) if nodes else "1")
    r = subprocess.run(["bash", script], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return (tmp_path / "argv").read_text().split("\0")[:-1]


def _opt(words, name, default=None):
    for i, w in enumerate(words):
        if w == name:
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return default


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.basename(s) for s in SCRIPTS])
def test_example_flags_parse_at_the_launched_world_size(script, tmp_path, monkeypatch):
    words = _launch(script, tmp_path)
    entry = next(i for i, w in enumerate(words) if re.search(r"pretrain_(gpt|t5)\.py$", w))
    launcher, argv = words[:entry], words[entry + 1:]
    model = "t5" if words[entry].endswith("t5.py") else "gpt"
    nnodes, nproc = int(_opt(launcher, "--nnodes", 1)), int(_opt(launcher, "--nproc_per_node"))
    if nnodes > 1:  # several nodes meet through torchrun's rendezvous, never --standalone
        assert _opt(launcher, "--rdzv_backend") == "c10d" and _opt(launcher, "--rdzv_endpoint").startswith("node001:")
        assert "--standalone" not in launcher
    monkeypatch.chdir(ROOT)
    args = build_parser(model).parse_args(argv)  # SystemExit(2) on an unknown or malformed flag
    cfg = config_from_args(args, model, world_size=nnodes * nproc)
    par = cfg.parallel
    assert par.world_size == nnodes * nproc
    for flag in ("vocab_file", "merge_file", "tokenizer_model", "dynapipe_cost_model", "terapipe_cost_model",
                 "aceso_config"):
        path = getattr(args, flag, None)
        if path and not path.startswith(("/", "data/cache/")):
            assert os.path.exists(os.path.join(ROOT, path)), f"{script}: --{flag} {path} is not in the repository"
    m = cfg.model
    # Real sizes: GPT-1.3B or larger; T5 at T5 v1.1-large (~0.8B) or larger.
    assert _layer_params(m) >= (0.7e9 if model == "t5" else 1.2e9), f"{script}: {_layer_params(m) / 1e9:.2f}B"


def _layer_params(m) -> float:
    """Weights of the transformer layers (embeddings left out): attention 4 h p, the MLP 2 or 3 h f,
    and T5's decoder layers a cross-attention 4 h p more."""
    attn, mlp = 4 * m.hidden_size * m.projection_size, (3 if m.gated_mlp else 2) * m.hidden_size * m.ffn_hidden_size
    cross = attn * (m.decoder_num_layers or 0) if m.model_type == "t5" else 0
    return m.num_layers * (attn + mlp) + cross


def test_every_launch_pattern_and_system_has_a_script():
    text = {os.path.basename(p): open(p).read() for p in SCRIPTS}
    joined = "\n".join(text.values())
    assert any("pretrain_gpt.py" in t and "--standalone" in t for t in text.values())
    assert any("pretrain_t5.py" in t for t in text.values())
    assert any("--rdzv_backend c10d" in t and "sbatch" not in n for n, t in text.items())
    assert any(n.endswith(".sbatch") and "srun" in t and "#SBATCH --nodes" in t for n, t in text.items())
    for flag in ("--dynapipe", "--aceso-config", "--terapipe", "--inter-grad-comp"):
        assert flag in joined, flag
