"""Newcomer mistakes caught from the flags alone, before any process group, model or file read:
each is one line naming the flag and what to give instead (the entry points print it and exit).

Here rather than in the config dataclasses because they need to know which flags were given
(an evaluation flag left at its default asks for nothing) or which script runs.
"""
from __future__ import annotations

import argparse
import os

from megatron.config.core import ConfigError
from megatron.config.terapipe import T5_REFUSAL


def check_flags(args: argparse.Namespace, model_type: str, defaults: dict) -> None:
    """`defaults`: the parser's default of each flag (to tell a flag given from one left alone)."""
    if model_type == "t5" and getattr(args, "terapipe", False):
        raise ConfigError(T5_REFUSAL)  # before --terapipe's own flags ask for a latency model T5 cannot use
    if getattr(args, "mock_data", False) or not getattr(args, "data_path", None):
        return
    from megatron.data.gpt_dataset import parse_split
    try:
        weights = parse_split(args.split)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    asked = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("eval_interval", "eval_iters")
             if getattr(args, k) != defaults.get(k)]
    if weights[1] == 0 and args.eval_iters > 0 and asked:
        raise ConfigError(f"{' and '.join(asked)} ask for evaluation, but --split {args.split} gives the validation "
                          "set no documents: give it a share (e.g. --split 949,50,1), or drop the evaluation flags")


def load_folder_hint(load: str) -> str:
    """'' unless `load` holds no checkpoint tracker while a child folder does (the run folder
    given instead of its checkpoints/ folder): then the line saying which folder to give."""
    from megatron.checkpointing.torch_format import TRACKER
    if not load or not os.path.isdir(load) or os.path.exists(os.path.join(load, TRACKER)):
        return ""
    children = sorted(c for c in os.listdir(load) if os.path.isfile(os.path.join(load, c, TRACKER)))
    if not children:
        return ""
    inner = os.path.join(load, children[0])
    return (f"--load {load}: no checkpoint there ({TRACKER} missing), but {inner} holds one: "
            f"--load {inner}")
