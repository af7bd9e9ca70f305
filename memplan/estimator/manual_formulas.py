"""The statements of manual backward formulas (C++ functions of several statements in torch/csrc/autograd/
FunctionsManual.cpp), as the trace sees their ops: a registry memplan.estimator.formula_blocks reads to let each
temporary go at its statement's end, and each named local at its scope's end."""

from __future__ import annotations

from typing import Any

import torch

# Manual formulas of several C++ statements, by autograd Node: for each variant of the function (a branch it takes),
# its statements' ops, as the trace sees them (aliases and result_type aside), in order, each with what its value is:
#   LOCAL      a named local (`auto x = ...;`), alive until its scope ends: the function's return, or the `}` of the
#              block that declares it
#   STATEMENT  a temporary, the formula's result, or assigned to a variable declared outside it (`gG = ...;`): a
#              value read after its statement lives until the statement of its last read ends
#   ARGUMENTS  the arguments of a call into a lambda whose body follows as a block: their temporaries live until the
#              call returns, past the body's statements
# and BEGIN / END around a block (an `if` body, a called lambda's body), which ends the named locals it declares; the
# block is one statement of the scope around it, which ends at its END. A temporary dies at the end of the first
# statement, at its own depth or less, that ends at or after its last read (C++ destroys a full expression's
# temporaries at its end). A variant must match the formula's last ops exactly, or the formula keeps the blocks
# formula_blocks gives it; the longest matching variant wins.
_M = torch.ops.aten
LOCAL, STATEMENT, ARGUMENTS = "local", "statement", "arguments"
BEGIN, END = "{", "}"
_Statement = tuple[tuple[Any, ...], str] | str
_FIRST_BWD_FN_GRAD_INPUT = (  # layer_norm_double_backward's lambda, called after its arguments' ops
    BEGIN,
    # auto h0 = (gamma_local * sigma2_eps_neg_1_2).div_(N);
    ((_M.mul.Tensor, _M.div_.Scalar), LOCAL),
    # auto h1 = (N * gO_local)
    #               .sub_(gO_local.sum(1, true))
    #               .sub_(
    #                   input_sub_mu.mul(sigma2_eps_neg_1) *
    #                   (gO_local * input_sub_mu).sum(1, true));   (the right operand of `*` computed first)
    (
        (
            _M.mul.Scalar,
            _M.sum.dim_IntList,
            _M.sub_.Tensor,
            _M.mul.Tensor,
            _M.sum.dim_IntList,
            _M.mul.Tensor,
            _M.mul.Tensor,
            _M.sub_.Tensor,
        ),
        LOCAL,
    ),
    # return h0 * h1;
    ((_M.mul.Tensor,), STATEMENT),
    END,
)
# norm_backward (FunctionsManual.cpp, torch 2.13), the gradient of torch.norm / torch.linalg.vector_norm for a p
# other than 0, 1, 2 and inf, from after its unsqueezes (views, before the statements). `self_scaled` and `scale_v`
# are declared at the function's start; `self.abs()`, `self.sgn()` and `self_scaled * grad` are temporaries of their
# statements. Held to the formula's end, `self.abs()` (its pow_ is in place) made an MLP whose hidden activation goes
# through torch.norm(p=3, dim=1) one activation-sized buffer high (tests/test_formula_statements.py).
_NORM_BACKWARD: tuple[tuple[_Statement, ...], ...] = (
    (  # p > 2
        # self_scaled = self * self.abs().pow_(p - 2);
        ((_M.abs.default, _M.pow_.Scalar, _M.mul.Tensor), LOCAL),
        # scale_v = grad / norm.pow(p - 1);
        ((_M.pow.Tensor_Scalar, _M.div.Tensor), LOCAL),
        # scale_v.masked_fill_(norm == 0, 0);
        ((_M.eq.Scalar, _M.masked_fill_.Scalar), STATEMENT),
        # return self_scaled * scale_v;
        ((_M.mul.Tensor,), STATEMENT),
    ),
    (  # 1 < p < 2 (the right operand first)
        # self_scaled = self.sgn() * self.abs().pow_(p - 1);
        ((_M.abs.default, _M.pow_.Scalar, _M.sgn.default, _M.mul.Tensor), LOCAL),
        ((_M.pow.Tensor_Scalar, _M.div.Tensor), LOCAL),
        ((_M.eq.Scalar, _M.masked_fill_.Scalar), STATEMENT),
        ((_M.mul.Tensor,), STATEMENT),
    ),
    (  # p < 1
        # self_scaled = self.sgn() * self.abs().pow_(p - 1).masked_fill_(self == 0, 0);
        ((_M.abs.default, _M.pow_.Scalar, _M.eq.Scalar, _M.masked_fill_.Scalar, _M.sgn.default, _M.mul.Tensor), LOCAL),
        # return self_scaled * grad * norm.pow(1 - p);
        ((_M.pow.Tensor_Scalar, _M.mul.Tensor, _M.mul.Tensor), STATEMENT),
    ),
)
# var_backward then mean_backward, as var_mean_backward (FunctionsManual.cpp, torch 2.13) runs them where both outputs'
# gradients flow (std_mean_backward's, after std_backward's `grad_var`, ends the same):
#   gself = var_backward(gvar, self, dim_opt, correction_opt, keepdim);
#     (its `return (2.0 / (rnumel - correction)) * grad * (self - self.mean(dim, true));`)
#   auto aux = mean_backward(gmean, ...);   (`sum_backward(...) / n`: an unsqueeze, an expand, the division)
#   gself = gself.defined() ? gself + aux : std::move(aux);
# Held to the formula's end, var_backward's `self - self.mean(...)` made var_mean's gradient one input-sized buffer
# high (tests/test_formula_statements.py).
_VAR_THEN_MEAN: tuple[tuple[_Statement, ...], ...] = (
    (
        ((_M.mean.dim, _M.sub.Tensor, _M.mul.Scalar, _M.mul.Tensor), STATEMENT),
        ((_M.unsqueeze.default, _M.expand.default, _M.div.Scalar), LOCAL),
        ((_M.add.Tensor,), STATEMENT),
    ),
)
MANUAL_STATEMENTS: dict[str, tuple[tuple[_Statement, ...], ...]] = {
    # gelu_double_backward (torch/csrc/autograd/FunctionsManual.cpp, torch 2.13), the gradient of gelu_backward's
    # `self`, after its `grad_output` block (`gelu_backward(grad, self, approximate)`). GCC computes an operator's
    # right operand first (`a * (b + c)`: `b + c`, then `a`).
    "GeluBackwardBackward0": (
        # approximate='none':
        #   auto input_sq = input * input;
        #   auto pdf = kBeta * at::exp(-0.5 * input_sq);
        #   auto dgrad_dInput = 2 * pdf - input_sq * pdf;
        #   auto gI = ggI * gO * dgrad_dInput;
        # Held to the formula's end, `-0.5 * input_sq`, its exp, `2 * pdf`, `input_sq * pdf` made a gradient penalty
        # through nn.GELU 19% high (tests/test_double_backward.py).
        (
            ((_M.mul.Tensor,), LOCAL),
            ((_M.mul.Scalar, _M.exp.default, _M.mul.Scalar), LOCAL),
            ((_M.mul.Tensor, _M.mul.Scalar, _M.sub.Tensor), LOCAL),
            ((_M.mul.Tensor, _M.mul.Tensor), STATEMENT),
        ),
        # approximate='tanh' (kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715; `1 / t` and `1 - t` are
        # at::empty_like(t).fill_(1).div_(t) and .sub_(t), ATen/TensorOperators.h). The quote below could not be
        # read at the v2.13.0 tag here (the stored copies lack it): it was written down from the function as known
        # and checked op for op against the trace's ops, the constants included (0.134145 = 3 kKappa):
        #   auto inner = kBeta * (input + kKappa * pow(input, 3));
        #   auto tanh_inner = at::tanh(inner);
        #   auto sech_inner = 1 / at::cosh(inner);
        #   auto f = 0.5 * input;
        #   auto g = 1 - tanh_inner * tanh_inner;
        #   auto h = kBeta * (1 + 3 * kKappa * input * input);
        #   auto f_prime_gh = 0.5 * g * h;
        #   auto g_prime = (2 * sech_inner) * (-sech_inner * tanh_inner) * h;
        #   auto g_prime_fh = f * h * g_prime;
        #   auto h_prime = 6 * kKappa * input * kBeta;
        #   auto h_prime_fg = f * g * h_prime;
        #   auto gI = ggI * gO * (2 * f_prime_gh + g_prime_fh + h_prime_fg);
        # Held to the formula's end, their temporaries (`cosh(inner)`, `tanh_inner * tanh_inner`, ...) made a gradient
        # penalty through nn.GELU(approximate='tanh') 50% high (tests/test_double_backward.py).
        (
            ((_M.pow.Tensor_Scalar, _M.mul.Scalar, _M.add.Tensor, _M.mul.Scalar), LOCAL),
            ((_M.tanh.default,), LOCAL),
            ((_M.cosh.default, _M.empty_like.default, _M.fill_.Scalar, _M.div_.Tensor), LOCAL),
            ((_M.mul.Scalar,), LOCAL),
            ((_M.mul.Tensor, _M.empty_like.default, _M.fill_.Scalar, _M.sub_.Tensor), LOCAL),
            ((_M.mul.Scalar, _M.mul.Tensor, _M.add.Scalar, _M.mul.Scalar), LOCAL),
            ((_M.mul.Scalar, _M.mul.Tensor), LOCAL),
            ((_M.neg.default, _M.mul.Tensor, _M.mul.Scalar, _M.mul.Tensor, _M.mul.Tensor), LOCAL),
            ((_M.mul.Tensor, _M.mul.Tensor), LOCAL),
            ((_M.mul.Scalar, _M.mul.Scalar), LOCAL),
            ((_M.mul.Tensor, _M.mul.Tensor), LOCAL),
            ((_M.mul.Scalar, _M.add.Tensor, _M.add.Tensor, _M.mul.Tensor, _M.mul.Tensor), STATEMENT),
        ),
    ),
    # layer_norm_double_backward (FunctionsManual.cpp, torch 2.13) with an affine LayerNorm, and only the gradient of
    # its input's gradient flowing back (ggI defined, ggG and ggB not: a gradient penalty), from after its reshapes
    # (views) and `auto mu = save_mean.to(input.scalar_type());` (no op at the same dtype). Held to the formula's
    # end, the `if (ggI.defined())` block's locals and each statement's temporaries made a gradient penalty through
    # nn.LayerNorm 21% high (tests/test_double_backward.py).
    "NativeLayerNormBackwardBackward0": (
        (
            # auto input_sub_mu = input - mu;
            ((_M.sub.Tensor,), LOCAL),
            # auto sigma2_eps_neg_1 = sigma2_eps_neg_1_2.pow(2);
            ((_M.pow.Tensor_Scalar,), LOCAL),
            # auto sigma2_eps_neg_3_2 = sigma2_eps_neg_1_2.pow(3);
            ((_M.pow.Tensor_Scalar,), LOCAL),
            # auto input_mu_sigma2_neg_3_2 = input_sub_mu * sigma2_eps_neg_3_2;
            ((_M.mul.Tensor,), LOCAL),
            # if (ggI.defined()) {
            BEGIN,
            # auto gxhat = gO * gamma_expanded;
            ((_M.mul.Tensor,), LOCAL),
            # auto gxhat_mu_sum = (gxhat * input_sub_mu).sum(1, true);
            ((_M.mul.Tensor, _M.sum.dim_IntList), LOCAL),
            # auto gxhat_sum = gxhat.sum(1, true);
            ((_M.sum.dim_IntList,), LOCAL),
            # auto ggI_sum = ggI_expanded.sum(1, true);
            ((_M.sum.dim_IntList,), LOCAL),
            # auto ggI_mu_sum = (ggI_expanded * input_sub_mu).sum(1, true);
            ((_M.mul.Tensor, _M.sum.dim_IntList), LOCAL),
            # auto all_sub = ((ggI_sum * gxhat_sum).div_(N))
            #                    .sub_((ggI_expanded * gxhat).sum(1, true))
            #                    .add_((sigma2_eps_neg_1 * gxhat_mu_sum * ggI_mu_sum)
            #                              .mul_(3. / static_cast<double>(N)));
            (
                (
                    _M.mul.Tensor,
                    _M.div_.Scalar,
                    _M.mul.Tensor,
                    _M.sum.dim_IntList,
                    _M.sub_.Tensor,
                    _M.mul.Tensor,
                    _M.mul.Tensor,
                    _M.mul_.Scalar,
                    _M.add_.Tensor,
                ),
                LOCAL,
            ),
            # auto gI_0t = (input_mu_sigma2_neg_3_2 * all_sub).div_(N);   (becomes gI, a result)
            ((_M.mul.Tensor, _M.div_.Scalar), LOCAL),
            # auto gI_1t =
            #     (ggI_mu_sum * sigma2_eps_neg_3_2).div_(N) * (gxhat_sum.div(N) - gxhat);
            ((_M.div.Scalar, _M.sub.Tensor, _M.mul.Tensor, _M.div_.Scalar, _M.mul.Tensor), LOCAL),
            # auto gI_2t = (gxhat_mu_sum * sigma2_eps_neg_3_2).div_(N) *
            #     (ggI_sum.div(N) - ggI_expanded);
            ((_M.div.Scalar, _M.sub.Tensor, _M.mul.Tensor, _M.div_.Scalar, _M.mul.Tensor), LOCAL),
            # gI = (gI_0t.add_(gI_1t).add_(gI_2t));
            ((_M.add_.Tensor, _M.add_.Tensor), STATEMENT),
            # }
            END,
            # if (gI.defined()) { gI = gI.reshape_as(input_t); }
            BEGIN,
            ((_M.view.default,), STATEMENT),
            END,
            # if (affine && ggI.defined()) {
            BEGIN,
            # gG = first_bwd_fn_grad_input(
            #     ggI_expanded, at::ones({}, sigma2_eps_neg_1_2.options()));
            ((_M.ones.default,), ARGUMENTS),
            *_FIRST_BWD_FN_GRAD_INPUT,
            # gG = (gO * gG).sum(0);
            ((_M.mul.Tensor, _M.sum.dim_IntList), STATEMENT),
            # gG = gG.reshape_as(*gamma);
            ((_M.view.default,), STATEMENT),
            # }
            END,
            # if (ggI.defined()) { ggO = first_bwd_fn_grad_input(ggI_expanded, gamma_expanded); }
            BEGIN,
            ((), ARGUMENTS),
            *_FIRST_BWD_FN_GRAD_INPUT,
            END,
            # if (ggO.defined()) { ggO = ggO.expand({M, N}).reshape_as(input_t); }   (the view reshape_as makes reads
            # as validate_outputs' own, which formula_blocks sets apart)
            BEGIN,
            ((_M.expand.default,), STATEMENT),
            END,
        ),
    ),
    # sinc_backward (FunctionsManual.cpp, torch 2.13; GCC computes the right operand first, `self_pi.sin()` before
    # `self_pi.cos()`, and a call's arguments right to left):
    #   auto self_pi = self * M_PI;
    #   auto self_squared_pi = self * self * M_PI;
    #   auto out = grad * ((self_pi * self_pi.cos()) - self_pi.sin()).div(self_squared_pi).conj();
    #   return at::where(self_squared_pi == 0.0, at::zeros({}, grad.options()), out);
    # Held to the formula's end, `self * self`, the sine, the cosine and the other temporaries of `out`'s statement made
    # an MLP through torch.sinc two activation-sized buffers high (tests/test_formula_statements.py).
    # differential_analytic_matrix_function (FunctionsManual.cpp, torch 2.11-2.14), torch.linalg.matrix_exp's gradient
    # (adjoint), on its subclass path, which the trace takes (plain_formulas):
    #   auto A = self.transpose(-2, -1).conj();      (`conj` of a real tensor is itself, no op)
    #   Tensor meta_grad;  ...  meta_grad = at::cat({at::cat({A, grad}, -1), at::cat({at::zeros_like(A), A}, -1)}, -2);
    #   return matrix_function(meta_grad).narrow_symint(-2, 0, n).narrow_symint(-1, n, n);
    # The inner cats and the zeros die with meta_grad's statement, before the [2n, 2n] exponential runs (a plain run's
    # path copies A, A and grad into `at::zeros` instead: no temporaries). Held to the formula's end, they made a
    # Linear(64, 64) through matrix_exp 81,920 B high there (tests/test_matrix_exp_scratch.py).
    "LinalgMatrixExpBackward0": tuple(
        (
            (adjoint, LOCAL),
            ((_M.cat.default, _M.zeros_like.default, _M.cat.default, _M.cat.default), LOCAL),
            ((_M.linalg_matrix_exp.default, _M.slice.Tensor, _M.slice.Tensor), STATEMENT),
        )
        for adjoint in ((_M.transpose.int,), (_M.transpose.int, _M._conj.default))
    ),
    "SincBackward0": (
        (
            ((_M.mul.Scalar,), LOCAL),
            ((_M.mul.Tensor, _M.mul.Scalar), LOCAL),
            ((_M.sin.default, _M.cos.default, _M.mul.Tensor, _M.sub.Tensor, _M.div.Tensor, _M.mul.Tensor), LOCAL),
            ((_M.scalar_tensor.default, _M.eq.Scalar, _M.where.self), STATEMENT),
        ),
    ),
    **{name: _NORM_BACKWARD for name in ("NormBackward0", "NormBackward1", "NormBackward2", "NormBackward3")},
    "LinalgVectorNormBackward0": _NORM_BACKWARD,
    "VarMeanBackward0": _VAR_THEN_MEAN,
    # renorm_backward (FunctionsManual.cpp, torch 2.13), p = 2 (norm_backward's one-statement branch). On the CPU the
    # accumulation type of float32 is float64, so `grad_output`, `self / norm` and what follows are float64:
    #   auto norm = at::linalg_vector_norm(self, p, reduce_dims, /*keepdim=*/true, /*dtype=*/acc_type);
    #   auto grad_output = (self.conj() * grad);
    #   grad_output = grad_output.sum(reduce_dims, /*keepdim=*/true, /*dtype=*/real_acc_type);  (frees the product)
    #   auto nb = norm_backward(std::move(grad_output), self, p, norm, reduce_dims, /*keepdim=*/true);
    #     (its `return grad * (self / norm).masked_fill_(norm == 0, 0);`)
    #   auto invnorm = (norm + 1e-7).reciprocal();
    #   auto grad_norm = maxnorm * invnorm * (grad - invnorm * nb);
    #   return at::where(norm > maxnorm, grad_norm.to(grad.scalar_type()), grad);
    # Held to the formula's end, `self.conj() * grad`, `self / norm` and `invnorm * nb` and `grad - ...` made an MLP
    # through torch.renorm five activation-sized float32 buffers high (tests/test_formula_statements.py).
    "RenormBackward0": (
        (
            ((_M.linalg_vector_norm.default,), LOCAL),
            ((_M.mul.Tensor,), STATEMENT),  # its value is reassigned: it dies with the statement that last reads it
            ((_M.sum.dim_IntList,), STATEMENT),  # moved into norm_backward's `grad`, gone when it returns
            ((_M.div.Tensor, _M.eq.Scalar, _M.masked_fill_.Scalar, _M.mul.Tensor), LOCAL),
            ((_M.add.Scalar, _M.reciprocal.default), LOCAL),
            ((_M.mul.Tensor, _M.sub.Tensor, _M.mul.Scalar, _M.mul.Tensor), LOCAL),
            ((_M._to_copy.default, _M.gt.Scalar, _M.where.self), STATEMENT),
        ),
    ),
    # atan2_backward (torch 2.13), as a plain run's allocator events and the trace's ops show it (the stored copies of
    # FunctionsManual.cpp read here predate its mask):
    #   auto denom = self * self + other * other;
    #   auto recip = denom.reciprocal();
    #   recip.masked_fill_(denom == 0, 0);      (plain_formulas runs the plain path's in-place op)
    #   return {output_mask[0] ? grad * other * recip : Tensor(), output_mask[1] ? grad * -self * recip : Tensor()};
    # Held to the first gradient, the mask `denom == 0` made an MLP through torch.atan2 one boolean mask high
    # (tests/test_formula_statements.py).
    "Atan2Backward0": tuple(
        (
            ((_M.mul.Tensor, _M.mul.Tensor, _M.add.Tensor), LOCAL),
            ((_M.reciprocal.default,), LOCAL),
            ((_M.eq.Scalar, _M.masked_fill_.Scalar), STATEMENT),
            (returned, STATEMENT),
        )
        for returned in (
            (_M.mul.Tensor, _M.mul.Tensor, _M.neg.default, _M.mul.Tensor, _M.mul.Tensor),  # both gradients
            (_M.mul.Tensor, _M.mul.Tensor),  # self's
            (_M.neg.default, _M.mul.Tensor, _M.mul.Tensor),  # other's
        )
    ),
    # std_mean_backward: std_backward's `auto grad_var = (grad / (result * 2)).masked_fill_(result == 0, 0);`, then
    # `return var_backward(std::move(grad_var), ...)` (whose `grad = unsqueeze_multiple(grad, ...)`, a view, comes
    # first), then as var_mean's
    "StdMeanBackward0": (
        (
            ((_M.mul.Scalar, _M.div.Tensor, _M.eq.Scalar, _M.masked_fill_.Scalar), STATEMENT),
            ((_M.unsqueeze.default,), STATEMENT),
            *_VAR_THEN_MEAN[0],
        ),
    ),
}
