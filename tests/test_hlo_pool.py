"""The compiled engine programs never copy the KV pool: cost follows the live tokens.

Compiles `decode_loop` and `mixed_step` (and the other engine programs) for a tiny model whose
pool has an odd size, then reads the optimised HLO: no instruction may produce a buffer as large
as one layer's pages, except the in-place updates of the donated state (scatters, dynamic
update slices, fusions rooted at one, custom calls whose result aliases their first operand)
and the values that merely name the state (parameters, tuple elements, loops and conditionals
that carry it). A `kv.k[layer]` slice handed to a kernel, a copy inserted around a loop or a
conditional, or a gather of whole layers would all show up.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flax import nnx

import models
from jax_paged import LLM, SamplingParams
from models.config import ModelConfig
from models.loading import GenerationConfig, LoadedModel

N, BS, KVH, D = 301, 4, 2, 16
LAYER_ELEMS = KVH * N * BS * D  # one layer's pages; the pool is L times that
# Instructions that name a buffer without producing a new one, or update it in place.
PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "while", "conditional", "bitcast"}
IN_PLACE = {"scatter", "dynamic-update-slice"}

_INSTR = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) ")


def _large_buffers(hlo: str) -> list[str]:
    """Instructions of `hlo` whose array result has >= LAYER_ELEMS elements and that neither
    pass a buffer through nor update one in place."""
    roots, comp = {}, None
    instrs = []
    for line in hlo.splitlines():
        if not line.startswith(" ") and (c := _COMP.match(line)):
            comp = c.group(1)
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        name, _, dims, op, rest = m.groups()
        if line.lstrip().startswith("ROOT"):
            roots[comp] = op
        size = int(np.prod([int(d) for d in dims.split(",") if d]))
        if size >= LAYER_ELEMS:
            instrs.append((op, rest, line.strip()))
    bad = []
    for op, rest, line in instrs:
        if op in PASS_THROUGH or op in IN_PLACE:
            continue
        if op == "custom-call" and "output_to_operand_aliasing={{}: (0, {})}" in rest:
            continue  # the native bfloat16 writes: the result is operand 0's buffer
        if op == "fusion":
            called = re.search(r"calls=(%[\w.\-]+)", rest)
            if called and roots.get(called.group(1)) in IN_PLACE:
                continue
        bad.append(line[:200])
    return bad


def test_large_buffers_detects_a_copy_and_a_layer_slice():
    """The checker itself: a copy of the pool, a layer slice and a custom call's new buffer are
    caught; a scatter and a custom call whose result aliases its operand are not."""
    hlo = "\n".join(
        [
            "ENTRY %main () -> f32[] {",
            f"  %p = f32[3,{KVH},{N},{BS},{D}]{{4,3,2,1,0}} parameter(0)",
            f"  %c = f32[3,{KVH},{N},{BS},{D}]{{4,3,2,1,0}} copy(%p)",
            f"  %s = f32[{KVH},{N},{BS},{D}]{{3,2,1,0}} dynamic-slice(%p, %i)",
            f"  %w = f32[3,{KVH},{N},{BS},{D}]{{4,3,2,1,0}} custom-call(%p, %x), "
            'custom_call_target="w", output_to_operand_aliasing={{}: (0, {})}',
            f"  %f = f32[3,{KVH},{N},{BS},{D}]{{4,3,2,1,0}} custom-call(%p, %x), "
            'custom_call_target="f"',
            f"  ROOT %u = f32[3,{KVH},{N},{BS},{D}]{{4,3,2,1,0}} scatter(%p, %i, %x)",
            "}",
        ]
    )
    bad = _large_buffers(hlo)
    assert len(bad) == 3 and "copy" in bad[0] and "dynamic-slice" in bad[1]
    assert 'custom_call_target="f"' in bad[2]  # a custom call's own (not aliased) result


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float16"])
def test_engine_programs_do_not_copy_the_pool(kv_cache_dtype):
    """Also for a 16-bit cache under a float32 model: XLA's CPU backend would widen a 16-bit
    pool to float32 around every scatter into it (the K/V writes, copy-on-write)."""
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=KVH,
        head_dim=D,
        max_position_embeddings=256,
    )
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    lm = LoadedModel(model, None, cfg, GenerationConfig(eos_token_ids=[1]), "tiny")
    llm = LLM(
        lm,
        num_kv_blocks=N,
        block_size=BS,
        max_num_seqs=4,
        max_model_len=128,
        kv_cache_dtype=kv_cache_dtype,
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 256, size=n).tolist()} for n in (5, 9, 3)]
    # n = 2 forks share the prompt's partial block, so copy-on-write runs inside the programs.
    llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True))
    kinds = {key[0] for key in llm.engine.runner.compiled}
    assert {"decode", "mixed"} <= kinds
    for key, compiled in llm.engine.runner.compiled.items():
        bad = _large_buffers(compiled.as_text())
        assert not bad, f"{key[0]} materialises pool-sized buffers:\n" + "\n".join(bad)
