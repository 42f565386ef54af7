"""Text to token ids and back, with the model's own chat template, without torch.

`Tokenizer` wraps a `tokenizers.Tokenizer` (Hugging Face's Rust BPE) with what `transformers` keeps beside it:
the special token ids, whether raw text starts with BOS, and the chat template, rendered with jinja2 in the
same sandbox and with the same variables as `transformers`' `apply_chat_template`.

It loads from a directory as `save_pretrained` writes it, or from a GGUF, which holds the vocabulary as
metadata under llama.cpp's key names. From a GGUF it rebuilds the tokenizer `transformers` builds from the
same file (tests/checkpoints/test_tokenizer.py checks they agree; for SmolLM2 it also splits number
characters apart, as llama.cpp and SmolLM2's own tokenizer.json do) and caches it as such a directory:
rebuilding Gemma 3's 262k-token vocabulary takes tens of seconds, reading it back about a second.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import gguf
import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from dflax import paths
from dflax.checkpoints import gguf_file

# The special tokens of tokenizer_config.json; the chat template sees them as variables.
_SPECIAL_TOKEN_NAMES = tuple(f"{name}_token" for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
# Tokens that close a chat turn. Generation stops on them as on EOS, as llama.cpp does.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")
_GGUF_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class Tokenizer:
    """A model's tokenizer: byte-pair encoding, special token ids and chat template.

    Create one with `load`, `from_gguf` or `from_hf_dir`. Encoding, decoding and chat templates give what
    `transformers.AutoTokenizer` gives for the same files (`add_special_tokens=True`, `tokenize=False`).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ):
        """Wraps a `tokenizers.Tokenizer`.

        Args:
          backend: the tokenizer; its post-processor decides what `encode` adds to raw text by default.
          special_tokens: names from tokenizer_config.json ("bos_token", "eos_token", "pad_token", ...) to
            token text.
          chat_template: Jinja source of the chat template, or None if the model has none.
          extra_eos_ids: ids besides EOS that end generation, e.g. from generation_config.json.
        """
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_template = chat_template
        candidates = [
            self._special_id("eos_token"),
            *extra_eos_ids,
            *map(backend.token_to_id, _END_OF_TURN_TOKENS),
        ]
        self._eos_ids = tuple(dict.fromkeys(i for i in candidates if i is not None))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Loads a .gguf file with `from_gguf` or a tokenizer directory with `from_hf_dir`."""
        path = Path(path).expanduser()
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.is_file():
            return cls.from_gguf(path)
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json"
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Loads a tokenizer directory as `transformers`' `save_pretrained` writes it.

        Args:
          path: a directory with tokenizer.json, and optionally tokenizer_config.json (special tokens, chat
            template), chat_template.jinja (preferred over the config's template) and generation_config.json
            (more EOS ids).

        Raises:
          FileNotFoundError: when there is no tokenizer.json.
        """
        path = Path(path).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json: expected a directory written by a transformers tokenizer's "
                "save_pretrained, or a .gguf file for Tokenizer.from_gguf"
            )
        config = _read_json(path / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids = _read_json(path / "generation_config.json").get("eos_token_id") or []
        return cls(
            tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
            {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES if config.get(name)},
            chat_template,
            [eos_ids] if isinstance(eos_ids, int) else eos_ids,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
        """Rebuilds the tokenizer described by a GGUF's metadata, converting it once and caching the result.

        Supports SmolLM2's byte-level BPE (`tokenizer.ggml.pre` "smollm") and Gemma 3's SentencePiece BPE.

        Args:
          path: the .gguf file.
          cache_dir: where conversions are cached, one directory per file (name, size and mtime) and
            version of this module's source; defaults to `paths.cache_dir() / "tokenizers"`.

        Raises:
          FileNotFoundError: when `path` does not exist.
          ValueError: when it is not a GGUF, or holds a tokenizer this module cannot rebuild.
        """
        path = Path(path).expanduser()
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(
                    f"{path} is not a GGUF file; for a tokenizer.json directory use Tokenizer.from_hf_dir"
                )
        stat = path.stat()
        root = Path(cache_dir) if cache_dir is not None else paths.cache_dir() / "tokenizers"
        # Keyed on this module's source too: a changed conversion never reuses an older one's output.
        code = paths.source_hash(__name__)
        converted = root / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{code}"
        if not (converted / "tokenizer.json").is_file():
            _save_atomically(*_convert_gguf(path), converted)
        return cls.from_hf_dir(converted)

    @property
    def bos_id(self) -> int | None:
        """The beginning-of-sequence id, or None if the model has none."""
        return self._special_id("bos_token")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS first, then end-of-turn tokens (e.g. Gemma's <end_of_turn>)."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        """The padding id: the pad token, else the first of `eos_ids`, else None."""
        pad = self._special_id("pad_token")
        return pad if pad is not None else next(iter(self._eos_ids), None)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """Jinja source of the chat template, or None."""
        return self._chat_template

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_start|>") become their ids.

        Args:
          text: the text.
          add_bos: prepend the BOS id; None does what the model does for raw text (Gemma adds BOS, SmolLM2
            does not), like `transformers` with `add_special_tokens=True`.
        """
        if add_bos is None:
            return self._backend.encode(text).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True, but this tokenizer has no BOS token")
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (a list or a 1-D array), leaving out special tokens unless told otherwise."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> str:
        """Renders a conversation with the model's chat template.

        Args:
          messages: dicts with "role" ("system", "user", "assistant") and "content".
          add_generation_prompt: end with the header that opens the assistant's turn.

        Returns:
          The prompt text; for the ids use `encode_chat`, which adds no second BOS.

        Raises:
          ValueError: when the model has no chat template.
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in its GGUF or tokenizer directory)")
        return _compile_chat_template(self._chat_template).render(
            # Like transformers, drop None values (an API's `content=None`): templates handle missing keys.
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **self._special_tokens,
        )

    def encode_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `apply_chat_template(messages)`; BOS only where the template writes it."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)

    def _special_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: str | Mapping) -> str:
    # Older tokenizer_config.json files store special tokens as serialized AddedToken dicts.
    return value["content"] if isinstance(value, Mapping) else value


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """The template in the environment `transformers` renders chat templates in (same options and helpers)."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change tool schemas in prompts.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _save_atomically(
    backend: tokenizers.Tokenizer, special_tokens: dict[str, str], chat_template: str | None, out_dir: Path
) -> None:
    """Writes a tokenizer directory, renamed into place whole so that a directory found there is complete."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, ignore_cleanup_errors=True) as tmp:
        backend.save(os.path.join(tmp, "tokenizer.json"))
        Path(tmp, "tokenizer_config.json").write_text(json.dumps(special_tokens, indent=2), encoding="utf-8")
        if chat_template is not None:
            Path(tmp, "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "tokenizer.json").is_file():  # not a concurrent conversion that finished first
                raise


def _convert_gguf(path: Path) -> tuple[tokenizers.Tokenizer, dict[str, str], str | None]:
    """(backend, special tokens, chat template) from a GGUF's tokenizer metadata."""
    reader = gguf_file.open_gguf(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    arch = reader.fields["general.architecture"].contents()
    kind, pre = meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre")
    tokens = meta["tokenizer.ggml.tokens"]
    special_tokens = {name: tokens[meta[key]] for name, key in _GGUF_SPECIAL_IDS.items() if key in meta}
    if kind == "gpt2" and pre == "smollm":
        backend = _smollm_bpe(tokens, meta["tokenizer.ggml.merges"])
    elif kind == "llama" and arch == "gemma3":
        backend = _gemma_bpe(tokens, special_tokens["unk_token"])
    else:
        raise ValueError(
            f"cannot rebuild the tokenizer of {path} (architecture {arch!r}, tokenizer.ggml.model {kind!r}, "
            f"tokenizer.ggml.pre {pre!r}); supported: SmolLM2 and Gemma 3 GGUFs. For another model save its "
            "transformers tokenizer with save_pretrained and load it with Tokenizer.from_hf_dir"
        )
    _add_gguf_added_tokens(backend, tokens, meta["tokenizer.ggml.token_type"])
    # llama.cpp adds BOS to SentencePiece vocabularies whose file does not say otherwise.
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama"):
        bos = special_tokens["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    chat_template = meta.get("tokenizer.chat_template") or _DEFAULT_CHAT_TEMPLATES.get(arch)
    return backend, special_tokens, chat_template


def _smollm_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 alphabet) that first splits every number character apart.

    The split is llama.cpp's "smollm" pre-tokenizer and SmolLM2's tokenizer.json; transformers' GGUF loader
    leaves it out, which changes ids only around non-ASCII number characters such as " ²" (no token joins
    an ASCII digit to anything).
    """
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma_bpe(tokens: list[str], unk_token: str) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE on "▁"-for-space text with byte fallback, as `transformers` builds Gemma's.

    Two fixes the file needs (the same `transformers` makes): tokens of two or more spaces are stored as
    spaces but matched as "▁"s; and the file has no merges, so every split of a token into two tokens
    becomes a merge, ranked by the merged token's position in the file (Gemma's scores do not follow the
    merge order) and then longer left part first.
    """
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [
        (t[:i], t[i:]) for t in tokens for i in range(len(t) - 1, 0, -1) if t[:i] in vocab and t[i:] in vocab
    ]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Registers control tokens as special and user-defined ones (e.g. "\\n\\n") as plain added tokens.

    Both are matched whole in the text; without this they would be cut into pieces. User-defined tokens the
    BPE vocabulary spells differently (Gemma's runs of spaces) are left to the BPE, as `transformers` does.
    """
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in typed if k == gguf.TokenType.CONTROL]
    )
    vocab = backend.get_vocab()
    backend.add_tokens(
        [AddedToken(t, normalized=False) for t, k in typed if k == gguf.TokenType.USER_DEFINED and t in vocab]
    )


# Gemma 3's chat template as published in the google/gemma-3 checkpoints' tokenizer_config.json. The
# Gemma-3-270M GGUF carries none (so transformers gives it none); this one lets chat prompts work.
_GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
_DEFAULT_CHAT_TEMPLATES = {"gemma3": _GEMMA3_CHAT_TEMPLATE}
