"""Settings + model source -> traces -> simulations -> EstimateResult."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.choices import MAX_COUNT
from memplan.distributed.deepspeed_file import replaced_values
from memplan.distributed.modes import FSDP_MODES, RESHARDING_FSDP_MODES
from memplan.errors import SettingsError, TraceError
from memplan.estimator.adam8bit import paged_state_bytes
from memplan.estimator.cuda.roofline import step_seconds
from memplan.estimator.flops import node_flops
from memplan.estimator.interpolate import BatchLines, phase_fit_bytes, same_requests
from memplan.estimator.interpolate import fits as timeline_fits
from memplan.estimator.optimizers import local_optimizer
from memplan.estimator.result import Breakdown, EstimateResult
from memplan.estimator.search import MAX_BATCH_SIZE, find_max_batch_size, largest_fitting, last_fitting_from
from memplan.estimator.simulate import Simulation, simulate
from memplan.estimator.timeline import MemoryTimeline, reserved_peak_bytes
from memplan.estimator.trace import TracedStep, build_fake_setup, trace_step
from memplan.finetune.bnb_kernels import OUTLIER_COLUMN_FRACTION
from memplan.finetune.quantize import INT8
from memplan.gpus import DEFAULT_GPU
from memplan.interrupts import raise_if_interrupted
from memplan.models.fingerprint import check_fingerprint
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings
from memplan.sizes import format_bytes

if TYPE_CHECKING:
    from torch.optim import Optimizer

Progress = Callable[[str], None]


def _notes(settings: TrainingSettings, has_convolutions: bool = False, paged_bytes: int = 0) -> list[str]:
    notes = []
    if settings.device == "cuda":
        notes.append(
            f"cuda target ({settings.gpu or DEFAULT_GPU}): CUDA's autocast lists, SDPA backend, fused dropout, "
            "cuBLAS workspaces and the caching allocator are emulated; cuDNN convolution workspaces are a band "
            "(memplan cannot know the algorithm cuDNN picks): its top is what is reported; a fit replays the step "
            "at the budget with both ends (the allocator frees cached memory and retries when short)"
        )
        if settings.cuda_context is None:
            notes.append(
                f"device_peak_bytes counts a CUDA context of {format_bytes(settings.context_bytes)}, as measured "
                "on an H100 with CUDA 13 (torch 2.11); it depends on the CUDA version, lazy loading and GPU: "
                "give yours with --cuda-context"
            )
    notes += _library_notes(settings, has_convolutions)
    if settings.optimizer in ("adam8bit", "paged-adam8bit"):
        notes.append("adam8bit: bitsandbytes' state layout (uint8 moments + blockwise absmax), in-place update")
    if paged_bytes:
        notes.append(
            f"paged-adam8bit: {format_bytes(paged_bytes)} of its state (the moments of parameters of 100,000 "
            "elements or more) is CUDA unified memory outside torch's allocator, in none of these figures: nvidia-smi "
            "shows it while it is on the GPU, and the driver moves it to host memory when the GPU runs short"
        )
    if settings.quantize is not None:
        notes.append(_quantize_note(settings))
    if settings.parallel == "ddp":
        notes.append(
            f"one rank of {settings.world_size}: torch's DistributedDataParallel traced on a fake process group, its "
            "gradient buckets (every trainable gradient once more) included; every micro-batch all-reduces (no "
            "no_sync())"
        )
    if settings.parallel == "zero1" and settings.deepspeed_stage is None:
        notes.append(
            f"one rank of {settings.world_size}: torch's DistributedDataParallel and ZeroRedundancyOptimizer traced "
            "on a fake process group; the optimizer state is this rank's share of the parameters (whole parameters, "
            "largest first, to the rank with the fewest elements so far), every gradient and DDP's gradient buckets "
            "whole; DeepSpeed's ZeRO-1 partitions and buckets differ and are not modelled"
        )
    if settings.parallel in FSDP_MODES:
        resharding = settings.parallel in RESHARDING_FSDP_MODES
        reshard = "after each forward and backward" if resharding else "after each backward only"
        notes.append(
            f"one rank of {settings.world_size}: torch's FSDP2 (fully_shard on each repeated block, then the root) "
            f"traced on a fake process group; parameters, gradients and optimizer state sharded, each module's "
            f"parameters all-gathered before its forward and backward and resharded {reshard}; its collectives' "
            "buffers allocated on their own CUDA streams, as FSDP2 does"
        )
    if settings.offload == "params" and settings.parallel in FSDP_MODES:
        pinned = (
            "pinned (torch's CachingHostAllocator rounds each up to a power of two)"
            if settings.device == "cuda"
            else "unpinned"
        )
        notes.append(
            "--offload params: FSDP2's CPUOffloadPolicy; the parameter shards, their gradients and the optimizer "
            f"state live in host memory ({pinned}) and the optimizer step runs there; each module's shards are "
            "copied to the GPU for its all-gather and each reduced gradient copied back; host_peak_bytes counts the "
            "host's share, the other figures the GPU's"
        )
    replaced = []
    if settings.deepspeed_stage is not None:
        job = (settings.batch_size, settings.grad_accum, settings.world_size, settings.optimizer)
        replaced = replaced_values(settings.deepspeed_settings, *job)
    if replaced:
        notes.append(
            "the DeepSpeed configuration's own values replaced by memplan's options (what the Trainer fills for "
            f'"auto"): {"; ".join(replaced)}'
        )
    if settings.deepspeed_stage is not None and settings.offloads_to_host:
        from memplan.distributed.deepspeed_config import runs_deepspeed_cpu_adam

        pinned = "pinned where its pin_memory says so: torch rounds each pinned buffer up to a power of two"
        if runs_deepspeed_cpu_adam(settings.deepspeed_settings):
            stepper = (
                "DeepSpeedCPUAdam, as DeepSpeed requires with offload and accelerate (so the Trainer) arranges "
                f"whatever the optimizer (here --optimizer {settings.optimizer}): two float32 moments, and a step "
                "that makes no temporaries (zero_force_ds_cpu_optimizer: false in --deepspeed runs yours instead)"
            )
        else:
            stepper = (
                f"--optimizer {settings.optimizer} itself, as zero_force_ds_cpu_optimizer: false lets DeepSpeed run "
                "a client optimizer there (torch's for-loop implementation on host tensors)"
            )
        # The model's own dtype: DeepSpeed's bf16 and fp16 make it 16-bit, fp32 and torch_autocast leave it float32.
        partition = "16-bit" if settings.precision in ("bf16", "fp16") else "float32"
        notes.append(
            "DeepSpeed's offload_optimizer: the float32 master partition, its gradient, the optimizer state and "
            f"DeepSpeed's staging buffers live in host memory ({pinned if settings.device == 'cuda' else 'unpinned'}), "
            "and the gradient norm and the step run there, the step as "
            f"{stepper}; each reduced gradient is copied to the host in the backward and the updated {partition} "
            "partition back after the step; host_peak_bytes counts the host's share, the other figures the GPU's"
        )
        if settings.deepspeed_offloads_parameters:
            notes.append(
                f"DeepSpeed's offload_param: ZeRO-3's {partition} parameter partitions live in host memory too, and "
                "each module's are copied to the GPU to be all-gathered before its forward and its backward"
            )
    band = settings.communicator_band_bytes
    if band is not None:
        notes.append(_nccl_note(settings, *band))
    return notes


def _nccl_note(settings: TrainingSettings, low: int, high: int) -> str:
    """What the device figure counts for NCCL (memplan.distributed.nccl)."""
    if settings.nccl_memory is not None:
        return f"NCCL: {format_bytes(settings.nccl_memory)} (--nccl-memory) counted in the device figure and fits"
    variables = [
        f"{name}={value}"
        for name, value, default in (
            ("NCCL_BUFFSIZE", settings.nccl_buffsize, None),
            ("NCCL_MAX_CTAS", settings.nccl_max_ctas, None),
            ("NCCL_NVLS_ENABLE", int(settings.nccl_nvls), 1),
        )
        if value != default
    ]
    return (
        f"NCCL's communicator holds {format_bytes(low)} to {format_bytes(high)} on the GPU outside torch's allocator "
        + (f"with {', '.join(variables)} " if variables else "")
        + "(modelled from NCCL's buffer sizes, not traced: the channels and algorithms NCCL picks depend on the "
        f"machine); the device figure and fits count the top, {format_bytes(high)}: give yours with --nccl-memory"
    )


def _quantize_note(settings: TrainingSettings) -> str:
    """What --quantize counts (memplan.finetune.quantize, memplan.finetune.bnb_kernels)."""
    on_cuda = settings.device == "cuda"
    if settings.quantize == INT8:
        if not on_cuda:
            how = "each 8-bit matmul dequantizes its weight, as bitsandbytes does when training on the CPU"
        else:
            how = (
                "each 8-bit matmul quantizes its input to int8 and multiplies in int32, as bitsandbytes does on CUDA, "
                f"with {OUTLIER_COLUMN_FRACTION:.0%} of its input columns assumed to hold an outlier and multiplied "
                "in 16 bits (how many do depends on the data)"
            )
        return (
            "int8: LLM.int8()'s layout (an int8 weight and a float32 scale per row) on every linear layer but the "
            f"LM head; {how}; the weight is dequantized in the backward"
        )
    return (
        f"{settings.quantize}: bitsandbytes' 4-bit layout (double-quantized, blocks of 64) on every linear layer "
        "but the LM head; each 4-bit matmul is counted with the whole weight dequantized, as bitsandbytes does on "
        "the CPU, in the backward, and on CUDA above 1536 rows"
        + (" (with fewer rows CUDA may pick its fused kernel, which does not: then less)" if on_cuda else "")
    )


def _library_notes(settings: TrainingSettings, has_convolutions: bool) -> list[str]:
    """What the CUDA library switches mean for these numbers (memplan.estimator.cuda.cudnn, .cublas)."""
    from memplan.estimator.cuda.cublas import DETERMINISTIC_CONFIGS

    notes = []
    if settings.device != "cuda":
        return notes
    if settings.cudnn_benchmark and has_convolutions:
        notes.append(
            "cudnn.benchmark: the first iteration times each convolution's candidate plans on one workspace as large "
            "as free memory allows, then empties the allocator's cache; it cannot make the step fail, but "
            "max_memory_reserved and nvidia-smi over the run may show up to the GPU's free memory then. The "
            "steady-state figures here do not count it"
        )
    if settings.deterministic and settings.cublas_workspace_config not in DETERMINISTIC_CONFIGS:
        notes.append(
            "deterministic algorithms on CUDA need CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8, or torch raises at the "
            "first matmul (unless warn_only); memplan counted "
            + (f"{settings.cublas_workspace_config}" if settings.cublas_workspace_config else "the default workspace")
            + ": give the value your run sets with --cublas-workspace-config"
        )
    if settings.cuda_alloc_conf is not None:
        from memplan.estimator.cuda.allocator import parse_alloc_conf

        config, unmodelled = parse_alloc_conf(settings.cuda_alloc_conf)
        if config.expandable_segments:
            notes.append("expandable_segments:True: reserved_peak_bytes follows the allocator's expandable segments")
        if config.garbage_collection_threshold is not None:
            notes.append(
                "garbage_collection_threshold: acts only where the process caps itself with "
                "torch.cuda.set_per_process_memory_fraction (CUDACachingAllocator.cpp malloc), which this step does "
                "not; it changes nothing here"
            )
        if unmodelled:
            notes.append(
                f"PYTORCH_CUDA_ALLOC_CONF {', '.join(unmodelled)}: not modelled; reserved_peak_bytes follows the "
                "allocator's default rules for them"
            )
    if settings.cudnn_workspace_cap_mib is not None and has_convolutions:
        notes.append(
            f"CUDNN_CONV_WSCAP_DBG={settings.cudnn_workspace_cap_mib}: each convolution's workspace band is capped at "
            f"{settings.cudnn_workspace_cap_mib} MiB (a cuDNN variable NVIDIA does not document; read as MiB per call)"
        )
    return notes


def second_batch_size(batch_size: int) -> int:
    """The other batch size traced to measure the per-sample slope."""
    return batch_size // 2 if batch_size >= 2 else 2


@dataclass(frozen=True)
class BatchFigures:
    """One batch size's figures, as its Simulation gives them, from its own trace or from the lines."""

    peak_bytes: int
    reserved_peak_bytes: int | None  # cuda
    smallest_device_bytes: int | None  # cuda
    traced: bool  # False: from lines through traced batch sizes (memplan.estimator.interpolate)


class BatchTracer:
    """Traces and simulates one configuration at any batch size, building the fake model once.

    Once three traced batch sizes agree that every request's size is affine in the batch (two
    draw the lines, the third must land on them exactly), the search answers other batch sizes
    from those lines and the allocator simulator instead of a trace (memplan.estimator.interpolate).
    """

    def __init__(self, spec: ModelSpec, settings: TrainingSettings, progress: Progress | None = None) -> None:
        self.spec, self.settings = spec, settings
        self.report = progress or (lambda message: None)
        self.report("building the model under fake tensors")
        self.setup = build_fake_setup(spec, settings)
        self.simulations: dict[int, Simulation] = {}
        self.first: TracedStep | None = None
        self.lines: BatchLines | None = None  # set once a third trace confirmed them
        self.interpolated: dict[int, dict[str, int]] = {}  # batch size -> fit_phase_peaks, from the lines
        self.interpolated_timelines: dict[int, MemoryTimeline] = {}  # batch size -> its timeline, from the lines
        self._slope_batch_size: int | None = None

    def fit_phase_peaks(self, batch_size: int) -> dict[str, int]:
        if batch_size in self.simulations or self.lines is None or batch_size == 1:
            return self.simulate(batch_size).fit_phase_peaks  # (batch 1 can take shortcuts: never on the lines)
        if batch_size not in self.interpolated:
            raise_if_interrupted()
            timeline = self.lines.timeline_at(batch_size)
            if timeline is None:
                return self.simulate(batch_size).fit_phase_peaks
            self.interpolated[batch_size] = phase_fit_bytes(timeline, self.settings)
            self.interpolated_timelines[batch_size] = timeline
        return self.interpolated[batch_size]

    def fits(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether this batch size fits the budget, decided at the budget itself (Simulation.fits_within),
        from the confirmed lines where they answered it."""
        self.fit_phase_peaks(batch_size)
        timeline = self.interpolated_timelines.get(batch_size)
        if timeline is None:
            return self.simulate(batch_size).fits_within(budget_bytes)
        return timeline_fits(timeline, self.settings, budget_bytes)

    def fit_bytes(self, batch_size: int) -> int:
        return max(self.fit_phase_peaks(batch_size).values())

    def figures(self, batch_size: int) -> BatchFigures:
        """The batch size's peak, reserved peak and least device memory: from the confirmed lines
        where they answer it, else from a trace."""
        self.fit_phase_peaks(batch_size)
        timeline = self.interpolated_timelines.get(batch_size)
        if timeline is None:
            simulation = self.simulate(batch_size)
            peaks = simulation.peak_bytes, simulation.reserved_peak_bytes, simulation.smallest_device_bytes
            return BatchFigures(*peaks, traced=True)
        if self.settings.device != "cuda":
            return BatchFigures(max(timeline.total_bytes()), None, None, traced=False)
        reserved = reserved_peak_bytes(timeline, self.settings.allocator_config)
        device = self.interpolated[batch_size]["device"]
        return BatchFigures(max(timeline.total_bytes()), reserved, device, traced=False)

    def simulate(self, batch_size: int) -> Simulation:
        if batch_size not in self.simulations:
            raise_if_interrupted()
            self.report(f"tracing batch size {batch_size} (trace {len(self.simulations) + 1})")
            replay = self.first.optimizer_recording if self.first else None  # batch size cannot change the step
            traced = trace_step(self.spec, self.settings.replace(batch_size=batch_size), self.setup, replay)
            self.simulations[batch_size] = simulate(traced)
            self.first = self.first or traced
            self._confirm_lines(batch_size)
        return self.simulations[batch_size]

    def slope_batch_size(self) -> int:
        """The other batch size traced for the per-sample slope, traced: second_batch_size, or twice the settings'
        batch size where the model cannot run at the smaller one (BatchNorm in training needs more than one value
        per channel: a batch of 1 over 1×1 maps fails, where the batch asked for runs)."""
        if self._slope_batch_size is None:
            other = second_batch_size(self.settings.batch_size)
            try:
                self.simulate(other)
            except TraceError:
                if other > self.settings.batch_size:
                    raise
                other = 2 * self.settings.batch_size
                self.simulate(other)
            self._slope_batch_size = other
        return self._slope_batch_size

    def _confirm_lines(self, batch_size: int) -> None:
        """With a third traced batch size: keep the lines through the other two if it lies on them."""
        if self.lines is not None or len(self.simulations) < 3:
            return
        cuda = self.settings.device == "cuda"
        fitted = [batch for batch in self.simulations if batch != batch_size and batch > 1][:2]
        if len(fitted) < 2:
            return
        timelines = ((batch, self.simulations[batch].timeline) for batch in fitted)
        lines = BatchLines.fit(*timelines, allocator=self.settings.allocator_config if cuda else None)
        predicted = lines.timeline_at(batch_size) if lines is not None else None
        if predicted is not None and same_requests(predicted, self.simulations[batch_size].timeline):
            self.lines = lines

    def max_batch_size(self, budget_bytes: int) -> int:
        """The largest batch size that fits the budget: the search runs on fit_bytes (on cuda the
        least memory each step completes in), the answer is checked at the budget itself (fits)."""
        if len(self.simulations) < 2:  # the search starts from two traced batch sizes
            self.simulate(self.settings.batch_size)
        if len(self.simulations) < 2:
            self.slope_batch_size()
        known = {batch: simulation.fit_phase_peaks for batch, simulation in self.simulations.items()}
        found = find_max_batch_size(known, self.fit_phase_peaks, budget_bytes)
        # The search may stop on a fitted line's word that found + 1 is over budget; the device
        # figure moves in allocator-segment steps, so confirm above it (logarithmically), from the
        # confirmed lines where there are some, else by tracing.
        return last_fitting_from(found, lambda batch: self.fits(batch, budget_bytes))


def longest_seq_len(tracer: BatchTracer, budget_bytes: int) -> tuple[int, bool, int]:
    """The longest sequence length that fits the budget at the settings' batch size
    (Simulation.fits_within); whether it is the limit (the model's maximum, else memplan's
    MAX_COUNT); the traces run.

    Each length asked about is one trace on the tracer's fake model: memory is no line in the
    sequence length (attention's scores grow with its square; the kernels change with it), so it is
    searched by galloping and bisection (memplan.estimator.search.largest_fitting)."""
    settings = tracer.settings
    assert settings.seq_len is not None, "run_estimate refuses --maximize seq-len for models without one"
    limit = tracer.spec.max_seq_len or MAX_COUNT
    fit = {settings.seq_len: tracer.simulate(settings.batch_size).fits_within(budget_bytes)}

    def fits(seq_len: int) -> bool:
        if seq_len not in fit:
            raise_if_interrupted()
            tracer.report(f"tracing sequence length {seq_len} (trace {len(tracer.simulations) + len(fit)})")
            # The sequence length cannot change the optimizer step: replay it (memplan.estimator.replay).
            replay = tracer.first.optimizer_recording if tracer.first else None
            traced = trace_step(tracer.spec, settings.replace(seq_len=seq_len), tracer.setup, replay)
            fit[seq_len] = simulate(traced).fits_within(budget_bytes)
        return fit[seq_len]

    found = largest_fitting(settings.seq_len, fits, limit)
    return found, found == limit, len(fit) - 1


def _paged_bytes(optimizer: Optimizer | None) -> int:
    """paged-adam8bit's state in unified memory: that of the parameters this rank updates (under
    --parallel zero1 its share, not the model's)."""
    local = local_optimizer(optimizer) if optimizer is not None else None
    if not getattr(local, "paged", False):
        return 0
    return paged_state_bytes([param for group in local.param_groups for param in group["params"]])


def step_flops(traced: TracedStep) -> int:
    """FLOPs of the traced iteration (torch.utils.flop_counter's formulas; recomputation included)."""
    return sum(node_flops(node) for node in traced.graph.nodes)


def run_estimate(
    spec: ModelSpec,
    settings: TrainingSettings,
    *,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
    plan_fingerprint: str | None = None,
    maximize_seq_len: bool = False,
) -> EstimateResult:
    """`maximize_seq_len` (with a budget): also the longest sequence that fits at the batch size."""
    started = time.perf_counter()
    settings = spec.settings_for(settings)
    if maximize_seq_len and budget_bytes is None:
        raise SettingsError("--maximize seq-len needs a budget: pass --budget (e.g. 24GiB) or --gpu NAME")
    if maximize_seq_len and settings.seq_len is None:
        raise SettingsError(f"--maximize seq-len: {spec.name} takes no sequence length (--seq-len)")
    tracer = BatchTracer(spec, settings, progress)
    if plan_fingerprint is not None:
        check_fingerprint(plan_fingerprint, "another model", tracer.setup.state.built_model, spec.name)
    simulations = tracer.simulations
    batch_size = settings.batch_size
    main = tracer.simulate(batch_size)
    traced = tracer.first
    assert traced is not None
    other = tracer.slope_batch_size()
    slope = (main.peak_bytes - tracer.simulate(other).phase_peak_bytes[main.phase]) // (batch_size - other)
    max_batch = fits = None
    if budget_bytes is not None:
        fits = tracer.fits(settings.batch_size, budget_bytes)
        max_batch = tracer.max_batch_size(budget_bytes)
    max_seq_len, max_seq_len_is_limit, seq_len_traces = None, False, 0
    if maximize_seq_len and budget_bytes is not None:
        max_seq_len, max_seq_len_is_limit, seq_len_traces = longest_seq_len(tracer, budget_bytes)
    unsupported = sorted({op for simulation in simulations.values() for op in simulation.unsupported_ops})
    paged = _paged_bytes(tracer.setup.state.optimizer)
    return EstimateResult(
        model=spec.name,
        settings=settings,
        peak_bytes=main.peak_bytes,
        breakdown=Breakdown(**main.breakdown),
        phase=main.phase,
        peak_op=main.peak_op,
        peak_module=main.peak_module,
        phase_peak_bytes=dict(main.phase_peak_bytes),
        reserved_peak_bytes=main.reserved_peak_bytes,
        allocated_peak_bytes=main.allocated_peak_bytes,
        conv_workspace_free_peak_bytes=main.conv_workspace_free_peak_bytes,
        conv_workspace_free_reserved_peak_bytes=main.conv_workspace_free_reserved_peak_bytes,
        roofline_step_seconds=step_seconds(traced),
        device_peak_bytes=main.reserved_peak_bytes + settings.outside_allocator_bytes
        if main.reserved_peak_bytes is not None
        else None,
        communicator_low_bytes=band[0] if (band := settings.communicator_band_bytes) is not None else None,
        communicator_bytes=band[1] if band is not None else None,
        smallest_device_bytes=main.smallest_device_bytes,
        per_sample_activation_bytes=slope,
        fixed_bytes=main.peak_bytes - slope * batch_size,
        parameter_count=traced.parameter_count,
        trainable_parameter_count=traced.trainable_parameter_count,
        checkpointed_blocks=tuple(traced.checkpointed_blocks),
        unsupported_ops=tuple(unsupported),
        graph_nodes=len(traced.graph.nodes),
        step_flops=step_flops(traced),
        traces=len(simulations) + seq_len_traces,
        interpolated_batch_sizes=len(tracer.interpolated),
        seconds=time.perf_counter() - started,
        budget_bytes=budget_bytes,
        fits=fits,
        max_batch_size=max_batch,
        max_batch_size_is_limit=max_batch == MAX_BATCH_SIZE,
        max_seq_len=max_seq_len,
        max_seq_len_is_limit=max_seq_len_is_limit,
        paged_optimizer_bytes=paged,
        host_peak_bytes=main.host_peak_bytes,
        notes=tuple(_notes(settings, main.conv_workspace_free_peak_bytes is not None, paged)),
        timeline=main.timeline,
    )
