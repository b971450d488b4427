"""The model's tokenizer without transformers: ``tokenizers.Tokenizer`` (tokenizer.json) plus the facts
tokenizer_config.json adds (special tokens, chat template, clean-up), with the part of the Hugging Face
tokenizer API that flowrt uses.

Importing transformers costs about 3 s of engine start-up; this class gives the same token ids, text and
chat renderings as transformers' fast tokenizer for directories whose tokenizer_config.json names the
generic classes (``PreTrainedTokenizerFast`` / ``TokenizersBackend``), which load tokenizer.json as it is.

:func:`load_tokenizer` falls back to ``transformers.AutoTokenizer`` (imported only then) when a directory
has no tokenizer.json (slow-only tokenizers), names a model-specific tokenizer class (transformers 5
rebuilds those pipelines in Python), is a large-vocabulary Mistral tokenizer (transformers patches its
regex), or when ``tokenizer=`` is not a local directory (a hub name, a single file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, overload

import tokenizers

from .chat_template import render_chat_template

__all__ = ["Tokenizer", "Encoding", "load_tokenizer", "uses_own_tokenizer", "render_chat_template", "check_text"]

#: tokenizer_config.json ``tokenizer_class`` values whose transformers class loads tokenizer.json unchanged
GENERIC_CLASSES = frozenset({None, "PreTrainedTokenizerFast", "TokenizersBackend"})
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the config gives none


class Encoding(dict):
    """What calling the tokenizer returns: ``enc["input_ids"]`` or ``enc.input_ids`` (like BatchEncoding)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def check_text(text: str, what: str = "text") -> None:
    """ValueError naming `what` when `text` is not valid Unicode (a lone surrogate such as the JSON escape
    ``"\\ud800"`` decodes to), which no tokenizer can encode (tokenizers raises a bare TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} contains a lone surrogate {text[e.start]!r} at character {e.start}: not valid "
                         f"Unicode text (a surrogate escape such as \\ud83d must be followed by its low half)"
                         ) from None


def _token_str(value: Any) -> str | None:
    """A special token from a config: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else str(value)


def _to_ids(ids: Any) -> Any:
    """Token ids as plain Python ints/lists (tensors and arrays accepted, as transformers does)."""
    if hasattr(ids, "tolist"):
        return ids.tolist()
    if isinstance(ids, Mapping) and "input_ids" in ids:
        return _to_ids(ids["input_ids"])
    if isinstance(ids, (list, tuple)):
        return [_to_ids(i) for i in ids]
    return int(ids)


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class TokenizerLike(Protocol):
    """What the engine itself calls on its tokenizer: flowrt's :class:`Tokenizer`, or the transformers tokenizer
    :func:`load_tokenizer` falls back to (both decode a row of ids to its text)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class Tokenizer:
    """A fast tokenizer with the Hugging Face calling conventions flowrt relies on.

    Padding and truncation stored in tokenizer.json are switched off, as transformers does for every
    call that does not ask for them.
    """

    is_fast = True

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None,
                 name_or_path: str = "") -> None:
        cfg = dict(config or {})
        self._tokenizer = backend
        self.name_or_path = name_or_path
        backend.no_padding()
        backend.no_truncation()
        self.special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_str(cfg.get(name))
            if value is not None:
                self.special[name] = value
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        # model-specific named tokens (e.g. "image_token"), and a dict of extra tokens, are special too
        model_tokens = {k: v for k, v in cfg.items() if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES}
        if isinstance(extra, dict):
            model_tokens.update(extra)
            extra = []
        for name, value in model_tokens.items():
            if isinstance(value, (str, dict)) and (token := _token_str(value)) is not None:
                self.special[name] = token
        self.extra_special_tokens: list[str] = [t for t in (_token_str(x) for x in extra) if t is not None]
        self._add_missing_tokens(cfg.get("added_tokens_decoder") or {})
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        self.chat_template: str | dict[str, str] | None = cfg.get("chat_template")
        if isinstance(self.chat_template, (list, tuple)):  # saved as [{"name": ..., "template": ...}]
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        mml = cfg.get("model_max_length")
        self.model_max_length = int(mml) if mml is not None else VERY_LARGE_INTEGER
        self._special_ids: list[int | None] | None = None

    def _add_missing_tokens(self, added_tokens_decoder: Mapping[str, Any]) -> None:
        """Tokens the config declares but tokenizer.json lacks become added tokens, as in transformers:
        the config's added_tokens_decoder entries, then every named and extra special token."""
        have = {t.content for t in self._tokenizer.get_added_tokens_decoder().values()}
        for _, spec in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(spec, dict) and spec.get("content") not in have:
                fields = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
                self._add(tokenizers.AddedToken(spec["content"], **fields))
                have.add(spec["content"])
        for token in [*self.special.values(), *self.extra_special_tokens]:
            if token not in have:
                self._add(tokenizers.AddedToken(token, special=True, normalized=False))
                have.add(token)

    def _add(self, token: tokenizers.AddedToken) -> None:
        if token.special:
            self._tokenizer.add_special_tokens([token])
        else:
            self._tokenizer.add_tokens([token])

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """From a directory with tokenizer.json (and optionally tokenizer_config.json, special_tokens_map.json,
        chat_template.jinja, additional_chat_templates/*.jinja, chat_template.json)."""
        d = Path(model_dir)
        return cls(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), read_tokenizer_config(d), str(d))

    def save_pretrained(self, save_directory: str | os.PathLike) -> tuple[str, ...]:
        """tokenizer.json + tokenizer_config.json, loadable by this class and by transformers."""
        d = Path(save_directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special,
                               "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
                               "model_max_length": self.model_max_length}
        if self.extra_special_tokens:
            cfg["extra_special_tokens"] = list(self.extra_special_tokens)
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
        return str(d / "tokenizer_config.json"), str(d / "tokenizer.json")

    # ---------------------------------------------------------------- vocabulary
    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (``len(tok)`` counts them)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @overload
    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...
    @overload
    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]: ...

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Unknown tokens map to the unk token's id (None without one), as in transformers."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        i = self._tokenizer.token_to_id(token)
        return i if i is not None else self.unk_token_id

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> str | None | list[str | None]:
        ids = _to_ids(ids)
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in skip]

    # ---------------------------------------------------------------- special tokens
    def _special_id(self, name: str) -> int | None:
        token = self.special.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token = property(lambda self: self.special.get("bos_token"))
    eos_token = property(lambda self: self.special.get("eos_token"))
    unk_token = property(lambda self: self.special.get("unk_token"))
    pad_token = property(lambda self: self.special.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def unk_token_id(self) -> int | None:
        token = self.special.get("unk_token")
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens, model-specific ones (image_token ...) included: what chat templates see
        as bos_token, eos_token, ..."""
        return dict(self.special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int | None]:
        """The special tokens' ids (None for one outside the vocabulary where there is no unk token)."""
        if self._special_ids is None:
            self._special_ids = [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]
        return list(self._special_ids)

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True, **_ignored: Any) -> list[int]:
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_texts(text)
            raise

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, return_tensors: str | None = None,
                 return_offsets_mapping: bool = False, **_ignored: Any) -> Encoding:
        try:
            return self._call(text, add_special_tokens, return_tensors, return_offsets_mapping)
        except TypeError:
            _check_texts(text)
            raise

    def _call(self, text: str | list[str], add_special_tokens: bool, return_tensors: str | None,
              return_offsets_mapping: bool) -> Encoding:
        batched = not isinstance(text, str)
        encs = self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens) if batched \
            else [self._tokenizer.encode(text, add_special_tokens=add_special_tokens)]
        out = Encoding(input_ids=[e.ids for e in encs], attention_mask=[e.attention_mask for e in encs])
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encs]
        if return_tensors is not None:
            return _tensors(out, return_tensors)
        return out if batched else Encoding({k: v[0] for k, v in out.items()})

    @overload
    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_ignored: Any) -> str: ...
    @overload
    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_ignored: Any) -> str | list[str]: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_ignored: Any) -> str | list[str]:
        """The text of a row of ids (a list of texts for a batch of rows; tensors and arrays accepted)."""
        ids = _to_ids(token_ids)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return [self._text(s, skip_special_tokens, clean_up_tokenization_spaces) for s in ids]
        return self._text(ids, skip_special_tokens, clean_up_tokenization_spaces)

    def _text(self, ids: int | list[int], skip_special_tokens: bool, clean_up_tokenization_spaces: bool | None) -> str:
        """The text of one row of token ids (or of one id)."""
        if isinstance(ids, int):
            ids = [ids]
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers 5 skips the clean-up for BPE models (it would strip real spaces before punctuation)
        if clean and type(self._tokenizer.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        clean = kwargs.get("clean_up_tokenization_spaces")
        return [self._text(s, skip_special_tokens, clean) for s in _to_ids(sequences)]

    # ---------------------------------------------------------------- chat
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: an explicit one (or the name of one of several), else the tokenizer's."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError("This model has several chat templates and none named 'default'; pass "
                             f"chat_template= with one of {sorted(own)}.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and "
                             "no template argument was passed!")
        return own

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            return_tensors: str | None = None, return_dict: bool = True,
                            **kwargs: Any) -> Any:
        """Render (and by default tokenize, with no special tokens added) a conversation or a batch of them.

        Keyword arguments go to the template, over the named special tokens (``bos_token`` ...).
        """
        for unsupported in ("padding", "truncation", "max_length", "return_assistant_tokens_mask",
                            "sanitize_control_tokens", "tokenizer_kwargs"):
            if kwargs.pop(unsupported, None):
                raise NotImplementedError(f"apply_chat_template({unsupported}=...) is not supported by flowrt's "
                                          "tokenizer")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        chats = list(conversation) if batched else [conversation]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        texts = [render_chat_template(template, chat, tools=tools, documents=documents,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      **{**self.special_tokens_map, **kwargs}) for chat in chats]
        if not tokenize:
            return texts if batched else texts[0]
        enc = self(texts if batched else texts[0], add_special_tokens=False, return_tensors=return_tensors)
        return enc if return_dict else enc["input_ids"]


def _check_texts(text: Any) -> None:
    """After the backend refused `text` (TypeError): ValueError when the cause is a lone surrogate."""
    if isinstance(text, str):
        check_text(text)
    elif isinstance(text, (list, tuple)):
        for i, t in enumerate(text):
            if isinstance(t, str):
                check_text(t, f"text[{i}]")


def _tensors(enc: Encoding, kind: str) -> Encoding:
    if kind == "pt":
        import torch

        return Encoding({k: torch.tensor(v) for k, v in enc.items()})
    if kind == "np":
        import numpy as np

        return Encoding({k: np.array(v) for k, v in enc.items()})
    raise ValueError(f"return_tensors={kind!r} is not supported (use 'pt' or 'np')")


# -------------------------------------------------------------------------------- loading


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json merged the way transformers merges it: special_tokens_map.json (legacy, only
    when the config has no added_tokens_decoder), then chat templates from files, which win over the
    config's; chat_template.json is used only when nothing else gives a template (transformers' tokenizer
    ignores that file; its processors read it)."""
    cfg: dict[str, Any] = _read_json(model_dir / "tokenizer_config.json") or {}
    if "added_tokens_decoder" not in cfg:
        for key, value in (_read_json(model_dir / "special_tokens_map.json") or {}).items():
            if key in SPECIAL_TOKEN_NAMES or key in ("additional_special_tokens", "extra_special_tokens"):
                cfg[key] = value
    templates: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        cfg["chat_template"] = templates["default"]
    elif templates:
        cfg["chat_template"] = templates
    if cfg.get("chat_template") is None:
        legacy = _read_json(model_dir / "chat_template.json") or {}
        if legacy.get("chat_template") is not None:
            cfg["chat_template"] = legacy["chat_template"]
    return cfg


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def uses_own_tokenizer(path: str | os.PathLike) -> bool:
    """Whether :func:`load_tokenizer` builds flowrt's :class:`Tokenizer` for ``path`` (else transformers')."""
    d = Path(path)
    if not d.is_dir() or not (d / "tokenizer.json").is_file():
        return False
    try:
        cfg = _read_json(d / "tokenizer_config.json") or {}
        model_cfg = _read_json(d / "config.json") or {}
    except ValueError:
        return False
    if cfg.get("tokenizer_class") not in GENERIC_CLASSES or cfg.get("auto_map"):
        return False
    # transformers rewrites the pre-tokenizer regex of some Mistral tokenizers with a vocabulary > 100k
    return not ("mistral" in str(model_cfg.get("model_type", "")).lower() and model_cfg.get("vocab_size", 0) > 100_000)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """flowrt's :class:`Tokenizer` where it matches transformers (see the module docstring), else
    ``transformers.AutoTokenizer.from_pretrained(path)``."""
    if uses_own_tokenizer(path):
        return Tokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
