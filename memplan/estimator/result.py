"""The result of an estimate: a frozen dataclass with units in its field names and a to_dict()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from memplan.estimator.timeline import MemoryTimeline
from memplan.settings import TrainingSettings


@dataclass(frozen=True)
class Breakdown:
    """Bytes by category live at the peak; they sum to `peak_bytes`."""

    parameters: int  # parameters and buffers
    gradients: int
    optimizer_state: int  # including the amp-fp16 loss scaler's state
    activations: int  # made in the forward pass and saved for the backward pass
    temporaries: int  # everything else: forward/backward/optimizer intermediates
    inputs: int  # the current micro-batch
    workspaces: int = 0  # cuda: cuBLAS workspaces, and a cuDNN convolution's workspace when the peak is at one
    communication: int = 0  # --parallel ddp: the Reducer's gradient buckets; fsdp: collective buffers
    unsharded_parameters: int = 0  # --parallel fsdp: parameters all-gathered for a module's forward or backward

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EstimateResult:
    model: str
    settings: TrainingSettings
    peak_bytes: int
    breakdown: Breakdown
    phase: str  # forward / backward / optimizer: where the peak falls
    peak_op: str
    peak_module: str | None  # None in the backward pass and the optimizer step
    phase_peak_bytes: dict[str, int]
    # The slope of the peak phase's peak, bytes per extra sample, and peak_bytes minus it × batch_size: None where the
    # estimate traced one batch size only (compare's rows, which show neither).
    per_sample_activation_bytes: int | None
    fixed_bytes: int | None
    parameter_count: int
    trainable_parameter_count: int
    checkpointed_blocks: tuple[str, ...]
    unsupported_ops: tuple[str, ...]
    graph_nodes: int
    step_flops: int  # FLOPs of the traced iteration (one micro-batch and the optimizer step), recompute included
    traces: int
    seconds: float
    reserved_peak_bytes: int | None = None  # cuda: max_memory_reserved, from the allocator simulator
    # cuda: max_memory_allocated as the caching allocator counts it, from the same simulator: peak_bytes
    # (the live tensors) plus what it hands out whole (a cached block up to 1 MiB larger, unsplit)
    allocated_peak_bytes: int | None = None
    # cuda: reserved + the CUDA context (+ on a data-parallel rank NCCL's buffers, the band's top), what
    # nvidia-smi shows
    device_peak_bytes: int | None = None
    # --parallel: NCCL's communicator on this rank, outside torch's allocator, modelled as a band
    # (memplan.distributed.nccl; --nccl-memory gives one figure): its low end and its top
    communicator_low_bytes: int | None = None
    communicator_bytes: int | None = None
    # cuda: the least memory (for torch) the iteration completes in, the allocator freeing its cached
    # segments (or, with expandable segments, unmapping free pages) and retrying when memory runs
    # out; with convolutions, the larger of the workspace band's two ends. `fits`, the largest batch
    # and the planner compare this with the budget (memplan.estimator.timeline.device_fit_bytes).
    smallest_device_bytes: int | None = None
    # cuda, models with convolutions: the same peaks if cuDNN picks plans that need no workspace, the
    # low end of the band whose top is peak_bytes / reserved_peak_bytes (memplan.estimator.cuda.cudnn)
    conv_workspace_free_peak_bytes: int | None = None
    conv_workspace_free_reserved_peak_bytes: int | None = None
    roofline_step_seconds: float | None = None  # cuda: the iteration's roofline time on the card (lower bound)
    budget_bytes: int | None = None
    fits: bool | None = None
    max_batch_size: int | None = None
    max_batch_size_is_limit: bool = False  # even memplan.estimator.search.MAX_BATCH_SIZE fits: "at least"
    # --maximize seq-len: the longest sequence that fits at this batch size (0: none does), and
    # whether that is the model's own maximum (or memplan's limit where the model has none).
    max_seq_len: int | None = None
    max_seq_len_is_limit: bool = False
    # cuda, --optimizer paged-adam8bit: its state in CUDA unified memory, outside torch's allocator
    # (in no peak here; the driver moves it to host memory when the GPU runs short)
    paged_optimizer_bytes: int = 0
    # --offload params or optimizer: the most host memory the rank's offloaded state takes at once (FSDP2's
    # shards, or DeepSpeed's master partition, with their gradients and optimizer state, and the host's
    # computation's temporaries, and the CPU tensors a GPU run keeps: memplan.estimator.cuda.host_tensors), in none
    # of the figures above
    host_peak_bytes: int | None = None
    notes: tuple[str, ...] = ()
    # batch sizes the largest-batch search answered from confirmed lines through traces, not traced
    interpolated_batch_sizes: int = 0
    # The predicted iteration allocation by allocation (for --plot and --snapshot); not in to_dict().
    timeline: MemoryTimeline | None = field(default=None, compare=False, repr=False)

    @property
    def device_bytes_without_nccl(self) -> int | None:
        """device_peak_bytes less NCCL's band top: what a rank on torch's fake process group (memplan's
        validation runs, which make no NCCL communicator) shows."""
        if self.device_peak_bytes is None:
            return None
        return self.device_peak_bytes - (self.communicator_bytes or 0)

    @property
    def fit_bytes(self) -> int:
        """What a budget must hold: on cuda the least device memory the step completes in, the
        allocator retrying after freeing its cached segments (smallest_device_bytes, across a
        convolution workspace band), the peak on cpu (as Simulation.fit_bytes)."""
        if self.smallest_device_bytes is None:
            return self.peak_bytes
        return self.smallest_device_bytes

    def fits_within(self, budget_bytes: int) -> bool:
        """Whether the step fits `budget_bytes`: on cuda it completes on a device of that size,
        replayed at that size (memplan.estimator.timeline.fits_within), else its peak is within it."""
        if self.smallest_device_bytes is None or self.timeline is None:
            return self.peak_bytes <= budget_bytes
        from memplan.estimator.timeline import fits_within

        return fits_within(self.timeline, budget_bytes, self.settings.allocator_config)

    def _repr_html_(self) -> str:
        """Jupyter's view: the CLI's report and the timeline plot (memplan.render.notebook)."""
        from memplan.render.notebook import estimate_html

        return estimate_html(self)

    def to_dict(self) -> dict[str, Any]:
        data = {item.name: getattr(self, item.name) for item in dataclasses.fields(self) if item.name != "timeline"}
        data["settings"] = self.settings.to_dict()
        data["breakdown"] = self.breakdown.to_dict()
        data["checkpointed_blocks"] = list(self.checkpointed_blocks)
        data["unsupported_ops"] = list(self.unsupported_ops)
        data["notes"] = list(self.notes)
        data["seconds"] = round(self.seconds, 3)
        return data
