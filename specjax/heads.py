"""Target-feature draft heads (EAGLE-style): a one-block draft that reads the target's hidden states.

    head = specjax.load("smollm2-135m-instruct-eagle")           # or heads.load_feature_head(dir)
    pair = specjax.pair(specjax.load("smollm2-135m-instruct"), head)  # the head borrows the target's embeddings
    out = specjax.decode(pair, prompts, num_draft=4, temperature=0.0)

A :class:`FeatureHead` drafts from the target's last-block features ("EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty", Li et al.,
arXiv:2401.15077): each verification forward hands the head the target's
features of the tokens it accepted, and the head drafts the next ones from
them, then from its own predicted features. A head may read several of the
target's blocks (``feature_layers``, e.g. a low, a middle and the last, as
EAGLE-3, arXiv:2503.01840, does), mixed by a learned ``reduce``;
:func:`with_feature_layers` grows a trained one-block head into such a head
without changing what it drafts, and :func:`with_num_layers` stacks more
blocks on a trained head the same way; :func:`with_head_vocab` narrows its
LM head to fewer (the most frequent) tokens, for a cheaper step. Every acceptance rule and drafting policy
works with it, on chains and trees. ``python -m training.eagle`` trains one
for a target. A head's directory (:func:`save_head`) holds ``config.json``
and ``head.safetensors`` (``WEIGHTS_FILE``), without the borrowed embedding;
:class:`FeatureHeadModule` and :func:`reduce_features` are the Flax module and
the feature mix behind :class:`FeatureHead`, for a training loss.

Published heads load too (``specjax.load(dir)`` or :func:`load_published_head`):
EAGLE-1/2 and EAGLE-3 as a :class:`FeatureHead` of their ``variant``, with
EAGLE-3's reduced vocabulary mapped to target ids (:func:`draft_to_target_ids`)
and its default target blocks fixed at pairing (:func:`eagle3_default_layers`);
Medusa as a :class:`MedusaHead` (:func:`medusa_logits`: every head at once).
A reduced head's forward also returns its own columns (``out.reduced``, a
:class:`ReducedLogits`), which greedy drafting ranks instead of the full scatter.
"""

import warnings

from specjax._src.models.feature_head import (
    WEIGHTS_FILE,
    FeatureHead,
    FeatureHeadModule,
    is_feature_head,
    load_feature_head,
    reduce_features,
    save_head,
)
from specjax._src.models.feature_head import VARIANTS
from specjax._src.models.feature_head_build import (
    attach_embedding,
    eagle3_default_layers,
    head_config,
    init_from_target,
    with_feature_layers,
    with_head_vocab,
    with_num_layers,
)
from specjax._src.models.lm import ReducedLogits
from specjax._src.models.published_heads import MedusaHead, draft_to_target_ids, load_published_head, medusa_logits

__all__ = (
    "WEIGHTS_FILE",
    "FeatureHead",
    "FeatureHeadModule",
    "attach_embedding",
    "head_config",
    "init_from_target",
    "is_feature_head",
    "load_feature_head",
    "reduce_features",
    "ReducedLogits",
    "save_head",
    "with_feature_layers",
    "with_head_vocab",
    "with_num_layers",
    "VARIANTS",
    "eagle3_default_layers",
    "MedusaHead",
    "draft_to_target_ids",
    "load_published_head",
    "medusa_logits",
)


def load_head(path, dtype=None):
    """Deprecated name of :func:`load_feature_head` (``specjax.rules`` loads pivot heads)."""
    warnings.warn("specjax.heads.load_head is deprecated; use specjax.heads.load_feature_head "
                  "(specjax.rules.load_pivot_head loads a pivot head).", DeprecationWarning, stacklevel=2)
    return load_feature_head(path, dtype)
