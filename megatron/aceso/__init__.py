"""Aceso (EuroSys'24): operator database, performance model and bottleneck-alleviation search.

- ``db``: reader for Aceso-format profiled databases (shipped V100 tables under ``data/``).
- ``model``: per-stage / 1F1B iteration time and memory of a heterogeneous pipeline.
- ``config``: Aceso's JSON configuration format, read and written.
- ``search``: iterative bottleneck alleviation and the Megatron uniform-grid baseline.
- ``profiler``: writes the same database format for our own GPT layers.
"""
