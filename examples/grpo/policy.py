"""The policy: a Llama of the served model's architecture (its config.json), fresh random weights,
trained with torch on the CPU in the trainer's own process.

Same architecture as what the replicas serve, so a checkpoint of it loads into them in place
(update_weights) and its parameters map one to one onto theirs (push_weights).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from task import EOS, Task, prompt_ids, target_ids


def make_policy(model_dir: str, seed: int = 0) -> torch.nn.Module:
    """A LlamaForCausalLM with `model_dir`'s config.json and random weights drawn from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a save_pretrained a step: no bars
    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = EOS
    return model


def pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the attention mask (pads are EOS, masked out)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), EOS, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response token | prefix) for every response token, as a [batch, longest response]
    tensor and its 0/1 mask (1 where a response token is)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    ids, mask = pad(seqs)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]: token t+1
    width = max(len(r) for r in responses)
    out = torch.stack([F.pad(logp[i, len(p) - 1:len(p) - 1 + len(r)], (0, width - len(r)))
                       for i, (p, r) in enumerate(zip(prompts, responses))])
    out_mask = torch.stack([F.pad(torch.ones(len(r)), (0, width - len(r))) for r in responses])
    return out, out_mask


def warm_start(model, task: Task, steps: int, batch: int = 64, lr: float = 3e-3, seed: int = 0,
               max_digits: int | None = None) -> list[float]:
    """Teacher forcing on the task's own pairs (digit strings up to `max_digits` long), so that
    the policy emits digits and EOS before RL starts. Returns the loss per step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        prompts = [prompt_ids(task.sample_digits(rng, max_digits)) for _ in range(batch)]
        logp, mask = response_logprobs(model, prompts, [target_ids(p) for p in prompts])
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses
