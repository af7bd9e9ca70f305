"""Training settings: the user's description of one training iteration.

What they are checked against lives beside them: the choices' checks (memplan.choices), checkpoint
layouts (memplan.checkpoint_layout), the data-parallel settings' checks (memplan.distributed.settings_checks);
sizes are read and printed by memplan.sizes."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from memplan.checkpoint_layout import CheckpointLayout
from memplan.choices import MAX_COUNT, check_choice, check_positive, options_given
from memplan.distributed.deepspeed_file import parse_deepspeed_config
from memplan.distributed.modes import DEEPSPEED_STAGES
from memplan.distributed.nccl import SIMPLE_BUFFER_BYTES, NcclConfig, communicator_band
from memplan.distributed.settings_checks import check_parallel
from memplan.errors import SettingsError
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
DEVICES = ("cuda", "cpu")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


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
    # The hf-trainer loop's TrainingArguments.label_smoothing_factor: where not 0, the Trainer computes the loss
    # with transformers' LabelSmoother from the model's logits (memplan.estimator.trainer_loss).
    label_smoothing: float = 0.0
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
    # optimizer) in place of the canonical loop (memplan.estimator.user_step.custom_step); None: the loop.
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

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingSettings:
        # A misspelt keyword is a settings mistake, said as memplan says it (the dataclass's __init__ would raise
        # a bare TypeError: "got an unexpected keyword argument").
        cls.refuse_unknown(kwargs)
        return super().__new__(cls)

    @classmethod
    def refuse_unknown(cls, names: Iterable[str]) -> None:
        """A SettingsError naming the known settings where `names` holds others."""
        unknown = set(names) - set(cls.__dataclass_fields__)
        if unknown:
            raise SettingsError(
                f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(cls.__dataclass_fields__)}"
            )

    def __post_init__(self) -> None:
        check_positive("batch size", self.batch_size)
        check_positive("gradient accumulation steps", self.grad_accum)
        for name, value in (("batch size", self.batch_size), ("gradient accumulation steps", self.grad_accum)):
            if value > MAX_COUNT:
                raise SettingsError(f"{name} {value:,} is beyond what memplan models (at most {MAX_COUNT:,})")
        check_positive("sequence length", self.seq_len)
        check_positive("target length", self.target_len)
        check_positive("image size", self.image_size)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("optimizer implementation", self.optimizer_impl, OPTIMIZER_IMPLS)
        if not isinstance(self.checkpoint, CheckpointLayout):
            check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        check_choice("device", self.device, DEVICES)
        check_choice("attention implementation", self.attn_impl, ATTENTION_IMPLEMENTATIONS)
        check_choice("loop", self.loop, LOOPS)
        self._check_label_smoothing()
        if self.cuda_context is not None:
            if self.device != "cuda":
                raise SettingsError("--cuda-context is the CUDA context of a GPU; it has no meaning with --device cpu")
            if self.cuda_context < 0:
                raise SettingsError(f"CUDA context must be 0 or more bytes, got {self.cuda_context}")
        self._check_cuda_libraries()
        self._check_lora()
        self._check_quantize()
        check_parallel(self)
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

        given = options_given(
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
                # given as --cuda-alloc-conf, PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF: the command line says
                # which (from the environment: ...); this names none of them wrongly
                raise SettingsError(
                    f"cannot read the allocator configuration {self.cuda_alloc_conf!r} (--cuda-alloc-conf): {error}"
                ) from None
        config = self.cublas_workspace_config
        if config is not None and config_bytes(config) is None:
            raise SettingsError(
                f"cannot read CUBLAS_WORKSPACE_CONFIG {config!r}: it is :SIZE:COUNT pairs in KiB, e.g. :4096:8 or :16:8"
            )

    def _check_label_smoothing(self) -> None:
        value = self.label_smoothing
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise SettingsError(f"label smoothing is a factor of 0 or more, got {value!r}")
        if value and self.deepspeed_stage is not None:
            raise SettingsError(
                "label smoothing is the Trainer's own loss, which memplan does not trace under DeepSpeed's engine: "
                "leave out label smoothing (label_smoothing_factor)"
            )
        if value and self.loop != "hf-trainer":
            raise SettingsError(
                "label smoothing is transformers' Trainer's (label_smoothing_factor), which memplan traces in its "
                "loop: give --loop hf-trainer"
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
                f"--precision {self.precision} with --step: your function runs the whole iteration, so open "
                "torch.autocast in it (memplan traces the one it opens) and give --precision fp32, bf16 or fp16 "
                "for the weights' storage"
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
        check_positive("LoRA rank", self.lora_rank)
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise SettingsError(f"--lora-alpha must be more than 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise SettingsError(f"--lora-dropout is a probability below 1, got {self.lora_dropout}")
        names = [name.strip() for name in self.lora_targets.split(",")] if self.lora_targets is not None else []
        if self.lora_targets is not None and not any(names):
            raise SettingsError("--lora-targets names no module: give names such as q_proj,v_proj")
        if not all(names):  # a slip (q_proj,,v_proj) that the header would print as given
            raise SettingsError(
                f"--lora-targets '{self.lora_targets}' has an empty name between its commas: give names such as "
                "q_proj,v_proj"
            )

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

    @property
    def deepspeed_settings(self) -> dict[str, Any]:
        """deepspeed_config as the object DeepSpeed takes ({} without one)."""
        return parse_deepspeed_config(self.deepspeed_config) if self.deepspeed_config is not None else {}

    def _check_quantize(self) -> None:
        if self.quantize is None:
            if not self.kbit_upcast:
                raise SettingsError("--no-kbit-upcast configures a quantized model: give --quantize nf4, fp4 or int8")
            return
        check_choice("quantization", self.quantize, QUANT_TYPES)
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
        cls.refuse_unknown(data)
        checkpoint = data.get("checkpoint", "none")
        if isinstance(checkpoint, dict):
            data = {**data, "checkpoint": CheckpointLayout.from_dict(checkpoint)}
        return cls(**data)
