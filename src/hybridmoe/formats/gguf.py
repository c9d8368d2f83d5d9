"""Memory-mapped GGUF v2/v3 reader: metadata and tensor records, nothing read from the data section.

Model files are untrusted: every length and offset is checked against the file size before use,
so a malformed file gives one clear `ModelFileError`, never a huge allocation or a hang.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelFileError, printable
from ..quant.types import GGMLType, block_size, row_bytes, type_from_id

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_COUNT = 1 << 24          # tensors / metadata keys / array items: far above any real model
DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are. `shape` is in torch order (outermost first; GGUF's ne reversed)."""
    name: str
    shape: tuple[int, ...]
    qtype: GGMLType
    nbytes: int
    file: str
    offset: int          # absolute byte offset in `file`

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(self.path, f"truncated or corrupt header: {what} runs past the end of the file "
                                 f"(at byte {self.pos}, needs {n}, file has {len(self.buf)})",
                                 "re-download or re-convert the file")

    def scalar(self, vtype: int, what: str):
        fmt, size = _SCALARS[vtype]
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what):
        return self.scalar(4, what)

    def u64(self, what):
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what + " length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0):
        """A metadata value; `key` is already printable (errors.printable)."""
        if vtype in _SCALARS:
            return self.scalar(vtype, f"value of {key}")
        if vtype == 8:
            return self.string(f"value of {key}")
        if vtype == 9:
            etype = self.u32(f"array type of {key}")
            count = self.u64(f"array length of {key}")
            if count > MAX_COUNT:
                raise ModelFileError(self.path, f"metadata array {key} claims {count} items", "the file is corrupt")
            if etype in _SCALARS:
                size = _SCALARS[etype][1]
                self.need(count * size, f"array {key}")
                arr = np.frombuffer(self.buf, dtype=_NP[etype], count=count, offset=self.pos).copy()
                self.pos += count * size
                return arr
            if etype == 8:
                self.need(count * 8, f"array {key}")          # every item has at least its length field
                return [self.string(f"item of {key}") for _ in range(count)]
            if etype == 9:
                if depth >= 2:
                    raise ModelFileError(self.path, f"metadata array {key} nests arrays more than 2 deep",
                                         "the file is corrupt")
                self.need(count * 12, f"array {key}")         # item type and length of every item
                return [self.value(9, key, depth + 1) for _ in range(count)]
            raise ModelFileError(self.path, f"metadata array {key} has unknown item type {etype}", "the file is corrupt")
        raise ModelFileError(self.path, f"metadata key {key} has unknown value type {vtype}",
                             "the file is corrupt or from a newer GGUF version")


class GGUFFile:
    """One GGUF file (one part of a split model)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            # O_NONBLOCK: a FIFO given as a model must not block the open; it is refused just below
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise ModelFileError(self.path, f"cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ModelFileError(self.path, f"is {_file_kind(st.st_mode)}, not a regular file",
                                     "give the path of a .gguf file")
            size = st.st_size
            if size < 24:
                raise ModelFileError(self.path, f"file is {size} bytes, too short for a GGUF header", "truncated download?")
            try:
                # ACCESS_COPY: private copy-on-write mapping, writable for torch.frombuffer, never written back.
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError, OverflowError) as e:
                raise ModelFileError(self.path, f"cannot map the {size}-byte file into memory: "
                                     f"{getattr(e, 'strerror', None) or e}",
                                     "is it larger than the address space (a 32-bit system, ulimit -v)?") from None
        finally:
            os.close(fd)
        self.size = size
        self.metadata: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self):
        c = _Cursor(memoryview(self._mm), self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')",
                                 "hybridmoe reads GGUF v2/v3 model files")
        c.pos = 4
        version = c.u32("version")
        if version not in (2, 3):
            raise ModelFileError(self.path, f"GGUF version {version} is not supported", "supported: 2 and 3")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise ModelFileError(self.path, f"header claims {n_tensors} tensors and {n_kv} metadata keys", "the file is corrupt")
        if n_kv * 12 > self.size or n_tensors * 24 > self.size:    # smallest key / tensor record: 12 / 24 bytes
            raise ModelFileError(self.path, f"header claims {n_tensors} tensors and {n_kv} metadata keys, more than "
                                 f"a {self.size}-byte file can hold", "the file is truncated or corrupt")
        for _ in range(n_kv):
            key = c.string("metadata key")
            shown = printable(key)
            vtype = c.u32(f"type of {shown}")
            if key in self.metadata:
                raise ModelFileError(self.path, f"metadata key {shown} appears twice", "the file is corrupt")
            self.metadata[key] = c.value(vtype, shown)
        raw_infos = []
        for _ in range(n_tensors):
            name = c.string("tensor name")
            shown = printable(name)
            n_dims = c.u32(f"dims of {shown}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(self.path, f"tensor {shown} has {n_dims} dimensions", f"ggml allows 1 to {MAX_DIMS}")
            ne = [c.u64(f"shape of {shown}") for _ in range(n_dims)]
            type_id = c.u32(f"type of {shown}")
            offset = c.u64(f"offset of {shown}")
            raw_infos.append((name, ne, type_id, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, (bool, np.bool_)) or not isinstance(align, (int, np.integer)) \
                or not 0 < align <= 1 << 30 or align & (align - 1):
            raise ModelFileError(self.path, f"metadata general.alignment: found {printable(align)}",
                                 "expected a power of two (an unsigned integer)")
        self.alignment = align = int(align)
        data_start = (c.pos + align - 1) // align * align
        for name, ne, type_id, offset in raw_infos:
            if name in self.tensors:
                raise ModelFileError(self.path, f"tensor {printable(name)} appears twice", "the file is corrupt")
            self.tensors[name] = self._check_tensor(name, ne, type_id, offset, data_start, align)
        self._check_overlaps()

    def _check_tensor(self, name, ne, type_id, offset, data_start, align) -> TensorInfo:
        shown = printable(name)
        if not name or len(name) > 256 or not name.isprintable():
            raise ModelFileError(self.path, f"tensor name {shown} is not a tensor name",
                                 "expected at most 256 printable characters; the file is corrupt")
        qtype = type_from_id(type_id)
        if qtype is None:
            raise ModelFileError(self.path, f"tensor {shown} has unknown ggml type id {type_id}",
                                 "the file is corrupt or from a newer llama.cpp")
        if any(d == 0 or d > (1 << 40) for d in ne):
            raise ModelFileError(self.path, f"tensor {shown} has shape {ne}", "the file is corrupt")
        bs = block_size(qtype)
        if ne[0] % bs:
            raise ModelFileError(self.path, f"tensor {shown}: row length {ne[0]} is not a multiple of "
                                 f"{qtype.name}'s block size {bs}", "the file is corrupt")
        nbytes = row_bytes(qtype, ne[0]) * math.prod(ne[1:])
        start = data_start + offset
        if offset % align:
            raise ModelFileError(self.path, f"tensor {shown} offset {offset} is not aligned to {align}", "the file is corrupt")
        if start + nbytes > self.size:
            raise ModelFileError(self.path, f"tensor {shown} runs past the end of the file "
                                 f"(needs bytes {start}..{start + nbytes}, file has {self.size})",
                                 "the file is truncated: re-download it")
        return TensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype, nbytes, self.path, start)

    def _check_overlaps(self):
        """No two tensors share bytes (sorted by offset, each must end before the next begins)."""
        prev = None
        for info in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            if prev is not None and info.offset < prev.offset + prev.nbytes:
                raise ModelFileError(self.path, f"tensors {printable(prev.name)} and {printable(info.name)} overlap "
                                     f"(bytes {prev.offset}..{prev.offset + prev.nbytes} and {info.offset}..)",
                                     "the file is corrupt")
            prev = info

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor backed by the mapping (no copy)."""
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def split_paths(path: str) -> list[str]:
    """All parts of a split model, given its first part; [path] for a whole file."""
    m = _SPLIT_RE.match(os.path.basename(path))
    if not m:
        return [path]
    count = int(m["count"])
    if not 1 <= count <= 9999 or not 1 <= int(m["no"]) <= count:
        raise ModelFileError(path, f"the name says part {int(m['no'])} of {count}",
                             "split parts are named X-0000N-of-0000M.gguf with 1 <= N <= M")
    d = os.path.dirname(path)
    return [os.path.join(d, f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFModel:
    """A model's metadata and tensor records over one or more GGUF parts."""

    def __init__(self, path: str | os.PathLike):
        path = str(path)
        if not os.path.exists(path):
            raise ModelFileError(path, "no such file", "give the path of a .gguf file (the first part of a split model)")
        parts = split_paths(path)
        m = _SPLIT_RE.match(os.path.basename(path))
        if m and int(m["no"]) != 1:
            raise ModelFileError(path, "this is not the first part of a split model",
                                 f"pass {os.path.basename(parts[0])} instead")
        for p in parts:
            if not os.path.exists(p):
                raise ModelFileError(p, f"part of split model {os.path.basename(path)} is missing",
                                     f"all {len(parts)} parts must sit in one folder")
        self.files = [GGUFFile(p) for p in parts]
        self.path = path
        self.metadata = dict(self.files[0].metadata)
        self.tensors: dict[str, TensorInfo] = {}
        self._by_file = {f.path: f for f in self.files}
        for i, f in enumerate(self.files):
            _check_part(f, i, self.files[0], len(parts))
            for name, info in f.tensors.items():
                if name in self.tensors:
                    raise ModelFileError(f.path, f"tensor {printable(name)} appears twice", "the file is corrupt")
                self.tensors[name] = info
        declared = self.metadata.get("split.tensors.count")
        if len(parts) > 1 and declared is not None and _int_or_none(declared) != len(self.tensors):
            raise ModelFileError(path, f"metadata split.tensors.count: found {printable(declared)}, expected "
                                 f"{len(self.tensors)} (the tensors of all {len(parts)} parts)", "a part is wrong")

    def raw(self, info: TensorInfo) -> torch.Tensor:
        return self._by_file[info.file].raw(info)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _int_or_none(v) -> int | None:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _check_part(f: GGUFFile, i: int, first: GGUFFile, count: int):
    """Part i (0-based) of a split model of `count` parts agrees with part 1: split.no, split.count,
    architecture and alignment (a part without the key agrees; gguf-split writes only split.* in parts 2..)."""
    md = f.metadata
    for key, want in (("split.count", count), ("split.no", i)):
        if key in md and _int_or_none(md[key]) != want:
            raise ModelFileError(f.path, f"metadata {key}: found {printable(md[key])}, expected {want} "
                                 f"(part {i + 1} of {count})", "the parts are from different models or renamed")
    if i == 0:
        return
    key = "general.architecture"
    if key in md and (key not in first.metadata or printable(md[key]) != printable(first.metadata[key])):
        raise ModelFileError(f.path, f"metadata {key}: found {printable(md[key])}, part 1 has "
                             f"{printable(first.metadata.get(key))}", "the parts are from different models")
    if f.alignment != first.alignment:
        raise ModelFileError(f.path, f"metadata general.alignment: found {f.alignment}, part 1 has {first.alignment}",
                             "the parts are from different models")


def open_gguf(path) -> GGUFModel:
    return GGUFModel(path)


def tensor_info_from_shape(name: str, shape: tuple[int, ...], qtype: GGMLType, file: str = "", offset: int = 0) -> TensorInfo:
    """A tensor record with no file behind it (for planning with generated shapes)."""
    nbytes = row_bytes(qtype, shape[-1]) * math.prod(shape[:-1])
    return TensorInfo(name, tuple(shape), qtype, nbytes, file, offset)
