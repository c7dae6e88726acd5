"""Checkpoint conversion: ``python -m checkpoints_conversion --help``.

``to-orbax`` turns a Hugging Face safetensors directory (or a GGUF file)
into specjax's Orbax format; ``to-hf`` exports a specjax (Orbax or HF)
checkpoint or a GGUF file back to a Hugging Face directory; neither writes
into a non-empty directory unless ``--force``. ``manifest`` / ``verify``
record and check a SHA-256 per file. The library functions behind it are
``specjax.load``, ``specjax.save_orbax``, ``specjax.export_hf``,
``specjax.checkpoint_manifest`` and ``specjax.verify_manifest``.
"""
