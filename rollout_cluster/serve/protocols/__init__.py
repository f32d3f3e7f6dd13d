"""The protocols trainers already speak, served by the Gateway over the same router, policies
and replicas as everything else (docs/trainers.md):

- openai.py: OpenAI-compatible routes as vLLM's server extends them (/v1/models,
  /v1/completions, /v1/chat/completions, streaming as server-sent events, `return_token_ids`);
  TRL >= 1.11's VLLMClient speaks these, plus /health, /get_world_size, /reset_prefix_cache;
- trl.py: the routes of `trl vllm-serve` up to TRL 1.10 (/health/, /get_world_size/, /generate/,
  /chat/, /reset_prefix_cache/), and the three TRL >= 1.11 extras;
- batch.py: what they share: a request's prompts and sampling into one batch for the router,
  stop strings, the text of the results.
"""
