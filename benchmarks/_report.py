"""Turning the results of ``benchmarks/compare.py`` into docs/benchmarks.md and its figures.

Everything here is a pure function of the results dictionary the script saves
as JSON, so the page can be re-rendered without measuring again
(``python benchmarks/compare.py --from results.json``). The stand-alone scripts
(``memory_floor.py``, ``inplace.py``), whose tables are pasted into the page,
open them with :func:`script_header` and print them with :func:`emit`.
"""

from __future__ import annotations

import datetime
import os
import shlex
import statistics
import sys

from commkit._units import format_bytes

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")

# The size bands, as (exclusive lower, inclusive upper) bytes: "up to 1 KiB" includes 1 KiB.
BANDS = ((-1, 1 << 10, "up to 1 KiB"), (1 << 10, 64 << 10, "1 KiB – 64 KiB"),
         (64 << 10, 4 << 20, "64 KiB – 4 MiB"), (4 << 20, 64 << 20, "4 MiB – 64 MiB"))
# Ratios to the raw mpi4py call. Up to 1 KiB: allreduce <= 1.3, the
# others <= 1.5; above 1 KiB: the band targets, which were set against the MPI library's own
# collective -- the raw call is that collective, called directly.
TARGETS = {"allreduce": (1.3, 1.2, 1.0, 0.8)}
DEFAULT_TARGETS = (1.5, 1.5, 1.25, 1.0)
# Broadcast, in place and out of place, at most 0.9x the raw MPI_Bcast from 1 MiB up.
BROADCAST_TARGET, BROADCAST_FROM = 0.9, 1 << 20
IN_PLACE = " in place"

# Where the hand-written analysis lives in the page; the script keeps it when it rewrites the page.
ANALYSIS_START = "<!-- analysis: written by hand; compare.py keeps this block when it rewrites the page -->"
ANALYSIS_END = "<!-- end of analysis -->"
NO_ANALYSIS = "*No analysis yet: profile the missing cells and write the causes here.*"
# Where tables measured by the other scripts (memory_floor.py, inplace.py) are pasted, each with its command.
PASTED_START = "<!-- pasted: tables from the other benchmark scripts; compare.py keeps this block -->"
PASTED_END = "<!-- end of pasted tables -->"
NO_PASTED = ("*Tables from `benchmarks/memory_floor.py` and `benchmarks/inplace.py` go here, each with its "
             "command, date and load.*")


def targets(collective):
    return TARGETS.get(collective, DEFAULT_TARGETS)


def band_of(size: int) -> int | None:
    for k, (lo, hi, _) in enumerate(BANDS):
        if lo < size <= hi:
            return k
    return None


def fmt_size(n: int) -> str:
    """The page's sizes: exact binary units up to MiB (``'64 KiB'``, ``'1536 B'``; the sweeps end at 64 MiB)."""
    return format_bytes(n, largest="MiB")


def fmt_us(t: float) -> str:
    if t >= 10000:
        return f"{t / 1000:.1f} ms"
    return f"{t:.1f}" if t >= 10 else f"{t:.2f}"


def fmt_pct(x: float) -> str:
    return f"{x * 100:.0f}%"


# -- summarising rows ----------------------------------------------------------------------------------


def baseline_of(rows) -> str:
    """"raw" (the mpi4py call) when the rows have it; results saved before it was measured have "native"."""
    return "raw" if any(r["algorithm"] == "raw" for r in rows) else "native"


def ratios(rows, baseline="native", name="auto"):
    """Per (collective, size): ``name``'s time over ``baseline``'s, per repetition and summarised.

    ``baseline`` is a name, or a tuple of names of which the first one measured
    at that size is used (``("raw in place", "raw")``: a raw broadcast has one
    form). Each repetition is one interleaved measurement (the median of its
    runs); the ratio reported is the median over repetitions, with their min and max.
    """
    reps = {}
    for row in rows:
        key = (row["collective"], row["size"])
        reps.setdefault(key, {}).setdefault(row.get("rep", 0), {})[row["algorithm"]] = row
    choices = (baseline,) if isinstance(baseline, str) else tuple(baseline)
    out = []
    for (collective, size), by_rep in reps.items():
        measured = {n for r in by_rep.values() for n in r}
        base = next((b for b in choices if b in measured), None)
        pairs = [(r[name], r[base]) for r in by_rep.values() if name in r and base in r]
        if not pairs:
            continue
        per_rep = [a["time_us"] / b["time_us"] for a, b in pairs]
        out.append({
            "collective": collective, "size": size, "baseline": base,
            "auto_choice": pairs[0][0].get("auto_choice"),
            "time_us": statistics.median(a["time_us"] for a, _ in pairs),
            "base_us": statistics.median(b["time_us"] for _, b in pairs),
            "ratio": statistics.median(per_rep), "lo": min(per_rep), "hi": max(per_rep), "reps": len(per_rep),
            "spread": statistics.median(a["spread"] for a, _ in pairs),
            "base_spread": statistics.median(b["spread"] for _, b in pairs),
            "runs": pairs[0][0]["runs"],
            "wrong": sum(a["wrong"] + b["wrong"] for a, b in pairs),
        })
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    out.sort(key=lambda r: (order.get(r["collective"], 99), r["size"]))
    return out


def verdicts(summary):
    """Per collective and band: the worst size's ratio, the target, PASS/MISS and the failing sizes."""
    cells = {}
    for r in summary:
        band = band_of(r["size"])
        if band is None:
            continue
        cell = cells.setdefault((r["collective"], band), {"worst": None, "misses": [], "sizes": 0})
        cell["sizes"] += 1
        target = targets(r["collective"])[band]
        if cell["worst"] is None or r["ratio"] > cell["worst"]["ratio"]:
            cell["worst"] = r
        if r["ratio"] > target:
            cell["misses"].append(r)
        cell["target"] = target
        cell["pass"] = not cell["misses"]
    return cells


def crossovers(rows):
    """Per collective: for each size the fastest commkit algorithm, and what auto chose and lost."""
    by_key = {}
    for row in rows:
        by_key.setdefault((row["collective"], row["size"]), {})[row["algorithm"]] = row
    table = {}
    for (collective, size), algs in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        mine = {k: v for k, v in algs.items() if k not in ("auto", "native")}
        if not mine:
            continue
        best = min(mine.values(), key=lambda r: r["time_us"])
        choice = algs.get("auto", best).get("auto_choice") or best["algorithm"]
        chosen = mine.get(choice)
        native = algs.get("native")
        table.setdefault(collective, []).append({
            "size": size, "best": best["algorithm"], "best_us": best["time_us"], "choice": choice,
            "choice_us": chosen["time_us"] if chosen else None,
            "loss": (chosen["time_us"] / best["time_us"]) if chosen else None,
            "native_us": native["time_us"] if native else None,
            "times": {k: v["time_us"] for k, v in mine.items()},
        })
    return table


def ranges(points, key):
    """Consecutive sizes sharing ``key``, as ``[(value, first size, last size)]``."""
    spans = []
    for p in points:
        if spans and spans[-1][0] == p[key]:
            spans[-1][2] = p["size"]
        else:
            spans.append([p[key], p["size"], p["size"]])
    return spans


# -- the stand-alone scripts' pages (memory_floor.py, inplace.py): pasted into the page's PASTED block ----------


def script_header(script: str, nprocs: int, argv, machine: str, run: str, load: str, wrong: int) -> list[str]:
    """The lines that open a stand-alone script's table: the command that made it, then when, where and how.

    Args:
        script: the script's path from the repository root (``benchmarks/inplace.py``).
        nprocs: the job's number of ranks.
        argv: the script's arguments, as given.
        machine: the machine line (``_tasks.machine_line``).
        run: what ran and how long (``"5 sweeps, 40 s"``).
        load: the load line (``_tasks.load_line``).
        wrong: the number of wrong results.

    Returns:
        ``Command: ...``, a blank line, ``Date: ...`` and a blank line: prepend them to the table.
    """
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return [f"Command: `{shlex.join(['mpiexec', '-n', str(nprocs), 'python', script, *argv])}`", "",
            f"Date: {date}; {machine}; {run}; {load}. Wrong results: {wrong}.", ""]


def emit(text: str, markdown: str | None) -> None:
    """Print a script's page, and also write it to the file ``markdown`` when one is named (``--markdown``)."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)


# -- the page ---------------------------------------------------------------------------------------


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _load_line(meta):
    load = meta.get("load") or {}
    samples = load.get("samples") or []
    if not samples:
        return "not recorded"
    ones = [s[1] for s in samples]
    text = (f"1-minute load average at start {load['start'][0]:.2f}, at end {load['end'][0]:.2f}; "
            f"sampled every {load.get('every', 5):g} s during the run: min {min(ones):.2f}, "
            f"median {statistics.median(ones):.2f}, max {max(ones):.2f}. Each rank busy-waits in MPI, so "
            "a job of p ranks adds about p to the load by itself")
    jobs = meta.get("jobs") or []
    if jobs:
        text += "; per part (load at its start and end): " + "; ".join(
            f"{j['what']}: {j['load'][0]:.2f} → {j['load'][1]:.2f}" for j in jobs if j.get("nprocs"))
    return text


def machine_section(meta):
    m = meta["machine"]
    rows = [
        ("CPU", f"{m.get('cpu')} ({m.get('cores')} cores as the OS sees them)"),
        ("memory", f"{m.get('memory_gib', '?')} GiB"),
        ("OS", m.get("platform")),
        ("MPI library", " ".join((m.get("mpi_library", "?") + ("; " + "; ".join(m["mpi_details"])
                                                              if m.get("mpi_details") else "")).split())),
        ("Python", m.get("python")),
        ("mpi4py", m.get("mpi4py")),
        ("NumPy", m.get("numpy")),
        ("commkit", f"{m.get('commkit')} ({meta.get('git', 'git revision unknown')})"),
        ("torch (gloo)", m.get("torch") or "not installed: the gloo comparison was skipped"),
        ("date", meta.get("date")),
        ("run time", f"{meta.get('seconds', 0) / 60:.1f} min"),
        ("load", _load_line(meta)),
    ]
    text = _table(["", ""], [(f"**{k}**", v) for k, v in rows])
    if meta.get("env_removed"):
        text += ("\n\nThe script clears these variables for its jobs, so the shipped selection table and "
                 f"blocking (timeout-free) calls are measured: `{'`, `'.join(meta['env_removed'])}`.")
    return text


def targets_table(cells, collectives):
    header = ["collective"] + [b[2] for b in BANDS]
    body = []
    for c in collectives:
        row = [f"`{c}`"]
        for k in range(len(BANDS)):
            cell = cells.get((c, k))
            if cell is None:
                row.append("–")
                continue
            w = cell["worst"]
            mark = "PASS" if cell["pass"] else "**MISS**"
            row.append(f"{mark} {w['ratio']:.2f} (≤ {cell['target']:g}; worst at {fmt_size(w['size'])}, "
                       f"runs {w['lo']:.2f}–{w['hi']:.2f})")
        body.append(row)
    return _table(header, body)


def _excess(ratio, target):
    pct = (ratio / target - 1) * 100
    return f"{pct:.0f}%" if pct >= 1 else f"{pct:.2f}%"


def _ratio(ratio, target):
    """Two decimals, or three where two would print the target itself."""
    return f"{ratio:.3f}" if round(ratio, 2) == target else f"{ratio:.2f}"


def misses_list(cells, collectives):
    lines = []
    for c in collectives:
        for k, (_, _, label) in enumerate(BANDS):
            cell = cells.get((c, k))
            if not cell or cell["pass"]:
                continue
            sizes = ", ".join(
                f"{fmt_size(r['size'])} {_ratio(r['ratio'], cell['target'])} (+{_excess(r['ratio'], cell['target'])}, "
                f"runs {r['lo']:.2f}–{r['hi']:.2f}, auto = `{r['auto_choice']}`)"
                for r in cell["misses"])
            lines.append(f"- `{c}`, {label} (target ≤ {cell['target']:g}): {sizes}.")
    return "\n".join(lines) if lines else "Every targeted cell passes."


def _index(summary):
    return {(r["collective"], r["size"]): r for r in summary}


def _each(r):
    return f"{r['lo']:.2f}–{r['hi']:.2f}"


def per_size_tables(rows, collectives):
    """Every size: the raw call, commkit auto and native, out of place and (where allowed) in place."""
    base = baseline_of(rows)
    summary = ratios(rows, base, "auto")
    native = _index(ratios(rows, base, "native"))
    in_place = _index(ratios(rows, (base + IN_PLACE, base), "auto" + IN_PLACE))
    native_ip = _index(ratios(rows, (base + IN_PLACE, base), "native" + IN_PLACE))
    wrong = {}
    for row in rows:
        key = (row["collective"], row["size"])
        wrong[key] = wrong.get(key, 0) + row["wrong"]
    out = []
    for c in collectives:
        mine = [r for r in summary if r["collective"] == c]
        if not mine:
            continue
        has_ip = any((c, r["size"]) in in_place for r in mine)
        body = []
        for r in mine:
            key = (c, r["size"])
            band = band_of(r["size"])
            target = targets(c)[band] if band is not None else None
            verdict = "" if target is None else ("PASS" if r["ratio"] <= target else "**MISS**")
            nat, ip, nip = native.get(key), in_place.get(key), native_ip.get(key)
            line = [fmt_size(r["size"]), f"`{r['auto_choice']}`", fmt_us(r["base_us"]), fmt_us(r["time_us"]),
                    f"**{r['ratio']:.2f}**", _each(r), f"≤ {target:g} {verdict}" if target else "",
                    f"{nat['ratio']:.2f}" if nat else "–"]
            if has_ip:
                line += [fmt_us(ip["base_us"]) if ip else "–", fmt_us(ip["time_us"]) if ip else "–",
                         f"**{ip['ratio']:.2f}**" if ip else "–", _each(ip) if ip else "–",
                         f"{nip['ratio']:.2f}" if nip else "–"]
            body.append(line + [f"{fmt_pct(r['spread'])}, {fmt_pct(r['base_spread'])}", r["runs"], wrong.get(key, 0)])
        header = ["size", "auto runs", f"{base} (us)", "auto (us)", f"auto / {base}", "each sweep", "target",
                  f"native / {base}"]
        if has_ip:
            header += ["raw (us), the in-place baseline" if c == "broadcast" else f"{base} in place (us)",
                       "auto in place (us)", f"in place: auto / {base}", "each sweep", f"in place: native / {base}"]
        out.append(f"### {c}\n\n" + _table(header + [f"spread (auto, {base})", "runs", "wrong"], body))
    return "\n\n".join(out)


def native_table(rows, collectives):
    """Per band, the worst ratio of commkit's path to the library's collective over the raw call."""
    base = baseline_of(rows)
    if base != "raw":
        return None
    out = []
    for name in ("native", "native" + IN_PLACE):
        summary = ratios(rows, (base + IN_PLACE, base) if name.endswith(IN_PLACE) else base, name)
        for c in collectives:
            cells = []
            for k in range(len(BANDS)):
                mine = [r for r in summary if r["collective"] == c and band_of(r["size"]) == k]
                if not mine:
                    cells.append("–")
                    continue
                worst = max(mine, key=lambda r: r["ratio"])
                med = statistics.median(r["ratio"] for r in mine)
                cells.append(f"{worst['ratio']:.2f} at {fmt_size(worst['size'])} (median {med:.2f})")
            if any(cell != "–" for cell in cells):
                out.append([f"`{c}`", "in place" if name.endswith(IN_PLACE) else "out of place"] + cells)
    return _table(["collective", "form"] + [b[2] for b in BANDS], out)


def broadcast_inplace_section(rows, collectives):
    """Broadcast against the raw MPI_Bcast from 1 MiB up, and in place against out of place."""
    base = baseline_of(rows)
    if base != "raw":
        return None
    parts = []
    bcast = []
    for name in ("auto", "auto" + IN_PLACE, "native", "native" + IN_PLACE):
        mine = [r for r in ratios(rows, "raw", name) if r["collective"] == "broadcast" and r["size"] >= BROADCAST_FROM]
        if mine:
            worst = max(mine, key=lambda r: r["ratio"])
            ok = worst["ratio"] <= BROADCAST_TARGET
            bcast.append([f"`{name}`", "PASS" if ok else "**MISS**",
                          f"{worst['ratio']:.2f} at {fmt_size(worst['size'])} (each sweep {_each(worst)})",
                          ", ".join(f"{fmt_size(r['size'])} {r['ratio']:.2f}" for r in mine)])
    if bcast:
        parts.append(f"Broadcast from {fmt_size(BROADCAST_FROM)} up, commkit over the raw `MPI_Bcast` on the same "
                     f"buffer (target ≤ {BROADCAST_TARGET:g} at every size):\n\n"
                     + _table(["commkit form", "verdict", "worst size", "every size"], bcast))
    table = []
    for c in collectives:
        for form in ("auto", "native", "raw"):
            mine = [r for r in ratios(rows, form, form + IN_PLACE) if r["collective"] == c]
            if not mine:
                continue
            worst = max(mine, key=lambda r: r["ratio"])
            slower = [r for r in mine if r["ratio"] > 1.0]
            table.append([f"`{c}`", f"`{form}`", (f"{worst['ratio']:.2f} at {fmt_size(worst['size'])} "
                                                 f"(each sweep {_each(worst)})"), f"{len(slower)} of {len(mine)}",
                          ", ".join(f"{fmt_size(r['size'])} {r['ratio']:.2f}" for r in slower if r["ratio"] > 1.05)
                          or "none"])
    if table:
        parts.append("In place over out of place, the same form in the same sweep (target: never above 1; "
                     "every algorithm, not only `auto`, is in `benchmarks/inplace.py`'s table below):\n\n"
                     + _table(["collective", "form", "worst in place / out of place", "sizes above 1",
                               "sizes above 1.05"], table))
    return "\n\n".join(parts) if parts else None


def overhead_section(results):
    over, null = results.get("overhead"), results.get("null")
    parts = []
    if over and over.get("rows"):
        body = []
        for r in over["rows"]:
            t = r["timing"]
            ck, raw = t["commkit auto"]["us"], t["mpi4py Sendrecv + np.add"]["us"]
            nat, rawar = t["commkit native"]["us"], t["mpi4py Allreduce"]["us"]
            fastest = t["commkit auto"]["min_us"] - t["mpi4py Sendrecv + np.add"]["min_us"]
            body.append([fmt_size(r["bytes"]), f"`{r['auto_choice']}`", f"{ck:.2f}", f"{raw:.2f}",
                         f"**{ck - raw:.2f}**", f"{fastest:.2f}", f"{t['mpi4py Sendrecv']['us']:.2f}",
                         f"{nat:.2f}", f"{rawar:.2f}", f"{nat - rawar:.2f}"])
        parts.append(_table(["size", "auto runs", "commkit allreduce", "mpi4py Sendrecv + np.add",
                             "overhead", "overhead, fastest blocks", "mpi4py Sendrecv alone", "commkit native",
                             "mpi4py Allreduce", "native path overhead"], body))
        first = over["rows"][0]["timing"]
        parts.append(f"Times in us per call, median of {over.get('blocks', '?')} blocks of "
                     f"{over.get('calls', '?')} back-to-back calls on 2 ranks (a block's time is its slower "
                     f"rank's; block order rotates); \"fastest blocks\" subtracts the two columns' fastest "
                     f"blocks instead, the estimate least disturbed by other load. Spread (IQR/median) of the "
                     f"commkit column: "
                     f"{fmt_pct(first['commkit auto']['spread'])}; of the mpi4py column: "
                     f"{fmt_pct(first['mpi4py Sendrecv + np.add']['spread'])}.")
    if null and null.get("rows"):
        body = []
        for r in null["rows"]:
            t = r["timing"]
            ck = t["commkit allreduce (null transport)"]["us"]
            add = t["np.add alone"]["us"]
            ring = t["commkit allreduce_ring (null transport)"]["us"]
            body.append([fmt_size(r["bytes"]), f"`{r['auto_choice']}`", f"{ck:.2f}", f"{add:.2f}",
                         f"**{ck - add:.2f}**", f"{ring:.2f}"])
        parts.append("With a transport that moves nothing (one process; what is left is commkit's own "
                     "Python: argument checks, the cached plan, the executor loop, the reduction):\n\n"
                     + _table(["size", "auto runs", "commkit allreduce", "np.add alone",
                               "Python per call", "allreduce_ring (4 steps)"], body))
    return "\n\n".join(parts) if parts else "Not measured in this run."


def rss_section(results):
    rss = results.get("rss")
    if not rss:
        return "Not measured in this run."
    body = []
    for r in rss:
        ranks = r["ranks"]
        before = max(x["maxrss_before_kib"] for x in ranks) / 1024
        after = max(x["maxrss_after_kib"] for x in ranks) / 1024
        scratch = ranks[0]["declared_scratch_bytes"]
        shmem = max(x["rss_shmem_kib"] or 0 for x in ranks) / 1024
        label = r["algorithm"] if r["algorithm"] == r["chosen"] else f"{r['algorithm']} (`{r['chosen']}`)"
        body.append([label, f"{before:.0f}", f"{after:.0f}", f"**{after - before:.0f}**",
                     "–" if scratch is None else f"{scratch / 2**20:.0f}", f"{shmem:.0f}",
                     sum(x["wrong"] for x in ranks)])
    size = fmt_size(rss[0]["bytes"])
    verdict = ""
    by = {r["algorithm"]: r for r in rss}
    if "auto" in by:
        auto = by["auto"]
        scratch = auto["ranks"][0]["declared_scratch_bytes"]
        growth = max(x["maxrss_after_kib"] - x["maxrss_before_kib"] for x in auto["ranks"]) * 1024
        ok = scratch is not None and scratch <= auto["bytes"]
        verdict = (f"\n\nTarget (allreduce scratch per rank at most the message size): "
                   f"{'**met**' if ok else '**missed**'} -- `auto` runs `{auto['chosen']}`, which declares "
                   f"{fmt_size(scratch) if scratch is not None else 'no'} of scratch for a {size} message and "
                   f"grew the peak RSS by {growth / 2**20:.0f} MiB")
        if "native" in by:
            nat = max(x["maxrss_after_kib"] - x["maxrss_before_kib"] for x in by["native"]["ranks"]) * 1024
            verdict += f"; MPICH's own allreduce grew it by {nat / 2**20:.0f} MiB"
        verdict += "."
    return (f"One float32 allreduce of {size} per rank on {rss[0]['nprocs']} ranks, each algorithm in a fresh "
            f"`mpiexec` job. Peak RSS is `ru_maxrss` of the larger rank, before the calls (input and output "
            f"allocated and written) and after them; the growth is what the collective itself needed. "
            f"MiB:\n\n" + _table(["algorithm", "peak RSS before", "peak RSS after", "growth",
                                  "commkit scratch declared", "shared memory mapped (RssShmem, at end)",
                                  "wrong"], body) + verdict)


def gloo_section(results, collectives):
    gloo = results.get("gloo")
    if not gloo:
        return "Not measured in this run."
    if gloo.get("skipped"):
        return f"Skipped: {gloo['skipped']}"
    summary = ratios(gloo["rows"], baseline="gloo")
    native = {(r["collective"], r["size"]): r for r in ratios(gloo["rows"])}
    slower = [r for r in summary if r["ratio"] >= 1.0]
    body = []
    for c in collectives:
        rows = [r for r in summary if r["collective"] == c]
        if not rows:
            continue
        best = min(rows, key=lambda r: r["ratio"])
        worst = max(rows, key=lambda r: r["ratio"])
        body.append([f"`{c}`", len(rows), f"{best['ratio']:.2f} at {fmt_size(best['size'])}",
                     f"{worst['ratio']:.2f} at {fmt_size(worst['size'])}",
                     sum(r["ratio"] < 1.0 for r in rows)])
    head = (f"torch {gloo.get('torch')}, `init_process_group('gloo', init_method='tcp://127.0.0.1:<port>')`, "
            "2 processes, one torch thread each, in the same `mpiexec` job as commkit and on the same "
            "NumPy buffers (`torch.from_numpy`), interleaved with commkit `auto` and `native` exactly as above. "
            "torch's allreduce, reduce and broadcast work in place, so before each of their runs the input is "
            "copied into the output, untimed: gloo is timed in place, commkit out of place (it leaves the "
            "input untouched and, for broadcast, copies it into the root's output inside the call), which "
            "favours gloo at large sizes. gloo's own threads share the two cores with the ranks, so every "
            "time in this job, commkit's included, is higher than in the tables above. "
            "Ratio = commkit auto / gloo (below 1: commkit is faster).\n\n")
    verdict = ("commkit auto is faster than gloo at every size measured." if not slower else
               "commkit auto is **not** faster at: " + ", ".join(
                   f"`{r['collective']}` {fmt_size(r['size'])} ({r['ratio']:.2f})" for r in slower) + ".")
    detail = []
    for c in collectives:
        rows = [r for r in summary if r["collective"] == c]
        if not rows:
            continue
        lines = []
        for r in rows:
            nat = native.get((c, r["size"]))
            lines.append([fmt_size(r["size"]), fmt_us(r["time_us"]), fmt_us(r["base_us"]), f"**{r['ratio']:.2f}**",
                          f"{r['lo']:.2f}–{r['hi']:.2f}", fmt_us(nat["base_us"]) if nat else "–", r["wrong"]])
        detail.append(f"### {c} vs gloo\n\n" + _table(
            ["size", "auto (us)", "gloo (us)", "auto / gloo", "each sweep", "native (us)", "wrong"], lines))
    return (head + verdict + "\n\n" + _table(["collective", "sizes", "best auto/gloo", "worst auto/gloo",
                                              "sizes where commkit is faster"], body)
            + "\n\n" + "\n\n".join(detail))


def ranks_section(results, collectives):
    detail = results.get("detail") or {}
    extra = sorted(int(p) for p in detail if int(p) > 2)
    if not extra:
        return "Not measured in this run."
    sums = {p: {(r["collective"], r["size"]): r for r in ratios(detail[str(p)]["rows"])} for p in extra}
    sizes = sorted({k[1] for p in extra for k in sums[p]})
    out = []
    for c in collectives:
        body = []
        for s in sizes:
            cells = []
            for p in extra:
                r = sums[p].get((c, s))
                cells.append("–" if r is None else f"{r['ratio']:.2f} (`{r['auto_choice']}`)")
            if any(cell != "–" for cell in cells):
                body.append([fmt_size(s)] + cells)
        out.append(f"### {c}\n\n" + _table(["size"] + [f"{p} ranks: auto / native (auto runs)" for p in extra],
                                             body))
    return "\n\n".join(out)


def crossover_section(results, collectives):
    detail = results.get("detail") or {}
    if not detail:
        return "Not measured in this run."
    out = []
    for p in sorted(detail, key=int):
        table = crossovers(detail[p]["rows"])
        flag = "" if int(p) <= 2 else " (oversubscribed: indicative only)"
        out.append(f"### {p} ranks{flag}")
        body = []
        for c in collectives:
            points = table.get(c)
            if not points:
                continue
            best = "; ".join(f"`{a}` {fmt_size(lo)}–{fmt_size(hi)}" if lo != hi else f"`{a}` {fmt_size(lo)}"
                             for a, lo, hi in ranges(points, "best"))
            lost = [pt for pt in points if pt["loss"] and pt["loss"] > 1.15]
            losses = ", ".join(f"{fmt_size(pt['size'])}: `{pt['choice']}` {pt['loss']:.2f}x `{pt['best']}`"
                               for pt in lost) or "none beyond 15%"
            body.append([f"`{c}`", best, losses])
        out.append(_table(["collective", "fastest commkit algorithm by size", "where auto's choice loses > 15%"],
                          body))
        for c in collectives:
            points = table.get(c)
            if not points:
                continue
            algs = sorted({a for pt in points for a in pt["times"]})
            rows = [[fmt_size(pt["size"])] + [fmt_us(pt["times"][a]) if a in pt["times"] else "–" for a in algs]
                    + [fmt_us(pt["native_us"]) if pt["native_us"] else "–", f"`{pt['choice']}`"] for pt in points]
            out.append(f"<details><summary>{c}, {p} ranks: every algorithm (us)</summary>\n\n"
                       + _table(["size"] + [f"`{a}`" for a in algs] + ["native", "auto runs"], rows)
                       + "\n\n</details>")
    return "\n\n".join(out)


def page(results, analysis: str | None, figures: dict, pasted: str | None = None) -> str:
    meta = results["meta"]
    main = results.get("bench", {}).get("2")
    collectives = [c for c in COLLECTIVES if c in meta.get("collectives", COLLECTIVES)]
    rows = main["rows"] if main else []
    base = baseline_of(rows) if rows else "raw"
    summary = ratios(rows, base, "auto")
    cells = verdicts(summary)
    ip_collectives = [c for c in collectives if any(r["algorithm"] == "auto" + IN_PLACE and r["collective"] == c
                                                   for r in rows)]
    ip_cells = verdicts(ratios(rows, (base + IN_PLACE, base), "auto" + IN_PLACE))
    wrong = sum(r["wrong"] for r in rows)
    sweeps = meta.get("repeats", 1)
    quick = ("\n```{note}\nThis page came from a `--quick` run (the CI smoke): two sizes and a few runs each. "
             "Its numbers are not measurements.\n```\n" if meta.get("quick") else "")
    if meta.get("tuning"):
        quick += ("\n```{warning}\n`auto` here follows the tuning file "
                  f"`{os.path.basename(meta['tuning'])}` (COMMKIT_TUNING), consulted before the shipped "
                  "`commkit/tuning/default.json`: these are not the shipped defaults.\n```\n")
    if base != "raw":
        quick += ("\n```{note}\nThese results were saved before compare.py measured the raw mpi4py call: "
                  "every ratio on this page is to commkit's `native` path.\n```\n")
    fig_main = figures.get("main")
    fig_algs = figures.get("algorithms")
    label = "the raw mpi4py call" if base == "raw" else "native"
    parts = [
        "# Benchmarks: commkit against the raw mpi4py call",
        quick,
        ("This page is written by `benchmarks/compare.py`; only the analysis block under "
         "[Targets](#targets) and the tables pasted from the other benchmark scripts (each with its "
         "command) are written by hand (the script keeps both when it rewrites the page). "
         "To reproduce it (about "
         f"{max(1, round(meta.get('seconds', 0) / 60))} minutes on this machine):"),
        f"```console\n$ {meta.get('command', 'python benchmarks/compare.py')}\n```",
        ("It starts every `mpiexec` job itself (through `commkit._mpiexec`), ends every process it started, "
         "and writes this page, its figures under `docs/_static/` and the raw results as JSON "
         f"(`{meta.get('data_path', 'benchmarks/results.json')}`)."),
        "## Machine and versions",
        machine_section(meta),
        "## Method",
        ("- **What is compared.** What a user would otherwise write -- the mpi4py call on a `Dup` of "
         "`COMM_WORLD` (`comm.Allreduce(x, out, MPI.SUM)`, `comm.Bcast(buf, 0)`, ...; MPICH from the "
         "`mpich` wheels), the **raw** column -- against commkit's `auto` (the algorithm the shipped "
         "selection table picks) and, as a second column, commkit's `native` (commkit's own path to the same "
         "library collective: what commkit's call path costs on top of the library). float32, "
         "`op=\"sum\"`, root 0."),
        ("- **In place and out of place.** Where commkit takes `out=x` (allreduce, broadcast, reduce) every "
         "form is measured both ways: the raw in-place allreduce and reduce pass `MPI.IN_PLACE` (a reduce's "
         "non-root ranks send `x` either way), the raw `MPI_Bcast` is in place by nature and is the "
         "baseline of both of commkit's broadcast forms (`broadcast(x, out=out)` and "
         "`broadcast(out, out=out)`). Before an in-place run its input is copied into the output, untimed; "
         "before any other run the output is poisoned, untimed."),
        ("- **Same buffers, interleaved.** Every form runs on the same input and output buffers: every timed "
         "run of one is followed by one of each other, and which goes first rotates. An `MPI_Barrier` "
         "precedes every run; a run's time is its slowest rank's; every result is checked against NumPy "
         "(the `wrong` column). Each sweep draws new input data (new small-integer values, so sums are "
         "exact) in newly allocated buffers."),
        ("- **Size** counts a message as `commkit.selection` does: the per-rank vector for allreduce, "
         "reduce and broadcast; the whole vector for allgather (the gathered result) and reduce_scatter "
         "(the input); the block sent to each peer for alltoall. Sizes are powers of 2 from 4 B to 64 MiB "
         "(a size that rounds to the same message, such as 4 B of allgather on 2 ranks, is skipped)."),
        (f"- **Medians and spread.** Each size is measured in {sweeps} separate sweeps over all sizes "
         "(minutes apart, so a burst of load hits one sweep, not all). In a sweep each form runs "
         "`runs` times (more for small sizes: about the same seconds per size) and its time is the median; "
         "`spread` is the inter-quartile range of those runs over their median. A ratio is the two "
         "medians' quotient in the same sweep; the tables give the median ratio over the sweeps and, "
         "next to it, the lowest and highest sweep (the spread of repeated identical runs). The machine "
         "is shared: the load average during each part is in the table above."),
        ("- **Bands, targets and verdicts.** A size belongs to the band whose upper end it does not exceed "
         "(1 KiB is in \"up to 1 KiB\", 64 KiB in \"1 KiB – 64 KiB\", 4 MiB in \"64 KiB – 4 MiB\"). "
         "Targets are ratios to the raw call: up to 1 KiB, allreduce ≤ 1.3 and the others ≤ 1.5; "
         "above 1 KiB, the band targets, which were set against the MPI library's own collective (the raw call is "
         "that collective, called directly). A cell passes when the median ratio of *every* size in it "
         "meets the target; it shows the worst size."),
        ("- **Ranks.** The targets are for 2 ranks on 2 cores. 3 and 4 ranks oversubscribe the cores, "
         "so those numbers show correctness and the shape of the curves, not speed (docs/architecture.md: quote speed "
         "only for ranks <= cores)."),
        "## Targets",
        (f"2 ranks, ratio = commkit auto / {label}, out of place, median over {sweeps} sweeps (worst size of "
         "each band; the lowest and highest sweep in brackets). Wrong results in these runs (every form): "
         f"**{wrong}**."),
        targets_table(cells, collectives) if summary else "Not measured in this run.",
    ]
    if ip_collectives:
        parts += [
            ("In place (`out=x`), ratio = commkit auto in place / the raw in-place call (`MPI.IN_PLACE`; "
             "broadcast: `MPI_Bcast`), same targets:"),
            targets_table(ip_cells, ip_collectives),
        ]
    nat = native_table(rows, collectives) if rows else None
    if nat:
        parts += [("commkit's own path to the library collective (`algorithm=\"native\"`) over the raw call, "
                   "worst size of each band and the median over the band's sizes (no target; this is what "
                   "commkit's call path adds):"), nat]
    i14 = broadcast_inplace_section(rows, collectives) if rows else None
    if i14:
        parts += ["### Broadcast, and in place against out of place", i14]
    parts += [
        "### Cells that miss",
        (misses_list(cells, collectives) if summary else "")
        + ("\n\nIn place:\n\n" + misses_list(ip_cells, ip_collectives) if ip_collectives else ""),
        ANALYSIS_START,
        (analysis or NO_ANALYSIS).strip(),
        ANALYSIS_END,
    ]
    if fig_main:
        parts += [(f"```{{image}} {fig_main}\n:alt: time and auto/raw ratio against size, 2 ranks, "
                  "one line per collective\n```")]
    parts += [
        "## Fixed overhead of one collective call",
        ("What commkit adds to a call (argument checks, the cached selection and schedule, the executor) "
         "over the transport's own point-to-point: a tiny allreduce through commkit against the same "
         "`Sendrecv` and `np.add` its 2-rank schedule performs, written directly in mpi4py on a duplicate "
         "of the same communicator. Target: at most 5 us."),
        overhead_section(results),
        PASTED_START,
        (pasted or NO_PASTED).strip(),
        PASTED_END,
        "## Memory",
        rss_section(results),
        "## Every size, 2 ranks",
        per_size_tables(rows, collectives) if summary else "Not measured in this run.",
        "## torch.distributed (gloo)",
        gloo_section(results, collectives),
        "## 3 and 4 ranks (oversubscribed, not targeted)",
        ("From the every-algorithm sweep below (one sweep, interleaved with every algorithm). "
         "**Not targeted**: more ranks than cores."),
        ranks_section(results, collectives),
        "## Every algorithm: where each wins",
        ("Every commkit algorithm that applies, with `auto` and `native`, interleaved on the same buffers "
         "(sizes in powers of 4, one sweep). These are the measured crossovers behind "
         "`commkit/tuning/default.json`; a choice that loses by more than 15% to another commkit algorithm "
         "is listed. Reproduce one with, for example, "
         "`commkit bench -n 2 -c allreduce --sizes 4:64M:4 -i 20`."),
    ]
    if fig_algs:
        parts.append(f"```{{image}} {fig_algs}\n:alt: every algorithm's time over native's, by size and "
                     "rank count\n```")
    parts.append(crossover_section(results, collectives))
    return "\n\n".join(p for p in parts if p is not None and p != "") + "\n"


def existing_block(path: str, start: str = ANALYSIS_START, end: str = ANALYSIS_END,
                   empty: str = NO_ANALYSIS) -> str | None:
    """The hand-kept block between ``start`` and ``end`` of an existing page, or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    lo, hi = text.find(start), text.find(end)
    if lo < 0 or hi < lo:
        return None
    block = text[lo + len(start): hi].strip()
    return None if block == empty else block


def existing_analysis(path: str) -> str | None:
    """The hand-written analysis block of an existing page, or None."""
    return existing_block(path)


# -- figures -------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_axis(ax):
    ax.set_xscale("log", base=2)
    ticks = [4, 64, 1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20]
    ax.set_xticks(ticks)
    ax.set_xticklabels(["4", "64", "1K", "16K", "256K", "4M", "64M"])
    ax.grid(True, which="major", alpha=0.3)


def _ratio_axis(ax):
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([0.1, 0.2, 0.3, 0.5, 0.8, 1, 1.25, 1.5, 2, 3, 5]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_main(results, path, collectives):
    """Time against size per collective (raw, auto, native, gloo), then every collective's ratio with the targets."""
    plt = _pyplot()
    rows = results["bench"]["2"]["rows"]
    base = baseline_of(rows)
    summary = ratios(rows, base, "auto")
    native = _index(ratios(rows, base, "native")) if base == "raw" else {}
    gloo = results.get("gloo") or {}
    gloo_sum = ratios(gloo["rows"], baseline="gloo") if gloo.get("rows") else []
    fig = plt.figure(figsize=(13, 12))
    grid = fig.add_gridspec(3, 3, height_ratios=[1, 1, 1.25])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(collectives):
        ax = fig.add_subplot(grid[i // 3, i % 3])
        mine = [r for r in summary if r["collective"] == c]
        sizes = [r["size"] for r in mine]
        ax.plot(sizes, [r["time_us"] for r in mine], "-o", ms=3, color=colors[i % len(colors)], label="commkit auto")
        ax.plot(sizes, [r["base_us"] for r in mine], "k--", label="raw mpi4py" if base == "raw" else "native (MPICH)")
        nat = [native[c, s] for s in sizes if (c, s) in native]
        if nat:
            ax.plot([r["size"] for r in nat], [r["time_us"] for r in nat], ":", color="0.3", label="commkit native")
        g = [r for r in gloo_sum if r["collective"] == c]
        if g:
            ax.plot([r["size"] for r in g], [r["base_us"] for r in g], ":", color="0.45", label="torch gloo")
        _size_axis(ax)
        ax.set_yscale("log")
        ax.set_title(f"{c}, 2 ranks")
        ax.set_ylabel("time (us, median)")
        ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[2, :])
    for i, c in enumerate(collectives):
        mine = [r for r in summary if r["collective"] == c]
        sizes = [r["size"] for r in mine]
        ratio = [r["ratio"] for r in mine]
        err = [[r["ratio"] - r["lo"] for r in mine], [r["hi"] - r["ratio"] for r in mine]]
        ax.errorbar(sizes, ratio, yerr=err, fmt="-o", ms=3, capsize=2, color=colors[i % len(colors)], label=c)
    for target, style, label in ((targets("allreduce"), "-", "target, allreduce"),
                                 (DEFAULT_TARGETS, "--", "target, the others")):
        xs, ys = [], []
        for (lo, hi, _), t in zip(BANDS, target):
            xs += [max(lo, 2), hi]
            ys += [t, t]
        ax.plot(xs, ys, style, color="crimson", lw=1.2, label=label)
    ax.axhline(1.0, color="k", lw=0.6)
    _size_axis(ax)
    _ratio_axis(ax)
    ax.set_xlabel("size (B)")
    ax.set_ylabel(f"commkit auto / {base} (median; bars: sweeps)")
    ax.set_title(("ratio to the raw mpi4py call" if base == "raw" else "ratio to MPICH's own collective")
                 + ", same run, interleaved (below 1: commkit faster)")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_algorithms(results, path, collectives):
    """Every algorithm's time over native's, one panel per collective and rank count."""
    plt = _pyplot()
    detail = results["detail"]
    procs = sorted(detail, key=int)
    fig, axes = plt.subplots(len(procs), len(collectives), figsize=(3.3 * len(collectives), 3.0 * len(procs)),
                             squeeze=False, sharey=True)
    for row, p in zip(axes, procs):
        by = {}
        for r in detail[p]["rows"]:
            by.setdefault((r["collective"], r["algorithm"]), {})[r["size"]] = r["time_us"]
        for ax, c in zip(row, collectives):
            native = by.get((c, "native"), {})
            for (coll, alg), times in sorted(by.items()):
                if coll != c or alg == "native":
                    continue
                sizes = sorted(s for s in times if s in native)
                style = {"color": "k", "lw": 2, "alpha": 0.35} if alg == "auto" else {}
                ax.plot(sizes, [times[s] / native[s] for s in sizes], "-o" if alg != "auto" else "-", ms=2,
                        label=alg, **style)
            ax.axhline(1.0, color="k", lw=0.6, ls="--")
            _size_axis(ax)
            _ratio_axis(ax)
            ax.set_title(f"{c}, {p} ranks" + (" (oversubscribed)" if int(p) > 2 else ""), fontsize=9)
            ax.legend(fontsize=6)
        row[0].set_ylabel("time / native")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(results, out_dir: str) -> dict:
    """Write ``out_dir``/benchmarks.md and ``out_dir``/_static/benchmarks*.png; return their paths."""
    meta = results["meta"]
    collectives = [c for c in COLLECTIVES if c in meta.get("collectives", COLLECTIVES)]
    static = os.path.join(out_dir, "_static")
    os.makedirs(static, exist_ok=True)
    paths, figures = {}, {}
    try:
        import matplotlib  # noqa: F401

        draw = True
    except ImportError:
        print("matplotlib is not installed: the page is written without its figures "
              "(`pip install matplotlib` to draw them).", file=sys.stderr)
        draw = False
    if draw and results.get("bench", {}).get("2"):
        paths["main"] = os.path.join(static, "benchmarks.png")
        plot_main(results, paths["main"], collectives)
        figures["main"] = "_static/benchmarks.png"
    if draw and results.get("detail"):
        paths["algorithms"] = os.path.join(static, "benchmarks_algorithms.png")
        plot_algorithms(results, paths["algorithms"], collectives)
        figures["algorithms"] = "_static/benchmarks_algorithms.png"
    md = os.path.join(out_dir, "benchmarks.md")
    text = page(results, existing_analysis(md), figures, existing_block(md, PASTED_START, PASTED_END, NO_PASTED))
    with open(md, "w") as f:
        f.write(text)
    paths["page"] = md
    return paths
