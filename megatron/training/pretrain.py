"""Wiring shared by the entry points: process groups, tokenizer, datasets, model stages,
planner, trainer, checkpoints. `run_pretraining(cfg)` returns the process exit code."""
from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from typing import Callable

import torch.distributed as dist

from megatron.training import interrupt
from megatron.training.batching import gpt_microbatch
from megatron.checkpointing import async_save
from megatron.checkpointing.torch_format import CheckpointError, load_checkpoint, save_checkpoint
from megatron.config.core import MegatronConfig
from megatron.config.schedules import SPLIT_SCHEDULES, schedule_description
from megatron.training.initialize import initialize_megatron
from megatron.training.trainer import RunInputError
from megatron.training.logging import gpt_flops_per_sample, print_rank_0
from megatron.planner.passes import plan_passes


def tokenizer_from_config(cfg: MegatronConfig):
    d = cfg.data
    if d.tokenizer_type is None:
        return None
    from megatron.tokenizer import build_tokenizer
    return build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                           tokenizer_model=d.tokenizer_model, vocab_size=cfg.model.vocab_size,
                           vocab_extra_ids=d.vocab_extra_ids)


def sample_counts(cfg: MegatronConfig):
    """(train, validation) samples a run consumes: datasets are built to exactly that size."""
    t = cfg.training
    n_train = t.train_iters * t.global_batch_size
    n_valid = (t.train_iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size
    return n_train, n_valid


def gpt_datasets(cfg: MegatronConfig):
    t = cfg.training
    n_train, n_valid = sample_counts(cfg)
    if cfg.data.mock_data:
        from megatron.data.mock_dataset import MockGPTDataset
        return (MockGPTDataset(n_train, cfg.model.seq_length, cfg.model.vocab_size, t.seed),
                MockGPTDataset(n_valid, cfg.model.seq_length, cfg.model.vocab_size, t.seed + 1))
    from megatron.data.gpt_dataset import build_gpt_datasets
    train, valid, _ = build_gpt_datasets(cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed,
                                         (n_train, n_valid, 0), cfg.data.data_cache_path)
    return train, valid


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the one trainer builder needs to know of a model, as one record per model (GPT here,
    T5 in `t5_builder.py`); everything else (planner, plan passes, sources, trainer) is shared."""
    name: str
    # (cfg, ps) -> (ps, stages, model chunks per rank, tied params, extra tied (params, group) pairs);
    # collective: every rank calls it (T5 creates its position-table groups)
    build: Callable
    activation_shapes: Callable  # (cfg, ps, microbatch shapes) -> shapes at each stage boundary
    microbatch_shapes: Callable  # micro-batch dict -> its shape key
    collate: Callable            # samples -> micro-batch dict
    flops_per_sample: Callable   # (model config, padded vocabulary) -> FLOPs of one sample
    datasets: Callable           # (cfg, tokenizer) -> (train, valid) pretraining datasets


def _gpt_build(cfg: MegatronConfig, ps):
    from megatron.models.gpt import build_gpt_stages, num_model_chunks, tied_embedding_params
    stages = build_gpt_stages(cfg, ps)
    chunks = num_model_chunks(cfg)
    tied = [] if cfg.model.untie_embeddings_and_output_weights else tied_embedding_params(stages, ps.pp_size * chunks)
    return ps, stages, chunks, tied, []


def _gpt_activation_shapes(cfg: MegatronConfig, ps, shapes):
    from megatron.models.gpt import gpt_activation_shapes
    # per-stage TP: the layout pass cuts each rank's block of the sequence
    return gpt_activation_shapes(cfg.model, shapes, 1 if ps.stage_layouts else ps.tp_size)


def _gpt_microbatch_shapes(mb):
    from megatron.training.trainer import gpt_microbatch_shapes
    return gpt_microbatch_shapes(mb)


GPT = ModelSpec("gpt", _gpt_build, _gpt_activation_shapes, _gpt_microbatch_shapes, gpt_microbatch,
                gpt_flops_per_sample, lambda cfg, tokenizer: gpt_datasets(cfg))


def _zb_costs(cfg, ps, chunks, model):
    """GPT zero-bubble runs: `m -> per-stage costs` the schedule's orders are chosen with (the
    `--dynapipe-cost-model` table, else an analytic estimate; `planner/schedule/zb_costs.py`)."""
    from megatron.config.schedules import SPLIT_SCHEDULES
    if model.name != "gpt" or cfg.parallel.pipeline_schedule not in SPLIT_SCHEDULES or ps.pp_size < 2:
        return None
    from megatron.models.stage_split import stage_layer_split
    from megatron.planner.schedule.zb_costs import run_stage_costs
    layers = stage_layer_split(cfg.model.num_layers, ps.pp_size * chunks, cfg.parallel.pipeline_stage_layers)
    return run_stage_costs(cfg, ps.tp_size, layers)


def build_trainer(cfg: MegatronConfig, ps, device, model: ModelSpec):
    """Tokenizer, stages, planner (with the run's plan passes), batch source and trainer for `model`."""
    from megatron.planner.schedule.fixed import FixedBatchPlanner
    from megatron.training.trainer import Trainer
    if cfg.model.model_type != model.name:
        raise ValueError(f"the {model.name} builder needs model_type {model.name!r}, got {cfg.model.model_type!r}")
    tokenizer = tokenizer_from_config(cfg)
    if tokenizer is not None:
        # With a tokenizer, --vocab-size is only its input (NullTokenizer); the model's vocabulary
        # is the tokenizer's (T5: sentinels included). With --mock-data alone it is the whole vocabulary.
        cfg.model.vocab_size = tokenizer.vocab_size
    ps, stages, chunks, tied, extra = model.build(cfg, ps)
    planner = FixedBatchPlanner(cfg.parallel.pipeline_schedule, ps.pp_size, chunks,
                                lambda shapes: model.activation_shapes(cfg, ps, shapes),
                                cfg.training.recompute_level, cfg.training.params_dtype_name,
                                plan_pass=plan_passes(cfg, ps.stage_layouts),
                                zb_costs=_zb_costs(cfg, ps, chunks, model))
    flops = model.flops_per_sample(cfg.model, cfg.model.padded_vocab_size(ps.tp_size))
    common = dict(tied_params=tied, flops_per_sample=flops, extra_tied_groups=extra)
    shapes_fn = model.microbatch_shapes
    if cfg.parallel.context_parallel:  # plans carry the shapes a CP rank runs: its share of each row
        from megatron.config.context_parallel import cp_granule
        from megatron.core.context_parallel import local_shapes_fn
        shapes_fn = local_shapes_fn(shapes_fn, ps.cp_size, cp_granule(cfg))
    if cfg.data.targets_data_path:  # multi-task (inputs, targets): DynaPipe, packing or fixed micro-batches
        if cfg.terapipe.enabled and not cfg.data.dynapipe:  # the same batches (fixed or packed rows), sliced
            # (with --dynapipe the DynaPipe planner slices its own micro-batches)
            from megatron.planner.terapipe.planner import terapipe_planner
            planner = terapipe_planner(cfg, ps)
        source = supervised_source(cfg, ps, tokenizer, planner, shapes_fn)
        trainer = Trainer(cfg, ps, device, stages, batch_source=source, valid_source=source.valid_source, **common)
        if cfg.terapipe.enabled:  # dropout keyed by token position, as training/terapipe.py
            from megatron.training.terapipe import keyed_dropout
            keyed_dropout(trainer, cfg, ps)
        return _context_parallel(trainer, cfg, ps)
    train_ds, valid_ds = model.datasets(cfg, tokenizer)
    if cfg.terapipe.enabled:
        from megatron.training.terapipe import terapipe_trainer
        return terapipe_trainer(cfg, ps, device, stages, train_ds, valid_ds, tied, flops)
    return _context_parallel(Trainer(cfg, ps, device, stages, train_ds=train_ds, valid_ds=valid_ds,
                                     collate_fn=model.collate, planner=planner, shapes_fn=shapes_fn, **common), cfg, ps)


def build_gpt_trainer(cfg: MegatronConfig, ps, device):
    return build_trainer(cfg, ps, device, GPT)


def _context_parallel(trainer, cfg: MegatronConfig, ps):
    """--context-parallel-size: every CP rank of a DP rank loads the same micro-batches and
    keeps its chunks of each sequence (plans were made for those local shapes)."""
    if not cfg.parallel.context_parallel:
        return trainer
    from megatron.core.context_parallel import ContextParallelSource
    trainer.batch_source = ContextParallelSource(trainer.batch_source, cfg, ps)
    if trainer.valid_source is not None:
        trainer.valid_source = ContextParallelSource(trainer.valid_source, cfg, ps)
    return trainer


def supervised_source(cfg: MegatronConfig, ps, tokenizer, planner, shapes_fn):
    """Batch source for multi-task (inputs, targets) data: DynaPipe, packing or fixed micro-batches."""
    from megatron.data.supervised_dataset import build_supervised_datasets
    from megatron.training.supervised import (BaselineSource, DynaPipeSource, dynapipe_planner_config,
                                              supervised_valid_source, tokenizer_ids)
    if tokenizer is None:
        raise ValueError("multi-task data (--targets-data-path) needs --tokenizer-type for its pad/eod ids")
    train, valid, _ = build_supervised_datasets(cfg.data.data_path, cfg.data.targets_data_path, cfg.data.split)
    if train is None:
        raise ValueError(f"--split {cfg.data.split} leaves no training pairs")
    ids = tokenizer_ids(tokenizer)
    if cfg.data.dynapipe:
        source = DynaPipeSource(cfg, ps, train, ids, dynapipe_planner_config(cfg, ps),
                                cfg.data.dynapipe_planner_workers, cfg.data.dynapipe_lookahead)
    else:
        source = BaselineSource(cfg, ps, train, ids, planner, shapes_fn, pack=cfg.data.pack_dataset)
    source.valid_source = supervised_valid_source(cfg, ps, valid, ids)  # the Trainer's valid_source
    return source


def report_failure(ps, what: str, message: str, trace: str = "", exc: BaseException = None) -> None:
    """How a rank reports the error that ended its run: rank 0 in full (the traceback of an
    unexpected error), every other rank one short line (its own error's first line and where it
    was raised, which names the culprit when only that rank failed). A message that already
    starts with this rank's description is not prefixed twice."""
    who = ps.describe()
    text = message[len(who) + 2:] if message.startswith(who + ": ") else message
    from megatron.cli.parser import tell_torchrun
    tell_torchrun(f"{who}: {what}: {(text.strip().splitlines() or [''])[0][:300]}")  # ends torchrun's summary
    if ps.rank == 0:
        print(f"{who}: {what}:" + (f"\n{trace}" if trace else f" {text}"), file=sys.stderr, flush=True)
        return
    first = (text.strip().splitlines() or [""])[0]
    where = ""
    if exc is not None and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" (at {os.path.relpath(frame.filename)}:{frame.lineno})"
    print(f"{who}: {what}: {first[:300]}{where}; rank 0 reports the job's failure", file=sys.stderr, flush=True)


def _save_whole(trainer) -> None:
    """save_checkpoint with Ctrl-C held back until the checkpoint is complete and named (with
    --async-save: until this rank's state is copied and handed to its writer thread)."""
    with interrupt.deferred():
        if trainer.cfg.checkpoint.async_save:
            async_save.save_checkpoint_async(trainer)
        else:
            save_checkpoint(trainer)


def _interrupted(cfg, trainer) -> int:
    async_save.finish_after_interrupt(trainer)  # --async-save: the file being written is finished
    return interrupt.report(cfg.checkpoint.save, trainer)


def run_pretraining(cfg: MegatronConfig, build_trainer=build_gpt_trainer) -> int:
    interrupt.install()
    trainer = None
    try:
        ps, device = initialize_megatron(cfg)
    except KeyboardInterrupt:
        interrupt.uninstall()
        return interrupt.report(cfg.checkpoint.save)
    except BaseException:
        interrupt.uninstall()
        raise
    try:
        if cfg.data.tokens_per_global_batch and cfg.data.targets_data_path:
            how = "dynapipe" if cfg.data.dynapipe else "packing" if cfg.data.pack_dataset else "fixed micro-batches"
            batch = f"global batches of <= {cfg.data.tokens_per_global_batch} tokens ({how})"
        else:
            batch = (f"global batch {cfg.training.global_batch_size} = {cfg.num_microbatches} micro-batches x "
                     f"{cfg.training.micro_batch_size} x DP {ps.dp_size}")
        if ps.stage_layouts:
            layers = cfg.parallel.pipeline_stage_layers or [cfg.model.num_layers // ps.pp_size] * ps.pp_size
            layout = "stages " + " | ".join(f"TP{t}xDP{d} ({n} layers)" for (t, d), n in zip(ps.stage_layouts, layers))
            batch = (f"global batch {cfg.training.global_batch_size} = {cfg.num_microbatches} pipeline micro-batches "
                     f"of {cfg.training.micro_batch_size}, split over each stage's DP ranks")
        else:
            layout = f"TP={ps.tp_size} PP={ps.pp_size} DP={ps.dp_size}"
            layout += f" CP={ps.cp_size}" if ps.cp_size > 1 else ""
        print_rank_0(f"> {cfg.model.model_type.upper()}: {cfg.model.num_layers} layers, "
                     f"hidden {cfg.model.hidden_size}, "
                     f"{layout}, {batch}")
        print_rank_0(f"> pipeline schedule: {schedule_description(cfg, ps.pp_size)}")
        if ps.pp_size == 1 and cfg.parallel.pipeline_schedule in SPLIT_SCHEDULES:
            print_rank_0(f"note: --pipeline-schedule {cfg.parallel.pipeline_schedule} at "
                         f"--pipeline-model-parallel-size 1 has no pipeline to schedule: each micro-batch runs "
                         f"forward then backward (as 1f1b)")
        from megatron.checkpointing.megatron_write import cannot_save
        if cannot_save(cfg, ps):  # a layout --ckpt-format cannot save: refused now, not at the first save
            raise CheckpointError(cannot_save(cfg, ps))
        trainer = build_trainer(cfg, ps, device)
        if cfg.checkpoint.load:
            load_checkpoint(trainer)
        trainer.train(save_fn=_save_whole if cfg.checkpoint.save else None)
        if cfg.checkpoint.save and (not cfg.checkpoint.save_interval
                                    or trainer.iteration % cfg.checkpoint.save_interval != 0):
            _save_whole(trainer)
        if cfg.checkpoint.async_save:  # the end of training waits for the save in flight and names it
            with interrupt.deferred():
                async_save.maybe_finalize(trainer, blocking=True)
        return 0
    except KeyboardInterrupt:
        return _interrupted(cfg, trainer)
    except (CheckpointError, RunInputError) as e:
        if interrupt.received():
            return _interrupted(cfg, trainer)
        report_failure(ps, "checkpoint error" if isinstance(e, CheckpointError) else "error", str(e))
        return 1
    except Exception as e:
        if interrupt.received():  # a peer stopped first and our collective failed: same Ctrl-C
            return _interrupted(cfg, trainer)
        report_failure(ps, "training failed", f"{type(e).__name__}: {e}", traceback.format_exc(), e)
        return 1
    finally:
        from megatron.core import heartbeat
        heartbeat.shutdown()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        interrupt.uninstall()
