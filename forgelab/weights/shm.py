"""Same-host weight transport: one safetensors file in shared memory, mapped by every generator.

    writer = SharedWeightsWriter("/dev/shm")            # trainer rank 0, once
    handle = writer.write(version, hf_state_dict)        # a few KB: path, file id, names, shapes, dtypes
    # ... send `handle` to each generator on this host (a Monarch message) ...
    reader = SharedWeightsReader()                        # generator, once
    weights = reader.open(handle)                         # {HF name: tensor view of the mapped file}
    writer.close()                                        # or process exit: the directory is removed

What it really is: the trainer keeps one file, ``<root>/forgelab-weights-<pid>-<token>/weights.safetensors``
(a valid safetensors file: ``safe_open`` reads it), mapped ``MAP_SHARED``. A write
copies every tensor into the mapping (one memcpy of the state dict; no
serialisation). Each generator maps the same file read-only and hands
``torch.frombuffer`` views of it to vLLM's reload, which copies them into the
engine's parameters: the bytes cross from trainer to generator through the page
cache once, with no pickling and no socket.

**Reuse, and when a new file is made.** After the first write the mapping is
reused: pages are already allocated and mapped on both sides, so later writes
and reads take no page faults (creating a fresh 385 MiB tmpfs file and faulting
it in costs more than the copy itself). Overwriting is only safe when no reader
can still be reading, so the caller says so: ``write(..., reuse=True)`` after
every generator sent the previous handle answered; otherwise (a send failed and
a generator may still be reading) the writer makes a new file under a temporary
name and renames it over the old one (atomic): a straggler keeps its mapping of
the old inode, whose memory the kernel frees when the last mapping goes, and its
handle's file id no longer matches the file at that path.

**Visibility.** A handle names the writer's host and carries a random file id
stored in the file's metadata. ``SharedWeightsReader.open`` raises
`SharedWeightsUnavailable` when the host differs, the path does not exist here
(another container's ``/dev/shm``) or holds another file: the caller then sends
the tensors as a message instead.

**No leaks.** The directory is removed by `close()`, when the writer is garbage
collected, and at interpreter exit (``weakref.finalize``; Monarch's ``stop()``
lets the process exit normally). A process killed with SIGKILL cannot clean up:
the next writer on the host removes directories whose owning process is gone.

Pure functions and plain classes: no actors, no Monarch.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import shutil
import socket
import warnings
import weakref
from dataclasses import dataclass

import torch

__all__ = [
    "SharedWeights",
    "SharedWeightsUnavailable",
    "SharedWeightsWriter",
    "SharedWeightsReader",
    "default_shm_root",
    "sweep_stale",
]

#: safetensors dtype names (https://github.com/huggingface/safetensors, format spec).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = "F8_E4M3" if _name.endswith("e4m3fn") else "F8_E5M2"
        _TORCH_DTYPES[_DTYPES[getattr(torch, _name)]] = getattr(torch, _name)

_DIR_PREFIX = "forgelab-weights-"
_DIR_RE = re.compile(rf"^{_DIR_PREFIX}(\d+)-[0-9a-f]+$")
_FILE = "weights.safetensors"


class SharedWeightsUnavailable(RuntimeError):
    """The handle's file cannot be mapped from this process (other host, other /dev/shm, replaced file)."""


@dataclass(frozen=True, kw_only=True)
class SharedWeights:
    """What a generator receives instead of the tensors: where the weights are and what they are."""

    version: int
    """Policy version the file holds."""
    path: str
    """The safetensors file on the writer's host."""
    host: str
    """``socket.gethostname()`` of the writer."""
    file_id: str
    """Random token in the file's metadata: proves the reader mapped the writer's file."""
    names: tuple[str, ...]
    """HF parameter names, in file order."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of each name."""
    dtypes: tuple[str, ...]
    """safetensors dtype of each name ("F32", "BF16", ...)."""
    nbytes: int
    """Tensor bytes in the file (header excluded)."""


def default_shm_root() -> str | None:
    """``/dev/shm`` when it is a writable folder, else None (no same-host fast path)."""
    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(root: str) -> list[str]:
    """Remove writer directories under ``root`` whose owning process is gone; returns their paths."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _DIR_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _layout(state_dict: dict[str, torch.Tensor], file_id: str) -> tuple[bytes, list[tuple[str, str, tuple, int, int]]]:
    """safetensors header bytes (length prefix included) and ``(name, dtype, shape, start, end)`` per tensor.

    Tensors are ordered by element size (largest first), then name, as safetensors
    itself writes them, so every tensor's offset is a multiple of its element size.
    """
    order = sorted(state_dict, key=lambda k: (-state_dict[k].element_size(), k))
    entries, header, offset = [], {"__metadata__": {"format": "pt", "forgelab_file_id": file_id}}, 0
    for name in order:
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shared weights: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPES:
            raise TypeError(f"shared weights: {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        entries.append((name, _DTYPES[t.dtype], tuple(t.shape), offset, offset + n))
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw, entries


def _views(buf: mmap.mmap, data_start: int, entries) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` (no copy), one per ``(name, dtype, shape, start, end)``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    out = {}
    for name, dtype, shape, start, end in entries:
        out[name] = flat[data_start + start : data_start + end].view(_TORCH_DTYPES[dtype]).view(shape)
    return out


def _remove_dir(path: str, mapping: list) -> None:
    for m in mapping:
        try:
            m.close()
        except (BufferError, ValueError):
            pass  # views still exported: the kernel unmaps when they are freed
    shutil.rmtree(path, ignore_errors=True)


class SharedWeightsWriter:
    """Owns one per-writer directory under ``root`` (a tmpfs such as ``/dev/shm``) and the weights file in it."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"shared-memory folder {root!r} does not exist")
        sweep_stale(root)
        self.root = root
        self.dir = os.path.join(root, f"{_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        os.mkdir(self.dir, 0o700)
        self.path = os.path.join(self.dir, _FILE)
        self.host = socket.gethostname()
        self._file_id = ""
        self._header = b""
        self._entries: list = []
        self._views: dict[str, torch.Tensor] = {}
        self._maps: list[mmap.mmap] = []  # shared with the finalizer, which unmaps them
        self._finalizer = weakref.finalize(self, _remove_dir, self.dir, self._maps)

    def write(self, version: int, state_dict: dict[str, torch.Tensor], *, reuse: bool = True) -> SharedWeights:
        """Put ``state_dict`` in the file; returns the handle generators need.

        ``reuse=True`` overwrites the current file in place when its layout
        (names, shapes, dtypes) is unchanged: only valid when no reader can still
        be reading it. ``reuse=False`` (or a new layout) writes a new file and
        renames it over the old one.
        """
        if not self._finalizer.alive:
            raise RuntimeError("SharedWeightsWriter.write after close()")
        if reuse and self._views:
            header, entries = _layout(state_dict, self._file_id)
            if header == self._header:
                self._copy_in(state_dict)
                return self._handle(version)
        self._new_file(state_dict)
        return self._handle(version)

    def _copy_in(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, view in self._views.items():
                view.copy_(state_dict[name])

    def _new_file(self, state_dict: dict[str, torch.Tensor]) -> None:
        file_id = secrets.token_hex(8)
        header, entries = _layout(state_dict, file_id)
        size = len(header) + (entries[-1][4] if entries else 0)
        tmp = os.path.join(self.dir, f".{file_id}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        buf = views = None
        try:
            # Reserve the pages now: a full tmpfs then fails here with ENOSPC, not with SIGBUS mid-copy.
            os.posix_fallocate(fd, 0, size)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            buf[: len(header)] = header
            views = _views(buf, len(header), entries)
            with torch.no_grad():
                for name, view in views.items():
                    view.copy_(state_dict[name])
            os.rename(tmp, self.path)  # atomic: a reader opens the old file or the whole new one
        except BaseException:
            views = None
            if buf is not None:
                buf.close()
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self._views = {}
        for old in self._maps:
            try:
                old.close()
            except BufferError:
                pass  # a caller still holds a view: unmapped when it is freed
        self._maps[:] = [buf]
        self._views, self._file_id, self._header, self._entries = views, file_id, header, entries

    def _handle(self, version: int) -> SharedWeights:
        return SharedWeights(
            version=int(version), path=self.path, host=self.host, file_id=self._file_id,
            names=tuple(e[0] for e in self._entries), shapes=tuple(e[2] for e in self._entries),
            dtypes=tuple(e[1] for e in self._entries), nbytes=self._entries[-1][4] if self._entries else 0,
        )

    def close(self) -> None:
        """Unmap and remove the directory (safe to call twice)."""
        self._views = {}
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class SharedWeightsReader:
    """Maps writers' files read-only and keeps the mapping while the file stays the same (no page faults)."""

    def __init__(self) -> None:
        self._key: tuple | None = None  # (path, st_dev, st_ino, size, file_id) of the current mapping
        self._map: mmap.mmap | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._file_id = ""

    def open(self, handle: SharedWeights, *, hostname: str | None = None) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` viewing the file of ``handle`` (valid until the next `open` or `close`).

        Raises `SharedWeightsUnavailable` when the file cannot be reached from
        here (``hostname``, default this host's, differs from the writer's; no such
        file; another file at that path), and ``ValueError`` when the file does not
        hold the names, shapes and dtypes the handle announces.
        """
        here = hostname if hostname is not None else socket.gethostname()
        if handle.host != here:
            raise SharedWeightsUnavailable(f"weights file is on host {handle.host!r}, this process runs on {here!r}")
        try:
            fd = os.open(handle.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SharedWeightsUnavailable(f"no file {handle.path} here (another /dev/shm?)") from None
        try:
            st = os.fstat(fd)
            key = (handle.path, st.st_dev, st.st_ino, st.st_size)
            if self._key != key:
                self.close()
                if st.st_size < 8:
                    raise SharedWeightsUnavailable(f"{handle.path} is not a weights file ({st.st_size} bytes)")
                buf = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
                n = int.from_bytes(buf[:8], "little")
                header = json.loads(buf[8 : 8 + n])
                meta = header.pop("__metadata__", {}) or {}
                entries = [(k, v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()]
                self._views = _views(buf, 8 + n, entries)
                self._map, self._key, self._file_id = buf, key, str(meta.get("forgelab_file_id", ""))
        finally:
            os.close(fd)
        if self._file_id != handle.file_id:
            raise SharedWeightsUnavailable(
                f"{handle.path} holds file {self._file_id!r}, not the writer's {handle.file_id!r} (replaced meanwhile)"
            )
        announced = {n: (s, d) for n, s, d in zip(handle.names, handle.shapes, handle.dtypes)}
        present = {k: (tuple(v.shape), _DTYPES[v.dtype]) for k, v in self._views.items()}
        if announced != present:
            diff = sorted(set(announced.items()) ^ set(present.items()))[:3]
            raise ValueError(f"{handle.path} does not hold what its handle announces (first differences: {diff})")
        return self._views

    def close(self) -> None:
        """Drop the mapping (tensors still held elsewhere keep it alive until freed)."""
        self._views = {}
        self._key = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
