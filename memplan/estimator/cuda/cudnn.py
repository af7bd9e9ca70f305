"""cuDNN convolution workspaces on the cuda target: a band, because cuDNN picks the algorithm at run time.

What PyTorch does (aten/src/ATen/native/cudnn/Conv_v8.cpp, torch 2.11-2.14, cuDNN 9):
- Forward, backward-data and backward-weight convolutions each run one cuDNN execution plan.
  `run_conv_plan` allocates `plan.getWorkspaceSize()` bytes through the caching allocator right
  before the kernel and frees them right after: a transient request per call, counted in
  memory_allocated, that leaves its segment cached (reserved) for later requests.
- With `torch.backends.cudnn.benchmark = False` (the default) the plan is the heuristics' first
  choice (CUDNN_HEUR_MODE_INSTANT); there is no filtering by workspace size. If its workspace
  cannot be allocated (after the allocator has released its cached blocks), `try_configs` catches
  the OutOfMemoryError and tries the next configuration, down to the fallback list. So a large
  workspace does not by itself crash a step that fits without it, but when memory is free it is
  taken, and it shows in max_memory_reserved and nvidia-smi.
- With benchmark = True, `get_plans_from_find` times every candidate on one shared workspace as
  large as the largest candidate's that fits in free memory (halving on OOM), then empties the
  allocator's cache; the fastest plan then runs with its own workspace.
- The plan and its workspace size depend on the GPU, the cuDNN build and the heuristics: they
  cannot be known without the GPU. cuDNN reaches its tensor-core kernels by transforming NCHW
  operands to NHWC ("The cuDNN library may use padding, folding, and NCHW-to-NHWC
  transformations to call the Tensor Core operations", cuDNN docs, Legacy API, "Data and Filter
  Formats"), and TF32 kernels need workspace for the fp32 -> tf32 rounding of their inputs
  (tensorflow/tensorflow#56055, raising TensorFlow's cuDNN workspace limit for Ampere TF32).

So memplan predicts a band per convolution call:
- low: 0 bytes, an implicit-GEMM plan that needs no workspace (also what the OOM fallback finds);
- high: every operand of that call transformed once (input + weight + output of the forward;
  grad_output + weight + grad_input for backward-data; input + grad_output + grad_weight for
  backward-weight), where a tensor-core path needs a transformation: NCHW operands, and fp32 on
  TF32 tensor cores (Ampere and later, TF32 allowed for convolutions by default:
  torch.backends.cudnn.allow_tf32 = True). 16-bit channels-last convolutions run natively: 0.
The top of the band is what "fits" and the largest batch use (an estimate that is too low is
worse than none); both ends are reported.

The user's switches (`CudnnSwitches`, from TrainingSettings):
- `torch.backends.cudnn.allow_tf32 = False`: fp32 convolutions leave tensor cores (Conv_v8.cpp
  drops plans with CUDNN_NUMERICAL_NOTE_TENSOR_CORE for fp32 without TF32): no transformation, no band.
- CUDNN_CONV_WSCAP_DBG=N: a cuDNN library variable, read by cuDNN, not by PyTorch; the PyTorch
  docs call it the cuDNN workspace setting "per allocation" (cuda_environment_variables.rst) and
  public scripts set it in MiB. memplan caps each call's band top at N MiB. NVIDIA documents
  neither its unit nor whether it filters every engine, so this reading is unverified.
- `torch.backends.cudnn.benchmark = True`: the plan cuDNN runs is the fastest one whose workspace
  fit when it was timed, so the band stays as it is. What benchmark mode adds is a one-time search
  at each convolution shape's first call: every candidate is timed on one workspace as large as
  the largest candidate's that fits in free memory (halving on failure), then the allocator's
  cache is emptied (Conv_v8.cpp get_plans_from_find, `_cudnn_get_conv_benchmark_empty_cache`,
  default true). It never makes a step fail, but max_memory_reserved and nvidia-smi over a run can
  show up to the GPU's free memory during the first iteration; memplan says so and does not
  count it in the steady-state peak.
- Deterministic algorithms (`torch.use_deterministic_algorithms(True)`, `cudnn.deterministic`):
  Conv_v8.cpp drops plans with CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC. Deterministic plans still
  transform NCHW operands for tensor cores, so the band is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

CONV_FORWARD_OPS = frozenset({aten.convolution.default})
CONV_BACKWARD_OPS = frozenset({aten.convolution_backward.default})
CONV_OPS = CONV_FORWARD_OPS | CONV_BACKWARD_OPS


@dataclass(frozen=True)
class ConvOperands:
    """The three tensors of one cuDNN convolution call: two it reads, one it writes."""

    read_bytes: tuple[int, int]
    written_bytes: int
    dtype: torch.dtype
    channels_last: bool


def _uses_tensor_cores(dtype: torch.dtype, compute_capability: tuple[int, int]) -> bool:
    """Whether cuDNN's tensor-core kernels apply: fp16 from Volta, bf16 and TF32 (fp32) from Ampere."""
    if dtype == torch.float16:
        return compute_capability >= (7, 0)
    if dtype in (torch.bfloat16, torch.float32):
        return compute_capability >= (8, 0)
    return False


# How the timeline names a convolution's workspace request (the top of the band).
CUDNN_WORKSPACE = "cudnn workspace"


@dataclass(frozen=True)
class CudnnSwitches:
    """How the run configures cuDNN's convolutions (see the module docstring)."""

    allow_tf32: bool = True  # torch.backends.cudnn.allow_tf32
    workspace_cap_bytes: int | None = None  # CUDNN_CONV_WSCAP_DBG, in bytes


def workspace_band_bytes(
    call: ConvOperands, compute_capability: tuple[int, int], switches: CudnnSwitches = CudnnSwitches()
) -> tuple[int, int]:
    """(low, high) bytes of the workspace one convolution call may request (see the module docstring)."""
    if call.dtype == torch.float32 and not switches.allow_tf32:
        return 0, 0
    if not _uses_tensor_cores(call.dtype, compute_capability):
        return 0, 0
    native = call.channels_last and call.dtype != torch.float32  # 16-bit NHWC: no transformation
    if native:
        return 0, 0
    high = sum(call.read_bytes) + call.written_bytes
    if switches.workspace_cap_bytes is not None:
        high = min(high, switches.workspace_cap_bytes)
    return 0, high


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _channels_last(tensor: torch.Tensor) -> bool:
    """cudnn_conv_suggest_memory_format (ConvUtils.h): channels-last when input or weight is (a tensor
    contiguous both ways counts as contiguous)."""
    return tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


def conv_calls(target: object, args: tuple, output: object) -> list[ConvOperands]:
    """The cuDNN calls one traced convolution op makes: one forward, or backward-data then backward-weight."""
    if target in CONV_FORWARD_OPS:
        x, weight = args[0], args[1]
        layout = _channels_last(x) or _channels_last(weight)
        return [ConvOperands((_nbytes(x), _nbytes(weight)), _nbytes(output), x.dtype, layout)]
    if target in CONV_BACKWARD_OPS:
        grad_output, x, weight = args[0], args[1], args[2]
        output_mask = args[10]
        calls = []
        layout = _channels_last(x) or _channels_last(weight)
        if output_mask[0]:
            calls.append(ConvOperands((_nbytes(grad_output), _nbytes(weight)), _nbytes(x), x.dtype, layout))
        if output_mask[1]:
            calls.append(ConvOperands((_nbytes(x), _nbytes(grad_output)), _nbytes(weight), x.dtype, layout))
        return calls
    return []
