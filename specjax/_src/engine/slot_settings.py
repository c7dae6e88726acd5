"""A slot's request settings: :class:`SlotSettings`, and the checks that turn them into the
device row an insert writes (:meth:`specjax.engine.Engine.validate` reports every problem as a
:class:`FieldError`; :meth:`specjax.engine.Engine.insert` raises the first).

The functions take the :class:`specjax.engine.Engine` whose limits they check (its vocabulary,
``K``, capacity, EOS slots, logit-bias slots, rule and log-prob width).
"""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.foundation.checks import as_integer, check_positive_int
from specjax._src.engine.prepare import check_min_temperature, resolve_eos_ids
from specjax._src.foundation.jit_keys import pytree_classes
from specjax._src.rules.base import AcceptanceRule
from specjax._src.rules.combinators import OneOf


class SlotSettings(NamedTuple):
    """One request's settings (host values; checked by :meth:`Engine.insert`).

    Attributes:
      temperature: 0 for greedy; else ``>= specjax.MIN_TEMPERATURE``.
      top_p: in (0, 1]; 1 keeps every token.
      top_k: a positive int up to the vocabulary size, or None.
      seed: an int: the request samples what ``decode(key=jax.random.key(seed))``
        samples for it alone. None with ``key`` None: a fresh random seed.
      key: a typed PRNG key instead of ``seed`` (``decode(key=key[None])``).
      max_new_tokens: tokens to generate at most (prompt + this must fit the
        slot's capacity).
      eos_token_id: an id or ids; None: the target's config; ``()``: none.
      stop_token_ids: more ids that end the request (kept in the output, as EOS).
      num_draft: the most drafts per cycle for this request, ``0 .. K``
        (None: the engine's ``K``; 0: plain decoding, one target token per cycle).
      controls: :class:`specjax.GenerationControls` (penalties, logit bias,
        ``min_new_tokens``), or None.
      rule: this request's acceptance rule: the engine's rule type with its
        own numbers (e.g. ``mars(theta=0.7)`` in an engine built with
        ``mars()``), or, in an engine built with ``rule=one_of(...)``, one of
        its members with numbers of its own (``Engine.rule_for``), where the
        engine holds per-slot rule numbers (every numeric field of its rule a
        scalar); None: the engine's rule (a one_of's first member, unless
        built with another ``index``).
      logprobs: None: no log-probabilities; 0: each committed token's own
        (``StepOutput.logprobs``); ``k`` in ``1 .. Engine(logprobs=N)``'s N:
        also the ``k`` most likely tokens (``StepOutput.top_ids[..., :k]``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    key: Any = None
    max_new_tokens: int = 64
    eos_token_id: Any = None
    stop_token_ids: Sequence[int] = ()
    num_draft: Optional[int] = None
    controls: Optional[processors_lib.GenerationControls] = None
    rule: Any = None
    logprobs: Optional[int] = None


class FieldError(NamedTuple):
    """One problem with a request's settings (:meth:`Engine.validate`).

    Attributes:
      field: the :class:`SlotSettings` attribute at fault (``"top_p"``,
        ``"controls.logit_bias"``, ...).
      message: what is wrong and what would be accepted (the text that
        :meth:`Engine.insert` raises).
    """

    field: str
    message: str


def settings_problems(
    engine, s: SlotSettings, prompt_length: int, index: Optional[int]
) -> tuple[list[tuple[str, Exception]], Optional[dict]]:
    """``([(field, error), ...], row)``: every problem, each with the
    exception :meth:`insert` raises for it, and the device row (None when
    there are problems). A check that depends on a bad field is skipped."""
    vocab, k_max = engine.vocab_size, engine.num_draft
    problems: list[tuple[str, Exception]] = []

    def check(field: str, fn):
        try:
            return True, fn()
        except (TypeError, ValueError) as error:
            problems.append((field, error))
            return False, None

    top_p = 1.0 if s.top_p is None else s.top_p
    # The order of the checks is the order insert has always raised them in.
    temperature_ok, _ = check("temperature", lambda: sampling.check_sampling_args(s.temperature, None, None))
    top_k_ok, _ = check("top_k", lambda: sampling.check_sampling_args(0.0, s.top_k, None))
    check("top_p", lambda: sampling.check_sampling_args(0.0, None, top_p))
    if temperature_ok:
        check("temperature", lambda: check_min_temperature(s.temperature))
    max_new_ok, _ = check("max_new_tokens", lambda: check_positive_int("max_new_tokens", s.max_new_tokens))
    if top_k_ok and s.top_k is not None and s.top_k > vocab:
        problems.append(
            (
                "top_k",
                ValueError(f"top_k={s.top_k} exceeds the vocabulary ({vocab} tokens); pass at most {vocab} or None."),
            )
        )
    if max_new_ok and prompt_length + s.max_new_tokens > engine.capacity:
        where = "" if index is None else f"request {index}: "
        problems.append(
            (
                "max_new_tokens",
                ValueError(
                    f"{where}the prompt ({prompt_length} tokens) + max_new_tokens ({s.max_new_tokens}) exceed the slot "
                    f"capacity ({engine.capacity}); shorten the prompt, lower max_new_tokens, or build the Engine with a "
                    "larger capacity."
                ),
            )
        )
    cap = k_max if s.num_draft is None else as_integer(s.num_draft)
    if cap is None or not 0 <= cap <= k_max:
        problems.append(
            (
                "num_draft",
                ValueError(f"num_draft must be an integer in 0 .. {k_max} (the engine's K), got {s.num_draft!r}."),
            )
        )
    eos_ok, eos = check("eos_token_id", lambda: resolve_eos_ids(s.eos_token_id, vocab, engine.params.target.module))
    stops_ok, stops = check(
        "stop_token_ids",
        lambda: resolve_eos_ids(tuple(s.stop_token_ids), vocab) if len(tuple(s.stop_token_ids)) else (),
    )
    ends = ()
    if eos_ok and stops_ok:
        ends = tuple(dict.fromkeys(eos + stops))
        if len(ends) > engine.cfg.num_eos:
            problems.append(
                (
                    "stop_token_ids" if stops else "eos_token_id",
                    ValueError(
                        f"eos_token_id and stop_token_ids name {len(ends)} ids; this engine holds {engine.cfg.num_eos} per "
                        "request (Engine(max_eos=...))."
                    ),
                )
            )
    controls = control_problems(engine, s.controls, problems)
    _, rule = check("rule", lambda: check_rule(engine, s.rule))
    _, keys = check("key" if s.key is not None else "seed", lambda: key_fields(s))
    _, logprobs = check("logprobs", lambda: check_logprobs(engine, s.logprobs))
    if problems:
        return problems, None
    eos_row = np.full((engine.cfg.num_eos,), -1, np.int32)
    eos_row[: len(ends)] = ends
    return problems, dict(
        max_new=np.int32(s.max_new_tokens),
        draft_cap=np.int32(cap),
        top_k=np.int32(0 if s.top_k is None else s.top_k),
        temperature=np.float32(s.temperature),
        top_p=np.float32(top_p),
        eos=eos_row,
        controls=controls,
        rule=rule,
        logprobs=np.int32(logprobs),
        **keys,
    )


def control_problems(engine, controls, problems: list) -> Optional[processors_lib.GenerationControls]:
    """Appends each bad control to ``problems`` as ``("controls.<field>", error)``; returns the controls
    (defaults for None), or None when one is bad."""
    if controls is not None and not isinstance(controls, processors_lib.GenerationControls):
        try:
            processors_lib.check_controls(controls, engine.vocab_size, "controls")
        except (TypeError, ValueError) as error:
            problems.append(("controls", error))
        return None
    controls = processors_lib.GenerationControls() if controls is None else controls
    ok = True
    # One field at a time (check_controls raises its first problem), in check_controls' order.
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_new_tokens", "logit_bias"):
        try:
            processors_lib.check_controls(
                processors_lib.GenerationControls(**{name: getattr(controls, name)}), engine.vocab_size, "controls"
            )
        except (TypeError, ValueError) as error:
            problems.append((f"controls.{name}", error))
            ok = False
    if not ok:
        return None
    if not engine.cfg.controls and not processors_lib.is_default(controls):
        problems.append(
            (
                "controls",
                ValueError(
                    "controls: this Engine was built with controls=False; build it with controls=True to use penalties, "
                    "logit_bias or min_new_tokens."
                ),
            )
        )
    elif controls.logit_bias and len(controls.logit_bias) > engine.cfg.num_bias:
        problems.append(
            (
                "controls.logit_bias",
                ValueError(
                    f"controls.logit_bias has {len(controls.logit_bias)} entries; this engine holds {engine.cfg.num_bias} "
                    "per request (Engine(max_bias=...))."
                ),
            )
        )
    return controls


def check_logprobs(engine, logprobs) -> int:
    """``SlotSettings.logprobs`` as the slot's int (-1 for None)."""
    if logprobs is None:
        return -1
    if not engine.cfg.logprobs:
        raise ValueError(
            "logprobs: this Engine was built with logprobs=0 (no log-probabilities); build it with "
            "Engine(logprobs=N) to report them, or leave SlotSettings.logprobs None."
        )
    number = as_integer(logprobs)
    if number is None or not 0 <= number <= engine.cfg.logprobs:
        raise ValueError(
            f"logprobs must be None or an integer in 0 .. {engine.cfg.logprobs} (this engine's "
            f"Engine(logprobs=...)), got {logprobs!r}."
        )
    return number


def rule_for(engine, rule) -> AcceptanceRule:
    """The value of ``SlotSettings.rule`` that has ``rule`` judge a request.

    ``rule``: one of :attr:`served_rules` with the same type and static
    fields and numbers of its own (``mars(theta=0.7)`` where ``mars()`` is
    served), or the engine's own rule type with other numbers. In an engine
    built with ``rule=one_of(...)`` it returns that ``one_of`` with
    ``index`` pointing at the member and the member's numbers replaced by
    ``rule``'s (the member whose numbers are ``rule``'s, where several
    share its type). :meth:`insert` and :meth:`validate` apply it to a
    ``SlotSettings.rule`` themselves. Raises ``ValueError`` naming the
    served rules when ``rule`` is none of them."""
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"rule: expected an AcceptanceRule (e.g. specjax.rules.mars(0.9)), got {type(rule).__name__}.")
    if same_structure(rule, engine.rule):
        return rule
    if isinstance(engine.rule, OneOf):
        members = engine.rule.rules
        matches = [i for i, member in enumerate(members) if same_structure(member, rule)]
        if matches:
            exact = [i for i in matches if same_values(members[i], rule)]
            i = (exact or matches)[0]
            return engine.rule.replace(rules=members[:i] + (rule,) + members[i + 1 :], index=i)
    if not isinstance(engine.rule, OneOf):
        raise ValueError(
            f"rule: {rule} is not the engine's rule type with other numbers ({engine.rule}); a "
            "request may change the rule's numbers, not its type or static fields (build the "
            "engine with rule=one_of(...) to serve several rules)."
        )
    served = ", ".join(str(r) for r in engine.served_rules)
    raise ValueError(
        f"rule: {rule} is not a rule this engine serves ({served}); a request may choose one of "
        "these, with numbers of its own, not another type or static setting."
    )


def check_rule(engine, rule):
    """A request's rule as the slot's row: the engine's rule (its one_of member
    chosen by :meth:`rule_for`) with the request's numbers (float32 / int32 scalars)."""
    if rule is None:
        rule = engine.rule
    elif not engine.cfg.per_slot_rule:
        if not (
            isinstance(rule, AcceptanceRule) and same_structure(rule, engine.rule) and same_values(rule, engine.rule)
        ):
            raise ValueError(
                f"rule: this engine's rule ({engine.rule}) has no per-request numbers (it holds "
                "arrays, such as PAD's pivot head, or no numbers), so every request uses it; leave "
                "SlotSettings.rule unset."
            )
    else:
        rule = rule_for(engine, rule)
    if not engine.cfg.per_slot_rule:
        return None
    return jax.tree_util.tree_map(lambda x, ref: np.asarray(x, slot_dtype(ref)), rule, engine.rule)


def slot_dtype(ref) -> np.dtype:
    """The dtype a rule's number has in the state (JAX's default widths: float32, int32)."""
    dtype = np.asarray(ref).dtype
    return {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}.get(dtype, dtype)


def same_structure(a, b) -> bool:
    """Same pytree classes (``jit_keys``: equal treedefs may hide other classes) and static fields."""
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and pytree_classes(a) == pytree_classes(b)


def same_values(a, b) -> bool:
    """Equal numbers leaf for leaf (``a`` and ``b`` of the same structure)."""
    return all(
        np.shape(x) == np.shape(y) and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def check_row_buckets(row_buckets, num_slots: int) -> tuple[int, ...]:
    if row_buckets is None:
        return (num_slots,)
    if isinstance(row_buckets, str):
        if row_buckets != "powers":
            raise ValueError(f'row_buckets must be None, "powers" or slot counts, got {row_buckets!r}.')
        row_buckets = [2**i for i in range(num_slots.bit_length()) if 2**i < num_slots]
    numbers = [as_integer(b) for b in row_buckets]
    if any(b is None or not 1 <= b <= num_slots for b in numbers):
        raise ValueError(f"row_buckets must be slot counts in 1 .. num_slots ({num_slots}), got {row_buckets!r}.")
    return tuple(sorted(set(numbers) | {num_slots}))


_KEY_SHAPE = (2,)  # the default (threefry) key's data


def key_fields(s: SlotSettings) -> dict:
    """``seed`` (uint32), ``keys`` (key data) and ``use_key``: a given key, or
    decode's key of sequence 0 for ``seed`` (``fold_in(key(seed), 0)``, derived in ``insert``)."""
    if s.key is not None and s.seed is not None:
        raise ValueError("give seed or key, not both.")
    if s.key is not None:
        key = s.key
        if not (
            hasattr(key, "dtype")
            and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and key.ndim == 0
            and jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))
        ):
            raise TypeError(f"key must be one typed PRNG key of the default kind (jax.random.key(seed)), got {key!r}.")
        return dict(seed=np.uint32(0), keys=np.asarray(jax.random.key_data(key)), use_key=np.bool_(True))
    seed = secrets.randbits(32) if s.seed is None else as_integer(s.seed)
    if seed is None or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {s.seed!r}.")
    return dict(seed=np.uint32(seed), keys=np.zeros(_KEY_SHAPE, np.uint32), use_key=np.bool_(False))
