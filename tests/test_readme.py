"""The README's commands run as written: every flag they pass parses, and their files exist.

Fenced ```bash blocks are read, line continuations joined and `VAR="..."` assignments expanded;
each pretrain_gpt.py / pretrain_t5.py command is parsed into a full configuration (at its
torchrun world size), each tools/ command through that tool's own parser. Running scaled-down
copies is what `make demo` and the training tests do; this test keeps the text honest.
"""
import os
import re
import shlex

import pytest

from megatron.cli.arguments import build_parser, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        env = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if not line:
                continue
            m = re.match(r'^([A-Z_]+)="(.*)"$', line)
            if m:
                env[m.group(1)] = m.group(2)
                continue
            for k, v in env.items():
                line = line.replace(f"${k}", v)
            out.append(line)
    return out


COMMANDS = _commands()
TRAIN = [c for c in COMMANDS if re.search(r"pretrain_(gpt|t5)\.py", c)]


def test_readme_has_the_commands():
    assert any(c.startswith("make demo") for c in COMMANDS) and any(c.startswith("make test") for c in COMMANDS)
    assert len(TRAIN) >= 5
    text = open(os.path.join(ROOT, "README.md")).read()
    # torchrun lives in .venv: the README must say how to get it before its first torchrun command
    assert text.index("source .venv/bin/activate") < text.index("torchrun ")


@pytest.mark.parametrize("cmd", TRAIN, ids=[f"cmd{i}" for i in range(len(TRAIN))])
def test_training_command_parses(cmd, monkeypatch):
    words = shlex.split(cmd.replace("$MASTER", "master"))
    script = next(w for w in words if re.search(r"pretrain_(gpt|t5)\.py$", w))
    model = "t5" if "t5" in script else "gpt"
    pre, argv = words[:words.index(script)], words[words.index(script) + 1:]
    nproc = int(pre[pre.index("--nproc_per_node") + 1]) if "--nproc_per_node" in pre else 1
    nnodes = int(pre[pre.index("--nnodes") + 1]) if "--nnodes" in pre else 1
    assert pre[0] in ("torchrun", "python"), cmd
    monkeypatch.chdir(ROOT)
    args = build_parser(model).parse_args(argv)  # SystemExit(2) on an unknown or malformed flag
    cfg = config_from_args(args, model, world_size=nproc * nnodes)
    for flag in ("tokenizer_model", "dynapipe_cost_model"):
        path = getattr(args, flag, None)
        if path and not path.startswith("/"):
            assert os.path.exists(os.path.join(ROOT, path)), f"{cmd}: {path} is not in the repository"
    assert cfg.training.train_iters > 0
    if "/data/" not in cmd:  # the shipped-data examples: logging must print during the run
        assert cfg.logging.log_interval <= cfg.training.train_iters, cmd


def test_tool_commands_parse():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pp", os.path.join(ROOT, "tools", "preprocess_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tools = [c for c in COMMANDS if "tools/preprocess_data.py" in c]
    for cmd in tools:
        words = shlex.split(cmd)
        mod.get_args(words[words.index("tools/preprocess_data.py") + 1:])


def test_converter_commands_run_as_written_after_make_demo():
    """Every tools/checkpoint/convert.py command parses with the tool's own parser, and every
    folder it loads exists after the steps the README gives: the `make demo` checkpoint (the
    `$CKPT` pattern matches where examples/demo_cpu.sh saves), an earlier command's --save, or
    an `hf download --local-dir` folder."""
    import glob
    import sys
    sys.path.insert(0, ROOT)
    from tools.checkpoint.convert import parse_args as convert_args
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"^CKPT=\$\(ls -d (\S+) \| tail -n 1\)", text, re.M)
    assert m, "the README must say which checkpoint $CKPT is"
    demo = open(os.path.join(ROOT, "examples", "demo_cpu.sh")).read()
    run_dir = re.search(r'RUN_DIR=\$\{RUN_DIR:-(runs/demo-)\$\(date [^)]*\)\}', demo)
    assert run_dir and '--save "$RUN_DIR/checkpoints"' in demo
    assert glob.fnmatch.fnmatch(run_dir.group(1) + "20260101-120000/checkpoints", m.group(1))
    made = {"$CKPT"}
    convert = [c for c in COMMANDS if "tools/checkpoint/convert.py" in c]
    assert len(convert) >= 5 and any("--from-hf" in c for c in convert) and any("--to-hf" in c for c in convert)
    for cmd in COMMANDS:
        words = shlex.split(cmd, posix=False)  # keep $CKPT as written
        if words[:2] == ["hf", "download"]:
            made.add(words[words.index("--local-dir") + 1])
        elif "tools/checkpoint/convert.py" in words:
            assert words[0] == "python", cmd
            args = convert_args(words[words.index("tools/checkpoint/convert.py") + 1:])  # exit 2 on a bad flag
            assert args.load in made, f"{cmd}: --load {args.load} is produced by no step before it"
            assert args.save not in made, f"{cmd}: --save {args.save} is already a folder of an earlier step"
            made.add(args.save)
