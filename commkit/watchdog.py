"""Flight recorder and watchdog: no hang goes unexplained.

Why. A rank that waits for a peer that will never come -- a peer that called
another collective, skipped one, or is stuck elsewhere -- used to wait silently
forever unless a timeout was set. Two pieces fix that, after PyTorch's NCCL
watchdog and Flight Recorder:

* **Flight recorder.** Every communicator keeps its last :data:`CAPACITY`
  collective calls in a ring buffer: call number, collective, algorithm,
  signature (count, dtype, root, op), start and end times, and while a call
  blocks, the step it is at and the peers it waits for. It costs one short
  list and one ``deque.append`` per call. ``comm.flight_record()`` returns it;
  :func:`dump_flight_records` writes every live communicator's record.
* **Watchdog.** One daemon thread per process looks at every communicator
  that is inside a blocking call or a ``wait()``. When one has made no
  progress (same call, same step) for ``COMMKIT_WATCHDOG`` seconds (default
  60; 0 turns the watchdog off), it writes one report to stderr: a readable
  summary and a machine-readable line (``commkit-flight-record {json}``) that
  ``commkit doctor`` reads back from the logs of all ranks to say which rank
  diverged first, and how. The waiting goes on (a timeout, when one is set,
  still raises); each stuck call is reported once.

The blocked thread is never interrupted, and the watchdog costs the per-call
path nothing but the bookkeeping above: the executor writes the step index
into the call's record before each transfer, and the watchdog reads it.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import weakref

from .errors import InvalidArgument

__all__ = ["FlightRecorder", "dump_flight_records", "watchdog_seconds", "MARKER", "CAPACITY"]

CAPACITY = 64
MARKER = "commkit-flight-record"

# Fields of one call record (a list, for a cheap per-call path).
SEQ, COLLECTIVE, ALGORITHM, SIGNATURE, T_START, T_END, STEP, STEP_OBJ, STATE = range(9)
RECORD_LEN = 9


def blank_record() -> list:
    """A record nobody reads (for executor calls made outside a communicator)."""
    return [None] * RECORD_LEN


def watchdog_seconds() -> float:
    """``COMMKIT_WATCHDOG`` in seconds (default 60; 0 or a negative value turns the watchdog off)."""
    text = os.environ.get("COMMKIT_WATCHDOG", "").strip()
    if not text:
        return 60.0
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"COMMKIT_WATCHDOG must be a number of seconds (0 turns it off), got {text!r}.") from None
    return max(value, 0.0)


def _peers(step) -> list:
    if step is None:
        return []
    sends = getattr(step, "sends", ())
    recvs = getattr(step, "recvs", ())
    return sorted({peer for peer, _ in recvs} | {peer for peer, _ in sends})


class FlightRecorder:
    """The recent calls of one communicator on one rank, and the call it is blocked in (if any).

    Attributes:
        calls: the last :data:`CAPACITY` call records, oldest first.
        active: the record of the call this rank is blocked in right now, or None.
    """

    __slots__ = ("rank", "size", "label", "calls", "active", "__weakref__")

    def __init__(self, rank: int, size: int, label: str):
        self.rank = rank
        self.size = size
        self.label = label
        self.calls = collections.deque(maxlen=CAPACITY)
        self.active = None

    def start(self, seq: int, collective: str, algorithm: str, signature) -> list:
        """Record the start of a collective call; returns its record (updated by the executor)."""
        rec = [seq, collective, algorithm, signature, time.monotonic(), None, -1, None, "running"]
        self.calls.append(rec)
        return rec

    @staticmethod
    def finish(rec: list, state: str = "done") -> None:
        rec[T_END] = time.monotonic()
        rec[STATE] = state

    def entries(self) -> list[dict]:
        """The records as plain dicts, oldest first (what reports and ``commkit doctor`` use)."""
        now = time.monotonic()
        return [_as_dict(rec, now) for rec in list(self.calls)]

    def report(self, rec=None, waited: float | None = None) -> dict:
        """A JSON-ready report: who, the call it is stuck in (if any), and its recent calls."""
        rec = rec if rec is not None else self.active
        now = time.monotonic()
        out = {
            "rank": self.rank,
            "size": self.size,
            "communicator": self.label,
            "pid": os.getpid(),
            "host": _hostname(),
            "stuck": _as_dict(rec, now) if rec is not None else None,
            "waited_s": None if waited is None else round(waited, 3),
            "calls": self.entries(),
        }
        return out


def _as_dict(rec, now) -> dict:
    if not isinstance(rec, list):  # a point-to-point wait: (what, peers, t0)
        what, peers, t0 = rec
        return {"seq": None, "collective": what, "algorithm": None, "signature": {}, "state": "running",
                "age_s": round(now - t0, 3), "step": None, "step_text": None, "peers": list(peers)}
    step_obj = rec[STEP_OBJ]
    return {
        "seq": rec[SEQ],
        "collective": rec[COLLECTIVE],
        "algorithm": rec[ALGORITHM],
        "signature": dict(rec[SIGNATURE]) if rec[SIGNATURE] else {},
        "state": rec[STATE],
        # Compiled plans record no start time (it would cost a clock read per call): no age for them.
        "age_s": round((rec[T_END] or now) - rec[T_START], 6) if rec[T_START] else None,
        "step": rec[STEP] if rec[STEP] >= 0 else None,
        "step_text": repr(step_obj) if step_obj is not None else None,
        "peers": _peers(step_obj),
    }


def _hostname() -> str:
    try:
        return os.uname().nodename
    except AttributeError:  # pragma: no cover - not on POSIX
        return "?"


def format_report(report: dict) -> str:
    """The human-readable block of a watchdog report."""
    stuck = report.get("stuck") or {}
    who = f"commkit watchdog: rank {report['rank']} of {report['size']} ({report['communicator']}, pid {report['pid']})"
    lines = [who]
    if stuck:
        sig = ", ".join(f"{k}={v}" for k, v in stuck.get("signature", {}).items())
        where = f" at step {stuck['step']} ({stuck['step_text']})" if stuck.get("step") is not None else ""
        call = f"{stuck['collective']} #{stuck['seq']}" if stuck.get("seq") is not None else stuck["collective"]
        alg = f" (algorithm {stuck['algorithm']!r}{', ' + sig if sig else ''})" if stuck.get("algorithm") else ""
        waited = report.get("waited_s")
        how_long = f"has made no progress for {waited:g} s" if waited is not None else "is blocked"
        lines.append(f"  {how_long} in {call}{alg}{where}")
        if stuck.get("peers"):
            lines.append(f"  waiting for rank(s) {', '.join(map(str, stuck['peers']))}")
    recent = report.get("calls", [])[-8:]
    if recent:
        lines.append("  last calls on this rank (oldest first):")
        for c in recent:
            sig = ", ".join(f"{k}={v}" for k, v in c.get("signature", {}).items())
            detail = f"{c['algorithm']}{', ' + sig if sig else ''}"
            lines.append(f"    #{c['seq']} {c['collective']} ({detail}): {c['state']}")
    lines.append("  Likely causes: a peer called a different collective (or with another root, count, dtype or op), "
                 "skipped a call, or is blocked elsewhere. Run `commkit doctor LOG` on the job's stderr to compare "
                 "all ranks; COMMKIT_DEBUG=check names the mismatch as it happens.")
    return "\n".join(lines)


def emit(report: dict, stream=None) -> None:
    """Write one report: the readable block, then the machine-readable line ``commkit doctor`` reads."""
    stream = stream if stream is not None else sys.stderr
    text = format_report(report) + "\n" + MARKER + " " + json.dumps(report, default=str) + "\n"
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # pragma: no cover - stderr closed
        pass


# -- the process-wide registry and watchdog thread -------------------------------------------------

_recorders: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()
_lock = threading.Lock()
_thread = None


def register(recorder: FlightRecorder) -> None:
    """Make ``recorder`` visible to :func:`dump_flight_records` and the watchdog (started on first use)."""
    global _thread
    _recorders.add(recorder)
    if _thread is None:
        seconds = watchdog_seconds()
        if seconds > 0:
            with _lock:
                if _thread is None:
                    _thread = threading.Thread(target=_watch, args=(seconds,), name="commkit-watchdog", daemon=True)
                    _thread.start()


def alive() -> int:
    """How many communicators (flight recorders) are alive in this process."""
    return len(_recorders)


def _watch(seconds: float) -> None:
    seen: dict = {}  # id(recorder) -> [record, step, since, reported]
    while True:
        try:
            seconds = watchdog_seconds()  # read each round: a test or a notebook may change it
        except Exception:  # noqa: BLE001 - a bad value was reported where it was first read
            pass
        if seconds <= 0:
            seen.clear()
            time.sleep(1.0)
            continue
        time.sleep(min(max(seconds / 4, 0.01), 1.0))
        now = time.monotonic()
        for recorder in list(_recorders):
            rec = recorder.active
            key = id(recorder)
            if rec is None:
                seen.pop(key, None)
                continue
            step = rec[STEP] if isinstance(rec, list) else None
            state = seen.get(key)
            if state is None or state[0] is not rec or state[1] != step:
                seen[key] = [rec, step, now, False]
                continue
            if not state[3] and now - state[2] >= seconds:
                state[3] = True
                emit(recorder.report(rec, now - state[2]))


def recent_summary(recorder, k: int = 4) -> str:
    """The last ``k`` calls of ``recorder`` in one line, for error messages."""
    if recorder is None or not recorder.calls:
        return ""
    calls = list(recorder.calls)[-k:]
    return "; ".join(f"#{c[SEQ]} {c[COLLECTIVE]} ({c[ALGORITHM]}) {c[STATE]}" for c in calls)


def dump_flight_records(stream=None) -> list[dict]:
    """Write the flight record of every live communicator of this process (``stream``: stderr by default).

    Returns the reports written. Each is one ``commkit-flight-record`` line that
    ``commkit doctor`` reads, after a readable block.
    """
    reports = [r.report() for r in sorted(_recorders, key=lambda r: (r.label, r.rank))]
    for report in reports:
        emit(report, stream)
    return reports


# -- reading the reports back: ``commkit doctor`` --------------------------------------------------


def read_reports(texts) -> list[dict]:
    """Every ``commkit-flight-record`` report in ``texts`` (strings: stderr logs of any ranks)."""
    reports = []
    for text in texts:
        for line in text.splitlines():
            at = line.find(MARKER + " ")
            if at < 0:
                continue
            try:
                reports.append(json.loads(line[at + len(MARKER) + 1:]))
            except ValueError:
                continue  # a line cut short when the job was killed
    return reports


def _describe(call: dict) -> str:
    sig = {k: v for k, v in (call.get("signature") or {}).items() if v is not None}
    args = ", ".join(f"{k}={v}" for k, v in sig.items())
    alg = f" [{call['algorithm']}]" if call.get("algorithm") else ""
    return f"{call['collective']}({args}){alg}, {call.get('state', '?')}"


def diagnose(reports: list[dict]) -> str:
    """Compare the ranks' flight records and say which rank diverged first, and how.

    Per communicator, the latest report of each rank is used. The verdict names
    the first call number at which ranks disagree (collective, root, count,
    dtype, op or algorithm), or else the ranks that never reached the call the
    others are stuck in, and what those ranks were doing instead.
    """
    if not reports:
        return ("no commkit-flight-record lines found: pass the stderr of the job (every rank's), or files "
                "written by commkit.dump_flight_records().")
    by_comm: dict = {}
    for report in reports:
        by_comm.setdefault(report.get("communicator", "?"), {})[report["rank"]] = report  # the latest wins
    lines = []
    for label, ranks in sorted(by_comm.items()):
        size = max(r.get("size", 0) for r in ranks.values())
        lines.append(f"communicator {label}: reports from ranks {sorted(ranks)} of {size}")
        missing = sorted(set(range(size)) - set(ranks))
        calls = {}
        for rank, report in ranks.items():
            table = {c["seq"]: c for c in report.get("calls", []) if c.get("seq") is not None}
            stuck = report.get("stuck")
            if stuck and stuck.get("seq") is not None:
                table[stuck["seq"]] = stuck
            calls[rank] = table
        common = sorted(set().union(*(set(t) for t in calls.values()))) if calls else []
        verdict = None
        for seq in common:
            seen = {rank: table[seq] for rank, table in calls.items() if seq in table}
            keys = {(c["collective"], json.dumps(c.get("signature"), sort_keys=True), c.get("algorithm"))
                    for c in seen.values()}
            if len(keys) > 1:
                verdict = [f"  DIVERGED at call #{seq}: the ranks called different collectives (or the same one "
                           "with a different signature):"]
                groups: dict = {}
                for rank, call in sorted(seen.items()):
                    groups.setdefault(_describe(call).rsplit(", ", 1)[0], []).append((rank, call.get("state")))
                for text, members in groups.items():
                    who = ", ".join(f"{r} ({state})" for r, state in members)
                    verdict.append(f"    ranks {who}: {text}")
                break
        if verdict is None:
            stuck_seqs = {rank: r["stuck"]["seq"] for rank, r in ranks.items()
                          if r.get("stuck") and r["stuck"].get("seq") is not None}
            if stuck_seqs:
                seq = min(stuck_seqs.values())
                verdict = [f"  STUCK at call #{seq} ({_describe(calls[min(stuck_seqs, key=stuck_seqs.get)][seq])}) "
                           f"on ranks {sorted(r for r, s in stuck_seqs.items() if s == seq)}"]
                for rank, report in sorted(ranks.items()):
                    if seq in calls[rank]:
                        continue
                    last = max(calls[rank]) if calls[rank] else None
                    doing = report.get("stuck") or {}
                    where = f"; it is blocked in {doing['collective']}" if doing else ""
                    before = f"its last call is #{last}" if last is not None else "it made no collective call"
                    verdict.append(f"    rank {rank} never reached call #{seq}: {before}{where}")
            else:
                verdict = ["  no rank is stuck in a collective call of this communicator"]
                for rank, report in sorted(ranks.items()):
                    if report.get("stuck"):
                        verdict.append(f"    rank {rank} is blocked in {report['stuck']['collective']}")
        lines.extend(verdict)
        if missing:
            lines.append(f"  no report from ranks {missing}: they may be blocked where the watchdog does not look "
                         "(outside commkit), have exited, or their stderr is not in these files")
    return "\n".join(lines)
