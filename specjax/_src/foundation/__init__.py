"""The foundation every room shares: argument checks and what a ``jit`` static needs to tell pytree classes apart."""
