"""Moved to :mod:`specjax.testing` (public tiny models); kept so tests can import it by this name."""
from specjax.testing import *  # noqa: F401,F403
