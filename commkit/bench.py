"""The benchmark engine behind ``commkit bench`` and ``commkit tune`` (and importable by benchmarks/).

What it measures, and why this way (docs/architecture.md, "Measuring"):

* every algorithm of a collective, ``native`` (the library's own) included, on
  the *same* input and output buffers: on a 2-core machine the very same
  ``MPI_Allreduce`` into two different output buffers was measured 2x apart;
* runs are interleaved and the order rotates every repetition (each algorithm
  goes first in turn), so drift and warm caches favour nobody;
* a barrier before every timed run; a run's time is the slowest rank's, and
  the reported time is the median over repetitions, with the spread of those
  identical runs (inter-quartile range / median) next to every ratio;
* every result is checked against a NumPy reference computed from the inputs
  (each rank's input is a pure function of its rank, so every rank can compute
  every reference without communication), and the output buffer is poisoned
  before each run so a stale correct result cannot hide a wrong one. Inputs
  are small integers, so float sums are exact in any order and the check is
  an exact comparison.

Columns, as nccl-tests and the OSU benchmarks print them: size (bytes, as
:mod:`commkit.selection` counts a message: the per-rank vector for allreduce,
reduce, broadcast, scan, exscan; the whole vector for gather, scatter,
allgather, reduce_scatter; the block per peer for alltoall), count
(elements in that size), dtype, op, algorithm, time (us, median), algbw and
busbw (GB/s, nccl-tests' definitions: algbw = S / t with S the bytes of the
per-rank buffer -- for alltoall all p blocks -- and busbw = algbw times
2(p-1)/p for allreduce, (p-1)/p for allgather, reduce_scatter, alltoall,
gather and scatter, 1 for broadcast, reduce and the scans), the ratio of the
median time to native's, and the number of wrong results.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from . import algorithms, collectives
from ._checks import parse_size
from ._units import format_bytes
from .errors import AlgorithmNotApplicable, InvalidArgument
from .ops import get_op

__all__ = ["Row", "parse_size", "parse_sizes", "size_range", "format_size", "busbw_factor", "candidates",
           "Case", "actual_size", "measure", "run", "format_table", "to_csv", "to_json", "plot", "Progress"]

_REDUCING = collectives.REDUCING


@dataclass
class Row:
    """One line of results: one collective, size and algorithm."""

    collective: str
    size: int           # bytes, as the selector counts a message
    count: int          # elements in `size`
    dtype: str
    op: str
    algorithm: str
    nprocs: int
    time_us: float      # median over repetitions of the slowest rank's time
    min_us: float
    spread: float       # (p75 - p25) / median of the same repetitions
    algbw: float        # GB/s
    busbw: float        # GB/s
    vs_native: float | None   # time / native's time, measured in the same run
    wrong: int          # results that differed from the reference (all ranks, all runs)
    runs: int           # timed runs per rank


# -- sizes ------------------------------------------------------------------------------------------


def size_range(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """``min_bytes``, ``min_bytes*factor``, ... up to ``max_bytes`` (nccl-tests' -b/-e/-f)."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise InvalidArgument(f"the size step factor must be an integer >= 2, got {factor!r}.")
    if min_bytes > max_bytes:
        raise InvalidArgument(f"the smallest size ({min_bytes} B) is larger than the largest ({max_bytes} B).")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        if size == 0:
            size = 1
            continue
        size *= factor
    return sizes


def parse_sizes(text: str) -> list[int]:
    """Sizes from ``"8,1K,1M"`` (a list) or ``"8:1M"`` / ``"8:1M:4"`` (a range with step factor 2 or 4)."""
    text = str(text).strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise InvalidArgument(f"invalid size range {text!r}: expected MIN:MAX or MIN:MAX:FACTOR.")
        factor = parts[2].strip() if len(parts) == 3 else "2"
        if not factor.isdigit():
            raise InvalidArgument(f"invalid size range {text!r}: the factor must be an integer >= 2.")
        return size_range(parse_size(parts[0]), parse_size(parts[1]), int(factor))
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise InvalidArgument(f"invalid sizes {text!r}: expected a list such as 8,1K,1M or a range such as 8:1M.")
    return sizes


def format_size(n: int) -> str:
    """``1048576`` -> ``"1M"``, ``1536`` -> ``"1536"``: exact binary units only, as :func:`parse_size` reads them."""
    return format_bytes(n, compact=True)


# -- what a run moves --------------------------------------------------------------------------------


def busbw_factor(collective: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each rank's link carries relative to algbw."""
    if p <= 1:
        return 1.0 if collective not in ("allreduce",) else 0.0
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter"):
        return (p - 1) / p
    return 1.0


def _algbw_bytes(collective: str, p: int, size: int) -> int:
    return size * p if collective == "alltoall" else size


def candidates(collective: str, p: int, op="sum") -> list[str]:
    """Every algorithm that can run ``collective`` on ``p`` ranks with ``op``, then ``native``."""
    op = get_op(op) if collective in _REDUCING else None
    names = [name for name, alg in sorted(algorithms.for_collective(collective).items())
             if alg.schedule is not None and alg.why_not(p, op) is None]
    return names + ["native"]


# -- one benchmark case: buffers, inputs, reference --------------------------------------------------


class Case:
    """The buffers, inputs and expected result of one collective at one size, on this rank.

    What :func:`measure` times, and what benchmarks/ builds its own timings on
    (the raw library call, torch.distributed) so that every contender runs on
    the same buffers and is checked against the same reference.

    Args:
        comm: the communicator (every rank builds its case; building one communicates nothing).
        collective: the collective's name, as in :data:`commkit.algorithms.COLLECTIVES`.
        size: the message size in bytes, as :mod:`commkit.selection` counts it;
            rounded as :func:`actual_size` rounds it (``self.size`` is the result).
        dtype: the element type (any NumPy dtype name).
        op: the reduction's name, for the reducing collectives (ignored by the others).
        root: the root rank of the rooted collectives.
        xp: the array module of the buffers (``numpy``, or ``cupy`` for NCCL).
        seed: picks the inputs; each rank's input is a pure function of
            (seed, rank, size), so every rank computes every reference without communicating.

    Attributes: ``x`` (this rank's input, None where it sends nothing), ``out``
    (its output buffer, None where it receives nothing), ``expected`` (its
    NumPy reference, None where the collective returns None), ``size``,
    ``count``, ``counts`` (reduce_scatter's, else None), ``block`` (elements
    per block, None for reduce_scatter), ``dtype``, ``op``.

    Cost: the reference folds every rank's input on every rank: O(p * size) time, O(size) extra memory.
    """

    def __init__(self, comm, collective, size, dtype, op, root, xp, seed=0):
        from .sim import schedule_args

        self.comm, self.collective, self.root, self.xp = comm, collective, root, xp
        p, r = comm.size, comm.rank
        self.dtype = np.dtype(dtype)
        self.op = get_op(op) if collective in _REDUCING else None
        count, self.size = schedule_args(collective, p, size, self.dtype.itemsize)
        self.count = self.size // self.dtype.itemsize
        self.seed = seed
        self.counts = list(count) if collective == "reduce_scatter" else None
        self.block = count if collective != "reduce_scatter" else None
        host = self._input(r)
        self.x = xp.asarray(host) if host is not None else None
        self.out = self._output()
        self.expected = self._reference()
        self._poison = self._poison_array()

    def _shape(self):
        c, p = self.collective, self.comm.size
        if c in ("scatter", "alltoall"):
            return (p, self.block)
        if c == "reduce_scatter":
            return (sum(self.counts),)
        return (self.block,)

    def _input(self, q):
        """Rank q's input: small integers, so every reduction order gives exactly the same floats."""
        if self.collective == "barrier" or (self.collective == "scatter" and q != self.root):
            return None
        rng = np.random.default_rng([self.seed, q, self.size])
        shape, dt, op = self._shape(), self.dtype, self.op
        if dt.kind == "b":
            return rng.integers(0, 2, size=shape).astype(bool)
        if op is not None and op.name == "prod":
            return rng.choice(np.array([-1, 1], dtype=dt), size=shape)
        low = 0 if dt.kind == "u" else -4
        values = rng.integers(low, 5, size=shape)
        if dt.kind == "c":
            return (values + 1j * rng.integers(-4, 5, size=shape)).astype(dt)
        return values.astype(dt)

    def _output(self):
        c, p, r, xp = self.collective, self.comm.size, self.comm.rank, self.xp
        if c == "barrier" or (c == "gather" and r != self.root):
            return None
        if c in ("gather", "allgather", "alltoall"):
            return xp.empty((p, self.block), self.dtype)
        if c == "reduce_scatter":
            return xp.empty((self.counts[r],), self.dtype)
        return xp.empty((self.block,), self.dtype)

    def _fold(self, ranks):
        acc = None
        fn = self.op.fn
        for q in ranks:
            x = self._input(q)
            acc = x.copy() if acc is None else np.asarray(fn(acc, x)).astype(self.dtype)
        return acc

    def _reference(self):
        """This rank's expected result (None where the collective returns None)."""
        c, p, r, root = self.collective, self.comm.size, self.comm.rank, self.root
        if c == "barrier" or (c in ("reduce", "gather") and r != root):
            return None
        if c == "broadcast":
            return self._input(root)
        if c == "allreduce" or c == "reduce":
            return self._fold(range(p))
        if c == "scan":
            return self._fold(range(r + 1))
        if c == "exscan":
            if r == 0:
                return self.op.identity_array((self.block,), self.dtype)
            return self._fold(range(r))
        if c in ("gather", "allgather"):
            return np.stack([self._input(q) for q in range(p)]) if p else None
        if c == "scatter":
            return self._input(root)[r]
        if c == "alltoall":
            return np.stack([self._input(q)[r] for q in range(p)])
        if c == "reduce_scatter":
            lo = sum(self.counts[:r])
            return self._fold(range(p))[lo: lo + self.counts[r]]
        raise AssertionError(c)

    def _poison_array(self):
        """A value differing from the expected result in every element (NaN, x+1, or not x)."""
        if self.out is None or self.expected is None:
            return None
        exp = self.expected
        if self.dtype.kind == "b":
            bad = ~exp
        elif self.dtype.kind in "fc":
            bad = np.full(exp.shape, np.nan, self.dtype)
        else:
            bad = (exp + 1).astype(self.dtype)  # wraps at the maximum, still differs
        return self.xp.asarray(bad.reshape(self.out.shape))

    def poison(self):
        """Overwrite the output, so a run that writes nothing cannot pass on the last run's result."""
        if self._poison is not None:
            self.out[...] = self._poison

    def run(self, algorithm):
        """Run the collective once with ``algorithm`` ("auto" lets the selector choose)."""
        comm, c, x, out = self.comm, self.collective, self.x, self.out
        kw = {"algorithm": None if algorithm == "auto" else algorithm}
        if c == "barrier":
            return comm.barrier(**kw)
        if c in ("allreduce", "scan", "exscan"):
            return getattr(comm, c)(x, self.op, out=out, **kw)
        if c == "reduce":
            return comm.reduce(x, self.op, self.root, out=out, **kw)
        if c == "reduce_scatter":
            return comm.reduce_scatter(x, self.op, counts=self.counts, out=out, **kw)
        if c == "broadcast":
            if comm.rank == self.root:
                return comm.broadcast(x, self.root, out=out, **kw)
            return comm.broadcast(None, self.root, out=out, **kw)
        if c == "gather":
            return comm.gather(x, self.root, out=out, **kw)
        if c == "scatter":
            return comm.scatter(x if comm.rank == self.root else None, self.root, out=out, **kw)
        if c == "allgather":
            return comm.allgather(x, out=out, **kw)
        if c == "alltoall":
            return comm.alltoall(x, out=out, **kw)
        raise AssertionError(c)

    def correct(self, result) -> bool:
        """Whether ``result`` (what :meth:`run` returned) equals this rank's reference exactly."""
        if self.expected is None:
            return result is None
        if result is None:
            return False
        got = result.get() if hasattr(result, "get") and self.xp is not np else np.asarray(result)
        return got.shape == self.expected.shape and bool(np.array_equal(got, self.expected, equal_nan=False))


# -- measuring ---------------------------------------------------------------------------------------


def _sync(xp):
    if xp is not np:
        from .transports._cuda import synchronize

        synchronize()


def measure(comm, collective: str, size: int, names, *, dtype="float32", op="sum", root: int = 0,
            iters: int = 20, warmup: int = 3, check: bool = True, xp=np, progress=None) -> list[Row]:
    """Benchmark ``names`` (algorithms, "native", "auto") on one collective and size; collective call.

    Runs are interleaved, rotating which algorithm goes first; every result is
    checked (unless ``check`` is False). ``native`` is dropped, on every rank,
    where the transport has no native collective for this dtype and op. Every
    rank returns the same rows.

    Cost: (warmup + iters) * len(names) collective calls, plus one barrier before each.
    """
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise InvalidArgument(f"iters must be an int >= 1, got {iters!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgument(f"warmup must be an int >= 0, got {warmup!r}.")
    case = Case(comm, collective, size, dtype, op, root, xp)
    names = list(names)
    if "native" in names and not _native_available(case):
        names.remove("native")
    times = np.zeros((len(names), iters))
    wrong = np.zeros(len(names), dtype=np.int64)
    for w in range(warmup):
        for k, name in enumerate(names):
            case.poison()
            result = case.run(name)
            _sync(xp)
            if check and not case.correct(result):
                wrong[k] += 1
    barrier = _barrier(comm)
    clock = time.perf_counter
    for i in range(iters):
        shift = i % len(names)
        for k in list(range(shift, len(names))) + list(range(shift)):
            case.poison()
            barrier()
            t0 = clock()
            result = case.run(names[k])
            _sync(xp)
            times[k, i] = clock() - t0
            if check and not case.correct(result):
                wrong[k] += 1
        if progress is not None:
            progress.advance(f"{collective} {format_size(case.size)}")
    # A run lasts until its slowest rank finishes. Gathered as objects: any transport
    # (NCCL's collectives want device arrays) can do that.
    everyone = comm.allgather_object((times, wrong))
    times = np.max([t for t, _ in everyone], axis=0)
    wrong = np.sum([w for _, w in everyone], axis=0)
    p = comm.size
    moved = _algbw_bytes(collective, p, case.size)
    native_median = float(np.median(times[names.index("native")])) if "native" in names else None
    rows = []
    for k, name in enumerate(names):
        t = times[k]
        median = float(np.median(t))
        q25, q75 = np.percentile(t, [25, 75])
        algbw = moved / median / 1e9 if median > 0 else 0.0
        rows.append(Row(
            collective=collective, size=case.size, count=case.count, dtype=case.dtype.name,
            op=case.op.name if case.op is not None else "none", algorithm=name, nprocs=p,
            time_us=median * 1e6, min_us=float(t.min()) * 1e6,
            spread=float((q75 - q25) / median) if median > 0 else 0.0,
            algbw=algbw, busbw=algbw * busbw_factor(collective, p),
            vs_native=median / native_median if native_median else None,
            wrong=int(wrong[k]), runs=iters,
        ))
    return rows


def _barrier(comm):
    """The library's own barrier where there is one (the least skew), else commkit's."""
    try:
        comm.barrier(algorithm="native")
        return lambda: comm.barrier(algorithm="native")
    except AlgorithmNotApplicable:
        return comm.barrier


def _native_available(case) -> bool:
    """Whether ``native`` runs here (MPI, NCCL; not the threads world or an op MPI lacks)."""
    try:
        case.poison()
        case.run("native")
        return True
    except AlgorithmNotApplicable:
        return False


def run(comm, collectives, sizes, *, names=None, dtype="float32", op="sum", root: int = 0,
        iters: int = 20, warmup: int = 3, check: bool = True, gpu: bool = False, progress=None) -> list[Row]:
    """Benchmark each collective at each size; collective call, every rank returns the same rows.

    Args:
        comm: the communicator to measure (every rank calls this).
        collectives: names such as ``["allreduce", "allgather"]``.
        sizes: message sizes in bytes (see the module docstring for what a size counts).
        names: algorithms to run (``"native"`` and ``"auto"`` allowed); default: every
            applicable algorithm and native.
        dtype, op, root: the call's element type, reduction op and root.
        iters, warmup: timed and untimed repetitions per algorithm and size.
        check: compare every result with the NumPy reference.
        gpu: the communicator moves CuPy arrays (NCCL).
        progress: an object with ``advance(label)`` (see :class:`Progress`).

    Raises:
        InvalidArgument: an unknown collective, algorithm, dtype or op.
    """
    xp = _cupy() if gpu else np
    rows = []
    for collective in collectives:
        chosen = resolve_algorithms(collective, comm.size, names, op)
        seen = set()
        for size in sizes:
            actual = actual_size(collective, comm.size, size, np.dtype(dtype).itemsize)
            if actual in seen:
                continue  # sizes that round to the same message (see schedule_args)
            seen.add(actual)
            rows.extend(measure(comm, collective, size, chosen, dtype=dtype, op=op, root=root, iters=iters,
                                warmup=warmup, check=check, xp=xp, progress=progress))
    return rows


def actual_size(collective: str, p: int, size: int, itemsize: int) -> int:
    """The bytes a benchmark of ``collective`` on ``p`` ranks at ``size`` bytes really moves.

    ``size`` is rounded down to whole elements of ``itemsize`` bytes (for
    gather, scatter and allgather, to whole per-rank blocks; a barrier moves 0),
    as :class:`Case` rounds it (:func:`commkit.sim.schedule_args`): two requested
    sizes with the same actual size are the same benchmark.
    """
    from .sim import schedule_args

    return schedule_args(collective, p, size, itemsize)[1]


def resolve_algorithms(collective, p, requested, op):
    """The algorithms a benchmark of ``collective`` on ``p`` ranks runs: ``requested`` (names) or every candidate.

    Names of other collectives' algorithms are skipped, so one list can serve several
    collectives; ``"auto"`` is kept. Raises InvalidArgument, before anything is timed,
    for an unknown collective or a name no collective has.
    """
    if collective not in algorithms.COLLECTIVES:
        raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
    available = candidates(collective, p, op)
    if not requested:
        return available
    known = set(algorithms.for_collective(collective)) | {"auto"}
    for name in requested:
        if not any(name in algorithms.for_collective(c) for c in algorithms.COLLECTIVES) and name != "auto":
            raise InvalidArgument(f"unknown algorithm {name!r}; {collective} has {sorted(known)}.")
    # Names of other collectives' algorithms are skipped, so one list can serve several collectives.
    names = [name for name in requested if name in available or name == "auto"]
    if not names:
        raise InvalidArgument(
            f"none of the algorithms {list(requested)} can run {collective} on {p} ranks with op {op!r}; "
            f"applicable: {available}."
        )
    return names


def _cupy():
    from .transports._cuda import load_cupy  # only commkit.transports imports CuPy

    return load_cupy("--gpu benchmarks")


def check_dtype_op(dtype: str, op: str, collectives) -> None:
    """Raise InvalidArgument unless ``dtype`` is a numeric dtype that ``op`` supports."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument(f"unknown dtype {dtype!r}; expected a NumPy name such as float32 or int64.") from None
    if dt.kind not in "biufc":
        raise InvalidArgument(f"dtype {dtype!r} is not numeric; commkit moves bool, int, uint, float and complex.")
    if any(c in _REDUCING for c in collectives):
        get_op(op).check_dtype(dt)


# -- output ------------------------------------------------------------------------------------------

_COLUMNS = [("size", "size(B)", 12), ("count", "count", 11), ("dtype", "type", 8), ("op", "redop", 6),
            ("algorithm", "algorithm", 19), ("time_us", "time(us)", 10), ("spread", "spread", 7),
            ("algbw", "algbw(GB/s)", 12), ("busbw", "busbw(GB/s)", 12), ("vs_native", "vs native", 10),
            ("wrong", "#wrong", 7)]


def _cell(key, value):
    if value is None:
        return "-"
    if key == "time_us":
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    if key == "spread":
        return f"{value * 100:.0f}%"
    if key in ("algbw", "busbw"):
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    if key == "vs_native":
        return f"{value:.2f}x"
    return str(value)


def _line(cells: dict) -> str:
    out = []
    for key, _, width in _COLUMNS:
        text = cells[key]
        if key == "algorithm":
            out.append("  " + text.ljust(width - 2))
        else:  # a cell wider than its column (a 123456% spread on a loaded machine) still gets a space
            out.append(text.rjust(width) if len(text) < width else " " + text)
    return "".join(out)


def format_table(rows, title: str | None = None) -> str:
    """The rows as an aligned text table, one block per collective (nccl-tests style)."""
    lines = []
    by_collective = {}
    for row in rows:
        by_collective.setdefault(row.collective, []).append(row)
    for collective, group in by_collective.items():
        first = group[0]
        lines.append(f"# {collective} on {first.nprocs} ranks: median of {first.runs} runs; spread = IQR/median "
                     f"of those runs; vs native = time / native's time in the same interleaved run")
        if title:
            lines.append(f"# {title}")
        header = {key: title for key, title, _ in _COLUMNS}
        lines.append("#" + _line(header)[1:])
        for row in group:
            lines.append(_line({key: _cell(key, getattr(row, key)) for key, _, _ in _COLUMNS}))
        wrong = sum(r.wrong for r in group)
        lines.append(f"# wrong results: {wrong}" + ("" if not wrong else "  <-- CHECK FAILED"))
        lines.append("")
    return "\n".join(lines)


def to_csv(rows) -> str:
    """The rows as CSV with a header line (the :class:`Row` field names)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    names = [f.name for f in fields(Row)]
    writer.writerow(names)
    for row in rows:
        writer.writerow(["" if getattr(row, n) is None else getattr(row, n) for n in names])
    return buf.getvalue()


def to_json(rows, meta: dict | None = None) -> str:
    """``{"meta": {...}, "rows": [...]}`` with one object per :class:`Row`."""
    return json.dumps({"meta": meta or {}, "rows": [asdict(r) for r in rows]}, indent=1)


def plot(rows, path: str) -> None:
    """Draw time and busbw against size, one line per algorithm, one row of panels per collective.

    matplotlib is imported here, with the Agg backend (no display needed).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib; install it with `pip install matplotlib`.") from None
    by_collective = {}
    for row in rows:
        by_collective.setdefault(row.collective, {}).setdefault(row.algorithm, []).append(row)
    n = max(len(by_collective), 1)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.6 * n), squeeze=False)
    for (collective, per_alg), (ax_t, ax_bw) in zip(by_collective.items(), axes):
        for name, group in sorted(per_alg.items()):
            group = sorted(group, key=lambda r: r.size)
            sizes = [max(r.size, 1) for r in group]
            style = "k--" if name == "native" else "-o"
            ax_t.plot(sizes, [r.time_us for r in group], style, label=name, markersize=3)
            ax_bw.plot(sizes, [r.busbw for r in group], style, label=name, markersize=3)
        p = next(iter(per_alg.values()))[0].nprocs
        ax_t.set(xscale="log", yscale="log", xlabel="size (B)", ylabel="time (us, median)",
                 title=f"{collective}, {p} ranks")
        ax_bw.set(xscale="log", xlabel="size (B)", ylabel="busbw (GB/s)", title=f"{collective}: bus bandwidth")
        ax_t.grid(True, which="both", alpha=0.3)
        ax_bw.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal (or ``force``)."""

    def __init__(self, total: int, force: bool = False, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()

    def advance(self, label: str = "") -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = int(width * min(self.done, self.total) / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<24}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 70 + "\r")
            self.stream.flush()
