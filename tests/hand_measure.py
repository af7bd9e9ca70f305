"""One training step run for real on the CPU and measured, written in plain PyTorch (no memplan loop code)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch.profiler import profile, record_function

from memplan.measure.collector import collector_held
from memplan.measure.cpu import LiveStorageCounter
from memplan.profiled_allocations import AllocationRecording, allocations_recorded


def measured_step_peak(
    step: Callable[[torch.nn.Module, dict, torch.optim.Optimizer], None],
    model: torch.nn.Module,
    batch: dict,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Peak live tensor-storage bytes of the second call of step(model, batch, optimizer): the first
    creates the optimizer state; whatever it leaves (gradients included) is live as the second starts."""
    step(model, batch, optimizer)
    counter = LiveStorageCounter()
    for tensor in [*model.parameters(), *model.buffers(), *batch.values()]:
        counter.add_static(tensor)
    for state in optimizer.state.values():
        for value in state.values():
            counter.add_static(value)
    for param in model.parameters():
        if param.grad is not None:
            counter.add_live(param.grad)  # the previous step's gradients, where the step kept them
    with collector_held(), counter:
        step(model, batch, optimizer)
    return counter.peak_bytes


def profiled_third_iteration_peak(build: Callable[[], Callable[[], None]], onednn: bool = False) -> int:
    """Peak bytes, by torch's CPU allocator's own allocation and free events (the profiler's, which see
    what no dispatch mode does: FSDP2's storage resizes), during the third of three iterations.
    `build()` makes the model and optimizer under the profiler and returns one iteration; the first
    two warm up; the collector is held during the third."""
    return peak_in_window(profiled_third_iteration(build, onednn), "measured")


def profiled_third_iteration(build: Callable[[], Callable[[], None]], onednn: bool = False) -> AllocationRecording:
    """The allocator's events of profiled_third_iteration_peak's run (recorded as torch.profiler's memory profile
    records them, memplan.profiled_allocations), the third iteration in record_function("measured").

    Run with oneDNN off: on CPUs with AVX512-FP16 or AMX (some of this project's machines), oneDNN's 16-bit
    matmuls take scratch from the CPU allocator inside the kernel (a 64×64×256 float16 product: 67,328 B beside
    its 32,768 B output), which memplan's cpu target does not model (docs/concepts.md); the reference BLAS path
    that runs them with oneDNN off takes none, on any CPU, so the measurement is of the tensors alone. `onednn=True`
    measures a run as torch's default has it (benchmarks/cpu_onednn_convolutions.py)."""
    gc.collect()
    with torch.backends.mkldnn.flags(enabled=onednn), allocations_recorded() as recording:
        iteration = build()
        iteration()
        iteration()
        gc.collect()
        gc.disable()
        try:
            with record_function("measured"):
                iteration()
        finally:
            gc.enable()
    return recording


def _events(recording: AllocationRecording | profile) -> list:
    """The events of torch's own results object, of memplan's recording or of torch.profiler's profile."""
    owner = recording if isinstance(recording, AllocationRecording) else recording.profiler
    return owner.kineto_results.events()


def allocator_events(recording: AllocationRecording | profile) -> list:
    """The CPU allocator's events ("[memory]") in the order they happened (read here, not with memplan's own
    AllocationRecording.allocator_events: these are the tests' truth)."""
    events = (event for event in _events(recording) if event.name() == "[memory]")
    return sorted(events, key=lambda event: event.start_ns())


def window(recording: AllocationRecording | profile, name: str, last: bool = False) -> tuple[int, int]:
    """When the first (or last) record_function `name` began and ended, in the events' clock."""
    windows = [event for event in _events(recording) if event.name() == name]
    chosen = windows[-1] if last else windows[0]
    return chosen.start_ns(), chosen.start_ns() + chosen.duration_ns()


def peak_in_window(recording: AllocationRecording | profile, window_name: str) -> int:
    """The most bytes the CPU allocator's events had live while the record_function `window_name` ran,
    counting from when recording started."""
    start, end = window(recording, window_name)
    total = peak = 0
    for event in allocator_events(recording):
        total += event.nbytes()
        if start <= event.start_ns() <= end:
            peak = max(peak, total)
    return peak


def training_iteration(
    model: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    grad_accum: int = 1,
) -> Callable[[], None]:
    """One iteration of the canonical loop: `grad_accum` forwards and backwards (the loss divided
    when accumulating), the step, zero_grad(set_to_none=True)."""

    def iteration() -> None:
        for _ in range(grad_accum):
            loss = loss_of(model(batch), batch)
            (loss / grad_accum if grad_accum > 1 else loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return iteration


def checkpoint_each(blocks: torch.nn.ModuleList) -> None:
    """Non-reentrant checkpoints around each block's forward, as memplan's --checkpoint all runs them: the RNG
    state preserved (torch's default), whose copy of the CPU generator's state (5,056 B a checkpoint) memplan
    counts on the cpu target (memplan/estimator/rng_snapshots.py)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)


def profiled_causal_lm_peak(
    model_of: Callable[[], torch.nn.Module],
    batch_of: Callable[[], dict],
    optimizer_of: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """The canonical loop's third iteration of a Hugging Face model that returns its own loss (`model(**batch).loss`,
    any head), `optimizer_of` (AdamW) over its trainable parameters, model and batch made inside the profiled
    window's build; the forward under CPU autocast to `autocast_dtype` where one is given (memplan's amp-bf16)."""

    def build() -> Callable[[], None]:
        torch.manual_seed(0)
        model = model_of().train()
        optimizer = optimizer_of([param for param in model.parameters() if param.requires_grad])
        batch = batch_of()
        build.kept = (model, optimizer, batch)  # type: ignore[attr-defined]

        def iteration() -> None:
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return iteration

    return profiled_third_iteration_peak(build)


def autocast_of(precision: str) -> torch.dtype | None:
    """The dtype memplan's precision runs the forward's autocast in on the cpu target (amp-bf16), or None."""
    return torch.bfloat16 if precision == "amp-bf16" else None


def held_beside_outputs(call: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held during `call()` beyond its outputs (all outputs live at its end), by its
    own events: what a kernel holds inside itself."""
    with allocations_recorded() as recording:
        outputs = call()  # kept: their bytes are the total at the end
    total = peak = 0
    for event in allocator_events(recording):
        total += event.nbytes()
        peak = max(peak, total)
    del outputs
    return peak - total


def trainer_third_step_peak(
    model_dir: str, auto_class: str = "AutoModelForCausalLM", seq_len: int = 32, **arguments
) -> int:
    """Peak bytes, by the CPU allocator's own profiler events, during the third step of transformers' own Trainer
    (its loop, accelerate's preparation of the model and batches) on the CPU, over a model built from the config in
    `model_dir` with `auto_class`, trained on random token batches (input_ids and labels) with TrainingArguments
    `arguments`; oneDNN off, as profiled_third_iteration says why."""
    import tempfile

    import transformers
    from transformers import AutoConfig, Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict:
            ids = torch.randint(0, 100, (seq_len,))
            return {"input_ids": ids, "labels": ids}

    window: list = []

    class ThirdStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                gc.collect()
                gc.disable()
                window.append(record_function("third step"))
                window[0].__enter__()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if window and state.global_step == 3:
                window[0].__exit__(None, None, None)
                gc.enable()

    training_arguments = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=3, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, **arguments,
    )  # fmt: skip
    torch.manual_seed(0)
    gc.collect()
    with torch.backends.mkldnn.flags(enabled=False), allocations_recorded() as recording:
        model = getattr(transformers, auto_class).from_config(AutoConfig.from_pretrained(model_dir))
        Trainer(model=model, args=training_arguments, train_dataset=Tokens(), callbacks=[ThirdStep()]).train()
    return peak_in_window(recording, "third step")
