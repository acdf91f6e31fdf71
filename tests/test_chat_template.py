"""engine.prepare.chat: templates render as transformers renders them; records become messages; trained spans."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.prepare.chat import ChatError, Template, conversation, trained_spans

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML = """{%- if not messages or messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Exercises what differs from plain Jinja: tojson without HTML escaping, raise_exception, loop controls,
# namespace, the generation tag, and trim_blocks/lstrip_blocks on un-dashed tags.
FEATURES = """{% set ns = namespace(n=0) %}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('Unknown role: ' + message['role']) }}
  {% endif %}
  {% if message['content'] == 'STOP' %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if message['role'] == 'assistant' %}
{% generation %}{{ message | tojson }}{% endgeneration %}
  {% else %}
{{ message | tojson(indent=2) }}
  {% endif %}
{% endfor %}
count={{ ns.n }} eos={{ eos_token }}
"""

LLAMA_SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
CHATML_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "  Grüße, 世界 🌍 <b>&'\"  \n"}, {"role": "assistant", "content": "ça va? ✓\r\n"}],
    [{"role": "user", "content": "{{ bos_token }} {% if x %}{# c #}{% endif %} {{'{{'}}"},
     {"role": "assistant", "content": "{% raw %}not a tag{% endraw %} }}"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "\n\nleading newlines"}],
]


def _tokenizer(special: dict[str, str], template: str) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(special.values())}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tok.chat_template = template
    return tok


def _saved(tmp_path: Path, special: dict[str, str], template: str) -> tuple[Path, PreTrainedTokenizerFast]:
    """A tokenizer directory as transformers writes it, and the tokenizer transformers loads back from it."""
    directory = tmp_path / "tok"
    _tokenizer(special, template).save_pretrained(directory)
    return directory, PreTrainedTokenizerFast.from_pretrained(directory)


@pytest.mark.parametrize("template, special", [(LLAMA3, LLAMA_SPECIAL), (CHATML, CHATML_SPECIAL)],
                         ids=["llama3", "chatml"])
def test_render_equals_transformers(tmp_path: Path, template: str, special: dict[str, str]) -> None:
    directory, tok = _saved(tmp_path, special, template)
    loaded = Template.load(str(directory / "tokenizer.json"))
    assert loaded.source == template and loaded.special == special
    for messages in CONVERSATIONS:
        for gp in (False, True):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gp)
            assert loaded.render(messages, add_generation_prompt=gp) == expected
    if template is LLAMA3:
        assert loaded.render(CONVERSATIONS[0]).count("<|begin_of_text|>") == 1


def test_features_template_equals_transformers(tmp_path: Path) -> None:
    directory, tok = _saved(tmp_path, {"eos_token": "</s>"}, FEATURES)
    loaded = Template.load(str(directory))
    for messages in [*CONVERSATIONS, [{"role": "user", "content": "a"}, {"role": "user", "content": "STOP"},
                                      {"role": "assistant", "content": "never"}],
                     # transformers drops None-valued keys and copies reasoning to `thinking`/`reasoning_content`
                     [{"role": "user", "content": "q", "name": None},
                      {"role": "assistant", "content": "a", "reasoning": "hmm"}]]:
        expected = tok.apply_chat_template(messages, tokenize=False)
        assert loaded.render(messages) == expected
    # Jinja's own tojson would escape these; transformers' does not.
    assert '世界 🌍 <b>&\'\\"' in loaded.render(CONVERSATIONS[2])

    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatError, match=r"failed \(template line 4\): Unknown role: tool"):
        loaded.render(bad)


def test_tokenizer_config_forms_match_transformers(tmp_path: Path) -> None:
    """chat_template in tokenizer_config.json (string and named list), AddedToken dict special tokens,
    and chat_template.jinja winning over the config entry, as transformers loads them."""
    directory, _ = _saved(tmp_path, LLAMA_SPECIAL, LLAMA3)
    (directory / "chat_template.jinja").unlink()
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
                           "normalized": False, "rstrip": False, "single_word": False, "special": True}
    messages = CONVERSATIONS[1]
    for form in (CHATML, [{"name": "tool_use", "template": LLAMA3}, {"name": "default", "template": CHATML}]):
        config["chat_template"] = form
        config_path.write_text(json.dumps(config))
        loaded = Template.load(str(directory))
        assert loaded.source == CHATML
        assert loaded.origin.endswith("(chat_template in tokenizer_config.json)")
        assert loaded.special["bos_token"] == "<|begin_of_text|>"
        tok = PreTrainedTokenizerFast.from_pretrained(directory)
        assert loaded.render(messages, True) == tok.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)
    (directory / "chat_template.jinja").write_text(LLAMA3.replace("\n", "\r\n"))
    loaded = Template.load(str(directory))
    assert loaded.source == LLAMA3 and loaded.origin == str(directory / "chat_template.jinja")
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    assert loaded.render(messages) == tok.apply_chat_template(messages, tokenize=False)


def test_override_wins_and_template_pickles(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path, LLAMA_SPECIAL, LLAMA3)
    override = tmp_path / "mine.jinja"
    override.write_text(CHATML)
    loaded = Template.load(str(directory), override=str(override))
    assert (loaded.source, loaded.origin) == (CHATML, str(override))
    assert loaded.special == LLAMA_SPECIAL
    assert loaded.sha256 != Template.load(str(directory)).sha256
    loaded.render(CONVERSATIONS[0])  # compiled and cached: the copy must still pickle and render the same
    copy = pickle.loads(pickle.dumps(loaded))
    assert copy == loaded and copy.render(CONVERSATIONS[1]) == loaded.render(CONVERSATIONS[1])


def test_load_failures(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path, LLAMA_SPECIAL, LLAMA3)
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(ChatError) as e:
        Template.load(str(directory / "tokenizer.json"))
    assert str(directory / "chat_template.jinja") in str(e.value)
    assert str(directory / "tokenizer_config.json") in str(e.value) and "--chat-template PATH" in str(e.value)

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ChatError, match=rf"{fifo}: a FIFO"):
        Template.load(str(directory), override=str(fifo))
    with pytest.raises(ChatError, match=rf"{tmp_path}: a directory"):
        Template.load(str(directory), override=str(tmp_path))
    with pytest.raises(ChatError, match=rf"{tmp_path / 'absent'}: cannot read"):
        Template.load(str(directory), override=str(tmp_path / "absent"))

    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ bos_token }}\n{% for m in messages %}\n{{ m.content }\n{% endfor %}\n")
    with pytest.raises(ChatError, match=rf"{broken}: the chat template does not compile: line 3: "):
        Template.load(str(directory), override=str(broken))

    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": LLAMA3}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatError, match=r"\(tool_use\) but none named \"default\""):
        Template.load(str(directory))


def test_formats_give_equal_conversations() -> None:
    expected = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}]
    chat = {"messages": [{**m, "extra": 1} for m in expected]}
    sharegpt = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                  {"from": "gpt", "value": "A"}]}
    trl = {"prompt": expected[:2], "completion": expected[2:]}
    assert conversation(chat, "chat") == conversation(sharegpt, "chat") == expected
    assert conversation(trl, "prompt-completion") == expected
    assert conversation({"prompt": "Q", "completion": "A"}, "prompt-completion") == expected[1:]


@pytest.mark.parametrize("record, fmt, reason", [
    ([], "chat", "the record is an array, not an object"),
    ({"text": "x"}, "chat", 'neither a "messages" nor a "conversations" field'),
    ({"messages": {}}, "chat", '"messages" is an object, not an array of messages'),
    ({"messages": []}, "chat", '"messages" is empty'),
    ({"messages": [{"role": "user", "content": "q"}, "hi"]}, "chat", "message 2: a string, not an object"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}, "chat", 'message 2: no "content"'),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": None}]}, "chat", "message 3: content is not a string (null)"),
    ({"messages": [{"role": 1, "content": "q"}]}, "chat", "message 1: role is not a string (a number)"),
    ({"messages": [{"role": "user", "content": "q"}]}, "chat", "no assistant message"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}, "chat",
     "message 2: unknown ShareGPT role 'bot'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "chat", "message 1: value is not a string (a number)"),
    ({"prompt": "q"}, "prompt-completion", 'no "completion" field'),
    ({"prompt": "q", "completion": ["a"]}, "prompt-completion",
     '"prompt" is a string and "completion" is an array: both must be strings or both arrays'),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
     "prompt-completion", "completion message 1: role is 'user', not 'assistant'"),
    ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "a"}]},
     "prompt-completion", 'prompt message 1: no "content"'),
    ({"prompt": "q", "completion": "a"}, "text", "unknown format 'text'"),
])
def test_malformed_records(record: object, fmt: str, reason: str) -> None:
    with pytest.raises(ChatError) as e:
        conversation(record, fmt)
    assert str(e.value).startswith(reason)


@pytest.mark.parametrize("source, special, closer", [(LLAMA3, LLAMA_SPECIAL, "<|eot_id|>"),
                                                      (CHATML, CHATML_SPECIAL, "<|im_end|>\n")],
                         ids=["llama3", "chatml"])
def test_trained_spans(source: str, special: dict[str, str], closer: str) -> None:
    template = Template(source=source, origin="test", special=special)
    messages = CONVERSATIONS[1]
    text, spans = trained_spans(template, messages, "assistant")
    assert text == template.render(messages)
    assert [text[s:e] for s, e in spans] == ["4" + closer, "6" + closer]
    assert trained_spans(template, messages, "last") == (text, spans[-1:])
    assert trained_spans(template, messages, "all") == (text, [(0, len(text))])
    # A conversation that opens with the assistant: its span starts after the template's preamble.
    text, spans = trained_spans(template, [{"role": "assistant", "content": "first"}], "assistant")
    assert len(spans) == 1 and text[spans[0][0]:].startswith("first") and spans[0][1] == len(text)


def test_non_prefix_stable_template_is_refused() -> None:
    # Earlier assistant turns are rendered without their content once a later turn exists,
    # as templates that drop earlier reasoning do.
    source = ("{% for m in messages %}<|{{ m.role }}|>"
              "{% if m.role == 'assistant' and not loop.last %}[earlier]{% else %}{{ m.content }}{% endif %}<|end|>"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    template = Template(source=source, origin="drop.jinja", special={})
    messages = CONVERSATIONS[1]
    with pytest.raises(ChatError, match=r"message 3: the chat template \(drop.jinja\) is not prefix-stable"):
        trained_spans(template, messages, "assistant")
    # Only the last turn's rendering matters for "last", and that one is stable.
    text, spans = trained_spans(template, messages, "last")
    assert [text[s:e] for s, e in spans] == ["6<|end|>"]
    with pytest.raises(ChatError, match="unknown --train-on 'every'"):
        trained_spans(template, messages, "every")
