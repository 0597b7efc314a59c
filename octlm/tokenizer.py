"""Tokenizer: tokenizer.json files, stream decoding, and chat templates rendered exactly like transformers.

Ordinary text never produces control tokens: `encode("<|im_end|>")` gives the ids of the characters
`<`, `|`, ... Only the chat template writes control tokens. `encode_chat` keeps that promise inside a
conversation: before rendering, every control string in the caller's data is wrapped in two reserved
noncharacters; after rendering, marked strings are encoded as text and the rest (the template's own
text) with control tokens. Assistant messages are the model's own output and are not marked: Qwen3's
template splits them on `</think>` and strips newlines, which markers would disturb (transformers'
`sanitize_control_tokens=True` marks them and renders extra newlines around the thinking block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

# Unicode noncharacters, set aside for a program's internal use: they mark a control string that came
# from the caller's data so the rendered chat can tell it apart from the template's own control tokens.
MARK_OPEN, MARK_CLOSE = "\ufdd0", "\ufdd1"
# A marker the template turned into an escape sequence (Python repr, JSON), losing track of literal text.
ESCAPED_MARK = re.compile(r"\\ufdd[01]", re.IGNORECASE)
# What json.dumps(ensure_ascii=True) escapes beyond ensure_ascii=False, except octlm's markers.
NON_ASCII = re.compile(f"[^\\x00-\\x7e{MARK_OPEN}{MARK_CLOSE}]")
# The variables transformers passes to every chat template (its special_tokens_map), when set.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may come under; transformers copies it to the first two before rendering.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A tokenizer.json (byte-level BPE or any other `tokenizers` model) plus its tokenizer_config.json."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | list[dict[str, str]] | None = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "tokenizer",
        template_source: str | None = None,
    ):
        """`source` and `template_source` name the files in error messages."""
        self.backend = backend
        self.source = source
        self.template_source = template_source or source
        self.config = dict(config or {})
        self.control_tokens = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        self._control_ids = frozenset(self.control_tokens.values())
        self._special_tokens = {
            k: _token_text(self.config[k], source, k) for k in SPECIAL_TOKEN_KEYS if self.config.get(k)
        }
        self.chat_templates = _named_templates(chat_template, self.template_source)
        self.eos_ids = list(dict.fromkeys([*([self.token_id(self.eos)] if self.eos else []), *extra_eos_ids]))
        self._marked = _marked_pattern(tuple(self.control_tokens))

    @classmethod
    def from_dir(cls, snapshot_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json
        (the last three when present) from a snapshot folder."""
        folder = Path(snapshot_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such snapshot folder")
        optional = {
            name: folder / name
            for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
        }
        present = {name: (path if path.is_file() else None) for name, path in optional.items()}
        return cls.from_files(
            folder / "tokenizer.json",
            present["tokenizer_config.json"],
            chat_template_file=present["chat_template.jinja"],
            generation_config_json=present["generation_config.json"],
        )

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str | Path,
        tokenizer_config_json: str | Path | None = None,
        *,
        chat_template_file: str | Path | None = None,
        generation_config_json: str | Path | None = None,
    ) -> Tokenizer:
        """Load from explicit files. chat_template.jinja overrides the config's `chat_template` (as in
        transformers); generation_config.json's eos ids (Qwen3: 151645, 151643) are added to `eos_ids`."""
        config = _read_json(Path(tokenizer_config_json)) if tokenizer_config_json else {}
        source = str(tokenizer_config_json or tokenizer_json)
        template_source = str(chat_template_file or source)
        template = config.get("chat_template")
        if chat_template_file:
            template = Path(chat_template_file).read_text(encoding="utf-8")
        _named_templates(template, template_source)  # a broken template fails before the slow load below
        backend = _load_backend(Path(tokenizer_json))
        eos = _generation_eos_ids(Path(generation_config_json), backend) if generation_config_json else []
        return cls(backend, config, template, eos, source, template_source)

    # ----- vocabulary -----

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (Qwen3: 151,669; its model has 151,936 rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def pad_id(self) -> int | None:
        return None if self.pad is None else self.token_id(self.pad)

    def token_id(self, token: str) -> int:
        """The id of one token given as its vocabulary string, e.g. "<|im_end|>" -> 151645."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a single token of {self.source}")
        return token_id

    # ----- text -----

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as plain text: control strings such as "<|im_end|>" in it are never control ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self._control_ids.isdisjoint(ids):
            return ids  # no added token matched, so this is exactly the plain pipeline below
        return self._encode_plain(text)

    def _encode_plain(self, text: str) -> list[int]:
        """Run normalizer, pre-tokenizer and model without the added-token matcher."""
        backend = self.backend
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        pieces = (
            backend.pre_tokenizer.pre_tokenize_str(normalized)
            if backend.pre_tokenizer
            else [(normalized, None)]
        )
        ids = [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]
        if not self._control_ids.isdisjoint(ids):
            raise ValueError(f"{self.source}: plain text {text[:60]!r} still encodes to a control token")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; unknown ids (a model's padding rows) decode to nothing, as in transformers."""
        return self.backend.decode(self._check_ids(ids, "ids"), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False, context: Sequence[int] = ()) -> StreamDecoder:
        """A decoder fed one id at a time; `context`: ids already shown, such as the prompt."""
        return StreamDecoder(self.backend, skip_special_tokens, self._check_ids(context, "context"))

    def _check_ids(self, ids: Iterable[int], what: str) -> list[int]:
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"{what}: token ids must be non-negative, got {min(ids)}")
        return ids

    # ----- chat template -----

    def chat_template(self, tools: object = None) -> str:
        """The template source: the only one, or from a named set "tool_use" (with tools) or "default"."""
        if not self.chat_templates:
            raise ValueError(
                f"{self.source} has no 'chat_template' key (and no chat_template.jinja beside it): "
                "this tokenizer cannot render conversations; encode raw text instead"
            )
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ValueError(
                f"{self.template_source}: no 'default' among the templates {sorted(self.chat_templates)}"
            )
        return self.chat_templates[name]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text, identical to transformers' apply_chat_template(..., tokenize=False)."""
        variables = self._template_variables(messages, tools, kwargs, lambda role: str, str)
        return self._render(tools, variables, add_generation_prompt, enable_thinking)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        trusted_roles: Sequence[str] = ("assistant",),
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids: control tokens written by the template are control ids, control strings in the caller's
        data stay literal text. Messages of `trusted_roles` are the model's own replies: their `<think>` and
        `<tool_call>` were control tokens when generated, so they stay control tokens (and the template may
        parse them). Without control strings in untrusted data, the ids equal transformers' tokenization."""

        def wrap_for(role: str) -> Callable[[str], str]:
            return _refuse_markers if role in trusted_roles else self._mark_literals

        variables = self._template_variables(messages, tools, kwargs, wrap_for, self._mark_literals)
        rendered = self._render(tools, variables, add_generation_prompt, enable_thinking)
        if ESCAPED_MARK.search(rendered):
            raise ValueError(
                f"the chat template of {self.template_source} writes data through an escaping filter "
                "(repr or ensure_ascii), so control strings in messages cannot be kept literal"
            )
        return self._encode_marked(rendered)

    def _template_variables(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
        wrap_for: Callable[[str], Callable[[str], str]],
        wrap_input: Callable[[str], str],
    ) -> dict[str, Any]:
        """Everything the template sees, rebuilt from plain JSON types (the sandbox sees nothing else)."""
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError(
                "tools must be a list of JSON-schema dicts (octlm does not convert Python functions)"
            )
        return {
            "messages": _prepare_messages(messages, wrap_for),
            "tools": _plain(tools, "tools", wrap_input),
            "documents": _plain(kwargs.get("documents"), "documents", wrap_input),
            **self._special_tokens,
            **{key: _plain(value, key, wrap_input) for key, value in kwargs.items() if key != "documents"},
        }

    def _render(
        self, tools: object, variables: dict[str, Any], add_generation_prompt: bool, thinking: bool
    ) -> str:
        template = _compile_template(self.chat_template(tools), self.template_source)
        try:
            return template.render(
                **variables, add_generation_prompt=add_generation_prompt, enable_thinking=thinking
            )
        except jinja2.TemplateError as error:
            raise ValueError(
                f"chat template of {self.template_source} rejected the conversation: {error}"
            ) from error

    def _mark_literals(self, text: str) -> str:
        """Wrap every control string in `text` in MARK_OPEN ... MARK_CLOSE."""
        _refuse_markers(text)
        if not self.control_tokens:
            return text
        return _control_pattern(tuple(self.control_tokens)).sub(
            lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, text
        )

    def _encode_marked(self, rendered: str) -> list[int]:
        """Encode a rendered chat: marked control strings as text, the template's control tokens as ids."""
        segments: list[str | int] = []  # text, or a control token id
        position = 0
        for match in self._marked.finditer(rendered):
            # A lone marker (the template cut a marked string) is dropped; it still separates the template
            # text on both sides, so the halves cannot join into a control token.
            self._split_controls(rendered[position : match.start()], segments)
            _append_text(segments, match.group(1) or "")
            position = match.end()
        self._split_controls(rendered[position:], segments)
        ids: list[int] = []
        for segment in segments:
            ids.extend([segment] if isinstance(segment, int) else self.encode(segment))
        return ids

    def _split_controls(self, text: str, segments: list[str | int]) -> None:
        """Append `text` to segments as plain-text pieces and the ids of the added tokens found in it."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        position = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._control_ids:
                _append_text(segments, text[position:start])
                segments.append(token_id)
                position = end
        _append_text(segments, text[position:])


class StreamDecoder:
    """Turns ids fed one at a time into the new text to print; never prints half of a multi-byte character."""

    def __init__(
        self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = False, context: Sequence[int] = ()
    ):
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=list(context) or None, skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is still unfinished)."""
        if int(token_id) < 0:
            raise ValueError(f"token ids must be non-negative, got {token_id}")
        text = self._stream.step(self._backend, int(token_id))
        if text is None:
            self._held.append(int(token_id))
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """End the stream: return the held-back ids' text (an unfinished character becomes U+FFFD, as in
        a full decode) and start afresh."""
        text = (
            self._backend.decode(self._held, skip_special_tokens=self._skip_special_tokens)
            if self._held
            else ""
        )
        self._held.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return text


# ----- loading -----


def _read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    """Load a tokenizer.json; a missing or malformed file names itself."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer.json not found")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({error})") from error


def _generation_eos_ids(path: Path, backend: tokenizers.Tokenizer) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list of ints), each a known token id."""
    value = _read_json(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    size = backend.get_vocab_size(with_added_tokens=True)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size for v in values):
        raise ValueError(f"{path}: 'eos_token_id' must be token ids below {size}, got {value!r}")
    return values


def _token_text(value: object, source: str, key: str) -> str:
    """A special token from tokenizer_config.json: a string or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{source}: {key!r} must be a string or a dict with 'content', got {value!r}")
    return value


def _named_templates(template: object, source: str) -> dict[str, str]:
    """{name: template}: a single one is "default"; a list of {"name", "template"} dicts keeps its names."""
    if template is None:
        return {}
    if isinstance(template, str):
        named = {"default": template}
    elif isinstance(template, list) and all(
        isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in template
    ):
        named = {t["name"]: t["template"] for t in template}
    else:
        raise ValueError(
            f"{source}: 'chat_template' must be a string or a list of {{'name', 'template'}} dicts"
        )
    for name, text in named.items():
        _compile_template(text, f"{source} (template {name!r})")  # fail at load time, not at the first chat
    return named


# ----- template data -----


def _prepare_messages(
    messages: object, wrap_for: Callable[[str], Callable[[str], str]]
) -> list[dict[str, Any]]:
    """Validate messages, drop None-valued keys and alias reasoning fields as transformers does."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] must be a dict with a string 'role', got {message!r:.100}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(_plain(message, f"messages[{index}]", wrap_for(message["role"])))
    return prepared


def _plain(value: Any, where: str, wrap: Callable[[str], str]) -> Any:
    """Rebuild `value` from str, int, float, bool, None, lists, tuples and dicts, passing every string
    (keys too) through `wrap`; anything else is a TypeError naming where it was found."""
    if value is None or type(value) in (bool, int, float):
        return value
    if isinstance(value, str):
        return wrap(str.__str__(value))
    if isinstance(value, int):  # subclasses such as IntEnum become plain ints
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {
            _plain(key, where, wrap): _plain(item, f"{where}[{key!r}]", wrap) for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{i}]", wrap) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot go into a chat template; use str, numbers, lists, dicts"
    )


def _refuse_markers(text: str) -> str:
    if MARK_OPEN in text or MARK_CLOSE in text:
        raise ValueError(
            f"{text[:60]!r} contains U+FDD0 or U+FDD1, noncharacters octlm reserves to mark literal text"
        )
    return text


def _append_text(segments: list[str | int], text: str) -> None:
    """Append text to segments, joining it to a text segment before it."""
    if not text:
        return
    if segments and isinstance(segments[-1], str):
        segments[-1] += text
    else:
        segments.append(text)


@lru_cache(maxsize=16)
def _control_pattern(controls: tuple[str, ...]) -> re.Pattern[str]:
    """Any control string, longest first so "<|im_end|>" wins over a shorter token it contains."""
    return re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))


@lru_cache(maxsize=16)
def _marked_pattern(controls: tuple[str, ...]) -> re.Pattern[str]:
    """A marked control string (its text in group 1), or a lone marker."""
    inner = _control_pattern(controls).pattern if controls else "(?!)"
    return re.compile(f"{MARK_OPEN}({inner}){MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}]")


# ----- Jinja2 sandbox, set up as transformers' apply_chat_template sets it up -----


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing underscore names so templates cannot reach its private attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, like jinja2's Namespace, so namespace(self=...) still works in templates
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore names on a namespace: {name!r}"
            )


class _DictMaker:
    """The template's `dict`: builds dicts without handing the template the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: json.dumps without Jinja's HTML escaping, non-ASCII kept unless asked.
    ensure_ascii is applied by hand so that octlm's markers stay raw; the output is otherwise identical."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    return NON_ASCII.sub(_json_escape, text) if ensure_ascii else text


def _json_escape(match: re.Match[str]) -> str:
    """The \\uXXXX escape of one character, as a surrogate pair above U+FFFF (as json.dumps writes it)."""
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _compile_template(source_text: str, origin: str) -> jinja2.Template:
    """Compile a chat template; errors name `origin` (the file) and the template line."""
    if MARK_OPEN in source_text or MARK_CLOSE in source_text:
        raise ValueError(f"{origin}: the chat template contains U+FDD0 or U+FDD1, which octlm reserves")
    try:
        return _sandboxed_template(source_text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"{origin}: chat template syntax error on line {error.lineno}: {error.message}"
        ) from error


@lru_cache(maxsize=8)
def _sandboxed_template(source_text: str) -> jinja2.Template:
    """Compile in the sandbox with transformers' settings, filters and globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictMaker(), namespace=_Namespace
    )
    return env.from_string(source_text)
