"""Names vulture (``make lint``) reports as unused that are used from outside its view.

Each entry says who uses it. vulture reads this file as code; nothing imports it.
"""
# einjoin/frontend/aten.py: parameters of ATen op signatures that the translations accept so
# that torch's calls bind (torch passes them by keyword or position; the translation ignores them).
half_to_float  # aten._softmax / aten._log_softmax
inplace  # aten.dropout(input, p, train, inplace)
enable_gqa  # aten.scaled_dot_product_attention(..., enable_gqa=)
implicit  # aten.expand(self, size, *, implicit=False)
output_size  # aten.repeat_interleave(..., output_size=)

# the context-manager protocol: __exit__(self, exc_type, exc, tb) takes all three
exc_type  # runtime/backends/ray.py: the run context's __exit__ reads only the exception
