"""TextCodec: strings to token ids and back, and chat messages to a prompt, for the HTTP
protocols (TRL's /generate/ and /chat/, OpenAI's /v1/completions and /v1/chat/completions).

It reads a Hugging Face model folder's tokenizer.json with the `tokenizers` library and renders
the chat template in a sandboxed Jinja environment, as transformers' apply_chat_template does,
without importing transformers in the Gateway. The templates are found as transformers 5 finds
them: chat_template.jinja (named "default") and additional_chat_templates/<name>.jinja, else
tokenizer_config.json's `chat_template`, one template or a list of {name, template}; of several,
a request's `chat_template` name picks one, else "tool_use" when tools are passed, else "default".
A model named by its Hugging Face id (engine.model: "Qwen/Qwen2.5-7B-Instruct"), as vLLM's engines
take it, has its tokenizer files from the Hugging Face cache (HF_HOME), downloaded there if missing
(HF_HUB_OFFLINE=1: from the cache alone). A model without tokenizer.json has no codec: token-id
prompts still work, and a text prompt is refused naming the field.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

from .chat_jinja import chat_environment

# The prompt's last tokens decode() puts before an output (vLLM primes its DecodeStream with the
# whole prompt; a decoder's choice for the first output token depends on the tokens just before it)
PROMPT_CONTEXT = 8
_UNFINISHED = "\ufffd"  # a character whose bytes are not all there yet: the stream holds it back
# What a codec reads of a model (a hub model's download is these files alone, not its weights)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/*.jinja"]
# the most the Gateway's start waits for the Hub (hub_folder); $ROLLOUT_HUB_TIMEOUT_S sets it
HUB_TIMEOUT_S = float(os.environ.get("ROLLOUT_HUB_TIMEOUT_S") or 30.0)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # "owner/name", as the Hub spells a model's id
log = logging.getLogger("ray.serve")


class NoTokenizer(ValueError):
    """Text was given (or asked for) but the model has no tokenizer."""


class NoSuchTemplate(ValueError):
    """A chat template was asked for by a name the model has none by, or the model has several and
    none is the one to take (no name asked for, and none named "default")."""


class TextCodec:
    def __init__(self, tokenizer, chat_template: Union[str, dict, None], special: dict):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        # Jinja source; {name: source} for a model with several named templates (transformers'
        # tokenizer.chat_template); None without one
        self.chat_template = chat_template
        # bos_token, eos_token, pad_token as strings (the template may use them); one the tokenizer
        # lacks is None, and left undefined for the template (rendered "", not "None", as transformers does)
        self.special = special
        self._compiled: dict = {}  # Jinja source -> its compiled template, once rendered
        self._marker = ()  # the Metaspace space marker once looked up (_space_marker); () before
        self._added: Optional[dict] = None  # added tokens' ids to their content, once read
        eos = special.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def load(cls, model: str) -> Optional["TextCodec"]:
        """The codec of a model folder or Hugging Face id, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer

        folder = Path(model)
        if not folder.exists() and _HUB_ID.fullmatch(model):
            folder = hub_folder(model)
        if folder is None or not (folder / "tokenizer.json").is_file():
            return None
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), _templates(folder, config), special)

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
        cannot match the streamed text (an unfinished character at either end, or last tokens that
        decode to nothing, skipped special tokens say), the stream's pieces after the whole prompt."""
        ids = list(ids)
        if not prompt_ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            return text if not text.endswith(_UNFINISHED) else "".join(self.pieces(ids, skip_special_tokens))
        tail = list(prompt_ids[-PROMPT_CONTEXT:])
        head = self.tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
        if not head and len(prompt_ids) > len(tail):  # (the tail decodes to nothing: the text before it decides)
            return "".join(self.pieces(ids, skip_special_tokens, prompt_ids=prompt_ids))
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

    def template_source(self, chat_template: Optional[str] = None, tools: bool = False) -> str:
        """The Jinja source of the chat template to render, as transformers' get_chat_template picks
        it: the one named `chat_template`; unnamed, of several, "tool_use" when tools are passed
        (`tools`: the request's tools are not None, an empty list too) and "default" otherwise.
        A model's one template is "default". A template's own text is not taken for a name (the
        model's templates are the ones rendered). NoTokenizer: the model has no template;
        NoSuchTemplate: no template has that name, or several and none is "default"."""
        templates = self.chat_template
        if templates is None:
            raise NoTokenizer("the model's tokenizer has no chat template (tokenizer_config.json chat_template)")
        if isinstance(templates, str):
            templates = {"default": templates}
        if chat_template is not None:
            if chat_template not in templates:
                shown = repr(chat_template) if len(chat_template) <= 80 else repr(chat_template[:77]) + "..."
                raise NoSuchTemplate(f"chat_template={shown}: the model has no chat template by that name (its "
                                     f"templates: {', '.join(sorted(templates))})")
            return templates[chat_template]
        if tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" not in templates:
            raise NoSuchTemplate(f"chat_template: the model has several chat templates and none named \"default\": "
                                 f"name one (its templates: {', '.join(sorted(templates))})")
        return templates["default"]

    def render_chat(self, messages: list, add_generation_prompt: bool = True, chat_template: Optional[str] = None,
                    **kwargs) -> str:
        """The prompt text of `messages` through the model's chat template (template_source picks it
        by `chat_template`, a name, and whether kwargs' `tools` is set). The template sees `tools` and
        `documents` as None when not given, as transformers renders it."""
        source = self.template_source(chat_template, kwargs.get("tools") is not None)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = chat_environment().from_string(source)
        special = {k: v for k, v in self.special.items() if v is not None}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{"tools": None, "documents": None, **special, **kwargs})


def hub_folder(repo_id: str, timeout_s: float = HUB_TIMEOUT_S) -> Optional[Path]:
    """The Hugging Face cache's folder of `repo_id`'s tokenizer files: the cache's own first (no
    network), else fetched into it within `timeout_s` (a Hub or proxy that does not answer must
    not hold up the Gateway's start: huggingface_hub's first call has no timeout of its own).
    HF_HOME, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply, as to vLLM's engines. None where the
    cache has none and the Hub gave none in time (said in the log: text prompts are then refused
    naming the field)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES, local_files_only=True))
    except Exception:  # noqa: BLE001 (not in the cache: ask the Hub)
        pass
    got: dict = {}

    def fetch() -> None:
        try:
            got["path"] = snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES)
        except Exception as e:  # noqa: BLE001
            got["error"] = e

    worker = threading.Thread(target=fetch, name=f"tokenizer-of-{repo_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if "path" in got:
        return Path(got["path"])
    why = got.get("error") or TimeoutError(f"no answer within {timeout_s:g} s")
    log.warning("no tokenizer for engine.model=%r from the Hugging Face cache or Hub (%s: %s): text prompts "
                "and chat are refused; token ids work", repo_id, type(why).__name__, why)
    return None


def _templates(folder: Path, config: dict) -> Union[str, dict, None]:
    """A model folder's chat templates as transformers 5 loads them: chat_template.jinja ("default")
    and additional_chat_templates/<name>.jinja, over tokenizer_config.json's `chat_template` (one
    template, or a list of {name, template}); one template named "default" is that template alone."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text()
    if (folder / "additional_chat_templates").is_dir():
        for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text()
    template = (files["default"] if list(files) == ["default"] else files) if files else config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    return template or None


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None
