"""One configuration traced and simulated at any batch size (BatchTracer), the model built once under fake tensors:
the batch sizes an estimate, a sweep or a budget's search asks about, traced here or in forked children, and
answered from lines through three traced batch sizes where they agree (memplan.estimator.interpolate); the longest
sequence that fits a budget."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from memplan.choices import MAX_COUNT
from memplan.errors import SettingsError, TraceError
from memplan.estimator.interpolate import BatchLines, phase_fit_bytes, same_requests
from memplan.estimator.interpolate import fits as timeline_fits
from memplan.estimator.search import find_max_batch_size, largest_fitting, last_fitting_from
from memplan.estimator.simulate import Simulation, simulate
from memplan.estimator.timeline import MemoryTimeline, reserved_peak_bytes
from memplan.estimator.trace import build_fake_setup, trace_step
from memplan.estimator.traced_step import TracedStep
from memplan.forked import ForkedJob, ForkedJobFailed, available_cores
from memplan.interrupts import raise_if_interrupted
from memplan.models.source import ModelSpec
from memplan.settings import TrainingSettings

Progress = Callable[[str], None]
_log = logging.getLogger(__name__)


def second_batch_size(batch_size: int) -> int:
    """The other batch size traced to measure the per-sample slope."""
    return batch_size // 2 if batch_size >= 2 else 2


def confirming_batch_size(batch_size: int) -> int | None:
    """The third batch size a budget's estimate traces beside its first two, only to confirm the lines through
    them (BatchTracer.confirm_aside): twice the batch size. None where the slope's batch size is 1 (batch 1
    is never on the lines, so the two traced draw none)."""
    return 2 * batch_size if batch_size // 2 > 1 else None


# A confirming trace is a third process beside the estimate's two: forked where each has a core of its own. On two
# cores the three would share them, and where the search needs no lines (its guess is batch 1) it is a loss.
CONFIRM_ASIDE_CORES = 3


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
        self.interpolated_timelines: dict[int, MemoryTimeline] = {}  # batch size -> its timeline, from the lines
        self.interpolated: dict[int, dict[str, int]] = {}  # batch size -> fit_phase_peaks, from its timeline
        self._slope_batch_size: int | None = None
        self._aside: dict[int, ForkedJob] = {}  # batch size -> its trace and simulation in a forked child
        self._confirming: int | None = None  # the batch size confirm_aside traces in a forked child
        self.confirming: dict[int, Simulation] = {}  # traced only to confirm the lines: no point of the search

    def trace_aside(self, batch_size: int, device_fit: bool = False) -> None:
        """Start tracing and simulating `batch_size` in a forked child (memplan.forked.ForkedJob) while this
        process traces another: on two cores, an estimate's two batch sizes in about the time of one.
        simulate() collects it, and traces here instead where the child could not; close() stops it. A
        child forked before the first trace here traces the optimizer step itself; one forked after it
        replays that trace's recording of it, as a trace here does: the same requests
        (memplan.estimator.replay). With `device_fit` the child also finds the step's
        least device memory (Simulation.smallest_device_bytes, a bisection of allocator replays that the
        batch search reads at both batch sizes), which comes back with the simulation."""
        if batch_size in self.simulations or batch_size in self._aside or not ForkedJob.can_start():
            return
        settings = self.settings.replace(batch_size=batch_size)

        # A child forked after the first trace replays its optimizer step, as a trace here would.
        replay = self.first.optimizer_recording if self.first else None

        def job() -> Simulation:
            simulation = simulate(trace_step(self.spec, settings, self.setup, replay))
            if device_fit:
                _ = simulation.smallest_device_bytes  # a cached_property: pickled with the simulation
            return simulation

        self._aside[batch_size] = ForkedJob(job)

    def confirm_aside(self, batch_size: int) -> None:
        """Where a third core is free, trace `batch_size` in a second forked child only to confirm the lines
        through the two batch sizes traced here and beside (max_batch_size), so the search answers its first
        guess from them instead of tracing it after the two. It joins no search: the search starts from the same
        points and takes the same steps, each answered as the confirmed lines answer every later one."""
        if available_cores() < CONFIRM_ASIDE_CORES or batch_size in self._aside:
            return
        self.trace_aside(batch_size)
        if batch_size in self._aside:
            self._confirming = batch_size

    def traces_here(self, batch_size: int) -> bool:
        """Whether answering `batch_size` takes a trace in this process: it is neither traced nor tracing in a
        forked child, and no confirmed lines answer it (batch size 1 never is on them)."""
        if batch_size in self.simulations or batch_size in self._aside:
            return False
        return self.lines is None or batch_size == 1

    def close(self) -> None:
        """Stop the forked traces nobody collected (the estimate failed or was interrupted before it needed them)."""
        for job in self._aside.values():
            job.cancel()
        self._aside.clear()

    def _collected(self, batch_size: int) -> Simulation | None:
        job = self._aside.pop(batch_size, None)
        if job is None:
            return None
        try:
            return job.result()
        except ForkedJobFailed as failure:  # whatever it was, the trace here says it again, or succeeds
            _log.debug("batch size %d traced in this process: the forked trace failed (%s)", batch_size, failure)
            return None

    def _on_lines(self, batch_size: int) -> MemoryTimeline | None:
        """The batch size's timeline from the confirmed lines; None where it takes a trace (no lines yet, a batch
        size traced already, batch 1, which can take shortcuts and is never on them, or one whose requests would
        not be whole bytes)."""
        if batch_size in self.simulations or self.lines is None or batch_size == 1:
            return None
        if batch_size not in self.interpolated_timelines:
            raise_if_interrupted()
            timeline = self.lines.timeline_at(batch_size)
            if timeline is None:
                return None
            self.interpolated_timelines[batch_size] = timeline
        return self.interpolated_timelines[batch_size]

    def fit_phase_peaks(self, batch_size: int) -> dict[str, int]:
        timeline = self._on_lines(batch_size)
        if timeline is None:
            return self.simulate(batch_size).fit_phase_peaks
        if batch_size not in self.interpolated:
            self.interpolated[batch_size] = phase_fit_bytes(timeline, self.settings)
        return self.interpolated[batch_size]

    def fits(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether this batch size fits the budget, decided at the budget itself (Simulation.fits_within),
        from the confirmed lines where they answer it (a replay at the budget: no device figure is needed)."""
        timeline = self._on_lines(batch_size)
        if timeline is None:
            return self.simulate(batch_size).fits_within(budget_bytes)
        return timeline_fits(timeline, self.settings, budget_bytes)

    def fit_bytes(self, batch_size: int) -> int:
        return max(self.fit_phase_peaks(batch_size).values())

    def figures(self, batch_size: int) -> BatchFigures:
        """The batch size's peak, reserved peak and least device memory: from the confirmed lines
        where they answer it, else from a trace."""
        self.fit_phase_peaks(batch_size)
        timeline = self._on_lines(batch_size)
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
            if batch_size in self._aside:
                self.report(f"tracing batch size {batch_size} in a forked process (trace {len(self.simulations) + 1})")
            collected = self.confirming.pop(batch_size, None) or self._collected(batch_size)
            if collected is not None:
                self.simulations[batch_size] = collected
            else:
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
        if self.lines is None and len(self.simulations) >= 3:
            fitted = [batch for batch in self.simulations if batch != batch_size and batch > 1][:2]
            self._keep_lines(fitted, batch_size, self.simulations[batch_size].timeline)

    def _keep_lines(self, fitted: list[int], batch_size: int, timeline: MemoryTimeline) -> None:
        """Keep the lines through the two `fitted` batch sizes' timelines where `batch_size`'s lies on them."""
        if len(fitted) < 2:
            return
        cuda = self.settings.device == "cuda"
        timelines = ((batch, self.simulations[batch].timeline) for batch in fitted)
        lines = BatchLines.fit(*timelines, allocator=self.settings.allocator_config if cuda else None)
        predicted = lines.timeline_at(batch_size) if lines is not None else None
        if predicted is not None and same_requests(predicted, timeline):
            self.lines = lines

    def _confirm_aside_lines(self) -> None:
        """confirm_aside's trace, collected: the lines through the two traced batch sizes where it lies on them."""
        batch_size, self._confirming = self._confirming, None
        if batch_size is None or self.lines is not None or batch_size not in self._aside:
            return
        simulation = self._collected(batch_size)
        if simulation is not None:
            self.confirming[batch_size] = simulation  # a trace that ran: simulate() takes it where asked
            self._keep_lines([batch for batch in self.simulations if batch > 1][:2], batch_size, simulation.timeline)

    def max_batch_size(self, budget_bytes: int) -> int:
        """The largest batch size that fits the budget: the search runs on fit_bytes (on cuda the
        least memory each step completes in), the answer is checked at the budget itself (fits)."""
        if len(self.simulations) < 2:  # the search starts from two traced batch sizes
            self.simulate(self.settings.batch_size)
        if len(self.simulations) < 2:
            self.slope_batch_size()
        self._confirm_aside_lines()
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
            try:
                # A length the model does not take fits no budget (Whisper's encoder takes one mel length; a CTC
                # head's labels need as many frames): refused as a --seq-len of it would be, not traced.
                candidate = tracer.spec.settings_for(settings.replace(seq_len=seq_len))
            except SettingsError:
                fit[seq_len] = False
                return False
            tracer.report(f"tracing sequence length {seq_len} (trace {len(tracer.simulations) + len(fit)})")
            # The sequence length cannot change the optimizer step: replay it (memplan.estimator.replay).
            replay = tracer.first.optimizer_recording if tracer.first else None
            traced = trace_step(tracer.spec, candidate, tracer.setup, replay)
            fit[seq_len] = simulate(traced).fits_within(budget_bytes)
        return fit[seq_len]

    found = largest_fitting(settings.seq_len, fits, limit)
    return found, found == limit, len(fit) - 1
