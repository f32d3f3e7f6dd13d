"""TextCodec: strings to token ids and back, and chat messages to a prompt, for the HTTP
protocols (TRL's /generate/ and /chat/, OpenAI's /v1/completions and /v1/chat/completions).

It reads a Hugging Face model folder's tokenizer.json with the `tokenizers` library and renders
the chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja) in a sandboxed
Jinja environment, as transformers' apply_chat_template does, without importing transformers in
the Gateway. A model without tokenizer.json has no codec: token-id prompts still work, and a text
prompt is refused naming the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

# The prompt's last tokens decode() puts before an output (vLLM primes its DecodeStream with the
# whole prompt; a decoder's choice for the first output token depends on the tokens just before it)
PROMPT_CONTEXT = 8
_UNFINISHED = "\ufffd"  # a character whose bytes are not all there yet: the stream holds it back


class NoTokenizer(ValueError):
    """Text was given (or asked for) but the model has no tokenizer."""


class TextCodec:
    def __init__(self, tokenizer, chat_template: Optional[str], special: dict):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template  # Jinja source, or None
        # bos_token, eos_token, pad_token as strings (the template may use them); one the tokenizer
        # lacks is None, and left undefined for the template (rendered "", not "None", as transformers does)
        self.special = special
        self._template = None
        self._marker = ()  # the Metaspace space marker once looked up (_space_marker); () before
        self._added: Optional[dict] = None  # added tokens' ids to their content, once read
        eos = special.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def load(cls, model_dir: str) -> Optional["TextCodec"]:
        """The codec of a model folder, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer

        folder = Path(model_dir)
        if not (folder / "tokenizer.json").is_file():
            return None
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), template, special)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: Optional[int] = None) -> list[int]:
        """Token ids of `text` as the model's tokenizer makes them; `add_special_tokens`: its
        post-processor's (a BOS, say), as a completion's prompt gets and a chat template's text does not.
        `max_length`: at most that many ids, cut from the left with room kept for the special tokens,
        as a Hugging Face tokenizer with truncation_side="left" (vLLM's for generative models) cuts."""
        if max_length is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if max_length <= 0:
            return []
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        added = self.tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(max_length - added, 0), direction="left")
        return self.tokenizer.post_process(encoding, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> str:
        """`ids`' text as vLLM's detokenizer makes it after `prompt_ids`: it decodes the output as
        the prompt's continuation, so a tokenizer whose decoder drops the first token's space
        (SentencePiece's Metaspace) or puts one between tokens (WordPiece) gives " world", not "world".
        Decoded once with the prompt's last tokens before it, then cut after their text; where that
        cannot match the streamed text (an unfinished character at either end), the stream's pieces."""
        ids = list(ids)
        if not prompt_ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            return text if not text.endswith(_UNFINISHED) else "".join(self.pieces(ids, skip_special_tokens))
        tail = list(prompt_ids[-PROMPT_CONTEXT:])
        head = self.tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
        whole = self.tokenizer.decode(tail + ids, skip_special_tokens=skip_special_tokens)
        if whole.startswith(head) and not head.endswith(_UNFINISHED) and not whole.endswith(_UNFINISHED):
            return whole[len(head):]
        return "".join(self.pieces(ids, skip_special_tokens, prompt_ids=prompt_ids))

    def pieces(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> list[str]:
        """Each token's text as vLLM's detokenizer streams it (FastIncrementalDetokenizer): a
        DecodeStream primed with the prompt's ids, then its steps; with special tokens kept and
        `spaces_between_special_tokens` false, an added token right after another is its bare
        content (no space the decoder would put before it). About 40 us a token: decode() is the
        fast way to the whole text."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)  # whole, as vLLM's
        added = {} if skip_special_tokens or spaces_between_special_tokens else self._added_tokens()
        out, last_added = [], False
        for t in ids:
            piece = stream.step(self.tokenizer, t) or ""
            content = added.get(t)
            if content is not None and last_added:
                piece = content
            last_added = content is not None
            out.append(piece)
        return out

    def _added_tokens(self) -> dict:
        if self._added is None:
            self._added = {i: tok.content for i, tok in self.tokenizer.get_added_tokens_decoder().items()}
        return self._added

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token on its own, decoded (OpenAI's logprobs.tokens), as vLLM's logprobs name them
        (convert_ids_list_to_tokens): a SentencePiece token's leading spaces, which decoding it alone
        drops ("▁world" -> "world"), are put back (" world")."""
        texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        marker = self._space_marker()
        if marker is None:
            return texts
        for k, i in enumerate(ids):
            piece = self.tokenizer.id_to_token(i) or ""
            wanted = len(piece) - len(piece.lstrip(marker))
            missing = wanted - (len(texts[k]) - len(texts[k].lstrip(" ")))
            if missing > 0:
                texts[k] = " " * missing + texts[k]
        return texts

    def _space_marker(self) -> Optional[str]:
        """The Metaspace pre-tokenizer's space marker ("▁"), or None for any other tokenizer."""
        if self._marker == ():
            pre = json.loads(self.tokenizer.to_str()).get("pre_tokenizer") or {}
            subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
            self._marker = next((p.get("replacement", "▁") for p in subs if p.get("type") == "Metaspace"), None)
        return self._marker

    def render_chat(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of `messages` through the model's chat template."""
        if self.chat_template is None:
            raise NoTokenizer("the model's tokenizer has no chat template (tokenizer_config.json chat_template)")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v is not None}, **kwargs)


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
