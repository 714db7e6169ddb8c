"""What ``hf-lisa chat`` and ``hf-lisa generate`` share: the model they talk to, loaded from ``MODEL`` or
``--base``/``--adapter``, its prompts rendered as training rendered them, and batched greedy or sampled generation.

``MODEL`` is an ``hf-lisa train`` output folder, any adapter folder (LISA in every form, LoRA, DoRA: PEFT knows LISA
once ``hf_lisa`` is imported), a model folder with merged or full weights, or a Hub id of an adapter or a model. An
adapter's base is ``--base`` when given, else the folder its ``adapter_config.json`` records, else the model its
``training_summary.json`` says the run loaded (the embedded SmolLM2 when the run named none). Loading goes through
:func:`hf_lisa.hub.load.from_pretrained` (safetensors only), the tokenizer through
:func:`hf_lisa.export.common.load_tokenizer` (the adapter's folder first, then its base).

Prompts go through the tokenizer's chat template as ``hf-lisa train --chat_template auto`` renders them (a user turn,
then the assistant's header), or are tokenised as raw text with ``--chat_template never`` (a base model); ``auto``
follows a run that trained with ``never``. The file side of ``hf-lisa generate`` (reading prompts, writing JSONL) is
:mod:`hf_lisa.generate_file`; the REPL is :mod:`hf_lisa.chat`.

Building the parser imports nothing heavy; torch and transformers load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from .errors import UsageError

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_NEW_TOKENS = 256

#: a prompt: raw text (no chat template) or a conversation (a list of ``{"role", "content"}`` messages)
Prompt = Union[str, list]


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """``--name_with_underscores`` and its ``--name-with-hyphens`` spelling, as ``hf-lisa export`` takes them."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, **kwargs)


def add_model_arguments(parser: argparse.ArgumentParser, temperature: float, top_p: Optional[float]) -> None:
    """The options of ``chat`` and ``generate`` that choose the model and how it decodes; ``temperature`` and
    ``top_p`` are the command's defaults."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="an hf-lisa train output folder, an adapter folder (LISA, LoRA, DoRA), a model folder "
                        "(merged or full weights), or a Hub id of an adapter or a model")
    _flag(parser, "base", default=None, metavar="BASE",
          help="the adapter's base model (folder or Hub id) instead of the one the adapter records")
    _flag(parser, "adapter", default=None, metavar="ADAPTER",
          help="an adapter (folder or Hub id) to load onto --base (or onto MODEL, then the base)")
    _flag(parser, "device", choices=DEVICES, default="auto", help="where the model runs (default auto: cuda when "
          "available, else cpu)")
    _flag(parser, "torch_dtype", choices=DTYPES, default="auto",
          help="dtype of the weights (default auto: the dtype they were saved in)")
    _flag(parser, "max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
          help=f"most tokens generated per reply (default {DEFAULT_MAX_NEW_TOKENS})")
    _flag(parser, "temperature", type=float, default=temperature,
          help=f"sampling temperature; 0 decodes greedily (default {temperature:g})")
    _flag(parser, "top_p", type=float, default=None,
          help="nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1]; needs "
          f"--temperature > 0 (default {'1 when sampling' if top_p is None else f'{top_p:g}'})")
    _flag(parser, "seed", type=int, default=None, help="seed of the sampling, for reproducible replies")
    _flag(parser, "system", default=None, metavar="TEXT",
          help="a system prompt put before each conversation (one that has its own system message keeps it)")
    _flag(parser, "chat_template", default="auto", metavar="MODE_OR_FILE",
          help="'auto' (the tokenizer's chat template when it has one, unless the run trained with 'never'), "
          "'always' (the tokenizer's; refused when it has none), 'never' (raw prompts, e.g. on a base model), or a "
          "built-in by name (chatml, llama-3, ...; see docs/data.md) or a Jinja file, replacing the tokenizer's")
    parser.set_defaults(default_top_p=top_p)


@dataclass
class GenerationSettings:
    """How replies are decoded: ``temperature`` 0 is greedy (``top_p`` then unused), above 0 sampling. ``seed`` is set
    at the start of each :meth:`LoadedModel.generate` call (by the commands: once, before the first reply)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GenerationSettings":
        """The settings of parsed ``chat``/``generate`` arguments, checked.

        Raises:
            UsageError: a value out of range, or ``--top_p`` with greedy decoding (it could not take effect).
        """
        if args.max_new_tokens < 1:
            raise UsageError(f"--max_new_tokens={args.max_new_tokens} must be at least 1.")
        if args.temperature < 0:
            raise UsageError(f"--temperature={args.temperature:g} must be 0 (greedy) or above (sampling).")
        if args.top_p is not None and not 0 < args.top_p <= 1:
            raise UsageError(f"--top_p={args.top_p:g} must be in (0, 1].")
        if args.top_p is not None and args.temperature == 0:
            raise UsageError(f"--top_p={args.top_p:g} applies to sampling, but --temperature 0 decodes greedily; "
                             "pass --temperature above 0 as well, or drop --top_p.")
        if args.seed is not None and args.temperature == 0:
            logger.warning("--seed %d has no effect: --temperature 0 decodes greedily (the same reply every time).",
                           args.seed)
        top_p = args.top_p if args.top_p is not None else args.default_top_p
        return cls(args.max_new_tokens, args.temperature, 1.0 if top_p is None else top_p, args.seed)

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


# ----------------------------------------------------------------------------------------------------------------------
# Which model: MODEL, --base, --adapter (no torch here: checked before anything loads)
# ----------------------------------------------------------------------------------------------------------------------
ADAPTER_CONFIG_NAME, MODEL_CONFIG_NAME, SUMMARY_NAME = "adapter_config.json", "config.json", "training_summary.json"


@dataclass
class Sources:
    """What to load: ``model`` (a full model) or ``adapter`` with its ``base`` (``None``: the adapter's recorded
    one, read from the Hub when it loads)."""

    model: Optional[str] = None
    adapter: Optional[str] = None
    base: Optional[str] = None
    recorded: bool = False  # ``base`` is what the adapter's adapter_config.json records (errors name that file)

    def describe(self) -> str:
        return self.model if self.adapter is None else f"{self.adapter} on {self.base or 'its recorded base'}"


def check_source(value: str, option: str) -> str:
    """``"local"`` for an existing folder, ``"hub"`` for a Hub id ('name' or 'namespace/name').

    Raises:
        UsageError: a file, or a path that does not exist and is no Hub id.
    """
    if os.path.isdir(value):
        return "local"
    if os.path.exists(value):
        raise UsageError(f"{option}={value!r} is a file; pass a folder (a model or an adapter) or a Hub id.")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        raise UsageError(f"{option}={value!r} does not exist: no such folder, and not a Hub id ('name' or "
                         "'namespace/name').") from None
    from .generate_guards import check_not_meant_locally

    check_not_meant_locally(value, option)
    return "hub"


def _folder_kind(folder: str, option: str) -> str:
    """``"adapter"`` or ``"model"``; refuses a folder that is neither, naming the checkpoints it holds, if any."""
    if os.path.isfile(os.path.join(folder, ADAPTER_CONFIG_NAME)):
        return "adapter"
    if os.path.isfile(os.path.join(folder, MODEL_CONFIG_NAME)):
        return "model"
    checkpoints = sorted((n for n in os.listdir(folder) if n.startswith("checkpoint-")),
                         key=lambda n: int(n.split("-")[-1]) if n.split("-")[-1].isdigit() else -1)
    hint = (f" It holds checkpoints: pass one, e.g. {os.path.join(folder, checkpoints[-1])!r}." if checkpoints else
            " Pass an hf-lisa train output folder, a model folder or an adapter folder.")
    raise UsageError(f"{option}={folder!r} holds neither {ADAPTER_CONFIG_NAME} (an adapter) nor {MODEL_CONFIG_NAME} "
                     f"(a model).{hint}")


def _read_json(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:
        raise UsageError(f"{path!r} is not valid JSON ({exc}).") from None
    return data if isinstance(data, dict) else {}


def recorded_run(folder: Optional[str]) -> dict:
    """The ``arguments`` of the ``training_summary.json`` in ``folder`` (``{}`` for none, or a Hub id)."""
    if not folder or not os.path.isdir(folder):
        return {}
    arguments = _read_json(folder, SUMMARY_NAME).get("arguments")
    return arguments if isinstance(arguments, dict) else {}


def find_base(adapter_dir: str) -> str:
    """The base model of a local adapter: the folder or Hub id its ``adapter_config.json`` records (a relative path
    from the adapter's folder, never from the current directory), else what its ``training_summary.json`` says the run
    loaded (the embedded SmolLM2 when the run named no model).

    Raises:
        UsageError: neither names a base that exists here, naming the adapter's config file, what it records and
            ``--base``.
    """
    from .hub.load import recorded_base

    config_file = os.path.join(adapter_dir, ADAPTER_CONFIG_NAME)
    recorded = _read_json(adapter_dir, ADAPTER_CONFIG_NAME).get("base_model_name_or_path")
    base, why = recorded_base(recorded, adapter_dir) if recorded is not None else (None, "")
    if base is not None:
        return base
    model = recorded_run(adapter_dir).get("model")
    if isinstance(model, dict) and "model_name_or_path" in model:
        loaded = model["model_name_or_path"]
        if loaded is None:  # the run trained the embedded default model
            from .models import default_model_path

            return default_model_path()
        loaded, _ = recorded_base(loaded, adapter_dir)
        if loaded is not None and os.path.isdir(loaded):
            return loaded
    found = (f"records base_model_name_or_path={recorded!r}, {why} ({config_file!r})" if recorded is not None else
             f"records no base_model_name_or_path ({config_file!r})")
    raise UsageError(f"the adapter {adapter_dir!r} {found}, and no {SUMMARY_NAME} beside it names one that is; pass "
                     "--base BASE (the folder or Hub id of the model it was trained on).")


def _recorded_sources(adapter: str) -> Sources:
    from .hub.load import recorded_base

    base = find_base(adapter)
    recorded = _read_json(adapter, ADAPTER_CONFIG_NAME).get("base_model_name_or_path")
    return Sources(adapter=adapter, base=base, recorded=recorded_base(recorded, adapter)[0] == base)


def resolve_sources(model: Optional[str], base: Optional[str], adapter: Optional[str]) -> Sources:
    """What ``MODEL`` / ``--base`` / ``--adapter`` ask to load, checked without loading anything.

    ``--adapter`` loads onto ``--base``, else onto ``MODEL``, else onto the base it records. ``MODEL`` alone is an
    adapter (its base found by :func:`find_base` unless ``--base`` is given) or a full model.

    Raises:
        UsageError: no model named, two bases named, ``--base`` with a full model, a folder that is neither model
            nor adapter, a missing path, an adapter whose base cannot be found.
    """
    if model is None and adapter is None:
        raise UsageError("name the model: MODEL (a folder or Hub id), or --adapter ADAPTER [--base BASE].")
    if adapter is not None and model is not None and base is not None:
        raise UsageError(f"MODEL={model!r} and --base={base!r} both name the base of --adapter={adapter!r}; pass one.")
    if adapter is not None:
        base_option, base = ("--base", base) if base is not None else ("MODEL", model)
        for value, option, kind in ((adapter, "--adapter", "adapter"), (base, base_option, "model")):
            if value is not None and check_source(value, option) == "local" and _folder_kind(value, option) != kind:
                what = "a model (config.json), not an adapter" if kind == "adapter" else "an adapter, not a model"
                raise UsageError(f"{option}={value!r} is {what}.")
        if base is None and os.path.isdir(adapter):
            return _recorded_sources(adapter)
        return Sources(adapter=adapter, base=base)
    if check_source(model, "MODEL") == "hub":
        return Sources(adapter=model, base=base) if base is not None else Sources(model=model)
    if _folder_kind(model, "MODEL") == "adapter":
        if base is not None:
            check_source(base, "--base")
            return Sources(adapter=model, base=base)
        return _recorded_sources(model)
    if base is not None:
        raise UsageError(f"--base={base!r} applies to an adapter, but MODEL={model!r} is a full model "
                         f"({MODEL_CONFIG_NAME}, no {ADAPTER_CONFIG_NAME}); drop --base.")
    return Sources(model=model)


# ----------------------------------------------------------------------------------------------------------------------
# The loaded model
# ----------------------------------------------------------------------------------------------------------------------
def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"``; ``auto`` picks CUDA when torch sees a GPU.

    Raises:
        UsageError: ``cuda`` without a GPU.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device=cuda but torch sees no CUDA GPU; pass --device cpu (or auto).")
    return device


def use_chat_template(tokenizer, choice: str, recorded: Optional[str] = None) -> bool:
    """Whether prompts go through ``tokenizer``'s chat template, for ``--chat_template`` ``choice``: ``auto``,
    ``always``, ``never``, or a built-in name or Jinja file (:mod:`hf_lisa.data.chat_templates`, installed as the
    tokenizer's template, as ``hf-lisa train`` does). ``recorded`` is the mode the run trained with: ``auto`` follows
    a run that trained with ``never``.

    Raises:
        UsageError: ``always`` with a tokenizer that has none; an unknown name or a bad file.
    """
    from .data.chat_templates import install_chat_template

    if install_chat_template(tokenizer, choice):
        return True
    has = getattr(tokenizer, "chat_template", None) is not None
    if choice == "auto":
        if recorded == "never":
            logger.info("--chat_template auto: the run trained with --chat_template never, so prompts are raw text.")
            return False
        return has
    if choice == "always" and not has:
        raise UsageError("--chat_template=always but the tokenizer has no chat template; pass a built-in name or a "
                         "Jinja file, or --chat_template never for raw prompts.")
    return choice == "always"


class LoadedModel:
    """A model ready to generate: the (PEFT) model in eval mode, its tokenizer (left padding), and whether prompts
    go through the chat template.

    Example:
        ```py
        >>> from hf_lisa.generate import GenerationSettings, load_model
        >>> loaded = load_model("outputs")  # doctest: +SKIP
        >>> loaded.generate(["What is 2 + 3?"], GenerationSettings(max_new_tokens=16))  # doctest: +SKIP
        ['2 + 3 = 5.']
        ```
    """

    def __init__(self, model, tokenizer, chat: bool, system: Optional[str] = None, description: str = "",
                 template: str = "the tokenizer's chat template", folders: Sequence[tuple] = ()) -> None:
        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.system, self.description = system, description
        self.template = template  # which chat template renders prompts, and where it came from (for messages)
        self.folders = list(folders)  # ``(what, folder or Hub id)`` of everything loaded: never an output
        self.own_system = 0  # conversations whose own system message was kept instead of ``system``

    @property
    def device(self):
        return next(self.model.parameters()).device

    def conversation(self, prompt: Prompt) -> list:
        """``prompt`` as messages: a user turn for text, with the ``system`` prompt first unless it has its own."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system is not None:
            if messages and messages[0].get("role") == "system":
                self.own_system += 1
            else:
                messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` as training renders it: through the chat template with the assistant's header,
        or as raw text with the tokenizer's special tokens (no template)."""
        if not self.chat:
            if not isinstance(prompt, str):
                raise UsageError("a conversation (messages) needs a chat template; --chat_template never takes raw "
                                 "text prompts only.")
            return self.tokenizer(prompt)["input_ids"]
        from .generate_guards import render_bounded

        conversation = self.conversation(prompt)
        text = render_bounded(lambda: self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                         add_generation_prompt=True), self.template)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generation_config(self, settings: GenerationSettings):
        """The model's generation config with ``settings`` in it (greedy: no sampling parameter left set)."""
        import copy

        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens, config.max_length = settings.max_new_tokens, None
        config.do_sample = settings.sampling
        config.temperature = settings.temperature if settings.sampling else None
        config.top_p = settings.top_p if settings.sampling else None
        if not settings.sampling:
            config.top_k = None
        config.pad_token_id = self.tokenizer.pad_token_id
        config.eos_token_id = sorted(self._eos_ids())  # the tokenizer's EOS stops a reply too (end of a chat turn)
        return config

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return ids | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())

    def generate_ids(self, batch: Sequence[list[int]], settings: GenerationSettings, streamer=None) -> list[list[int]]:
        """The new tokens of each row of ``batch`` (left-padded into one tensor), up to and without the first EOS."""
        import torch

        width = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in batch], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device)
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                         generation_config=self.generation_config(settings), streamer=streamer)
        eos, replies = self._eos_ids(), []
        for row in output[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in eos), len(row))
            replies.append(row[:end])
        return replies

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: Sequence[Prompt], settings: GenerationSettings, batch_size: int = 8,
                 progress=None) -> list[str]:
        """One reply per prompt, in order, ``batch_size`` prompts per ``generate`` call; ``progress`` (a tqdm bar)
        advances by the prompts done. ``settings.seed``, when set, seeds the sampling first."""
        seed_everything(settings.seed)
        return self.generate_encoded([self.encode(p) for p in prompts], settings, batch_size, progress)

    def generate_encoded(self, encoded: Sequence[list[int]], settings: GenerationSettings, batch_size: int = 8,
                         progress=None) -> list[str]:
        """:meth:`generate` for prompts already encoded (:meth:`encode`), without seeding."""
        replies = []
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            replies += [self.decode(ids) for ids in self.generate_ids(batch, settings)]
            if progress is not None:
                progress.update(len(batch))
        return replies


def load_model(model: Optional[str] = None, *, base: Optional[str] = None, adapter: Optional[str] = None,
               device: str = "auto", torch_dtype: str = "auto", chat_template: str = "auto",
               system: Optional[str] = None) -> LoadedModel:
    """Load what ``hf-lisa chat``/``generate`` talk to (see the module docstring for ``model``/``base``/``adapter``).

    Raises:
        UsageError: as :func:`resolve_sources`, for a device or template that cannot be used, or a model without a
            tokenizer.
    """
    sources = resolve_sources(model, base, adapter)
    return load_sources(sources, device=device, torch_dtype=torch_dtype, chat_template=chat_template, system=system)


def load_sources(sources: Sources, *, device: str = "auto", torch_dtype: str = "auto", chat_template: str = "auto",
                 system: Optional[str] = None) -> LoadedModel:
    """:func:`load_model` for sources already resolved."""
    import torch
    from peft import PeftModel

    from .export.common import load_tokenizer
    from .generate_guards import no_stdin, template_origin
    from .hub.load import from_pretrained, recorded_base

    device = resolve_device(device)
    kwargs: dict[str, Any] = {} if device == "cpu" else {"device_map": {"": device}}
    dtype = None if torch_dtype == "auto" else getattr(torch, torch_dtype)
    source = sources.adapter or sources.model
    with no_stdin():  # never a prompt for input (transformers' custom-code question) answered by a chat's stdin
        # a base read from the adapter's config is resolved again there, so that its errors name that file
        model = from_pretrained(source, base_model=None if sources.recorded else sources.base, torch_dtype=dtype,
                                **kwargs)
        if sources.base is not None and not isinstance(model, PeftModel):
            raise UsageError(f"--base={sources.base!r} applies to an adapter, but {source!r} is a full model; drop "
                             "--base.")
        base = model.peft_config[model.active_adapter].base_model_name_or_path if isinstance(model, PeftModel) else None
        base = sources.base or (recorded_base(base, source if os.path.isdir(source) else None)[0] if base else None)
        tokenizer = load_tokenizer(source, base)
    if tokenizer is None:
        custom = [f for f in (source, base) if f and _read_json(f, "tokenizer_config.json").get("auto_map")]
        if custom:
            raise UsageError(f"the tokenizer of {custom[0]!r} needs its own Python code to load ('auto_map' in its "
                             "tokenizer_config.json); hf-lisa never runs a model's code: save a tokenizer that "
                             "transformers implements beside the model.")
        raise UsageError(f"no tokenizer loads from {source!r}" + (f" or its base {base!r}" if base else "") +
                         "; save one beside the model (tokenizer.save_pretrained).")
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right end
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    recorded = recorded_run(source).get("data", {})
    chat = use_chat_template(tokenizer, chat_template, recorded.get("chat_template") if isinstance(recorded, dict)
                             else None)
    installed = chat_template not in ("auto", "always", "never")  # a built-in or a file: use_chat_template set it
    if system is not None and not chat:
        raise UsageError("--system needs a chat template, but prompts are raw text here (--chat_template never, or a "
                         "tokenizer without one); drop --system or pass a template.")
    description = sources.describe() if sources.adapter is None else f"{source} on {base}"
    folders = [("the model", source)] if sources.adapter is None else [("the adapter", source), ("its base", base)]
    return LoadedModel(model.eval(), tokenizer, chat, system, description,
                       template_origin(tokenizer, chat_template, installed), folders)


def quiet_loading() -> None:
    """No weight-loading progress bar from transformers when stderr is not a terminal (a piped chat, a script)."""
    import sys

    if not sys.stderr.isatty():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def seed_everything(seed: Optional[int]) -> None:
    """transformers' ``set_seed`` (Python, NumPy, torch), when ``seed`` is not ``None``."""
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
