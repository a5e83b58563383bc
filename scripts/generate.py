"""Batch generation from the shell with the jax-paged engine.

    python scripts/generate.py                               # SmolLM2: the capital of France
    python scripts/generate.py --chat "What is the capital of France?" "Name three colours."
    python scripts/generate.py --prompts-file prompts.txt --max-tokens 128 --output out.jsonl
    python scripts/generate.py --prompts-file requests.jsonl --temperature 0.8 --seed 1
    python scripts/generate.py --model path/to/hf_folder_or_file.gguf "Once upon a time"

Prompts come from the positional arguments, or from --prompts-file: a text file (one prompt a
line) or, for a ``.jsonl`` file, one JSON object a line with "prompt" (text), "prompt_token_ids"
or "messages" (a chat), plus any `SamplingParams` field for that request, overriding the flags.
A bad request (malformed JSON, an unknown field, a bad value, a chat the template cannot render,
a prompt the engine refuses) gets an error record; the others run. Every error names where its
request came from: ``line N:`` (the line of --prompts-file, from 1, blank lines counted) or
``prompt N:`` (the N-th positional prompt, from 1).

Output: the completions on stdout as they finish, tagged ``[index]`` (the request's position,
from 0), or with --output one JSON object a line, written and flushed as each request finishes
(so in completion order; a crash loses only the unfinished ones):
``{"index", "line", "error", "prompt", "prompt_token_ids", "outputs": [{"text", "token_ids",
"finish_reason", ...}]}``, "line" being the --prompts-file line (null for positional prompts).
A closing summary (requests, tokens, tokens/s, peak KV usage, preemptions, compile time) goes
to stderr.

Exit status: 0; 2 for a bad command line (a missing --model or --prompts-file, a folder that is
not a model, an --output that cannot be written, a prompts file with no prompts), all checked
before the model loads; 1 when every request failed, the model did not load or the run stopped
(130 on Ctrl-C). A failure prints one ``error: ...`` line on stderr; -v adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jax_paged import LLM, SamplingParams  # noqa: E402
from jax_paged.engine.config import ATTENTION_IMPLS, KV_CACHE_DTYPES  # noqa: E402
from jax_paged.entrypoints.outputs import describe_error  # noqa: E402
from models.loading import CHECKPOINT_MARKER  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France?"
_SAMPLING_FLAGS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "ignore_eos",
    "stop",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("prompts", nargs="*", help=f"prompts (default: --chat {DEFAULT_PROMPT!r})")
    ap.add_argument("--prompts-file", help="text file (one prompt a line) or .jsonl requests")
    ap.add_argument("--model", default=None, help="HF folder, .gguf file or checkpoint folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chat", action="store_true", help="apply the chat template")
    ap.add_argument("--output", help="write one JSON object per request to this .jsonl file")
    g = ap.add_argument_group("sampling (per-request JSONL fields override these)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    e = ap.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-decode-steps", type=int, default=32)
    e.add_argument(
        "--async-scheduling",
        action="store_true",
        help="detokenise a step's outputs while the device runs the next one",
    )
    e.add_argument(
        "--attention-impl",
        default="auto",
        choices=ATTENTION_IMPLS,
    )
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV pages' dtype (auto: the model's)",
    )
    e.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices to split the model and KV cache over (on a CPU, emulate N devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    e.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each on its own --tensor-parallel-size devices",
    )
    d = ap.add_argument_group("several hosts (jax.distributed; every host runs this command)")
    d.add_argument("--coordinator-address", help="host:port of process 0")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("-v", "--verbose", action="store_true", help="engine logs (KV usage, ...)")
    return ap


class Failure(Exception):
    """Stops the script with one ``error: <message>`` line on stderr and exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def usage_error(message: str) -> Failure:
    return Failure(message, 2)


class Request(NamedTuple):
    where: str  # how error messages name it: "line 3" (of --prompts-file) or "prompt 2"
    line: int | None  # its 1-based line in --prompts-file; None for a positional prompt
    prompt: object  # text, {"prompt_token_ids": [...]} or chat messages; None if error is set
    fields: dict  # per-request SamplingParams fields
    error: str | None  # why it cannot run, found while reading it (without the location)


def read_requests(args) -> list[Request]:
    """The requests in input order; a line that cannot be read becomes a request with its
    error. A missing, unreadable or empty --prompts-file is a usage error."""
    if args.prompts_file is None:
        prompts = args.prompts or [DEFAULT_PROMPT]
        chat = args.chat or not args.prompts
        return [
            Request(f"prompt {k}", None, [{"role": "user", "content": p}] if chat else p, {}, None)
            for k, p in enumerate(prompts, 1)
        ]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise usage_error(f"--prompts-file {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise usage_error(f"--prompts-file {path}: cannot read it ({describe_error(e)})") from e
    out = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            where = f"line {lineno}"
            if path.suffix == ".jsonl":
                out.append(_parse_jsonl(where, lineno, line, args.chat))
            else:
                text = [{"role": "user", "content": line}] if args.chat else line
                out.append(Request(where, lineno, text, {}, None))
    if not out:
        raise usage_error(f"--prompts-file {path} holds no prompts")
    return out


def _parse_jsonl(where: str, lineno: int, line: str, chat: bool) -> Request:
    def bad(message: str) -> Request:
        return Request(where, lineno, None, {}, message)

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        return bad(f"malformed JSON ({err.msg})")
    if not isinstance(obj, dict):
        return bad("must be a JSON object")
    keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(keys) != 1:
        return bad("give one of prompt, prompt_token_ids, messages")
    key = keys[0]
    value = obj.pop(key)
    if key == "messages" and not (
        isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    ):
        return bad('messages must be a non-empty list of {"role", "content"} objects')
    if key == "prompt" and chat:
        value, key = [{"role": "user", "content": value}], "messages"
    prompt = value if key in ("prompt", "messages") else {"prompt_token_ids": value}
    unknown = set(obj) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        return bad(
            f"unknown fields {sorted(unknown)}; allowed: prompt, prompt_token_ids, messages "
            f"and the SamplingParams fields {sorted(SamplingParams.__dataclass_fields__)}"
        )
    return Request(where, lineno, prompt, obj, None)


def check_model(model: str | None) -> None:
    """What `models.load` accepts: None (the embedded model), a .gguf file, or a folder with
    config.json (HF) or a jax-paged checkpoint. Anything else is a usage error."""
    if model is None:
        return
    path = Path(model)
    if not path.exists():
        raise usage_error(f"--model {model}: no such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise usage_error(f"--model {model}: expected a .gguf file or a model folder")
    elif not path.is_dir():
        raise usage_error(f"--model {model}: not a file or folder")
    elif not ((path / "config.json").is_file() or (path / CHECKPOINT_MARKER).is_file()):
        raise usage_error(
            f"--model {model}: not a model folder (no config.json, no {CHECKPOINT_MARKER})"
        )


def open_output(name: str):
    """--output opened for writing (truncated), or a usage error saying why it cannot be."""
    path = Path(name)
    if path.is_dir():
        raise usage_error(f"--output {name} is a folder")
    if not path.parent.is_dir():
        raise usage_error(f"--output {name}: folder {path.parent} does not exist")
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by main
    except OSError as e:
        raise usage_error(f"--output {name}: cannot write it ({e.strerror or e})") from e


class Writer:
    """Writes each result as it comes: a flushed JSON line on --output, else text on stdout
    (errors on stderr). Counts what it wrote and ticks the progress bar."""

    def __init__(self, requests: list[Request], sink, bar):
        self.requests, self.sink, self.bar = requests, sink, bar
        self.done = self.errors = self.tokens = 0

    def _print(self, text: str, file) -> None:
        if self.bar is not None:
            self.bar.write(text, file=file)  # above the bar, not through it
        else:
            print(text, file=file)

    def emit(self, i: int, error: str | None, out) -> None:
        r = self.requests[i]
        if error is not None:
            error = f"{r.where}: {error}"
        self.done += 1
        self.errors += error is not None
        if out is not None:
            self.tokens += sum(len(c.token_ids) for c in out.outputs)
        if self.sink is not None:
            rec = {"index": i, "line": r.line, "error": error}
            if out is not None:
                rec["prompt"] = out.prompt
                rec["prompt_token_ids"] = out.prompt_token_ids
                rec["outputs"] = [
                    dict(
                        index=c.index,
                        text=c.text,
                        token_ids=c.token_ids,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        cumulative_logprob=c.cumulative_logprob,
                    )
                    for c in out.outputs
                ]
            self.sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
            self.sink.flush()
        elif error is not None:
            self._print(f"[{i}] error: {error}", sys.stderr)
        else:
            for c in out.outputs:
                tag = f"[{i}]" if len(out.outputs) == 1 else f"[{i}.{c.index}]"
                self._print(f"{tag} {c.text}", sys.stdout)
        if self.bar is not None:
            self.bar.update(1)


def run(args, requests: list[Request], sink) -> int:
    base = {f: getattr(args, f) for f in _SAMPLING_FLAGS}
    t0 = time.perf_counter()
    try:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_decode_steps=args.max_decode_steps,
            async_scheduling=args.async_scheduling,
            attention_impl=args.attention_impl,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
        )
    except Exception as e:
        name = args.model or "(the embedded default)"
        raise Failure(f"cannot start the engine on model {name}: {describe_error(e)}") from e
    load_s = time.perf_counter() - t0
    tok = llm.tokenizer

    # Each request either runs (prompts[k], params[k], request index at[k]) or fails here.
    prompts, params, at, failed = [], [], [], []
    for i, r in enumerate(requests):
        err = r.error
        if err is None:
            try:
                sp = SamplingParams(**{**base, **r.fields})
                prompt = r.prompt
                if isinstance(prompt, list):  # a chat
                    if tok is None:
                        raise ValueError("messages: this model has no tokenizer / chat template")
                    try:
                        ids = tok.apply_chat_template(
                            prompt, add_generation_prompt=True, tokenize=True
                        )
                    except Exception as e:  # noqa: BLE001 - a template error is this request's
                        raise ValueError(f"messages: {describe_error(e)}") from e
                    prompt = {"prompt_token_ids": ids}
            except Exception as e:  # noqa: BLE001 - a bad value is this request's error
                err = describe_error(e)
            else:
                prompts.append(prompt)
                params.append(sp)
                at.append(i)
                continue
        failed.append((i, err))

    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
    w = Writer(requests, sink, bar)
    t1 = time.perf_counter()
    try:
        for i, err in failed:
            w.emit(i, err, None)
        if prompts:
            with contextlib.closing(llm.iter_generate(prompts, params)) as results:
                for k, out in results:
                    w.emit(at[k], out.error, out)
                    if bar is not None:
                        m = llm.get_metrics()
                        bar.set_postfix_str(f"{m['generation_tokens_per_s']:.1f} tok/s")
    except (Exception, KeyboardInterrupt) as e:
        stop = isinstance(e, KeyboardInterrupt)
        kept = f" (written to {args.output})" if sink is not None else ""
        raise Failure(
            f"generation stopped after {w.done} of {len(requests)} requests{kept}: "
            + ("interrupted" if stop else describe_error(e)),
            130 if stop else 1,
        ) from e
    finally:
        if bar is not None:
            bar.close()
    gen_s = time.perf_counter() - t1

    m = llm.get_metrics()
    summary = dict(
        requests=len(requests),
        errors=w.errors,
        output_tokens=w.tokens,
        output_tokens_per_s=round(w.tokens / gen_s, 2) if gen_s > 0 else None,
        # The same with the one-off compile time taken out (what a longer run converges to).
        output_tokens_per_s_after_compile=(
            round(w.tokens / (gen_s - m["compile_seconds"]), 2)
            if gen_s > m["compile_seconds"]
            else None
        ),
        load_seconds=round(load_s, 2),
        generate_seconds=round(gen_s, 2),
        compile_seconds=round(m["compile_seconds"], 2),
        compiled_variants=m["compiled_variants"],
        peak_kv_usage=round(m["peak_kv_usage"], 4),
        preemptions=m["num_preemptions"],
    )
    print("summary: " + json.dumps(summary), file=sys.stderr)
    return 1 if w.errors == len(requests) else 0


def start_distributed(args) -> None:
    """Joins the multi-host job (`jax.distributed.initialize`, before any device is used).
    Every host runs the same requests through the same global mesh and computes the same
    outputs; process 0 alone writes them."""
    import jax

    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    if jax.process_index() != 0:
        args.output, args.no_progress = None, True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sink = None
    try:
        # Everything the command line can get wrong is checked before the model loads.
        requests = read_requests(args)
        check_model(args.model)
        if args.coordinator_address or args.num_processes:
            start_distributed(args)
        sink = open_output(args.output) if args.output else None
        return run(args, requests, sink)
    except Failure as e:
        if args.verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        message, code = str(e), e.code
    except KeyboardInterrupt:
        message, code = "interrupted", 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, unless -v
        if args.verbose:
            traceback.print_exc()
        message, code = describe_error(e), 1
    finally:
        if sink is not None:
            sink.close()
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
