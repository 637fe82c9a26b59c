"""A synthetic Aceso-format database small enough to price by hand."""
import os

from megatron.aceso.db import OpRow, write_op_csv
from megatron.aceso.model import ModelSpec

# name, fwd us, bwd us, input MB, output MB, weights MB, activations MB, fwd/bwd reserved MB
BASE = [
    ("encoder-embedding", 1000, 2000, 0, 10, 100, 5, 7, 3),
    ("enc-a", 2000, 4000, 10, 20, 50, 30, 1, 2),
    ("enc-b", 1000, 1000, 20, 10, 0, 40, 0, 0),
    ("final-layernorm", 500, 500, 10, 10, 0, 10, 0, 0),
    ("gpt-post-process", 3000, 3000, 10, 0, 100, 50, 20, 10),
]
SPEC = ModelSpec("gpt", "tiny", (2,), 64, 16, 4)


def write_synthetic_db(root):
    """Tables for mbs in {1, 2}, tp in {1, 2}: times and activations scale by mbs/tp, inputs and
    outputs by mbs, weights by 1/tp. Collectives: all_reduce on 2 GPUs 1 ms per 100 MB, only
    all_gather on 4 GPUs (0.5 ms per 100 MB). p2p: 10 GB/s in a node, 5 GB/s between nodes."""
    os.makedirs(root, exist_ok=True)
    for m in (1, 2):
        for t in (1, 2):
            rows = [OpRow(n, f * m / t, b * m / t, i * m, o * m, w / t, a * m / t, fr, br)
                    for n, f, b, i, o, w, a, fr, br in BASE]
            write_op_csv(os.path.join(root, f"gpt_tiny_mbs{m}_tp{t}_algo0.csv"), rows)
    with open(os.path.join(root, "prim_gpt_tiny_all_reduce_2gpus.csv"), "w") as f:
        f.write("data_size(MB),time(ms)\n200,2.0\n100,1.0\n")
    with open(os.path.join(root, "prim_gpt_tiny_all_gather_4gpus.csv"), "w") as f:
        f.write("data_size(MB),time(ms)\n100,0.5\n200,1.0\n")
    with open(os.path.join(root, "p2p_intra_node.csv"), "w") as f:
        f.write("1,1024\n10,10\n")
    with open(os.path.join(root, "p2p_inter_node.csv"), "w") as f:
        f.write("1,1024\n5,5\n")
    return root
