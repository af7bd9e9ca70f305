"""CUDA emulation on fake CPU tensors, checked against PyTorch's own CUDA tables and rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.compat import torch_release
from memplan.estimator.cuda import autocast as autocast_module
from memplan.estimator.cuda.autocast import cuda_autocast_policy, cuda_policies, unknown_cuda_autocast_ops
from memplan.estimator.cuda.kernels import cuda_kernels, select_sdpa_backend
from memplan.estimator.simulate import simulate
from memplan.estimator.trace import trace_step
from memplan.models.source import resolve_model
from memplan.settings import TrainingSettings

BF16, F32 = torch.bfloat16, torch.float32


def test_policy_tables_cover_exactly_the_ops_cuda_autocast_registers() -> None:
    registered = {
        name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    }
    assert set(cuda_policies()) == registered
    assert unknown_cuda_autocast_ops() == set()


def test_rms_norm_follows_the_installed_release() -> None:
    # torch 2.11's CUDA autocast has no rms_norm kernel (it runs in its input's dtype); 2.12 and
    # later run it in float32. The policy must be the installed release's, not the newest table's.
    registered = "aten::rms_norm" in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    assert ("rms_norm" in cuda_policies()) == registered
    assert registered == (torch_release(torch.__version__) >= (2, 12))


def test_an_autocast_op_memplan_does_not_know_is_reported(tiny_model_dirs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # As if a newer torch registered log_softmax for CUDA autocast and no table knew its policy.
    known = autocast_module.known_policies()
    monkeypatch.setattr(
        autocast_module, "known_policies", lambda: {k: v for k, v in known.items() if k != "log_softmax.int"}
    )
    spec = resolve_model(tiny_model_dirs["gpt2"])
    settings = spec.settings_for(TrainingSettings(batch_size=2, seq_len=64, precision="amp-bf16", device="cuda"))
    unsupported = simulate(trace_step(spec, settings)).unsupported_ops
    assert [op for op in unsupported if "log_softmax" in op] == [
        "aten::log_softmax.int (CUDA autocast policy unknown; run in its inputs' dtypes)"
    ]


def _probes(device: str) -> dict[str, Callable[[], torch.Tensor]]:
    def t(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
        return torch.empty(*shape, device=device, dtype=dtype)

    labels = torch.zeros(4, dtype=torch.long, device=device)
    return {
        "mm": lambda: torch.mm(t(4, 8), t(8, 4)),
        "bmm": lambda: torch.bmm(t(2, 4, 8), t(2, 8, 4)),
        "einsum": lambda: torch.einsum("ij,jk->ik", t(4, 8), t(8, 4)),
        "softmax": lambda: torch.softmax(t(4, 8, dtype=BF16), -1),
        "log_softmax": lambda: torch.log_softmax(t(4, 8, dtype=BF16), -1),
        "layer_norm": lambda: torch.nn.functional.layer_norm(t(4, 8, dtype=BF16), (8,)),
        "group_norm": lambda: torch.nn.functional.group_norm(t(2, 4, 8, dtype=BF16), 2),
        "sum": lambda: torch.sum(t(4, 8, dtype=BF16)),
        "sum_dim": lambda: torch.sum(t(4, 8, dtype=BF16), dim=1),
        "cumsum": lambda: torch.cumsum(t(4, 8, dtype=BF16), 1),
        "exp": lambda: torch.exp(t(4, 8, dtype=BF16)),
        "pow": lambda: torch.pow(t(4, 8, dtype=BF16), 2),
        "rsqrt": lambda: torch.rsqrt(t(4, 8, dtype=BF16)),
        "norm": lambda: torch.norm(t(4, 8, dtype=BF16)),
        "mse_loss": lambda: torch.nn.functional.mse_loss(t(4, 8, dtype=BF16), t(4, 8, dtype=BF16)),
        "cross_entropy": lambda: torch.nn.functional.cross_entropy(t(4, 8, dtype=BF16), labels),
        "cat": lambda: torch.cat([t(4, 8, dtype=BF16), t(4, 8)]),
        "stack": lambda: torch.stack([t(4, 8, dtype=BF16), t(4, 8)]),
        "addcmul": lambda: torch.addcmul(t(4, 8, dtype=BF16), t(4, 8), t(4, 8, dtype=BF16)),
        "gelu": lambda: torch.nn.functional.gelu(t(4, 8, dtype=BF16)),
        # fp32_append_dtype: norm overloads without a dtype are sent to the ones with dtype=float32.
        "norm_scalar": lambda: torch.ops.aten.norm.Scalar(t(4, 8, dtype=BF16), 2),
        "norm_dim": lambda: torch.ops.aten.norm.ScalarOpt_dim(t(4, 8, dtype=BF16), 2, [1]),
        # fp32_set_opt_dtype keeps a dtype the caller gave, as a keyword or positionally.
        "sum_with_dtype": lambda: torch.sum(t(4, 8, dtype=BF16), dtype=torch.float16),
        "softmax_with_dtype": lambda: torch.ops.aten.softmax.int(t(4, 8, dtype=BF16), -1, torch.float16),
        "cumsum_default_dtype": lambda: torch.ops.aten.cumsum.default(t(4, 8, dtype=BF16), 1),
        # An integer input is not eligible: sum runs as called.
        "sum_int64": lambda: torch.sum(t(4, 8, dtype=torch.int64)),
        # A float64 input is not eligible: norm stays in float64.
        "norm_float64": lambda: torch.ops.aten.norm.Scalar(t(4, 8, dtype=torch.float64), 3),
        # Tensors given by keyword reach the kernel positionally, and are cast like the rest.
        "layer_norm_keywords": lambda: torch.ops.aten.layer_norm.default(
            t(4, 8, dtype=BF16), [8], weight=t(8, dtype=BF16), bias=t(8, dtype=BF16)
        ),
    }


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, tuple | list) else (out,)
        self.ops.append((str(func), tuple(leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor))))
        return out


def _record(probe: Callable[[], torch.Tensor]) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    recorder = _OpRecorder()
    with recorder:
        probe()
    # The ops that make tensors, without the probe's own input factories.
    return [op for op in recorder.ops if op[1] and op[0] not in ("aten.empty.memory_format", "aten.zeros.default")]


def _cuda_autocast_reference() -> dict[str, list]:
    """CUDA autocast itself, run on fake CUDA tensors (a CPU-only torch runs forward ops there); CUDA's autocast
    state left as it was found."""
    before = torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", BF16)
        try:
            return {name: _record(probe) for name, probe in _probes("cuda").items()}
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", before)
            torch.clear_autocast_cache()


def _cpu_autocast(emulate: bool) -> dict[str, list]:
    with FakeTensorMode(), torch.autocast("cpu", dtype=BF16):
        if not emulate:
            return {name: _record(probe) for name, probe in _probes("cpu").items()}
        with cuda_autocast_policy():
            return {name: _record(probe) for name, probe in _probes("cpu").items()}


def test_emulated_policy_runs_the_same_ops_in_the_same_dtypes_as_cuda_autocast() -> None:
    reference = _cuda_autocast_reference()
    emulated = _cpu_autocast(emulate=True)
    mismatches = {name: (emulated[name], reference[name]) for name in reference if emulated[name] != reference[name]}
    assert mismatches == {}
    # Without the emulation CPU autocast differs (design.md §3): the emulation is what makes them equal.
    plain = _cpu_autocast(emulate=False)
    differing = sorted(name for name in reference if plain[name] != reference[name])
    assert {"softmax", "layer_norm", "cross_entropy", "exp"} <= set(differing)
    # And leaving the context gives CPU autocast back.
    assert _cpu_autocast(emulate=False) == plain


def test_an_autocast_a_script_opens_for_cuda_is_cuda_s_under_the_emulation() -> None:
    """`torch.autocast("cuda", ...)` (a --step's own, torch.cuda.amp.autocast()) disables itself without a GPU: a step
    that opened one was traced in float32. Under the emulation it runs CUDA's policy, in CUDA's default dtype where
    none is given; truth: CUDA autocast itself on fake CUDA tensors, and CUDA's own default dtype."""
    cuda_default = torch.get_autocast_dtype("cuda")  # read outside the emulation, which answers for CUDA inside it
    reference = _cuda_autocast_reference()
    with FakeTensorMode(), cuda_autocast_policy(), torch.autocast("cuda", dtype=BF16):
        emulated = {name: _record(probe) for name, probe in _probes("cpu").items()}
    assert {name: (emulated[name], reference[name]) for name in reference if emulated[name] != reference[name]} == {}
    with FakeTensorMode(), cuda_autocast_policy(), torch.autocast("cuda"):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == cuda_default


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it() -> None:
    """ATen/autocast_mode.cpp bans binary_cross_entropy under CUDA autocast; the emulation raises the same."""

    def probe(device: str) -> None:
        probs = torch.empty(4, device=device, dtype=BF16)
        torch.nn.functional.binary_cross_entropy(probs, torch.empty(4, device=device, dtype=BF16))

    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        try:
            with pytest.raises(RuntimeError) as cuda_error:
                probe("cuda")
        finally:
            torch.set_autocast_enabled("cuda", False)
    with FakeTensorMode(), torch.autocast("cpu", dtype=BF16), cuda_autocast_policy():
        with pytest.raises(RuntimeError) as emulated_error:
            probe("cpu")
    assert str(emulated_error.value) == str(cuda_error.value)
    assert "binary_cross_entropy_with_logits" in str(cuda_error.value)


def _qkv(heads: int = 4, seq: int = 128, head_dim: int = 64, dtype: torch.dtype = BF16) -> list[torch.Tensor]:
    return [torch.empty(2, heads, seq, head_dim, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "mask", "causal", "capability", "expected"),
    [
        # sdp_utils.cpp: flash needs fp16/bf16, sm80+, no mask, head_dim <= 256.
        (BF16, 64, False, True, (9, 0), "flash"),
        (torch.float16, 128, False, False, (8, 0), "flash"),
        (BF16, 256, False, True, (9, 0), "flash"),
        (BF16, 96, False, True, (9, 0), "flash"),  # padded to a multiple of 8 by attention.cpp
        # fp32, a mask or a large head dim: memory-efficient (head dim a multiple of 8 / 4 for fp32).
        (F32, 64, False, True, (9, 0), "efficient"),
        (BF16, 64, True, False, (9, 0), "efficient"),
        (F32, 64, True, False, (8, 0), "efficient"),
        (BF16, 512, False, False, (9, 0), "efficient"),
        # Before Ampere: no flash; memory-efficient has no bf16 there.
        (torch.float16, 64, False, True, (7, 5), "efficient"),
        (torch.float16, 64, False, True, (7, 0), "efficient"),
        (BF16, 64, False, True, (7, 5), "math"),
        # A head dim memory-efficient cannot align: math.
        (BF16, 300, False, False, (9, 0), "math"),
        # sm86/89 training with 192 < head_dim <= 224: not flash.
        (BF16, 200, False, False, (8, 9), "efficient"),
    ],
)
def test_sdpa_backend_selection_follows_sdp_utils(dtype, head_dim, mask, causal, capability, expected) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _qkv(head_dim=head_dim, dtype=dtype)
    attn_mask = torch.empty(2, 1, 128, 128, dtype=dtype) if mask else None
    assert select_sdpa_backend(q, k, v, attn_mask, causal, False, capability) == expected


def test_unequal_heads_need_enable_gqa() -> None:
    q = torch.empty(2, 8, 128, 64, dtype=BF16)
    k = v = torch.empty(2, 2, 128, 64, dtype=BF16)
    assert select_sdpa_backend(q, k, v, None, True, False) == "math"
    assert select_sdpa_backend(q, k, v, None, True) == "math"  # the flag is off unless given
    assert select_sdpa_backend(q, k, v, None, True, True) == "flash"


def test_dropout_is_the_fused_kernel_with_a_bool_mask() -> None:
    with FakeTensorMode(), cuda_kernels(None):
        x = torch.empty(16, 32, requires_grad=True)
        recorder = _OpRecorder()
        with recorder:
            torch.nn.functional.dropout(x, 0.1, training=True)
    assert ("aten.native_dropout.default", (F32, torch.bool)) in recorder.ops
    with FakeTensorMode():
        recorder = _OpRecorder()
        with recorder:
            torch.nn.functional.dropout(torch.empty(16, 32, requires_grad=True), 0.1, training=True)
    assert not any(op == "aten.native_dropout.default" for op, _ in recorder.ops)  # CPU again


def _graph_ops(model_dir: str, **settings: object) -> set[str]:
    spec = resolve_model(model_dir)
    traced = trace_step(spec, spec.settings_for(TrainingSettings(batch_size=2, seq_len=64, **settings)))
    return {str(node.target) for node in traced.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize(
    ("settings", "attention_op"),
    [
        ({"precision": "amp-bf16"}, "aten._scaled_dot_product_cudnn_attention.default"),  # H100: cuDNN first
        ({"precision": "amp-bf16", "gpu": "A100-80GB"}, "aten._scaled_dot_product_flash_attention.default"),
        ({"precision": "fp32"}, "aten._scaled_dot_product_efficient_attention.default"),
        ({"precision": "amp-bf16", "gpu": "T4"}, "aten.bmm.default"),  # sm75 has no bf16 kernel: math
        ({"precision": "amp-fp16", "gpu": "T4"}, "aten._scaled_dot_product_efficient_attention.default"),
        ({"precision": "amp-bf16", "attn_impl": "eager"}, "aten.bmm.default"),
    ],
)
def test_a_cuda_trace_runs_the_attention_kernel_cuda_would(tiny_model_dirs, settings, attention_op) -> None:  # type: ignore[no-untyped-def]
    ops = _graph_ops(tiny_model_dirs["gpt2"], device="cuda", **settings)
    assert attention_op in ops
    fused = {op for op in ops if "flash" in op or "efficient" in op}
    assert fused <= {attention_op, attention_op.replace(".default", "_backward.default")}
    assert "aten.native_dropout.default" in ops


def test_a_cpu_trace_keeps_cpu_kernels(tiny_model_dirs) -> None:  # type: ignore[no-untyped-def]
    ops = _graph_ops(tiny_model_dirs["gpt2"], device="cpu", precision="amp-bf16")
    assert not {op for op in ops if "flash" in op or "efficient" in op} - {
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    }
    assert "aten.native_dropout.default" not in ops
    assert "aten.bernoulli_.float" in ops  # CPU dropout: a mask in the input's dtype


class _CallRecorder(TorchDispatchMode):
    """Every aten call with its arguments, for checking what reaches the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append((str(func), args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def call(self, name: str) -> tuple[tuple, dict]:
        found = [(args, kwargs) for op, args, kwargs in self.calls if op == name]
        assert len(found) == 1, [op for op, _, _ in self.calls]
        return found[0]


# sm80: cuDNN attention stays last in torch's order there (check_prefer_cudnn_attention), so these
# tests see flash and memory-efficient chosen as on any GPU without that preference.
FLASH_FIRST_GPU = "A100-80GB"


def _attend(gpu: str | None, make, *, autocast: bool = False, **kwargs: object):  # type: ignore[no-untyped-def]
    """SDPA as the cuda target runs it; `make()` builds (q, k, v, extra kwargs) inside the fake mode."""
    with FakeTensorMode(), cuda_kernels(gpu):
        q, k, v, extra = make()
        recorder = _CallRecorder()
        with recorder, torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **extra, **kwargs)
    return out, recorder


def _grad(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.requires_grad_() for t in tensors]


def test_flash_gets_head_dims_padded_to_8_the_original_scale_and_returns_the_original_width() -> None:
    """attention.cpp: pad_last_dim<8> before the kernel, the scale of the unpadded head dim, slice back."""
    out, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_grad(_qkv(head_dim=60)), {}), is_causal=True, dropout_p=0.1)
    args, kwargs = recorder.call("aten._scaled_dot_product_flash_attention.default")
    assert [tuple(t.shape) for t in args[:3]] == [(2, 4, 128, 64)] * 3
    assert args[3:5] == (0.1, True) and kwargs["scale"] == pytest.approx(60**-0.5)  # dropout, causal
    assert tuple(out.shape) == (2, 4, 128, 60)
    _, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_qkv(head_dim=64), {}), scale=0.5)
    args, kwargs = recorder.call("aten._scaled_dot_product_flash_attention.default")
    assert tuple(args[0].shape) == (2, 4, 128, 64) and kwargs["scale"] == 0.5  # no padding, the caller's scale
    assert [op for op, _, _ in recorder.calls if "pad" in op or "slice" in op] == []  # no copies made


def test_autocast_casts_inputs_and_a_float_mask_before_the_kernel_is_chosen() -> None:
    _, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_qkv(dtype=F32), {}), autocast=True)
    args, _ = recorder.call("aten._scaled_dot_product_flash_attention.default")  # bf16 now: flash
    assert [t.dtype for t in args[:3]] == [BF16] * 3
    masked = lambda: (*_qkv(dtype=F32), {"attn_mask": torch.zeros(2, 1, 128, 128)})  # noqa: E731
    _, recorder = _attend(FLASH_FIRST_GPU, masked, autocast=True)
    args, _ = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert [t.dtype for t in args[:4]] == [BF16] * 4


def test_efficient_gets_a_bool_mask_as_an_additive_mask_expanded_to_every_head() -> None:
    """attention.cpp convert_boolean_attn_mask, then the kernel's (B, H, Lq, Lk) mask; logsumexp only
    when a gradient is needed."""
    masked = lambda: (*_grad(_qkv(dtype=F32)), {"attn_mask": torch.ones(2, 1, 128, 128, dtype=torch.bool)})  # noqa: E731
    _, recorder = _attend("H100", masked, dropout_p=0.2, scale=0.25)
    args, kwargs = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert args[3].dtype == F32 and tuple(args[3].shape) == (2, 4, 128, 128)
    assert args[4:6] == (True, 0.2) and kwargs["scale"] == 0.25  # logsumexp wanted, dropout
    _, recorder = _attend("H100", lambda: (*_qkv(dtype=F32), {}))
    args, _ = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert args[3] is None and args[4] is False  # no mask, no gradient wanted


def test_math_keeps_the_callers_grouped_heads_and_arguments() -> None:
    def grouped():  # type: ignore[no-untyped-def]
        return torch.empty(2, 8, 128, 64), torch.empty(2, 2, 128, 64), torch.empty(2, 2, 128, 64), {}

    out, recorder = _attend("H100", grouped, is_causal=True, enable_gqa=True, scale=0.3)
    # The math kernel is composite: its parts show the caller's arguments arrived (attention.cpp
    # scales q and k by sqrt(scale) each, builds the causal mask with tril, repeats k/v per group).
    ops = [op for op, _, _ in recorder.calls]
    scales = [args[1] for op, args, _ in recorder.calls if op == "aten.mul.Scalar"]
    assert pytest.approx(0.3**0.5) in scales and "aten.tril.default" in ops
    assert tuple(out.shape) == (2, 8, 128, 64)
    _, plain = _attend("H100", grouped, enable_gqa=True)
    assert "aten.tril.default" not in [op for op, _, _ in plain.calls]


def test_dropout_shortcuts_follow_dropout_cpp() -> None:
    """p = 0 or eval: the input itself, no op; p = 1: zeros through a multiply; else the fused kernel."""
    with FakeTensorMode(), cuda_kernels(None):
        x = torch.empty(16, 32, requires_grad=True)
        for p, train in ((0.0, True), (0.5, False)):
            recorder = _CallRecorder()
            with recorder:
                assert torch.nn.functional.dropout(x, p, training=train) is x
            assert recorder.calls == []
        recorder = _CallRecorder()
        with recorder:
            dropped = torch.nn.functional.dropout(x, 1.0, training=True)
        assert [op for op, _, _ in recorder.calls if "dropout" in op] == [] and tuple(dropped.shape) == (16, 32)
        recorder = _CallRecorder()
        with recorder:
            torch.nn.functional.dropout(x, 0.5, training=True)
        args, _ = recorder.call("aten.native_dropout.default")
        assert args[1:] == (0.5, True)


def _tensors(q_heads=4, kv_heads=4, seq=128, q_dim=64, k_dim=None, v_dim=None, dtype=BF16, kv_seq=None):  # type: ignore[no-untyped-def]
    q = torch.empty(2, q_heads, seq, q_dim, dtype=dtype)
    k = torch.empty(2, kv_heads, kv_seq or seq, k_dim or q_dim, dtype=dtype)
    v = torch.empty(2, kv_heads, kv_seq or seq, v_dim or q_dim, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("case", "tensors", "causal", "gqa", "capability", "expected"),
    [
        # flash's head-dim limit is 256 inclusive.
        ("256 flash", _tensors(q_dim=256), False, False, (9, 0), "flash"),
        ("264 not flash", _tensors(q_dim=264), False, False, (9, 0), "efficient"),
        # sm86/89/120 training: 192 < head_dim <= 224 excluded from flash, both ends checked.
        ("sm86 192 flash", _tensors(q_dim=192), False, False, (8, 6), "flash"),
        ("sm86 200 no", _tensors(q_dim=200), False, False, (8, 6), "efficient"),
        ("sm86 224 no", _tensors(q_dim=224), False, False, (8, 6), "efficient"),
        ("sm86 232 flash", _tensors(q_dim=232), False, False, (8, 6), "flash"),
        ("sm120 200 no", _tensors(q_dim=200), False, False, (12, 0), "efficient"),
        ("sm87 200 flash", _tensors(q_dim=200), False, False, (8, 7), "flash"),
        ("sm90 200 flash", _tensors(q_dim=200), False, False, (9, 0), "flash"),
        # Flash needs one head dim for q, k and v; memory-efficient needs q's = k's only.
        ("v differs", _tensors(q_dim=64, v_dim=32), False, False, (9, 0), "efficient"),
        ("k differs", _tensors(q_dim=64, k_dim=32), False, False, (9, 0), "math"),
        # Memory-efficient's alignment: a multiple of 8 (16-bit) or 4 (fp32) from sm80; 8 / 1 on sm7x.
        ("fp32 66 on A100", _tensors(q_dim=66, dtype=F32), False, False, (8, 0), "math"),
        ("fp32 68 on A100", _tensors(q_dim=68, dtype=F32), False, False, (8, 0), "efficient"),
        ("fp32 66 on V100", _tensors(q_dim=66, dtype=F32), False, False, (7, 0), "efficient"),
        ("fp16 68 on T4", _tensors(q_dim=68, dtype=torch.float16), False, False, (7, 5), "math"),
        ("fp16 72 on T4", _tensors(q_dim=72, dtype=torch.float16), False, False, (7, 5), "efficient"),
        ("fp16 68 on sm60", _tensors(q_dim=68, dtype=torch.float16), False, False, (6, 0), "efficient"),
        ("fp16 65 on sm60", _tensors(q_dim=65, dtype=torch.float16), False, False, (6, 0), "efficient"),
        ("fp32 65 on V100", _tensors(q_dim=65, dtype=F32), False, False, (7, 0), "efficient"),
        ("fp32 65 on A100", _tensors(q_dim=65, dtype=F32), False, False, (8, 0), "math"),
        ("bf16 masked sm80", _tensors(), True, False, (8, 0), "flash"),
        ("fp16 sm50", _tensors(dtype=torch.float16), False, False, (5, 0), "efficient"),
        ("fp16 sm37", _tensors(dtype=torch.float16), False, False, (3, 7), "math"),
        # Grouped heads: flash with enable_gqa when the query heads are a multiple of the key heads.
        ("gqa 8/2", _tensors(q_heads=8, kv_heads=2), True, True, (9, 0), "flash"),
        ("gqa 8/3", _tensors(q_heads=8, kv_heads=3), True, True, (9, 0), "math"),
        ("gqa without the flag", _tensors(q_heads=8, kv_heads=2), True, False, (9, 0), "math"),
        # Causal with different query and key lengths: not flash (its causal mask is top-left).
        ("causal 128/256", _tensors(kv_seq=256), True, False, (9, 0), "efficient"),
        ("not causal 128/256", _tensors(kv_seq=256), False, False, (9, 0), "flash"),
        # Shapes no fused kernel takes: empty sequences, a last dim with a stride, not 4-d.
        ("empty sequence", _tensors(seq=0), False, False, (9, 0), "math"),
        ("strided last dim", tuple(t.transpose(-1, -2) for t in _tensors(seq=64)), False, False, (9, 0), "math"),
        ("3-d", tuple(t[0] for t in _tensors()), False, False, (9, 0), "math"),
        # One 3-d operand whose sizes would otherwise pass every other check (batch 2, 4 heads).
        ("3-d query", (torch.empty(2, 4, 64, dtype=BF16), *_tensors()[1:]), False, False, (9, 0), "math"),
        ("3-d key", (_tensors()[0], torch.empty(2, 4, 64, dtype=BF16), _tensors()[2]), False, False, (9, 0), "math"),
        ("3-d value", (*_tensors()[:2], torch.empty(2, 4, 64, dtype=BF16)), False, False, (9, 0), "math"),
        ("empty query sequence", _tensors(seq=0, kv_seq=128), False, False, (9, 0), "math"),
        ("empty key sequence", (_tensors()[0], *_tensors(seq=0)[1:]), False, False, (9, 0), "math"),
        ("one-token sequence", _tensors(seq=1), False, False, (9, 0), "flash"),
        # check_last_dim_stride_equals_1: a head dim of 1 passes whatever its stride.
        (
            "head dim 1, strided",
            tuple(t.transpose(-1, -2) for t in _tensors(seq=1, q_dim=64)),
            False,
            False,
            (9, 0),
            "flash",
        ),
        ("257 not flash", _tensors(q_dim=257), False, False, (9, 0), "math"),
        ("sm86 193 no", _tensors(q_dim=193), False, False, (8, 6), "math"),
        ("sm86 225 flash", _tensors(q_dim=225), False, False, (8, 6), "flash"),
        ("bf16 264 on sm80", _tensors(q_dim=264), False, False, (8, 0), "efficient"),
        ("gqa 8/2, 5 tokens", _tensors(q_heads=8, kv_heads=2, seq=5), True, True, (9, 0), "flash"),
    ],
)
def test_sdpa_backend_boundaries(case, tensors, causal, gqa, capability, expected) -> None:  # type: ignore[no-untyped-def]
    """Each rule of sdp_utils.cpp just inside and just outside its limit (torch 2.11-2.14)."""
    q, k, v = tensors
    assert select_sdpa_backend(q, k, v, None, causal, gqa, capability) == expected, case


def test_cublas_workspace_is_32_mib_on_hopper_and_blackwell() -> None:
    """CublasHandlePool.cpp `use32mb`: ":4096:8" for compute capability major 9, 10 and 12
    (pytorch#175344), ":4096:2:16:8" elsewhere (torch 2.11-2.14)."""
    from memplan.estimator.cuda.cublas import cublas_workspace_bytes

    assert [cublas_workspace_bytes(cc) for cc in ((9, 0), (9, 1), (10, 0), (12, 0))] == [32 * 2**20] * 4
    assert [cublas_workspace_bytes(cc) for cc in ((8, 0), (8, 9), (11, 0), (7, 5))] == [
        4096 * 1024 * 2 + 16 * 1024 * 8
    ] * 4


def test_cublas_workspace_config_sets_the_size_as_torch_parses_it() -> None:
    """CublasHandlePool.cpp parseChosenWorkspaceSize: each ":SIZE:COUNT" pair adds SIZE KiB x COUNT."""
    from memplan.estimator.cuda.cublas import config_bytes, cublas_workspace_bytes

    assert config_bytes(":16:8") == 16 * 1024 * 8
    assert config_bytes(":4096:8") == 4096 * 1024 * 8
    assert config_bytes(":4096:2:16:8") == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert config_bytes("4096") is None and config_bytes("") is None  # torch warns and keeps its default
    assert cublas_workspace_bytes((9, 0), ":16:8") == 16 * 1024 * 8  # the variable beats the Hopper default
    assert cublas_workspace_bytes((8, 0), ":4096:8") == 32 * 2**20
    assert cublas_workspace_bytes((8, 0), None) == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_flash_is_called_as_attention_cpp_calls_it() -> None:
    """attention.cpp: `_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
    return_debug_mask=false, scale)`, q/k/v padded to the next multiple of 8 (58 -> 64, not 60).
    The dispatcher drops trailing arguments equal to their defaults, so a debug mask asked for
    shows as a sixth argument."""
    out, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_grad(_qkv(head_dim=58)), {}))
    args, _ = recorder.call("aten._scaled_dot_product_flash_attention.default")
    assert [tuple(t.shape) for t in args[:3]] == [(2, 4, 128, 64)] * 3
    assert args[3:] == ()  # no dropout, not causal, no debug mask
    assert tuple(out.shape) == (2, 4, 128, 58)
    _, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_grad(_qkv()), {}), is_causal=True, dropout_p=0.1)
    args, _ = recorder.call("aten._scaled_dot_product_flash_attention.default")
    assert args[3:] == (0.1, True)


def test_the_callers_flags_reach_the_backend_choice() -> None:
    """A causal call with more keys than queries is not flash's (its causal mask is top-left), and
    grouped heads reach flash only with enable_gqa."""
    longer_keys = lambda: (*_tensors(kv_seq=256), {})  # noqa: E731
    _, recorder = _attend(FLASH_FIRST_GPU, longer_keys, is_causal=True)
    args, _ = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert args[6] is True  # is_causal reaches the memory-efficient kernel too
    grouped = lambda: (*_tensors(q_heads=8, kv_heads=2), {})  # noqa: E731
    _, recorder = _attend(FLASH_FIRST_GPU, grouped, enable_gqa=True)
    recorder.call("aten._scaled_dot_product_flash_attention.default")
    with pytest.raises(RuntimeError):  # as on CUDA: unequal heads without the flag do not broadcast
        _attend(FLASH_FIRST_GPU, grouped)


def test_autocast_casts_every_floating_input_but_float64() -> None:
    """autocast_mode.h cached_cast/is_eligible: float16 inputs are cast to bfloat16 under bfloat16
    autocast (and then run flash), float64 ones are left alone (and run the math backend)."""
    half = lambda: (*_qkv(dtype=torch.float16), {"attn_mask": torch.zeros(2, 1, 128, 128, dtype=torch.float16)})  # noqa: E731
    _, recorder = _attend(FLASH_FIRST_GPU, half, autocast=True)
    args, _ = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert [t.dtype for t in args[:4]] == [BF16] * 4
    out, recorder = _attend(FLASH_FIRST_GPU, lambda: (*_qkv(dtype=torch.float64), {}), autocast=True)
    assert out.dtype == torch.float64
    assert not [
        op for op, _, _ in recorder.calls if "flash" in op or "efficient" in op or op.startswith("aten._to_copy")
    ]


def test_a_bool_mask_becomes_additive_in_the_querys_own_dtype() -> None:
    masked = lambda: (*_qkv(dtype=BF16), {"attn_mask": torch.ones(2, 1, 128, 128, dtype=torch.bool)})  # noqa: E731
    _, recorder = _attend(FLASH_FIRST_GPU, masked)
    args, _ = recorder.call("aten._scaled_dot_product_efficient_attention.default")
    assert args[3].dtype == BF16 and tuple(args[3].shape) == (2, 4, 128, 128)


def test_the_math_backend_gets_the_mask_and_runs_without_autocast() -> None:
    """On T4 (sm75) bfloat16 attention has no fused kernel: math, which gets the caller's mask and
    runs below autocast's dispatch key as on CUDA, so its matmuls stay in the float32 that
    attention.cpp upcasts 16-bit inputs to (CPU autocast would cast them back to bfloat16)."""
    masked = lambda: (*_qkv(), {"attn_mask": torch.zeros(2, 1, 128, 128, dtype=BF16)})  # noqa: E731
    _, recorder = _attend("T4", masked, autocast=True)
    adds = [args for op, args, _ in recorder.calls if op == "aten.add.Tensor"]
    assert len(adds) == 1 and tuple(adds[0][1].shape) == (2, 1, 128, 128)
    matmuls = [args for op, args, _ in recorder.calls if op == "aten.bmm.default"]
    assert len(matmuls) == 2 and all(t.dtype == F32 for args in matmuls for t in args)


def test_dropout_edges_follow_dropout_cpp() -> None:
    """Dropout.cpp: the fused kernel for any non-empty input (one element included); an empty input
    comes back as it is, whatever p; p = 1 multiplies by a zero of the input's own dtype."""
    with FakeTensorMode(), cuda_kernels(None):
        one = torch.empty(1, dtype=BF16, requires_grad=True)
        recorder = _CallRecorder()
        with recorder:
            torch.nn.functional.dropout(one, 0.5, training=True)
        recorder.call("aten.native_dropout.default")
        empty = torch.empty(0, 4, requires_grad=True)
        for p in (0.5, 1.0):
            recorder = _CallRecorder()
            with recorder:
                assert torch.nn.functional.dropout(empty, p, training=True) is empty
            assert recorder.calls == []
        x = torch.empty(16, 32, dtype=BF16, requires_grad=True)
        recorder = _CallRecorder()
        with recorder:
            dropped = torch.nn.functional.dropout(x, 1.0, training=True)
        assert dropped is not x and dropped.dtype == BF16
        args, _ = recorder.call("aten.mul.Tensor")
        assert args[0] is x and args[1].dtype == BF16 and tuple(args[1].shape) == ()


@pytest.mark.parametrize(
    ("capability", "cudnn_version", "cuda_major", "preferred"),
    [
        ((9, 0), 91900, 13, True),  # the lent H100's torch 2.11.0+cu130 (docs/validation/h100/environment.json)
        ((9, 0), 91500, 13, False),  # "cudnn_version > 91500"
        ((9, 0), 91501, 13, True),
        ((10, 0), 91900, 13, True),
        ((10, 1), 91900, 13, True),  # CUDA 13 builds: any sm10x minor
        ((10, 1), 91900, 12, False),  # CUDA 12 builds: minor 0 or 3 only
        ((10, 3), 91900, 12, True),
        ((8, 0), 91900, 13, False),
        ((12, 0), 91900, 13, False),
    ],
)
def test_cudnn_attention_comes_first_as_check_prefer_cudnn_attention_says(
    capability, cudnn_version, cuda_major, preferred, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from memplan.estimator.cuda.kernels import cudnn_attention_preferred

    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert cudnn_attention_preferred(capability, cudnn_version, cuda_major) is preferred
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert cudnn_attention_preferred(capability, cudnn_version, cuda_major) is False


def test_cudnn_attention_takes_what_can_use_cudnn_attention_accepts() -> None:
    q, k, v = _qkv(head_dim=64, dtype=BF16)
    assert select_sdpa_backend(q, k, v, None, True, False, (9, 0), True) == "cudnn"
    assert select_sdpa_backend(q, k, v, None, True, False, (9, 0), False) == "flash"  # not preferred
    assert select_sdpa_backend(q, k, v, None, True, False, (9, 0), True, deterministic=True) == "flash"
    mask = torch.zeros(2, 1, 128, 128, dtype=BF16)
    assert select_sdpa_backend(q, k, v, mask, False, False, (9, 0), True) == "cudnn"  # a mask is a bias
    assert select_sdpa_backend(q, k, v, mask.requires_grad_(), False, False, (9, 0), True) == "efficient"
    wide = _qkv(head_dim=160, dtype=BF16)  # above 128 on cuDNN 9.19: flash takes up to 256
    assert select_sdpa_backend(*wide, None, True, False, (9, 0), True) == "flash"
    odd = _qkv(head_dim=60, dtype=BF16)  # not a multiple of 8
    assert select_sdpa_backend(*odd, None, True, False, (9, 0), True) == "flash"
    q32, k32, v32 = _qkv(head_dim=64, dtype=F32)
    assert select_sdpa_backend(q32, k32, v32, None, True, False, (9, 0), True) == "efficient"
    grouped_q, grouped_kv = torch.empty(2, 8, 128, 64, dtype=BF16), torch.empty(2, 2, 128, 64, dtype=BF16)
    assert select_sdpa_backend(grouped_q, grouped_kv, grouped_kv, None, True, True, (9, 0), True) == "cudnn"
    assert select_sdpa_backend(grouped_q, grouped_kv, grouped_kv, None, True, False, (9, 0), True) == "math"


def test_cudnn_attention_is_called_as_attention_cpp_calls_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`_scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
    is_causal, return_debug_mask=false, scale)`; a bool mask arrives additive in the query's dtype."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    out, recorder = _attend("H100", lambda: (*_grad(_qkv(dtype=BF16)), {}), is_causal=True, dropout_p=0.1, scale=0.5)
    args, kwargs = recorder.call("aten._scaled_dot_product_cudnn_attention.default")
    assert args[3] is None and args[4:7] == (True, 0.1, True) and kwargs["scale"] == 0.5
    assert tuple(out.shape) == (2, 4, 128, 64)
    masked = lambda: (*_qkv(dtype=BF16), {"attn_mask": torch.ones(2, 1, 128, 128, dtype=torch.bool)})  # noqa: E731
    _, recorder = _attend("H100", masked)
    args, _ = recorder.call("aten._scaled_dot_product_cudnn_attention.default")
    assert args[3].dtype == BF16 and tuple(args[3].shape) == (2, 1, 128, 128) and args[4] is False


def test_cuda_autocast_state_is_the_cpu_stand_in_read_and_written_and_nothing_leaks():
    """Under the emulation, asking about CUDA's autocast (peft's 4-bit LoRA layer calls
    torch.is_autocast_enabled() with no device) answers for the CPU autocast standing in for it;
    `torch.autocast("cuda", enabled=False)` turns the stand-in off inside it, as on CUDA; the
    process's real CUDA autocast flags are as they were afterwards."""
    import warnings

    from memplan.estimator.cuda.autocast import cuda_autocast_policy

    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled() and torch.get_autocast_gpu_dtype() == torch.bfloat16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CUDA is not available": this machine has none
            with torch.autocast("cuda", enabled=False):
                assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled()  # outside: CUDA's own flag again
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before
