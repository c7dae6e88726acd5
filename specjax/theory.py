"""Acceptance certificates: when is a greedy draft guaranteed to be accepted?

For a deterministic rule whose accepted set is an upper level set of the target
distribution p, ``certificate(rule, p)`` is the smallest ``KL(p || q)`` of any
drafter q whose argmax the rule rejects: a drafter closer than that to the
target is always accepted. See ``specjax._src.theory.certificates`` for the derivations.

    from specjax import theory
    from specjax.rules import additive
    c = theory.certificate(additive(t=0.3), target_probs)        # [..., V] -> [...]
    d = theory.position_diagnostics(additive(t=0.3), target_probs, draft_probs)

Live, during greedy decoding (certified fraction and certificate quantiles per
criterion; see ``specjax._src.theory.certify``)::

    diag = theory.certificate_diagnostics(additive(t=0.3), trees=(2, 4, 8))
    out = specjax.decode(pair, prompts, rule=additive(t=0.3), temperature=0.0, diagnostics=diag)
    report = diag.summarize(out.stats)   # report["additive:t=0.3"]["certificate_p5"], ...
    out, report = theory.certified_decode(pair, prompts, rule=additive(t=0.3))   # the same
"""

from specjax._src.theory.certificates import (
    accepted_set,
    certificate,
    check_certifiable,
    entropy,
    greedy_certificate,
    greedy_margin_bounds,
    kl_divergence,
    level_set_certificate,
    margin_bounds,
    num_accepted,
    position_diagnostics,
    rejection_margin,
    summarize_diagnostics,
    top_margin,
    tree_certificate,
    tree_margin_bounds,
    universal_bound,
)
from specjax._src.theory.certify import (
    CertificateDiagnostics,
    CertificateReport,
    certificate_diagnostics,
    certified_decode,
    histogram_quantile,
)

__all__ = [
    "CertificateDiagnostics",
    "CertificateReport",
    "certificate_diagnostics",
    "certified_decode",
    "histogram_quantile",
    "accepted_set",
    "certificate",
    "check_certifiable",
    "entropy",
    "greedy_certificate",
    "greedy_margin_bounds",
    "kl_divergence",
    "level_set_certificate",
    "margin_bounds",
    "num_accepted",
    "position_diagnostics",
    "rejection_margin",
    "summarize_diagnostics",
    "top_margin",
    "tree_certificate",
    "tree_margin_bounds",
    "universal_bound",
]
