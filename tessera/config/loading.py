"""Load a config from a ``.py``, YAML, TOML or JSON file (or a dict), apply ``--set`` overrides,
and build the typed, validated ``Config``.

A ``.py`` config is a file of module-level assignments of plain values (numbers, strings,
lists, ``dict(...)``, arithmetic, names assigned above). It is parsed, never executed, so a
config cannot run code; names that start with ``_`` are private helpers.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import operator
import sys
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tessera.config.schema import Config
from tessera.context.dims import ParallelDims
from tessera.errors import ConfigError, NotAvailableError

# ---- building typed objects from plain data ------------------------------------------------


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"dict[{type_name(key)}, {type_name(value)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return build(tp, value, f"{path}.")
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _convert(arm, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}={value!r} is not a valid {type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        raise ConfigError(f"{path}={value!r} is not allowed; allowed: {', '.join(repr(a) for a in allowed)}")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {
            _convert(key_type, k, f"{path}.<key>"): _convert(value_type, v, f"{path}.{k}") for k, v in value.items()
        }
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}={value!r} is not None")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"{path}={value!r} must be of type {type_name(tp)}")


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key, type and rule.

    An int given for a section that has a ``size`` field is taken as ``dict(size=...)``, and
    ``"auto"`` for one with an ``auto`` field as ``dict(auto=True)``.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, Mapping):
        if "size" in names and isinstance(data, int) and not isinstance(data, bool):
            data = {"size": data}
        elif "auto" in names and data == "auto":
            data = {"auto": True}
        else:
            where = path.rstrip(".") or "the config"
            raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    for key, value in data.items():
        if key in renamed:  # an old name keeps working, with a warning naming the new one
            new = renamed[key]
            if new in data:
                raise ConfigError(
                    f"'{path}{key}' and '{path}{new}' both given: '{path}{key}' is the old name of '{path}{new}'"
                )
            warnings.warn(
                f"config key '{path}{key}' is deprecated: use '{path}{new}' (same meaning)", FutureWarning, stacklevel=2
            )
            key = new
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{path}{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{path}{key}'{hint} (known keys: {', '.join(names)})")
        kwargs[key] = _convert(hints[key], value, f"{path}{key}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


# ---- reading files -------------------------------------------------------------------------

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CONSTRUCTORS: dict[str, Callable[..., Any]] = {"dict": dict, "list": list, "tuple": tuple}


def _literal(node: ast.AST, env: Mapping[str, Any], where: str) -> Any:
    """Evaluate a plain-value expression: literals, containers, dict(...), arithmetic, names."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e, env, where) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                raise ConfigError(f"{where}: '**' unpacking is not supported in config files")
            out[_literal(k, env, where)] = _literal(v, env, where)
        return out
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise ConfigError(f"{where}: name {node.id!r} is not assigned above it in the config file")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand, env, where)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_literal(node.left, env, where), _literal(node.right, env, where))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONSTRUCTORS:
        args = [_literal(a, env, where) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ConfigError(f"{where}: '**' unpacking is not supported in config files")
            kwargs[kw.arg] = _literal(kw.value, env, where)
        value = _CONSTRUCTORS[node.func.id](*args, **kwargs)
        return list(value) if isinstance(value, tuple) else value
    raise ConfigError(
        f"{where}: config files hold plain values (numbers, strings, lists, dict(...), arithmetic); "
        f"found {ast.unparse(node)!r}"
    )


def _load_py(path: Path) -> dict[str, Any]:
    tree = ast.parse(path.read_text(), filename=str(path))
    env: dict[str, Any] = {}
    for node in tree.body:
        where = f"{path}:{node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring or comment string
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            value = _literal(node.value, env, where)
            for target in node.targets:
                env[target.id] = value  # type: ignore[attr-defined]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            env[node.target.id] = _literal(node.value, env, where)
        else:
            raise ConfigError(
                f"{where}: a config file holds only assignments like `name = value`; "
                f"found {ast.unparse(node).splitlines()[0]!r}"
            )
    return {k: v for k, v in env.items() if not k.startswith("_")}


def config_path(path: str | Path) -> Path:
    """``path`` itself if it names a file; a relative path not found from the current folder is
    looked for next to the running script (``python examples/train.py`` naming ``my_config.py``)."""
    given = Path(path)
    if given.is_file():
        return given
    tried = [given.resolve()]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not given.is_absolute() and main_file:
        beside = Path(main_file).resolve().parent / given
        if beside.is_file():
            return beside
        if beside != tried[0]:
            tried.append(beside)
    where = " or ".join(str(t) for t in tried)
    raise ConfigError(f"config file {str(path)!r} does not exist (looked for {where})")


_FLOAT = r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+)$"""


def _yaml_loader() -> Any:
    """PyYAML's safe loader, reading numbers as YAML 1.2 does: ``1e-5`` and ``3E4`` are floats
    (YAML 1.1, which PyYAML follows, wants a dot in the mantissa and reads them as strings)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))
    return Loader


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a config file into plain data (not yet validated)."""
    path = config_path(path)
    suffix = path.suffix.lower()
    if suffix == ".py":
        return _load_py(path)
    if suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.load(path.read_text(), Loader=_yaml_loader())  # a SafeLoader: plain data only
    elif suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        data = tomllib.loads(path.read_text())
    elif suffix == ".json":
        data = json.loads(path.read_text())
    else:
        raise ConfigError(f"config file {str(path)!r}: unknown format {suffix!r}; use .py, .yaml, .toml or .json")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at its top level")
    return data


def _parse_override_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (from ``--set``) to plain config data."""
    out = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if isinstance(child, int) and not isinstance(child, bool):
                child = {"size": child}  # the shorthand section=N
            elif child == "auto":
                child = {"auto": True}  # the shorthand parallel="auto"
            elif not isinstance(child, dict):
                child = {}
            node[part] = child
            node = child
        node[parts[-1]] = _parse_override_value(text)
    return out


ConfigSource = str | Path | Mapping[str, Any] | Config | None


def load_config(source: ConfigSource = None, overrides: Sequence[str] = ()) -> Config:
    """Load and validate a config from a path, a mapping, a Config or None (all defaults)."""
    if isinstance(source, Config):
        if not overrides:
            return source
        data: dict[str, Any] = dataclasses.asdict(source)
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_config_file(source)
    if overrides:
        data = apply_overrides(data, overrides)
    config = build(Config, data)
    if "model" in data:  # the config names its model: its layer count is known now
        check_model_layout(config)
    return config


def default_run_dir(config: Config) -> Path:
    """The run folder of ``tessera train`` when none is given: trainer.output_dir/<time>-<model>."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    hf_path = config.model.hf_path
    if hf_path is not None:  # hf:PATH: the folder's name (or the config file's, unless config.json)
        given = Path(hf_path)
        label = (
            given.parent.name if given.name == "config.json" else given.stem if given.suffix == ".json" else given.name
        )
        return Path(config.trainer.output_dir) / f"{stamp}-hf-{label or 'model'}"
    return Path(config.trainer.output_dir) / f"{stamp}-{config.model.name}-{config.model.preset}"


def check_model_layout(config: Config) -> None:
    """Refuse a layout that the configured model (``config.model``) cannot take: more pipeline
    stages (times chunks) than the model has layers to give them."""
    pp = config.parallel.pipeline
    if pp.size == 1:
        return
    if config.model.hf_path is not None:
        from tessera.hf.train import pipeline_layer_count as hf_layer_count  # reads the model's config.json

        counted = hf_layer_count(config.model.hf_path, config.model.options)
        if counted is None:  # no num_hidden_layers: the pipeline policy decides at initialize
            return
        layers = counted
        model = f"model {config.model.name!r}"
        parts_of = f"the entry (embeddings), {layers - 2} decoder layers, the exit (final norm and head)"
    else:
        from tessera.models.gpt import pipeline_layer_count  # models sit above config; import on use

        layers = pipeline_layer_count(config.model.preset, config.model.options)
        model = f"model {config.model.name!r} (preset {config.model.preset!r})"
        parts_of = f"embedding, {layers - 2} blocks, head"
    parts = pp.size * pp.chunks
    if parts > layers:
        raise ConfigError(
            f"parallel.pipeline.size={pp.size}"
            + (f" x chunks={pp.chunks}" if pp.chunks > 1 else "")
            + f" needs {parts} pipeline parts, but {model} "
            f"has only {layers} layers to split ({parts_of}): use at most {layers} parts"
        )


def parallel_dims(config: Config, world_size: int) -> ParallelDims:
    """The validated layout of ``config`` on ``world_size`` ranks (``parallel = "auto"`` must have
    been resolved by :func:`tessera.config.resolve_auto` first)."""
    p = config.parallel
    if p.auto:
        raise ConfigError(
            'parallel="auto" is chosen at launch, when the world size is known: resolve it with '
            "tessera.config.resolve_auto(config, world_size) first"
        )
    return ParallelDims(
        world_size=world_size,
        data=p.data,
        pipeline=p.pipeline.size,
        sequence=p.sequence.size,
        tensor=p.tensor.size,
        tensor_mode=p.tensor.mode,
        tensor_depth=p.tensor.depth,
        sequence_parallel=p.tensor.sequence_parallel,
        keep_blocks=p.tensor.keep_blocks,
        sequence_mode=p.sequence.mode,
        expert=p.expert.size,
    )


# ---- features not built yet ----------------------------------------------------------------

# (key, is it in use?, what it is). Each strategy's issue removes its line when it lands.
_NOT_BUILT: list[tuple[str, Callable[[Config], bool], str]] = []


def unavailable_features(config: Config) -> list[str]:
    """Messages for every configured feature that is accepted but not built yet."""
    return [
        f"{key}: {what} is not available yet in this version of tessera"
        for key, in_use, what in _NOT_BUILT
        if in_use(config)
    ]


def require_available(config: Config) -> None:
    """Raise NotAvailableError naming every configured feature that is not built yet."""
    missing = unavailable_features(config)
    if missing:
        raise NotAvailableError("; ".join(missing))
