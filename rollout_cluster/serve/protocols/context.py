"""What every protocol route needs from the Gateway (ProtocolContext), and how a route refuses a
request (ProtocolError: the status, a message naming the field, the field)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...config import EngineConfig, LimitsConfig
from ...protocol import ModelInfo
from ...text.codec import TextCodec
from ..router_reach import RouterAbsent, router_status


class ProtocolError(Exception):
    """A request refused: the HTTP status, a message naming the field, and the field (`param`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "BadRequestError",
                 retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.retry_after_s = retry_after_s


@dataclass
class ProtocolContext:
    """What every protocol route needs from the Gateway."""

    router: object  # the Router's handle (a SignedRouter in the Gateway: it cancels what it runs)
    codec: Optional[TextCodec]  # the model's tokenizer; None: prompts are token ids, no text comes back
    limits: LimitsConfig  # the config's limits (n, batch size, the Retry-After of a busy answer)
    call_timeout_s: float  # bound on each router call
    model_name: str  # the id /v1/models lists; a request may name it (or the model's path)
    model_root: str  # the model's path
    batch_timeout_s: float = 3600.0  # a request's batch is cancelled past this
    world_size: int = 1  # GPUs (tensor-parallel ranks) per engine, for TRL's /get_world_size
    logprobs_mode: str = "raw_logprobs"  # the engines' (engine.logprobs_mode), for TRL's /server_info
    # the config's engine.max_model_len: what bounds a text tokenized before any replica said its own
    config_max_model_len: int = EngineConfig.model_fields["max_model_len"].default
    _model: Optional[ModelInfo] = field(default=None, repr=False)  # the engine's limits, once a replica said them
    # each token id's text on its own, as the tokenizer decoded it once (bounded by the vocabulary)
    _token_texts: dict = field(default_factory=dict, repr=False)
    _chars_per_token: int = field(default=0, repr=False)  # the most characters one token covers, once computed

    async def status(self) -> dict:
        """The router's status; ProtocolError 503 with Retry-After when no router answers (it is
        down or restarting: router_reach.py), as a full router's answer carries."""
        try:
            return await router_status(self.router, self.call_timeout_s)
        except RouterAbsent as e:
            raise ProtocolError(503, str(e), kind="ServiceUnavailableError",
                                retry_after_s=self.limits.retry_after_s) from None

    async def model_info(self) -> Optional[ModelInfo]:
        if self._model is None:
            st = await self.status()
            if st.get("model"):
                self._model = ModelInfo(**st["model"])
        return self._model

    def token_texts(self, ids: list) -> list[str]:
        """Each token of `ids` decoded on its own (OpenAI's logprobs tokens): one tokenizer call per
        token id ever seen, not per token of every answer."""
        known = self._token_texts
        new = list({t for t in ids if t not in known})
        if new:
            known.update(zip(new, self.codec.token_texts(new)))
        return [known[t] for t in ids]

    def encode(self, text: str, param: str, add_special_tokens: bool = True, truncation=None) -> list[int]:
        """codec.encode(text), refused unread when `text` holds more characters than max_model_len
        tokens can: tokenizing the body's 64 MiB of text took the event loop ~50 s and GiBs of ids,
        only to refuse the prompt as longer than the context. `truncation` (truncation.Truncation):
        the ids cut as vLLM cuts them, and such a text first trimmed to the characters the kept side's
        max_model_len tokens could cover, as vLLM trims it for an explicit truncation_side (for the
        tokenizer's own cut, side None, vLLM tokenizes the whole text; trimmed here too, from the left).
        Before any replica said its max_model_len, the config's bounds the text."""
        max_model_len = self._model.max_model_len if self._model is not None else self.config_max_model_len
        if max_model_len:
            if not self._chars_per_token:  # byte-level BPE: a token's vocabulary string has a char per byte
                # (at least 100: a WordPiece [UNK] stands for a whole word of up to 100 characters)
                self._chars_per_token = max(100, max(map(len, self.codec.tokenizer.get_vocab()), default=0))
            limit = max_model_len * self._chars_per_token
            if len(text) > limit and truncation is not None:
                text = text[:limit] if truncation.side == "right" else text[-limit:]
            elif len(text) > limit:
                raise ProtocolError(400, f"{param}: {len(text)} characters, more than the model's context could hold "
                                         f"(max_model_len={max_model_len} tokens of at most "
                                         f"{self._chars_per_token} characters)", param)
        if truncation is None:
            return self.codec.encode(text, add_special_tokens)
        if truncation.side is None:
            return self.codec.encode(text, add_special_tokens, max_length=truncation.keep)
        return truncation.ids(self.codec.encode(text, add_special_tokens))

    def names_model(self, name) -> bool:
        return name in (None, "", self.model_name, self.model_root)
