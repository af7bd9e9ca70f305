"""What CUDA kernels and libraries request and free within one op, beside the op's outputs: cuBLAS's
per-thread workspaces, cuDNN's convolution workspaces (the band's top), attention backward scratch,
reductions' staging buffers, embedding backward's sort and partial sums, softmax backward's product of its
gradient and output, and bitsandbytes' scratch.
Each is a registry rule of its own module (memplan.estimator.cuda, memplan.finetune.bnb_kernels); this
module finds the nodes that make them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from memplan.estimator.composite_kernels import bound_arguments, kernel_scratch_requests, may_hold_scratch
from memplan.estimator.cpu_kernels import CHUNK_CAT_OPS, chunk_cat_cast_bytes, chunk_cat_padding_bytes
from memplan.estimator.cuda.allocator import round_size
from memplan.estimator.cuda.attention_scratch import CUDNN_BACKWARD, FLASH_BACKWARD, attention_backward_scratch
from memplan.estimator.cuda.cublas import cublas_workspace_bytes
from memplan.estimator.cuda.cudnn import (
    CONV_OPS,
    CUDNN_WORKSPACE,
    CudnnSwitches,
    conv_calls,
    workspace_band_bytes,
)
from memplan.estimator.cuda.embedding_backward import EMBEDDING_DENSE_BACKWARD, embedding_backward_requests
from memplan.estimator.cuda.layer_norm_backward import LAYER_NORM_BACKWARD, gamma_beta_partials
from memplan.estimator.cuda.reductions import reduction_of
from memplan.estimator.cuda.softmax_backward import SOFTMAX_BACKWARD_OPS, softmax_backward_requests
from memplan.estimator.liveness import fake_args, op_name, round_for_device
from memplan.estimator.opgraph import OpNode
from memplan.estimator.oprules.dtypes import MATMUL_OPS
from memplan.estimator.timeline import SizedCall
from memplan.estimator.traced_step import TracedStep
from memplan.finetune.bnb_kernels import gemm_4bit_scratch, int8_scratch, is_gemm_4bit, is_int8_op
from memplan.gpus import DEFAULT_GPU, gpu_named
from memplan.settings import TrainingSettings

# Ops that call cuBLAS on CUDA (aten/src/ATen/native/cuda/Blas.cpp): the matrix products, and addmm fused with its
# activation.
CUBLAS_OPS = MATMUL_OPS | {torch.ops.aten._addmm_activation.default}


ATTENTION_BACKWARD_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
}


def cublas_workspaces(traced: TracedStep) -> list[int]:
    """The cuBLAS workspaces a CUDA step holds: one per thread that runs a matmul.

    cuBLAS handles and their workspaces are per thread (CublasHandlePool.cpp), and the autograd
    engine runs CUDA backward formulas on its own device thread, so a step whose forward (or
    optimizer) and backward both multiply matrices holds two. They persist from the first step on.
    """
    if traced.settings.device != "cuda":
        return []
    capability = gpu_named(traced.settings.gpu or DEFAULT_GPU).compute_capability
    size = round_size(
        cublas_workspace_bytes(capability, traced.settings.cublas_workspace_config), traced.settings.allocator_config
    )
    return [size] * len(first_matmuls(traced))


def first_matmuls(traced: TracedStep) -> list[int]:
    """Per thread that multiplies matrices (the main thread's forward and optimizer step, then the
    autograd engine's device thread's backward), the index of its first matmul node: where the
    first iteration asks for that thread's cuBLAS workspace. The handle, and the workspace with it,
    is made on the thread's first cuBLAS call (getCurrentCUDABlasHandle, CublasHandlePool.cpp),
    once the op has allocated its output, and is kept after that."""
    nodes = list(traced.graph.nodes)
    threads = (
        [*range(traced.forward_end), *range(traced.backward_end, len(nodes))],
        range(traced.forward_end, traced.backward_end),
    )
    firsts = (next((i for i in thread if nodes[i].target in CUBLAS_OPS), None) for thread in threads)
    return [first for first in firsts if first is not None]


class Scratch(NamedTuple):
    """A transient request a CUDA kernel makes and frees within its op."""

    name: str  # what it is
    nbytes: int  # bytes requested
    # a request whose size is not affine in the batch (a reduction's staging, the embedding backward's): to be
    # sized anew at other batch sizes (SizedCall)
    sized_call: SizedCall | None = None
    # Freed before the op's next request: one of several library calls the op makes in turn (a
    # convolution backward's backward-data, then backward-weight workspace). Requests that are not
    # sequential are held together until the op ends (attention backward scratch).
    sequential: bool = False


def kernel_transients_of(
    traced: TracedStep, nodes: list[OpNode], targets: set | frozenset, rule: Callable[..., tuple[Scratch, ...]]
) -> dict[int, tuple[Scratch, ...]]:
    """`rule(node, args, settings)` for each node calling one of `targets`, by node index (cuda only;
    nodes whose rule requests nothing are left out)."""
    if traced.settings.device != "cuda":
        return {}
    transients = {}
    for index, node in enumerate(nodes):
        if node.op == "call_function" and node.target in targets:
            requests = rule(node, fake_args(node)[0], traced.settings)
            if requests:
                transients[index] = requests
    return transients


def _conv_workspace(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The workspaces (the band's top) of a convolution node's cuDNN calls: one forward; a backward
    node runs backward-data, then backward-weight, each freeing its workspace before the next starts."""
    capability = gpu_named(settings.gpu or DEFAULT_GPU).compute_capability
    cap = settings.cudnn_workspace_cap_mib
    switches = CudnnSwitches(settings.cudnn_allow_tf32, None if cap is None else cap * 2**20)
    name = f"{CUDNN_WORKSPACE} ({op_name(node)})"
    highs = (
        workspace_band_bytes(call, capability, switches)[1]
        for call in conv_calls(node.target, args, node.meta.get("val"))
    )
    return tuple(Scratch(name, high, sequential=True) for high in highs if high)


def _attention_scratch(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """What an attention backward node allocates besides its gradients (memplan.estimator.cuda.attention_scratch)."""
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    kernel = {FLASH_BACKWARD: "flash", CUDNN_BACKWARD: "cuDNN"}.get(node.target, "memory-efficient")
    splits_over = gpu.multiprocessors if settings.deterministic else None
    requests = attention_backward_scratch(node.target, args, gpu.compute_capability, splits_over)
    return tuple(Scratch(f"{kernel} attention backward scratch", nbytes) for nbytes in requests)


def _embedding_backward_scratch(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """What a dense embedding backward node sorts and sums in besides its gradient
    (memplan.estimator.cuda.embedding_backward)."""
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    calls = embedding_backward_requests(args, gpu.multiprocessors, settings.deterministic)
    return tuple(Scratch("embedding backward's sort and partial sums", call.bytes(), sized_call=call) for call in calls)


def _softmax_backward_scratch(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The gradient-times-output product and contiguous copies a (log-)softmax backward node makes besides its
    gradient (memplan.estimator.cuda.softmax_backward)."""
    grad, output = args[0], args[1]
    if not isinstance(grad, torch.Tensor) or not isinstance(output, torch.Tensor):
        return ()
    name = f"{op_name(node)}'s product and copies"
    return tuple(Scratch(name, nbytes) for nbytes in softmax_backward_requests(node.target, grad, output))


def _layer_norm_backward_partials(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The partial dgamma/dbeta buffers a tall layer norm backward sums in (memplan.estimator.cuda.
    layer_norm_backward); its contiguous copies are the composite rule's (composite_kernels.layer_group_norm)."""
    b = bound_arguments(LAYER_NORM_BACKWARD, args, {})
    input, mask = b["input"], b["output_mask"]
    if not isinstance(input, torch.Tensor):
        return ()
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    shape = list(b["normalized_shape"])
    calls = gamma_beta_partials(input, shape, b["weight"], b["bias"], list(mask), gpu.multiprocessors)
    return tuple(Scratch("layer norm backward's partial sums", call.bytes(), sized_call=call) for call in calls)


REDUCTION_OPS = {
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.sum.default,
    torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default,
    # ReduceNormKernel.cu norm_kernel_cuda_impl: `gpu_reduce_kernel<scalar_t, out_t>(iter, Norm*Ops...)`, every
    # order through Reduce.cuh with its default vt0 = input_vec_size = 4, as sum and mean. Measured on the lent H100
    # (t5-base-adafactor): torch.optim.Adafactor's column norm `grad.norm(dim=-2)` of the [32,128, 768] embedding
    # gradient requested a 138,412,032 B buffer and 24 B of semaphores, of each [3,072, 768] weight 18,874,368 B
    # and 24 B, the staging setReductionConfig plans for 768 outputs of 32,128 (3,072) inputs.
    torch.ops.aten.linalg_vector_norm.default,
}
# the position of each op's reduced dimensions among its arguments
_REDUCED_DIMS_ARG = {
    torch.ops.aten.sum.dim_IntList: 1,
    torch.ops.aten.mean.dim: 1,
    torch.ops.aten.linalg_vector_norm.default: 2,  # (self, ord, dim, keepdim, *, dtype)
}


def _reduction_staging(node: OpNode, args: tuple, settings: TrainingSettings) -> tuple[Scratch, ...]:
    """The global-memory staging of a CUDA sum, mean or vector norm (memplan.estimator.cuda.reductions)."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not source.is_contiguous() or source.dim() == 0:
        return ()
    position = _REDUCED_DIMS_ARG.get(node.target)
    dims = args[position] if position is not None and len(args) > position else None
    reduced = set(range(source.dim())) if not dims else {d % source.dim() for d in dims}
    gpu = gpu_named(settings.gpu or DEFAULT_GPU)
    reduction = reduction_of(tuple(source.shape), reduced, source.dtype, gpu.compute_capability, gpu.multiprocessors)
    if reduction is None:
        return ()
    name = f"reduction staging ({op_name(node)})"
    # Both parts always, 0 bytes where this size reduces within blocks (the replay skips 0-byte
    # requests): the same requests at every batch size, so batch lines can size them anew.
    parts = (replace(reduction, part=0), replace(reduction, part=1))
    return tuple(Scratch(name, part.bytes(), sized_call=part) for part in parts)


def library_transients(nodes: list[OpNode], device: str) -> dict[int, tuple[Scratch, ...]]:
    """What library kernels allocate inside one op: bitsandbytes' 4-bit matmul dequantizes its
    weight there on every target; its 8-bit ops, run on the cuda target only (MatMul8bitLt), keep
    their int32 products and outlier masks there (memplan.finetune.bnb_kernels); composite kernels hold their
    own ops' temporaries (memplan.estimator.composite_kernels); on the cpu target,
    FSDP2's reduce-scatter copy-in pads the gradients N does not divide (memplan.estimator.cpu_kernels)."""
    transients = {}
    for index, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if device == "cpu" and str(node.target) in CHUNK_CAT_OPS:
            args, kwargs = fake_args(node)  # (tensors, dim, num_chunks) positional; out= a kwarg
            padding = chunk_cat_padding_bytes(*args[:3])
            requests = [Scratch("chunk_cat's padded copies", padding)] if padding else []
            out = kwargs.get("out")
            if isinstance(out, torch.Tensor):  # in turn, after the padded copies: each cast's temporary
                casts = chunk_cat_cast_bytes(*args[:3], out)
                requests += [Scratch("chunk_cat's cast temporaries", nbytes, sequential=True) for nbytes in casts]
            if requests:
                transients[index] = tuple(requests)
            continue
        elif may_hold_scratch(node.target):
            args, kwargs = fake_args(node)
            held = kernel_scratch_requests(node.target, args, kwargs, device)
            scratch = [(f"{op_name(node)}'s own temporaries", nbytes) for nbytes in held]
        elif is_gemm_4bit(node.target):
            args, kwargs = fake_args(node)
            scratch = gemm_4bit_scratch(args, kwargs, device)
        elif device == "cuda" and is_int8_op(node.target):
            args, kwargs = fake_args(node)
            scratch = int8_scratch(node.target, args, kwargs)
        else:
            continue
        if scratch:
            transients[index] = tuple(Scratch(name, nbytes) for name, nbytes in scratch)
    return transients


def rounded_transients(transients: dict[int, tuple[Scratch, ...]], settings: TrainingSettings) -> dict[int, int]:
    """Bytes each node's transients add to memory_allocated while it runs: those held together, plus
    the largest of those requested in turn."""
    return {index: _node_transient_bytes(requests, settings) for index, requests in transients.items()}


def _node_transient_bytes(requests: tuple[Scratch, ...], settings: TrainingSettings) -> int:
    held = sum(round_for_device(r.nbytes, settings) for r in requests if not r.sequential)
    in_turn = max((round_for_device(r.nbytes, settings) for r in requests if r.sequential), default=0)
    return held + in_turn


def kernel_transients(
    traced: TracedStep, nodes: list[OpNode]
) -> tuple[dict[int, tuple[Scratch, ...]], dict[int, tuple[Scratch, ...]]]:
    """Each node's transients by node index: those in both ends of the cuDNN workspace band (attention
    backward scratch, reductions' staging, embedding and softmax backward's, library kernels'), and the convolutions'
    workspaces (the band's top)."""
    exact: dict[int, tuple[Scratch, ...]] = {}
    for found in (
        kernel_transients_of(traced, nodes, ATTENTION_BACKWARD_OPS, _attention_scratch),
        kernel_transients_of(traced, nodes, REDUCTION_OPS, _reduction_staging),
        kernel_transients_of(traced, nodes, {EMBEDDING_DENSE_BACKWARD}, _embedding_backward_scratch),
        kernel_transients_of(traced, nodes, SOFTMAX_BACKWARD_OPS, _softmax_backward_scratch),
        kernel_transients_of(traced, nodes, {LAYER_NORM_BACKWARD}, _layer_norm_backward_partials),
        library_transients(nodes, traced.settings.device),
    ):
        # one node can have several: a CUDA sum of a bool mask copies it to int64 (a composite kernel's
        # temporary) and then stages its reduction; each is requested, none replaces another
        for index, requests in found.items():
            exact[index] = exact.get(index, ()) + requests
    return exact, kernel_transients_of(traced, nodes, CONV_OPS, _conv_workspace)
