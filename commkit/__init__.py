"""commkit: MPI-style message passing in pure Python, with collectives written once as schedules.

Quick tour::

    import commkit as ck
    comm = ck.init()                       # under mpiexec: wraps MPI.COMM_WORLD
    y = comm.allreduce(x, op="sum")        # algorithm chosen by size and process count
    ck.run_local(lambda c: c.allreduce(c.rank), size=4)   # 4 ranks on threads
"""

from __future__ import annotations

from ._launch import launch, launcher
from ._world import init, local_world, run_local
from .communicator import Communicator, PointToPointRequest
from .plan import PersistentRequest
from .requests import Request, wait_all, wait_any
from .mesh import Mesh, MeshLayout, mesh_layout
from .errors import (
    AlgorithmNotApplicable,
    CollectiveMismatch,
    CommBroken,
    CommClosed,
    MessageTruncated,
    CommError,
    CommTimeout,
    ConcurrentCall,
    InvalidArgument,
    InvalidBuffer,
    PeerFailed,
    RankError,
    TransportUnavailable,
    UnsupportedOp,
)
from .ops import BAND, BOR, BXOR, LAND, LOR, LXOR, MAX, MIN, PROD, SUM, Op
from .schedule import ScheduleRequest
from .tracing import trace
from .watchdog import dump_flight_records
from .transports.base import ANY_SOURCE, ANY_TAG, Status

__version__ = "0.1.0"


def __getattr__(name):
    # commkit.cost runs the simulator, which a program that only communicates never needs: it is imported at
    # its first use (ck.cost...), so that every rank a job starts imports commkit in about half the time.
    if name == "cost":
        import importlib  # (not "from . import cost": that asks this module for the name first, and so this function)
        return importlib.import_module(".cost", __name__)
    raise AttributeError(f"module 'commkit' has no attribute {name!r}")

__all__ = [
    "cost", "init", "run_local", "local_world", "launch", "launcher", "Mesh", "MeshLayout", "mesh_layout", "Communicator", "Request", "PointToPointRequest", "ScheduleRequest",
    "PersistentRequest", "wait_all", "wait_any", "trace", "dump_flight_records",
    "Op", "SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR",
    "ANY_SOURCE", "ANY_TAG", "Status",
    "CommError", "InvalidArgument", "InvalidBuffer", "UnsupportedOp", "AlgorithmNotApplicable", "CommClosed", "CommBroken", "MessageTruncated",
    "CommTimeout", "CollectiveMismatch", "PeerFailed", "ConcurrentCall", "TransportUnavailable", "RankError",
    "__version__",
]
