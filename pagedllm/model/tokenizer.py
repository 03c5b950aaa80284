"""A thin wrapper over the Hugging Face fast tokenizer with the few calls the engine, RAG and benchmarks use.

For a GGUF, transformers builds the tokenizer from the file's metadata, which takes ~10 s; the result is saved
to the user cache (keyed by the file's path, size and mtime) so later loads take well under a second. A GGUF
tokenizer never adds BOS by default (SmolLM2's chat template carries its own special tokens). Its stop tokens
are the file's EOS / EOT / EOM ids and the end-of-turn tokens its vocabulary has, as llama.cpp stops on them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.model.config import is_gguf, load_model_config, resolve_model_path
from pagedllm.model.formats.cache import cache_dir_for, remove_cached, seal_folder, sealed_folder_problem

os.environ.setdefault("HF_HUB_OFFLINE", "1")
logger = logging.getLogger(__name__)


class Tokenizer:
    """encode / decode / chat template, plus the special ids the engine stops on."""

    def __init__(
        self, hf_tokenizer: Any, eos_token_ids: list[int] | None = None, bos_token_id: int | None = None
    ) -> None:
        self.hf = hf_tokenizer
        eos = list(eos_token_ids or [])
        if not eos and hf_tokenizer.eos_token_id is not None:
            eos = [int(hf_tokenizer.eos_token_id)]
        self.eos_token_ids: list[int] = eos
        self.bos_token_id: int | None = bos_token_id if bos_token_id is not None else hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.pad_token_id: int | None = hf_tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int] | int) -> list[str] | str:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template_text(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template renders (with the tools, for a template that shows them), or
        `chat_template` instead of the model's; `template_kwargs` are more variables for it (Qwen3's
        `enable_thinking`). transformers renders in Jinja's ImmutableSandboxedEnvironment. UserError-free: a
        template error is a model problem."""
        if not (chat_template or self.chat_template):
            raise ModelLoadError("this model's tokenizer has no chat template; use plain prompts instead of chat")
        extra: dict[str, Any] = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        if chat_template:
            extra["chat_template"] = chat_template
        if continue_final_message:
            extra["continue_final_message"] = True
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; special tokens come from the template itself, so none are added."""
        return self.encode(
            self.apply_chat_template_text(messages, add_generation_prompt, tools), add_special_tokens=False
        )


def _no_bos(folder: str) -> None:
    """Make a saved tokenizer not add BOS (GGUF metadata says so for SmolLM2; transformers may not keep it)."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    cfg["add_bos_token"] = False
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def gguf_tokenizer_folder(path: str) -> str:
    """A HF tokenizer folder for the GGUF at `path`, built once and cached; a cached folder that fails its
    manifest check is rebuilt (one log line), never loaded."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    target = cache_dir_for(path, "tokenizers")
    if os.path.lexists(target):
        problem = sealed_folder_problem(target, ("tokenizer.json", "tokenizer_config.json"))
        if problem is None:
            return target
        logger.warning("cached tokenizer %s %s: building it again", target, problem)
        remove_cached(target)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # an architecture transformers' GGUF loader lacks (ValueError), or reads wrongly (TypeError: its gpt-oss
    # reader takes a key's name for its value; StrictDataclassError: Gemma 4's per-layer ffn sizes, which its
    # config class takes for one): the tokenizer needs no model class
    except (ValueError, TypeError, StrictDataclassError) as e:
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
        except Exception as e2:
            raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e2} (after {e})") from e2
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    try:
        tok.save_pretrained(tmp)
        _no_bos(tmp)
        seal_folder(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The tokenizer of a HF folder or GGUF file (None = the default model); usable without loading weights."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    cfg = load_model_config(path)
    if os.path.isdir(path):
        folder = path
        if not (
            os.path.isfile(os.path.join(folder, "tokenizer.json"))
            or os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
        ):
            raise ModelLoadError(f"no tokenizer in {folder} (expected tokenizer.json / tokenizer_config.json)")
    elif is_gguf(path):
        folder = gguf_tokenizer_folder(path)
    else:
        raise ModelLoadError(f"{path} is not a model: expected a Hugging Face model folder or a GGUF file")
    try:
        hf = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from e
    eos = list(cfg.eos_token_ids)
    if is_gguf(path):
        eos += [i for i in end_of_generation_ids(hf) if i not in eos and i < cfg.vocab_size]
    return Tokenizer(hf, eos, cfg.bos_token_id)


# Tokens that end a turn in the chat formats people run, which llama.cpp stops on when a GGUF's vocabulary has
# them (a GGUF names one EOS; Llama 3 ends turns with <|eot_id|>, Gemma with <end_of_turn>, ChatML with <|im_end|>,
# Phi-3 with <|end|>). A base model's end of text is the file's EOS already.
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>")


# gpt-oss (harmony): an answer ends with <|return|> (the final message) or <|call|> (a tool call); its <|end|> ends
# a message inside the answer, so there it is no stop (llama.cpp drops it from a gpt-oss vocabulary's stops too).
HARMONY_STOPS = ("<|return|>", "<|call|>")


def end_of_generation_ids(hf_tokenizer: Any) -> list[int]:
    """Ids of the END_OF_GENERATION tokens this tokenizer's vocabulary has (a harmony vocabulary's own)."""
    vocab = hf_tokenizer.get_vocab()
    if all(t in vocab for t in HARMONY_STOPS):
        return [int(vocab[t]) for t in HARMONY_STOPS]
    return [int(vocab[t]) for t in END_OF_GENERATION if t in vocab]
