"""A Megatron-LM checkpoint of a run with --apply-layernorm-1p stores each norm's scale as w - 1
(Megatron computes x * (1 + w)); the readers add the 1 back, so the model here (x * w) gets the
same scales. The fixtures are Megatron-written checkpoints (legacy and Megatron-Core torch
layouts, TP 1 and 2) rewritten as that run writes them: `args.apply_layernorm_1p` set and every
norm scale stored minus one."""
import os
import shutil
import sys
import types

import pytest
import torch

from megatron.checkpointing import megatron_legacy as L
from tests.checkpointing.megatron_logits import FIX


def _norm_scale(key: str) -> bool:
    # Megatron's names: legacy *_layernorm / *_norm, Megatron-Core *_layernorm, TE's fused layer_norm_weight
    return key.endswith(("norm.weight", "layer_norm_weight"))


def _as_1p(d):
    shifted = 0
    for k, v in d.items():
        if isinstance(v, dict):
            shifted += _as_1p(v)
        elif isinstance(v, torch.Tensor) and _norm_scale(k):
            assert bool(((v >= 0.5) & (v <= 2)).all())  # so w - 1 and (w - 1) + 1 are exact
            d[k] = v - 1
            shifted += 1
    return shifted


def _rewrite_1p(src: str, dst: str, monkeypatch) -> int:
    # args.model_type is Megatron's enum: it is written back under Megatron's own name
    enums = types.ModuleType("megatron.core.enums")
    enums.ModelType = L.ModelType
    monkeypatch.setitem(sys.modules, "megatron.core.enums", enums)
    monkeypatch.setattr(L.ModelType, "__module__", "megatron.core.enums")
    shutil.copytree(src, dst)
    shifted = 0
    for dirpath, _, files in os.walk(dst):
        if "model_optim_rng.pt" in files:
            path = os.path.join(dirpath, "model_optim_rng.pt")
            state = L.safe_load_megatron(path)
            state["args"].apply_layernorm_1p = True
            shifted += sum(_as_1p(v) for k, v in state.items() if k.startswith("model"))
            torch.save(state, path)
    return shifted


@pytest.mark.parametrize("name", ["legacy_gpt_tp1", "mcore_gpt_tp2", "legacy_llama_tp2"])
def test_layernorm_1p_checkpoint_reads_as_the_plain_one(name, tmp_path, monkeypatch):
    src = os.path.join(FIX, name)
    dst = str(tmp_path / name)
    assert _rewrite_1p(src, dst, monkeypatch) > 0
    args0, plain, _ = L.read_full(src)
    args1, onep, _ = L.read_full(dst)
    assert not getattr(args0, "apply_layernorm_1p", False) and args1.apply_layernorm_1p
    norms = [k for k in plain if k.endswith("layernorm.weight")]
    assert norms and set(plain) == set(onep)
    for k in plain:
        assert torch.equal(plain[k], onep[k]), k
    # without the reader's correction the scales would be w - 1: the test can tell
    assert not torch.equal(plain[norms[0]] - 1, onep[norms[0]])
