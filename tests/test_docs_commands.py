"""Every command block of README.md and docs/*.md is run or checked, so the docs cannot go stale.

A ```bash (or sh, shell, console) block is preceded by a marker saying how it is tested:

    <!-- test: run [FLAGS] -->   run each command, in order with the page's other `run` blocks,
                                 with FLAGS replacing (or added to) the training commands' own
                                 (e.g. `--train-iters 2`); `runs/` points into a temporary folder
    <!-- test: parse (WHY) -->   each training command parses into a full configuration at its
                                 torchrun world size, each tools/ command through the tool's parser,
                                 each `python -m` module exists; WHY says why it is not run
    <!-- test: skip (WHY) -->    not run (a fragment, a download, the suite itself); WHY is required

Blocks have `VAR="..."` assignments expanded and line continuations joined; a `#` comment is
dropped. A new page under docs/ is covered without touching this file.
"""
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron.cli.arguments import build_parser, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK = re.compile(r"(?:<!--\s*test:\s*(?P<marker>.*?)\s*-->\s*\n)?```(?:bash|sh|shell|console)\n(?P<body>.*?)```",
                   re.S)
TRAIN = re.compile(r"pretrain_(gpt|t5)\.py")


def _commands(body):
    out, env = [], {}
    for line in body.replace("\\\n", " ").splitlines():
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


def _blocks():
    """(page, index, kind, detail, commands) of every command block."""
    out = []
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for i, m in enumerate(BLOCK.finditer(text)):
            marker = (m.group("marker") or "").strip()
            kind, _, detail = marker.partition(" ")
            out.append((page, i, kind, detail.strip(), _commands(m.group("body"))))
    return out


BLOCKS = _blocks()


def test_every_block_says_how_it_is_tested():
    bad = [f"{p} block {i + 1}: {k or 'no marker'}" for p, i, k, d, _ in BLOCKS
           if k not in ("run", "parse", "skip") or (k in ("parse", "skip") and not d.startswith("("))]
    assert not bad, "each command block needs <!-- test: run [FLAGS] | parse (why) | skip (why) --> before it: " \
        + "; ".join(bad)
    readme = [c for p, *_, cmds in BLOCKS if p == "README.md" for c in cmds]
    assert any(c.startswith("make demo") for c in readme) and any(c.startswith("make test") for c in readme)
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) < 250, "the README is the front door: keep it under 250 lines (move detail to docs/)"
    # torchrun lives in .venv: the README must say how to get it before its first torchrun command
    assert text.index("source .venv/bin/activate") < text.index("torchrun ")


def test_readme_links_point_at_files():
    text = open(os.path.join(ROOT, "README.md")).read()
    missing = [t for t in re.findall(r"\]\(([^)#]+)\)", text)
               if not t.startswith("http") and not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README.md links to missing files: {missing}"


def _parse_training(cmd):
    words = shlex.split(cmd.replace("$MASTER", "master"))
    script = next(w for w in words if TRAIN.search(w))
    model = "t5" if "t5" in script else "gpt"
    pre, argv = words[:words.index(script)], words[words.index(script) + 1:]
    pre = [w.replace("--nproc-per-node", "--nproc_per_node") for w in pre]  # torchrun takes both spellings
    nproc = int(pre[pre.index("--nproc_per_node") + 1]) if "--nproc_per_node" in pre else 1
    nnodes = int(pre[pre.index("--nnodes") + 1]) if "--nnodes" in pre else 1
    assert pre[0] in ("torchrun", "python"), cmd
    args = build_parser(model).parse_args(argv)  # SystemExit(2) on an unknown or malformed flag
    cfg = config_from_args(args, model, world_size=nproc * nnodes)
    for flag in ("tokenizer_model", "dynapipe_cost_model", "aceso_config"):
        path = getattr(args, flag, None)
        if path and not path.startswith(("/", "runs/")):
            assert os.path.exists(os.path.join(ROOT, path)), f"{cmd}: {path} is not in the repository"
    assert cfg.training.train_iters > 0
    if "/data/" not in cmd:  # the shipped-data examples: logging must print during the run
        assert cfg.logging.log_interval <= cfg.training.train_iters, cmd


def _parse_tool(cmd, made):
    words = shlex.split(cmd, posix=False)  # keep $CKPT as written
    if words[:2] == ["hf", "download"]:
        made.add(words[words.index("--local-dir") + 1])
    elif "tools/checkpoint/convert.py" in words:
        from tools.checkpoint.convert import parse_args as convert_args
        assert words[0] == "python", cmd
        args = convert_args(words[words.index("tools/checkpoint/convert.py") + 1:])  # exit 2 on a bad flag
        shipped = not args.load.startswith(("/", "runs/", "$")) and os.path.isdir(os.path.join(ROOT, args.load))
        assert args.load in made or shipped, f"{cmd}: --load {args.load} is produced by no step before it"
        assert args.save not in made, f"{cmd}: --save {args.save} is already a folder of an earlier step"
        made.add(args.save)
    elif "tools/preprocess_data.py" in words:
        spec = importlib.util.spec_from_file_location("pp", os.path.join(ROOT, "tools", "preprocess_data.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.get_args(shlex.split(cmd)[words.index("tools/preprocess_data.py") + 1:])
    elif words[:2] == ["python", "-m"]:
        assert importlib.util.find_spec(words[2]) is not None, f"{cmd}: no module {words[2]}"
    elif words[0] == "bash":
        assert os.path.exists(os.path.join(ROOT, words[1])), f"{cmd}: {words[1]} is not in the repository"


@pytest.mark.parametrize("page", PAGES)
def test_parse_blocks(page, monkeypatch):
    """Every command of a `parse` or `run` block parses (a `run` block's as written, before shrinking)."""
    monkeypatch.chdir(ROOT)
    sys.path.insert(0, ROOT)
    made = {"$CKPT"}  # `CKPT=$(ls -d runs/demo-*/checkpoints | tail -n 1)`: the `make demo` checkpoint
    for p, _, kind, _, cmds in BLOCKS:
        if p != page or kind == "skip":
            continue
        for cmd in cmds:
            if cmd.startswith("CKPT=$(ls -d runs/demo-*/checkpoints"):
                _check_demo_checkpoint_pattern(cmd)
            elif TRAIN.search(cmd):
                _parse_training(cmd)
                m = re.search(r"--save (\S+)", cmd)
                if m:
                    made.add(m.group(1))
            elif not cmd.startswith(("source ", "make ")):
                _parse_tool(cmd, made)


def _check_demo_checkpoint_pattern(cmd):
    """$CKPT's pattern matches where examples/demo_cpu.sh saves."""
    import fnmatch
    pattern = re.search(r"ls -d (\S+) \|", cmd).group(1)
    demo = open(os.path.join(ROOT, "examples", "demo_cpu.sh")).read()
    run_dir = re.search(r'RUN_DIR=\$\{RUN_DIR:-(runs/demo-)\$\(date [^)]*\)\}', demo)
    assert run_dir and '--save "$RUN_DIR/checkpoints"' in demo
    assert fnmatch.fnmatch(run_dir.group(1) + "20260101-120000/checkpoints", pattern)


def _shrink(words, flags):
    """`words` with each --flag of `flags` given its value there (replaced, or added at the end)."""
    words, flags = list(words), shlex.split(flags)
    i = 0
    while i < len(flags):
        name = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if name in words:
            j = words.index(name)
            if value is not None:
                words[j + 1] = value
        else:
            words += [name] + ([value] if value is not None else [])
    return words


RUN_PAGES = sorted({p for p, _, k, *_ in BLOCKS if k == "run"})


@pytest.mark.parametrize("page", RUN_PAGES)
def test_run_blocks(page, tmp_path):
    """The page's `run` blocks, in order, as a user types them (shrunk by the marker's flags)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
               PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    runs = str(tmp_path / "runs") + "/"
    timeline = False  # an earlier training command of the page recorded a pipeline timeline
    for p, i, kind, flags, cmds in BLOCKS:
        if p != page or kind != "run":
            continue
        for cmd in cmds:
            if cmd.startswith("source .venv/bin/activate"):
                continue  # this interpreter is the venv's (or CI's) already
            words = shlex.split(cmd.replace("runs/", runs))
            if TRAIN.search(cmd):
                words = _shrink(words, flags)
                timeline = timeline or "--pipeline-timeline" in words
            if words[0] == "torchrun":
                words = [sys.executable, "-m", "torch.distributed.run"] + words[1:]
            elif words[0] == "python":
                words = [sys.executable] + words[1:]
            r = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{page} block {i + 1}: {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            if TRAIN.search(cmd):
                assert "lm loss:" in r.stdout, f"{page} block {i + 1}: no loss printed\n{r.stdout[-2000:]}"
            if words[1:3] == ["-m", "megatron.report"]:  # the plots it promises, a timeline's too if recorded
                made = os.listdir(os.path.join(words[3], "report"))
                assert "summary.md" in made and "loss.png" in made and "memory.png" in made, made
                if timeline:
                    assert any(f.startswith("timeline_") for f in made), made
