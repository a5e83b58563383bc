"""Stacked layer kernels held as one array per layer, for any model whose layers run under a scan.

A model that stacks its layers (every parameter of ``model.layers`` has a leading ``[L]`` axis)
and scans over them reads layer ``i``'s parameters with `layer_at(layer_params, i)` and
multiplies by its kernels through `Linear`. Such a model runs unchanged on either form of its
parameters: the stacked one, or the one `split_layer_weights` makes, where each
``layers.*.kernel`` ``[L, in, out]`` is a `PerLayer` of ``L`` separate arrays and `layer_at`
hands `Linear` a `LayerSwitch` (a ``lax.switch`` over the layers, each branch's dot reading
its own layer's array in place).

A model declares that it reads the split form by the class attribute
``per_layer_weights = True`` (see `models.protocol`); `jax_paged.backend.prepare_params`
decides when to hand it that form (on one CPU device, where it avoids a copy of every kernel
per layer per step). Nothing here knows a model family.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# The attribute of the model (and the top key of its state) that holds the stacked layers.
LAYERS = "layers"


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """A stacked ``[L, ...]`` parameter held as ``L`` separate arrays (`split_layer_weights`)."""

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


class LayerSwitch:
    """Layer ``index``'s kernel of a `PerLayer` parameter inside the layer scan. `Linear`
    multiplies by it through a ``lax.switch`` over the layers, each branch's dot reading its
    own layer's array in place."""

    def __init__(self, arrays: tuple[jax.Array, ...], index: jax.Array | int):
        self.arrays, self.index = arrays, index

    def matmul(self, x: jax.Array, dtype) -> jax.Array:
        """x[..., K] @ kernel[K, N] -> [..., N] in ``dtype``, accumulated in f32 (`dot_f32`)."""

        def branch(w):
            return lambda x: dot_f32(x, w, dtype)

        if not isinstance(self.index, jax.core.Tracer):  # a known layer: no switch
            return branch(self.arrays[int(self.index)])(x)
        return jax.lax.switch(self.index, [branch(w) for w in self.arrays], x)


def dot_f32(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """x[..., K] @ w[K, N] -> [..., N] in ``dtype``: both operands in ``dtype``, the products
    summed in f32, the result rounded once (what torch does for bf16 matmuls).

    Asking for the f32 result is also what makes a bf16 dot fast on the CPU: XLA:CPU runs a
    bf16 x bf16 -> f32 dot through its bf16 kernels (AMX / avx512_bf16 where present) and a
    bf16 -> bf16 dot through a slow generic loop, 4-6x apart at SmolLM2's shapes on 2 cores
    (440-1130 against 90-235 GFLOP/s at 64-512 rows). For f32 operands nothing changes.
    """
    y = jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
    return y.astype(dtype)


def layer_at(layer_params: Any, i: jax.Array | int) -> Any:
    """Layer ``i``'s parameters (``i``: i32[] or int) out of the stacked ones: a dynamic index
    into each ``[L, ...]`` array, a `LayerSwitch` for each `PerLayer` kernel."""

    def pick(a):
        if isinstance(a, PerLayer):
            return LayerSwitch(a.arrays, i)
        return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)

    return jax.tree.map(pick, layer_params, is_leaf=lambda a: isinstance(a, PerLayer))


def split_layer_weights(state: Any) -> Any:
    """``state`` (a model's, from `nnx.split`) with every stacked layer kernel
    (``layers.*.kernel``, ``[L, in, out]``) held as ``L`` separate arrays (`PerLayer`); the
    small stacked parameters (norms, biases) stay as they are. Costs a second copy of those
    kernels while the stacked ones are still referenced.

    Why: inside the layer scan a stacked kernel is a dynamic slice, and XLA's CPU backend
    copies it into a fresh buffer before every dot (its dots read whole buffers): 424 MB per
    forward for SmolLM2-135M, about 60 ms on 2 cores whatever the batch, more than the whole
    decode attention at batch 8. A `LayerSwitch` dot reads its layer's own buffer instead,
    while the layer body stays one scanned copy (compile time still flat in depth).
    """

    def split(path, a):
        top = getattr(path[0], "key", None) if path else None
        last = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if top == LAYERS and "kernel" in last and getattr(a, "ndim", 0) == 3:
            return PerLayer(a[i] for i in range(a.shape[0]))
        return a

    return jax.tree_util.tree_map_with_path(split, state)


class Linear(nnx.Linear):
    """`nnx.Linear` that accumulates in f32 (`dot_f32`) and whose kernel may also be a
    `LayerSwitch` (see `split_layer_weights`)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        if isinstance(kernel, LayerSwitch):
            y = kernel.matmul(inputs, self.dtype or jnp.result_type(inputs, kernel.arrays[0]))
        else:
            y = dot_f32(inputs, kernel, self.dtype or jnp.result_type(inputs, kernel))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Embed):
    """`nnx.Embed` that looks a 16-bit float table (bf16, f16) up as raw bits.

    XLA:CPU has no bf16 gather: it widens the whole table to f32 and gathers from that, and in
    a decode loop it hoists the widening out of the loop, so every call converted the SmolLM2
    table (49152 x 576) anew, 43 ms. Gathering the table's bits as uint16 reads only the rows
    asked for, on every backend, with the same result.
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if not (jnp.issubdtype(table.dtype, jnp.floating) and table.dtype.itemsize == 2):
            return super().__call__(inputs)
        bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), inputs, axis=0)
        x = jax.lax.bitcast_convert_type(bits, table.dtype)
        return x.astype(self.dtype or table.dtype)
