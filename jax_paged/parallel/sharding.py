"""Tensor parallelism over a `jax.sharding.Mesh`, Megatron-style, with JAX's own SPMD.

The mesh has one axis, ``tp`` (`TP_AXIS`), of ``tensor_parallel_size`` devices::

    weights     q/k/v_proj, gate/up_proj   [L, E, out]  columns split  P(None, None, "tp")
                o_proj, down_proj          [L, in, E]   rows split     P(None, "tp", None)
                biases of split columns                                P(None, "tp")
                embeddings, LM head, norms                             replicated
    KV pages    [L, KVH, N, bs, D]         KV heads split              P(None, "tp")
    block manager, sampling state, batch inputs                        replicated

So each device holds its heads' share of the attention weights, its share of the MLP's width
and the pages of its KV heads. XLA's partitioner inserts the two all-reduces per layer (after
o_proj and after down_proj); the paged attention (K/V write and kernel) runs per shard under
`jax.shard_map`, each device on its own heads and pages with the replicated block tables.
Embeddings and the LM head are replicated: sampling needs every device to see the whole
vocabulary's logits (a vocabulary split would all-gather them every step), and at the sizes
this serves they are a small share of the weights.

KV heads fewer than devices (GQA): each KV head is replicated ``tp / KVH`` times, as vLLM
does (the k/v projections repeat their heads, so query head h still reads a copy of its own
KV head). Head counts the mesh cannot serve are refused with both numbers named.

Nothing here assumes one host: `make_mesh` takes global devices (``jax.devices()``), and every
array is placed with a `NamedSharding` over the mesh (README, "Several devices and hosts").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_paged.memory import kv_cache as kvc

TP_AXIS = "tp"

_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
_ROWS = ("o_proj", "down_proj")  # input features split


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh over the first ``tensor_parallel_size`` of ``devices`` (default: all of
    ``jax.devices()``, every host's)."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be in [1, {len(devices)}] "
            f"(the devices there are: {len(devices)})"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,), axis_types=(AxisType.Auto,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def kv_replication(config, tp: int) -> int:
    """How many times each KV head is stored so that ``tp`` devices split them evenly (1, or
    ``tp / num_kv_heads``). ValueError naming the numbers when the mesh cannot serve the
    model."""
    h, kvh = config.num_heads, config.num_kv_heads
    if h % tp:
        raise ValueError(
            f"num_heads={h} is not divisible by tensor_parallel_size={tp}: pick a "
            "tensor_parallel_size that divides the attention heads"
        )
    if config.intermediate_size % tp:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} is not divisible by "
            f"tensor_parallel_size={tp}"
        )
    if kvh % tp == 0:
        return 1
    if tp % kvh == 0:
        return tp // kvh
    raise ValueError(
        f"num_kv_heads={kvh} and tensor_parallel_size={tp}: one must divide the other (KV "
        "heads are split over the devices, or replicated when fewer than them)"
    )


def replicate_kv_heads(model: nnx.Module, r: int) -> nnx.Module:
    """The same model with every KV head stored ``r`` times (k/v projections repeat their
    heads; ``config.num_kv_heads`` becomes ``r`` times larger). Outputs are unchanged: query
    head h reads KV head h // (H / KVH), which is now any of its r copies."""
    if r == 1:
        return model
    c = model.config
    new_config = dataclasses.replace(c, num_kv_heads=c.num_kv_heads * r)
    graphdef, state = nnx.split(model)
    d = c.head_dim

    def expand(path, x):
        names = [str(p) for p in path]
        if len(names) >= 2 and names[-2] in ("k_proj", "v_proj"):
            lead = x.shape[:-1]
            heads = x.reshape(*lead, c.num_kv_heads, d)
            return jnp.repeat(heads, r, axis=-2).reshape(*lead, c.num_kv_heads * r * d)
        return x

    flat = [(path, var.replace(expand(path, var[...]))) for path, var in nnx.to_flat_state(state)]
    cls = type(model)
    abstract = nnx.eval_shape(lambda: cls(new_config, dtype=model.dtype, rngs=nnx.Rngs(0)))
    new_def, new_state = nnx.split(abstract)
    shapes = {tuple(path): var.shape for path, var in nnx.to_flat_state(new_state)}
    for path, var in flat:
        if shapes.get(tuple(path)) != var.shape:
            raise ValueError(f"replicating KV heads: parameter {path} does not fit {cls.__name__}")
    del graphdef
    return nnx.merge(new_def, nnx.from_flat_state(flat))


def param_spec(path, ndim: int) -> P:
    """The partition spec of a parameter from its path (see the module docstring); anything
    else (norms, embeddings, LM head, a user model's own names) is replicated."""
    names = [str(p) for p in path]
    if len(names) < 2:
        return P()
    module, leaf = names[-2], names[-1]
    if module in _COLUMNS and leaf in ("kernel", "bias"):
        return P(*([None] * (ndim - 1)), TP_AXIS)
    if module in _ROWS and leaf == "kernel":
        return P(*([None] * (ndim - 2)), TP_AXIS, None)
    return P()


def shard_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """``params`` placed on ``mesh`` by `param_spec`."""
    flat = []
    for path, var in nnx.to_flat_state(params):
        x = var[...]
        sharding = NamedSharding(mesh, param_spec(path, x.ndim))
        flat.append((path, var.replace(jax.device_put(x, sharding))))
    return nnx.from_flat_state(flat)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [L, KVH, N, bs, D]: split over the KV heads."""
    return NamedSharding(mesh, P(None, TP_AXIS))


def create_kv_cache(mesh: Mesh | None, *args, **kwargs):
    """`kv_cache.KVCache.create(*args, **kwargs)`; with a mesh made in place on its devices,
    each holding its KV heads' pages (never whole on one device first)."""
    make = functools.partial(kvc.KVCache.create, *args, **kwargs)
    if mesh is None:
        return make()
    pages = kv_sharding(mesh)
    return jax.jit(make, out_shardings=kvc.KVCache(k=pages, v=pages))()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_map_attention(fn, mesh: Mesh, num_args: int):
    """``fn(layer, q, k, v, kv_k, kv_v, *rest) -> (out, kv_k, kv_v)`` run per shard: q [T, H, D]
    and k/v [T, KVH, D] split over heads, the stacked pages over KV heads, ``layer`` and the
    ``num_args`` other arguments (slots, tables, lengths) replicated."""
    heads, pages = P(None, TP_AXIS, None), P(None, TP_AXIS)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(P(), heads, heads, heads, pages, pages) + (P(),) * num_args,
        out_specs=(heads, pages, pages),
        check_vma=False,
    )


def put_replicated(tree, mesh: Mesh):
    """Every numpy leaf of ``tree`` as a jax.Array replicated on ``mesh``; other leaves as
    they are. Built shard by shard from the host copy (`jax.make_array_from_callback`), which
    holds on several hosts too, where every host passes the same values."""
    rep = replicated(mesh)

    def put(x):
        if isinstance(x, np.ndarray | np.generic):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, rep, lambda index: x[index])
        return x

    return jax.tree.map(put, tree)


def per_device_bytes(x: jax.Array) -> int:
    """Bytes of ``x`` held by one device (its first addressable shard)."""
    shard = x.addressable_shards[0].data
    return int(shard.size * shard.dtype.itemsize)
