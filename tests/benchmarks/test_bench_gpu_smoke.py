"""CPU form of benchmarks/bench_gpu.py (the scaled-down model): every row has the agreed fields,
the plain PyTorch model is the same size as ours in both variants, the throughput fields follow
from the step times, and the MFU peak table maps device names as documented."""
import pytest

from benchmarks.bench_gpu import main, peak_tflops

REQUIRED = ("device", "model", "ours_step_s", "plain_step_s", "tokens_per_s", "mfu", "peak_mem_bytes")


def test_cpu_rows():
    rows = main(["--models", "gpt,llama", "--rows", "step", "--steps", "1", "--warmup", "0"])
    rows += main(["--models", "gpt", "--rows", "packed,precision", "--steps", "1", "--warmup", "0"])
    assert [(r["model"], r["row"]) for r in rows] == [("gpt", "step"), ("llama", "step"), ("gpt", "packed"),
                                                      ("gpt", "precision")]
    for r in rows:
        assert all(k in r for k in REQUIRED), r
        assert r["device"] == "cpu" and r["scaled_down"] and r["mfu"] is None and r["peak_mem_bytes"] is None
    for r in rows[:2]:
        assert r["params"] == r["params_plain"] and r["state_bytes"] == r["plain_state_bytes"]
        assert r["tokens_per_s"] == pytest.approx(r["global_batch_size"] * r["seq"] / r["ours_step_s"], rel=1e-3)
    assert rows[1]["params"] < rows[0]["params"]  # no biases, GQA: a different model, not a relabelled one
    packed = rows[2]
    assert 0 < packed["packed"]["real_tokens"] <= packed["rows_per_step"] * packed["seq"]
    assert packed["unpacked"]["real_tokens"] == packed["rows_per_step"] * packed["seq"]
    prec = rows[3]
    # fp32 weight + grad + 2 Adam moments; Megatron's: bf16 weight and micro-batch grad, fp32 main grad,
    # fp32 main weight, 2 Adam moments
    assert prec["fp32_params_autocast"]["state_bytes_per_param"] == 16.0
    assert prec["bf16_params_fp32_main"]["state_bytes_per_param"] == 20.0


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("Tesla V100-SXM2-32GB", None)])
def test_peak_table(name, peak):
    assert peak_tflops(name)[1] == peak
