"""Placement: the device of every kernel (so of every partial result) and of every output block.

A placement is plain data. ``NodePlacement.kernel_devices[i]`` is where kernel ``i`` of the node's
decomposition runs; ``homes[out_key]`` is where that output block is aggregated and lives. Placers
share one signature and one registry.

>>> import einjoin as ej
>>> from einjoin.placement import place
>>> z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
>>> d = ej.decompose(z.node, {"m": 2, "k": 2})
>>> p = place("round_robin", {z.node: d}, ej.local(4))[z.node]
>>> p.kernel_devices, p.homes
((0, 1, 1, 2), {(0, 0): 0, (1, 0): 1})

The data, the registry and the round-robin and random placers are in
:mod:`einjoin.placement.base`; the affinity-based placers in :mod:`einjoin.placement.affinity`,
the local search over placements (``"search"``) in :mod:`einjoin.placement.search` and the learned
SEL/PLC policy (``"doppler"``) in :mod:`einjoin.placement.doppler`, which register them when this
package imports them.
"""

from einjoin.placement.base import (PLACERS, NodePlacement, Placement, Placer, place,
                                    random_placement, register_placer, round_robin)
from einjoin.placement import affinity  # registers greedy, critical_path and nums
from einjoin.placement import search  # registers search (after affinity: it starts from their placements)
from einjoin.placement import doppler  # registers doppler (the learned SEL/PLC policy)
from einjoin.placement.homes import block_devices, tie_homes

__all__ = ["NodePlacement", "Placement", "Placer", "PLACERS", "place", "register_placer",
           "round_robin", "random_placement", "affinity", "search", "doppler", "tie_homes", "block_devices"]
