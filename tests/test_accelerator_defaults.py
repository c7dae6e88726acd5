"""Defaults that follow the platform: a GGUF file loads in bfloat16 on a GPU or TPU, float32 on the CPU.

The platform is stood in for by ``loading._platform`` (this machine has only a
CPU); the logits stay float32 everywhere.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax._src.models import loading
from specjax.testing import llama_config, peaked_target_and_draft
from test_gguf import write_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    target = peaked_target_and_draft(llama_config(rope_theta=10000.0))[0]
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, target.module.config, target.params)
    return str(path)


def test_a_gguf_file_computes_in_float32_on_the_cpu(gguf_file):
    model = specjax.load(gguf_file)
    assert model.module.config.dtype == "float32"
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(model.params))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_gguf_file_computes_in_bfloat16_on_an_accelerator_with_float32_logits(gguf_file, monkeypatch, platform):
    monkeypatch.setattr(loading, "_platform", lambda mesh=None: platform)
    model = specjax.load(gguf_file)
    assert model.module.config.dtype == "bfloat16"
    assert specjax.logits(model, [[1, 2, 3]]).dtype == np.float32
    assert specjax.load(gguf_file, dtype="float32").module.config.dtype == "float32"  # asked for, kept
