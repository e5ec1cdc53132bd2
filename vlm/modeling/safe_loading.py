"""Safe loading: our checkpoints are safetensors and our metadata JSON; a pickle is never unpickled
unless asked for (``trust_pickle=True``); a state dict is loaded with every key accounted for
(``load_state_dict_checked``)."""
from __future__ import annotations

import json
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class UnsafeCheckpoint(ValueError):
    """A checkpoint folder holds weights only as pickles."""


class NotJSONError(ValueError):
    """A metadata file that should be JSON is not (binary data, e.g. a planted pickle)."""


def require_safetensors(folder, trust_pickle: bool = False) -> None:
    """Refuse a local checkpoint folder that holds only pickles
    (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``, ``*.pickle``) - and a path that IS such a
    file - unless ``trust_pickle=True``. Every ``from_pretrained`` of our model classes goes through it
    and passes ``use_safetensors=True`` to transformers (with ``trust_pickle=True`` both are lifted;
    transformers / torch may still refuse the file for their own reasons, e.g. ``weights_only``).
    Pickles next to a ``*.safetensors`` file are never read.

    Metadata we write ourselves is JSON: ``read_json(path)`` reads it and turns a file that is not
    UTF-8 JSON (say a pickle planted under ``trainer_state.json``) into one clear line; nothing is ever
    unpickled. Tokenizer / processor files are JSON read by ``tokenizers`` / ``json`` (no pickle, and
    ``trust_remote_code=False``).

    DeepSpeed's own engine checkpoints (``*_model_states.pt``, ``*_optim_states.pt``, read on resume)
    are files our trainer wrote itself: resuming trusts the run directory (see docs/reliability.md,
    Safe loading); they are out of scope here.
    """
    path = Path(folder)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES and not trust_pickle:
        raise UnsafeCheckpoint(f"{path} is a pickle file; loading it can run code. Convert it to safetensors, "
                               "or pass trust_pickle=True if you trust the file.")
    if not path.is_dir():
        return  # not a local folder: transformers reports the missing path itself
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists():
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not trust_pickle:
        raise UnsafeCheckpoint(f"{path} holds only pickle weights ({', '.join(pickles[:3])}); loading them can run "
                               "code. Convert to safetensors, or pass trust_pickle=True if you trust the file.")


def read_json(path):
    """``json.loads`` of a UTF-8 file; anything else raises NotJSONError with one line naming it."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        hint = " (it looks like a pickle; it was not unpickled)" if data[:1] == b"\x80" else ""
        raise NotJSONError(f"{path}: not a JSON file: binary data{hint}") from None
    except (ValueError, RecursionError) as err:
        raise NotJSONError(f"{path}: not a JSON file: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def load_state_dict_checked(model, state: dict) -> tuple[list[str], list[str]]:
    """``model.load_state_dict(state, strict=False)``; returns (missing, unexpected). A missing key
    whose tensor IS a loaded one (a tied ``lm_head`` shares the embedding's parameter) is not
    missing: it was loaded through its twin. Callers turn non-empty lists into their own one-line
    error."""
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict(keep_vars=True)
    loaded = {id(own[k]) for k in own if k in state}
    missing = [k for k in result.missing_keys if id(own[k]) not in loaded]
    return missing, list(result.unexpected_keys)
