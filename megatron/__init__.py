"""Megatron-style distributed trainer for GPT and T5 driven by planner-written pipeline instruction streams."""
__version__ = "0.1.0"
