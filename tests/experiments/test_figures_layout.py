"""What a reader of the figures sees: every PNG has its data as a CSV beside it (Fig 18's memory
panel included), and the line figures' legend sits beside the axes, where it covers no line."""
import json

import pytest

from megatron.experiments import drivers
from megatron.experiments.backends import Job, SimulateBackend
from megatron.experiments.config import load_grid
from megatron.experiments.live import rows_from_log
from tests.experiments.test_experiments import RECORDED, tiny_grid


@pytest.fixture
def results(tmp_path):
    """Simulated best / controlled rows of the tiny grid plus recorded live DynaPipe rows."""
    g = load_grid(tiny_grid(tmp_path))
    res = tmp_path / "res"
    drivers.grid_search(g, SimulateBackend(), res)
    drivers.benchmark(g, SimulateBackend(), res)
    job = Job("best_throughput", g.settings()[0], "dynapipe", 2, 1, 2, batches=3)
    live = job.row(g, "live", status="ok", **rows_from_log(RECORDED, warmup=1))
    with open(res / "best_throughput.jsonl", "a") as f:
        f.write(json.dumps(live) + "\n")
    return res


def test_every_png_has_its_csv_and_legends_cover_no_line(results, tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    from megatron.experiments.figures import draw
    figs, subplots = [], plt.subplots

    def keep(*a, **k):
        figs.append(subplots(*a, **k))
        return figs[-1]
    monkeypatch.setattr(plt, "subplots", keep)
    out = tmp_path / "figs"
    assert draw(results, out, [13, 14, 18], "simulate") == 0
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"fig18_time.png", "fig18_memory.png"}
    assert any(p.name.startswith("fig14_") for p in pngs)
    for p in pngs:
        assert p.with_suffix(".csv").is_file(), f"{p.name} has no CSV beside it"
    mem = (out / "fig18_memory.csv").read_text().splitlines()
    assert mem[0].endswith("predicted_peak_mb,measured_peak_mb") and len(mem) == 4  # 3 measured iterations
    lines_figs = [(f, ax) for f, ax in figs if ax.get_xlabel().startswith("max sequence length")]
    assert len(lines_figs) == 2  # Figs 13 and 14
    for fig, ax in lines_figs:
        fig.canvas.draw()
        leg, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert leg.x0 >= box.x1, "the legend overlaps the plot area"
