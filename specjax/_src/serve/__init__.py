"""The OpenAI-compatible server on the slots engine (``specjax serve``)."""
