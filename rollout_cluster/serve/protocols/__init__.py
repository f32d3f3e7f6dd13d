"""The protocols trainers already speak, served by the Gateway over the same router, policies
and replicas as everything else (docs/trainers.md):

- openai.py: OpenAI-compatible routes as vLLM's server extends them (/v1/models,
  /v1/completions, /v1/chat/completions, streaming as server-sent events, `return_token_ids`);
  TRL >= 1.11's VLLMClient speaks these, plus /health, /get_world_size, /reset_prefix_cache
  (openai_bodies.py: their request bodies; openai_answers.py: the parts of their answers);
- trl.py: the routes of `trl vllm-serve` up to TRL 1.10 (/health/, /get_world_size/, /generate/,
  /chat/, /reset_prefix_cache/), and the three TRL >= 1.11 extras;
- what they share: context.py (the Gateway's ProtocolContext, ProtocolError), json_body.py (the
  body read and checked), prompts.py (a request's prompts and sampling into checked requests;
  truncation.py: vLLM's truncate_prompt_tokens),
  batch.py (one request, one batch on the router; re-exports the rest), outputs.py (the text of
  the results, stop strings), answers.py (the JSON answer).
"""
