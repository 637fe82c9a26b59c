"""Unknown keys in a hand-written JSON config are refused, with the nearest valid key.

A misspelt key (`num_gpu` for `num_gpus`) would otherwise be ignored and its default used
silently; every JSON config reader calls `refuse_unknown_keys` on each object it reads.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Type


def unknown_key_message(doc: dict, allowed: Iterable[str], where: str) -> str:
    """'' when every key of `doc` is in `allowed`, else one line naming the first unknown key
    and the closest allowed one (or the whole list when none is close)."""
    allowed = sorted(set(allowed))
    for key in doc:
        if key in allowed:
            continue
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(allowed)}"
        return f"{where}: unknown key '{key}' ({hint})"
    return ""


def refuse_unknown_keys(doc: dict, allowed: Iterable[str], where: str, error: Type[Exception] = ValueError) -> None:
    """Raise `error` with `unknown_key_message` when `doc` holds a key outside `allowed`."""
    msg = unknown_key_message(doc, allowed, where) if isinstance(doc, dict) else ""
    if msg:
        raise error(msg)
