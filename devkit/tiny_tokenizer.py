"""A word-level tokenizer saved beside a tiny random checkpoint, so that load_model reads the folder as it reads a
real one."""

from __future__ import annotations


def save_tiny_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer ("t0".."tN"), enough for load_model to find one."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<unk>"], vocab["<s>"], vocab["</s>"] = 0, 1, 2
    tok = HFTok(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
