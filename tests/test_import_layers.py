"""The import graph of `megatron` points down the layers, has no cycles, and no file is long.

Layers, top to bottom (docs/architecture.md): entry points > training and checkpointing > planner,
aceso and profiling > pipeline > models >
core > data, with the configuration dataclasses (and the pure-Python specs they validate with)
at the bottom, since every layer takes a config. Every import counts, including the ones inside
functions: a lazy import still ties the lower module to the upper one.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "megatron")
MAX_LINES = 600

# Module prefix -> layer (higher imports lower; equal layers may import each other, cycles aside).
# The longest matching prefix wins.
LAYERS = {
    # entry points: command lines and the tools that read them
    "megatron.cli": 7, "megatron.training.pretrain": 7, "megatron.training.t5_builder": 7,
    "megatron.experiments": 7, "megatron.aceso.__main__": 7, "megatron.fused_kernels.__main__": 7,
    "megatron.profiling.profile_model": 7, "megatron.profiling.calibrate": 7, "megatron.report": 7,
    # training: the loop, its checkpoints, logging and process setup
    "megatron.training": 6, "megatron.checkpointing": 6,
    # planners, and what measures the models they price (profilers, Aceso's search)
    "megatron.planner": 5, "megatron.aceso": 5, "megatron.profiling": 5,
    "megatron.pipeline": 4,
    # what runs on one rank: model stages and the compressors the executor calls
    "megatron.models": 3, "megatron.compression": 3,
    "megatron.core": 2, "megatron.fused_kernels": 2,
    "megatron.data": 1, "megatron.tokenizer": 1,
    # definitions every layer reads: configs and pure-Python specs (no torch)
    "megatron": 0, "megatron.config": 0, "megatron.core.recompute": 0,
}
NAMES = {7: "entry points", 6: "training", 5: "planner", 4: "pipeline", 3: "models", 2: "core", 1: "data",
         0: "definitions"}


def _modules():
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


MODULES = _modules()


def layer(mod: str) -> int:
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"{mod} has no layer: add it to LAYERS in tests/test_import_layers.py")


def imports(mod: str, path: str) -> dict:
    """{imported megatron module: first line} for every import statement in the file."""
    tree = ast.parse(open(path).read(), path)
    package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    out = {}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t and t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]  # `import megatron.a.b.func`-style names resolve to their module
            if t in MODULES and t != mod:
                out.setdefault(t, node.lineno)
    return out


GRAPH = {m: imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


def test_imports_point_down():
    bad = [f"{MODULES[m][len(ROOT) + 1:]}:{line} imports {d} ({NAMES[layer(m)]} -> {NAMES[layer(d)]})"
           for m, deps in GRAPH.items() for d, line in deps.items() if layer(d) > layer(m)]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def _cycles():
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(GRAPH[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(GRAPH[w])))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "modules importing each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_file_over_600_lines():
    long = [f"{os.path.relpath(p, ROOT)} ({n} lines)" for p in MODULES.values()
            if (n := sum(1 for _ in open(p))) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility): " + ", ".join(long)


def test_the_checker_sees_upward_and_cyclic_imports(tmp_path):
    # the rules themselves: a core module importing the planner is upward; a relative import
    # resolves to its module
    assert layer("megatron.core.optimizer") < layer("megatron.planner.schedule.static")
    assert layer("megatron.core.recompute") == 0 and layer("megatron.cli.composition") == 7
    f = tmp_path / "m.py"
    f.write_text("from . import instructions\nfrom megatron.planner.schedule.static import x\n")
    got = imports("megatron.pipeline.m", str(f))
    assert set(got) == {"megatron.pipeline.instructions", "megatron.planner.schedule.static"}
