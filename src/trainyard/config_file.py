"""A job's YAML file and `a.b=c` overrides -> a checked JobConfig; presets; the resolved job written back.

Errors name the field path, the file and line (or the override) and a fix; every error of a job is reported at
once, so a user fixes them in one edit rather than one per run.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trainyard.config import JobConfig
from trainyard.errors import ConfigError
from trainyard.redaction import redact

PRESETS = ("quickstart", "tiny", "tiny-moe")
VALUE_FIX = "change that value in the file, or override it with key=value"
VALUES_FIX = "change those values in the file, or override them with key=value"
SIBLING_CUTOFF = 0.5
"""How close an unknown key must be to a key of its own section to be suggested."""
ELSEWHERE_CUTOFF = 0.8
"""How close to a key of another section: stricter, as there are many more of them."""

Where = Callable[[list[str]], str]


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


LENGTH_KEYS = ("epochs", "max_steps", "total_tokens")
"""train's keys that each set the run's length: one given on the command line replaces the file's others."""


def _parse_override(item: str) -> tuple[list[str], Any]:
    if item.startswith("~"):
        if "=" in item:
            raise ConfigError(f"override '{item}' both removes and sets a key",
                              fix=f"remove it with {item.split('=', 1)[0]}, or set it with {item[1:]}")
        return item[1:].strip().split("."), REMOVED
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


def _fields_by_key(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key a file writes (the alias where there is one, e.g. checkpoint.async)."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside a list or an Optional (data.mixture's MixtureSource)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_model_in, typing.get_args(annotation))), None)


def _mapping_model(annotation: Any) -> type[BaseModel] | None:
    """The section a mapping under this field is read into: the model itself or an Optional one (log.wandb), not a
    list of them (data.mixture, whose keys are not written as a path)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(filter(None, map(_mapping_model, typing.get_args(annotation))), None)
    return None


def _section_model(path: list[str]) -> type[BaseModel] | None:
    """The pydantic model that owns the keys at `path` (None for free-form dicts)."""
    model: type[BaseModel] | None = JobConfig
    for part in path:
        field = _fields_by_key(model).get(part) if model is not None else None
        model = _mapping_model(field.annotation) if field else None
    return model


def _schema_paths(model: type[BaseModel] = JobConfig, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of the job's sections, nested ones included."""
    for key, info in _fields_by_key(model).items():
        yield (*prefix, key)
        section = _mapping_model(info.annotation)
        if section is not None:
            yield from _schema_paths(section, (*prefix, key))


def _did_you_mean(key: str, prefix: list[str], known: list[str]) -> str:
    """The closest key of this section, or the same (or a close) key in another section as a full path: a top-level
    `lr` means train.lr, `lora.lr` too. Ties (every_steps is in three sections) are all named."""

    def closeness(name: str) -> float:
        return 1.0 if name == key else difflib.SequenceMatcher(None, key, name).ratio()

    here = tuple(prefix)
    scored = [(closeness(name), 1, ".".join((*here, name))) for name in known]
    scored = [item for item in scored if item[0] >= SIBLING_CUTOFF]
    for path in _schema_paths():
        if path[:-1] != here and closeness(path[-1]) >= ELSEWHERE_CUTOFF:
            scored.append((closeness(path[-1]), 0, ".".join(path)))
    if not scored:
        return f"known keys here: {', '.join(known)}"
    best = max(scored)[:2]
    names = [f"'{path}'" for score, local, path in scored if (score, local) == best]
    shown = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"did you mean {shown}?"


def _unknown_keys(data: dict[str, Any], where_of: Where, prefix: list[str]) -> dict[str, ConfigError]:
    """Every key no section knows, by dotted path (pydantic reports them too, without a suggestion)."""
    model = _section_model(prefix)
    if model is None:
        return {}
    known = list(_fields_by_key(model))
    problems: dict[str, ConfigError] = {}
    for key, value in data.items():
        path = prefix + [str(key)]
        if key not in known:
            dotted = ".".join(path)
            problems[dotted] = ConfigError(
                f"unknown key '{dotted}'", where=where_of(path), fix=_did_you_mean(str(key), prefix, known)
            )
        elif isinstance(value, dict):
            problems.update(_unknown_keys(value, where_of, path))
    return problems


REMOVED = object()
"""The value of a `~key` override: the key leaves the file's data."""


def _remove_path(data: dict[str, Any], path: list[str], item: str) -> None:
    """`~section.key`: the file's key is gone, as if never written (its default applies). A key no section knows
    is refused with a did-you-mean; a known key the file does not set is nothing to remove."""
    model = _section_model(path[:-1])
    known = list(_fields_by_key(model)) if model is not None else []
    if model is not None and path[-1] not in known:
        raise ConfigError(f"override '{item}': unknown key '{'.'.join(path)}'",
                          fix=_did_you_mean(path[-1], path[:-1], known))
    node: Any = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _replace_lengths(data: dict[str, Any], parsed: list[tuple[list[str], Any]], lines: dict[str, int],
                     file: str) -> list[str]:
    """A run length given on the command line is the later, more specific statement: the file's other length keys
    go. Returns the line that says so, if any key went."""
    given = [keys[1] for keys, value in parsed
             if len(keys) == 2 and keys[0] == "train" and keys[1] in LENGTH_KEYS and value is not REMOVED]
    train = data.get("train")
    if not given or not isinstance(train, dict):
        return []
    replaced = [key for key in LENGTH_KEYS if key in train and key not in given]
    for key in replaced:
        del train[key]
    if not replaced:
        return []
    where = ", ".join(f"train.{key} ({file}:{lines[f'train.{key}']})" if f"train.{key}" in lines else f"train.{key}"
                      for key in replaced)
    return [f"train.{given[-1]} from the command line replaces {where}"]


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


def _resolve_loc(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], FieldInfo | None]:
    """A pydantic location without the union member it tried (lora.target_modules, not
    lora.target_modules.list[str]), and the field it ends at. Past a field that holds no section, only list
    indices are locations; the other parts name union members."""
    kept: list[Any] = []
    model: type[BaseModel] | None = JobConfig
    field: FieldInfo | None = None
    for part in loc:
        if isinstance(part, int):
            kept.append(part)
            continue
        found = _fields_by_key(model).get(part) if model is not None else None
        if found is not None:
            kept.append(part)
            field, model = found, _model_in(found.annotation)
    return tuple(kept), field


def _one_message(errors: list[dict[str, Any]]) -> str:
    """One field's errors as one sentence: a union's members read 'Input should be a valid list or 'all-linear''."""
    messages = [error["msg"].removeprefix("Value error, ") for error in errors]
    if len(messages) > 1:
        messages = [message.split(", unable to parse", 1)[0] for message in messages]
        messages = [messages[0], *(message.removeprefix("Input should be ") for message in messages[1:])]
    return " or ".join(dict.fromkeys(messages))


def _list_syntax(field: str, value: Any) -> str:
    """How a list is written, from the user's own items (`q_proj` or `q_proj,v_proj`), in both places: a scalar
    given for a list is the usual slip, and the override form is YAML's flow list, which the shell must not split."""
    items = [item.strip() for item in str(value).split(",") if item.strip()] or ["..."]
    return (
        f"write a list, items separated by commas: as an override {field}=[{','.join(items)}] (no spaces, or quote "
        f"the whole override), in the YAML file {field.rsplit('.', 1)[-1]}: [{', '.join(items)}]"
    )


def _field_problem(
    loc: tuple[Any, ...], field: FieldInfo | None, errors: list[dict[str, Any]], where_of: Where
) -> ConfigError:
    """One field's errors as a ConfigError naming the field, the value, where it was set and a fix."""
    name = _field_name(loc) or "(top level)"
    value = errors[0].get("input")
    shown = "" if isinstance(value, dict) or not loc else f" (got {value!r})"
    if value is None and field is not None and not field.is_required() and field.default is not None:
        return ConfigError(
            f"{name} cannot be null: it always has a value (its default is {field.default!r})",
            where=where_of([str(p) for p in loc]),
            fix=f"give it a value, or remove the file's key with ~{name} to use the default",
        )
    wants_list = any(error["type"] in ("list_type", "tuple_type") for error in errors)
    if wants_list and not isinstance(value, list | dict) and field and not _model_in(field.annotation):
        fix: str | None = _list_syntax(name, value)
    else:  # a validator's own message already says what to set
        fix = None if all(error["type"] == "value_error" for error in errors) else VALUE_FIX
    return ConfigError(f"{name}: {_one_message(errors)}{shown}", where=where_of([str(p) for p in loc]), fix=fix)


def _validation_problems(err: ValidationError, where_of: Where, unknown: set[str]) -> list[ConfigError]:
    """All of pydantic's errors, one per field (a union's members merged), unknown keys left to their own check."""
    by_field: dict[tuple[Any, ...], tuple[FieldInfo | None, list[dict[str, Any]]]] = {}
    for error in err.errors():
        if error["type"] == "extra_forbidden" and ".".join(map(str, error["loc"])) in unknown:
            continue
        loc, field = _resolve_loc(error["loc"])
        by_field.setdefault(loc, (field, []))[1].append(error)
    return [_field_problem(loc, field, errors, where_of) for loc, (field, errors) in by_field.items()]


def _all_at_once(problems: list[ConfigError]) -> ConfigError:
    """One error for every problem found: one alone as it is, several as a list with a fix each."""
    if len(problems) == 1:
        return problems[0]
    lines = [f"{len(problems)} problems in the job config:"]
    for problem in problems:
        lines.append(f"  {problem.where}: {problem.what}" if problem.where else f"  {problem.what}")
        if problem.fix and problem.fix != VALUE_FIX:
            lines.append(f"    Fix: {problem.fix}")
    shared = VALUES_FIX if any(problem.fix == VALUE_FIX for problem in problems) else None
    return ConfigError("\n".join(lines), fix=shared)


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job: the file (or the quickstart preset when None), then the overrides in order."""
    data, lines, file = _read_yaml(path or "quickstart")
    sources: dict[str, str] = {}
    parsed = [_parse_override(item) for item in overrides]
    notes = _replace_lengths(data, parsed, lines, file)
    for item, (keys, value) in zip(overrides, parsed, strict=True):
        if value is REMOVED:
            _remove_path(data, keys, item)
            lines = {key: line for key, line in lines.items() if key != ".".join(keys)}
            continue
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

    unknown = _unknown_keys(data, where_of, [])
    problems = list(unknown.values())
    try:  # validators that name two fields say where each was set (the context)
        cfg = JobConfig.model_validate(data, context={"where": lambda field: where_of(field.split("."))})
    except ValidationError as err:
        problems += _validation_problems(err, where_of, set(unknown))
    if problems:
        raise _all_at_once(problems) from None
    cfg._where = {**{key: f"{file}:{line}" for key, line in lines.items()}, **sources}
    cfg._notes = notes
    return cfg


# ---------------------------------------------------------------- batch plan


def dump_config(cfg: JobConfig) -> str:
    """The resolved job as YAML, secrets redacted: what goes into the run dir. It loads back as the same job: a
    mixture's unused data.path is left out (the two are exclusive), and so is the default max_steps of an epochs
    job the trainer has not sized yet (train.epoch_rows unset: a pod's job.yaml)."""
    unused: dict[str, set[str]] = {}
    if cfg.data.mixture:
        unused["data"] = {"path"}
    if cfg.train.epochs is not None and cfg.train.epoch_rows is None:
        unused["train"] = {"max_steps"}
    return yaml.safe_dump(redact(cfg.model_dump(mode="json", by_alias=True, exclude=unused or None)), sort_keys=False)
