"""The embedded default's tokenizer: a small byte-level BPE trained here, on text shipped in the package.

It carries the release's special tokens at the ids the tiny config names (bos 0, eos 1, pad 2, the
DSpark noise token and the image token, then the chat format's markers), and its merges are
learned from `data/corpus.txt`, which spells the same words with and without capitals and accents
and has runs of whitespace. Those learned tokens fold together under the Engram normalizer, so the
compressed vocabulary the Engram hash reads is strictly smaller than the vocabulary, as it is for
the released tokenizer.

The BPE trainer breaks count ties by token ids, never by hash order or thread timing, so the JSON
is byte-identical for the same package and `tokenizers` version on every machine (`tests/test_tiny.py`
trains it in two fresh processes with different thread settings and compares).
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from dsv41.core.config import Config

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
# The release's spelling of this token is not known here; only its id matters to the model.
DSPARK_NOISE_TOKEN = "<｜dspark▁noise｜>"

# The chat format's markers (`dsv41.generation.chat`), spelled as the release spells them. The released
# tokenizer has each as one id; the tiny one puts them on the reserved ids right after the image
# token, so every chat prompt tokenizes with them whole (they were added with the chat format: the
# tokenizer's earlier layout had fillers there, and the checkpoint's weights do not change).
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
CHAT_TOKENS = (
    USER_TOKEN,
    ASSISTANT_TOKEN,
    SYSTEM_TOKEN,
    LATEST_REMINDER_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
    *TASK_TOKENS.values(),
)


def reserved_token(index: int) -> str:
    """Filler special token for an id the tiny vocabulary has no learned token for."""
    return f"<｜reserved▁{index}｜>"


def corpus_text() -> str:
    """The training text that ships with the package (written for this project)."""
    return resources.files("dsv41").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


def build_tiny_tokenizer(config: Config | None = None, texts=None):
    """A `tokenizers.Tokenizer` laid out for `config` (default: the TINY preset), its merges learned
    from `texts` (an iterable of strings; default: the lines of `data/corpus.txt`).

    Ids: bos/eos/pad at the config's ids (0, 1, 2), then the 256 byte symbols and the learned
    merges, then reserved fillers so that the noise and image tokens land exactly on
    `dspark_noise_token_id` and `image_token_id`, and the vocabulary is exactly `vocab_size`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if config is None:
        from dsv41.core.config import TINY as config

    vocab_size = int(config.vocab_size)
    fixed = {
        int(config.bos_token_id): BOS_TOKEN,
        int(config.eos_token_id): EOS_TOKEN,
        int(config.pad_token_id): PAD_TOKEN,
        int(config.dspark_noise_token_id): DSPARK_NOISE_TOKEN,
        int(config.image_token_id): IMAGE_TOKEN,
    }
    if sorted(fixed)[:3] != [0, 1, 2]:
        raise ValueError(f"the tiny tokenizer expects bos/eos/pad at ids 0, 1, 2, got {sorted(fixed)[:3]}")
    if len(fixed) != 5 or max(fixed) >= vocab_size:
        raise ValueError(f"special token ids {sorted(fixed)} must be distinct and inside the vocabulary {vocab_size}")
    learned_end = min(i for i in fixed if i > 2)  # merges fill the ids below the first late special
    chat_ids = {max(fixed) + 1 + i: text for i, text in enumerate(CHAT_TOKENS)}
    if max(chat_ids) >= vocab_size:
        raise ValueError(f"the chat tokens need ids up to {max(chat_ids)}, past the vocabulary {vocab_size}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=learned_end,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True) if texts is None else texts, trainer=trainer)

    # Every id from the end of the learned vocabulary up to vocab_size is a special token: the two
    # named ones at their ids, the chat markers after them, reserved fillers elsewhere. Added tokens
    # take ids in order.
    late = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True), vocab_size):
        late.append(fixed.get(token_id) or chat_ids.get(token_id) or reserved_token(token_id))
    tok.add_special_tokens(late)

    for token_id, text in {**fixed, **chat_ids}.items():
        if tok.token_to_id(text) != token_id:
            raise RuntimeError(f"tiny tokenizer layout: {text} landed on id {tok.token_to_id(text)}, not {token_id}")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, expected {vocab_size}"
        )
    return tok


def tokenizer_config(config: Config | None = None) -> dict:
    """The minimal `tokenizer_config.json` that goes beside `tokenizer.json`."""
    if config is None:
        from dsv41.core.config import TINY as config
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.max_seq_len),  # max_position_embeddings, else the YaRN length
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
