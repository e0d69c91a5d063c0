"""prog.save / ej.load of a program whose module holds a sparse buffer (a GNN's adjacency): its
COO arrays are written with the program's arrays (safetensors) and fed as a SparseTensor after
loading; a fresh process loads and runs it to torch's values (issue 24)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

import einjoin as ej

torch = pytest.importorskip("torch")


class _Gcn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, 9, (2, 20), generator=g)
        self.register_buffer("adj", torch.sparse_coo_tensor(idx, torch.rand(20, generator=g), (9, 9)).coalesce())
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adj, self.lin(x))


def test_a_program_with_a_sparse_buffer_saves_and_loads_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    m = _Gcn()
    x = torch.randn(9, 4)
    prog = ej.compile(ej.from_torch(m, x))
    path = tmp_path / "gcn.ej"
    prog.save(path)
    want = m(x).detach().numpy()
    np.testing.assert_allclose(np.asarray(ej.load(path).run(x)), want, rtol=1e-5, atol=1e-6)
    np.save(tmp_path / "x.npy", x.numpy())
    code = ("import numpy as np, einjoin as ej, sys; p = sys.argv[1]; "
            "out = ej.load(p + '/gcn.ej').run(np.load(p + '/x.npy')); np.save(p + '/out.npy', np.asarray(out))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-5, atol=1e-6)
