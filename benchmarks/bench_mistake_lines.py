"""How many lines a user reads when a start-up mistake stops a torchrun job (issue 49).

    python benchmarks/bench_mistake_lines.py [--nproc 2]

Runs ten newcomer mistakes (each refused at start-up with one line naming the flag and the fix)
under `torchrun --standalone --nproc_per_node N` and prints, per mistake, one JSON row: the
lines of output (stdout + stderr), whether our line is in torchrun's failure summary, and
the last non-border line. torchrun's own summary (a traceback of its agent and a box) follows
any failed worker; `megatron.cli.parser.tell_torchrun` puts our line into that box.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]
MOCK = ["--mock-data", "--vocab-size", "64"]


def mistakes(tmp: str) -> dict:
    return {
        "split abc": MODEL + ["--data-path", "p", "--vocab-size", "64", "--split", "abc"],
        "eval without a validation share": MODEL + ["--data-path", "p", "--vocab-size", "64", "--split", "100,0,0",
                                                    "--eval-iters", "2", "--eval-interval", "1"],
        "misspelt flag": MODEL + MOCK + ["--global-batch-szie", "8"],
        "data without a tokenizer": MODEL + ["--data-path", os.path.join(tmp, "none")],
        "mock data without a vocabulary": MODEL + ["--mock-data"],
        "TP larger than the job": MODEL + MOCK + ["--tensor-model-parallel-size", "4"],
        "heads do not divide hidden": [x if x != "2" or i != 5 else "3" for i, x in enumerate(MODEL)] + MOCK,
        "missing tokenizer file": MODEL + ["--data-path", os.path.join(tmp, "none"), "--tokenizer-type",
                                           "GPTSentencePieceTokenizer", "--tokenizer-model",
                                           os.path.join(tmp, "missing.model")],
        "batch not a multiple of the micro-batch": MODEL + MOCK + ["--micro-batch-size", "3"],
        "fp16 and bf16": MODEL + MOCK + ["--fp16", "--bf16"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MEGATRON_NO_FUSED_KERNELS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in mistakes(tmp).items():
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(a.nproc), "pretrain_gpt.py", *flags], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=600)
            lines = (r.stdout + r.stderr).strip().splitlines()
            ours = [x for x in lines if "error:" in x and "pretrain_gpt.py" in x]
            last = [x for x in lines if x.strip() and set(x.strip()) != {"="}]
            print(json.dumps({"mistake": name, "exit": r.returncode, "lines": len(lines),
                              "our_line": ours[0][:160] if ours else None,
                              "in_summary": any(x.strip().startswith("traceback : pretrain_gpt.py") for x in lines),
                              "last_line": last[-1][:160] if last else ""}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
