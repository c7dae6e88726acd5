"""Sharded decoding over a ``jax.sharding.Mesh`` with axes ``('data', 'model')``.

::

    import specjax
    from specjax import sharding

    mesh = sharding.make_mesh(data=2, model=4)               # 8 devices
    target = specjax.load("ckpt/target", mesh=mesh)          # read straight into its shards
    draft = sharding.replicate(specjax.load("ckpt/draft"), mesh)  # or shard_params(draft, mesh)
    out = specjax.decode(specjax.pair(target, draft), prompts, mesh=mesh, key=jax.random.key(0))

Tensor parallel over heads, MLP width and vocabulary on ``'model'``; data
parallel over sequences on ``'data'``; XLA's SPMD partitioner inserts the
collectives. A mixture of experts whose experts the ``'model'`` axis splits
computes, on each device, the routed tokens of the experts it holds
(:class:`ExpertMesh`, which ``decode`` sets). See ``docs/sharding.md``.
"""

from specjax._src.models.sharding import (
    DATA,
    MODEL,
    DecodeLayout,
    ExpertMesh,
    cache_spec,
    check_batch,
    check_divisible,
    make_mesh,
    param_shardings,
    param_specs,
    replicate,
    shard_params,
)

__all__ = (
    "DATA",
    "MODEL",
    "DecodeLayout",
    "ExpertMesh",
    "cache_spec",
    "check_batch",
    "check_divisible",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "replicate",
    "shard_params",
)
