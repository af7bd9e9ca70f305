"""Capture one steady-state iteration as an FX graph over fake tensors (design.md §3).

The step is traced *statefully*: the model's own fake parameters, `.backward()` through the autograd
engine, then the real `torch.optim` optimizer. Parameters, buffers, optimizer state and existing
gradients become graph constants; the batch becomes the graph's placeholders. What a trace leaves is
a TracedStep (memplan.estimator.traced_step); a user's `--step` is traced by
memplan.estimator.custom_step_trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.distributed.fsdp import StorageResize, storage_resizes_recorded
from memplan.distributed.offload import copies_made
from memplan.errors import MemplanError
from memplan.estimator.buffer_values import constants_tracked, keep_buffers
from memplan.estimator.compiled import compiled_code_run_eagerly
from memplan.estimator.cuda.host_tensors import host_outputs_recorded, optimizer_host_tensors
from memplan.estimator.cuda.target import target_kernels
from memplan.estimator.custom_step_trace import keeps_tensors_across_calls, trace_custom_step
from memplan.estimator.eager_lifetimes import EagerLifetimes, lifetimes_tracked, storage_key
from memplan.estimator.fake_conversions import fake_friendly_conversions
from memplan.estimator.fake_mode import TracingFakeMode, constant_item
from memplan.estimator.held_tensors import OptimizerLocals
from memplan.estimator.hf_patches import no_weight_init, real_run_paths
from memplan.estimator.leaves import local_tensor, tensors_in
from memplan.estimator.loop import (
    LOOPS_BINDING_THE_LOSS,
    STORAGE_DTYPES,
    TrainingState,
    current_grads,
    drop_grads,
    fetched_ahead,
    gradients_outlive_the_step,
    iteration,
    micro_batch,
    model_tensors,
    optimizer_step,
    optimizer_tensors,
    prepare,
)
from memplan.estimator.module_attributes import attribute_tensors
from memplan.estimator.module_tracker import ModuleTracker
from memplan.estimator.optimizers import local_optimizer
from memplan.estimator.python_locals import tensors_held
from memplan.estimator.recorder import GraphRecorder
from memplan.estimator.replay import OptimizerRecording
from memplan.estimator.rng_snapshots import rng_snapshots_recorded
from memplan.estimator.saved_tensors import SavedTensors
from memplan.estimator.swapped_storages import SwappedStorages, parameter_data_swaps, storages_held_by_fake_tensors
from memplan.estimator.tensor_caches import cached_tensors, caches_of_new_modules, run_with_fresh_tensor_caches
from memplan.estimator.trace_errors import step_failure, trace_failure
from memplan.estimator.traced_step import (
    Observed,
    PreviousMicroBatch,
    TracedStep,
    categorize_storages,
    traced_step_from,
)
from memplan.estimator.user_step import step_function
from memplan.estimator.wrapped_numbers import wrapped_numbers_recorded
from memplan.interrupts import deferred
from memplan.models.source import ModelSpec, exit_in_user_code
from memplan.settings import TrainingSettings

__all__ = ["FakeSetup", "build_fake_setup", "trace_step"]


def _warm_up_optimizer(state: TrainingState) -> None:
    """Create the optimizer state a steady-state iteration finds (one untraced step on zero grads)."""
    if state.optimizer is None:
        return
    for param in state.trainable:
        param.grad = torch.zeros_like(param)
    with constant_item():
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def _find_the_reached_parameters(state: TrainingState, settings: TrainingSettings, fake_mode: FakeTensorMode) -> None:
    """A loop that keeps gradients across micro-batches (accumulation, zero_grad late or never) holds gradients,
    and the optimizer state, only for the trainable parameters a backward reaches: torch's AccumulateGrad makes a
    parameter's `.grad`, and the optimizers skip a parameter whose `.grad` is None. One untraced micro-batch
    finds them (a teacher network run under no_grad whose parameters still require grad is not among them: it
    had gradients and AdamW state in the trace: 1,016,584 B too many for tests/test_trace.py's unused head under
    accumulation). The canonical loop, which starts with none, prunes what the warm-up made for them after its
    trace instead (_unreached_state)."""
    with fake_mode, real_run_paths(), target_kernels(settings), constant_item():
        micro_batch(state)
    state.kept_loss = None  # (its graph is not the traced micro-batch's to hold)
    state.reached = frozenset(id(param) for param in state.trainable if param.grad is not None)
    for param in state.trainable:
        param.grad = None


def _bound_across_micro_batches(state: TrainingState, settings: TrainingSettings) -> object:
    """What the loop's variable holds from one micro-batch into the next one's forward, where it is bound again: with
    accumulation, the loss where the loop binds it (`loss = loss_of(model(...))` keeps the last micro-batch's until it
    returns: module docstring of memplan.estimator.loop), keep-output's `out` (until `out = model(...)` returns). The
    backward freed the graph's saved tensors; its Nodes, and what custom autograd Functions keep on their contexts
    (bitsandbytes' 8-bit matmuls' inputs, a reentrant checkpoint's RNG state), and the tensors themselves, live on.
    None where nothing does."""
    if settings.grad_accum <= 1 or settings.step is not None:
        return None
    if settings.loop in LOOPS_BINDING_THE_LOSS:
        return state.kept_loss
    return state.kept_output if settings.loop == "keep-output" else None


@dataclass
class FakeSetup:
    """A model, optimizer and state built once under fake tensors, reusable across batch sizes. `forward_run`:
    whether the model's forward has run on it (an untraced iteration or micro-batch, or a trace), as a steady-state
    iteration's has."""

    fake_mode: FakeTensorMode
    state: TrainingState
    forward_run: bool = False


@contextlib.contextmanager
def _untraced(state: TrainingState, spec: ModelSpec, settings: TrainingSettings) -> Iterator[None]:
    """An untraced run of the user's model or step: a failure in it is said as a traced one's is, naming the
    module it happened in (a BatchNorm at batch 1 had been an internal error)."""
    tracker = ModuleTracker(state.built_model, lambda: 0)
    try:
        with tracker:
            yield
    except MemplanError:
        raise
    except Exception as error:
        if settings.step is not None:
            raise step_failure(error, settings) from error
        raise trace_failure(error, tracker.current(), spec, state.batch) from error


@deferred()
@compiled_code_run_eagerly()
@run_with_fresh_tensor_caches
def build_fake_setup(spec: ModelSpec, settings: TrainingSettings) -> FakeSetup:
    if settings.step is not None:
        # Imported here, outside the fake mode: a module first imported inside it makes its module-level tensors
        # (a noise scheduler's tables, a constant) fake for good, and the caller's process, which imports the same
        # module object from sys.modules, then trains on fake tensors silently (memplan.estimator.user_step).
        step_function(settings)
    fake_mode = TracingFakeMode(allow_non_fake_inputs=True)
    with fake_mode, constant_item(), no_weight_init(), fake_friendly_conversions():
        with constants_tracked(fake_mode) as constants:
            state = prepare(spec, settings)
        caches_of_new_modules()  # (the model's module, imported as it was built)
        keep_buffers([*state.built_model.buffers(), *attribute_tensors(state.built_model)], constants)
        if settings.step is None and state.data_parallel is None:
            _warm_up_optimizer(state)
    if settings.step is None and state.data_parallel is None and gradients_outlive_the_step(settings):
        with _untraced(state, spec, settings):
            _find_the_reached_parameters(state, settings, fake_mode)
    if settings.step is not None or state.data_parallel is not None:
        # One untraced iteration leaves the state a steady-state one finds: whatever the user's own
        # step leaves; under DDP, the optimizer's state and the order the gradients became ready,
        # in which the second iteration's forward makes the buckets again.
        offload_copies = copies_made(state.data_parallel)
        with _untraced(state, spec, settings):
            with fake_mode, real_run_paths(), target_kernels(settings), constant_item(), offload_copies:
                iteration(state)  # the user's step, where there is one
                if state.data_parallel is not None:
                    # Now, not at the traced step's first forward: that would trace the old buckets
                    # freed and the new ones made (where the warm-up ran one forward, it has not yet).
                    state.data_parallel.after_warm_up()
    forward_run = settings.step is not None or state.data_parallel is not None or state.reached is not None
    return FakeSetup(fake_mode=fake_mode, state=state, forward_run=forward_run)


def _unreached_state(state: TrainingState, settings: TrainingSettings) -> set[StorageWeakRef]:
    """The optimizer state of trainable parameters the traced backward gave no gradient (a head or pooler the loss
    does not use): torch's optimizers skip a parameter whose `.grad` is None and never make state for it, where
    the warm-up (_warm_up_optimizer, zero gradients for every trainable parameter) made some. Read where the
    micro-batch began with no gradients (the canonical loop's); a loop that keeps gradients across steps was
    handed zero gradients for them too, which this cannot tell from real ones. Its storages, not read by the
    traced step, are left out of it. Not on a data-parallel rank (its wrapper holds the gradients)."""
    if state.optimizer is None or state.data_parallel is not None:
        return set()
    if gradients_outlive_the_step(settings) and state.reached is None:
        return set()
    optimizer_state = local_optimizer(state.optimizer).state
    unreached, reached = set(), set()
    for param in state.trainable:
        values = optimizer_state.get(param, {}).values()
        keys = {storage_key(value) for value in values if isinstance(value, torch.Tensor)}
        (unreached if param.grad is None else reached).update(keys)
    return unreached - reached  # never one a reached parameter's state shares


def _gradients_as_ddp_makes_them(state: TrainingState, settings: TrainingSettings, fake_mode: FakeTensorMode) -> None:
    """The gradients a DDP rank's last micro-batch (or a loop that keeps them) finds, made as DDP makes
    them: with gradient_as_bucket_view they are views into its buckets, not tensors of their own. What
    the warm-up left is kept; where the loop dropped them, one untraced micro-batch makes them.
    DeepSpeed's engine keeps a step's gradients in its own partition, not in `.grad`, and counts the
    micro-batches itself: it always runs the untraced one, and is told the traced one is the step's last."""
    engine_counts = hasattr(state.data_parallel, "after_micro_batch") and settings.grad_accum > 1
    if not engine_counts and all(param.grad is not None for param in state.trainable):
        return
    state.micro_batches_done = max(settings.grad_accum - 2, 0)
    with fake_mode, real_run_paths(), target_kernels(settings), constant_item(), copies_made(state.data_parallel):
        micro_batch(state)
        if engine_counts:
            state.data_parallel.after_micro_batch()
            state.data_parallel.skip_micro_batches(settings.grad_accum - 2)
    state.kept_loss = None  # (its graph is not the traced micro-batch's to hold)
    state.micro_batches_done = settings.grad_accum - 1


def _module_held_storages(state: TrainingState) -> set[StorageWeakRef]:
    """The storages the model holds on its modules: its buffers and tensor attributes (not its parameters)."""
    model = state.built_model
    return {storage_key(tensor) for tensor in [*model.buffers(), *attribute_tensors(model)]}


def trace_step(
    spec: ModelSpec,
    settings: TrainingSettings,
    setup: FakeSetup | None = None,
    optimizer_replay: OptimizerRecording | None = None,
) -> TracedStep:
    """Trace the last micro-batch (gradients already present when grad_accum > 1) and the optimizer step.

    `setup` (from `build_fake_setup` with the same settings but any batch size) skips rebuilding the model.
    `optimizer_replay`: an earlier trace's `optimizer_recording` on the same setup, replayed instead of
    tracing the optimizer step again when the new gradients match it (memplan.estimator.replay).

    A model whose first forward lets go of a buffer or tensor attribute it was built with, binding another in its
    place, holds the new one from the second iteration on, and the one it was built with no longer: wav2vec2-
    conformer's relative positions `self.pe = self.extend_pe(hidden_states, self.pe)` swap its float32 table for a
    copy in the hidden states' dtype, bfloat16 under autocast, once (transformers' modeling_wav2vec2_conformer.py,
    Wav2Vec2ConformerRelPositionalEmbedding.extend_pe returns `pe` itself once its dtype matches). The trace of
    the setup's first forward held both (the table it read as a constant of the whole step): the step is traced
    again from the state it left, as the measured iteration starts from the state the earlier ones left.
    """
    started = time.perf_counter()
    setup = setup or build_fake_setup(spec, settings)
    if setup.forward_run:
        return _traced_once(spec, settings, setup, optimizer_replay, started)
    built_with = _module_held_storages(setup.state)
    traced = _traced_once(spec, settings, setup, optimizer_replay, started)
    setup.forward_run = True
    if built_with - _module_held_storages(setup.state):
        traced = _traced_once(spec, settings, setup, optimizer_replay, started)
    return traced


@deferred()
@compiled_code_run_eagerly()
@run_with_fresh_tensor_caches
def _traced_once(
    spec: ModelSpec,
    settings: TrainingSettings,
    setup: FakeSetup,
    optimizer_replay: OptimizerRecording | None,
    started: float,
) -> TracedStep:
    """One trace of trace_step's step on `setup`, from the state the setup is in (`started`: when trace_step was
    called, which the trace's seconds count from)."""
    fake_mode, state = setup.fake_mode, setup.state
    state.settings = settings
    with fake_mode:
        state.batch = spec.make_batch(settings, STORAGE_DTYPES[settings.precision])
        state.fetched_batches = fetched_ahead(spec, settings)
        state.micro_batches_done = settings.grad_accum - 1  # the step's last micro-batch is traced
        if gradients_outlive_the_step(settings) and state.data_parallel is None:
            # Later micro-batches find every gradient allocated (they dominate the first one), and
            # so do loops that free them late or never (memplan.estimator.loop).
            for param in state.trainable:
                if state.reached is None or id(param) in state.reached:
                    param.grad = torch.zeros_like(param)
    if gradients_outlive_the_step(settings) and state.data_parallel is not None:
        with _untraced(state, spec, settings):  # (the slope's fallback to a larger batch relies on its errors)
            _gradients_as_ddp_makes_them(state, settings, fake_mode)
    keeps_tensors = settings.step is not None and keeps_tensors_across_calls(state, fake_mode)
    if keeps_tensors:
        # What the step keeps from one call to the next was made by the setup's call, at its batch size (another
        # trace's: the slope's, a search's): one more call with this batch leaves what a steady state at it finds.
        with _untraced(state, spec, settings):
            with fake_mode, real_run_paths(), target_kernels(settings), constant_item():
                iteration(state)
    previous_grads = [
        (storage_key(grad), local_tensor(grad).untyped_storage().nbytes()) for grad in current_grads(state)
    ]
    inputs = tensors_in(state.batch)
    boundaries: dict[str, int] = {}
    recorder = GraphRecorder(inputs, settings.device)
    if getattr(state.data_parallel, "swaps_storages", False):
        recorder.producers = {}
    if hasattr(state.data_parallel, "before_traced_iteration"):
        state.data_parallel.before_traced_iteration(recorder.node_count)
    if settings.step is not None:
        return trace_custom_step(spec, settings, state, fake_mode, recorder, previous_grads, started, keeps_tensors)

    def marker(phase: str) -> None:
        boundaries[phase] = recorder.node_count()

    eager_lifetimes = EagerLifetimes(recorder.node_count, recorder.aliases_of, recorder.target)
    tracker = ModuleTracker(state.built_model, recorder.node_count)
    graphs = SavedTensors(recorder.node_count, tracker.current)
    try:
        # Autocast's weight-cast cache stays on, as in the real run: EagerLifetimes records how
        # long it holds each copy (make_fx, which memplan traced with before, turned it off).
        on_target = target_kernels(settings)
        resizes_recorded = storage_resizes_recorded(recorder.node_count, state.data_parallel, recorder.stream_numbers)
        swapping = recorder.producers is not None
        swaps = parameter_data_swaps(recorder.node_count) if swapping else contextlib.nullcontext()
        with (
            fake_mode,
            tracker,
            real_run_paths(recorder.tensor_nodes, recorder.graph.nodes),
            on_target as unknown_ops,
            recorder,
            resizes_recorded as resizes,
            rng_snapshots_recorded(recorder.node_count, settings.device) as rng_snapshots,
            wrapped_numbers_recorded(recorder.node_count, settings.device, recorder) as wrapped_numbers,
            swaps as swaps_seen,
            copies_made(state.data_parallel) as host_copies,
            host_outputs_recorded() as host_outputs,
        ):
            with lifetimes_tracked(eager_lifetimes), graphs:
                micro_batch(state, marker)
            eager_lifetimes.finish()
            # What the model keeps on its modules lives through the step (memplan.estimator.module_attributes).
            on_modules = {storage_key(tensor) for tensor in attribute_tensors(state.built_model)}
            kept_on_modules = set(on_modules)
            # So do the tensors it put in transformers' lru caches (memplan.estimator.tensor_caches).
            kept_on_modules |= {storage_key(tensor) for tensor in cached_tensors()}
            # The keep-output loop's `out` lives through the step too (memplan.estimator.loop).
            kept_on_modules |= {storage_key(tensor) for tensor in tensors_held(state.kept_output)}
            # So does the loss the loop keeps bound; its graph's Nodes, and what they hold, until it goes at the step's
            # end (memplan.estimator.loop, TrainingState.kept_loss).
            kept_on_modules |= {storage_key(tensor) for tensor in tensors_held(state.kept_loss)}
            # The previous micro-batch's loss (or output) and graph are this one's twins: let go where this one's go,
            # and seen going.
            previous = _bound_across_micro_batches(state, settings)
            grads = current_grads(state)
            unreached = _unreached_state(state, settings)
            step_start = recorder.node_count()
            # No module runs in the step. A module whose forward a checkpoint's recomputation stopped
            # early (torch.utils.checkpoint stops once it has what the backward needs) never ran its
            # forward hook, and would otherwise be named as where the step's peak falls.
            tracker.stack.clear()
            tracker.transitions.append((step_start, None))
            if optimizer_replay is not None and optimizer_replay.matches(grads):
                recorder.replay(optimizer_replay, grads)
                drop_grads(state)
                recording: OptimizerRecording | None = optimizer_replay
                eager_lifetimes.local_lifetimes += optimizer_replay.local_lifetimes_from(step_start)
            else:
                recorder.recording = OptimizerRecording(grads)
                optimizer_locals = OptimizerLocals(recorder.node_count)
                with constant_item(), optimizer_locals:
                    optimizer_step(state)  # gradients live until zero_grad ends the iteration
                optimizer_locals.finish()
                recording, recorder.recording = recorder.recording, None
                recording.keep_local_lifetimes(optimizer_locals.lifetimes, step_start)
                eager_lifetimes.local_lifetimes += recording.local_lifetimes_from(step_start)
                # What outlives one trace of the fake model, besides the gradients.
                if not recording.is_replayable(model_tensors(state) + optimizer_tensors(state)) or resizes:
                    recording = None  # FSDP2's step runs on local shards a replay cannot substitute
            state.kept_loss = None  # (a replayed step did not run optimizer_step, which lets it go)
            lifetimes_seen, snapshots_seen = len(eager_lifetimes.local_lifetimes), len(rng_snapshots)
            previous_graph = [storage_key(tensor) for tensor in tensors_held(previous)]
            del previous  # its graph goes now: the finalizers say what it held
            previous_graph += [key for key, _ in eager_lifetimes.local_lifetimes[lifetimes_seen:]]
            previous_snapshots = [resize for resize in rng_snapshots[snapshots_seen:] if not resize.after_bytes]
            if swaps_seen is not None:
                # DeepSpeed's step swaps storages too (stage 3 partitions and gathers parameters):
                # watched through it, and never replayed (the recording's tensors would count as held).
                recording = None
    except MemplanError:
        raise
    except SystemExit as exit_request:
        raise exit_in_user_code(f"the training step of {spec.name}", exit_request) from exit_request
    except Exception as error:  # any failure inside the user's model becomes one clear message
        raise trace_failure(error, tracker.current(), spec, state.batch) from error
    step_end = recorder.node_count() - 1
    eager_lifetimes.local_lifetimes += [(key, step_end) for key in kept_on_modules]
    eager_lifetimes.local_lifetimes += graphs.lifetimes(step_end)
    held_at_end = storages_held_by_fake_tensors() if swaps_seen is not None else None
    graph = recorder.finish(grads)
    categories, sizes = categorize_storages(state, grads)
    for key in unreached:
        categories.pop(key, None)
        sizes.pop(key, None)
    released_early = []
    if "zero_grad" in boundaries:  # the previous gradients were dropped after the forward
        for key, nbytes in previous_grads:
            categories[key] = "gradients"
            released_early.append((key, nbytes, boundaries["zero_grad"] - 1))
    dropped = getattr(state.data_parallel, "dropped_in_step", frozenset)()
    swapped = None if swaps_seen is None else SwappedStorages(swaps_seen, held_at_end or frozenset(), dropped)
    for key in swaps_seen.entered.values() if swaps_seen is not None else ():
        if categories.get(key, "parameters") == "parameters":  # ZeRO-3's gathered parameters, whole
            categories[key] = "unsharded_parameters"
    previous_graph = [key for key in previous_graph if key not in on_modules]  # the model's, not the graph's copy
    # The previous graph's copies of the generator's state, freed as the variable is bound again (liveness reads the
    # rest).
    rebound = boundaries.get("output" if settings.loop == "keep-output" else "forward", 0)
    rng_snapshots += [
        StorageResize(PreviousMicroBatch(resize.storage), rebound, resize.before_bytes, 0)
        for resize in previous_snapshots
    ]
    observed = Observed(
        tracker,
        eager_lifetimes,
        started,
        unknown_ops,
        resizes,
        swapped,
        rng_snapshots=rng_snapshots,
        wrapped_numbers=wrapped_numbers,
        saved_packs=graphs.packs,
        previous_graph=previous_graph + [resize.storage for resize in previous_snapshots],
        previous_graph_freed_at=rebound,
    )
    if settings.device == "cuda":  # what a GPU run keeps in host memory (memplan.estimator.cuda.host_tensors)
        on_host = [*host_outputs, *optimizer_host_tensors(state.optimizer)]
        observed.host_tensors = frozenset(storage_key(tensor) for tensor in on_host)
    if getattr(state.data_parallel, "offload", False):
        rank = state.data_parallel
        optimizer_state = [local_tensor(tensor) for tensor in optimizer_tensors(state)]
        gradients = [local_tensor(grad) for grad in grads]
        observed.host = rank.host_memory(gradients, optimizer_state, host_copies)
    return traced_step_from(graph, state, boundaries, (categories, sizes), observed, recording, released_early)
