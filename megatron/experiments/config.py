"""Experiment grids as data: load and validate `experiment_configs/*.json` (fields documented in
`experiment_configs/README.md`). Every problem is reported before any run, naming the file and
the field."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from megatron.atomic import write_json
from megatron.config.json_keys import refuse_unknown_keys

ROOT = Path(__file__).resolve().parents[2]
# packing: the DynaPipe paper's (attention over whole rows); packing_varlen / packing_balanced:
# per-document attention (next-fit / WLB-LLM cost-balanced), see megatron.planner.dynapipe.baselines.
SYSTEMS = ("dynapipe", "packing", "packing_varlen", "packing_balanced", "fixed")
RECOMPUTE = ("none", "selective", "full")


class ExperimentConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # gpt | t5
    cost_model: str  # path relative to the repository root
    hidden_size: int
    num_layers: int = 0  # GPT
    encoder_layers: int = 0  # T5
    decoder_layers: int = 0
    max_lens: tuple = ()
    script: Optional[str] = None  # live: pretrain_gpt.py / pretrain_t5.py
    flags: tuple = ()  # live: model-shape and data flags passed to the script
    systems: tuple = SYSTEMS  # systems to run for this model


@dataclass(frozen=True)
class Setting:
    """One point of the experiment grid (a model at a max length on a cluster size)."""
    model: str
    max_len: int
    gpus: int
    tokens: int  # global batch token budget

    @property
    def key(self) -> str:
        return f"{self.model}_L{self.max_len}_G{self.gpus}"


@dataclass
class Grid:
    path: str
    name: str
    models: Dict[str, ModelSpec]
    cluster_sizes: List[int]
    tokens_per_gpu: int
    memory_limit_mb: float
    gpus_per_node: int
    tp: List[int]
    pp: List[int]
    micro_batch_sizes: List[int]
    recompute: List[str]
    search_batches: int
    benchmark_batches: int
    seed: int = 1
    lengths_file: Optional[str] = None
    live: dict = field(default_factory=dict)

    def settings(self) -> List[Setting]:
        return [Setting(m, L, g, self.tokens_per_gpu * g)
                for m, spec in self.models.items() for L in spec.max_lens for g in self.cluster_sizes]

    def layouts(self, spec: ModelSpec, gpus: int) -> List[dict]:
        """PP x TP x DP with PP x TP x DP = gpus, PP splitting the model's layers evenly."""
        out = []
        for pp in self.pp:
            for tp in self.tp:
                if gpus % (pp * tp):
                    continue
                if spec.kind == "gpt" and spec.num_layers % pp:
                    continue
                if spec.kind == "t5" and pp > 1 and (pp % 2 or spec.encoder_layers % (pp // 2)
                                                     or spec.decoder_layers % (pp // 2)):
                    continue
                out.append({"pp": pp, "tp": tp, "dp": gpus // (pp * tp)})
        return out


def _need(doc, key, typ, where, default=...):
    if key not in doc:
        if default is not ...:
            return default
        raise ExperimentConfigError(f"{where}: missing field '{key}'")
    v = doc[key]
    ok = isinstance(v, typ) and not (typ in (int, (int, float)) and isinstance(v, bool))
    if not ok:
        name = typ.__name__ if isinstance(typ, type) else "number"
        raise ExperimentConfigError(f"{where}: field '{key}' must be a {name}, got {v!r}")
    return v


def _known(doc, keys, where):
    """A misspelt field is refused with the nearest valid one, not silently given its default."""
    refuse_unknown_keys(doc, keys, where, ExperimentConfigError)


def _int_list(doc, key, where, allowed=None, default=...):
    v = _need(doc, key, list, where, default)
    if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise ExperimentConfigError(f"{where}: field '{key}' must be a non-empty list of positive integers, got {v!r}")
    if allowed is not None and any(x not in allowed for x in v):
        raise ExperimentConfigError(f"{where}: field '{key}' has values outside {allowed}: {v!r}")
    return v


def load_grid(path) -> Grid:
    """Read and validate one grid file; relative paths inside it are relative to the repository root."""
    path = Path(path)
    where = str(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExperimentConfigError(f"{where}: no such experiment config") from None
    except json.JSONDecodeError as e:
        raise ExperimentConfigError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ExperimentConfigError(f"{where}: the top level must be a JSON object")
    _known(doc, ("name", "models", "grid", "cluster_sizes", "tokens_per_gpu", "memory_limit_mb", "gpus_per_node",
                 "search_batches", "benchmark_batches", "seed", "lengths_file", "live"), where)
    models_doc = _need(doc, "models", dict, where)
    if not models_doc:
        raise ExperimentConfigError(f"{where}: field 'models' is empty")
    models = {}
    for name, m in models_doc.items():
        w = f"{where}: models.{name}"
        if not isinstance(m, dict):
            raise ExperimentConfigError(f"{w}: must be an object")
        _known(m, ("kind", "cost_model", "hidden_size", "num_layers", "encoder_layers", "decoder_layers", "max_lens",
                   "script", "flags", "systems"), w)
        kind = _need(m, "kind", str, w)
        if kind not in ("gpt", "t5"):
            raise ExperimentConfigError(f"{w}: field 'kind' must be 'gpt' or 't5', got {kind!r}")
        cm = _need(m, "cost_model", str, w)
        if not (ROOT / cm).is_file() and not Path(cm).is_file():
            raise ExperimentConfigError(f"{w}: field 'cost_model': no such file {cm!r}")
        spec = ModelSpec(
            name=name, kind=kind, cost_model=cm, hidden_size=_need(m, "hidden_size", int, w),
            num_layers=_need(m, "num_layers", int, w) if kind == "gpt" else 0,
            encoder_layers=_need(m, "encoder_layers", int, w) if kind == "t5" else 0,
            decoder_layers=_need(m, "decoder_layers", int, w) if kind == "t5" else 0,
            max_lens=tuple(_int_list(m, "max_lens", w)),
            script=_need(m, "script", str, w, None), flags=tuple(_need(m, "flags", list, w, [])),
            systems=tuple(_need(m, "systems", list, w, list(SYSTEMS))))
        if not spec.systems or any(x not in SYSTEMS for x in spec.systems) or "dynapipe" not in spec.systems:
            raise ExperimentConfigError(f"{w}: field 'systems' must list 'dynapipe' and any of {SYSTEMS[1:]}, "
                                        f"got {list(spec.systems)!r}")
        if spec.script is not None and spec.script not in ("pretrain_gpt.py", "pretrain_t5.py"):
            raise ExperimentConfigError(f"{w}: field 'script' must be pretrain_gpt.py or pretrain_t5.py")
        models[name] = spec
    grid = _need(doc, "grid", dict, where)
    gw = f"{where}: grid"
    _known(grid, ("tp", "pp", "micro_batch_sizes", "recompute"), gw)
    _known(doc.get("live") or {}, ("warmup_iters", "extra_flags", "timeout_s"), f"{where}: live")
    g = Grid(
        path=where, name=_need(doc, "name", str, where), models=models,
        cluster_sizes=_int_list(doc, "cluster_sizes", where),
        tokens_per_gpu=_need(doc, "tokens_per_gpu", int, where),
        memory_limit_mb=float(_need(doc, "memory_limit_mb", (int, float), where)),
        gpus_per_node=_need(doc, "gpus_per_node", int, where, 8),
        tp=_int_list(grid, "tp", gw), pp=_int_list(grid, "pp", gw),
        micro_batch_sizes=_int_list(grid, "micro_batch_sizes", gw),
        recompute=_need(grid, "recompute", list, gw),
        search_batches=_need(doc, "search_batches", int, where),
        benchmark_batches=_need(doc, "benchmark_batches", int, where),
        seed=_need(doc, "seed", int, where, 1),
        lengths_file=_need(doc, "lengths_file", str, where, None),
        live=_need(doc, "live", dict, where, {}))
    bad = [r for r in g.recompute if r not in RECOMPUTE]
    if bad or not g.recompute:
        raise ExperimentConfigError(f"{gw}: field 'recompute' must be a non-empty subset of {RECOMPUTE}, "
                                    f"got {g.recompute!r}")
    if g.lengths_file and not (ROOT / g.lengths_file).is_file() and not Path(g.lengths_file).is_file():
        raise ExperimentConfigError(f"{where}: field 'lengths_file': no such file {g.lengths_file!r}")
    for s in g.settings():
        if not g.layouts(models[s.model], s.gpus):
            raise ExperimentConfigError(f"{gw}: no PP x TP in the grid splits {s.model} over {s.gpus} GPUs")
    return g


# ---- per-setting config files (best_configs/, control_configs/, ablation_configs/) -------------

def setting_doc(grid: Grid, s: Setting) -> dict:
    return {"grid": grid.name, "model": s.model, "max_len": s.max_len, "gpus": s.gpus, "tokens": s.tokens}


def write_config(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, doc, indent=1, sort_keys=True)


SYSTEM_FIELDS = {"dynapipe": ("pp", "tp", "dp"),
                 **{s: ("pp", "tp", "dp", "micro_batch_size", "recompute") for s in SYSTEMS[1:]}}


def load_setting_config(path, grid: Grid) -> dict:
    """A best_/control_/ablation_configs file: {setting fields, "systems": {name: {fields}}}."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ExperimentConfigError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ExperimentConfigError(f"{where}: the top level must be a JSON object")
    _known(doc, ("grid", "model", "max_len", "gpus", "tokens", "backend", "systems", "variants"), where)
    for k, typ in (("model", str), ("max_len", int), ("gpus", int), ("tokens", int)):
        _need(doc, k, typ, where)
    if doc["model"] not in grid.models:
        raise ExperimentConfigError(f"{where}: field 'model': unknown model {doc['model']!r} "
                                    f"(grid {grid.path} has {sorted(grid.models)})")
    systems = _need(doc, "systems", dict, where)
    for name, sysdoc in systems.items():
        if name not in SYSTEMS:
            raise ExperimentConfigError(f"{where}: systems.{name}: unknown system (choose from {SYSTEMS})")
        if sysdoc is None:
            continue  # infeasible in the grid search
        for f in SYSTEM_FIELDS[name]:
            if f not in sysdoc:
                raise ExperimentConfigError(f"{where}: systems.{name}: missing field '{f}'")
    return doc
