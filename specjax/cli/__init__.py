"""The ``specjax`` command line, apart from the library (``specjax/_src`` has no
argparse and no printing).

    specjax compare                       # the real pair (SmolLM2-135M + its head), ~5 min on 2 CPU cores
    specjax compare --pair embedded       # every rule on the small pair that ships with specjax
    specjax compare --quick               # a smoke run
    specjax generate --rule mars:theta=0.9 --prompt "def fib(n):"
    specjax certify                       # certificate quantiles per criterion vs the paper (greedy)
    specjax models                        # the models specjax.load knows by name

``app.py`` holds the options and the dispatch; ``compare.py``, ``generate.py``
and ``certify.py`` one command each (``compare.py`` is also the compare job:
presets, evaluation sets, timed runs, table and plot); ``common.py`` the
model-pair options every command shares.
"""

from specjax.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
