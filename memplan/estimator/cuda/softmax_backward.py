"""What CUDA's softmax and log-softmax backward allocate inside themselves besides the gradient they return.

The traced ops, `_softmax_backward_data(grad_output, output, dim, input_dtype)` and
`_log_softmax_backward_data(...)`, produce only `grad_input` on fake tensors. On a GPU (torch 2.11-2.14,
aten/src/ATen/native/cuda/SoftMax.cu) both are structured kernels, so `grad_input` is allocated first, then:
- `softmax_backward_cuda_out`: `Tensor tmp = grad * output;` before it calls `host_softmax_backward(tmp, output,
  ...)`: a TensorIterator product of the incoming gradient and the saved softmax output, in their promoted dtype
  and the layout TensorIterator gives it (contiguous for contiguous operands), held until the op returns;
  `log_softmax_backward_cuda_out` passes `grad` itself, making no such product;
- `host_softmax_backward`: `grad_.contiguous()` and `output_.contiguous()`, a copy of each that is not contiguous
  (a tensor of no dimensions is viewed, not copied), held until it returns; nothing when the gradient is empty.
Every request is freed when the op returns. The CPU kernel (aten/src/ATen/native/SoftMax.cpp) computes the product
inside its vectorized loop and makes no such tensor, so this is the cuda target's only.

Measured on the lent H100 (torch 2.11.0+cu130; docs/validation/h100/traces-main.tar.gz): each softmax backward
of gpt2-eager-attention (4 x 12 heads x 1024 x 1024 float32 scores under bf16 autocast) requested 201,326,592 B
for `grad_input`, then 201,326,592 B more, freed at once; qwen2.5-0.5b-fp32's math attention (2 x 14 x 2048 x
2048 float32) 469,762,048 B twice, the second freed first; t5-small-amp-bf16's 268,435,456 B likewise.
"""

from __future__ import annotations

import torch

from memplan.estimator.memory_formats import meta_like

SOFTMAX_BACKWARD = torch.ops.aten._softmax_backward_data.default
LOG_SOFTMAX_BACKWARD = torch.ops.aten._log_softmax_backward_data.default
SOFTMAX_BACKWARD_OPS = frozenset({SOFTMAX_BACKWARD, LOG_SOFTMAX_BACKWARD})


def _copy_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor.contiguous()` requests: a copy unless it is contiguous or has no dimensions."""
    if tensor.dim() == 0 or tensor.is_contiguous():
        return 0
    return tensor.numel() * tensor.element_size()


def softmax_backward_requests(op: object, grad: torch.Tensor, output: torch.Tensor) -> tuple[int, ...]:
    """Bytes of each request one CUDA (log-)softmax backward makes after its `grad_input`, in order, all held until
    it returns (module docstring); () where it makes none."""
    requests = []
    if op is SOFTMAX_BACKWARD:
        tmp = meta_like(grad) * meta_like(output)  # TensorIterator's dtype and layout, as the kernel's product has them
        requests.append(tmp.numel() * tmp.element_size())
        grad = tmp
    if grad.numel() == 0:
        return tuple(nbytes for nbytes in requests if nbytes)
    requests += [_copy_bytes(grad), _copy_bytes(output)]
    return tuple(nbytes for nbytes in requests if nbytes)
