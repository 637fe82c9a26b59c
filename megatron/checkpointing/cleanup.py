"""What killed saves of this project leave under a --save folder, and its removal.

Only the job that holds the folder's writer lock cleans (checkpoint_ownership); a folder without
this project's `.saving.json` marker is never touched."""
from __future__ import annotations

import os
import re
import shutil
import socket
import time

from megatron.checkpointing import ownership as checkpoint_ownership

MANIFEST = "manifest.json"
_TMP_PREFIX = ".tmp-"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_STAGED_RE = re.compile(r"^(iter_\d{7})\.(saving|replaced)$")


def _is_stale_temporary(name: str, age_s: float, max_age_s: float) -> bool:
    """A temporary is stale when its writer (same host) is dead, or, for another host's, when old."""
    m = re.match(re.escape(_TMP_PREFIX) + r"(.+)-(\d+)-[^-]*$", name)
    if m and m.group(1) == socket.gethostname():
        try:
            os.kill(int(m.group(2)), 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
    return age_s > max_age_s


def remove_stale_files(root: str, max_age_s: float = 3600.0) -> list:
    """Remove what killed saves of this project left under `root`: temporaries of dead writers,
    iteration folders whose `.saving.json` marker names a writer that is gone, and the staging
    folders of a torch_dist re-save. Folders without that marker (Megatron-LM's, a live run's,
    a person's) are never touched, whatever they lack.

    Only the job holding `root`'s writer lock (checkpoint_ownership.claim, rank 0) cleans; for
    anyone else this does nothing. Returns what it removed."""
    removed = []
    if not os.path.isdir(root) or not checkpoint_ownership.holds(root):
        return removed
    now = time.time()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if not name.startswith(_TMP_PREFIX):
                continue
            full = os.path.join(dirpath, name)
            try:
                age = now - os.path.getmtime(full)
            except OSError:
                continue
            if _is_stale_temporary(name, age, max_age_s):
                try:
                    os.unlink(full)
                    removed.append(full)
                except OSError:
                    pass
    for name in sorted(os.listdir(root)):  # (".replaced" sorts before ".saving")
        full = os.path.join(root, name)
        m = _STAGED_RE.match(name)
        if m and m.group(2) == "replaced":  # a torch_dist re-save swapped halfway (see _save_dist)
            it_dir = os.path.join(root, m.group(1))
            if not os.path.isdir(it_dir):
                os.replace(full, it_dir)  # killed between the two renames: the old save is the checkpoint
            elif os.path.exists(os.path.join(it_dir, MANIFEST)):
                shutil.rmtree(full, ignore_errors=True)  # the new save is complete: the old one is ours to drop
            else:
                continue
            removed.append(full)
            continue
        if not (m or _ITER_RE.match(name)) or os.path.islink(full) or not os.path.isdir(full):
            continue  # (a link is never cleaned through, nor reported removed)
        if os.path.exists(os.path.join(full, MANIFEST)):
            checkpoint_ownership.unmark(full)  # complete; killed after its manifest, before the unmark
        elif checkpoint_ownership.abandoned_save(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed
