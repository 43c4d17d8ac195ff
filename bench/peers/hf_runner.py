"""Runs the throughput workloads on transformers' own generate() and cache: greedy, eos disabled, exact output
lengths. Several requests are served as padded static batches (left padding, one generate call per batch, the
batch generating as many tokens as its longest request): how a plain transformers deployment batches."""
from __future__ import annotations

import time

from protocol import load_job, run_workloads, set_threads_env

PAD_ID = 0


def main() -> None:
    job, result_path = load_job()
    set_threads_env(job["threads"])
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job["dtype"]]
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # eos disabled: every request runs to its exact length
    model.generation_config.pad_token_id = PAD_ID
    load_s = time.perf_counter() - start
    batch_size = job.get("hf_batch_size", 8)

    @torch.inference_mode()
    def generate_batch(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        width, new = max(len(p) for p in prompts), max(max_tokens)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding keeps every request's last prompt token at the end
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, eos_token_id=None, pad_token_id=PAD_ID)  # [B, width + new]
        # a request's tokens past its own max_tokens were computed but are not useful: cut them here
        return [out[row, width:width + m].tolist() for row, m in enumerate(max_tokens)]

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), batch_size):
            outputs += generate_batch(prompts[i:i + batch_size], max_tokens[i:i + batch_size])
        return outputs

    run_workloads(job, result_path, "transformers", transformers.__version__, load_s, generate,
                  extra={"batch_size": batch_size})


if __name__ == "__main__":
    main()
