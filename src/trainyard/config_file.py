"""A job's YAML file and `a.b=c` overrides -> a checked JobConfig; presets; the resolved job written back.

Errors name the field path, the file and line (or the override) and a fix.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainyard.config import JobConfig
from trainyard.errors import ConfigError
from trainyard.redaction import redact

PRESETS = ("quickstart", "tiny", "tiny-moe")


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, by dotted path."""


def _compose_lines(text: str) -> dict[str, int]:
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = f"{prefix}{key_node.value}"
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path + ".")

    root = yaml.compose(text, Loader=_LineLoader)
    if root is not None:
        walk(root, "")
    return lines


def preset_path(name: str) -> Path:
    return Path(str(resources.files("trainyard") / "configs" / f"{name}.yaml"))


def _read_yaml(path: str) -> tuple[dict[str, Any], dict[str, int], str]:
    file = Path(path)
    if not file.exists() and path in PRESETS:
        file = preset_path(path)
    if not file.is_file():
        what = "is a folder, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(
            f"config file {path} {what}",
            fix=f"pass a YAML file, or one of the built-in presets: {', '.join(PRESETS)}",
        )
    text = _decode_text(file.read_bytes(), str(file))
    try:
        data = yaml.load(text, Loader=_LineLoader) or {}
        lines = _compose_lines(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else str(file)
        raise ConfigError(f"not valid YAML ({getattr(err, 'problem', err)})", where=where) from None
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping of sections", where=f"{file}:1")
    return data, lines, str(file)


def _decode_text(raw: bytes, name: str) -> str:
    """UTF-8 text of a config file; a binary or otherwise encoded file names its first bad line."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        kind = "a binary file" if b"\0" in raw[:8192] else "not UTF-8 text"
        raise ConfigError(
            f"{kind} (byte 0x{raw[err.start]:02x} at offset {err.start}), not a YAML job",
            where=f"{name}:{line}",
            fix="pass the job's YAML file, saved as UTF-8",
        ) from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(
            f"override '{item}' is not key=value",
            fix="write overrides as section.field=value, for example train.lr=1e-4",
        )
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _known_fields(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _section_model(path: list[str]) -> type[BaseModel] | None:
    """The pydantic model that owns the keys at `path` (None for free-form dicts)."""
    model: type[BaseModel] = JobConfig
    for part in path:
        by_alias = {info.alias or name: info for name, info in model.model_fields.items()}
        field = by_alias.get(part)
        annotation = field.annotation if field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            return None
    return model


def _check_unknown_keys(data: dict[str, Any], where_of: Any, prefix: list[str]) -> None:
    model = _section_model(prefix)
    if model is None:
        return
    known = _known_fields(model)
    for key, value in data.items():
        path = prefix + [str(key)]
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            fix = f"did you mean '{'.'.join(prefix + hint)}'?" if hint else None
            fix = fix or f"known keys here: {', '.join(known)}"
            raise ConfigError(f"unknown key '{'.'.join(path)}'", where=where_of(path), fix=fix)
        if isinstance(value, dict):
            _check_unknown_keys(value, where_of, path)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _field_name(loc: tuple[Any, ...]) -> str:
    """A validation error's location as the user writes it: data.mixture[1].weight, not data.mixture.1.weight."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job: the file (or the quickstart preset when None), then the overrides in order."""
    data, lines, file = _read_yaml(path or "quickstart")
    sources: dict[str, str] = {}
    for item in overrides:
        keys, value = _parse_override(item)
        _set_path(data, keys, value)
        sources[".".join(keys)] = f"override '{item}'"

    def where_of(loc: list[str]) -> str:
        for depth in range(len(loc), 0, -1):
            dotted = ".".join(loc[:depth])
            for key, source in sources.items():
                if key == dotted or key.startswith(dotted + "."):
                    return source
            if dotted in lines:
                return f"{file}:{lines[dotted]}"
        return file

    _check_unknown_keys(data, where_of, [])
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        field = _field_name(first["loc"]) or "(top level)"
        value = first.get("input")
        shown = "" if isinstance(value, dict) or not loc else f" (got {value!r})"
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(
            f"{field}: {message}{shown}",
            where=where_of(loc),
            fix="change that value in the file, or override it with key=value",
        ) from None
    cfg._where = {**{key: f"{file}:{line}" for key, line in lines.items()}, **sources}
    return cfg


# ---------------------------------------------------------------- batch plan


def dump_config(cfg: JobConfig) -> str:
    """The resolved job as YAML, secrets redacted: what goes into the run dir. It loads back as the same job: a
    mixture's unused data.path is left out (the two are exclusive)."""
    unused = {"data": {"path"}} if cfg.data.mixture else None
    return yaml.safe_dump(redact(cfg.model_dump(mode="json", by_alias=True, exclude=unused)), sort_keys=False)
