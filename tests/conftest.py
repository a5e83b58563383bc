"""Shared fixtures: tiny random HF models per family, and SmolLM2 loaded by us and by HF.

The HF transformers oracle is imported lazily through `oracle()`, which FAILS the test (never
skips) when torch or transformers is missing: CI must not pass without the oracle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import platform
from pathlib import Path

import numpy as np
import pytest


def _xla_cache_dir() -> str:
    """A compilation cache that persists across test runs on this machine: one folder per jax /
    jaxlib version and CPU model (an entry compiled for another CPU's instruction set must not
    be loaded), so a rerun loads the engine's programs instead of compiling them again."""
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    tag = hashlib.sha1(cpu.encode()).hexdigest()[:8]
    name = f"jax-{version('jax')}-jaxlib-{version('jaxlib')}-cpu-{tag}"
    return str(Path(os.path.expanduser("~/.cache/jax_paged/test_xla")) / name)


def _prune_xla_cache(folder: Path, keep: int = 1 << 30, limit: int = 2 << 30) -> None:
    """Deletes the oldest entries once the folder holds more than ``limit`` bytes, down to
    ``keep``. A full run writes about 100 MB, and every change to the code adds new entries.
    (jax's own bound, ``jax_compilation_cache_max_size``, rescans the whole folder on every
    write, which costs more than it saves here.)"""
    try:
        files = [(f.stat().st_mtime, f.stat().st_size, f) for f in folder.iterdir() if f.is_file()]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    if total <= limit:
        return
    for _, size, f in sorted(files, key=lambda x: x[0]):
        if total <= keep:
            break
        try:
            f.unlink()
            total -= size
        except OSError:
            pass


# `LLM` turns on jax's persistent compilation cache at $JAX_PAGED_CACHE_DIR; the tests use their
# own folder ($JAX_PAGED_TEST_CACHE_DIR, or the per-version one above; "" turns it off) and cache
# every program, not only those that take a second to compile as `LLM` does: most of the tiny
# models' programs compile in 0.1-1 s, and hundreds of them add up.
os.environ.setdefault(
    "JAX_PAGED_CACHE_DIR", os.environ.get("JAX_PAGED_TEST_CACHE_DIR", _xla_cache_dir())
)
if os.environ["JAX_PAGED_CACHE_DIR"]:
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_PAGED_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _prune_xla_cache(Path(os.environ["JAX_PAGED_CACHE_DIR"]))

# Loaded XLA CPU executables hold memory mappings (about 400 for an engine step of a tiny
# model) and jax's caches keep them alive for the whole process: a suite that compiles a few
# hundred distinct programs in one process would reach the kernel's `vm.max_map_count` (65530
# by default) and XLA would abort inside a compile. After each module the caches are cleared
# once the process holds more than this share of the limit, which leaves the next module
# more room than any module needs while sparing the recompiles (from the on-disk cache) that
# clearing after every module costs.
MAP_SHARE_BEFORE_CLEARING = 0.4


def _map_count() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Frees the compiled programs held by jax's caches when a module ends, if the process
    holds more memory mappings than `MAP_SHARE_BEFORE_CLEARING` of ``vm.max_map_count`` (or
    the count cannot be read), and another module is still to run."""
    yield
    items = request.session.items
    if items and items[-1].getparent(pytest.Module) is request.node:
        return  # the last module: the process ends next
    count = _map_count()
    if count is not None and count < MAP_SHARE_BEFORE_CLEARING * _max_map_count():
        return
    import gc

    import jax

    gc.collect()
    jax.clear_caches()


_FULL_SUITE = True


def pytest_configure(config):
    global _FULL_SUITE
    expr = config.getoption("markexpr", "")
    if expr:
        from _pytest.mark.expression import Expression

        _FULL_SUITE = bool(Expression.compile(expr).evaluate(lambda name, **kw: name == "slow"))


# Time spent compiling (or loading from the cache above) per jitted function, printed at the
# end of every run beside `--durations`: on an empty cache compiles are most of the suite's
# time (a tiny model's engine step is a few hundred XLA fusions, about 4 s to compile), so the
# programs a change adds show up here first.
_COMPILE_SECONDS: dict[str, float] = {}
_COMPILE_COUNTS: dict[str, int] = {}


def _record_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        name = str(kwargs.get("fun_name", "?"))
        _COMPILE_SECONDS[name] = _COMPILE_SECONDS.get(name, 0.0) + duration
        _COMPILE_COUNTS[name] = _COMPILE_COUNTS.get(name, 0) + 1


def pytest_sessionstart(session):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_record_compile)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the figures to the controller
        workeroutput["compile_seconds"] = dict(_COMPILE_SECONDS)
        workeroutput["compile_counts"] = dict(_COMPILE_COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist (controller side): adds a finished worker's compile figures to this
    process's, so that the summary below covers every worker."""
    out = getattr(node, "workeroutput", {})
    for name, seconds in out.get("compile_seconds", {}).items():
        _COMPILE_SECONDS[name] = _COMPILE_SECONDS.get(name, 0.0) + seconds
    for name, count in out.get("compile_counts", {}).items():
        _COMPILE_COUNTS[name] = _COMPILE_COUNTS.get(name, 0) + count


def pytest_terminal_summary(terminalreporter):
    if not _COMPILE_SECONDS:
        return
    total = sum(_COMPILE_SECONDS.values())
    count = sum(_COMPILE_COUNTS.values())
    terminalreporter.section("XLA compiles and cache loads, by function")
    top = sorted(_COMPILE_SECONDS, key=_COMPILE_SECONDS.get, reverse=True)[:8]
    for name in top:
        terminalreporter.write_line(
            f"{_COMPILE_SECONDS[name]:8.1f} s {_COMPILE_COUNTS[name]:5d}  {name}"
        )
    terminalreporter.write_line(f"{total:8.1f} s {count:5d}  all")


def full_suite_run() -> bool:
    """False when this run deselects the slow tests (``-m "not slow"``, the fast tier):
    randomised tests then run at a reduced size (fewer operations or examples, the same
    checks). For module-level settings such as hypothesis's ``max_examples``."""
    return _FULL_SUITE


@pytest.fixture(scope="session")
def full_suite() -> bool:
    """`full_suite_run()` as a fixture."""
    return _FULL_SUITE


def oracle():
    """(torch, transformers), or a test failure naming what to install."""
    try:
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
    except ImportError as e:
        pytest.fail(
            f"HF transformers oracle missing ({e}); install the test extra: pip install '.[test]'"
        )
    # One thread: the tiny models gain nothing from two, and on a machine whose cores other
    # jobs share, torch's OpenMP threads spin against them (one HF greedy run of a tiny Gemma
    # measured 1.1 s alone and 34 s beside another test process).
    torch.set_num_threads(1)
    return torch, transformers


# ----------------------------------------------------------------------------------------------
# Tiny random HF models


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """One tiny HF model. `kwargs` go to the HF config class; `shards` saves sharded files."""

    name: str
    config_class: str
    kwargs: tuple
    shards: bool = False


TINY_SPECS = {
    s.name: s
    for s in [
        # GQA 4, head_dim 32, untied, llama3 RoPE scaling with a short original context so
        # the scaling changes frequencies that short prompts use.
        TinySpec(
            "llama3_gqa4",
            "LlamaConfig",
            (
                ("hidden_size", 128),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 1),
                ("intermediate_size", 256),
                ("tie_word_embeddings", False),
                (
                    "rope_parameters",
                    (
                        ("rope_type", "llama3"),
                        ("rope_theta", 500000.0),
                        ("factor", 8.0),
                        ("low_freq_factor", 1.0),
                        ("high_freq_factor", 4.0),
                        ("original_max_position_embeddings", 32),
                    ),
                ),
            ),
        ),
        # MHA (GQA 1), head_dim 64, tied embeddings, attention and MLP biases.
        TinySpec(
            "llama_mha_tied_bias",
            "LlamaConfig",
            (
                ("hidden_size", 128),
                ("num_attention_heads", 2),
                ("num_key_value_heads", 2),
                ("intermediate_size", 192),
                ("tie_word_embeddings", True),
                ("attention_bias", True),
                ("mlp_bias", True),
            ),
        ),
        # GQA 3, head_dim 32, sliding window 8 (prompts run past it).
        TinySpec(
            "mistral_window",
            "MistralConfig",
            (
                ("hidden_size", 192),
                ("num_attention_heads", 6),
                ("num_key_value_heads", 2),
                ("intermediate_size", 256),
                ("sliding_window", 8),
                ("tie_word_embeddings", False),
            ),
        ),
        # q/k/v bias, tied embeddings, GQA 4, head_dim 32, saved in several shards.
        TinySpec(
            "qwen2_tied",
            "Qwen2Config",
            (
                ("hidden_size", 128),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 1),
                ("intermediate_size", 256),
                ("tie_word_embeddings", True),
            ),
            shards=True,
        ),
        # q/k RMSNorm per head, head_dim 64 set explicitly (not hidden / heads), GQA 3.
        TinySpec(
            "qwen3_qknorm",
            "Qwen3Config",
            (
                ("hidden_size", 96),
                ("num_attention_heads", 3),
                ("num_key_value_heads", 1),
                ("head_dim", 64),
                ("intermediate_size", 192),
                ("tie_word_embeddings", False),
            ),
        ),
    ]
}


def _to_kwargs(pairs):
    return {k: _to_kwargs(v) if isinstance(v, tuple) else v for k, v in pairs}


def build_tiny_hf_model(spec: TinySpec, seed: int = 0):
    """A tiny random HF model (eval mode, f32) with noise on every 1-D parameter.

    Default init sets norms to 1 and biases to 0, which would hide a model that forgets them.
    """
    torch, transformers = oracle()
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=256,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(_to_kwargs(spec.kwargs))
    config = getattr(transformers, spec.config_class)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.5 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # greedy runs the full length
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """name -> (HF model, folder it was saved to). Built once per test run, on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            spec = TINY_SPECS[name]
            model = build_tiny_hf_model(spec)
            folder = tmp_path_factory.mktemp(name)
            shard = {"max_shard_size": "100KB"} if spec.shards else {}
            model.save_pretrained(folder, **shard)
            cache[name] = (model, folder)
        return cache[name]

    return get


# HF oracle outputs, computed once per test run: (id(model), call arguments) -> (model, result).
# The model is kept with its result so that its id cannot be reused by another model.
_HF_MEMO: dict = {}


def _memo(model, key, compute):
    full = (id(model), *key)
    if full not in _HF_MEMO:
        _HF_MEMO[full] = (model, compute())
    return _HF_MEMO[full][1]


def hf_logits(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """HF f32 logits of each prompt on its own: list of [len, V] (read-only arrays, shared by
    every test that asks for the same prompt of the same model)."""
    torch, _ = oracle()

    def one(p):
        with torch.no_grad():
            out = model(torch.tensor([p])).logits[0].numpy()
        out.setflags(write=False)
        return out

    return [_memo(model, ("logits", tuple(p)), lambda p=p: one(p)) for p in prompts]


def hf_greedy(model, prompt: list[int], max_tokens: int, eos: bool = True) -> list[int]:
    """HF transformers' greedy continuation of one prompt (the oracle for engine outputs);
    ``eos=False`` generates exactly ``max_tokens`` (no EOS stop)."""
    torch, _ = oracle()

    def run():
        ids = torch.tensor([prompt])
        kw = {} if eos else dict(eos_token_id=None, min_new_tokens=max_tokens)
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
                **kw,
            )
        return tuple(out[0, len(prompt) :].tolist())

    return list(_memo(model, ("greedy", tuple(prompt), max_tokens, eos), run))


def right_pad(prompts: list[list[int]], pad: int = 0) -> np.ndarray:
    t = max(len(p) for p in prompts)
    out = np.full((len(prompts), t), pad, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (the embedded GGUF), ours and HF's, one load each per test run


@pytest.fixture(scope="session")
def smollm2():
    """Our `LoadedModel` of the embedded GGUF (float32)."""
    import models

    return models.load()


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """Our tokenizer of the embedded GGUF. The fast tier builds it from the file's metadata the
    way `models.load` builds it, without dequantizing the weights (2 s instead of 5); the full
    suite, whose slow tests load the whole model anyway, takes the loaded model's."""
    if _FULL_SUITE:
        return request.getfixturevalue("smollm2").tokenizer
    import gguf

    import models
    from models.gguf import _gguf_metadata
    from models.tokenizer import Tokenizer

    reader = gguf.GGUFReader(str(models.default_model_path()))
    return Tokenizer.from_gguf_metadata(_gguf_metadata(reader))


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    _, transformers = oracle()
    import models

    path = models.default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_hf_model():
    torch, transformers = oracle()
    import models

    path = models.default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Tiny GGUF files, written the way llama.cpp's converter writes a Llama


def permute_qk_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF row order -> llama.cpp's (the inverse of what the loader undoes)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_gguf(path, hf_model=None, *, arch: str = "llama", extra_tensor=None) -> None:
    """Writes a GGUF with a byte-level vocabulary; weights from `hf_model` (a tiny HF Llama).

    Without a model, writes a 1-layer Llama of zeros (enough for the error tests).
    `extra_tensor=(name, array)` adds one more tensor (e.g. an unsupported type).
    """
    import gguf

    if hf_model is not None:
        c = hf_model.config
        dims = dict(
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            ffn=c.intermediate_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            vocab=c.vocab_size,
        )
        sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    else:
        dims = dict(layers=1, hidden=16, ffn=32, heads=2, kv_heads=1, vocab=256)
        sd = None
    head_dim = dims["hidden"] // dims["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(dims["layers"])
    w.add_context_length(256)
    w.add_embedding_length(dims["hidden"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(dims["heads"])
    w.add_head_count_kv(dims["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(dims["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    from models.tokenizer import byte_level_alphabet

    tokens = byte_level_alphabet()[: dims["vocab"]]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def get(hf_name, shape):
        return np.zeros(shape, np.float32) if sd is None else sd[hf_name]

    h, f, v = dims["hidden"], dims["ffn"], dims["vocab"]
    q_rows, kv_rows = dims["heads"] * head_dim, dims["kv_heads"] * head_dim
    w.add_tensor("token_embd.weight", get("model.embed_tokens.weight", (v, h)))
    for i in range(dims["layers"]):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight", (q_rows, h))
        k = get(p + "self_attn.k_proj.weight", (kv_rows, h))
        w.add_tensor(f"blk.{i}.attn_q.weight", permute_qk_like_llama_cpp(q, dims["heads"]))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute_qk_like_llama_cpp(k, dims["kv_heads"]))
        w.add_tensor(f"blk.{i}.attn_v.weight", get(p + "self_attn.v_proj.weight", (kv_rows, h)))
        w.add_tensor(f"blk.{i}.attn_output.weight", get(p + "self_attn.o_proj.weight", (h, q_rows)))
        w.add_tensor(f"blk.{i}.attn_norm.weight", get(p + "input_layernorm.weight", (h,)))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", get(p + "post_attention_layernorm.weight", (h,)))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", get(p + "mlp.gate_proj.weight", (f, h)))
        w.add_tensor(f"blk.{i}.ffn_up.weight", get(p + "mlp.up_proj.weight", (f, h)))
        w.add_tensor(f"blk.{i}.ffn_down.weight", get(p + "mlp.down_proj.weight", (h, f)))
    w.add_tensor("output_norm.weight", get("model.norm.weight", (h,)))
    if sd is not None and "lm_head.weight" in sd and not hf_model.config.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------------
# The engine's tiny model: an HF Llama folder whose EOS (id 2) really occurs


def make_tiny_llama(**overrides):
    """A random HF Llama: 2 layers, GQA 4/2, head dim 16, vocab 256, unless overridden."""
    torch, transformers = oracle()
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
    )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kwargs, **overrides}))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama (GQA 4/2, head dim 16) with noisy norms, saved as an HF folder."""
    torch, _ = oracle()
    model = make_tiny_llama().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path, model


def research_greedy(dec, params, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt's first ``num_tokens`` tokens through a `PagedDecoder` under one jit: its
    ``prefill``, then ``decode_step`` in a ``lax.scan`` (the research API as a user calls it).
    ``params``: the `SamplingParams` for ``dec.init``."""
    import functools

    import jax
    import jax.numpy as jnp

    padded = np.zeros((len(prompts), dec.max_len), np.int32)
    for r, p in enumerate(prompts):
        padded[r, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(dec, weights, state, tokens, lens):
        state, first = dec.prefill(weights, state, tokens, lens)
        step = lambda s, _: dec.decode_step(weights, s)  # noqa: E731
        state, toks = jax.lax.scan(step, state, None, length=num_tokens - 1)
        return first, toks

    first, toks = run(dec, dec.params, dec.init(params), jnp.asarray(padded), lens)
    return np.concatenate([np.asarray(first)[None], np.asarray(toks)]).T.tolist()
