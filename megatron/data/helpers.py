"""Lazy access to the C++ index builders (megatron/data/helpers.cpp).

The extension is compiled ahead of time by setup.py; importing this module never
compiles anything (compiling on first use hangs multi-rank jobs, see Megatron-LM
issue #1050).  If the shared object is missing, the error names the build command.
"""
from __future__ import annotations

import importlib

_BUILD_HINT = (
    "the C++ dataset helpers (megatron.data.helpers_cpp) are not built; run "
    "`python setup.py build_ext --inplace` (or `pip install -e .`) in the repository root"
)

_module = None


def get_helpers():
    """Return the compiled helpers module, raising a clear ImportError if absent."""
    global _module
    if _module is None:
        try:
            _module = importlib.import_module("megatron.data.helpers_cpp")
        except ImportError as exc:  # pragma: no cover - depends on the build state
            raise ImportError(f"{_BUILD_HINT} ({exc})") from exc
    return _module


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                     drop_last=True, add_extra_token=1):
    """GPT sample index, see helpers.cpp."""
    return get_helpers().build_sample_idx(sizes, doc_idx, seq_length, num_epochs,
                                          tokens_per_epoch, drop_last, add_extra_token)


def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size):
    """Fill the blending arrays in place, see helpers.cpp."""
    return get_helpers().build_blending_indices(dataset_index, dataset_sample_index, weights,
                                                num_datasets, size)


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                  seed, min_num_sent=1):
    """T5 sentence-to-sample mapping, see helpers.cpp."""
    return get_helpers().build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length,
                                       short_seq_prob, seed, min_num_sent)
