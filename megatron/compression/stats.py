"""`--log-compression-stats`: what each compressed message cost and how wrong it was.

Per (pipeline stage, message kind) and log window:
  * ratio      bytes an uncompressed message would have sent / bytes sent;
  * sent_err   |decoded - true| / |true|, `true` being the gradient before any residual was
               folded in (so with error feedback it also shows how much the residual moved
               what was sent away from this message's own gradient);
  * residual   |kept residual| / |true| (only where a residual is kept);
  * orth       |P^T P - I|_F of the orthonormalised factor (numerical health of the QR);
  * ms         compression time per message (encode and, for collectives, the reduction).

Kinds: `pp_grad` (compressed backpropagation), `dp` (data-parallel reducer), `emb` (tied
embedding all-reduce), `tp_grad` / `tp_act` (tensor-parallel all-reduces).

Per-message values stay tensors on the device (summed there), so recording never forces a
host sync; the one sync per window happens in `report`, which all ranks call at the log
interval (a gather to the logging rank, one compact line, TensorBoard scalars). Nothing here
runs unless the flag is on: the compressors hold `stats = None` otherwise.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import torch

METRICS = ("sent_err", "residual", "orth")


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a| / |b| as a 0-d float tensor (0 when b is 0: nothing to be wrong about)."""
    nb = torch.linalg.vector_norm(b.float())
    return torch.where(nb > 0, torch.linalg.vector_norm(a.float()) / nb.clamp_min(1e-30), torch.zeros_like(nb))


def orth_error(p: torch.Tensor) -> torch.Tensor:
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    eye = torch.eye(p.shape[1], device=p.device, dtype=p.dtype)
    return torch.linalg.matrix_norm(p.t() @ p - eye)


class Timer:
    """Wall time of a compression step; on CUDA it synchronises (only used with the flag on)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0


class CompressionStats:
    def __init__(self):
        self._reset()

    def _reset(self):
        # (stage, kind) -> {"n", "raw", "sent", "s", metric -> (tensor sum, count)}
        self.acc: Dict[Tuple[int, str], dict] = {}

    def record(self, stage: int, kind: str, *, raw_bytes: int, sent_bytes: int, seconds: float = 0.0,
               true: Optional[torch.Tensor] = None, decoded: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None, p: Optional[torch.Tensor] = None) -> None:
        a = self.acc.setdefault((stage, kind), {"n": 0, "raw": 0, "sent": 0, "s": 0.0})
        a["n"] += 1
        a["raw"] += raw_bytes
        a["sent"] += sent_bytes
        a["s"] += seconds
        vals = {}
        if true is not None and decoded is not None:
            vals["sent_err"] = rel(decoded.reshape(true.shape) - true, true)
        if true is not None and residual is not None:
            vals["residual"] = rel(residual, true)
        if p is not None:
            vals["orth"] = orth_error(p)
        for k, v in vals.items():
            s, c = a.get(k, (0.0, 0))
            a[k] = (v.detach() + s, c + 1)

    def add_time(self, stage: int, kind: str, seconds: float) -> None:
        if (stage, kind) in self.acc:
            self.acc[(stage, kind)]["s"] += seconds

    def snapshot(self) -> Dict[Tuple[int, str], dict]:
        """This rank's window as plain numbers (the host sync happens here), then reset."""
        out = {}
        for key, a in self.acc.items():
            row = {"n": a["n"], "raw": a["raw"], "sent": a["sent"], "s": a["s"]}
            for m in METRICS:
                if m in a:
                    s, c = a[m]
                    row[m] = (float(s), c)
            out[key] = row
        self._reset()
        return out

    def report(self, iteration: int, dist_world: Optional[object], is_logger: bool, writer=None) -> Optional[str]:
        """Collective when `dist_world` is a process group (every rank calls it at the same
        iteration): gathers all ranks' windows to the logging rank, which merges them per
        (stage, kind) over data-parallel replicas, prints one line and writes TensorBoard."""
        mine = self.snapshot()
        if dist_world is not None:
            import torch.distributed as dist
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if not is_logger:
            return None
        merged = merge(gathered)
        if not merged:
            return None
        line = format_line(iteration, merged)
        print(line, flush=True)
        if writer is not None:
            for (stage, kind), row in merged.items():
                for name, value in summary(row).items():
                    writer.add_scalar(f"compression/stage{stage}/{kind}/{name}", value, iteration)
            writer.flush()
        return line


def merge(windows) -> Dict[Tuple[int, str], dict]:
    out: Dict[Tuple[int, str], dict] = {}
    for w in windows:
        for key, row in (w or {}).items():
            a = out.setdefault(key, {"n": 0, "raw": 0, "sent": 0, "s": 0.0})
            for f in ("n", "raw", "sent", "s"):
                a[f] += row[f]
            for m in METRICS:
                if m in row:
                    s, c = a.get(m, (0.0, 0))
                    a[m] = (s + row[m][0], c + row[m][1])
    return out


def summary(row: dict) -> Dict[str, float]:
    out = {"ratio": row["raw"] / row["sent"] if row["sent"] else float("nan"),
           "ms": 1e3 * row["s"] / max(row["n"], 1)}
    for m in METRICS:
        if m in row and row[m][1]:
            out[m] = row[m][0] / row[m][1]
    return out


def format_line(iteration: int, merged: Dict[Tuple[int, str], dict]) -> str:
    parts = []
    for (stage, kind) in sorted(merged):
        s = summary(merged[(stage, kind)])
        text = f"stage {stage} {kind}: {s['ratio']:.1f}x"
        for m in METRICS:
            if m in s:
                text += f" {m} {s[m]:.3g}"
        text += f" {s['ms']:.2f} ms x{merged[(stage, kind)]['n']}"
        parts.append(text)
    return f" compression stats (iteration {iteration}) | " + " | ".join(parts) + " |"
