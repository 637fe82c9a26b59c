"""What each --ckpt-format can hold, checked against the run's layout at start-up, so that an
accepted combination never trains for hours and then dies at its first save.

- torch: every layout (each rank writes its own stages under this project's names);
- torch_dist: tensors by global name (measured: zb-v at PP 2 saves and resumes); CP is refused
  in context_parallel.py;
- megatron-legacy: what Megatron-LM's legacy model can load: one uniform split of the layers
  over the pipeline ranks, stage v of rank p at v * PP + p (Megatron's interleaving), one TP
  size for every stage (measured: CP 2 saves and resumes); for T5 also Megatron's T5
  architecture (below) and even stacks (checked with the model's split at start-up:
  megatron_write.check_can_save)."""
from __future__ import annotations

from megatron.config.errors import _require

_INSTEAD = "save with --ckpt-format torch (or torch_dist) instead"


def check_ckpt_format(cfg) -> None:
    """Refuse, in one line naming the flags, a layout the chosen --ckpt-format cannot write."""
    m, p, fmt = cfg.model, cfg.parallel, cfg.checkpoint.ckpt_format
    if fmt != "megatron-legacy":
        return
    _require(m.model_type != "t5" or (
        m.position_embedding_type == "learned_absolute" and not m.untie_embeddings_and_output_weights and
        m.normalization == "LayerNorm" and m.add_bias_linear and not m.gated_mlp and m.activation_func == "gelu"),
        "--ckpt-format megatron-legacy writes Megatron-LM's T5 (learned positions, tied head, LayerNorm, biases, "
        "GeLU): add --position-embedding-type learned_absolute (no untied/RMSNorm/gated) or --ckpt-format torch")
    # (also at PP 1: rank 0 then holds both stages, the last sharing the first's embedding table)
    _require(p.pipeline_schedule != "zb-v",
             f"--ckpt-format megatron-legacy with --pipeline-schedule zb-v: zb-v puts two stages per pipeline rank "
             f"in a V (rank 0 holds the first and the last), which Megatron-LM's files (stage v of rank p at "
             f"v x PP + p) cannot describe; {_INSTEAD}")
    _require(p.stage_parallel is None,
             f"--ckpt-format megatron-legacy with per-stage TP x DP sizes (an Aceso layout): Megatron-LM's files "
             f"have one TP size for every stage; {_INSTEAD}")
    # measured (tests/cli/test_composition_ckpt.py): a resume from these files lost the compressors'
    # state (error-feedback residuals, PowerSGD's factors) and drifted from the uninterrupted run
    c = cfg.compression
    comp = [f for f, on in (("--inter-grad-comp", c.inter_grad_comp), ("--grad-comp", c.grad_comp),
                            ("--mp-grad-comp", c.mp_grad_comp), ("--mp-acti-comp", c.mp_acti_comp)) if on]
    _require(not comp, f"--ckpt-format megatron-legacy with {' / '.join(comp)}: Megatron-LM's files have no place "
             f"for the compressors' state (error-feedback residuals, low-rank factors), so a resume would lose it; "
             f"{_INSTEAD}")
    layers = p.pipeline_stage_layers
    _require(m.model_type == "t5" or layers is None or len(set(layers)) == 1,
             f"--ckpt-format megatron-legacy with --pipeline-stage-layers {' '.join(map(str, layers or []))}: "
             f"Megatron-LM splits the layers evenly over the pipeline ranks and cannot load an uneven split; "
             f"{_INSTEAD}")
