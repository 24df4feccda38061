"""One vLLM engine, one mode, timed: run by `bench exports` with the Python of vLLM CPU's own
environment (it does not import SpecLab, whose dependencies are not there), in a process of its
own per mode, since a vLLM engine spawns workers and keeps memory until its process ends.

    python bench/vllm_peer.py SPEC.json OUT.json

SPEC: {"engine_args": {...LLM kwargs: model, dtype, speculative_config…}, "prompts": [[token ids]],
"max_tokens": N, "warmup": [token ids], "repeats": R}. OUT: {"vllm_version", "startup_s", "tokens", "seconds",
"tok_s", "outputs": [[token ids]], "per_prompt_s": [...]}. Greedy (temperature 0), one request at a
time: the latency of a single stream, which is what speculative decoding buys."""
from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path, encoding="utf-8").read())
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec["engine_args"])
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    if spec.get("warmup"):
        llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)
    outputs, times, tokens = [], [], 0
    for r in range(spec.get("repeats", 1)):
        for ids in spec["prompts"]:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            tokens += len(out[0].outputs[0].token_ids)
            if r == 0:
                outputs.append(list(out[0].outputs[0].token_ids))
    result = {"vllm_version": vllm.__version__, "startup_s": startup, "tokens": tokens, "seconds": sum(times),
              "tok_s": tokens / sum(times), "outputs": outputs, "per_prompt_s": times}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
