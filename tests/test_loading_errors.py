"""Bad input to `models.load` gets a clear error that names the problem."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import write_tiny_gguf

import models
from models.config import ModelConfig


@pytest.fixture
def folder(tiny_hf, tmp_path):
    """A writable copy of a good tiny HF folder."""
    _, src = tiny_hf("llama_mha_tied_bias")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_good_folder_loads(folder):
    assert models.load(folder).config.num_layers == 2


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load(tmp_path / "nope.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load(tmp_path)


def test_folder_without_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        models.load(folder)


def test_pickled_weights_are_refused(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="unpickling"):
        models.load(folder)


def test_missing_shard(tiny_hf, tmp_path):
    _, src = tiny_hf("qwen2_tied")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        models.load(dst)


@pytest.mark.parametrize("model_type", ["gpt2", "phi3"])
def test_unsupported_architecture(folder, model_type):
    _edit_config(folder, model_type=model_type, architectures=None)
    with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'") as e:
        models.load(folder)
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in str(e.value)


def test_unsupported_architecture_class(folder):
    _edit_config(folder, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*LlamaForCausalLM"):
        models.load(folder)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "model_type"])
def test_config_missing_field(folder, field):
    _edit_config(folder, **{field: None})
    with pytest.raises(ValueError, match=f"missing required field '{field}'"):
        models.load(folder)


def test_config_missing_llama3_rope_field():
    cfg = dict(
        model_type="llama",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
    )
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_hf_dict(cfg)
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict(cfg)


def test_config_not_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        models.load(folder)


def test_missing_tensor(folder):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        models.load(folder)


def test_wrong_tensor_shape(folder):
    _edit_config(folder, intermediate_size=100)
    with pytest.raises(ValueError, match=r"mlp.*has shape .* expected"):
        models.load(folder)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_safetensors(folder, keep):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
        models.load(folder)


def test_corrupt_safetensors(folder):
    path = folder / "model.safetensors"
    path.write_bytes(b"\xff" * 64 + path.read_bytes()[64:])
    with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
        models.load(folder)


@pytest.mark.parametrize("dtype", [jnp.float16, "int8", np.float64, "fp8"])
def test_unsupported_dtype(folder, dtype):
    with pytest.raises(ValueError, match="unsupported dtype.*float32, bfloat16"):
        models.load(folder, dtype=dtype)


def test_supported_dtype_spellings(folder):
    for dtype in (jnp.bfloat16, "bfloat16", "bf16", np.float32, "float32"):
        models.load(folder, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# GGUF


def test_good_gguf_loads(tmp_path):
    write_tiny_gguf(tmp_path / "ok.gguf")
    lm = models.load(tmp_path / "ok.gguf")
    assert lm.config.num_layers == 1 and lm.tokenizer.vocab_size == 256


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_gguf(tmp_path, keep):
    write_tiny_gguf(tmp_path / "ok.gguf")
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        models.load(tmp_path / "cut.gguf")


def test_corrupt_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(1000))
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        models.load(tmp_path / "bad.gguf")


def test_unsupported_gguf_quant_type(tmp_path):
    extra = ("extra.weight", np.zeros((4, 8), np.int32))
    write_tiny_gguf(tmp_path / "i32.gguf", extra_tensor=extra)
    with pytest.raises(ValueError, match="unsupported GGUF quantisation type I32.*Q4_1"):
        models.load(tmp_path / "i32.gguf")


def test_unsupported_gguf_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*llama"):
        models.load(tmp_path / "gpt2.gguf")


def test_not_a_model_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        models.load(tmp_path / "weights.bin")


def test_default_model_is_the_embedded_gguf():
    path = models.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
