"""Typed configuration: load a ``.py``, YAML, TOML or JSON file (or a dict), validate it, and
fail early with a message that names the key.

A ``.py`` config is a file of module-level assignments of plain values (numbers, strings,
lists, ``dict(...)``, arithmetic, names assigned above). It is parsed, never executed, so a
config cannot run code; names that start with ``_`` are private helpers.

``python -m tessera.config docs/config.md`` regenerates the field reference in the docs.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tessera.context.dims import ParallelDims, check_tensor_layout
from tessera.errors import ConfigError, NotAvailableError


def _field(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


# ---- sections ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorConfig:
    size: int = _field(1, "Ranks that share each layer's weights (the tensor axis).")
    mode: Literal["1d", "2d", "2.5d", "3d"] = _field(
        "1d", "Algorithm: 1d (Megatron), 2d (SUMMA, size q^2), 2.5d (Tesseract, size depth*q^2), 3d (size q^3)."
    )
    depth: int = _field(1, "Number of stacked q x q grids; 2.5d only.")
    sequence_parallel: bool = _field(
        False, "1d only: keep activations outside the tensor-parallel matmuls split along the sequence."
    )

    def validate(self, path: str) -> None:
        check_tensor_layout(self.size, self.mode, self.depth)
        if self.sequence_parallel and self.mode != "1d":
            raise ConfigError(f"{path}sequence_parallel=True needs mode '1d' (mode is {self.mode!r})")


@dataclass(frozen=True)
class PipelineConfig:
    size: int = _field(1, "Number of pipeline stages.")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"] = _field("1f1b", "Pipeline schedule.")
    microbatches: int | None = _field(None, "Micro-batches per step; default: the number of stages.")
    chunks: int = _field(1, "Model chunks per rank; more than 1 only with the interleaved schedule.")
    partition: Literal["uniform", "parameters", "time", "explicit"] = _field(
        "parameters",
        "How layers are split into stages: equal layer counts, equal parameters, equal measured time, or `boundaries`.",
    )
    boundaries: list[int] | None = _field(
        None, "First layer index of every stage but the first (partition='explicit')."
    )

    def validate(self, path: str) -> None:
        if self.size < 1:
            raise ConfigError(f"{path}size={self.size} must be at least 1")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"{path}microbatches={self.microbatches} must be at least 1")
        if self.chunks < 1:
            raise ConfigError(f"{path}chunks={self.chunks} must be at least 1")
        if self.schedule != "interleaved" and self.chunks != 1:
            raise ConfigError(
                f"{path}chunks={self.chunks} needs schedule='interleaved' (schedule is {self.schedule!r})"
            )
        micro = self.microbatches if self.microbatches is not None else self.size
        if self.size > 1 and self.schedule != "gpipe" and micro < self.size:
            raise ConfigError(
                f"{path}microbatches={micro} is fewer than the {self.size} stages: schedule "
                f"{self.schedule!r} needs at least one micro-batch per stage in flight (use >= {self.size}, or 'gpipe')"
            )
        if self.partition == "explicit":
            want = self.size * self.chunks - 1
            if self.boundaries is None or len(self.boundaries) != want:
                raise ConfigError(f"{path}partition='explicit' needs boundaries: {want} increasing layer indices")
            if list(self.boundaries) != sorted(set(self.boundaries)) or self.boundaries[0] < 1:
                raise ConfigError(f"{path}boundaries={self.boundaries} must be strictly increasing and >= 1")
        elif self.boundaries is not None:
            raise ConfigError(f"{path}boundaries is only used with partition='explicit'")


@dataclass(frozen=True)
class SequenceConfig:
    size: int = _field(1, "Ranks that split the sequence dimension (the sequence axis).")
    mode: Literal["ring", "ring_attention", "ulysses"] = _field(
        "ring", "ring self-attention, ring attention with online softmax, or all-to-all (Ulysses)."
    )

    def validate(self, path: str) -> None:
        if self.size < 1:
            raise ConfigError(f"{path}size={self.size} must be at least 1")


@dataclass(frozen=True)
class ParallelConfig:
    data: int | None = _field(None, "Data-parallel degree; default: whatever the other axes leave of the world.")
    pipeline: PipelineConfig = _section(PipelineConfig, "Pipeline parallelism (an int is taken as `size`).")
    tensor: TensorConfig = _section(TensorConfig, "Tensor parallelism (an int is taken as `size`).")
    sequence: SequenceConfig = _section(SequenceConfig, "Sequence parallelism (an int is taken as `size`).")

    def validate(self, path: str) -> None:
        if self.data is not None and self.data < 1:
            raise ConfigError(f"{path}data={self.data} must be at least 1")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _field(0, "0 (off), 1 (shard optimizer states), 2 (+ gradients), 3 (+ parameters).")
    overlap_comm: bool = _field(True, "Overlap gradient reduction with the backward pass.")
    bucket_mb: float = _field(25.0, "Size of a gradient-reduction bucket in MiB.")
    offload_optimizer: Literal["none", "cpu"] = _field("none", "Keep optimizer states in host memory and step there.")

    def validate(self, path: str) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}stage={self.stage} is not a ZeRO stage; allowed: 0, 1, 2, 3")
        if self.bucket_mb <= 0:
            raise ConfigError(f"{path}bucket_mb={self.bucket_mb} must be positive")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ConfigError(f"{path}offload_optimizer={self.offload_optimizer!r} needs stage >= 1")


@dataclass(frozen=True)
class GeminiConfig:
    enabled: bool = _field(False, "Manage model state in chunks placed on device, host memory or disk.")
    placement: Literal["static", "auto"] = _field(
        "auto", "static: fixed device share; auto: driven by the memory tracer."
    )
    chunk_mb: float = _field(32.0, "Chunk size in MiB.")
    device_fraction: float = _field(1.0, "static placement: share of chunks kept on the device.")
    disk_dir: str | None = _field(None, "Folder for chunks spilled to disk; None keeps everything in memory.")

    def validate(self, path: str) -> None:
        if self.chunk_mb <= 0:
            raise ConfigError(f"{path}chunk_mb={self.chunk_mb} must be positive")
        if not 0.0 <= self.device_fraction <= 1.0:
            raise ConfigError(f"{path}device_fraction={self.device_fraction} must be within [0, 1]")


@dataclass(frozen=True)
class MixedPrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16"] = _field("fp32", "Compute dtype; master weights stay fp32.")
    loss_scale: float | Literal["dynamic"] = _field("dynamic", "fp16: 'dynamic' or a fixed scale.")
    initial_scale: float = _field(2.0**16, "fp16 dynamic scaling: the first scale.")
    growth_interval: int = _field(1000, "fp16 dynamic scaling: clean steps before the scale grows.")
    growth_factor: float = _field(2.0, "fp16 dynamic scaling: factor of growth.")
    backoff_factor: float = _field(0.5, "fp16 dynamic scaling: factor applied on overflow.")
    min_scale: float = _field(1.0, "fp16 dynamic scaling: the scale never falls below this.")

    def validate(self, path: str) -> None:
        if isinstance(self.loss_scale, float) and self.loss_scale <= 0:
            raise ConfigError(f"{path}loss_scale={self.loss_scale} must be positive")
        if self.initial_scale <= 0 or self.min_scale <= 0:
            raise ConfigError(f"{path}initial_scale and min_scale must be positive")
        if self.growth_interval < 1:
            raise ConfigError(f"{path}growth_interval={self.growth_interval} must be at least 1")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError(f"{path}growth_factor must be > 1 and backoff_factor within (0, 1)")


@dataclass(frozen=True)
class CommConfig:
    timeout_s: float = _field(
        300.0, "Watchdog: a collective that does not finish in this time fails naming rank, op and axis."
    )

    def validate(self, path: str) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"{path}timeout_s={self.timeout_s} must be positive")


@dataclass(frozen=True)
class LaunchConfig:
    backend: Literal["auto", "gloo", "nccl"] = _field("auto", "auto: nccl when CUDA is present, else gloo.")
    intra_op_threads: int = _field(1, "CPU only: intra-op threads per rank; 0 keeps torch's default.")

    def validate(self, path: str) -> None:
        if self.intra_op_threads < 0:
            raise ConfigError(f"{path}intra_op_threads={self.intra_op_threads} must be >= 0")


@dataclass(frozen=True)
class TrainerConfig:
    steps: int | None = _field(None, "Optimizer steps to train; None: `epochs` passes over the data.")
    epochs: int = _field(1, "Passes over the training data when `steps` is None.")
    log_every: int = _field(10, "Log metrics every this many steps.")
    eval_every: int | None = _field(None, "Evaluate every this many steps; None: at the end of each epoch.")
    checkpoint_every: int | None = _field(None, "Save a checkpoint every this many steps; None: only at the end.")
    output_dir: str = _field("runs", "Folder under which each run writes its own folder.")
    progress_bar: bool = _field(True, "Show a progress bar on rank 0.")

    def validate(self, path: str) -> None:
        for name in ("steps", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{path}{name}={value} must be at least 1")
        if self.epochs < 1 or self.log_every < 1:
            raise ConfigError(f"{path}epochs and log_every must be at least 1")


@dataclass(frozen=True)
class Config:
    """The whole configuration of a tessera run."""

    parallel: ParallelConfig = _section(ParallelConfig, "The parallel layout.")
    zero: ZeroConfig = _section(ZeroConfig, "ZeRO sharding of optimizer states, gradients and parameters.")
    gemini: GeminiConfig = _section(GeminiConfig, "Chunk-based heterogeneous memory management.")
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig, "Mixed precision and loss scaling.")
    gradient_accumulation: int = _field(1, "Micro-batches accumulated per optimizer step.")
    clip_grad_norm: float | None = _field(None, "Clip gradients to this global norm; None: no clipping.")
    seed: int = _field(42, "Base random seed (every rank and axis stream derives from it).")
    comm: CommConfig = _section(CommConfig, "Communication and its watchdog.")
    launch: LaunchConfig = _section(LaunchConfig, "Process-group backend and threads.")
    trainer: TrainerConfig = _section(TrainerConfig, "The Trainer's loop, logging and checkpoints.")

    def validate(self, path: str) -> None:
        if self.gradient_accumulation < 1:
            raise ConfigError(f"gradient_accumulation={self.gradient_accumulation} must be at least 1")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm} must be positive (or None)")


# ---- building typed objects from plain data ------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
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
        raise ConfigError(f"{path}={value!r} is not a valid {_type_name(tp)}")
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
    raise ConfigError(f"{path}={value!r} must be of type {_type_name(tp)}")


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key, type and rule.

    An int given for a section that has a ``size`` field is taken as ``dict(size=...)``.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, Mapping):
        if "size" in names and isinstance(data, int) and not isinstance(data, bool):
            data = {"size": data}
        else:
            where = path.rstrip(".") or "the config"
            raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
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


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a config file into plain data (not yet validated)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".py":
        return _load_py(path)
    if suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text())
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
    return build(Config, data)


def parallel_dims(config: Config, world_size: int) -> ParallelDims:
    """The validated layout of ``config`` on ``world_size`` ranks."""
    p = config.parallel
    return ParallelDims(
        world_size=world_size,
        data=p.data,
        pipeline=p.pipeline.size,
        sequence=p.sequence.size,
        tensor=p.tensor.size,
        tensor_mode=p.tensor.mode,
        tensor_depth=p.tensor.depth,
    )


# ---- features not built yet ----------------------------------------------------------------

# (key, is it in use?, what it is). Each strategy's issue removes its line when it lands.
_NOT_BUILT: list[tuple[str, Callable[[Config], bool], str]] = [
    ("parallel.tensor.size", lambda c: c.parallel.tensor.size > 1, "tensor parallelism"),
    ("parallel.pipeline.size", lambda c: c.parallel.pipeline.size > 1, "pipeline parallelism"),
    ("parallel.sequence.size", lambda c: c.parallel.sequence.size > 1, "sequence parallelism"),
    ("zero.stage", lambda c: c.zero.stage > 0, "ZeRO"),
    ("gemini.enabled", lambda c: c.gemini.enabled, "the Gemini memory manager"),
]


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


# ---- the field reference -------------------------------------------------------------------


def reference_markdown() -> str:
    """Markdown tables of every config field: key, type, default and meaning."""
    lines: list[str] = []

    def table(cls: type, prefix: str, doc: str) -> None:
        hints = typing.get_type_hints(cls)
        lines.append(f"### `{prefix.rstrip('.') or 'top level'}`\n")
        if doc:
            lines.append(f"{doc}\n")
        lines.append("| key | type | default | meaning |")
        lines.append("| --- | --- | --- | --- |")
        nested = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((f, tp))
                continue
            type_cell = _type_name(tp).replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | `{type_cell}` | `{f.default!r}` | {f.metadata['doc']} |")
        lines.append("")
        for f, tp in nested:
            table(tp, f"{prefix}{f.name}.", f.metadata["doc"])  # type: ignore[arg-type]

    table(Config, "", "")
    return "\n".join(lines).rstrip() + "\n"


_BEGIN = "<!-- BEGIN GENERATED: python -m tessera.config docs/config.md -->"
_END = "<!-- END GENERATED -->"


def render_docs(text: str) -> str:
    """``text`` with the part between the generated-reference markers replaced."""
    if _BEGIN not in text or _END not in text:
        raise ValueError("the docs page lacks the generated-reference markers")
    head, rest = text.split(_BEGIN, 1)
    _, tail = rest.split(_END, 1)
    return f"{head}{_BEGIN}\n\n{reference_markdown()}\n{_END}{tail}"


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    target = Path(sys.argv[1])
    target.write_text(render_docs(target.read_text()))
    print(f"wrote the config reference into {target}")
