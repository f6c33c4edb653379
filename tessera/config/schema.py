"""The config schema: one frozen dataclass per section, each field with its type, default and
documentation, and a ``validate`` method for the rules between fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from tessera.context.dims import check_tensor_layout
from tessera.context.rules import Combination, check_combination
from tessera.errors import ConfigError


def _field(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _field_factory(factory: Any, doc: str) -> Any:
    return field(default_factory=factory, metadata={"doc": doc})


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
    keep_blocks: bool = _field(
        False,
        "2d, 2.5d, 3d: keep what each Linear received in the forward for its backward (2d/2.5d: the q SUMMA "
        "blocks of its weight and of its input or output; 3d: its gathered weight) instead of moving it again: "
        "fewer bytes moved, more activation memory. Off, 3d gathers its weight again in backward.",
    )

    def validate(self, path: str) -> None:
        check_tensor_layout(self.size, self.mode, self.depth, self.sequence_parallel, self.keep_blocks)


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
        check_combination(self.combination())  # the schedule's rules: tessera.context.rules
        if self.partition == "explicit":
            want = self.size * self.chunks - 1
            if self.boundaries is None or len(self.boundaries) != want:
                raise ConfigError(f"{path}partition='explicit' needs boundaries: {want} increasing layer indices")
            if list(self.boundaries) != sorted(set(self.boundaries)) or self.boundaries[0] < 1:
                raise ConfigError(f"{path}boundaries={self.boundaries} must be strictly increasing and >= 1")
        elif self.boundaries is not None:
            raise ConfigError(f"{path}boundaries is only used with partition='explicit'")

    def combination(self) -> Combination:
        """The stages, schedule, micro-batches (default: one per stage) and chunks, for the layout rules."""
        micro = self.microbatches if self.microbatches is not None else self.size
        return Combination(pipeline=self.size, schedule=self.schedule, microbatches=micro, chunks=self.chunks)


@dataclass(frozen=True)
class SequenceConfig:
    size: int = _field(1, "Ranks that split the sequence dimension (the sequence axis).")
    mode: Literal["ring_qk", "ring", "all_to_all"] = _field(
        "ring",
        "ring_qk: ring self-attention (full score rows); ring: ring attention with online softmax (zigzag-"
        "balanced); all_to_all: head exchange (Ulysses; the heads must divide by the size).",
    )

    def validate(self, path: str) -> None:
        if self.size < 1:
            raise ConfigError(f"{path}size={self.size} must be at least 1")


@dataclass(frozen=True)
class ExpertConfig:
    size: int = _field(
        1,
        "Ranks of the data axis that spread the experts of MoE layers (the expert axis; it divides the data-parallel "
        "degree): each holds num_experts / size experts, tokens exchanged by all-to-all (docs/moe.md).",
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
    expert: ExpertConfig = _section(
        ExpertConfig, "Expert parallelism, a split of the data axis (an int is taken as `size`)."
    )
    auto: bool = _field(
        False,
        'Let the planner choose the layout at launch (`parallel = "auto"` is short for `dict(auto=True)`): the '
        "axes, and with them zero.stage and offload, activation_checkpoint.mode, gradient_accumulation and "
        "data.micro_batch_size, keeping the global batch (micro_batch_size x ranks x gradient_accumulation); the "
        "other parallel keys stay unset. See `planner` and docs/planner.md.",
    )

    def validate(self, path: str) -> None:
        if self.auto:
            given = {
                "data": self.data,
                "pipeline": self.pipeline,
                "tensor": self.tensor,
                "sequence": self.sequence,
                "expert": self.expert,
            }
            chosen = [key for key, value in given.items() if value != getattr(ParallelConfig(), key)]
            if chosen:
                raise ConfigError(
                    f"{path}auto=True lets the planner choose the whole layout, and {path}{chosen[0]} is set too: "
                    f"drop {', '.join(path + key for key in chosen)}, or drop {path}auto"
                )
        if self.data is not None and self.data < 1:
            raise ConfigError(f"{path}data={self.data} must be at least 1")
        check_combination(self.combination())  # how the axes combine: tessera.context.rules

    def combination(self) -> Combination:
        """This layout as the layout rules read it (the data degree unknown unless given)."""
        return self.pipeline.combination()._replace(
            data=self.data,
            sequence=self.sequence.size,
            tensor=self.tensor.size,
            tensor_mode=self.tensor.mode,
            tensor_depth=self.tensor.depth,
            sequence_parallel=self.tensor.sequence_parallel,
            keep_blocks=self.tensor.keep_blocks,
            expert=self.expert.size,
            auto=self.auto,
        )


@dataclass(frozen=True)
class PlannerConfig:
    device_memory: int | str | None = _field(
        None,
        "parallel='auto': memory per rank to plan for, e.g. '2GiB'; None: this machine's (the GPU's memory less "
        "2 GiB, or on CPU 80% of the host memory shared by this node's ranks).",
    )
    hardware: str | None = _field(
        None,
        "parallel='auto': the compute and link figures to plan with, a name of "
        "tessera.planner.scenarios.HARDWARE ('a100-80gb', 'a100-40gb', 'h100-80gb', 'cpu'); None: 'cpu' without "
        "CUDA, else 'a100-80gb'.",
    )
    calibrate: bool = _field(
        False,
        "parallel='auto': measure this machine's compute rate and links with short runs before planning (tens of "
        "seconds, `tessera plan --calibrate`) instead of the hardware's figures.",
    )

    def validate(self, path: str) -> None:
        parse_bytes(self.device_memory, f"{path}device_memory")
        if self.hardware is not None:
            from tessera.planner.scenarios import HARDWARE  # the planner sits below config: import on use

            if self.hardware not in HARDWARE:
                raise ConfigError(f"{path}hardware={self.hardware!r} is not known; allowed: {', '.join(HARDWARE)}")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _field(0, "0 (off), 1 (shard optimizer states), 2 (+ gradients), 3 (+ parameters).")
    overlap_comm: bool = _field(True, "Overlap gradient reduction with the backward pass.")
    chunk_mb: float = _field(
        25.0, "Chunk capacity in MiB: parameters are packed into chunks, each also a gradient reduction's bucket."
    )
    offload_optimizer: Literal["none", "cpu"] = _field("none", "Keep optimizer states in host memory and step there.")
    shard: Literal["all", "host"] = _field(
        "all",
        "all: shard over every data rank; host: shard over the data ranks of each host and repeat the shards on "
        "every host (hybrid sharding: gradients reduce-scattered inside a host, then all-reduced across hosts; "
        "parameters gathered inside a host). Needs stage >= 1 or gemini; docs/zero.md.",
    )
    RENAMED: ClassVar[dict[str, str]] = {"bucket_mb": "chunk_mb"}

    def validate(self, path: str) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}stage={self.stage} is not a ZeRO stage; allowed: 0, 1, 2, 3")
        if self.chunk_mb <= 0:
            raise ConfigError(f"{path}chunk_mb={self.chunk_mb} must be positive")
        if self.offload_optimizer != "none" and self.stage == 0:  # also a layout rule: for sections checked alone
            raise ConfigError(f"{path}offload_optimizer={self.offload_optimizer!r} needs stage >= 1")


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = _field(
        "none",
        "none; full: a block keeps only its inputs and runs again in the backward; selective: a block keeps "
        "its matmul outputs and recomputes attention scores and elementwise ops.",
    )
    every: int = _field(1, "Checkpoint one block in every `every` (the first, then every `every`-th).")

    def validate(self, path: str) -> None:
        if self.every < 1:
            raise ConfigError(f"{path}every={self.every} must be at least 1")


@dataclass(frozen=True)
class CompileConfig:
    enabled: bool = _field(False, "Compile the model with torch.compile (docs/compile.md); false: eager.")
    scope: Literal["blocks", "model"] = _field(
        "blocks",
        "blocks: each repeated block compiled on its own, the strategies' hooks eager around it (every layout); "
        "model: the whole forward as one region (data parallelism, ZeRO 1-2, no pipeline).",
    )
    backend: Literal["inductor", "aot_eager", "eager"] = _field(
        "inductor",
        "inductor: generated kernels (needs a C++ compiler on CPU, triton on CUDA); aot_eager: the captured "
        "forward and backward graphs run by torch's kernels; eager: capture only.",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = _field(
        "default", "torch.compile's mode (inductor)."
    )
    fullgraph: bool = _field(False, "A graph break inside a compiled region is an error instead of a split.")
    dynamic: bool | None = _field(False, "torch.compile's dynamic shapes (None: after a shape changes).")
    loss: bool = _field(False, "Compile the loss function too.")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = _field(0, "Rank of the low-rank adapters (0: no adapters, the whole model trains).")
    alpha: float = _field(16.0, "The adapters' update is scaled by alpha / rank.")
    dropout: float = _field(0.0, "Dropout on the adapters' input.")
    targets: list[str] = _field_factory(
        lambda: ["all-linear"],
        'Linear layers to adapt, by name or name suffix ("q_proj"); "all-linear": all but the output head.',
    )
    modules_to_save: list[str] = _field_factory(list, "Modules trained whole beside the adapters (a new head).")
    init: Literal["default", "gaussian", "zeros"] = _field(
        "default", "default: A as nn.Linear initialises, B zero (PEFT's); gaussian: A normal(1/rank), B zero."
    )
    quantize: Literal["none", "int8", "nf4"] = _field(
        "none", "Keep the adapted layers' frozen weights quantized: int8 per output channel, or NF4 in blocks of 64."
    )
    double_quant: bool = _field(False, "NF4: quantize the blocks' absmax scales too (int8, groups of 256).")

    def validate(self, path: str) -> None:
        if self.rank < 0:
            raise ConfigError(f"{path}rank={self.rank} must be >= 0 (0: no adapters)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{path}dropout={self.dropout} must be within [0, 1)")
        if self.quantize != "none" and not self.rank:
            raise ConfigError(f"{path}quantize={self.quantize!r} quantizes an adapted base: set {path}rank too")
        if self.rank and not self.targets:
            raise ConfigError(f"{path}targets is empty: name the layers to adapt, or 'all-linear'")


_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(value: int | float | str | None, key: str) -> int | None:
    """A size in bytes from an int or a string such as ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        text = str(value).strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        number_text, unit = digits, text[len(digits) :]
        try:
            number = float(number_text)
        except ValueError:
            number, unit = -1.0, "?"
    if unit not in _BYTE_UNITS or number <= 0:
        raise ConfigError(f"{key}={value!r} is not a size: give bytes (an int) or e.g. '2GiB', '512MiB', '1.5GB'")
    return int(number * _BYTE_UNITS[unit])


@dataclass(frozen=True)
class GeminiConfig:
    enabled: bool | None = _field(
        None,
        "Manage model state in chunks placed on device, host memory or disk (ZeRO-3 over the data axis); "
        "None: on when any other gemini key is set.",
    )
    placement: Literal["static", "auto"] = _field(
        "auto",
        "static: fixed shares of chunks off the device (params_offload, optimizer_offload); auto: placed and "
        "evicted from the warm-up trace (the part needed furthest ahead leaves first).",
    )
    device_budget: int | str | None = _field(
        None, "Device bytes for model state (and, with auto, activations), e.g. '2GiB'; None: unbounded."
    )
    host_budget: int | str | None = _field(None, "Host-memory bytes for model state, e.g. '8GiB'; None: unbounded.")
    offload_dir: str | None = _field(None, "Folder of the disk tier; None: no disk tier.")
    chunk_mb: float | None = _field(None, "Chunk capacity in MiB; None: searched for the least waste.")
    params_offload: float = _field(0.0, "static: share of parameter chunks kept off the device.")
    optimizer_offload: float = _field(
        0.0, "static: share of optimizer chunks (fp32 masters, states, gradients) kept off the device."
    )
    map_large_buffers: bool | None = _field(
        None,
        "Map every allocation of 256 KiB or more on its own, so freed memory leaves the process at once (glibc, "
        "process-wide): the resident set follows the budgets, new activations cost page faults. None: on with a "
        "host_budget.",
    )
    frozen_tier: Literal["auto", "device", "host", "disk"] = _field(
        "auto",
        "Where the shards of frozen weights (a LoRA adapter's base) live between uses: auto (placed as parameters "
        "are), device, host, or disk (read for each use; needs offload_dir).",
    )

    @property
    def active(self) -> bool:
        """Whether the run uses Gemini: ``enabled``, or, when it is None, any other key set."""
        if self.enabled is not None:
            return self.enabled
        return any(getattr(self, f.name) != f.default for f in fields(self) if f.name != "enabled")

    def validate(self, path: str) -> None:
        if self.chunk_mb is not None and self.chunk_mb <= 0:
            raise ConfigError(f"{path}chunk_mb={self.chunk_mb} must be positive")
        for key in ("params_offload", "optimizer_offload"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{path}{key}={getattr(self, key)} must be within [0, 1]")
        parse_bytes(self.device_budget, f"{path}device_budget")
        parse_bytes(self.host_budget, f"{path}host_budget")
        if self.frozen_tier == "disk" and self.offload_dir is None:
            raise ConfigError(f"{path}frozen_tier='disk' needs the disk tier: give {path}offload_dir")


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
    nproc_per_node: int = _field(4, "Processes `tessera train` (and `tessera run --config`) starts on this machine.")

    def validate(self, path: str) -> None:
        if self.intra_op_threads < 0:
            raise ConfigError(f"{path}intra_op_threads={self.intra_op_threads} must be >= 0")
        if self.nproc_per_node < 1:
            raise ConfigError(f"{path}nproc_per_node={self.nproc_per_node} must be at least 1")


@dataclass(frozen=True)
class TrainerConfig:
    steps: int | None = _field(250, "Optimizer steps to train; None: `epochs` passes over the data.")
    epochs: int = _field(1, "Passes over the training data when `steps` is None.")
    log_every: int = _field(25, "Print metrics every this many steps (the JSONL file gets every step).")
    eval_every: int | None = _field(50, "Evaluate every this many steps; None: only at the end.")
    eval_batches: int | None = _field(10, "Micro-batches per rank in one evaluation; None: the whole test set.")
    checkpoint_every: int | None = _field(
        None,
        "Save a sharded checkpoint of the whole run (resumable, in any layout) to <run>/checkpoints/ every "
        "this many steps and at the end; None: none (the final weights go to model.safetensors either way).",
    )
    keep_last: int | None = _field(2, "Keep only the newest this many checkpoints; None: keep all.")
    resume: str | None = _field(
        None,
        "Continue from a checkpoint: a checkpoint folder's path, 'latest' (the newest in <run>/checkpoints/, "
        "which must exist) or 'auto' (the newest there if any: for restarted jobs). `tessera train --resume`.",
    )
    output_dir: str = _field("runs", "Folder under which each run writes its own folder.")
    progress_bar: bool | Literal["auto"] = _field(
        "auto", "A progress bar on rank 0: 'auto' only when stderr is a terminal (not in a log file), true, false."
    )

    def validate(self, path: str) -> None:
        for name in ("steps", "eval_every", "eval_batches", "checkpoint_every", "keep_last"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{path}{name}={value} must be at least 1")
        if self.epochs < 1 or self.log_every < 1:
            raise ConfigError(f"{path}epochs and log_every must be at least 1")


HF_PREFIX = "hf:"  # model.name = "hf:PATH": a Hugging Face causal language model


@dataclass(frozen=True)
class ModelConfig:
    name: str = _field(
        "gpt",
        "'gpt': the reference GPT (tessera.models); 'hf:PATH': a Hugging Face causal LM, from a local folder "
        "(config.json and safetensors weights: fine-tuned) or a config.json alone (random weights); "
        "`tessera train --model hf:PATH` (docs/hf.md).",
    )
    preset: str = _field(
        "tiny",
        "gpt: size preset: tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; tiny-moe, small-moe (docs/moe.md).",
    )
    options: dict[str, Any] = _field_factory(
        dict,
        "Overrides of the preset's fields, e.g. dict(dropout=0.1); for hf:, of the model's config.json fields, "
        "e.g. dict(attention_dropout=0.1).",
    )
    deferred: bool = _field(
        True,
        "Build the model under tessera.deferred_init(): each rank makes only what it keeps (same values); an hf: "
        "folder's weights are read so either way.",
    )
    init: str = _field(
        "random",
        "Initial weights: 'random' (seeded; for an hf: folder with weights, the folder's), or a checkpoint folder "
        "or .safetensors file.",
    )

    @property
    def hf_path(self) -> str | None:
        """The PATH of ``name = "hf:PATH"``; None for tessera's own models."""
        return self.name[len(HF_PREFIX) :] if self.name.startswith(HF_PREFIX) else None

    def validate(self, path: str) -> None:
        if self.name != "gpt" and not self.name.startswith(HF_PREFIX):
            raise ConfigError(
                f"{path}name={self.name!r} is not a model tessera train builds; allowed: 'gpt' (the reference GPT) "
                f"or '{HF_PREFIX}PATH' (a Hugging Face causal LM: a local folder or its config.json)"
            )
        if self.hf_path is not None and not self.hf_path.strip():
            raise ConfigError(
                f"{path}name={self.name!r} names no path: give '{HF_PREFIX}PATH', PATH a local folder with "
                "config.json (and safetensors weights to fine-tune) or a config.json file"
            )


@dataclass(frozen=True)
class DataConfig:
    name: Literal["python_bytes", "text_files"] = _field(
        "python_bytes",
        "python_bytes: the Python standard library's source (no download); text_files: the files in `files`. "
        "Read as bytes (the GPT's tokens), or tokenized by an hf: model's tokenizer when its folder has one.",
    )
    files: list[str] = _field_factory(
        list,
        "text_files: the text files, or folders (their files, recursively, in path order, hidden ones skipped), "
        "joined by a newline; `tessera train --data PATH`.",
    )
    seq_len: int | None = _field(
        None, "Tokens per sample; None: the model's max_seq_len (hf: its max_position_embeddings, at most 1024)."
    )
    micro_batch_size: int = _field(16, "Samples per rank per micro-step (global batch = this x data x accumulation).")
    global_batch_size: int | None = _field(
        None,
        "Samples per optimizer step over all data ranks; set, it decides gradient_accumulation (a pipeline's "
        "micro-batches) on whatever world the job gets, so an elastic job restarted on fewer ranks keeps its "
        "global batch. None: micro_batch_size x data ranks x gradient_accumulation.",
    )
    max_bytes: int = _field(4 * 2**20, "Bytes of corpus to read.")
    eval_fraction: float = _field(0.05, "Share of the corpus (its end) held out for evaluation.")
    shuffle: bool = _field(True, "Shuffle the training samples each epoch (the same order on every rank).")

    def validate(self, path: str) -> None:
        if self.name == "text_files" and not self.files:
            raise ConfigError(f"{path}name='text_files' needs {path}files: the text files or folders to read")
        if self.name != "text_files" and self.files:
            raise ConfigError(f"{path}files is read only with {path}name='text_files' (name is {self.name!r})")
        if self.seq_len is not None and self.seq_len < 1:
            raise ConfigError(f"{path}seq_len={self.seq_len} must be at least 1")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"{path}global_batch_size={self.global_batch_size} must be at least 1 (or None)")
        if self.micro_batch_size < 1 or self.max_bytes < 1:
            raise ConfigError(f"{path}micro_batch_size and max_bytes must be at least 1")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"{path}eval_fraction={self.eval_fraction} must be within (0, 1)")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "adam", "sgd", "lamb", "lars"] = _field(
        "adamw", "Optimizer (lamb and lars: tessera.optim, for large batches)."
    )
    lr: float = _field(2e-3, "Peak learning rate.")
    weight_decay: float = _field(0.1, "Weight decay (decoupled for adamw).")
    betas: list[float] = _field_factory(lambda: [0.9, 0.95], "Adam betas.")
    eps: float = _field(1e-8, "Adam epsilon.")
    momentum: float = _field(0.9, "SGD and LARS momentum.")
    trust_coefficient: float = _field(0.001, "LARS trust coefficient.")
    kernel: Literal["auto", "for-loop", "foreach", "fused"] = _field(
        "auto",
        "How an adam/adamw step runs: auto is torch's choice, or fused when compile.enabled (measured faster on "
        "CPU, docs/compile.md); for-loop, foreach or fused as asked.",
    )

    def validate(self, path: str) -> None:
        if self.lr <= 0:
            raise ConfigError(f"{path}lr={self.lr} must be positive")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"{path}betas={self.betas} must be two numbers within [0, 1)")
        if self.kernel not in ("auto", "for-loop") and self.name not in ("adam", "adamw"):
            raise ConfigError(f"{path}kernel={self.kernel!r} is for adam and adamw; {self.name} takes 'auto'")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = _field(20, "Linear warm-up steps from 0 to the peak learning rate.")
    decay: Literal["cosine", "linear", "constant"] = _field("cosine", "Decay after warm-up, down to min_lr_ratio x lr.")
    min_lr_ratio: float = _field(0.1, "Final learning rate as a share of the peak.")

    def validate(self, path: str) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"{path}warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"{path}min_lr_ratio={self.min_lr_ratio} must be within [0, 1]")


@dataclass(frozen=True)
class Config:
    """The whole configuration of a tessera run."""

    parallel: ParallelConfig = _section(
        ParallelConfig, 'The parallel layout ("auto": chosen by the planner at launch).'
    )
    zero: ZeroConfig = _section(ZeroConfig, "ZeRO sharding of optimizer states, gradients and parameters.")
    gemini: GeminiConfig = _section(GeminiConfig, "Chunk-based heterogeneous memory management.")
    activation_checkpoint: ActivationCheckpointConfig = _section(
        ActivationCheckpointConfig, "Activations recomputed in the backward pass instead of kept (tessera's blocks)."
    )
    mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig, "Mixed precision and loss scaling.")
    compile: CompileConfig = _section(CompileConfig, "Compiled training: torch.compile of the model's blocks.")
    lora: LoraConfig = _section(LoraConfig, "Low-rank adapters on a frozen base (tessera.lora; docs/lora.md).")
    gradient_accumulation: int = _field(1, "Micro-batches accumulated per optimizer step.")
    clip_grad_norm: float | None = _field(None, "Clip gradients to this global norm; None: no clipping.")
    seed: int = _field(42, "Base random seed (every rank and axis stream derives from it).")
    comm: CommConfig = _section(CommConfig, "Communication and its watchdog.")
    launch: LaunchConfig = _section(LaunchConfig, "Process-group backend and threads.")
    trainer: TrainerConfig = _section(TrainerConfig, "The Trainer's loop, logging and checkpoints.")
    model: ModelConfig = _section(ModelConfig, "The model `tessera train` builds.")
    data: DataConfig = _section(DataConfig, "The data `tessera train` reads.")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "The optimizer `tessera train` builds.")
    schedule: ScheduleConfig = _section(ScheduleConfig, "The learning-rate schedule of `tessera train`.")
    planner: PlannerConfig = _section(PlannerConfig, 'What the planner plans for when parallel = "auto".')

    def validate(self, path: str) -> None:
        if self.gradient_accumulation < 1:
            raise ConfigError(f"gradient_accumulation={self.gradient_accumulation} must be at least 1")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm} must be positive (or None)")
        check_combination(self.combination())  # how the strategies combine with the layout: tessera.context.rules

    def combination(self) -> Combination:
        """The layout and its strategy choices (ZeRO stage and offload, Gemini) as the layout rules read them."""
        return self.parallel.combination()._replace(
            zero=self.zero.stage,
            offload=self.zero.offload_optimizer != "none",
            gemini=self.gemini.active,
            host_shard=self.zero.shard == "host",
        )
