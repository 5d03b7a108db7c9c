"""A ``tokenizers.Tokenizer`` with the part of transformers' tokenizer API the engine and server use,
built without importing transformers (whose import is a large share of a server's start).

:class:`FastTokenizer` sets the backend up as ``PreTrainedTokenizerFast(tokenizer_object=...)``
does (its special tokens added, its BOS/EOS post-processor), so encoding and decoding are the
backend's own and equal transformers' (the tests compare the backends' JSON). Chat templates render
through :mod:`pagellm.tokenizer.chat_template`. Any other attribute (``save_pretrained``,
``__call__``...) is served by the transformers tokenizer of the same backend, built on first use: code written for a
Hugging Face tokenizer keeps working.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from tokenizers import AddedToken, Tokenizer, processors

from pagellm.tokenizer.chat_template import render_chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# transformers' named special tokens, in its order (all_special_tokens lists them so).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# apply_chat_template's arguments about tokenizing: a call with any goes to transformers.
_TOKENIZING_ARGS = frozenset(
    {"sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)


class FastTokenizer:
    """A Hugging Face-style fast tokenizer over ``backend`` (which it takes and sets up)."""

    is_fast = True

    def __init__(
        self,
        backend: Tokenizer,
        name_or_path: str = "",
        chat_template: Optional[str] = None,
        add_bos_token: Optional[bool] = None,
        add_eos_token: Optional[bool] = None,
        **special_tokens: Optional[str],
    ) -> None:
        """``add_bos_token``/``add_eos_token``: None where the model does not say (then, as in
        transformers, a post-processor the backend already has is kept)."""
        unknown = set(special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise TypeError(f"unknown special token names: {sorted(unknown)}")
        self._backend = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self._special = {name: token for name, token in special_tokens.items() if token is not None}
        flags = {"add_bos_token": add_bos_token, "add_eos_token": add_eos_token}
        stated = {name: value for name, value in flags.items() if value is not None}
        self._hf_kwargs: dict[str, Any] = {"name_or_path": name_or_path, **special_tokens, **stated}
        self._hf: Optional[PreTrainedTokenizerFast] = None
        # As transformers' init: named special tokens the vocabulary lacks are added as special.
        missing = [token for token in dict.fromkeys(self._special.values()) if backend.token_to_id(token) is None]
        if missing:
            backend.add_special_tokens([AddedToken(token, special=True) for token in missing])
        bos = self._special.get("bos_token") if add_bos_token else None
        eos = self._special.get("eos_token") if add_eos_token else None
        if backend.post_processor is None or add_bos_token is not None or add_eos_token is not None:
            single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
            pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
            marks = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
            backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=marks)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """The transformers tokenizer of this vocabulary (for libraries that take one: xgrammar)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            kwargs = {**self._hf_kwargs, "chat_template": self.chat_template}  # as it is now, if reassigned
            self._hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(self._backend.to_str()), **kwargs)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # e.g. copy and pickle probing before __init__ ran
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # a dunder, which __getattr__ never sees
        return self.hf(*args, **kwargs)

    # -- encoding -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        """Clean-up of tokenization spaces is never applied: transformers skips it for BPE too."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Optional[int] | list[Optional[int]]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(token) for token in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    # -- special tokens ---------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: self._special[name] for name in SPECIAL_TOKEN_NAMES if name in self._special}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._backend.token_to_id(token) for token in self.all_special_tokens]

    def _token(self, name: str) -> Optional[str]:
        return self._special.get(name)

    def _token_id(self, name: str) -> Optional[int]:
        token = self._special.get(name)
        return None if token is None else self._backend.token_to_id(token)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))

    # -- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[Any], *args: Any, tokenize: bool = True, **kwargs: Any) -> Any:
        """transformers' ``apply_chat_template``; the text of one conversation (``tokenize=False``,
        the server's case) is rendered here, anything else by the transformers tokenizer."""
        if tokenize or args or _TOKENIZING_ARGS & set(kwargs) or (conversation and isinstance(conversation[0], (list, tuple))):
            return self.hf.apply_chat_template(conversation, *args, tokenize=tokenize, **kwargs)
        template = kwargs.pop("chat_template", None) or self.chat_template
        if template is None:
            raise ValueError("Cannot use chat template functions: tokenizer.chat_template is not set and no template was passed.")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = list(getattr(conversation, "messages", conversation))
        template_kwargs = {**self.special_tokens_map, **kwargs}  # the caller's win, as in transformers
        return render_chat_template(template, messages, **template_kwargs)

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)}, special_tokens={self.special_tokens_map})"
