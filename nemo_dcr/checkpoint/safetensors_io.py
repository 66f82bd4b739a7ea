"""safetensors checkpoints: a single ``.safetensors`` file or a directory of shards with
``model.safetensors.index.json``. Read lazily, one tensor at a time, bits untouched; written
byte-for-byte from a recorded header, atomically (temp + fsync + rename).

The format (https://github.com/huggingface/safetensors): u64 little-endian header length N,
N bytes of UTF-8 JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``,
then the data buffer. We keep the header text verbatim so a rebuilt file is byte-identical to
the trainer's.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager

import torch

from nemo_dcr.errors import CheckpointError, DcrError  # CheckpointError re-exported: defined with every other error

INDEX_NAME = "model.safetensors.index.json"

ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def read_header(path: str):
    """-> (raw header bytes including the 8-byte length prefix, parsed dict)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8 or n > 1 << 30:
                raise CheckpointError(f"{path}: header length {n} out of range; not a safetensors file")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    try:
        parsed = json.loads(text)
    except ValueError:
        raise CheckpointError(f"{path}: header is not JSON; not a safetensors file") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_len = size - 8 - n
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        try:
            dt = ST_DTYPES[info["dtype"]]
            b, e = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * torch.empty((), dtype=dt).element_size()
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has an unsupported or malformed entry") from None
        if not (0 <= b <= e <= data_len) or e - b != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} data offsets out of range (file truncated?)")
    return head + text, parsed


def tensors_in_order(parsed: dict) -> list:
    """Tensor names in the order their data lies in the file."""
    names = [k for k in parsed if k != "__metadata__"]
    return sorted(names, key=lambda k: (parsed[k]["data_offsets"][0], parsed[k]["data_offsets"][1], k))


class Checkpoint(Mapping):
    """A lazy name -> tensor mapping over a safetensors file or sharded directory."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            index = os.path.join(self.path, INDEX_NAME)
            if os.path.exists(index):
                with open(index, "rb") as f:
                    self.index_text = f.read().decode("utf-8")
                try:
                    wmap = json.loads(self.index_text)["weight_map"]
                except (ValueError, KeyError, TypeError):
                    raise CheckpointError(f"{index}: not a safetensors index (no weight_map)") from None
                files = sorted(set(wmap.values()))
            else:
                self.index_text = None
                files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
                if len(files) != 1:
                    raise CheckpointError(f"{self.path}: a directory checkpoint needs {INDEX_NAME} "
                                          f"or exactly one .safetensors file (found {len(files)})")
            self.kind = "dir"
            self.files = {f: os.path.join(self.path, f) for f in files}
        elif os.path.isfile(self.path):
            self.kind, self.index_text = "file", None
            self.files = {os.path.basename(self.path): self.path}
        else:
            raise CheckpointError(f"{self.path}: no such file or directory")
        self.headers = {}
        self.where = {}
        for fname, fpath in self.files.items():
            raw, parsed = read_header(fpath)
            self.headers[fname] = (raw, parsed)
            for name in parsed:
                if name == "__metadata__":
                    continue
                if name in self.where:
                    raise CheckpointError(f"{self.path}: tensor {name!r} appears in two files")
                self.where[name] = fname
        self.total_bytes = sum(
            parsed[n]["data_offsets"][1] - parsed[n]["data_offsets"][0]
            for _, parsed in self.headers.values() for n in parsed if n != "__metadata__")

    def __getitem__(self, name: str) -> torch.Tensor:
        fname = self.where[name]
        raw, parsed = self.headers[fname]
        info = parsed[name]
        b, e = info["data_offsets"]
        dtype = ST_DTYPES[info["dtype"]]
        buf = bytearray(e - b)
        with open(self.files[fname], "rb") as f:
            f.seek(len(raw) + b)
            if f.readinto(buf) != e - b:
                raise CheckpointError(f"{self.files[fname]}: truncated while reading {name!r}")
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return t.view(dtype).reshape(info["shape"])

    def __iter__(self):
        return iter(self.where)

    def __len__(self):
        return len(self.where)

    def layout(self) -> dict:
        """Everything needed to rebuild the same files byte for byte (stored in a delta's meta)."""
        return {
            "kind": self.kind,
            "files": [{"name": f, "header": raw[8:].decode("utf-8")} for f, (raw, _) in self.headers.items()],
            "index": self.index_text,
        }


def layout_for(tensors: Mapping) -> dict:
    """A single-file layout for tensors that came without one (deltas made by the Python API)."""
    header, off = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-(len(text) + 8) % 8)
    return {"kind": "file", "files": [{"name": "model.safetensors", "header": text}], "index": None}


def write_file(path: str, header_text: str, produce) -> None:
    """Write one safetensors file from a verbatim header; ``produce(name)`` returns each tensor.

    The tensors are written in data-offset order and each one's dtype, shape and size is
    checked against the header."""
    raw = header_text.encode("utf-8")
    parsed = json.loads(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        pos = 0
        for name in tensors_in_order(parsed):
            info = parsed[name]
            t = produce(name)
            b, e = info["data_offsets"]
            if ST_NAMES.get(t.dtype) != info["dtype"] or list(t.shape) != list(info["shape"]):
                raise DcrError(f"{name}: rebuilt tensor is {t.dtype}{list(t.shape)}, header says "
                               f"{info['dtype']}{info['shape']}")
            if b != pos:
                if b < pos:
                    raise DcrError(f"{path}: overlapping tensor data in header at {name!r}")
                f.write(b"\0" * (b - pos))
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
            f.write(data)
            pos = e
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_output(out: str, is_dir: bool):
    """Yield a temporary path next to ``out``; on success move it into place, on any error
    remove it, leaving ``out`` as it was."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(out)
    if is_dir:
        tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    else:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-", dir=parent)
        os.close(fd)
    try:
        yield tmp
        if is_dir:
            _fsync_dir(tmp)
            if os.path.exists(out):
                old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
                os.rmdir(old)
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)
        else:
            if os.path.isdir(out):
                raise DcrError(f"{out} is a directory; the result is a single file")
            os.replace(tmp, out)
        _fsync_dir(parent)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_sharded(state: Mapping, out: str, shards: int = 2) -> None:
    """Write ``state`` as a Hugging Face-style sharded directory with model.safetensors.index.json
    (tensors dealt round-robin by sorted name)."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in part}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
