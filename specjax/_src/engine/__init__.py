"""The slots engine: many requests in one state, advanced by a jitted step (see :mod:`.slots`)."""
