"""Sphinx helpers that build parts of the docs from commkit itself, so they cannot drift from the code.

* ``commkit-algorithms`` -- a table of the algorithms of one family (a module
  of :mod:`commkit.algorithms`, or ``all``): name, restrictions and cost
  formula, straight from the registry.
* ``commkit-tuning-table`` -- the shipped selection rules
  (``commkit/tuning/default.json``), one row per rule, with its reason.
* ``commkit-module`` (reStructuredText pages only) -- ``automodule`` for a
  module that exists in this checkout, and a visible note for one that does
  not yet (autodoc would fail the ``-W`` build on a missing module).
* The repository's ``notebooks/`` folder is copied to ``docs/notebooks/``
  when the build starts (Sphinx reads only files under ``docs/``; a symbolic
  link would make MyST resolve the notebooks' links to each other outside the
  docs), and the page ``notebooks`` gets a glob toctree over ``notebooks/*``
  only when some notebook is there, since Sphinx warns about a glob that
  matches nothing.
* Pages other people write (:data:`OPTIONAL_PAGES`) are left out of the
  index's toctree while they do not exist, instead of failing the build.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
from typing import ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

log = logging.getLogger(__name__)

NOTEBOOKS_MARKER = "<!-- notebooks-toctree -->"
OPTIONAL_PAGES = ("gpu", "benchmarks", "mesh")


def _table(header, rows, widths):
    table = nodes.table(classes=["commkit-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    head += _row([nodes.Text(h) for h in header])
    body = nodes.tbody()
    group += body
    for cells in rows:
        body += _row(cells)
    return table


def _row(cells):
    row = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        para = nodes.paragraph()
        para += cell
        entry += para
        row += entry
    return row


def _identifier(text: str):
    """An identifier in a table cell: code that wraps only between identifiers, never inside one.

    A narrow column would otherwise break ``allreduce_double_binary_tree`` mid-word (the
    ``commkit-id`` class is ``white-space: nowrap`` in ``_static/commkit.css``).
    """
    return nodes.literal(text, text, classes=["commkit-id"])


def _xref(target: str, text: str):
    ref = addnodes.pending_xref("", refdomain="py", reftype="func", reftarget=target, refexplicit=True,
                                refwarn=False)
    ref += _identifier(text)
    return ref


class AlgorithmsTable(SphinxDirective):
    """``commkit-algorithms FAMILY``: the registry's algorithms of one module (or ``all``)."""

    required_arguments = 1
    option_spec: ClassVar[dict] = {"collective": directives.unchanged}

    def run(self):
        from commkit import algorithms

        algorithms.load()  # the built-in algorithms and any named in COMMKIT_ALGORITHMS
        for path in glob.glob(os.path.join(os.path.dirname(algorithms.__file__), "*.py")):
            self.env.note_dependency(path)  # rebuild the page when an algorithm's registration changes
        family = self.arguments[0]
        wanted = self.options.get("collective")
        rows = []
        for collective in algorithms.COLLECTIVES:
            if wanted and collective != wanted:
                continue
            for alg in algorithms.for_collective(collective).values():
                if alg.schedule is None:
                    continue
                module = alg.schedule.__module__
                if family != "all" and module.rsplit(".", 1)[-1] != family:
                    continue
                restrictions = [text for flag, text in ((alg.commutative, "commutative op"),
                                                        (alg.power_of_two, "p a power of two")) if flag]
                summary = alg.doc.splitlines()[0] if alg.doc else ""
                rows.append([
                    _xref(f"{module}.{alg.schedule.__name__}", alg.qualname),
                    nodes.Text(", ".join(restrictions) or "none"),
                    nodes.Text(alg.formula),
                    nodes.Text(summary),
                ])
        if not rows:
            raise self.error(f"no algorithms in family {family!r}" + (f" for {wanted!r}" if wanted else ""))
        return [_table(("algorithm", "restrictions", "cost", "in one line"), rows, (22, 14, 30, 34))]


class TuningTable(SphinxDirective):
    """``commkit-tuning-table``: the rules of ``commkit/tuning/default.json``."""

    def run(self):
        from commkit import algorithms, selection
        from commkit.selection import default_table

        self.env.note_dependency(os.path.join(os.path.dirname(selection.__file__), "tuning", "default.json"))
        table = default_table()
        rows = []
        for collective in algorithms.COLLECTIVES:
            for rule in table.get(collective, ()):
                when = []
                if "min_procs" in rule or "max_procs" in rule:
                    when.append(_bounds("p", rule.get("min_procs"), rule.get("max_procs"), str))
                if "min_bytes" in rule or "max_bytes" in rule:
                    when.append(_bounds("bytes", rule.get("min_bytes"), rule.get("max_bytes"), _size))
                if rule.get("commutative"):
                    when.append("commutative op")
                rows.append([_identifier(collective), nodes.Text("; ".join(when) or "otherwise"),
                             _identifier(rule["algorithm"]), nodes.Text(rule.get("reason", ""))])
        return [_table(("collective", "when", "algorithm", "why"), rows, (14, 22, 18, 46))]


def _size(n: int) -> str:
    from commkit._units import format_bytes

    return format_bytes(n, largest="MiB")


def _bounds(what, lo, hi, fmt):
    if lo is not None and hi is not None:
        return f"{fmt(lo)} ≤ {what} ≤ {fmt(hi)}"
    if lo is not None:
        return f"{what} ≥ {fmt(lo)}"
    return f"{what} ≤ {fmt(hi)}"


class ModuleIfPresent(SphinxDirective):
    """``commkit-module NAME``: ``automodule NAME`` with members, or a note if the module is not there yet."""

    required_arguments = 1
    has_content = False

    def run(self):
        name = self.arguments[0]
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            log.info(f"commkit docs: {name} is not in this checkout; its API section shows a note instead")
            note = nodes.note()
            note += nodes.paragraph(text=f"{name} is not part of this build of commkit yet.")
            return [note]
        lines = StringList([f".. automodule:: {name}", "   :members:", ""], source=self.get_source_info()[0])
        container = nodes.container()
        self.state.nested_parse(lines, self.content_offset, container)
        return container.children


def _optional_pages(app, docname, source):
    if docname != "index":
        return
    for page in OPTIONAL_PAGES:
        if not any(os.path.exists(os.path.join(app.srcdir, page + ext)) for ext in (".md", ".rst", ".ipynb")):
            log.info(f"commkit docs: {page} does not exist yet; left out of the table of contents")
            source[0] = re.sub(rf"^{page}\n", "", source[0], flags=re.MULTILINE)


def _copy_notebooks(app, config):
    """Mirror ``commkit_notebooks`` (default ``../notebooks``) into ``docs/notebooks``, mtimes kept."""
    source = os.path.normpath(os.path.join(app.srcdir, config.commkit_notebooks))
    target = os.path.join(app.srcdir, "notebooks")
    if os.path.islink(target):
        os.unlink(target)
    shutil.rmtree(target, ignore_errors=True)
    if os.path.isdir(source) and glob.glob(os.path.join(source, "*.ipynb")):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))


def _notebooks(app, docname, source):
    if docname != "notebooks" or NOTEBOOKS_MARKER not in source[0]:
        return
    found = sorted(glob.glob(os.path.join(app.srcdir, "notebooks", "*.ipynb")))
    if found:
        block = "```{toctree}\n:glob:\n:maxdepth: 1\n\nnotebooks/*\n```\n"
    else:
        block = "*No notebooks are in this checkout yet.*\n"
    source[0] = source[0].replace(NOTEBOOKS_MARKER, block)


def _always_reread(app, env, added, changed, removed):
    # Their text depends on which files and modules exist, not only on their own source.
    return [name for name in ("index", "notebooks", "api") if name in env.found_docs]


def setup(app):
    app.add_directive("commkit-algorithms", AlgorithmsTable)
    app.add_directive("commkit-tuning-table", TuningTable)
    app.add_directive("commkit-module", ModuleIfPresent)
    app.add_config_value("commkit_notebooks", "../notebooks", "env")
    app.connect("config-inited", _copy_notebooks)
    app.connect("source-read", _notebooks)
    app.connect("source-read", _optional_pages)
    app.connect("env-get-outdated", _always_reread)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
