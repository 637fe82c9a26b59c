"""benchmarks/gpu_check.py's runner: each part in its own process with its own limit, the JSON
rewritten after every part, and a part that hangs or fails costing only itself. Fake parts keep
this cheap; CI runs the real CPU form (`make gpu-check-cpu` in .ci/run)."""
import json
import sys

from benchmarks import gpu_check as gc


def _part(name, code, limit=30.0, parse=lambda out, ctx: {}):
    return gc.Part(name, name, lambda ctx: [sys.executable, "-c", code], lambda ctx: limit, floor_s=1.0, parse=parse)


def test_a_hung_or_failing_part_costs_only_itself(tmp_path):
    seen = []
    parts = [
        _part("first", "print('{\"row\": 1}')", parse=lambda out, ctx: {"rows": gc._json_lines(out)}),
        _part("hangs", "import time; time.sleep(60)", limit=2.0),
        _part("fails", "import sys; print('boom'); sys.exit(3)"),
        gc.Part("never", "not here", lambda ctx: None, lambda ctx: 5, floor_s=1.0,
                skip_reason=lambda ctx: "nothing to run"),
        _part("last", "print('{\"row\": 2}')", parse=lambda out, ctx: {"rows": gc._json_lines(out)}),
    ]

    def log(line):
        seen.append(line)
        if "hangs: timeout" in line:  # the file already holds the part before it
            assert "first" in json.loads((tmp_path / "gpu_check_cpu.json").read_text())["parts"]

    rep = gc.check(False, tmp_path, budget_s=60, parts=parts, log=log)
    p = json.loads((tmp_path / "gpu_check_cpu.json").read_text())["parts"]
    assert p["first"]["status"] == "ok" and p["first"]["rows"] == [{"row": 1}]
    assert p["hangs"]["status"].startswith("timeout") and p["hangs"]["seconds"] < 20
    assert p["fails"]["status"] == "failed (rc 3)" and "boom" in p["fails"]["log_tail"]
    assert p["never"] == {"what": "not here", "status": "skipped", "reason": "nothing to run"}
    assert p["last"]["status"] == "ok" and p["last"]["rows"] == [{"row": 2}]
    md = (tmp_path / "gpu_check_cpu.md").read_text()
    assert "CPU form" in md and f"torch {rep['torch']}" in md and "hangs, fails" in md


def test_budget_leaves_room_for_later_parts(tmp_path):
    # a part may not take the time the parts after it need (their floor)
    parts = [_part("a", "import time; time.sleep(60)", limit=100.0),
             gc.Part("b", "b", lambda ctx: [sys.executable, "-c", "pass"], lambda ctx: 30, floor_s=4.0)]
    gc.check(False, tmp_path, budget_s=7, parts=parts, log=lambda s: None)
    p = json.loads((tmp_path / "gpu_check_cpu.json").read_text())["parts"]
    assert p["a"]["status"].startswith("timeout") and p["a"]["seconds"] < 6
    assert p["b"]["status"] == "ok"


def test_unknown_part_is_one_line(capsys):
    assert gc.main(["--cpu", "--parts", "nope"]) == 2
    assert "--parts nope: unknown" in capsys.readouterr().err
