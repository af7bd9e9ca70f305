"""Training settings and memory sizes: the user's description of one training iteration."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from memplan.distributed.deepspeed_file import AUTOCAST_DTYPE_NAMES, AUTOCAST_SECTION, file_precision
from memplan.distributed.nccl import SIMPLE_BUFFER_BYTES, NcclConfig, communicator_band
from memplan.errors import SettingsError, SizeParseError
from memplan.estimator.cuda.allocator import AllocatorConfig, parse_alloc_conf
from memplan.gpus import CONTEXT_BYTES, DEFAULT_GPU, gpu_named

PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16")
# bitsandbytes' 4-bit data types (bnb_4bit_quant_type).
QUANT_TYPES = ("nf4", "fp4", "int8")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adam8bit", "paged-adam8bit", "none")
OPTIMIZER_IMPLS = ("default", "foreach", "for-loop", "fused")
# Training loops people write, each a different steady state (memplan.estimator.loop, docs/concepts.md).
LOOPS = ("canonical", "zero-grad-before-backward", "set-to-none-false", "hf-trainer", "keep-output")
CHECKPOINT_MODES = ("none", "all", "selective")
# The largest batch size (and accumulation count) memplan models: the batch search's own limit
# (memplan.estimator.search.MAX_BATCH_SIZE); beyond it tensor sizes overflow inside torch.
MAX_COUNT = 1 << 20  # "selective": every block, the selective policy
# How a checkpoint treats what its segment computes (memplan.estimator.checkpointing):
# "full" recomputes all of it in the backward; "selective" keeps the outputs of matmuls,
# convolutions and attention and recomputes the rest (torch's selective activation checkpointing).
CHECKPOINT_POLICIES = ("full", "selective")
DEVICES = ("cuda", "cpu")
# Data parallelism, per rank (memplan.distributed): "none" (one process), torch's DDP, DDP with the
# optimizer state sharded by torch's ZeroRedundancyOptimizer ("zero1"), or FSDP2's fully_shard
# resharding after the forward ("fsdp") or only after the backward ("fsdp-grad-op"), or hybrid: sharded
# within groups of --shard-size ranks and replicated across them ("hsdp"), or DeepSpeed's own ZeRO stage 2
# or 3 ("zero2", "zero3": memplan/distributed/deepspeed.py).
PARALLEL_MODES = ("none", "ddp", "zero1", "fsdp", "fsdp-grad-op", "hsdp", "zero2", "zero3")
DDP_MODES = ("ddp", "zero1")  # DistributedDataParallel wraps the model
# The modes with ranks, as messages list them: "ddp, zero1, ... or zero3".
_DATA_PARALLEL_MODES = f"{', '.join(PARALLEL_MODES[1:-1])} or {PARALLEL_MODES[-1]}"
FSDP_MODES = ("fsdp", "fsdp-grad-op", "hsdp")
RESHARDING_FSDP_MODES = ("fsdp", "hsdp")  # reshard_after_forward=True
# --offload: "params" is FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state on the
# host, the optimizer step run there) or, with zero3, DeepSpeed's offload_param beside its offload_optimizer;
# "optimizer" is DeepSpeed's offload_optimizer (the float32 master partition, its gradient and the optimizer
# state on the host, the step run there).
OFFLOAD_MODES = ("none", "optimizer", "params")
DEEPSPEED_STAGES = {"zero2": 2, "zero3": 3}  # DeepSpeed's engine wraps the model and the optimizer
DEEPSPEED_MODES = tuple(DEEPSPEED_STAGES)
# The --parallel mode of each ZeRO stage DeepSpeed runs: stage 1 is `zero1` with a --deepspeed file
# (without one, `zero1` is torch's ZeroRedundancyOptimizer; TrainingSettings.deepspeed_stage).
DEEPSPEED_MODE_OF_STAGE = {1: "zero1", **{stage: mode for mode, stage in DEEPSPEED_STAGES.items()}}
# FSDP2's MixedPrecisionPolicy param_dtype choices (reduce_dtype float32, as torchtitan's default).
FSDP_MIXED_PRECISIONS = ("bf16", "fp16")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

# Binary and decimal units; "GB" is 10**9 as disks and nvidia-smi's marketing sizes use it,
# "GiB" is 2**30 as torch.cuda reports it.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse `80GB`, `24GiB`, `512MiB`, `1.5 GiB` or plain bytes into a byte count."""
    if isinstance(text, int):
        if text <= 0:
            raise SizeParseError(f"size must be positive, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeParseError(f"cannot read {text!r} as a size; write e.g. 24GiB, 80GB, 512MiB or a number of bytes")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise SizeParseError(f"size must be at least one byte, got {text!r}")
    return int(value)


def format_bytes(num_bytes: float) -> str:
    """Binary units, as torch.cuda and memory_viz print them."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:,.0f} {unit}" if unit == "B" else f"{sign}{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _options_given(*options: tuple[str, Any, Any]) -> list[str]:
    """The names of the (name, value, default) options whose value is not their default."""
    return [name for name, value, default in options if value != default]


def parse_deepspeed_config(text: str) -> dict[str, Any]:
    """A DeepSpeed configuration's JSON text, as the object DeepSpeed takes; one line where it is not one."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise SettingsError(f"the DeepSpeed configuration is not JSON ({error})") from error
    if not isinstance(config, dict):
        raise SettingsError(
            f"the DeepSpeed configuration holds a JSON {type(config).__name__}, not an object as ds_config.json does"
        )
    return config


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise SettingsError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CheckpointLayout:
    """Which modules a training run checkpoints (non-reentrant `torch.utils.checkpoint`).

    Each segment is a run of consecutive sibling modules (blocks of one `nn.ModuleList`) wrapped
    in one checkpoint, which keeps only the first block's inputs; a segment of one module is
    ordinary per-module checkpointing. `policies` gives each segment's CHECKPOINT_POLICIES entry
    (all "full" when left empty).
    """

    segments: tuple[tuple[str, ...], ...] = ()
    policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.policies:
            object.__setattr__(self, "policies", ("full",) * len(self.segments))
        if len(self.policies) != len(self.segments):
            raise SettingsError(
                f"a checkpoint layout needs one policy per segment: {len(self.segments)} segment(s), "
                f"{len(self.policies)} policies"
            )
        for policy in self.policies:
            _check_choice("checkpoint policy", policy, CHECKPOINT_POLICIES)
        names = list(self.modules)
        if any(not segment for segment in self.segments):
            raise SettingsError("a checkpoint segment must name at least one module")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise SettingsError(f"modules checkpointed twice in one layout: {', '.join(repeated)}")

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(name for segment in self.segments for name in segment)

    def describe(self) -> str:
        selective = self.policies.count("selective")
        policy = f" ({selective} selective)" if selective else ""
        if selective and selective == len(self.segments):
            policy = " (selective)"
        return f"{len(self.segments)} checkpoint(s) over {len(self.modules)} module(s){policy}"

    def to_dict(self) -> dict[str, list]:
        return {"segments": [list(segment) for segment in self.segments], "policies": list(self.policies)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointLayout:
        return cls(
            segments=tuple(tuple(segment) for segment in data.get("segments", ())),
            policies=tuple(data.get("policies", ())),
        )


@dataclass(frozen=True)
class TrainingSettings:
    """One steady-state iteration of the canonical loop (see docs/concepts.md).

    `seq_len`, `target_len` and `image_size` are None where the model source decides (its
    default or maximum); `optimizer_impl` "default" means what torch picks on `device`.
    """

    batch_size: int = 1
    seq_len: int | None = None
    target_len: int | None = None
    image_size: int | None = None
    grad_accum: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_impl: str = "default"
    checkpoint: str | CheckpointLayout = "none"  # "none", "all" (every repeated block) or a layout
    device: str = "cuda"
    gpu: str | None = None  # cuda: the card whose kernels are emulated (memplan.gpus); None = H100
    attn_impl: str = "sdpa"  # transformers' attn_implementation
    loop: str = "canonical"  # one of LOOPS: where zero_grad runs, what stays alive (memplan.estimator.loop)
    cuda_context: int | None = None  # bytes nvidia-smi shows beyond reserved; None = memplan.gpus.CONTEXT_BYTES
    # The CUDA libraries as the run configures them (memplan.estimator.cuda.cudnn, .cublas, docs/concepts.md):
    cudnn_benchmark: bool = False  # torch.backends.cudnn.benchmark
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) (and cudnn.deterministic)
    cudnn_allow_tf32: bool = True  # torch.backends.cudnn.allow_tf32
    cudnn_workspace_cap_mib: int | None = None  # CUDNN_CONV_WSCAP_DBG
    cublas_workspace_config: str | None = None  # CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8"
    cuda_alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF, e.g. "expandable_segments:True"
    # LoRA adapters added with peft (memplan.finetune.lora); None: the model is trained as built.
    lora_rank: int | None = None  # peft LoraConfig r
    lora_alpha: float | None = None  # lora_alpha; None: peft's default
    lora_targets: str | None = None  # comma-separated target_modules; None: peft's default for the architecture
    lora_dropout: float = 0.0  # lora_dropout
    # QLoRA: the base model's linear layers in bitsandbytes' 4-bit layout (memplan.finetune.quantize);
    # None: the base weights stay in the precision's dtype.
    quantize: str | None = None  # one of QUANT_TYPES: bnb_4bit_quant_type, or int8 (load_in_8bit)
    kbit_upcast: bool = True  # peft's prepare_model_for_kbit_training casts the 16-bit rest to float32
    # The user's own training iteration, `package.module:function` called as fn(model, batch,
    # optimizer) in place of the canonical loop (memplan.estimator.loop.custom_step); None: the loop.
    step: str | None = None
    # Data parallelism (memplan.distributed): the figures are one rank's; batch settings are per rank.
    parallel: str = "none"  # one of PARALLEL_MODES
    world_size: int = 1  # data-parallel ranks
    # DistributedDataParallel(gradient_as_bucket_view=...): gradients are views into DDP's buckets.
    ddp_bucket_view: bool = False
    # FSDP2's MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32): float32 shards,
    # gathered and computed in this dtype ("bf16" or "fp16"), gradients reduced in float32; None: off.
    fsdp_mixed_precision: str | None = None
    # With hsdp: the ranks each shard group spans (FSDP2 on a 2-D DeviceMesh of world_size / shard_size
    # replicas by shard_size shards); a divisor of world_size.
    shard_size: int | None = None
    # With fsdp, fsdp-grad-op or hsdp: "params" offloads the shards, their gradients and the optimizer
    # state to host memory (FSDP2's CPUOffloadPolicy; memplan.distributed.offload); one of OFFLOAD_MODES.
    offload: str = "none"
    # With zero2/zero3: the user's DeepSpeed configuration (`--deepspeed ds_config.json`) as JSON text,
    # whose zero_optimization section DeepSpeed applies; None: DeepSpeed's defaults.
    deepspeed_config: str | None = None
    # Bytes NCCL's communicator holds on the rank, outside torch's allocator (what nvidia-smi shows of it);
    # None: the top of memplan's modelled band (memplan.distributed.nccl), with --parallel on cuda.
    nccl_memory: int | None = None
    # The NCCL variables that size its buffers (memplan.distributed.nccl.NcclConfig): NCCL_BUFFSIZE,
    # NCCL_MAX_CTAS (or NCCL_MAX_NCHANNELS), NCCL_NVLS_ENABLE; None / True: NCCL's defaults.
    nccl_buffsize: int | None = None
    nccl_max_ctas: int | None = None
    nccl_nvls: bool = True

    def __post_init__(self) -> None:
        _check_positive("batch size", self.batch_size)
        _check_positive("gradient accumulation steps", self.grad_accum)
        for name, value in (("batch size", self.batch_size), ("gradient accumulation steps", self.grad_accum)):
            if value > MAX_COUNT:
                raise SettingsError(f"{name} {value:,} is beyond what memplan models (at most {MAX_COUNT:,})")
        _check_positive("sequence length", self.seq_len)
        _check_positive("target length", self.target_len)
        _check_positive("image size", self.image_size)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("optimizer implementation", self.optimizer_impl, OPTIMIZER_IMPLS)
        if not isinstance(self.checkpoint, CheckpointLayout):
            _check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention implementation", self.attn_impl, ATTENTION_IMPLEMENTATIONS)
        _check_choice("loop", self.loop, LOOPS)
        if self.cuda_context is not None:
            if self.device != "cuda":
                raise SettingsError("--cuda-context is the CUDA context of a GPU; it has no meaning with --device cpu")
            if self.cuda_context < 0:
                raise SettingsError(f"CUDA context must be 0 or more bytes, got {self.cuda_context}")
        self._check_cuda_libraries()
        self._check_lora()
        self._check_quantize()
        self._check_parallel()
        self._check_step()
        if self.gpu is not None:
            if self.device != "cuda":
                raise SettingsError(
                    "--gpu names the CUDA card whose kernels and memory are modelled; it has no meaning with "
                    "--device cpu: drop --gpu (estimate, plan and sweep take a memory limit as --budget)"
                )
            object.__setattr__(self, "gpu", gpu_named(self.gpu).name)  # canonical name
        if self.optimizer_impl != "default" and self.optimizer in ("adam8bit", "paged-adam8bit", "none"):
            runs = "no optimizer" if self.optimizer == "none" else "bitsandbytes' own kernel"
            raise SettingsError(
                f"--optimizer-impl {self.optimizer_impl} chooses among torch's implementations, and --optimizer "
                f"{self.optimizer} runs {runs}: leave --optimizer-impl out"
            )
        if self.optimizer_impl == "fused" and self.optimizer not in ("adamw", "adam", "sgd", "sgd-momentum"):
            raise SettingsError(
                f"torch has no fused implementation of {self.optimizer}; "
                "use --optimizer-impl default, foreach or for-loop"
            )

    def _check_cuda_libraries(self) -> None:
        from memplan.estimator.cuda.cublas import config_bytes

        given = _options_given(
            ("--cudnn-benchmark", self.cudnn_benchmark, False),
            ("--no-cudnn-tf32", self.cudnn_allow_tf32, True),
            ("--cudnn-workspace-cap (CUDNN_CONV_WSCAP_DBG)", self.cudnn_workspace_cap_mib, None),
            ("--cublas-workspace-config (CUBLAS_WORKSPACE_CONFIG)", self.cublas_workspace_config, None),
            ("--cuda-alloc-conf (PYTORCH_CUDA_ALLOC_CONF)", self.cuda_alloc_conf, None),
        )
        if given and self.device != "cuda":
            raise SettingsError(f"{given[0]} configures a CUDA library; it has no meaning with --device cpu")
        cap = self.cudnn_workspace_cap_mib
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise SettingsError(f"the cuDNN workspace cap is a number of MiB, 0 or more; got {cap!r}")
        if self.cuda_alloc_conf is not None:
            try:
                parse_alloc_conf(self.cuda_alloc_conf)
            except ValueError as error:
                raise SettingsError(f"cannot read PYTORCH_CUDA_ALLOC_CONF {self.cuda_alloc_conf!r}: {error}") from None
        config = self.cublas_workspace_config
        if config is not None and config_bytes(config) is None:
            raise SettingsError(
                f"cannot read CUBLAS_WORKSPACE_CONFIG {config!r}: it is :SIZE:COUNT pairs in KiB, e.g. :4096:8 or :16:8"
            )

    def _check_step(self) -> None:
        if self.step is None:
            return
        from memplan.models.imports import is_import_path

        if not isinstance(self.step, str) or not is_import_path(self.step):
            raise SettingsError(f"--step {self.step!r} must name a function as package.module:function")
        if self.loop != "canonical":
            raise SettingsError("--step runs your own iteration in place of the loop; leave out --loop")
        if self.grad_accum != 1:
            raise SettingsError(
                "--step runs your whole iteration: accumulate inside your function and leave --grad-accum at 1"
            )
        if self.is_amp:
            raise SettingsError(
                f"--precision {self.precision} with --step: memplan does not emulate an autocast your function "
                "opens; use fp32, bf16 or fp16 storage with --step, or the canonical loop for autocast"
            )

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            given = [
                flag
                for flag, value, default in (
                    ("--lora-alpha", self.lora_alpha, None),
                    ("--lora-targets", self.lora_targets, None),
                    ("--lora-dropout", self.lora_dropout, 0.0),
                )
                if value != default
            ]
            if given:
                raise SettingsError(f"{given[0]} configures LoRA adapters: give their rank with --lora RANK")
            return
        _check_positive("LoRA rank", self.lora_rank)
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise SettingsError(f"--lora-alpha must be more than 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise SettingsError(f"--lora-dropout is a probability below 1, got {self.lora_dropout}")
        names = [name.strip() for name in self.lora_targets.split(",")] if self.lora_targets is not None else []
        if self.lora_targets is not None and not any(names):
            raise SettingsError("--lora-targets names no module: give names such as q_proj,v_proj")
        if not all(names):  # a slip (q_proj,,v_proj) that the header would print as given
            raise SettingsError(
                f"--lora-targets {self.lora_targets} has an empty name between its commas: give names such as "
                "q_proj,v_proj"
            )

    def _check_parallel(self) -> None:
        _check_choice("parallel mode", self.parallel, PARALLEL_MODES)
        _check_positive("world size", self.world_size)
        if self.world_size > MAX_COUNT:
            raise SettingsError(f"world size {self.world_size:,} is beyond what memplan models (at most {MAX_COUNT:,})")
        if self.ddp_bucket_view and self.parallel not in DDP_MODES:
            raise SettingsError("--ddp-bucket-view is an option of DDP: give --parallel ddp or zero1")
        if self.parallel == "zero1" and self.optimizer == "none":
            raise SettingsError(
                "--parallel zero1 shards the optimizer's state, and --optimizer none has none: give one"
            )
        self._check_shard_size()
        self._check_offload()
        if self.fsdp_mixed_precision is not None:
            _check_choice("FSDP2 mixed precision", self.fsdp_mixed_precision, FSDP_MIXED_PRECISIONS)
            if self.parallel not in FSDP_MODES:
                raise SettingsError(
                    "--fsdp-mixed-precision is FSDP2's policy: give --parallel fsdp, fsdp-grad-op or hsdp"
                )
            if self.precision in ("bf16", "fp16"):
                raise SettingsError(
                    f"--fsdp-mixed-precision casts float32 parameters, and --precision {self.precision} stores them in "
                    f"{self.precision}: give --precision fp32 (or amp-bf16, amp-fp16) with it"
                )
        self._check_deepspeed()
        if self.parallel in FSDP_MODES and self.optimizer == "adafactor":
            # torch 2.13's Adafactor on FSDP2's DTensors: "aten.pow_.Scalar: in-place operations that require
            # placement changes are not supported" (its row/column norms are Partial), in a real run as in a trace.
            raise SettingsError(
                f"--parallel {self.parallel} with --optimizer adafactor: torch's Adafactor does not run on FSDP2's "
                "sharded parameters (an in-place op on a partial DTensor); use adamw, adam, sgd or adam8bit"
            )
        if self.parallel in FSDP_MODES and self.quantize is not None:
            raise SettingsError(
                f"--parallel {self.parallel} with --quantize: FSDP2 over bitsandbytes' quantized layers is not traced "
                "yet; leave out one of them"
            )
        self._check_nccl()
        if self.parallel == "none" and self.world_size != 1:
            raise SettingsError(
                f"--world-size {self.world_size} counts data-parallel ranks: give --parallel {_DATA_PARALLEL_MODES}, "
                "or leave it out"
            )

    def _check_shard_size(self) -> None:
        if self.shard_size is not None and self.parallel != "hsdp":
            raise SettingsError("--shard-size is HSDP's: give --parallel hsdp with it")
        if self.parallel != "hsdp":
            return
        if self.shard_size is None:
            raise SettingsError(
                "--parallel hsdp shards within groups of ranks and replicates across them: give --shard-size S, "
                "the ranks each group spans (a divisor of --world-size; 8 for one node of 8 GPUs)"
            )
        _check_positive("shard size", self.shard_size)
        if self.world_size % self.shard_size:
            raise SettingsError(
                f"--shard-size {self.shard_size} does not divide --world-size {self.world_size}: HSDP runs "
                "world-size / shard-size replicas of one shard group"
            )

    def _check_offload(self) -> None:
        _check_choice("offload", self.offload, OFFLOAD_MODES)
        if self.offload == "none":
            return
        if self.deepspeed_stage is not None:
            if self.offload == "params" and self.deepspeed_stage != 3:
                raise SettingsError(
                    f"--offload params with --parallel {self.parallel}: DeepSpeed offloads parameters at stage 3 "
                    "(offload_param): give --parallel zero3, or --offload optimizer"
                )
            return
        if self.parallel not in FSDP_MODES:
            raise SettingsError(
                "--offload moves sharded state to host memory: give --parallel fsdp, fsdp-grad-op or hsdp "
                "(--offload params), or zero2, zero3, or zero1 with a --deepspeed file (--offload optimizer) with it"
            )
        if self.offload == "optimizer":
            raise SettingsError(
                "FSDP2 offloads the parameters, their gradients and the optimizer state together "
                "(CPUOffloadPolicy): give --offload params"
            )
        if self.step is not None:
            raise SettingsError("--offload with --step is not traced yet: leave out one of them")

    @property
    def deepspeed_offloads_parameters(self) -> bool:
        """Whether a ZeRO-3 rank keeps its parameter partitions on the host: DeepSpeed's offload_param (--offload
        params, or device "cpu" in the --deepspeed file)."""
        return self.deepspeed_stage == 3 and (self.offload == "params" or self._file_offloads("offload_param"))

    @property
    def offloads_to_host(self) -> bool:
        """Whether the rank keeps state in host memory and steps there: FSDP2's CPU offload (--offload params),
        or DeepSpeed's offload_optimizer (--offload optimizer, or device "cpu" in the --deepspeed file)."""
        if self.offload != "none":
            return True
        return self.deepspeed_stage is not None and self._file_offloads("offload_optimizer")

    def _file_offloads(self, section: str) -> bool:
        """Whether the --deepspeed file's zero_optimization `section` puts its state on the host."""
        zero = self.deepspeed_settings.get("zero_optimization") or {}
        return (zero.get(section) or {}).get("device") == "cpu"

    @property
    def deepspeed_stage(self) -> int | None:
        """The ZeRO stage of the DeepSpeed rank traced, or None: zero2 and zero3 are DeepSpeed's, and zero1
        is DeepSpeed's stage 1 where a --deepspeed file is given (torch's ZeroRedundancyOptimizer otherwise)."""
        if self.parallel in DEEPSPEED_STAGES:
            return DEEPSPEED_STAGES[self.parallel]
        return 1 if self.parallel == "zero1" and self.deepspeed_config is not None else None

    def _check_deepspeed(self) -> None:
        if self.deepspeed_config is not None and self.parallel not in (*DEEPSPEED_MODES, "zero1"):
            raise SettingsError(
                "--deepspeed (or a deepspeed entry in --hf-args) configures DeepSpeed's ZeRO: give --parallel zero1, "
                "zero2 or zero3 with it"
            )
        traced = self.deepspeed_stage
        if traced is None:
            return
        option = f"--parallel {self.parallel}"
        if self.deepspeed_config is not None:
            stage = (self.deepspeed_settings.get("zero_optimization") or {}).get("stage")
            if stage not in (None, traced):
                mode = DEEPSPEED_MODE_OF_STAGE.get(stage)
                instead = f"give --parallel {mode}" if mode else "memplan traces stages 1 to 3"
                raise SettingsError(f"--deepspeed sets ZeRO stage {stage}; {option} traces stage {traced}: {instead}")
        if self.optimizer == "none":
            raise SettingsError(f"{option} partitions the optimizer's state, and --optimizer none has none: give one")
        self._check_file_precision()
        unsupported = _options_given(
            ("--step", self.step, None),
            ("--quantize", self.quantize, None),
            ("--loop", self.loop, "canonical"),
        )
        if unsupported:
            raise SettingsError(
                f"{option} with {unsupported[0]}: DeepSpeed runs its own loop (engine.backward, engine.step), and "
                "memplan traces it as accelerate runs it (the canonical loop), unquantized; leave it out"
            )

    def _check_file_precision(self) -> None:
        """The precision a DeepSpeed configuration enables outright must be --precision's, as the Trainer stops on
        a file that mismatches its arguments (memplan.distributed.deepspeed_file)."""
        enabled = file_precision(self.deepspeed_settings)
        if enabled is not None and enabled != self.precision:
            if enabled.startswith("amp-"):
                # transformers fills bf16's and fp16's "auto" from its arguments, not torch_autocast's, which
                # DeepSpeed would read as enabled: the file itself must say what the job runs.
                raise SettingsError(
                    f"the DeepSpeed configuration enables {AUTOCAST_SECTION} in {AUTOCAST_DTYPE_NAMES[enabled]}, and "
                    f"--precision is {self.precision}: give --precision {enabled}, or change the file's "
                    f'{AUTOCAST_SECTION} section (its dtype, or "enabled": false) to what the job runs'
                )
            raise SettingsError(
                f"the DeepSpeed configuration enables {enabled}, and --precision is {self.precision}: give --precision "
                f'{enabled}, or set "enabled" in the file\'s {enabled} section to "auto" to take --precision\'s'
            )

    @property
    def deepspeed_settings(self) -> dict[str, Any]:
        """deepspeed_config as the object DeepSpeed takes ({} without one)."""
        return parse_deepspeed_config(self.deepspeed_config) if self.deepspeed_config is not None else {}

    def _check_nccl(self) -> None:
        given = _options_given(
            ("--nccl-memory", self.nccl_memory, None),
            ("--nccl-buffsize (NCCL_BUFFSIZE)", self.nccl_buffsize, None),
            ("--nccl-max-ctas (NCCL_MAX_CTAS)", self.nccl_max_ctas, None),
            ("--no-nccl-nvls (NCCL_NVLS_ENABLE=0)", self.nccl_nvls, True),
        )
        if given and (self.parallel == "none" or self.device != "cuda"):
            raise SettingsError(
                f"{given[0]} sizes what NCCL holds on one GPU of a data-parallel job: give --parallel "
                f"{_DATA_PARALLEL_MODES} on the cuda target"
            )
        if self.nccl_memory is not None and self.nccl_memory < 0:
            raise SettingsError(f"NCCL memory must be 0 or more bytes, got {self.nccl_memory}")
        _check_positive("NCCL buffer size (NCCL_BUFFSIZE)", self.nccl_buffsize)
        _check_positive("NCCL channel cap (NCCL_MAX_CTAS)", self.nccl_max_ctas)

    def _check_quantize(self) -> None:
        if self.quantize is None:
            if not self.kbit_upcast:
                raise SettingsError("--no-kbit-upcast configures a quantized model: give --quantize nf4, fp4 or int8")
            return
        _check_choice("quantization", self.quantize, QUANT_TYPES)
        if self.lora_rank is None:
            raise SettingsError(
                "--quantize freezes the base weights in 4 or 8 bits; train adapters on them with --lora RANK (QLoRA)"
            )

    @functools.cached_property
    def allocator_config(self) -> AllocatorConfig:
        """The caching allocator's configuration memplan simulates (memplan.estimator.cuda.allocator)."""
        return AllocatorConfig() if self.cuda_alloc_conf is None else parse_alloc_conf(self.cuda_alloc_conf)[0]

    @property
    def context_bytes(self) -> int:
        """The CUDA context counted in device-level figures and taken off a GPU's memory for budgets."""
        return CONTEXT_BYTES if self.cuda_context is None else self.cuda_context

    @property
    def communicator_band_bytes(self) -> tuple[int, int] | None:
        """The least and most device memory NCCL's communicator holds on this rank, outside torch's
        allocator: --nccl-memory where given, else memplan's model (memplan.distributed.nccl); None
        without data parallelism or off cuda (no communicator)."""
        if self.parallel == "none" or self.device != "cuda":
            return None
        if self.nccl_memory is not None:
            return self.nccl_memory, self.nccl_memory
        config = NcclConfig(self.nccl_buffsize or SIMPLE_BUFFER_BYTES, self.nccl_max_ctas, self.nccl_nvls)
        return communicator_band(self.world_size, gpu_named(self.gpu or DEFAULT_GPU).compute_capability, config)

    @property
    def outside_allocator_bytes(self) -> int:
        """What nvidia-smi shows beyond torch's reserved memory: the CUDA context and, on a data-parallel
        rank, the top of NCCL's band. Counted in the device figure and taken off a GPU's memory for fits."""
        band = self.communicator_band_bytes
        return self.context_bytes + (band[1] if band is not None else 0)

    @property
    def is_amp(self) -> bool:
        return self.precision.startswith("amp-")

    def replace(self, **changes: Any) -> TrainingSettings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(self.checkpoint, CheckpointLayout):
            data["checkpoint"] = self.checkpoint.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingSettings:
        """The inverse of to_dict; unknown keys are an error, missing ones take their defaults."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise SettingsError(f"unknown setting(s) {', '.join(sorted(unknown))}")
        checkpoint = data.get("checkpoint", "none")
        if isinstance(checkpoint, dict):
            data = {**data, "checkpoint": CheckpointLayout.from_dict(checkpoint)}
        return cls(**data)
