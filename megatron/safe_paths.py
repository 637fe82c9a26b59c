"""One path rule for every reader of a checkpoint (or any folder someone else may have written).

A file is read only if it is a regular file inside its folder, reached without following a link
below that folder, and no larger than its format allows:

- the name is checked first, as text (not absolute, no `..`, no NUL): a manifest entry naming
  `../../etc/hostname` or `/dev/zero` is refused as "outside the folder" before anything is
  opened or even looked up, so a refusal never tells whether an outside file exists;
- every component below the folder is `lstat`ed: a symbolic link (to another checkpoint, to
  `/dev/zero`) is refused naming the link and its target. The folder itself (`--load`) may be
  a link: the user chose it;
- the last component must be a regular file: a FIFO (which blocks `open` forever), a device
  (`/dev/zero`, endless) or a socket is refused from `lstat`, before any open;
- a read is bounded: a tracker holds a few bytes, a JSON manifest or config a few MB; the
  bytes are read from a descriptor opened with O_NOFOLLOW | O_NONBLOCK and checked again
  with `fstat`, so a file swapped for a FIFO or a link after the check is still refused.

Readers that hand the path to another library (`torch.load`, `safetensors`, `np.memmap`)
call `regular_file` first; their reads are bounded by the file's real size.
"""
from __future__ import annotations

import os
import stat

TRACKER_BYTES = 64          # "release" or an iteration number, with a newline
CHECKSUM_BYTES = 256        # one sha256 hex digest and a file name
JSON_BYTES = 64 << 20       # manifests, configs, DCP metadata.json
INDEX_BYTES = 4 << 30       # a DCP .metadata index (grows with the chunk count)


class UnsafePathError(OSError):
    """A path a reader refuses: outside its folder, through a link, or not a regular file.
    An OSError, so every reader's existing "cannot read" handling reports it in one line."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "refused path"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def check_name(folder: str, relpath, what: str = "file") -> str:
    """`relpath` as a normalised path below `folder`, refused from its text alone when it could
    lead outside (absolute, `..`, NUL, not a string)."""
    if not isinstance(relpath, str) or not relpath or "\0" in relpath or os.path.isabs(relpath) \
            or relpath.startswith("\\"):
        raise UnsafePathError(f"{folder}: {what} {str(relpath)[:120]!r} is outside the folder; refused "
                              f"(a checkpoint may only name files inside itself)")
    norm = os.path.normpath(relpath)
    if norm == os.pardir or norm.startswith(os.pardir + os.sep) or norm == os.curdir:
        raise UnsafePathError(f"{folder}: {what} {relpath[:120]!r} is outside the folder; refused "
                              f"(a checkpoint may only name files inside itself)")
    return norm


def inside(folder: str, relpath, what: str = "file") -> str:
    """folder/relpath when no component below `folder` is a link (FileNotFoundError when a
    component is missing, as `open` would raise)."""
    norm = check_name(folder, relpath, what)
    cur = folder
    for part in norm.split(os.sep):
        cur = os.path.join(cur, part)
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(cur)
            except OSError:
                target = "?"
            raise UnsafePathError(f"{cur}: a symbolic link (to {target[:160]}) inside {folder}; refused (a reader "
                                  f"never follows a link out of its folder; copy the file in instead)")
    return cur


def regular_file(folder: str, relpath, what: str = "file") -> str:
    """folder/relpath if it is a regular file inside `folder` reached without links, else
    UnsafePathError (FileNotFoundError when missing)."""
    path = inside(folder, relpath, what)
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{path}: {_kind(mode)}, not a regular file; refused ({what}: a plain file only)")
    return path


def is_regular_inside(folder: str, relpath) -> bool:
    """True when `regular_file` would accept the path (False for missing, link, special)."""
    try:
        regular_file(folder, relpath)
        return True
    except OSError:
        return False


def read_bytes(folder: str, relpath, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file inside `folder`, at most `max_bytes` (a larger file is refused)."""
    path = regular_file(folder, relpath, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped after the check
            raise UnsafePathError(f"{path}: {_kind(st.st_mode)}, not a regular file; refused")
        if st.st_size > max_bytes:
            raise UnsafePathError(f"{path}: {st.st_size} bytes, more than a {what} may hold ({max_bytes}); refused")
        chunks, left = [], max_bytes + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafePathError(f"{path}: more than a {what} may hold ({max_bytes} bytes); refused")
    return data


def read_text(folder: str, relpath, max_bytes: int, what: str = "file") -> str:
    data = read_bytes(folder, relpath, max_bytes, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnsafePathError(f"{os.path.join(folder, relpath)}: not UTF-8 text ({e.reason} at byte {e.start}); "
                              f"refused") from None


def regular_path(path: str, what: str = "file") -> str:
    """`path` (links followed: a user's own data paths may be links) if it ends at a regular file;
    a FIFO or device is refused from `stat`, before anything opens it."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{path}: {_kind(mode)}, not a regular file; refused ({what}: a plain file only)")
    return path


def first_refusal(folder: str, relpaths, regular: bool = True) -> "str | None":
    """Why the first of `relpaths` that exists is refused (a link, outside, not a regular file;
    with regular=False only the first two: folders), or None: missing files are left to the
    caller, which knows whether they may be missing."""
    for rel in relpaths:
        try:
            (regular_file if regular else inside)(folder, rel)
        except FileNotFoundError:
            continue
        except OSError as e:
            return str(e)
    return None
