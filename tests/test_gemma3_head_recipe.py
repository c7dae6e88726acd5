"""``python -m training.gemma3_head``: the shipped answers and the recipe that builds the head from them.

The build itself (teacher forcing with the 270M target, then training) takes an hour on a CPU;
here: the answers file is what the recipe says it is, and the recipe hands each stage its
settings, the head going where ``--pair gemma3`` looks for it.
"""

from __future__ import annotations

import numpy as np

from specjax._src.models import registry
from training import distill_data, draft, eagle, gemma3_head

GEMMA3_VOCAB = 262_144


def test_the_shipped_answers_are_gemma3_answers_to_training_prompts():
    z = np.load(gemma3_head.ANSWERS)
    assert int(z["format"]) == distill_data.ANSWERS_FORMAT
    ids = z["token_ids"]
    assert ids.size > 300_000 and int(ids.max()) < GEMMA3_VOCAB
    assert int(ids.max()) >= 49_152  # beyond SmolLM2's vocabulary: not the other pair's answers
    rows = z["prompt_lengths"].size
    assert rows == z["answer_lengths"].size and int(z["prompt_lengths"].sum() + z["answer_lengths"].sum()) == ids.size


def test_the_recipe_rebuilds_the_data_then_trains_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(draft, "main", lambda argv: calls.append(("draft", argv)) or 0)
    def fake_eagle(argv):
        calls.append(("eagle", argv))
        export = registry.built_path(registry.GEMMA3_EAGLE)
        export.mkdir(parents=True, exist_ok=True)
        (export / "MODEL_CARD.md").write_text("# card\n")
        return 0

    monkeypatch.setattr(eagle, "main", fake_eagle)
    assert gemma3_head.main(["--out", str(tmp_path / "run"), "--no-progress"]) == 0
    card = (registry.built_path(registry.GEMMA3_EAGLE) / "MODEL_CARD.md").read_text()
    assert card.startswith("# card") and "## Measured with the engine" in card and "tau 2.65" in card
    (_, d), (_, e) = calls
    assert d[d.index("--answers-from") + 1] == str(gemma3_head.ANSWERS) and "--gather-only" in d
    assert d[d.index("--target") + 1] == e[e.index("--target") + 1] == registry.GEMMA3_TARGET
    assert e[e.index("--data") + 1] == str(tmp_path / "run" / "data")
    assert e[e.index("--export") + 1] == str(registry.built_path(registry.GEMMA3_EAGLE))
    assert str(registry.built_path(registry.GEMMA3_EAGLE)).startswith(str(tmp_path / "cache"))
    args = eagle.build_parser().parse_args(e)  # every setting is one training.eagle takes
    assert args.head_vocab == 8192 and not args.head_vocab_from and args.unroll >= 2


def test_only_models_specjax_builds_have_a_build_path():
    import pytest

    from specjax.models import built_model_path

    assert built_model_path(registry.GEMMA3_EAGLE).name == "gemma-3-270m-eagle"
    with pytest.raises(ValueError, match="not a model specjax builds.*gemma-3-270m-eagle"):
        built_model_path("gemma-3-270m")  # shipped by a package, not built
