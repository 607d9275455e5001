"""Sphinx configuration for the commkit documentation (MyST Markdown, notebooks through myst-nb).

Build: ``tox -e docs``, or ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
Nothing here runs commkit's collectives: the figures under ``_static/figures``
are committed, made by ``python docs/make_figures.py``, and notebooks are
shown as saved (``nb_execution_mode = "off"``).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's commkit, also when it is not installed

import commkit

project = "commkit"
author = "the commkit authors"
copyright = "the commkit authors"
release = version = commkit.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "commkit_docs",
]

# docs/notebooks is a copy of the repository's notebooks/ folder, made when the build starts.
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"

autodoc_member_order = "bysource"
autodoc_mock_imports = ["cupy", "cupyx", "torch"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, so autodoc'd attributes are not described twice

html_theme = "sphinx_rtd_theme"
html_title = f"commkit {release}"
html_static_path = ["_static"]
html_css_files = ["commkit.css"]
