"""Model directories that ship with some files xz-compressed, unpacked once into a cache.

The models that ship with specjax travel inside the package (and the
repository), where every megabyte counts; their bf16 weights and their
tokenizer compress by almost a third and by seven eighths. Such a directory holds
``NAME.xz`` and ``specjax_packed.json``, which records each packed file's size
and SHA-256, and its layout: ``NAME.xz`` is an xz stream of the exact file
(``xz -dk NAME.xz`` gives it back), or, for a safetensors file whose record says
``"layout": "columns"``, of the file with each 2-D tensor's elements stored
column by column (the header unchanged). :func:`unpacked` writes the directory
with every such file decompressed, restored and checked into
``$SPECJAX_CACHE_DIR/models`` (default ``~/.cache/specjax``) the first time it
is loaded; later loads read the unpacked copy. The loaded model is the one the
uncompressed files gave, bit for bit.

:func:`pack` makes such a directory from a plain one (``python -m
specjax._src.models.packed DIR FILE...``). It compresses each file with a few
LZMA2 settings, a safetensors file in both layouts, and keeps the smallest
stream; every one is plain xz, so the reader needs no record of which LZMA2
setting was used."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np

PACKED = "specjax_packed.json"
PACKED_FORMAT = "specjax-packed"
_CHUNK = 1 << 20

# The LZMA2 settings pack() tries on each file (it keeps the smallest stream).
# They differ in what the literal coder conditions a byte on: lc high bits of
# the previous byte and the byte's position modulo 2**lp (pb: the same for
# matches). Weights barely repeat, so nearly all of their bytes are literals.
_PRESET = 9 | lzma.PRESET_EXTREME
_FILTER_CANDIDATES = (
    {"preset": _PRESET},  # xz -9e
    {"preset": _PRESET, "lc": 4, "lp": 0, "pb": 0},  # text (JSON): what the previous character was
    # Two-byte numbers (bf16 weights): the low byte (mantissa) and the high byte
    # (sign, exponent) of each element get their own statistics, each
    # conditioned on the other's top bits. 4-6% smaller than xz -9e on the
    # shipped bf16 safetensors (whose headers, hence the tensor data, start
    # at even offsets: the parity of a byte's position is its place in an element).
    {"preset": _PRESET, "lc": 3, "lp": 1, "pb": 1},
)


# A 2-D weight's column is one input unit across all rows (e.g. one embedding
# dimension over the whole vocabulary); its values share a scale, so stored
# column by column they keep LZMA2's adaptive literal statistics on one scale
# at a time: the SmolLM2 draft's weights pack 1.2% smaller so (24.45 -> 24.15 MB),
# the feature head's 0.6% larger (pack() keeps whichever is smaller).
ROWS, COLUMNS = "rows", "columns"
_LAYOUTS = (ROWS, COLUMNS)


def cache_dir() -> Path:
    """``$SPECJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``."""
    if os.environ.get("SPECJAX_CACHE_DIR"):
        return Path(os.environ["SPECJAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax"


def is_packed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PACKED))


def _read_manifest(path: str) -> dict:
    try:
        with open(os.path.join(path, PACKED)) as f:
            meta = json.load(f)
        if meta.get("format") != PACKED_FORMAT or not isinstance(meta.get("files"), dict):
            raise ValueError(f"format is {meta.get('format')!r}, expected {PACKED_FORMAT!r}")
        for name, want in meta["files"].items():
            if want.get("layout", ROWS) not in _LAYOUTS:
                raise ValueError(f"{name} has layout {want['layout']!r}, which this specjax does not know "
                                 f"(it reads {', '.join(_LAYOUTS)}); upgrade specjax")
        return meta
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable {PACKED} ({e}); reinstall specjax or restore the directory.") from e


def _by_columns(data: bytes, to_columns: bool) -> bytes:
    """The safetensors file ``data`` with every 2-D tensor ``[R, C]`` stored column by column
    (as its ``[C, R]`` transpose, row-major), or, with ``to_columns=False``, back; the
    header and every other tensor stay as they are.

    Raises:
      ValueError: ``data`` is not a safetensors file whose tensors lie inside it.
    """
    size = len(data)
    if size < 8 or 8 + int.from_bytes(data[:8], "little") > size:
        raise ValueError("not a safetensors file: its header length runs past its end")
    start = 8 + int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:start])
        tensors = [(name, *info["shape"], *(start + o for o in info["data_offsets"]))
                   for name, info in header.items() if name != "__metadata__" and len(info["shape"]) == 2]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"not a safetensors file: unreadable header ({e!r})") from e
    out = bytearray(data)
    for name, rows, cols, begin, end in tensors:
        if rows * cols == 0:
            continue
        if not start <= begin <= end <= size or (end - begin) % (rows * cols):
            raise ValueError(f"tensor {name} ({rows} x {cols}) does not fit its bytes {begin}..{end} of {size}")
        elements = np.frombuffer(data, np.uint8, end - begin, begin).reshape(-1, (end - begin) // (rows * cols))
        stored = (rows, cols) if to_columns else (cols, rows)
        out[begin:end] = elements.reshape(*stored, -1).transpose(1, 0, 2).tobytes()
    return bytes(out)


def _decompress(src: str, dest: str, want: dict) -> None:
    """``src`` (xz) into ``dest``, restored to rows when its layout is columns, checking
    the size and SHA-256 recorded for it."""
    digest, size = hashlib.sha256(), 0
    try:
        if want.get("layout", ROWS) == COLUMNS:  # the whole file, to transpose its tensors back
            with lzma.open(src, "rb") as fin:
                data = fin.read()
            try:
                data = _by_columns(data, to_columns=False)
            except ValueError:
                pass  # not the file recorded: the size and SHA-256 check below says so
            digest.update(data)
            size = len(data)
            with open(dest, "wb") as fout:
                fout.write(data)
        else:
            with lzma.open(src, "rb") as fin, open(dest, "wb") as fout:
                for chunk in iter(lambda: fin.read(_CHUNK), b""):
                    digest.update(chunk)
                    size += len(chunk)
                    fout.write(chunk)
    except (OSError, lzma.LZMAError, EOFError) as e:
        raise ValueError(f"{src} is damaged and cannot be decompressed ({e}); reinstall specjax.") from e
    if size != want["size"] or digest.hexdigest() != want["sha256"]:
        raise ValueError(
            f"{src} decompresses to {size} bytes with SHA-256 {digest.hexdigest()[:16]}..., not the "
            f"{want['size']} bytes {want['sha256'][:16]}... recorded in {PACKED}: it is damaged; reinstall specjax."
        )


def unpacked(path: str) -> str:
    """``path`` itself, or for a packed directory its unpacked copy in the cache (made on first use).

    Raises:
      ValueError: a packed file is missing or damaged (names it).
    """
    if not is_packed(path):
        return path
    meta = _read_manifest(path)
    with open(os.path.join(path, PACKED), "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    dest = cache_dir() / "models" / f"{Path(path).resolve().name}-{key}"
    if (dest / PACKED).exists():  # written last: the copy is complete
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Unpack beside the destination and rename: concurrent loads (pytest
    # workers) never read a half-written directory. os.mkdir, not mkdtemp:
    # mkdtemp makes the directory 0700 whatever the umask, and a cache shared
    # between users must stay readable by the next one.
    tmp = dest.parent / f"{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        for name, want in meta["files"].items():
            src = os.path.join(path, name + ".xz")
            if not os.path.isfile(src):
                raise ValueError(f"{path} is missing {name}.xz, which {PACKED} lists; reinstall specjax.")
            _decompress(src, os.path.join(tmp, name), want)
        for entry in sorted(os.listdir(path)):
            if entry != PACKED and not (entry.endswith(".xz") and entry[:-3] in meta["files"]):
                shutil.copy2(os.path.join(path, entry), os.path.join(tmp, entry))
        shutil.copy2(os.path.join(path, PACKED), os.path.join(tmp, PACKED))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / PACKED).exists():  # not a finished copy by a concurrent load
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _compress(src: str, dest: str, filters: dict, layout: str) -> None:
    with lzma.open(dest, "wb", format=lzma.FORMAT_XZ, filters=[{"id": lzma.FILTER_LZMA2, **filters}]) as fout:
        with open(src, "rb") as fin:
            if layout == COLUMNS:
                fout.write(_by_columns(fin.read(), to_columns=True))
            else:
                for chunk in iter(lambda: fin.read(_CHUNK), b""):
                    fout.write(chunk)


def pack(path: str, names: list[str]) -> None:
    """Replaces each file ``names`` of directory ``path`` by ``NAME.xz`` and records it in ``specjax_packed.json``.

    Each file is compressed once per setting in ``_FILTER_CANDIDATES``, a
    ``.safetensors`` file once more per setting in the columns layout, and the
    smallest stream is kept: three ``xz -9e`` passes, six for weights (the 35 MB
    SmolLM2 draft weights take about 45 s a pass on a quiet 2-core machine).
    """
    meta = _read_manifest(path) if is_packed(path) else {"format": PACKED_FORMAT, "files": {}}
    for name in names:
        src, dest = os.path.join(path, name), os.path.join(path, name + ".xz")
        digest = hashlib.sha256()
        with open(src, "rb") as fin:
            for chunk in iter(lambda: fin.read(_CHUNK), b""):
                digest.update(chunk)
        layouts = (ROWS, COLUMNS) if name.endswith(".safetensors") else (ROWS,)
        trial = f"{dest}.{os.getpid()}.trial"
        try:
            best, best_layout = None, ROWS
            for layout in layouts:
                for filters in _FILTER_CANDIDATES:
                    _compress(src, trial, filters, layout)
                    size = os.path.getsize(trial)
                    if best is None or size < best:
                        best, best_layout = size, layout
                        os.replace(trial, dest)
        finally:
            if os.path.exists(trial):
                os.unlink(trial)
        meta["files"][name] = {"size": os.path.getsize(src), "sha256": digest.hexdigest()}
        if best_layout == COLUMNS:
            meta["files"][name]["layout"] = COLUMNS
        os.unlink(src)
    with open(os.path.join(path, PACKED), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m specjax._src.models.packed DIR FILE [FILE ...]")
    pack(sys.argv[1], sys.argv[2:])
