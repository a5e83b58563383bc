"""Tokenizer: the `tokenizers` library for ids, jinja2 for chat templates.

Built from an HF folder (`tokenizer.json` + `tokenizer_config.json`) or from a GGUF file's own
vocabulary, merges and special tokens (`from_gguf_metadata`): byte-level BPE, or Gemma's
SentencePiece-style BPE with byte fallback (rebuilt the way transformers' GGUF converter does).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

# llama.cpp `tokenizer.ggml.pre` -> how text is split before byte-level BPE. These are the split
# rules each vocabulary was trained with (GPT-2's default when no rule is listed).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2's scheme) stands for bytes 0..255, in
    byte order: a byte-level vocabulary's first 256 tokens, as tiny test models build them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _gguf_pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":  # GPT-2's split, digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: gpt2, smollm, llama-bpe, qwen2"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _derived_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies (GGUF files store none): every split
    of a token into two vocabulary tokens, best token first by ``scores``, ties by the longer
    left then right piece, then by the pieces' ids (transformers' ``generate_merges``)."""
    merges = []  # (-score of the merged token, -len left, -len right, left, right)
    for tok, score in scores.items():
        local = [
            (tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(-score, -len(a), -len(b), a, b) for a, b in local]
    merges.sort(key=lambda m: m[:3])  # stable: equal keys keep the order above
    return [(a, b) for *_, a, b in merges]


def _unk(tokens: list[str], unk_id: int | None) -> str:
    return tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else "<unk>"


def _byte_fallback_bpe(
    tokens: list[str], vocab: dict[str, int], rank: dict[str, float], unk_id: int | None
) -> tokenizers.Tokenizer:
    """A SentencePiece-style BPE with byte fallback over ``vocab``, its merges derived from the
    vocabulary (`_derived_merges`) in the order ``rank`` gives (higher first); the callers add
    their normaliser, pre-tokenizer and decoder."""
    return tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=_derived_merges(vocab, rank),
            unk_token=_unk(tokens, unk_id),
            fuse_unk=True,
            byte_fallback=True,
        )
    )


def _gemma_backend(tokens: list[str], unk_id: int | None) -> tuple[tokenizers.Tokenizer, dict]:
    """Gemma's BPE (byte fallback, spaces as "\u2581", no prefix space) from a GGUF vocabulary.

    As transformers' GGUF converter (`gemma_tokenizer`) builds it: tokens of two or more spaces
    are stored as real spaces and renamed to "\u2581" runs; the merges are derived from the
    vocabulary (`_derived_merges`) ranked by the token's position in the file (Gemma's scores do
    not follow its merge order; a repeated token ranks at its last position, as in HF).
    Returns (backend, vocab token -> id).
    """
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _byte_fallback_bpe(tokens, vocab, {t: -i for t, i in vocab.items()}, unk_id)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend, vocab


def _llama_backend(
    tokens: list[str], scores: list[float], unk_id: int | None
) -> tuple[tokenizers.Tokenizer, dict]:
    """Llama 2 / Mistral SentencePiece BPE from a GGUF vocabulary, as transformers' GGUF
    converter builds it (`LlamaTokenizer`): byte fallback, merges derived from the vocabulary
    ranked by the file's scores, spaces as "\u2581" with one prepended to the text, the
    decoder stripping it again. Returns (backend, vocab token -> id)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _byte_fallback_bpe(tokens, vocab, dict(zip(tokens, scores, strict=True)), unk_id)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend, vocab


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # The environment HF renders chat templates in: sandboxed, trim_blocks + lstrip_blocks,
    # loop controls, `raise_exception`, a `tojson` that keeps non-ASCII, `strftime_now`.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Encode/decode text and render chat prompts.

    Attributes:
      backend: the `tokenizers.Tokenizer`.
      chat_template: jinja2 source, or None.
      bos_token, eos_token, pad_token, unk_token: special token strings (or None), with
        `*_token_id` properties.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self._template = _compile_template(chat_template) if chat_template else None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer | None:
        """From `tokenizer.json` and `tokenizer_config.json`; None without tokenizer.json."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot read tokenizer ({e})") from None
        cfg: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        template = cfg.get("chat_template")
        jinja_path = folder / "chat_template.jinja"  # where transformers 5 saves it
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: use the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            unk_token=_token_content(cfg.get("unk_token")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """From a GGUF's `tokenizer.*` metadata: byte-level BPE (`tokenizer.ggml.model` gpt2),
        or a SentencePiece vocabulary (`llama`): Gemma's in a gemma / gemma2 / gemma3 file
        (`_gemma_backend`), Llama 2's / Mistral's otherwise (`_llama_backend`)."""
        kind = meta.get("tokenizer.ggml.model")
        arch = meta.get("general.architecture")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            vocab = {t: i for i, t in enumerate(tokens)}
            backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
            backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama" and arch in ("gemma", "gemma2", "gemma3"):
            backend, vocab = _gemma_backend(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
        elif kind == "llama" and arch != "phi3" and meta.get("tokenizer.ggml.scores"):
            backend, vocab = _llama_backend(
                tokens, meta["tokenizer.ggml.scores"], meta.get("tokenizer.ggml.unknown_token_id")
            )
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (architecture {arch!r}); supported: "
                "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE with scores; Gemma's or "
                "Llama 2's / Mistral's, not Phi-3's)"
            )
        # llama.cpp token types: 3 = control (special), 4 = user-defined (matched whole, not
        # special). Both must be added so the text "<|im_start|>" stays one token.
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pairs = list(zip(tokens, types, strict=True))
        special = [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == 3]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, k in pairs
            if k == 4 and t in vocab
        ]
        backend.add_special_tokens(special)
        backend.add_tokens(user)

        def tok(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = tok("bos_token_id"), tok("eos_token_id")
        # A SentencePiece vocabulary without the flag gets BOS, as llama.cpp and HF give it.
        add_bos = (
            bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
        )
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            single = " ".join(
                ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
            )
            pair = single + " " + single.replace("$A", "$B").replace(":0", ":1")
            spec = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=spec
            )
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=eos,
            pad_token=tok("padding_token_id"),
            unk_token=tok("unknown_token_id"),
        )

    def save(self, folder: str | Path) -> None:
        """Writes `tokenizer.json` and a `tokenizer_config.json` that `from_folder` reads back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))

    # -- ids --------------------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. Special-token text like "<|im_end|>" maps to its single id.

        `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS prefix).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [
            e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Renders `messages` ([{"role", "content"}, ...]) with the model's chat template.

        tokenize=True returns ids (encoded without adding special tokens, as HF does: the template
        already writes them).
        """
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
