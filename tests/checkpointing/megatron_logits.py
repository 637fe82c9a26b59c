"""Logits of a loaded trainer (PP 1, any TP) against those a Megatron fixture's source computed."""
import os

import torch

FIX = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")


def gpt_logits(t, tokens):
    """This trainer's logits on `tokens` (PP 1, any TP: the vocabulary shards gathered)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    stage = t.stages[0]
    stage.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        rotary = None
        if t.cfg.model.position_embedding_type == "rope":
            from megatron.models.rotary import rotary_cos_sin
            rotary = rotary_cos_sin(t.cfg.model, pos, torch.float32)
        x = stage.final_layernorm(stage.decoder(stage.embedding(tokens, pos), None, rotary=rotary))
        part = F.linear(x, stage.output_weight())
        if t.ps.tp_size > 1:
            parts = [torch.empty_like(part) for _ in range(t.ps.tp_size)]
            dist.all_gather(parts, part.contiguous(), group=t.ps.tp_group)
            part = torch.cat(parts, dim=-1)
    stage.train()
    return part.transpose(0, 1)


def fixture_logit_diff(t, root: str) -> float:
    """Largest |logit difference| between trainer `t` and the fixture's `logits.pt`."""
    ref = torch.load(os.path.join(root, "logits.pt"), weights_only=True)
    return (gpt_logits(t, ref["tokens"])[..., :ref["logits"].shape[-1]] - ref["logits"]).abs().max().item()
