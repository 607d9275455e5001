"""``native``: the transport's own collective (MPI's or NCCL's), the baseline every benchmark compares against.

There is no schedule: the communicator hands the call to the transport, which
runs the library's implementation. It applies only where the transport has
collectives (not the threads world) and where the library supports the dtype
and op (``transport.native_supports``); the selector checks both.
"""

from __future__ import annotations

from . import COLLECTIVES, REGISTRY, Algorithm

for _collective in COLLECTIVES:
    REGISTRY[(_collective, "native")] = Algorithm(_collective, "native", None, formula="the library's own")
