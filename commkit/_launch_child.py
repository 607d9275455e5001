"""One rank of a job started by :func:`commkit.launch`: ``python -m commkit._launch_child JOBDIR``.

Reads the job from ``JOBDIR/job.pkl``, runs ``fn(comm, *args, **kwargs)`` and
leaves ``result.R`` or ``error.R`` in ``JOBDIR``, holding the control
connection ``JOBDIR/ctl`` open meanwhile (see :mod:`commkit._launch`
for the protocol). On failure it aborts the MPI job, so the other ranks stop
at once rather than wait for this one forever.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import sys
import traceback

from ._mpiexec import launcher_rank


def _write(jobdir: str, name: str, data: bytes) -> str:
    """Write ``JOBDIR/name`` atomically: the parent sees all of it or nothing."""
    path = os.path.join(jobdir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def _dumps(obj) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _Labelled(io.TextIOBase):
    """A text stream that starts every line with a prefix (``"[rank] "`` or none) and writes whole lines at once.

    Writing a line in one call keeps the lines of different ranks from
    interleaving mid-line on the way through mpiexec.
    """

    def __init__(self, raw, prefix: str):
        super().__init__()
        self._raw = raw
        self._prefix = prefix
        self._partial = ""
        self._midline = False  # a flushed partial line was already prefixed

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            first, rest = lines[0], lines[1:]
            out = ("" if self._midline else self._prefix) + first + "\n"
            out += "".join(f"{self._prefix}{line}\n" for line in rest)
            self._midline = False
            self._raw.write(out)
            self._raw.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._raw.write(("" if self._midline else self._prefix) + self._partial)
            self._partial = ""
            self._midline = True
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):
        return self._raw.encoding


def _setup_streams(rank: int, label: bool) -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            # Whole lines, as soon as they are complete: output streams to the
            # caller while the job runs instead of arriving in blocks at the end.
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
        # Always write whole lines in one call, labelled or not: plain prints were seen
        # to arrive interleaved mid-line ("hello from 0hello from 1") under load.
        setattr(sys, name, _Labelled(stream, f"[{rank}] " if label else ""))


def _record_failure(jobdir: str, rank: int, exc: BaseException, stage: str) -> None:
    """Leave ``error.R``, and claim ``first-error`` unless another rank failed earlier."""
    tb = exc.__traceback__
    if stage == "fn" and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at fn: the frame of main() only adds noise
    if stage == "result":
        tb = None  # the frames would be cloudpickle's, not the user's
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        original = _dumps(exc)
        pickle.loads(original)  # only send what the parent can rebuild
    except Exception:  # noqa: BLE001 - the text traceback is enough
        original = None
    where = {"start": " while starting the rank", "fn": "", "result": " while pickling its return value"}[stage]
    record = {"rank": rank, "message": f"{type(exc).__name__}: {exc}{where}", "traceback": text,
              "exception": original}
    path = _write(jobdir, f"error.{rank}", pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
    try:
        os.link(path, os.path.join(jobdir, "first-error"))
    except FileExistsError:
        pass


def _connect(jobdir: str, rank: int):
    """Open this rank's control connection; it stays open until the process ends."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.path.join(jobdir, "ctl"))
    conn.sendall(f"hello {rank} {os.getpid()}\n".encode())
    return conn


def _finished(control) -> None:
    """Tell the parent this rank's result or error file is complete."""
    if control is not None:
        try:
            control.sendall(b"done\n")
        except OSError:
            pass


def main(argv: list[str]) -> None:
    jobdir = argv[1]
    with open(os.path.join(jobdir, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    parent_path = job["sys_path"]
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    rank, comm, control, stage = launcher_rank(), None, None, "start"
    if rank is None:
        rank = -1  # no launcher variable to read: MPI tells the rank below
    try:
        import commkit

        comm = commkit.init("mpi")
        rank = comm.rank
        control = _connect(jobdir, rank)
        _setup_streams(rank, job["label"])
        fn, args, kwargs = pickle.loads(job["call"])
        stage = "fn"
        result = fn(comm, *args, **kwargs)
        stage = "result"
        data = _dumps(result)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the job ends
        _record_failure(jobdir, rank, exc, stage)
        _finished(control)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if comm is not None:
            comm.abort(exc)
        os._exit(1)
    _write(jobdir, f"result.{rank}", data)
    _finished(control)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main(sys.argv)
