"""The README's three multi-task modes, as typed (one flag apart), consume the same samples and
report the same "consumed tokens" (packed rows counted one token a sample more: 4084 vs 4049)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path

ROOT = Path(__file__).resolve().parents[2]


def _write(prefix, docs):
    b = IndexedDatasetBuilder(bin_path(prefix), dtype=np.int32)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(idx_path(prefix))


def test_modes_report_the_same_consumed_tokens(tmp_path):
    rng = np.random.RandomState(0)
    n = 120
    _write(str(tmp_path / "in"), [rng.randint(0, 97, k) for k in np.clip(rng.lognormal(2.6, 0.8, n).astype(int), 2, 60)])
    _write(str(tmp_path / "out"), [rng.randint(0, 97, k) for k in np.clip(rng.lognormal(1.8, 0.7, n).astype(int), 1, 30)])
    # the README's COMMON model (the shipped table's), dropout left at its default as there
    common = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--ffn-hidden-size", "256", "--seq-length", "64", "--max-position-embeddings", "512", "--train-iters", "2", "--lr", "1e-3",
              "--data-path", str(tmp_path / "in"), "--targets-data-path", str(tmp_path / "out"), "--split", "100,0,0",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--tokens-per-global-batch", "600",
              "--log-interval", "2", "--eval-iters", "0", "--eval-interval", "1000"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    seen = {}
    for mode, extra in (("dynapipe", ["--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json",
                                      "--dynapipe-memory-limit", "400", "--dynapipe-planner-workers", "0"]),
                        ("packing", ["--pack-dataset", "--micro-batch-size", "2"]),
                        ("fixed", ["--micro-batch-size", "2"])):
        r = subprocess.run([sys.executable, *common, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, (mode, r.stderr[-2000:])
        line = [x for x in r.stdout.splitlines() if " iteration        2/" in x][0]
        seen[mode] = (re.search(r"consumed samples: +(\d+)", line).group(1),
                      re.search(r"consumed tokens: +(\d+)", line).group(1))
    assert len(set(seen.values())) == 1, seen
