"""Byte-span index of a LLaVA JSONL file or JSON list: built once, saved as `.npy`, memory-mapped.

The index is an int64 array `[n + 2, 2]`: row 0 = (INDEX_VERSION, kind: 0 JSONL / 1 JSON list),
row 1 = (file size, fingerprint), rows 2.. = (start, end) byte offsets of each record in the file.
The fingerprint hashes the size, the mtime (ns) and the first and last MiB of the file, so an index
is rebuilt when the file changes (a same-size edit in the middle of a file over 2 MiB within one
mtime tick is the one change it can miss).

Where: `<file>.idx.npy` next to the data; when that folder is not writable, under the cache dir
(`index_cache_dir`, default `$XDG_CACHE_HOME/conceptmoe/jsonl_index` or `~/.cache/...`), named
`<basename>.<hash of the absolute path>.idx.npy`; a log line says which. Writes are atomic (a
private tmp file + `os.replace`), so concurrent builders (ranks, nodes, test workers) are safe;
in the training loader (torch.distributed initialised) rank 0 builds first and the other ranks
load its file after a barrier. A JSON list is scanned as a stream over a memory-mapped file (a C regex skips strings,
Python counts brackets): each top-level element is parsed alone to validate it and dropped, so the
list is never held as Python objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import uuid

import numpy as np

from vlm.modeling.chat_common import JSON_ERRORS

log = logging.getLogger(__name__)

INDEX_VERSION = 1
KIND_JSONL, KIND_JSON_LIST = 0, 1
_EDGE = 1 << 20  # bytes hashed at each end of the file
# a whole JSON string, one structural character, or a quote that opens a string never closed
_TOKEN = re.compile(rb'(")(?:[^"\\]++|\\.)*+"|([\[\]{},])|(")', re.S)
_WS = b" \t\n\r"
_NON_WS = re.compile(rb"[^ \t\n\r]")

# construction counters (tests read them: a reused index must not rescan)
STATS = {"built": 0, "loaded": 0}


def file_key(path: str) -> tuple[int, int]:
    """(size, fingerprint) of the data file as stored in row 1 of its index."""
    st = os.stat(path)
    h = hashlib.blake2b(f"{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if st.st_size > _EDGE:
            f.seek(max(_EDGE, st.st_size - _EDGE))
            h.update(f.read())
    return st.st_size, int.from_bytes(h.digest(), "little", signed=True)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "conceptmoe", "jsonl_index")


def index_locations(path: str, cache_dir: str | None = None) -> list[str]:
    """[next to the data, under the cache dir]: where an index is looked for, in this order."""
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir or default_cache_dir(), f"{os.path.basename(path)}.{digest}.idx.npy")
    return [f"{path}.idx.npy", cached]


def load_or_build(path: str, kind: int, cache_dir: str | None = None,
                  collective: bool = False) -> tuple[np.ndarray, str, bool]:
    """-> (spans int64 [n, 2] memory-mapped, index file, built?). `collective=True` (the training
    loader, which every rank builds): with torch.distributed initialised and several ranks, rank 0
    builds first and the others wait at a barrier, so every rank must call it for the same files."""
    if collective:
        return _rank0_first(lambda: _load_or_build(path, kind, cache_dir))
    return _load_or_build(path, kind, cache_dir)


def _rank0_first(fn):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        error = result = None
        if dist.get_rank() == 0:
            try:
                result = fn()
            except Exception as err:  # re-raised after the barrier, so no rank waits forever
                error = err
        dist.barrier()
        if error is not None:
            raise error
        if result is not None:
            return result
    return fn()


def _load_or_build(path: str, kind: int, cache_dir: str | None) -> tuple[np.ndarray, str, bool]:
    key = file_key(path)
    locations = index_locations(path, cache_dir)
    for loc in locations:
        spans = _load(loc, kind, key)
        if spans is not None:
            STATS["loaded"] += 1
            log.info("[data] %s: reusing the record index %s (%d records)", path, loc, len(spans))
            return spans, loc, False
    spans = scan_jsonl(path) if kind == KIND_JSONL else scan_json_list(path)
    table = np.empty((len(spans) + 2, 2), dtype=np.int64)
    table[0], table[1] = (INDEX_VERSION, kind), key
    table[2:] = spans.reshape(-1, 2)
    loc = _save(table, locations, path)
    STATS["built"] += 1
    return np.load(loc, mmap_mode="r")[2:], loc, True


def _load(loc: str, kind: int, key: tuple[int, int]) -> np.ndarray | None:
    if not os.path.isfile(loc):
        return None
    try:
        table = np.load(loc, mmap_mode="r")
    except (OSError, ValueError) as err:
        log.warning("[data] unreadable record index %s (%s): rebuilding it", loc, err)
        return None
    if (table.ndim != 2 or table.shape[1] != 2 or table.shape[0] < 2 or table.dtype != np.int64
            or tuple(table[0]) != (INDEX_VERSION, kind) or tuple(table[1]) != key):
        log.info("[data] stale record index %s (the data file changed): rebuilding it", loc)
        return None
    return table[2:]


def _save(table: np.ndarray, locations: list[str], path: str) -> str:
    errors = []
    for i, loc in enumerate(locations):
        tmp = f"{loc}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(os.path.dirname(loc) or ".", exist_ok=True)
            with open(tmp, "wb") as f:
                np.save(f, table)
            os.replace(tmp, loc)  # atomic: a reader sees the old file or the whole new one
        except OSError as err:
            errors.append(f"{loc}: {err.strerror or err}")
            if os.path.isfile(tmp):
                os.unlink(tmp)
            continue
        if i == 0:
            log.info("[data] %s: built the record index (%d records) -> %s", path, len(table) - 2, loc)
        else:
            log.warning("[data] %s: data folder not writable (%s); record index (%d records) saved under "
                        "the cache dir: %s (set data.index_cache_dir to move it)", path, errors[0],
                        len(table) - 2, loc)
        return loc
    raise OSError(f"{path}: cannot save its record index ({'; '.join(errors)}); "
                  f"set data.index_cache_dir to a writable folder")


def scan_jsonl(path: str) -> np.ndarray:
    """(start, end) of every non-blank line (end includes the newline)."""
    spans, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                spans.append((pos, pos + len(line)))
            pos += len(line)
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def scan_json_list(path: str) -> np.ndarray:
    """(start, end) of every top-level element of a JSON list, whitespace trimmed. Each element is
    parsed once (then dropped) so that a file that is not valid JSON raises here, one line."""
    def invalid(why: str) -> ValueError:
        return ValueError(f"{path}: not a valid JSON list ({why})")

    spans = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        first = _first_non_ws(mm)
        if first >= len(mm) or mm[first] != ord("["):
            raise invalid("top-level JSON must be a list of records")
        depth, elem_start, end = 1, first + 1, None
        for m in _TOKEN.finditer(mm, first + 1):
            if m.lastindex == 1:  # a complete string
                continue
            if m.lastindex == 3:
                raise invalid(f"unterminated string at byte {m.start()}")
            c = mm[m.start()]
            if c in b"[{":
                depth += 1
            elif c in b"]}":
                depth -= 1
                if depth == 0:
                    _element(mm, elem_start, m.start(), spans, invalid, last=True)
                    end = m.end()
                    break
            elif depth == 1:  # a comma between top-level elements
                _element(mm, elem_start, m.start(), spans, invalid, last=False)
                elem_start = m.end()
        if end is None:
            raise invalid("unterminated list (no closing ']')")
        if mm[end:].strip(_WS):
            raise invalid(f"extra data after the list at byte {end}")
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def _first_non_ws(mm) -> int:
    m = _NON_WS.search(mm)
    return m.start() if m else len(mm)


def _element(mm, start: int, end: int, spans: list, invalid, last: bool) -> None:
    raw = mm[start:end]
    body = raw.strip(_WS)
    if not body:
        if last and not spans:  # "[]": an empty list
            return
        raise invalid(f"empty element at byte {start}")
    lead = len(raw) - len(raw.lstrip(_WS))
    try:
        json.loads(body.decode("utf-8", errors="surrogateescape"))
    except JSON_ERRORS as err:
        detail = str(err).splitlines()[0] if str(err) else ""
        raise invalid(f"element at byte {start + lead}: {type(err).__name__}: {detail}") from None
    spans.append((start + lead, start + lead + len(body)))
