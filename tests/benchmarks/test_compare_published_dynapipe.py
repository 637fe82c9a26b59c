"""benchmarks/compare_published_dynapipe.py without the published package: it exits 0 with the
install hint, and its driver reads the published planner's return values as that package
returns them (a fake `dynapipe` module stands in; none of its code is used or needed)."""
import sys
import types

import pytest

import benchmarks.compare_published_dynapipe as cmp


def test_without_the_package_prints_how_to_install_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(cmp, "published_available", lambda: (False, "ModuleNotFoundError('dynapipe')"))
    assert cmp.main(["--models", "gpt", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "pip install -e ." in out and not any(line.startswith("{") for line in out.splitlines())


def _fake_dynapipe(monkeypatch, microbatches, calls):
    """Modules with the published signatures: generate_microbatches returns, per DP group,
    micro-batches as [sequence][sample id] lists (packing off: one sample per sequence)."""
    class CM:
        def __init__(self, *a):  # from a profile directory
            pass

        @staticmethod
        def load(path):  # from a saved pickle
            return CM()

    class Opt:
        def __init__(self, *a, **k):
            pass

        def generate_microbatches(self, enc, decoder_sample_sequence_lengths=None):
            return (0.0, microbatches, "preferred", "none", (0, 0, 0))

    class Planner:
        def __init__(self, *a, **k):
            pass

        def generate_execution_plan(self, shapes):
            calls.append(list(shapes))
            return [], 10.0 * len(shapes), None, "selective", "wait-free-cyclic"

    mods = {"dynapipe": types.ModuleType("dynapipe"),
            "dynapipe.data_opt": types.ModuleType("dynapipe.data_opt"),
            "dynapipe.data_opt.cost_models": types.SimpleNamespace(ProfileBasedCostModelWithRC=CM),
            "dynapipe.data_opt.optimizer": types.SimpleNamespace(DataAssignmentOptimizer=Opt),
            "dynapipe.model": types.SimpleNamespace(DynaPipeCluster=lambda *a, **k: None,
                                                    TransformerModelSpec=lambda *a, **k: None),
            "dynapipe.schedule_opt": types.ModuleType("dynapipe.schedule_opt"),
            "dynapipe.schedule_opt.execution_planner": types.SimpleNamespace(ExecutionPlanner=Planner)}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("kind", ["gpt", "t5"])
def test_published_microbatches_become_shapes(monkeypatch, tmp_path, kind):
    import bench_planner as bp  # compare_published_dynapipe put benchmarks/ on sys.path
    calls = []
    # two DP groups; samples 0 and 2 share a micro-batch, as do 1 and 3
    _fake_dynapipe(monkeypatch, [[[[0], [2]]], [[[1], [3]], [[4]]]], calls)
    cfg = bp.config(kind, cmp.ROOT / "cost_models")
    pub = cmp.Published(cfg, str(tmp_path / "cm.pkl"))
    batch = [100, 7, 30, 9, 64] if kind == "gpt" else [(100, 3), (7, 1), (30, 20), (9, 2), (64, 5)]
    out = pub.plan(batch)
    if kind == "gpt":
        assert out["groups"] == [[(2, 104, 0)], [(2, 16, 0), (1, 64, 0)]]
    else:  # decoder: longest target + 2 (bos/eos), rounded to 8
        assert out["groups"] == [[(2, 104, 24)], [(2, 16, 8), (1, 64, 8)]]
    assert calls == out["groups"]
    assert out["makespan_ms"] == 20.0 and out["rc"] == "selective"
