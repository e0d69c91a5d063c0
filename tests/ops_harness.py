"""Shared by the tests/test_ops_*.py files: import a torch module with ``ej.from_torch`` (both
capture paths), compile it for 1 and 2 devices, run it and compare with torch's own forward; and
compare ``ej.grad`` of an imported scalar with torch.autograd."""

from __future__ import annotations

import numpy as np
import torch

import einjoin as ej


def _np(v):
    v = v.detach() if isinstance(v, torch.Tensor) else v
    if isinstance(v, torch.Tensor):
        return v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
    return np.asarray(v)


def _flat(v):
    if isinstance(v, (tuple, list)):
        return [x for item in v for x in _flat(item)]
    return [v]


def assert_close(out, expected, rtol=1e-4, atol=1e-5):
    outs, exps = _flat(out), _flat(expected)
    assert len(outs) == len(exps), (len(outs), len(exps))
    for o, e in zip(outs, exps):
        o, e = _np(o), _np(e)
        assert o.shape == e.shape, (o.shape, e.shape)
        assert o.dtype == e.dtype, (o.dtype, e.dtype)
        if o.dtype.kind in "biu":
            np.testing.assert_array_equal(o, e)
        else:
            fin = np.abs(e[np.isfinite(e)])
            scale = max(1.0, float(fin.max())) if fin.size else 1.0
            np.testing.assert_allclose(o, e, rtol=rtol, atol=atol * scale)


def check_import(module, args, *, methods=("export", "fx"), devices=(1, 2), rtol=1e-4, atol=1e-5):
    """``module(*args)`` against the imported module compiled for each device count and capture
    method; returns the last TorchFunction."""
    with torch.no_grad():
        expected = module(*args)
    fn = None
    for method in methods:
        fn = ej.from_torch(module, args, method=method)
        assert fn.method == method
        for d in devices:
            out = ej.compile(fn, devices=d).run(*args)
            assert_close(out, expected, rtol, atol)
    return fn


def check_grads(module, args, *, method="export", devices=2, rtol=1e-6, atol=1e-8):
    """The gradients of the module's (scalar) output w.r.t. its parameters and its float
    arguments, by ej.grad compiled on ``devices``, against torch.autograd (float64 modules)."""
    args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)
    loss = module(*args)
    params = [p for p in module.parameters() if p.requires_grad]
    float_args = [a for a in args if a.is_floating_point()]
    want = torch.autograd.grad(loss, params + float_args, allow_unused=True)
    fn = ej.from_torch(module, tuple(a.detach() for a in args), method=method)
    (y,) = fn.outputs
    arg_inputs = [ej.frontend.Tensor(n) for n in _arg_nodes(fn, args)]
    wrt = list(fn.parameters.values()) + arg_inputs
    grads = ej.grad(y, wrt)
    prog = ej.compile(fn.with_outputs(list(grads)), devices=devices)
    got = prog.run(*(a.detach() for a in args))
    got = got if isinstance(got, (list, tuple)) else [got]
    for g, w in zip(got, want):
        w = torch.zeros_like(g) if w is None else w
        np.testing.assert_allclose(_np(g), _np(w), rtol=rtol, atol=atol)


def _arg_nodes(fn, args):
    from einjoin.ir.graph import Graph
    by_name = {}
    for o in fn.outputs:
        by_name.update(Graph([o.node]).input_by_name)
    out = []
    for name, a in zip(fn.arg_names, args):
        if a.is_floating_point():
            out.append(by_name[name])
    return out
