"""The one BPE tokenizer all tiny targets share, trained locally on synthetic workload text.

Byte-level BPE (no unknown tokens), ChatML chat template, eos = <|im_end|>. `<|mask|>` is the mask token DFlash
drafters put in their blocks. Training is deterministic: same corpus and vocab size give the same tokenizer.json.
"""

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdistill.data.workload import generate_rows

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
VOCAB_SIZE = 4096
CORPUS_ROWS = 6000  # ~230 sessions: enough distinct text for ~4k merges; training takes a few s

# ChatML, as Qwen uses it; accepted by transformers' apply_chat_template and by vLLM.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml(messages: list[dict]) -> str:
    """The chat template rendered by hand (the tokenizer does not exist yet when its corpus is built)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def _workload_tokenizer_json(vocab_size: int) -> str:
    rows = generate_rows(CORPUS_ROWS, seed=0, split="tokenizer")
    return train_tokenizer([chatml(r["messages"]) for r in rows], vocab_size).to_str()


def workload_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """The shared tokenizer: BPE over chat-formatted rows of the workload's `tokenizer` split.

    Trained once per process (a few seconds); each call returns a fresh object, so callers may mutate it.
    """
    return Tokenizer.from_str(_workload_tokenizer_json(vocab_size))


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "mask_token": MASK_TOKEN,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat_template inside it, not in a separate .jinja file)."""
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def as_hf(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The same tokenizer as transformers sees it after loading a saved checkpoint."""
    cfg = tokenizer_config()
    keys = ("eos_token", "pad_token", "mask_token", "model_max_length", "chat_template")
    return PreTrainedTokenizerFast(tokenizer_object=tok, **{k: cfg[k] for k in keys})
