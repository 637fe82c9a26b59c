"""Installs the `megatron` package and builds the C++ dataset helpers and the partitioner's
inner loop (pybind11 + numpy)."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext_modules = [
    Pybind11Extension(
        "megatron.data.helpers_cpp",
        ["megatron/data/helpers.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
    Pybind11Extension(
        "megatron.planner.dynapipe.partition_cpp",
        ["megatron/planner/dynapipe/partition.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(
    license="Apache-2.0",
    name="megatron-dynapipe",
    version="0.1.0",
    description="Megatron-style GPT/T5 trainer with planner-driven pipeline instruction streams",
    packages=find_packages(include=["megatron", "megatron.*"]),
    # fused-kernel sources (JIT-built from the installed package); Aceso's published V100
    # operator databases (MIT, see megatron/aceso/data/README.md)
    package_data={"megatron.fused_kernels": ["csrc/cpu/*.cpp", "csrc/cuda/*.cu", "csrc/cuda/*.cuh", "csrc/common/*.h"],
                  "megatron.aceso": ["data/README.md", "data/*/*.csv"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "numpy",
        "pybind11>=2.10",
        "sentencepiece",
        "regex",
        "nltk",
        "tqdm",
        "tokenizers",
        "tiktoken",  # fastest GPT-2 BPE backend, fed local vocab files (never downloads)
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout"],
        "tensorboard": ["tensorboard"],
        # tools/checkpoint/convert.py --to-hf / --from-hf only
        "convert": ["transformers", "safetensors"],
        # experiment_scripts/generate_figure_*.sh and optimus_cc_report.py figures (JSON/CSV without it)
        "experiments": ["matplotlib"],
        # `make docs`: the docs/ site, built with --strict so a broken link fails
        "docs": ["mkdocs>=1.5"],
        # --wandb-project (off, with one line, when absent)
        "wandb": ["wandb"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
