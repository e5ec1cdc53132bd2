"""Where vision weights come from: the local Hugging Face cache (never the network), local paths,
the one-line load log (source, tensor count, sha1) and one-line load errors (``ConfigError``)."""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import constants as hub_constants
from torch import nn

from .config_base import ConfigError, fail

HUB_PREFIXES = ("hf-hub:", "hf_hub:")
HUB_REPO_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz")
LOG = logging.getLogger("vision_encoders")


class _StderrUnlessConfigured(logging.StreamHandler):
    """Prints the load line when nobody configured logging (so it is never lost); else defers to root."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


if not LOG.handlers:
    LOG.addHandler(_StderrUnlessConfigured())
    LOG.setLevel(logging.INFO)


def hub_id(name: str) -> str | None:
    """``hf-hub:org/name`` (or ``hf_hub:``) -> ``org/name``; None for anything else."""
    for prefix in HUB_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def hub_cache_dir() -> str:
    return hub_constants.HF_HUB_CACHE


@contextmanager
def offline_hub():
    """Hub look-ups inside resolve from the local cache only, as under ``HF_HUB_OFFLINE=1``."""
    before = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = before


def cached_file(repo_id: str, filenames) -> str | None:
    """The first of ``filenames`` of ``repo_id`` (main revision) present in the local cache, or None."""
    for filename in filenames:
        path = huggingface_hub.try_to_load_from_cache(repo_id, filename)
        if isinstance(path, str):
            return path
    return None


def require_cached(key: str, what: str, repo_id: str, filenames) -> str:
    """``cached_file`` or a one-line error naming the repo, the files and the cache folder."""
    path = cached_file(repo_id, filenames)
    if path is None:
        raise fail(key, f"{what}: {' / '.join(filenames)} of hub repo {repo_id!r} is not in the local Hugging Face "
                        f"cache {hub_cache_dir()} (set HF_HOME / HF_HUB_CACHE to a populated cache)")
    return path


def looks_like_path(value: str) -> bool:
    """A local path rather than a tag / hub id: has a separator or ~ / . start, a weights suffix, or exists."""
    return (os.sep in value or value.startswith(("~", ".")) or value.endswith(WEIGHT_SUFFIXES)
            or Path(value).expanduser().exists())


def check_pickle(key: str, path: str, trust_pickle: bool) -> None:
    if not str(path).endswith(".safetensors") and not trust_pickle:
        raise fail(key, f"refusing to unpickle {path}; convert it to .safetensors or set vision.trust_pickle=true")


def unknown_name(key: str, name: str, library: str, known) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f" (close: {', '.join(close)})" if close else ""
    return fail(key, f"{name!r} is not a known {library} model{hint}")


@contextmanager
def library_errors(key: str, what: str):
    """A library's exception while loading -> one line naming the field and what was loaded."""
    try:
        with offline_hub():
            yield
    except ConfigError:
        raise
    except (RuntimeError, OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise fail(key, f"{what}: {type(err).__name__}: {first.strip()[:300]}") from err


def weights_digest(module: nn.Module) -> tuple[int, str]:
    """(number of tensors in the state dict, "sha1 " + first 8 hex of a sha1 over their bytes in order).

    Tensors on the meta device (a model built by ``from_pretrained`` before its checkpoint is read)
    have no bytes: the digest then says so.
    """
    tensors = list(module.state_dict().values())
    if any(tensor.is_meta for tensor in tensors):
        return len(tensors), "no data yet"
    sha = hashlib.sha1()
    for tensor in tensors:
        sha.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return len(tensors), "sha1 " + sha.hexdigest()[:8]


@contextmanager
def load_line_muted():
    """No load line inside: for a tower whose weights the caller replaces at once and then logs
    with ``log_load`` (an export's fresh copy of a trained model)."""
    before = LOG.disabled
    LOG.disabled = True
    try:
        yield
    finally:
        LOG.disabled = before


def log_load(module: nn.Module, what: str, source: str, level: int = logging.INFO) -> str:
    """The one line every vision load logs: what, from where, tensor count and checksum (at ``level``)."""
    count, digest = weights_digest(module)
    line = f"vision: {what} <- {source}: {count} tensors, {digest}"
    LOG.log(level, line)
    return line
