"""``--chat_template``: the tokenizer's own template (``auto``, ``always``, ``never``), a built-in by name or a Jinja
file.

A named or file template replaces ``tokenizer.chat_template`` before tokenisation, so the rows are rendered with it, the
generation metric prompts with it, and ``save_pretrained`` writes it next to the adapter and into every checkpoint
(``chat_template.jinja``): the model is served with the template it was trained on.

Every built-in is written for the loss masks of :mod:`hf_lisa.data.pipeline`, which render a conversation one message at a
time and need each rendering to be a prefix of the next ("incremental"):

* a message renders the same whatever follows it (no look-ahead: consecutive tool results are separate turns, a
  system prompt folded into the first user turn is written where it stands);
* the assistant's turn ends with its family's end marker, then the tokenizer's EOS token unless that marker *is* the
  EOS token. A base model whose tokenizer does not know ``<|im_end|>`` or ``<|eot_id|>`` as one token still learns to
  end its answers with a token that ``generate`` stops on.

``developer`` messages render as ``system``; ``tool`` messages as each family writes tool results (``ipython`` for
Llama 3, a ``<tool_response>`` user turn for Qwen 2.5, a user turn for Gemma).

Example:
    ```py
    >>> from hf_lisa.data.chat_templates import install_chat_template
    >>> install_chat_template(tokenizer, "chatml")  # doctest: +SKIP
    True
    ```
"""

from __future__ import annotations

import os
import re

from ..errors import UsageError

__all__ = ["BUILTIN_CHAT_TEMPLATES", "CHAT_TEMPLATE_MODES", "install_chat_template", "load_chat_template"]

CHAT_TEMPLATE_MODES = ("auto", "always", "never")
JINJA_SUFFIXES = (".jinja", ".jinja2", ".j2")
#: the largest template file read (the largest chat templates shipped with models are a few tens of KiB)
TEMPLATE_FILE_LIMIT = 2**20
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _eos_after(marker: str) -> str:
    """Jinja: the tokenizer's EOS token, unless the end marker just written is that token."""
    return "{%- if eos_token and eos_token != '" + marker + "' %}{{- eos_token }}{%- endif %}"


_SYSTEM = "('system', 'developer')"
_CHATML_TURNS = (
    "{%- for message in messages %}"
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{{- '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>' }}"
    "{%- if role == 'assistant' %}" + _eos_after("<|im_end|>") + "{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: name -> Jinja source. Names are matched ignoring case, ``-``, ``_`` and ``.`` (``Llama3``, ``qwen2.5``).
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    # <|im_start|>role\n...<|im_end|>\n (OpenAI ChatML; SmolLM2, Qwen, Hermes)
    "chatml": _CHATML_TURNS,
    # Llama 3 / 3.1 Instruct without the tool and date preamble: headers, <|eot_id|>
    "llama-3": (
        "{{- bos_token or '' }}"
        "{%- for message in messages %}"
        "{%- set role = message['role'] %}"
        "{%- set role = 'system' if role == 'developer' else ('ipython' if role == 'tool' else role) %}"
        "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{%- if role == 'assistant' %}" + _eos_after("<|eot_id|>") + "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    # Mistral v1 instruct: [INST] user [/INST] answer</s>; a system prompt opens the first [INST]
    "mistral": (
        "{{- bos_token or '' }}"
        "{%- for message in messages %}"
        "{%- if message['role'] in " + _SYSTEM + " %}{{- '[INST] ' + message['content'] + '\\n\\n' }}"
        "{%- elif message['role'] == 'user' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] not in " + _SYSTEM + " %}{{- '[INST] ' }}{%- endif %}"
        "{{- message['content'] + ' [/INST]' }}"
        "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + (eos_token or '') }}"
        "{%- else %}{{- '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
        "{%- endif %}"
        "{%- endfor %}"
    ),
    # Gemma 2/3: user and model turns; the system prompt opens the first user turn
    "gemma": (
        "{{- bos_token or '' }}"
        "{%- for message in messages %}"
        "{%- if message['role'] in " + _SYSTEM + " %}"
        "{{- '<start_of_turn>user\\n' + message['content'] + '\\n\\n' }}"
        "{%- else %}"
        "{%- if loop.first or message['role'] != 'user' or messages[loop.index0 - 1]['role'] not in " + _SYSTEM
        + " %}{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}{%- endif %}"
        "{{- message['content'] + '<end_of_turn>' }}"
        "{%- if message['role'] == 'assistant' %}" + _eos_after("<end_of_turn>") + "{%- endif %}"
        "{{- '\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
    ),
    # Phi-3 / 3.5: <|role|>\n...<|end|>\n
    "phi-3": (
        "{%- for message in messages %}"
        "{%- set role = 'system' if message['role'] == 'developer' else message['role'] %}"
        "{{- '<|' + role + '|>\\n' + message['content'] + '<|end|>' }}"
        "{%- if role == 'assistant' %}" + _eos_after("<|end|>") + "{%- endif %}"
        "{{- '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    ),
    # Qwen 2.5: ChatML with Qwen's default system prompt, tool results as <tool_response> user turns
    "qwen-2.5": (
        "{%- if not messages or messages[0]['role'] not in " + _SYSTEM + " %}"
        "{{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- set role = 'system' if message['role'] == 'developer' else message['role'] %}"
        "{%- if role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>' }}"
        "{%- else %}{{- '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>' }}{%- endif %}"
        "{%- if role == 'assistant' %}" + _eos_after("<|im_end|>") + "{%- endif %}"
        "{{- '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # Zephyr: <|role|>\n...</s>\n, every turn closed by the EOS token
    "zephyr": (
        "{%- for message in messages %}"
        "{%- set role = 'system' if message['role'] == 'developer' else message['role'] %}"
        "{{- '<|' + role + '|>\\n' + message['content'] + (eos_token or '') + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    ),
}


def _key(name: str) -> str:
    return re.sub(r"[-_.]", "", name.lower())


_BY_KEY = {_key(name): name for name in BUILTIN_CHAT_TEMPLATES}


def _allowed() -> str:
    return (f"allowed: {', '.join(CHAT_TEMPLATE_MODES)}, a built-in template ({', '.join(BUILTIN_CHAT_TEMPLATES)}) "
            f"or a Jinja file ({', '.join(JINJA_SUFFIXES)})")


def builtin_name(value: str) -> str | None:
    """The built-in ``value`` names (``"Llama3"`` -> ``"llama-3"``), or None."""
    return _BY_KEY.get(_key(value)) if isinstance(value, str) else None


def _parse_jinja(text: str, label: str) -> None:
    """Refuse ``text`` unless it parses as a chat template (the syntax ``transformers`` compiles templates with)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):  # transformers' {% generation %} block, parsed only
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters.setdefault("tojson", lambda value, **kwargs: value)  # transformers adds its own
    try:
        env.from_string(text)  # compiled, as transformers compiles it: an unknown filter or test is named now
    except jinja2.TemplateSyntaxError as err:  # TemplateAssertionError too
        raise UsageError(f"{label} is not a valid Jinja template: line {err.lineno}: "
                         f"{(err.message or '').rstrip('.')}.") from None
    if "messages" not in text:
        raise UsageError(f"{label} never reads `messages`, so it cannot render a conversation; expected a chat "
                         "template (Jinja), e.g. the `chat_template` of a tokenizer_config.json saved as a file.")


def _read_template_file(path: str, label: str) -> str:
    from .files import read_user_file

    if not os.path.exists(path):
        raise UsageError(f"{label}: no such file; {_allowed()}.")
    data = read_user_file(path, label, TEMPLATE_FILE_LIMIT, f"a Jinja file ({', '.join(JINJA_SUFFIXES)})")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"{label}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8; expected a UTF-8 Jinja "
                         "file.") from None
    if not text.strip():
        raise UsageError(f"{label} is empty; expected a chat template (Jinja).")
    return text


def load_chat_template(value: str) -> str | None:
    """The template ``--chat_template=value`` names: a built-in's source, a Jinja file's text, or None for the modes
    ``auto``, ``always`` and ``never`` (the tokenizer's own template, or none).

    A value that is neither a mode nor a built-in name is a file: one that exists, or has a path separator or a Jinja
    suffix (so ``./chatml`` reads a file called ``chatml``).

    Raises:
        UsageError: an unknown name (listing the built-ins), a missing, unreadable, empty or non-UTF-8 file, a file that
            is not valid Jinja or never reads ``messages``.
    """
    label = f"--chat_template={value!r}"
    if value in CHAT_TEMPLATE_MODES:
        return None
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{label} is invalid; {_allowed()}.")
    name = builtin_name(value)
    if name is not None:
        return BUILTIN_CHAT_TEMPLATES[name]
    looks_like_path = os.sep in value or "/" in value or value.lower().endswith(JINJA_SUFFIXES)
    if not looks_like_path and not os.path.exists(value):
        raise UsageError(f"{label} is not a known template; {_allowed()}.")
    key = _file_key(value)
    if key not in _FILE_TEMPLATES:  # read and checked once per process (the checks, then tokenisation)
        text = _read_template_file(value, label)
        _parse_jinja(text, label)
        _FILE_TEMPLATES[key] = text
    return _FILE_TEMPLATES[key]


#: template files read so far, by :func:`_file_key`: each is read once, however often its option is looked at
_FILE_TEMPLATES: dict[tuple, str] = {}


def _file_key(path: str) -> tuple:
    """The file ``path`` and its version (device, inode, size, modification time): a changed file is read again."""
    try:
        info = os.stat(path)
    except OSError:
        return (os.path.abspath(path),)
    return os.path.abspath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def install_chat_template(tokenizer, value: str) -> bool:
    """Set ``tokenizer.chat_template`` to the template ``value`` names; False (and nothing changed) for a mode."""
    template = load_chat_template(value)
    if template is None:
        return False
    tokenizer.chat_template = template
    return True
