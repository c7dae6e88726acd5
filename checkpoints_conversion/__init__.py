"""Checkpoint conversion: ``python -m checkpoints_conversion --help``.

``to-orbax`` turns a Hugging Face safetensors directory into specjax's Orbax
format; ``to-hf`` exports a specjax (Orbax or HF) checkpoint back to a
Hugging Face directory. The library functions behind it are
``specjax.load``, ``specjax.save_orbax`` and ``specjax.export_hf``.
"""
