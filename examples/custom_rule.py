"""A user-defined acceptance rule in a few lines, composed with ``any_of``.

The rule: accept a draft token if it is in the target's top-3 and the target
gives it more than 5%. ``rules.criterion`` turns that accepted-set function into
a full AcceptanceRule (correction: argmax p when greedy, p restricted to the set
when sampling). ``any_of`` then keeps every token lossless speculative sampling
accepts and adds the ones our rule accepts.

    python examples/custom_rule.py           # after `pip install -e .` (or with PYTHONPATH=.)
    python examples/custom_rule.py --small   # 200 random blocks instead of 2000 (what the tests run)

Random logits stand in for the models; ``specjax.decode(..., rule=rule)`` takes
the same object.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax import rules


def confident_top3(logits, probs):
    """``[K, V]`` -> ``[K, V]`` bool: in the target's top-3 and ``p > 0.05``."""
    third = jax.lax.top_k(logits, 3)[0][..., -1:]
    return (logits >= third) & (probs > 0.05)


my_rule = rules.criterion(confident_top3, name="confident_top3")
rule = rules.any_of(rules.speculative_sampling(), my_rule)


def random_block(key, k=5, v=50):
    """One sequence's draft block: a draft that is a noisy copy of the target."""
    kt, kd, kx, ku = jax.random.split(key, 4)
    target = 2.0 * jax.random.normal(kt, (k + 1, v))
    draft = target[:k] + 1.5 * jax.random.normal(kd, (k, v))
    tokens = jax.random.categorical(kx, draft)
    return rules.VerifyInputs(tokens, draft, jax.nn.softmax(draft), target,
                              jax.nn.softmax(target), jax.random.uniform(ku, (k,)),
                              jnp.ones((k,), bool), {})


def main(num_blocks=2000):
    inputs = jax.vmap(random_block)(jax.random.split(jax.random.key(0), num_blocks))
    print(f"{'rule':58s} accept  tau   paths (exact/relaxed/pardon)")
    for r in (rules.speculative_sampling(), my_rule, rule, rules.parse_rule("mars:theta=0.9")):
        verify = jax.jit(jax.vmap(lambda x, s: r.verify(x, s, greedy=False)))
        v = verify(inputs, jax.vmap(lambda _: r.init())(jnp.arange(num_blocks)))
        # tokens per cycle = accepted prefix + one correction/bonus token
        tau = np.mean(np.cumprod(np.asarray(v.accept), axis=1).sum(1) + 1)
        paths = np.bincount(np.asarray(v.path).ravel(), minlength=rules.NUM_PATHS)
        print(f"{str(r.spec):58s} {np.mean(v.accept):.3f}  {tau:.2f}  {paths[1:]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="200 random blocks instead of 2000")
    main(num_blocks=200 if parser.parse_args().small else 2000)
