"""Optimus-CC (ASPLOS'23): compressed communication on the critical path.

Independent mechanisms, each behind its own flag:

* `pipeline`: compressed backpropagation (CB) of the activation gradient sent to the previous
  pipeline stage, marked per `SendGrad`/`RecvGrad` pair in the instruction stream, with lazy
  error propagation (LEP, residuals kept within their iteration) and the epilogue-only variant;
* `data_parallel`: rank-r PowerSGD or randomized SVD for the data-parallel gradient
  reduction, optionally only on the first K pipeline stages (selective compression);
* `embedding`: the tied-embedding gradient sync folded into one all-reduce per TP rank, and
  the low-rank reducer on that sync (`--emb-grad-comp`);
* `tensor_parallel`: low-rank TP all-reduces (gradients; activations opt-in).

`lowrank` holds the compressor they share; `stats` the `--log-compression-stats` diagnostics.
"""
