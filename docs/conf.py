"""Sphinx configuration for the specjax documentation.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (``pip install -e ".[docs]"``).
Guides are Markdown (MyST); the API reference is generated from the public modules' docstrings,
which use Google style (``Args:``, ``Returns:``), read by napoleon.
"""

project = "specjax"
author = "specjax authors"
copyright = "2026, specjax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# Every reference must resolve: a renamed function makes the build fail instead of leaving a
# dead link. References to other projects (jax, numpy, flax, the standard library) are not
# checked, since no intersphinx inventory is fetched (the build must work offline).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|np|numpy|flax|optax|orbax|typing|collections|dataclasses|enum|os|pathlib|"
               r"tokenizers|gguf|jinja2|concurrent|abc|functools)(\..*)?"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|type|None|Callable|Any|"
               r"Sequence|Mapping|Iterable|Iterator|Optional|Union|Array|ArrayLike|PyTree|"
               r"Self|Literal|NamedTuple|PathLike|KeyArray|DTypeLike|Mesh|NamedSharding|"
               r"PartitionSpec|Path|Key|Shape)"),
    # napoleon reads the "text:" that opens an attribute's docstring as its type: not a name.
    (r"py:.*", r".*[^\w.].*"),
    # private helpers and private modules named in docstrings and type hints
    (r"py:.*", r"(.*\.)?_\w+(\..*)?"),
]

autodoc_default_options = {"members": True, "imported-members": True, "member-order": "bysource", "undoc-members": False}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields of their class: autodoc already documents each field.
napoleon_use_ivar = True
add_module_names = False
# Guides link to files of the repository outside docs/ (BENCHMARKS.md, benchmarks/results/,
# examples/) with relative paths that work where the Markdown is read, on a code host or a
# checkout; Sphinx cannot resolve those as documents. tests/test_docs.py checks that every
# relative link of the guides and the README points to a file that exists.
suppress_warnings = ["myst.header", "myst.xref_missing"]

# furo: a plain, maintained theme with a light and a dark mode, readable API pages and no
# configuration to keep up.
html_theme = "furo"
html_title = "specjax"
