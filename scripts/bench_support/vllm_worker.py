"""Runs under vLLM's own Python (never jax-paged's): builds `vllm.LLM` on a model folder, then
answers one JSON request per stdin line with a greedy generation on token ids. Protocol lines
on stdout start with "@@" (vLLM's logs may share stdout); see `vllm_peer.OfflineVLLM`.

    python vllm_worker.py MODEL_DIR DTYPE MAX_NUM_SEQS MAX_MODEL_LEN
"""

import json
import sys
import time


def send(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> None:
    model_dir, dtype, max_num_seqs, max_model_len = sys.argv[1:5]
    t0 = time.perf_counter()
    try:
        import vllm

        llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            max_num_seqs=int(max_num_seqs),
            max_model_len=int(max_model_len),
            enable_prefix_caching=False,  # the repeats reuse the same prompts
            seed=0,
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"startup_s": time.perf_counter() - t0, "version": vllm.__version__})
    for line in sys.stdin:
        req = json.loads(line)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        send({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
