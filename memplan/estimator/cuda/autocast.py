"""CUDA's autocast policy, emulated on the fake CPU tensors memplan traces with (design.md §3).

CPU and CUDA autocast cast different ops: CUDA runs softmax, log_softmax, layer_norm, sum, exp,
pow, the losses and more in float32, and leaves ops such as `cat` or `cross_entropy_loss` alone
that CPU autocast casts. While `cuda_autocast_policy()` is active, every op that either backend
registers an autocast kernel for gets a Python AutocastCPU kernel implementing CUDA's policy for
it; leaving the context removes them and CPU autocast is itself again.

The op lists are CUDA's, from ATen/autocast_mode.h (torch 2.13): AT_FORALL_LOWER_PRECISION_FP,
AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE and
AT_FORALL_PROMOTE, plus the CUDA-only registrations in ATen/autocast_mode.cpp (cudnn convolutions,
and binary_cross_entropy, which CUDA autocast refuses), and the ops other supported releases
register besides (2.11-2.14; each noted where it is listed). The tables are the union over those
releases; what applies is what the *installed* torch registers for AutocastCUDA
(`cuda_policies()`): rms_norm runs in float32 from 2.12 on and in its input's dtype on 2.11. An op
the installed torch registers that no table knows (a newer release) is run as it comes and
reported among the estimate's unsupported ops, never guessed. tests/test_cuda_emulation.py checks
the tables against the installed torch's registrations, and each policy against CUDA autocast
itself run on fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import torch
from torch.utils._pytree import tree_map

LOWER_PRECISION = frozenset(
    """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
    linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose""".split()
)
FP32 = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
    nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
    binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
    _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    linalg_matrix_sqrth""".split()
    # linalg_matrix_sqrth: registered from 2.14 on; CUDA autocast on fake CUDA tensors (2.14.1)
    # returns float32 for a bfloat16 input.
)
FP32_SET_OPT_DTYPE = frozenset(
    """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord sum sum.dim_IntList
    prod.dim_Dimname softmax.Dimname log_softmax.Dimname cumprod.dimname cumsum.dimname
    sum.dim_DimnameList""".split()
    # The named-dimension overloads: registered by torch 2.11's CUDA build, not by 2.13's or 2.14's.
)
# Ops without a dtype argument that CUDA redispatches to the overload that has one, with float32
# (norm.names_ScalarOpt_dim: torch 2.11's CUDA build).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype",
}
PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
)
BANNED = frozenset({"binary_cross_entropy"})
# Registered by CUDA builds only (ATen/cudnn/AutocastRNN.cpp casts weights and inputs to the
# autocast dtype before cuDNN's RNN); memplan's CPU tensors never dispatch to it.
CUDA_BUILD_LOWER_PRECISION = frozenset({"_cudnn_rnn"})
# ATen/autocast_mode.cpp, the message CUDA autocast raises for binary_cross_entropy.
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def known_policies() -> dict[str, str]:
    """Every op some supported torch release's CUDA autocast has a kernel for, and its policy."""
    policies: dict[str, str] = {}
    for names, policy in (
        (LOWER_PRECISION | CUDA_BUILD_LOWER_PRECISION, "lower_precision_fp"),
        (FP32, "fp32"),
        (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
        (FP32_APPEND_DTYPE, "fp32_append_dtype"),
        (PROMOTE, "promote"),
        (BANNED, "banned"),
    ):
        policies.update(dict.fromkeys(names, policy))
    return policies


def cuda_autocast_ops() -> set[str]:
    """The ops the installed torch registers a CUDA autocast kernel for, by `name.overload`."""
    return _registered("AutocastCUDA")


def cuda_policies() -> dict[str, str]:
    """The installed torch's CUDA autocast: each op it has a kernel for that memplan knows, and its policy."""
    registered = cuda_autocast_ops()
    return {name: policy for name, policy in known_policies().items() if name in registered}


def unknown_cuda_autocast_ops() -> set[str]:
    """Ops the installed torch's CUDA autocast has a kernel for and no table of memplan's knows."""
    return cuda_autocast_ops() - set(known_policies())


# CPU autocast's own lower_precision_fp list (ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten,
# AutocastCPU)): where CUDA agrees, CPU's C++ kernel stays, keeping its cache of cast parameters.
CPU_LOWER_PRECISION = frozenset(
    """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear _convolution.deprecated matmul
    conv_tbc conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu
    scaled_dot_product_attention""".split()
)


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def autocast_eligible(value: object) -> bool:
    """autocast_mode.h is_eligible: a floating-point tensor that is not float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast_all(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    def cast(value: object) -> object:
        return value.to(dtype) if autocast_eligible(value) and value.dtype != dtype else value  # type: ignore[union-attr]

    return tree_map(cast, args), tree_map(cast, kwargs)


def _below_autocast(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return op(*args, **kwargs)


def _unknown_kernel(name: str, seen: set[str]):  # type: ignore[no-untyped-def]
    op = _overload(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        seen.add(f"aten::{name} (CUDA autocast policy unknown; run in its inputs' dtypes)")
        return _below_autocast(op, args, kwargs)

    return kernel


def _kernel(name: str, policy: str):  # type: ignore[no-untyped-def]
    op = _overload(name)
    dtype_position = next(
        (i for i, argument in enumerate(op._schema.arguments) if argument.name == "dtype" and not argument.kwarg_only),
        None,
    )

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "banned":
            raise RuntimeError(BANNED_MESSAGE)
        if policy == "lower_precision_fp":
            args, kwargs = _cast_all(args, kwargs, torch.get_autocast_dtype("cpu"))
        elif policy == "fp32":
            args, kwargs = _cast_all(args, kwargs, torch.float32)
        elif policy == "promote":
            widest = torch.get_autocast_dtype("cpu")
            for value in torch.utils._pytree.tree_leaves((args, kwargs)):
                if autocast_eligible(value):
                    widest = torch.promote_types(widest, value.dtype)
            args, kwargs = _cast_all(args, kwargs, widest)
        elif policy == "fp32_set_opt_dtype" and args and autocast_eligible(args[0]):
            # autocast_mode.h set_opt_dtype: only when the caller gave no dtype of its own.
            if dtype_position is None:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif len(args) <= dtype_position or args[dtype_position] is None:
                defaults = [argument.default_value for argument in op._schema.arguments[len(args) : dtype_position]]
                args = (*args[:dtype_position], *defaults, torch.float32, *args[dtype_position + 1 :])
        elif policy == "fp32_append_dtype" and args:
            # autocast_mode.h fp32_append_dtype: always the dtype overload, with float32 for an
            # eligible first argument and the argument's own dtype otherwise (type_from_firstarg).
            target = getattr(torch.ops.aten.norm, FP32_APPEND_DTYPE[name])
            dtype = torch.float32 if autocast_eligible(args[0]) else args[0].dtype
            # The dispatcher drops trailing arguments equal to their defaults (norm.Scalar's p=2),
            # which the dtype overload may not have: give them back before redispatching.
            positional = [argument for argument in op._schema.arguments if not argument.kwarg_only]
            args = (*args, *(argument.default_value for argument in positional[len(args) :]))
            return _below_autocast(target, args, {**kwargs, "dtype": dtype})
        return _below_autocast(op, args, kwargs)

    return kernel


def _registered(key: str) -> set[str]:
    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key(key)}


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[set[str]]:
    """While active, torch.autocast("cpu", ...) applies CUDA's op lists instead of CPU's.

    Yields the set it fills with the ops that ran under autocast whose CUDA policy memplan does
    not know (`unknown_cuda_autocast_ops`), described for the estimate's unsupported ops.
    """
    library = torch.library.Library("aten", "IMPL")
    policies = cuda_policies()
    unknown = unknown_cuda_autocast_ops()
    seen: set[str] = set()
    for name in sorted(set(policies) | unknown | _registered("AutocastCPU")):
        policy = policies.get(name)
        if policy == "lower_precision_fp" and name in CPU_LOWER_PRECISION:
            continue  # CPU's kernel already does this, with the parameter cast cache CUDA also has
        try:
            _overload(name)
        except AttributeError:
            continue  # registered under a name this torch's Python bindings do not expose
        if name in unknown:
            kernel = _unknown_kernel(name, seen)
        elif policy:
            kernel = _kernel(name, policy)
        else:
            # No CUDA kernel: the op falls through to run on its inputs as they are, and the ops it
            # decomposes into meet autocast again, as on CUDA (cross_entropy -> log_softmax, nll_loss).
            kernel = torch.library.fallthrough_kernel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
            library.impl(name, kernel, "AutocastCPU")
    with _cuda_state_reads_cpu():
        try:
            yield seen
        finally:
            library._destroy()


@contextlib.contextmanager
def _cuda_state_reads_cpu() -> Iterator[None]:
    """CUDA's autocast state is the CPU autocast that stands in for it, read and written: code that
    asks whether CUDA autocast is on (`torch.is_autocast_enabled()` without a device means CUDA's;
    peft's 4-bit LoRA layer casts its input to the adapter's dtype only where it reads False,
    peft/tuners/lora/bnb.py) gets the stand-in's state, and `torch.autocast("cuda", enabled=False)`
    (ESMFold, OneFormer) turns the stand-in off inside it and back after, as it does CUDA's. The
    real CUDA flags are never touched, so nothing outlives the trace.

    `torch.autocast("cuda", ...)` with autocast enabled (a `--step` of the user's own, `torch.cuda.amp.autocast()`)
    turns the stand-in on, in CUDA's default float16 where no dtype is given: without a GPU torch's autocast
    disables itself ("CUDA is not available ... Disabling autocast", amp/autocast_mode.py) and the step was
    traced in float32."""
    enabled, dtype, gpu_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype
    set_enabled, set_dtype = torch.set_autocast_enabled, torch.set_autocast_dtype

    def stand_in(device_type: str | None) -> str | None:
        return "cpu" if device_type in (None, "cuda") else device_type

    torch.is_autocast_enabled = lambda device_type=None: enabled(stand_in(device_type))  # type: ignore[assignment]
    torch.get_autocast_dtype = lambda device_type: dtype(stand_in(device_type))  # type: ignore[assignment]
    torch.get_autocast_gpu_dtype = lambda: dtype("cpu")  # type: ignore[assignment]
    torch.set_autocast_enabled = lambda device_type, value: set_enabled(stand_in(device_type), value)  # type: ignore[assignment]
    torch.set_autocast_dtype = lambda device_type, value: set_dtype(stand_in(device_type), value)  # type: ignore[assignment]
    autocast_class = torch.amp.autocast_mode.autocast
    autocast_init = autocast_class.__init__

    def init(
        self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, cache_enabled: Any = None
    ) -> None:
        if device_type != "cuda":
            autocast_init(self, device_type, dtype, enabled, cache_enabled)
            return
        with (
            patch.object(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False),
            patch.object(torch.cuda, "is_bf16_supported", lambda *_, **__: True),
        ):
            # CUDA autocast's default dtype is float16 (the CPU's, which stands in for it, bfloat16).
            autocast_init(self, device_type, dtype or torch.float16, enabled, cache_enabled)

    autocast_class.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype = enabled, dtype, gpu_dtype
        torch.set_autocast_enabled, torch.set_autocast_dtype = set_enabled, set_dtype
        autocast_class.__init__ = autocast_init  # type: ignore[method-assign]
