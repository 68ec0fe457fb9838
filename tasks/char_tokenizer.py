"""A character-level tokenizer for the quickstart's tiny models: one token per character, built locally.

Built with the `tokenizers` library and wrapped as a `transformers` fast tokenizer, so it saves and loads like any
Hugging Face tokenizer (`save_pretrained` -> `AutoTokenizer.from_pretrained`) and needs no hub access.
"""

import json
import os
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(chars: str = DEFAULT_CHARS, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is the special tokens (ids 0-3: pad, bos, eos, unk) followed by `chars`.

    `add_bos` prepends <bos> when encoding with `add_special_tokens=True`. Characters outside `chars` encode to <unk>.
    Decoding joins characters without separators, so `decode(encode(text)) == text` for text made of `chars`.
    There is no chat template: set `tokenizer.chat_template` if a test or task needs one.
    """
    if not chars:
        raise ValueError("build_char_tokenizer: chars is empty; pass the characters the vocabulary should hold")
    duplicates = sorted({c for c in chars if chars.count(c) > 1})
    if duplicates:
        raise ValueError(f"build_char_tokenizer: chars has duplicates {duplicates}; each character must appear once")

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # WordLevel looks up whole pre-tokens, so splitting into single characters (newlines included) makes it char-level.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates decoded tokens; the default decoder would put spaces between characters.
    tokenizer.decoder = decoders.Fuse()
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of a model folder (or hub id): AutoTokenizer's, except that a folder whose tokenizer_config.json
    names the generic backend (TokenizersBackend / PreTrainedTokenizerFast: what this module's tokenizer saves as) is
    loaded as its tokenizer.json says. transformers 5.2x builds the family's own class from a folder's config.json
    (Qwen2Tokenizer beside a qwen2 model), which replaces the saved pre-tokenizer: a character tokenizer then drops
    spaces and newlines when it encodes."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared in GENERIC_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
