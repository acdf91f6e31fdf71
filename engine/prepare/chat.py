"""Chat and prompt/completion records, rendered with the tokenizer's own chat template.

Rendering mirrors transformers' `apply_chat_template(..., tokenize=False)` byte for byte (the
same sandboxed Jinja environment, globals, filters and variables) without importing transformers:
this runs inside `tpud prepare`'s tokenizer worker processes, which receive a pickled Template.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from engine.files import Refused, read_regular_file

# Templates are a few KB; tokenizer_config.json can carry a large added_tokens_decoder.
TEMPLATE_LIMIT = 1 << 20
CONFIG_LIMIT = 64 << 20

# A template is a program from a model repository: one that loops for ever (nested ranges) must
# fail its record, not stall `tpud prepare`. Real templates render a conversation in milliseconds.
RENDER_SECONDS = 10.0

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool"}
TRAIN_ON = ("assistant", "all", "last")
FORMATS = ("chat", "prompt-completion")

# Names a message's reasoning may come under; transformers copies it to `thinking` and `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """A bad template or conversation; str() is a reason a user can act on (the caller prefixes FILE:LINE)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask tag. Templates that use it
    must compile here too; the body renders unchanged (masks come from trained_spans, not from this tag)."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, as transformers builds it, so that scoping inside the tag is the same.
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Overran(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _Overran in the block after `seconds` (a timer signal: only the main thread gets one,
    which is where tokenizer processes and a one-process prepare render)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Overran

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' and sorts keys; transformers' does neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """`dict` as templates see it: callable, but with no attributes to reach Python internals through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, which could otherwise shadow its internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot start with '_': {name!r}")


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Templates come from model repositories and are untrusted: the immutable sandbox, as in transformers.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Cached per process and keyed by source, so a Template stays plain data that pickles to workers.
    return _environment().from_string(source)


def _template_line(error: BaseException) -> str:
    # Jinja rewrites tracebacks so that template frames carry the template's own line numbers.
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == "<template>"]
    return f" (template line {lines[-1]})" if lines else ""


def _read_text(path: str, limit: int) -> str:
    try:
        data = read_regular_file(path, limit)
    except Refused as e:
        raise ChatError(f"{path}: {e}") from None
    except OSError as e:
        raise ChatError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChatError(f"{path}: not UTF-8 text (byte {e.start})") from None
    # transformers reads template files in text mode, which turns every \r\n and \r into \n.
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _special_tokens(config: dict[str, Any], path: str) -> dict[str, str]:
    special: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # the serialized AddedToken form
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ChatError(f"{path}: {name} is not a string or an object with a string \"content\"")
        special[name] = value
    return special


@dataclass(frozen=True)
class Template:
    source: str
    origin: str
    special: dict[str, str]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    @classmethod
    def load(cls, tokenizer: str, override: str | None = None) -> Template:
        """The chat template for the tokenizer at `tokenizer` (a tokenizer.json or its directory).

        `override` (--chat-template PATH) wins; else chat_template.jinja beside the tokenizer, else
        "chat_template" in tokenizer_config.json: transformers' own order, where the .jinja file
        takes priority over the config entry. Special tokens always come from tokenizer_config.json.
        """
        directory = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer) or "."
        config_path = os.path.join(directory, "tokenizer_config.json")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        config: dict[str, Any] = {}
        if os.path.lexists(config_path):
            try:
                loaded = json.loads(_read_text(config_path, CONFIG_LIMIT))
            except json.JSONDecodeError as e:
                raise ChatError(f"{config_path}: not valid JSON: line {e.lineno}: {e.msg}") from None
            if not isinstance(loaded, dict):
                raise ChatError(f"{config_path}: not a JSON object")
            config = loaded
        special = _special_tokens(config, config_path)

        if override is not None:
            source, origin = _read_text(override, TEMPLATE_LIMIT), override
        elif os.path.lexists(jinja_path):
            source, origin = _read_text(jinja_path, TEMPLATE_LIMIT), jinja_path
        elif config.get("chat_template") is not None:
            source, origin = _from_config(config["chat_template"], config_path), \
                f"{config_path} (chat_template in tokenizer_config.json)"
        else:
            raise ChatError(f"no chat template for the tokenizer: looked for {jinja_path} and for \"chat_template\" "
                            f"in {config_path}; give one with --chat-template PATH")
        try:
            _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatError(f"{origin}: the chat template does not compile: line {e.lineno}: {e.message}") from None
        return cls(source=source, origin=origin, special=special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """What transformers' apply_chat_template(messages, tokenize=False, add_generation_prompt=...) renders
        for a tokenizer with this template and these special tokens."""
        chat = []
        for message in messages:
            # transformers drops None-valued keys (templates test for presence) and aliases reasoning fields.
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        try:
            with _time_limit(RENDER_SECONDS):
                return _compile(self.source).render(messages=chat, tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt, **self.special)
        except _Overran:
            raise ChatError(f"the chat template ({self.origin}) took more than {RENDER_SECONDS:g} s to render "
                            f"this conversation") from None
        except jinja2.TemplateSyntaxError as e:
            raise ChatError(f"{self.origin}: the chat template does not compile: line {e.lineno}: {e.message}") \
                from None
        except Exception as e:  # a template is a program: any failure of it is this record's failure
            reason = e.message if isinstance(e, jinja2.TemplateError) and e.message else f"{type(e).__name__}: {e}"
            raise ChatError(f"the chat template ({self.origin}) failed{_template_line(e)}: {reason}") from None


def _from_config(value: object, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        names = ", ".join(sorted(str(n) for n in named))
        raise ChatError(f"{path}: chat_template lists templates ({names}) but none named \"default\"; "
                        f"give one with --chat-template PATH")
    raise ChatError(f"{path}: chat_template is neither a string nor a list of {{\"name\", \"template\"}}")


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _messages(items: object, label: str, field: str) -> list[dict[str, str]]:
    """Validated {role, content} messages from a JSON array; `label` names a message in reasons."""
    if not isinstance(items, list):
        raise ChatError(f"\"{field}\" is {_json_type(items)}, not an array of messages")
    if not items:
        raise ChatError(f"\"{field}\" is empty")
    return [_strings(item, f"{label} {n}", "role", "content") for n, item in enumerate(items, 1)]


def _strings(item: object, name: str, *keys: str) -> dict[str, str]:
    """`item`'s `keys`, checked to be an object's string fields; `name` names it in reasons."""
    if not isinstance(item, dict):
        raise ChatError(f"{name}: {_json_type(item)}, not an object")
    for key in keys:
        if key not in item:
            raise ChatError(f"{name}: no \"{key}\"")
        if not isinstance(item[key], str):
            raise ChatError(f"{name}: {key} is not a string ({_json_type(item[key])})")
    return {key: item[key] for key in keys}


def _sharegpt(items: object) -> list[dict[str, str]]:
    if not isinstance(items, list):
        raise ChatError(f"\"conversations\" is {_json_type(items)}, not an array of messages")
    converted: list[object] = []
    for n, raw in enumerate(items, 1):
        item = _strings(raw, f"message {n}", "from", "value")
        if item["from"] not in SHAREGPT_ROLES:
            raise ChatError(f"message {n}: unknown ShareGPT role {item['from']!r} "
                            f"(known: {', '.join(SHAREGPT_ROLES)})")
        converted.append({"role": SHAREGPT_ROLES[item["from"]], "content": item["value"]})
    return _messages(converted, "message", "conversations")


def conversation(record: object, fmt: str) -> list[dict[str, str]]:
    """A record as {role, content} messages; reasons number messages from 1."""
    if fmt not in FORMATS:
        raise ChatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if not isinstance(record, dict):
        raise ChatError(f"the record is {_json_type(record)}, not an object")
    if fmt == "chat":
        if "messages" in record:
            messages = _messages(record["messages"], "message", "messages")
        elif "conversations" in record:
            messages = _sharegpt(record["conversations"])
        else:
            raise ChatError("neither a \"messages\" nor a \"conversations\" field")
    else:
        for key in ("prompt", "completion"):
            if key not in record:
                raise ChatError(f"no \"{key}\" field")
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            # TRL's conversational form: the prompt's messages, then the assistant's.
            answer = _messages(completion, "completion message", "completion")
            for n, message in enumerate(answer, 1):
                if message["role"] != "assistant":
                    raise ChatError(f"completion message {n}: role is {message['role']!r}, not 'assistant'")
            messages = _messages(prompt, "prompt message", "prompt") + answer
        else:
            raise ChatError(f"\"prompt\" is {_json_type(prompt)} and \"completion\" is {_json_type(completion)}: "
                            "both must be strings or both arrays of messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("no assistant message: nothing to train on")
    return messages


def trained_spans(template: Template, messages: list[dict[str, Any]], train_on: str,
                  limit: int | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of it whose tokens are trained;
    with `limit`, only those of the turns that begin before that many characters (the rest cannot
    be kept in a window: each turn renders the conversation before it again, so a conversation
    of thousands of turns would otherwise cost time quadratic in its length).

    An assistant message's span runs from the end of the conversation before it rendered with the
    generation prompt to the end of the conversation up to it: its content and whatever the template
    closes the turn with. That holds only where a template renders a conversation's beginning the
    same whatever follows it (is prefix-stable), so every rendering used is checked to be a prefix.
    """
    if train_on not in TRAIN_ON:
        raise ChatError(f"unknown --train-on {train_on!r} (known: {', '.join(TRAIN_ON)})")
    text = template.render(messages)
    if train_on == "all":
        return text, [(0, len(text))]
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if train_on == "last":
        indices = indices[-1:]
    spans = []
    for i in indices:
        before = template.render(messages[:i], add_generation_prompt=True)
        if limit is not None and len(before) >= limit:
            break
        through = template.render(messages[:i + 1])
        if not through.startswith(before):
            broken = "the conversation before it, rendered with the generation prompt, is not a prefix of it"
        elif not text.startswith(through):
            broken = "the conversation up to it is rendered differently once later messages follow"
        else:
            spans.append((len(before), len(through)))
            continue
        other = "all" if train_on == "last" else "last or all"
        raise ChatError(f"message {i + 1}: the chat template ({template.origin}) is not prefix-stable ({broken}), "
                        f"so the trained tokens cannot be derived; use --train-on {other}")
    return text, spans
