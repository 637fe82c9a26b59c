"""Data path: mmap .bin/.idx datasets (indexed_dataset), preprocessing engine
(preprocess, sentence_split), GPT / T5 / supervised datasets, blending, samplers,
packing and the C++ index helpers (helpers.cpp, loaded lazily by helpers.py).
See docs/data.md."""
