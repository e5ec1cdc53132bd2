"""The one config mechanism: typed sections (pydantic, strict), YAML with ``base:`` inheritance,
dotted ``key=value`` overrides, and one-line ``ConfigError``s that name the dotted field."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A bad config key or value; one line naming the key (control characters are shown escaped)."""

    def __init__(self, message: str = ""):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


def fail(key: str, msg: str) -> ConfigError:
    return ConfigError(f"config error: {key}: {msg}")


def check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise fail(key, msg)


class Section(BaseModel):
    """A typed config section: unknown keys and wrong types are errors (no coercion)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=False, populate_by_name=True)


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty string")
    return value


# Field types shared by every section.
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Text = Annotated[str, AfterValidator(_non_blank)]  # a name or path: not empty or blank


def Num(*, gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None) -> Any:
    """A finite float (ints accepted) with bounds."""
    return Annotated[float, Field(gt=gt, ge=ge, lt=lt, le=le, allow_inf_nan=False)]


# --- validation ---------------------------------------------------------------------------------
def dotted(loc: tuple) -> str:
    """``("data", "datasets", 0, "type")`` -> ``data.datasets[0].type``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _known_here(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The keys a section accepts at ``loc`` (for the unknown-key hint)."""
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        sub = getattr(field, "annotation", None) if field else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return []
        cls = sub
    return sorted(f.alias or name for name, f in cls.model_fields.items())


def error_from(err: ValidationError, cls: type[BaseModel], prefix: str = "") -> ConfigError:
    """The first pydantic error as one line: ``config error: <prefix><dotted field>: <what>``."""
    e = err.errors(include_url=False)[0]
    loc = tuple(e["loc"])
    key = prefix + dotted(loc) if loc else prefix.rstrip(".") or "config"
    if e["type"] == "extra_forbidden":
        known = _known_here(cls, loc)
        return fail(key, "unknown config key" + (f" (known here: {', '.join(known)})" if known else ""))
    if e["type"] == "missing":
        return fail(key, "is required")
    msg = e["msg"].removeprefix("Value error, ")
    got = repr(e["input"])
    return fail(key, f"{msg[:1].lower()}{msg[1:]}, got {got if len(got) <= 80 else got[:77] + '...'}")


def build(cls, raw: Any, prefix: str = ""):
    """Validate ``raw`` (a mapping; None = empty) into the section ``cls``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise fail(prefix.rstrip(".") or "config", f"must be a mapping, got {raw!r}")
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise error_from(err, cls, prefix) from None


# --- YAML and overrides ---------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: ``1e-3`` (no dot) is a number, as a user means it, not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def load_yaml(path: str | Path) -> dict:
    """A YAML mapping (empty file = {}); a missing, broken or non-mapping file is one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: file not found: {path}")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"config error: {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at top level")
    return raw


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """``load_yaml`` + ``base: other.yaml`` (relative to the file), deep-merged, recursively."""
    path = Path(path)
    raw = load_yaml(path)
    base = raw.pop("base", None)
    if base:
        base_path = Path(base) if Path(base).is_absolute() else path.parent / base
        check(base_path.resolve() not in _seen, "base", f"circular base: {base_path}")
        raw = deep_merge(read_yaml(base_path, _seen + (path.resolve(),)), raw)
    return raw


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` -> ``("train.lr", 0.001)``; the value is read as YAML."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"config error: override {text!r} must look like dotted.key=value")
    key, val = text.split("=", 1)
    try:
        return key.strip(), parse_value(val)
    except yaml.YAMLError:
        raise fail(key.strip(), f"cannot parse value {val!r}") from None


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """``raw["a"]["b"] = value`` for ``key = "a.b"`` (sections created as needed)."""
    parts = key.split(".")
    cur = raw
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        check(isinstance(nxt, dict), ".".join(parts[: i + 1]), f"is a value, not a section (cannot set {key})")
        cur = nxt
    cur[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str] | dict | None) -> dict:
    """A copy of ``raw`` with ``["a.b=1", ...]`` or ``{"a.b": 1}`` applied."""
    out = copy.deepcopy(raw)
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, val in items:
        set_dotted(out, key, val)
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (empty mappings kept as values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(d: dict) -> dict:
    out: dict = {}
    for k, v in d.items():
        set_dotted(out, k, v)
    return out
