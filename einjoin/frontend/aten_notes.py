"""What each torch-op translation of :mod:`einjoin.frontend.aten` does not cover, as data: the
notes column of ``docs/torch_ops.md`` (keyed by any of a translation's names), and the ops no
translation can cover (:data:`DATA_DEPENDENT`: a result whose size depends on the values).

>>> NOTES["div"]
"`rounding_mode` None, 'floor' or 'trunc' (an integer divisor of 0 is an error, as in torch)"
"""

from __future__ import annotations

from einjoin.errors import UnsupportedOpError

__all__ = ["NOTES", "DATA_DEPENDENT", "DATA_DEPENDENT_HELP", "data_dependent"]

# ops whose result's size (or a Python value) depends on the tensor values: a static graph cannot
# hold them, whatever the translation; named as such (with the workaround), not as "unsupported"
DATA_DEPENDENT = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique", "_unique",
                            "_unique2", "unique_consecutive", "unique_dim", "item", "_local_scalar_dense",
                            "tolist", "bincount"})
DATA_DEPENDENT_HELP = (
    "the result's size depends on the tensor values, and einjoin graphs are static. Keep shapes "
    "fixed: torch.where(mask, x, 0) or x.masked_fill(~mask, 0) and then a reduction instead of "
    "x[mask] or masked_select, a mask instead of nonzero(); a Python value read from a tensor "
    "(.item(), a branch on it) becomes an argument bound with functools.partial")


def data_dependent(what: str) -> UnsupportedOpError:
    """The error for a data-dependent shape (``what`` says which), marked so the importer can
    group it apart from unsupported ops."""
    err = UnsupportedOpError(f"{what} makes a data-dependent shape: {DATA_DEPENDENT_HELP}")
    err.data_dependent = what  # type: ignore[attr-defined]
    return err


NOTES: dict[str, str] = {
    "div": "`rounding_mode` None, 'floor' or 'trunc' (an integer divisor of 0 is an error, as in torch)",
    "floordiv": "an integer divisor of 0 is an error, as in torch",
    "fmod": "an integer divisor of 0 is an error, as in torch",
    "bitwise_and": "integer and bool tensors (a float is a DTypeError, as in torch)",
    "bitwise_or": "integer and bool tensors (a float is a DTypeError, as in torch)",
    "bitwise_xor": "integer and bool tensors (a float is a DTypeError, as in torch)",
    "bitwise_left_shift": "integer tensors; a count below 0 or of the width or more gives 0, as in torch",
    "bitwise_right_shift": "integer tensors; a count below 0 or of the width or more gives the sign fill "
                           "(0 for uint8), as in torch",
    "cummax": "O(n²) along the dim (EinSums over the mask j <= i); ties and NaN indexed as torch (the last)",
    "cummin": "O(n²) along the dim (EinSums over the mask j <= i); ties and NaN indexed as torch (the last)",
    "mean": "of float tensors, or with `dtype=` (an integer tensor is refused, as in torch)",
    "where": "the three-argument form only (`where(cond)` returns indices: data-dependent)",
    "dropout": "the identity in eval mode; in training mode a keep-mask hashed from the graph input "
               "`dropout_seed` (int64 scalar; `ej.dropout_mask`), scaled by 1 / (1 - p)",
    "native_dropout": "as `dropout` (what torch.export makes of a training-mode dropout beside a buffer "
                      "write), also returning the keep mask",
    "feature_dropout": "the identity in eval mode; an error in training mode",
    "scaled_dot_product_attention": "no `dropout_p`; `is_causal` aligns top-left as in torch",
    "slice": "a step above 1 is a select, a reshape and a select (padded past the end)",
    "index": "one 1-D integer index tensor; a boolean mask is data-dependent",
    "getitem": "ints, slices, None, Ellipsis and one 1-D integer index tensor; a boolean mask is "
               "data-dependent",
    "repeat_interleave": "an int `repeats` (a tensor of repeats is data-dependent); no `dim`: of the "
                         "flattened tensor",
    "view": "to a shape (not a dtype view)",
    "arange": "non-empty ranges",
    "_scaled_dot_product_flash_attention_for_cpu": "the output only (the logsumexp is for backward)",
    "cross_entropy": "class-index (int64) or class-probability targets, `weight`, `ignore_index`, "
                     "`label_smoothing`; a class index out of range is an error at run time (as torch)",
    "cross_entropy_loss": "as `cross_entropy`",
    "nll_loss": "class-index targets, `weight`, `ignore_index`; a class index out of range is an "
                "error at run time (as torch)",
    "nll_loss_forward": "as `nll_loss`; returns (the loss, the total weight of the counted targets)",
    "mse_loss": "no `weight`",
    "embedding": "`padding_idx` (that row gets no gradient, as torch); `max_norm` and "
                 "`scale_grad_by_freq` refused",
    "broadcast_tensors": "tensors only",
    # issue 20: routing and indexing (frontend/routing.py, aten_index.py)
    "gather": "an index outside [0, size) is an error at run time (as torch)",
    "take_along_dim": "broadcasts as torch; no `dim`: of the flattened tensors",
    "scatter": "`reduce` 'add' only (not 'multiply'); a repeated index keeps the last write (torch: "
               "unspecified; its CPU kernel keeps the last), and the overwritten `src` elements get no "
               "gradient (torch's gives each the gradient of its position); O(n·m) per row along `dim`",
    "scatter_reduce": "'sum', 'mean' (scatter-adds), 'prod', 'amax', 'amin' (an EinSum along `dim`, "
                      "O(n·m) per row)",
    "index_copy": "a repeated index keeps the last row (torch: unspecified)",
    "index_put": "without `accumulate`, a repeated index sums its writes (torch: unspecified); a bool "
                 "mask index takes one value",
    "one_hot": "`num_classes` given (-1 is data-dependent); a class outside [0, num_classes) is an "
               "error at run time (as torch)",
    "argmax": "the first occurrence; NaN counts as the largest (as torch)",
    "max": "`max(x)`, `max(x, dim, keepdim)` (values and the first maximum's index; the gradient goes "
           "to that element, as torch) and `max(a, b)`",
    "cumsum": "an EinSum over the mask j <= i (O(n²) per row, exact, decomposable); ints and bools "
              "give int64, a `dtype=` that dtype (wrapping, as torch)",
    "pad": "modes constant, reflect, replicate, circular; a negative constant pad crops",
    "masked_fill": "a number or a 0-d tensor value (taken in the input's dtype); the mask broadcasts "
                   "to the input",
    # norms, recurrences, losses (frontend/norms.py, recurrent.py, aten_nn.py)
    "batch_norm": "eval mode, or training mode without running statistics; training mode with running "
                  "statistics is refused (their in-place update is not in the graph): import in eval mode",
    "_native_batch_norm_legit_functional": "training mode returns the new running statistics (outputs 3 "
                                           "and 4)",
    "_native_batch_norm_legit": "as `batch_norm`",
    "instance_norm": "training mode with track_running_stats refused, as `batch_norm`",
    "gru": "padded tensors (not packed sequences); no dropout between layers in training mode",
    "lstm": "as `gru`; no `proj_size`",
    "linalg_vector_norm": "`ord` a number (2, 1, inf, -inf, 0, p) or 'fro'",
    "median": "over a dim: torch's index among ties (a stable sort's), the first NaN's in a row with NaNs",
    "linalg_matrix_norm": "`ord` 'fro', 1, -1, inf, -inf (the singular-value orders 'nuc', 2, -2 refused)",
    "l1_loss": "no `weight`",
    "huber_loss": "no `weight`",
    "kl_div": "`reduction` 'batchmean' too",
    "binary_cross_entropy": "each log clamped at -100, as torch",
    "_to_copy": "into int8 / int16 / int32 / int64 / uint8 as torch (later arithmetic wraps in the "
                "narrow type); uint16 / uint32 / uint64 refused (torch 2.13 has no arithmetic for them)",
    "int": "as `_to_copy`: int32",
    "round": "half to even, as torch; `decimals` of floats as torch (float32 math for 16-bit)",
}
