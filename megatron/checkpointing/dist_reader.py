"""Reading a `torch_dist` iteration folder without letting it run code or reach outside itself.

`torch.distributed.checkpoint`'s own loader trusts its `.metadata` index: an entry declared
`BytesStorageMetadata` is read with `torch.load(weights_only=False)` (code runs), and a storage
entry's `relative_path` is joined to the folder unchecked (`../../x`, `/etc/passwd`). So this
project never calls `dcp.load`. It reads the index with an unpickler that builds only DCP's
metadata classes, then checks the whole index before opening any shard:

- every state-dict entry is exactly a `TensorStorageMetadata` (dtype, non-negative shape,
  chunks inside that shape) or a `BytesStorageMetadata` whose name the caller allows (this
  project writes none, so by default any byte entry is refused);
- every storage entry names a plain file of the folder (no separator, no `..`, not absolute,
  not a link) that the manifest lists, with an offset and length inside that file, and no
  stream transforms (compression/encryption extensions this project never writes);
- shards are read by this module: the byte range of a chunk goes through
  `torch.load(weights_only=True)` and must come back as one tensor of the declared dtype and
  chunk shape; byte entries are handed back as raw bytes, never unpickled.

Files are checked against the manifest's sha256 before loading (`checkpointing_dist.verify`,
shared over the ranks); a file's size is checked again against the manifest when it is opened.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from typing import Dict, Iterable, Optional

import torch

from megatron import safe_paths

MANIFEST = "manifest.json"
INDEX = ".metadata"


class DistCheckpointError(ValueError):
    """A torch_dist folder this reader refuses; the message is one line naming the file."""


class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "Path"),
        ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not part of a DCP index")


def read_manifest(it_dir: str) -> Dict[str, dict]:
    """{file name: {"sha256", "bytes"}} of `it_dir`'s manifest; names must be plain files of it."""
    path = os.path.join(it_dir, MANIFEST)
    try:
        files = json.loads(safe_paths.read_text(it_dir, MANIFEST, safe_paths.JSON_BYTES, "manifest"))["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
        for name, entry in files.items():
            _plain_name(name, path)
            if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                    and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0):
                raise TypeError(f"entry {name!r} is not {{'sha256': str, 'bytes': int}}")
    except DistCheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise DistCheckpointError(f"{path} is missing or unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    return files


def _plain_name(name, where: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise DistCheckpointError(f"{where}: file name {str(name)[:80]!r} is not a plain file of the checkpoint folder "
                                  f"(an index or manifest may not point elsewhere)")
    return name


def read_metadata(it_dir: str):
    """DCP's `Metadata` of `it_dir`, built only from DCP's metadata classes (structure unchecked:
    see `check_index`)."""
    path = os.path.join(it_dir, INDEX)
    try:
        data = safe_paths.read_bytes(it_dir, INDEX, safe_paths.INDEX_BYTES, "DCP index")
        if not data:
            raise EOFError("the file is empty")
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise DistCheckpointError(f"{path}: refused to load: {str(e)[:200]} "
                                  f"(a checkpoint must not carry code)") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError,
            MemoryError, RuntimeError) as e:
        raise DistCheckpointError(f"{path}: unreadable DCP index ({type(e).__name__}: {str(e)[:160]}); the save "
                                  f"was truncated or the file is not a torch_dist index") from None
    return md


def _is_size(v, ndim: Optional[int] = None) -> bool:
    return type(v) is torch.Size and all(type(x) is int and x >= 0 for x in v) and (ndim is None or len(v) == ndim)


def check_index(md, it_dir: str, manifest: Dict[str, dict], allowed_bytes: Iterable[str] = (),
                source: str = "this project's torch_dist save") -> None:
    """Refuse (one line naming `.metadata` and the entry) anything in DCP's index that this
    project did not write: see the module docstring for the rules. `source` names the writer
    the index was expected from (Megatron-Core's reader passes its own)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    where = os.path.join(it_dir, INDEX)
    allowed_bytes = set(allowed_bytes)

    def bad(what):
        raise DistCheckpointError(f"{where}: {what}; refused (this index was not written by {source})")

    if type(md) is not Metadata or type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        bad("not a DCP Metadata with a state-dict index and storage table")
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str:
            bad(f"entry name {str(key)[:80]!r} is not a string")
        if type(entry) is BytesStorageMetadata:
            if key not in allowed_bytes or vars(entry):
                bad(f"entry {key[:120]!r} is a byte (pickled object) entry where only tensors are expected")
            continue
        if type(entry) is not TensorStorageMetadata:
            bad(f"entry {key[:120]!r} is a {type(entry).__name__}, not a tensor entry")
        props = entry.properties
        if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
            bad(f"entry {key[:120]!r} has no valid dtype")
        if not _is_size(entry.size) or type(entry.chunks) is not list:
            bad(f"entry {key[:120]!r} has an invalid shape or chunk list")
        for c in entry.chunks:
            if type(c) is not ChunkStorageMetadata or not _is_size(c.offsets, len(entry.size)) \
                    or not _is_size(c.sizes, len(entry.size)) \
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.size)):
                bad(f"entry {key[:120]!r} has a chunk outside its shape {tuple(entry.size)}")
    sizes = {}
    for idx, info in md.storage_data.items():
        if type(idx) is not MetadataIndex or type(idx.fqn) is not str:
            bad("a storage key is not a MetadataIndex")
        if idx.fqn not in md.state_dict_metadata:
            bad(f"storage for {idx.fqn[:120]!r}, which the index does not declare")
        if type(info) is not _StorageInfo or type(info.offset) is not int or type(info.length) is not int \
                or info.offset < 0 or info.length < 0:
            bad(f"storage of {idx.fqn[:120]!r} is not a (file, offset >= 0, length >= 0) record")
        if getattr(info, "transform_descriptors", None):
            bad(f"storage of {idx.fqn[:120]!r} asks for stream transforms {list(info.transform_descriptors)[:4]!r}")
        name = _plain_name(info.relative_path, where)
        if name not in manifest or name in (INDEX, MANIFEST):
            bad(f"storage of {idx.fqn[:120]!r} is in {name[:80]!r}, which the manifest does not list as a shard")
        if name not in sizes:
            sizes[name] = _shard_size(it_dir, name, manifest)
        if info.offset + info.length > sizes[name]:
            bad(f"storage of {idx.fqn[:120]!r} ends at byte {info.offset + info.length} of {name} "
                f"({sizes[name]} bytes): the shard is truncated")


def _shard_size(it_dir: str, name: str, manifest: Dict[str, dict]) -> int:
    path = os.path.join(it_dir, name)
    try:  # the names are plain (check_index), so the one rule left is: a regular file, not a link
        safe_paths.regular_file(it_dir, name, "shard")
    except safe_paths.UnsafePathError as e:
        raise DistCheckpointError(f"{path}: a link or a file outside the checkpoint folder; refused" if
                                  os.path.islink(path) else str(e)) from None
    except OSError:
        pass  # missing: reported below
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise DistCheckpointError(f"{path}: missing or unreadable ({e.strerror})") from None
    if size != manifest[name]["bytes"]:
        raise DistCheckpointError(f"{path}: {size} bytes, the manifest says {manifest[name]['bytes']} (truncated or "
                                  f"replaced since it was verified)")
    return size


def tensor_index(md) -> Dict[str, tuple]:
    """{name: (shape, dtype)} of the tensor entries of a checked index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if type(v) is TensorStorageMetadata}


def read_tensors(md, it_dir: str, targets: Dict[str, torch.Tensor]) -> None:
    """Fill every tensor of `targets` (name -> tensor of the indexed shape and dtype) from the
    shards of a checked index, chunk by chunk."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    by_name: Dict[str, list] = {}
    for idx, info in md.storage_data.items():
        by_name.setdefault(idx.fqn, []).append((idx, info))
    plan: Dict[str, list] = {}  # file -> [(offset, length, name, chunk)]
    for name, target in targets.items():
        entry = md.state_dict_metadata.get(name)
        if type(entry) is not TensorStorageMetadata:
            raise DistCheckpointError(f"{os.path.join(it_dir, INDEX)}: holds no tensor {name[:120]!r}")
        covered = 0
        stored = {tuple(idx.offset or ()): info for idx, info in by_name.get(name, [])}
        for c in entry.chunks:
            info = stored.get(tuple(c.offsets))
            if info is None:
                raise DistCheckpointError(f"{os.path.join(it_dir, INDEX)}: no storage for chunk {tuple(c.offsets)} "
                                          f"of {name[:120]!r}")
            plan.setdefault(info.relative_path, []).append((info.offset, info.length, name, c))
            covered += torch.Size(c.sizes).numel()
        if covered != torch.Size(entry.size).numel():
            raise DistCheckpointError(f"{os.path.join(it_dir, INDEX)}: the chunks of {name[:120]!r} cover "
                                      f"{covered} of its {torch.Size(entry.size).numel()} elements")
    for fname, items in sorted(plan.items()):
        path = os.path.join(it_dir, fname)
        with open(path, "rb") as f:
            for offset, length, name, c in sorted(items, key=lambda x: x[0]):
                f.seek(offset)
                data = f.read(length)
                t = _chunk(data, path, offset, name, md.state_dict_metadata[name].properties.dtype, tuple(c.sizes))
                view = targets[name]
                for d, (o, s) in enumerate(zip(c.offsets, c.sizes)):
                    view = view.narrow(d, o, s)
                view.copy_(t)


def _chunk(data: bytes, path: str, offset: int, name: str, dtype, shape) -> torch.Tensor:
    where = f"{path} (bytes {offset}-{offset + len(data)}, tensor {name[:120]!r})"
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DistCheckpointError(f"{where}: refused to load: {str(e).splitlines()[0][:160]} (a checkpoint must not "
                                  f"carry code)") from None
    except Exception as e:  # noqa: BLE001 - any failure to parse a forged or torn record is bad input
        raise DistCheckpointError(f"{where}: unreadable "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                                  f"the shard is truncated or corrupt") from None
    if type(t) is not torch.Tensor or t.dtype != dtype or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise DistCheckpointError(f"{where}: holds {got}, the index declares {dtype} {shape}")
    return t
