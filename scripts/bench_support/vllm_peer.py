"""The real vLLM as a peer in the benchmarks: its environment, the model folder both systems
load, and an offline vLLM kept alive in a subprocess of its own venv. (Not named ``vllm.py``:
the worker beside it must import the real vLLM.)

vLLM is never a dependency of jax-paged or of its tests: it lives in a venv of its own
(`scripts/setup_vllm.sh`, as ../shared/notes/peers.md sets it up on these CPUs), found through
``--vllm-python`` / ``VLLM_PYTHON`` (default ``.venv-vllm/bin/python``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_PYTHON = os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
_WORKER = Path(__file__).with_name("vllm_worker.py")
_TAG = "@@"  # protocol lines on the worker's stdout start with this; vLLM's own logs do not


def vllm_env() -> dict:
    """vLLM on the CPU: both cores for its worker, a 2 GiB KV cache, no hub, no usage stats."""
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def export_hf_folder(gguf_path: str | Path, directory: str | Path) -> Path:
    """Writes a GGUF model as an HF folder (float32 safetensors, tokenizer, generation config)
    that jax-paged and vLLM both load, so both run the same dequantised weights. Needs
    transformers with gguf and accelerate (the test extra). An existing folder is reused."""
    import torch
    import transformers

    gguf_path, directory = Path(gguf_path), Path(directory)
    if (directory / "config.json").exists():
        return directory
    kw = dict(gguf_file=gguf_path.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    src = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.float32, **kw
    )
    config = src.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save it as loaded
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


class OfflineVLLM:
    """`vllm.LLM` in a subprocess (``vllm_worker.py`` under vLLM's Python), built once and
    asked for greedy generations on token ids; each answer carries the seconds `generate` took
    inside that process and the tokens. Use as a context manager."""

    def __init__(self, model_dir, *, dtype: str, max_num_seqs: int, max_model_len: int,
                 python: str = DEFAULT_PYTHON, log: Path | None = None):  # fmt: skip
        if not Path(python).exists():
            raise FileNotFoundError(
                f"vLLM's python {python!r} does not exist: run `bash scripts/setup_vllm.sh` "
                "or give --vllm-python / VLLM_PYTHON"
            )
        self._log = open(log or os.devnull, "w")  # noqa: SIM115 - closed in close()
        cmd = [python, str(_WORKER), str(model_dir), dtype, str(max_num_seqs), str(max_model_len)]
        self._proc = subprocess.Popen(
            cmd, env=vllm_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1,
        )  # fmt: skip
        self.info = self._read()  # {"startup_s", "version"} once the engine is built

    def _read(self) -> dict:
        for line in self._proc.stdout:
            if line.startswith(_TAG):
                msg = json.loads(line[len(_TAG) :])
                if "error" in msg:
                    raise RuntimeError(f"vLLM worker: {msg['error']}")
                return msg
            self._log.write(line)  # vLLM's own stdout logs
        raise RuntimeError(f"vLLM worker exited ({self._proc.wait()}); its log: {self._log.name}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy, ``ignore_eos``: {"seconds": wall of `LLM.generate`, "tokens": [[int]]}."""
        self._proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        return self._read()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
