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


# ---- the pipeline, CP, MFU and DynaPipe parts (benchmarks/gpu_check_extra.py)

def _ctx(tmp_path, cuda, gpus):
    return gc.Ctx(cuda=cuda, py=sys.executable, out_dir=tmp_path, tmp=tmp_path, gpus=gpus)


def test_parts_follow_the_gpus(tmp_path):
    parts = {p.name: p for p in gc.PARTS}
    assert {"zb_clock", "cp_memory", "mfu_tp", "dynapipe_pred"} <= set(parts)
    cpu, one, two = _ctx(tmp_path, False, 0), _ctx(tmp_path, True, 1), _ctx(tmp_path, True, 2)
    zb = parts["zb_clock"].argv(cpu)
    assert "benchmarks/bench_zb_cpu.py" in zb and "--device" not in zb
    assert {"1f1b", "zb-h1", "zb-v", "dualpipev"} <= set(zb)
    assert "benchmarks/bench_cp_memory.py" in parts["cp_memory"].argv(cpu)
    for name in ("zb_clock", "cp_memory"):   # one GPU: skipped with the reason, never time-sliced
        assert parts[name].argv(one) is None and ">= 2 GPUs (1 visible)" in parts[name].skip_reason(one)
    assert zb_cuda_device(parts["zb_clock"].argv(two)) == "cuda"
    assert parts["cp_memory"].argv(two)[-2:] == ["--child", "cp_alloc"]
    assert [gc.extra.mfu_tps(True, n) for n in (1, 2, 3, 8)] == [[1], [1, 2], [1, 2], [1, 2, 4]]
    assert gc.extra.mfu_tps(False, 0) == [2]
    # the MFU part's limit grows with the runs it makes
    assert parts["mfu_tp"].limit_s(_ctx(tmp_path, True, 4)) > parts["mfu_tp"].limit_s(one)


def test_moe_parts_follow_the_gpus(tmp_path):
    parts = {p.name: p for p in gc.PARTS}
    cpu, one, four = _ctx(tmp_path, False, 0), _ctx(tmp_path, True, 1), _ctx(tmp_path, True, 4)
    assert parts["moe_gemm"].argv(cpu)[1:] == ["benchmarks/bench_moe_grouped_gemm.py", "--device", "cpu", "--quick",
                                               "--reps", "3"]
    assert "cuda" in parts["moe_gemm"].argv(one)
    a2a = parts["moe_alltoall"]
    assert a2a.argv(one) is None and "(1 visible)" in a2a.skip_reason(one)  # one GPU: no all-to-all
    assert a2a.argv(four)[a2a.argv(four).index("--ranks") + 1] == "4"  # EP = the visible GPUs
    assert a2a.argv(cpu)[a2a.argv(cpu).index("--ranks") + 1] == "2" and "--device" not in a2a.argv(cpu)


def zb_cuda_device(argv):
    return argv[argv.index("--device") + 1]


def test_mfu_runs_are_what_the_trainer_accepts():
    # the real command-line parser the torchrun ranks use, at the world size each run has
    from megatron.cli.arguments import parse_args
    for tp in (1, 2, 4):
        cfg = parse_args(gc.extra.mfu_args(True, tp), world_size=tp)
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (24, 2048, 2048)
        assert cfg.parallel.tensor_model_parallel_size == tp and cfg.training.bf16
    assert parse_args(gc.extra.mfu_args(False, 2), world_size=2).parallel.tensor_model_parallel_size == 2


def test_dynapipe_line_is_read_from_the_trainers_own_format():
    from megatron.training.logging import planner_line
    line = planner_line({"planner": "dynapipe", "simulated_ms": 412.3}, 2.5)
    assert gc.extra._SIM.findall(line) == [("412.3", "2500.0")]


def test_summary_has_the_new_tables():
    parts = {
        "zb_clock": {"status": "ok", "note": "PP 2 on gloo CPU ranks", "rows": [
            {"benchmark": "zero_bubble_cpu", "schedule": "zb-v", "pp": 2, "microbatches": 4, "measured_ms": 80.0,
             "simulated_ms": 66.0, "idle_fraction_measured": [0.3, 0.2]}]},
        "cp_memory": {"status": "ok", "note": "n", "rows": [{"cp": 2, "comm": "p2p", "core_bytes": 10,
                                                             "core_ratio": 0.5}]},
        "mfu_tp": {"status": "ok", "rows": [{"model": "GPT-1.3B", "tp": 2, "step_ms": 900.0,
                                             "tflops_per_device": 400.0, "mfu": 0.404, "rc": 0}]},
        "dynapipe_pred": {"status": "ok", "rows": [{"cost_model": "t.json", "simulated_ms": [1.0], "measured_ms": [2.0],
                                                    "median_measured_over_simulated": 2.0, "rc": 0}]},
    }
    md = "\n".join(gc.extra.markdown(parts))
    assert "| zb-v | 2 x 4 | 80.0 | 66.0 | [0.3, 0.2] |" in md
    assert "| 2 | p2p | 10 | 0.5 |" in md and "| GPT-1.3B | 2 | 900.0 | 400.0 | 0.404 | 0 |" in md
    assert "41-47 %" in md and "median measured / simulated 2.0" in md
