"""The documentation builds with warnings as errors (what `tox -e docs` runs), so CI catches broken docs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("sphinx", "myst_nb")),
                    reason="needs the docs extra (pip install '.[docs]'): sphinx and myst-nb")
def test_docs_build_without_warnings(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         os.path.join(ROOT, "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "html" / "index.html").exists()
    assert (tmp_path / "html" / "api.html").exists()
