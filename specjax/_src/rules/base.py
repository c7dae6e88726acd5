"""The acceptance-rule interface: rules are hashable values with pure methods.

Modelled on optax's ``GradientTransformation``, but each rule is a frozen
pytree dataclass, so ``jit`` takes it as an argument: its numeric fields are
traced and its static fields shape the program. A rule looks at one sequence's
draft block and says, for every draft slot independently, whether it would
accept the draft token *if every earlier slot were accepted*, why, and which
distribution the correction token is drawn from if that slot is the first
rejection. The engine vmaps the rule over the batch, takes the accepted prefix,
samples the correction or bonus token and calls ``update`` with the outcome.

Deciding every slot at once (rather than in a sequential loop) is exact: a
slot's decision only matters when all earlier slots were accepted, and every
rule here decides a slot from that slot's own distributions.

Shapes below are per sequence: ``K`` draft slots, vocabulary ``V``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.logits import sampling

Array = jax.Array
RuleState = Any


class Path(enum.IntEnum):
    """Why a slot was accepted. Stored as int32 in verdicts and stats."""

    REJECTED = 0
    EXACT = 1  # the lossless test accepted it (or, greedy, the draft is the target's argmax)
    RELAXED = 2  # a deterministic relaxed criterion accepted what the lossless test rejected
    PARDON = 3  # a tolerance or classifier accepted what the lossless test rejected (EARS, PAD)


NUM_PATHS = len(Path)


class VerifyInputs(NamedTuple):
    """One sequence's draft block, as every rule sees it.

    Attributes:
      draft_tokens: ``[K]`` int32 proposed tokens.
      draft_logits: ``[K, V]`` float32 draft logits after the sampling warp
        (temperature, top-k, top-p; raw logits when greedy).
      draft_probs: ``[K, V]`` ``softmax(draft_logits)``: the draft's
        distribution q (at temperature 0, the model's own T=1 distribution).
      target_logits: ``[K + 1, V]`` target logits after the same warp; slot ``K``
        is the bonus position after the last draft.
      target_probs: ``[K + 1, V]`` ``softmax(target_logits)``: p, the
        distribution the lossless test ``U <= p/q`` and residuals use.
      uniforms: ``[K]`` Uniform(0, 1) draws; shared by every rule of a
        combination, so ``any_of`` composes decisions made with the same coins.
      valid: ``[K]`` bool, False for slots the drafting policy did not fill
        (always a prefix of True). Target rows past ``1 + sum(valid)`` may be
        zero logits (uniform probs): the verification forward can run narrower
        than the block (``Buckets.verify``), so a rule reads them only under
        the ``valid`` mask, as every built-in rule does.
      features: extra per-slot inputs some rules need (PAD's hidden states), a
        dict of arrays with leading axis ``K``, or an empty dict (zero rows
        past the same point).

    On a token tree sampled at ``T > 0`` a node's children are judged one at
    a time, each as a one-slot block (``K = 1``) whose ``target_probs`` and
    ``draft_probs`` are what the earlier, rejected siblings left: the rule's
    correction after the previous child (``p`` for the first) and ``q`` with
    the earlier children removed (a point mass on the child for a dynamic
    tree's top-k children, ``dynamic_tree(..., sampled=False)``). ``target_logits`` and ``draft_logits`` stay the
    models' warped logits at the node. So a rule reads the target's own
    confidence at a position (a margin, a rank, an entropy, a tolerance) from
    :func:`position_probs` or the logits, and runs its lossless test on the
    probs; on a chain the two coincide.
    """

    draft_tokens: Array
    draft_logits: Array
    draft_probs: Array
    target_logits: Array
    target_probs: Array
    uniforms: Array
    valid: Array
    features: dict


class Verdict(NamedTuple):
    """A rule's decision for every slot of one block.

    Attributes:
      accept: ``[K]`` bool, accept slot k given all earlier slots accepted.
      path: ``[K]`` int32 :class:`Path` code (``REJECTED`` where not accepted).
      correction: ``[K, V]`` float32 distribution of the token emitted when slot
        k is the first rejection. Rows only need to be valid where ``accept`` is
        False. Greedy rules return one-hot rows.
    """

    accept: Array
    path: Array
    correction: Array


class RuleSpec(NamedTuple):
    """A rule's name and hyperparameters: for reports, parsing and theory.

    ``params`` is a tuple of ``(name, value)`` pairs so the spec is hashable.
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        # The inverse of ``specjax.rules.parse_rule``: "mars:theta=0.9", and
        # combinators as "any_of(speculative_sampling,mars:theta=0.9)".
        if not self.params:
            return self.name
        # (one_of's index follows its rules: "one_of(sd,mars:theta=0.9):index=1".)
        subs = self.params[0][1]
        if (self.params[0][0] == "rules" and isinstance(subs, tuple)
                and all(isinstance(s, RuleSpec) for s in subs)):
            rest = self.params[1:]
            return (self.name + "(" + ",".join(str(s) for s in subs) + ")"
                    + (":" + ",".join(f"{k}={v}" for k, v in rest) if rest else ""))
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


def spec_value(value: Any) -> Any:
    """A concrete scalar (Python, numpy or JAX) as a Python number, for specs."""
    if isinstance(value, jax.core.Tracer):
        return value  # inside jit: no concrete number to show
    if hasattr(value, "shape") and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    return value


class AcceptanceRule:
    """Base class of acceptance rules: hashable values, not closures.

    A rule is a frozen ``flax.struct.dataclass`` deriving from this class
    (like optax's ``GradientTransformation``, but a value the engine can pass
    to ``jit``). Its fields are its hyper-parameters:

    * pytree fields (the default) are *traced*: numbers such as MARS's
      ``theta`` and arrays such as PAD's head params. Another value of them
      reuses the compiled decode loop;
    * ``struct.field(pytree_node=False)`` fields are *static*: settings that
      change the program (a variant name, a rank ``m``, a user function).

    The engine reads what a rule needs from the value itself
    (:attr:`hidden_layers`, and the capability :attr:`lossless`); it never
    inspects closures, parses specs or asks for a rule's class.

    Methods (per sequence; the engine vmaps them over the batch):

    * ``init() -> state``: one sequence's initial running state (a pytree;
      ``()`` for stateless rules).
    * ``verify(inputs, state, *, greedy) -> Verdict``. ``greedy`` is a static
      Python bool: True when decoding at temperature 0.
    * ``update(state, inputs, verdict, num_accepted, *, greedy) -> state``,
      once per cycle with the accepted prefix length (int32 scalar).
    * ``spec``: the rule's :class:`RuleSpec` (name and parameters) for
      reports and :func:`~specjax.rules.parse_rule`.

    Level-set criteria (the acceptance-theory rules) also define
    ``accepted_set(logits, probs) -> bool[..., V]``; ``specjax.theory`` asks
    the rule for it rather than re-deriving it.

    A custom rule::

        @struct.dataclass
        class Confident(AcceptanceRule):
            floor: float = 0.2                      # traced
            name = "confident"

            def verify(self, inputs, state, *, greedy):
                exact, correction = lossless_decision(inputs, greedy=greedy)
                accept = exact | (token_prob(inputs.target_probs, inputs.draft_tokens) > self.floor)
                return Verdict(accept, paths(accept, exact, Path.RELAXED), correction)
    """

    name = "rule"  # a class attribute, not a field: subclasses override it
    level_set = False  # True: accepted_set() is an upper level set of p (certifiable)
    # True: a one-draft block is judged by the lossless test alone (accept iff
    # U q(x) <= p(x), correction the residual), so the engine may walk a token
    # tree by recursive rejection sampling without asking the rule per child,
    # and draw a dynamic tree's children (exact). The engine reads this
    # capability, never the rule's class.
    lossless = False

    def init(self) -> RuleState:
        return ()

    def verify(self, inputs: VerifyInputs, state: RuleState, *, greedy: bool) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__} does not define verify()")

    def update(self, state: RuleState, inputs: VerifyInputs, verdict: Verdict, num_accepted: Array,
               *, greedy: bool) -> RuleState:
        del inputs, verdict, num_accepted, greedy
        return state

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target block outputs the rule reads from ``inputs.features["hidden"]``."""
        return ()

    @property
    def spec(self) -> RuleSpec:
        """``RuleSpec(name, fields)``: every field in declaration order, less
        those declared with ``spec=False`` and ``omit_default`` fields left at
        their default."""
        params = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("spec") is False:
                continue
            if f.metadata.get("omit_default") and value == f.default:
                continue
            params.append((f.name, spec_value(value)))
        return RuleSpec(self.name, tuple(params))

    def __str__(self) -> str:
        return str(self.spec)


def static_field(default: Any = dataclasses.MISSING, *, omit_default: bool = False, spec: bool = True):
    """A compile-time rule field (see :class:`AcceptanceRule`).

    ``omit_default``: leave the field out of ``spec`` while it has its default
    (keeps ``"mars:theta=0.9"`` short); ``spec=False``: never in the spec.
    """
    metadata = {"omit_default": omit_default, "spec": spec}
    return struct.field(pytree_node=False, default=default, metadata=metadata)


def traced_field(default: Any = dataclasses.MISSING, *, omit_default: bool = False):
    """A traced rule field: a number or array the compiled program takes as input."""
    return struct.field(pytree_node=True, default=default, metadata={"omit_default": omit_default})


def _no_state() -> tuple:
    return ()


def _keep_state(state, inputs, verdict, num_accepted, *, greedy):
    del inputs, verdict, num_accepted, greedy
    return state


@struct.dataclass
class FunctionRule(AcceptanceRule):
    """A rule from plain functions (:func:`from_functions`). The functions are
    static and compared by identity: module-level functions share compiled
    programs; a fresh closure per call compiles anew."""

    verify_fn: Any = static_field(spec=False)
    init_fn: Any = static_field(_no_state, spec=False)
    update_fn: Any = static_field(_keep_state, spec=False)
    name: str = static_field("custom", spec=False)
    layers: tuple = static_field((), spec=False)

    def init(self) -> RuleState:
        return self.init_fn()

    def verify(self, inputs: VerifyInputs, state: RuleState, *, greedy: bool) -> Verdict:
        return self.verify_fn(inputs, state, greedy=greedy)

    def update(self, state, inputs, verdict, num_accepted, *, greedy):
        return self.update_fn(state, inputs, verdict, num_accepted, greedy=greedy)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.layers


def from_functions(verify, *, init=None, update=None, name: str = "custom",
                   hidden_layers: tuple = ()) -> FunctionRule:
    """A rule from functions, optax-style: ``verify(inputs, state, *, greedy)
    -> Verdict``, ``init() -> state`` (default: no state) and ``update(state,
    inputs, verdict, num_accepted, *, greedy) -> state`` (default: keep it).

    ``hidden_layers``: target block outputs the rule reads from
    ``inputs.features["hidden"]``. Hyper-parameters captured in a closure are
    compile-time constants; to trace them, subclass :class:`AcceptanceRule`.
    """
    if not callable(verify):
        raise TypeError(f"from_functions(): verify must be a function, got {type(verify).__name__}.")
    return FunctionRule(verify_fn=verify, init_fn=init or _no_state, update_fn=update or _keep_state,
                        name=str(name), layers=tuple(int(x) for x in hidden_layers))


def residual_distribution(target_probs: Array, draft_probs: Array) -> Array:
    """``norm(max(0, p - q))`` over the last axis; falls back to ``p`` where p == q.

    When p and q coincide the residual is empty, but the lossless test then
    accepts with probability one, so the fallback row is never sampled; it only
    keeps the row a valid distribution (no 0/0).
    """
    residual = jnp.maximum(target_probs - draft_probs, 0.0)
    total = residual.sum(-1, keepdims=True)
    return jnp.where(total > 1e-12, residual / jnp.maximum(total, 1e-30), target_probs)


def position_probs(inputs: VerifyInputs) -> Array:
    """``[K, V]`` ``softmax(target_logits)`` of the first ``K`` rows: the
    target's distribution at each slot's position, unchanged by the residuals
    a tree's earlier siblings leave in ``target_probs`` (see :class:`VerifyInputs`)."""
    k = inputs.draft_tokens.shape[0]
    return jax.nn.softmax(inputs.target_logits[:k], axis=-1)


def one_hot_argmax(logits: Array) -> Array:
    """``[..., V]`` one-hot of the argmax, float32."""
    return jax.nn.one_hot(sampling.argmax(logits), logits.shape[-1], dtype=jnp.float32)


def token_prob(probs: Array, tokens: Array) -> Array:
    """``probs[k, tokens[k]]`` for ``probs[K, V]`` (first K rows), ``tokens[K]``."""
    k = tokens.shape[0]
    return jnp.take_along_axis(probs[:k], tokens[:, None], axis=-1)[:, 0]


def lossless_decision(inputs: VerifyInputs, *, greedy: bool) -> tuple[Array, Array]:
    """The standard speculative-sampling test and its residual.

    Returns ``(accept[K], correction[K, V])``. Greedy: accept iff the draft is
    the target's argmax; the correction is the argmax. Sampling: accept iff
    ``U <= p(x) / q(x)``; the correction is ``norm(max(0, p - q))``.
    """
    k = inputs.draft_tokens.shape[0]
    target_logits = inputs.target_logits[:k]
    if greedy:
        accept = inputs.draft_tokens == sampling.argmax(target_logits)
        return accept, one_hot_argmax(target_logits)
    p = token_prob(inputs.target_probs, inputs.draft_tokens)
    q = token_prob(inputs.draft_probs, inputs.draft_tokens)
    # U * q <= p avoids dividing by q; q(x) > 0 always holds for a sampled x.
    accept = inputs.uniforms * q <= p
    return accept, residual_distribution(inputs.target_probs[:k], inputs.draft_probs)


@struct.dataclass
class SpeculativeSampling(AcceptanceRule):
    """Standard (lossless) speculative sampling; greedy exact match at T=0.

    "Fast Inference from Transformers via Speculative Decoding" (Leviathan et
    al., arXiv:2211.17192). Output tokens follow the target's warped
    distribution exactly. Correction: ``norm(max(0, p - q))`` (sampling) or
    ``argmax p`` (greedy).
    """

    name = "speculative_sampling"
    level_set = True  # in its greedy form: the accepted set is {argmax p}
    lossless = True

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        accept, correction = lossless_decision(inputs, greedy=greedy)
        path = jnp.where(accept, Path.EXACT, Path.REJECTED).astype(jnp.int32)
        return Verdict(accept=accept, path=path, correction=correction)

    def accepted_set(self, logits: Array, probs: Array) -> Array:
        """Greedy form: ``bool[..., V]``, the target's argmax only."""
        del probs
        return jax.nn.one_hot(sampling.argmax(logits), logits.shape[-1], dtype=bool)


def speculative_sampling() -> SpeculativeSampling:
    """Standard (lossless) speculative sampling; see :class:`SpeculativeSampling`."""
    return SpeculativeSampling()
