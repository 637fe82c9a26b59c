"""--context-parallel-size's flag combinations, checked where the configuration is (pure Python,
no torch): what context parallelism composes with, and one line naming the flag where it does
not. The runtime is megatron/core/context_parallel.py and megatron/models/cp_attention.py."""
from __future__ import annotations

from megatron.config.errors import _require


def cp_granule(cfg) -> int:
    """Tokens per sequence must be a multiple of this: 2 chunks per CP rank (causal load
    balancing), each rank's share split again over TP under sequence parallelism."""
    p = cfg.parallel
    tp = p.tensor_model_parallel_size if cfg.model.sequence_parallel else 1
    return 2 * p.context_parallel_size * tp


def check_context_parallel_config(cfg) -> None:
    """Raise ValueError (one line, naming the flag) for what context parallelism cannot run."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    cp = p.context_parallel_size
    flag = f"--context-parallel-size {cp}" if cp > 1 else "--cp-keyed-dropout"
    if m.model_type != "gpt":
        raise ValueError(f"{flag} is implemented for GPT: T5's decoder cross-attends the whole encoder output "
                         "and its relative-position bias spans the full sequence, so chunking the encoder alone "
                         "would gather it back in every layer; drop the flag for T5")
    if cfg.terapipe.enabled:
        raise ValueError(f"{flag} with --terapipe: token slices and context parallelism both cut the sequence; "
                         "pick one (the planner prices both: benchmarks/bench_cp.py)")
    if d.dynapipe and d.dynapipe_packed_rows:
        raise ValueError(f"{flag} with --dynapipe-packed-rows: DynaPipe plans a static CP group's micro-batches "
                         "of padded samples only (packed rows under CP are priced per document nowhere yet); drop "
                         "--dynapipe-packed-rows, or use --pack-dataset without --dynapipe")
    c = cfg.compression
    if c.grad_comp or c.emb_comm_opt or c.emb_grad_comp:
        raise ValueError(f"{flag} with --grad-comp / --emb-comm-opt / --emb-grad-comp: these sum gradients over "
                         "the data-parallel group, but under context parallelism each CP rank holds the gradient of "
                         "other tokens, so the sum must span DP x CP; drop the compression flag")
    if c.inter_grad_comp or c.mp_grad_comp or c.mp_acti_comp:
        raise ValueError(f"{flag} with --inter-grad-comp / --mp-grad-comp / --mp-acti-comp: their error-feedback "
                         "state is per data-parallel rank and saved from one rank of each DP group, but CP ranks "
                         "compress different tokens' messages, so a resume would lose it; drop the compression flag")
    if getattr(cfg.checkpoint, "ckpt_format", "torch") == "torch_dist":
        raise ValueError(f"{flag} with --ckpt-format torch_dist: save with --ckpt-format torch (its files do not "
                         "depend on the CP size)")
    if d.dynapipe_cp_sizes:
        check_variable_cp(cfg)
    if m.seq_length is not None and m.seq_length % cp_granule(cfg):
        tp = p.tensor_model_parallel_size if m.sequence_parallel else 1
        raise ValueError(f"{flag}: --seq-length ({m.seq_length}) must be a multiple of 2 x CP"
                         + (f" x TP (--sequence-parallel) = {cp_granule(cfg)}" if tp > 1 else f" = {2 * cp}")
                         + " (each CP rank holds two chunks of every sequence)")


def check_variable_cp(cfg) -> None:
    """--dynapipe-cp-sizes (the CP size chosen per micro-batch): one line per combination not built."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    sizes, cp = tuple(d.dynapipe_cp_sizes), p.context_parallel_size
    flag = f"--dynapipe-cp-sizes {','.join(map(str, sizes))}"
    if not d.dynapipe or cp < 2:
        raise ValueError(f"{flag} picks each DynaPipe micro-batch's CP size inside a CP group: it needs --dynapipe "
                         "and --context-parallel-size N > 1 (the largest size)")
    if any(c < 1 or cp % c for c in sizes) or cp not in sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"{flag}: each size must divide --context-parallel-size {cp}, without repeats, and {cp} "
                         f"must be one of them (e.g. --dynapipe-cp-sizes 1,{cp})")
    if p.tensor_model_parallel_size > 1 or p.num_layers_per_virtual_pipeline_stage:
        raise ValueError(f"{flag} runs with TP 1 and one stage per pipeline rank only (sub-groups inside TP, "
                         "and interleaved stages, are not built); use --context-parallel-size alone for a static "
                         "CP group")
    if d.dynapipe_trace_dir:
        raise ValueError(f"{flag} with --dynapipe-trace-dir: the simulated timeline is drawn per DP group, not per "
                         "CP lane; drop --dynapipe-trace-dir")
    if m.hidden_dropout > 0 or m.attention_dropout > 0:
        raise ValueError(f"{flag} with dropout: micro-batches at CP 1 run the plain attention, whose dropout "
                         "masks are not keyed by token position; set --hidden-dropout 0 --attention-dropout 0")


def check_cp_parallel(p) -> None:
    """What --context-parallel-size needs from the parallel layout alone (`ParallelConfig`)."""
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
    _require(p.cp_comm_type in ("all_gather", "p2p"),
             f"--cp-comm-type must be all_gather or p2p, got {p.cp_comm_type!r}")
    if cp == 1:
        return
    _require(p.stage_parallel is None,
             "--context-parallel-size with --aceso-config: per-stage TP x DP sizes give stages different "
             "rank counts, but a CP group holds the same sequence chunks on every stage; drop one")
    _require(p.world_size % (tp * pp * cp) == 0,
             f"world size ({p.world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {tp * pp * cp}")
