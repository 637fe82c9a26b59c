"""Optimus-CC (ASPLOS'23): compressed communication on the critical path.

Three independent mechanisms, each behind its own flag:

* `pipeline`: compressed backpropagation (CB) of the activation gradient sent to the previous
  pipeline stage, marked per `SendGrad`/`RecvGrad` pair in the instruction stream, with lazy
  error propagation (LEP) and the epilogue-only variant;
* `data_parallel`: rank-r PowerSGD for the data-parallel gradient reduction, optionally only
  on the first K pipeline stages (selective compression);
* `embedding`: the tied-embedding gradient sync folded into one all-reduce per TP rank.

`lowrank` holds the compressor they share; `stats` counts bytes on the wire.
"""
