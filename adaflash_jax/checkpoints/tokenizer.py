"""Tokenizer and chat-template rendering for HF directories and GGUF files, without transformers.

Built on the `tokenizers` library directly. A GGUF carries only vocabulary, merges and
token types, so the pipeline around them is rebuilt here to match what transformers
builds for the same file, id for id; chat templates render with the same jinja2
settings transformers uses, so prompts are byte-identical.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .gguf import GGUFCheckpoint, read_gguf_metadata

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4

# Tokens that close a chat turn; a model stops on them even when they are not its eos.
_TURN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|END_OF_TURN_TOKEN|>",
    "<|endoftext|>",
)

# Pre-tokenizer splits keyed by tokenizer.ggml.pre, as transformers applies them to GGUF
# vocabularies. Any other value (SmolLM2's "smollm" among them) gets the plain GPT-2
# ByteLevel regex, again as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


class Tokenizer:
    """Text <-> ids plus chat templating, with the special-token facts generation needs."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self._extra_eos_token_ids = [int(i) for i in extra_eos_token_ids]

    # ----- construction -------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a transformers-style tokenizer directory (tokenizer.json and friends)."""
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"no tokenizer.json in {path}")
        backend = BackendTokenizer.from_file(tokenizer_file)
        tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))
        names = {
            name: _token_content(tokenizer_config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        extra_eos = []
        for file_name in ("generation_config.json", "config.json"):
            eos_ids = _read_json(os.path.join(path, file_name)).get("eos_token_id")
            extra_eos += eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else []
        return cls(
            backend,
            chat_template=_hf_chat_template(path, tokenizer_config),
            extra_eos_token_ids=extra_eos,
            **names,
        )

    def save_hf_dir(self, path: str | os.PathLike) -> None:
        """Writes tokenizer.json + tokenizer_config.json (+ generation_config.json) so that
        `from_hf_dir(path)` rebuilds this tokenizer: same ids, template and stop tokens."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config = {name: getattr(self, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                  if getattr(self, name) is not None}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, ensure_ascii=False, indent=1)
        if self._extra_eos_token_ids:
            with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as handle:
                json.dump({"eos_token_id": self._extra_eos_token_ids}, handle)

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | GGUFCheckpoint) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer a GGUF file describes in its metadata."""
        metadata = source.metadata if isinstance(source, GGUFCheckpoint) else read_gguf_metadata(source)
        tokenizer_model = metadata.get("tokenizer.ggml.model")
        if tokenizer_model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {tokenizer_model!r} is not supported; only byte-level BPE ('gpt2') is."
            )
        raw_tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(raw_tokens)
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")

        byte_alphabet = set(_bytes_to_unicode().values())
        vocab = {_byte_level_spelling(token, byte_alphabet): index for index, token in enumerate(raw_tokens)}
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=[tuple(merge.split(" ")) for merge in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()

        def token_for(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return raw_tokens[index] if index is not None and 0 <= index < len(raw_tokens) else None

        names = {
            "bos_token": token_for("bos_token_id"),
            "eos_token": token_for("eos_token_id"),
            "pad_token": token_for("padding_token_id"),
            "unk_token": token_for("unknown_token_id"),
        }
        # Control tokens (and the named specials) must never be split by BPE; tokens whose
        # spelling falls outside the byte alphabet are llama.cpp mislabels and stay out.
        special = [
            token
            for token, token_type in zip(raw_tokens, token_types)
            if token_type == _CONTROL_TOKEN and set(token) <= byte_alphabet
        ]
        special += [token for token in names.values() if token in vocab and token not in special]
        backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special])
        user_defined = [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(raw_tokens, token_types)
            if token_type == _USER_DEFINED_TOKEN and token in vocab
        ]
        if user_defined:
            backend.add_tokens(user_defined)
        _set_special_token_template(
            backend,
            bos=names["bos_token"] if metadata.get("tokenizer.ggml.add_bos_token") else None,
            eos=names["eos_token"] if metadata.get("tokenizer.ggml.add_eos_token") else None,
        )
        return cls(backend, chat_template=metadata.get("tokenizer.chat_template"), **names)

    # ----- encoding -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids for `text`; special tokens written in the text map to their single ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that should end generation: eos, configured extras, and the template's turn end."""
        template_text = self.chat_template or ""
        turn_ends = [self.token_to_id(token) for token in _TURN_END_TOKENS if token in template_text]
        candidates = [self.eos_token_id, *self._extra_eos_token_ids, *turn_ends]
        return list(dict.fromkeys(i for i in candidates if i is not None))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    # ----- chat ---------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_variables: Any,
    ) -> str:
        """Render a conversation to the prompt string the model was trained on.

        Extra keyword arguments become template variables (e.g. `enable_thinking`).
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables = {
            "tools": None,
            "documents": None,
            **{
                name: value
                for name, value in (
                    ("bos_token", self.bos_token),
                    ("eos_token", self.eos_token),
                    ("unk_token", self.unk_token),
                    ("pad_token", self.pad_token),
                )
                if value is not None
            },
            **template_variables,
        }
        template = _compile_chat_template(self.chat_template)
        try:
            return template.render(
                messages=_validated_messages(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template rejected the conversation: {error}") from error


def _validated_messages(messages: Any) -> list[dict]:
    """Plain dict copies with None-valued keys dropped, as transformers passes them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} is {type(message).__name__}, not a dict")
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {index} needs a non-empty string 'role', got {role!r}")
        content = message.get("content")
        if content is None and "tool_calls" not in message:
            raise ValueError(f"message {index} ({role}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"message {index} ({role}) content must be a string or a list of parts")
        cleaned.append(message)
    return cleaned


def _raise_template_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Same environment settings as transformers, so rendered prompts match byte for byte."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_template_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


def _gguf_pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    split = _GGUF_PRE_TOKENIZER_SPLITS.get(pre_type)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _set_special_token_template(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """Make `encode(..., add_special_tokens=True)` add bos/eos when the file asks for them."""
    if bos is None and eos is None:
        return
    prefix = [bos] if bos is not None else []
    suffix = [eos] if eos is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A", *suffix]),
        pair=" ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix]),
        special_tokens=[(token, backend.token_to_id(token)) for token in dict.fromkeys(prefix + suffix)],
    )


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def _byte_level_spelling(token: str, byte_alphabet: set[str]) -> str:
    """Vocabulary entries outside the byte alphabet (raw text) are respelled byte by byte."""
    if set(token) <= byte_alphabet:
        return token
    spelling = _bytes_to_unicode()
    return "".join(spelling[byte] for byte in token.encode("utf-8"))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _hf_chat_template(path: str, tokenizer_config: dict) -> str | None:
    """The directory's chat template; a chat_template.jinja file wins, as in transformers."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as handle:
            return handle.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    template = template or tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        by_name = {entry.get("name"): entry.get("template") for entry in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template
