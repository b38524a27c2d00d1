"""Make a tiny Hugging Face Llama folder to fine-tune: a byte-level BPE tokenizer trained on your text, a
ChatML chat template, and a randomly initialised ``tiny``-shaped model (sysx's ``tiny`` preset).

    python examples/tiny_hf_model.py --text data/stdlib_chat.jsonl --output models/tiny-chat [--vocab-size 512]

It stands in for a downloaded model (``Llama-3.2-1B-Instruct`` and the like) on a machine without a
network: the folder has what those have (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template``), so every sysx command treats it the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen and many fine-tunes use it; the assistant's turn ends with <|im_end|>, the model's eos
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def texts_of(path: Path) -> Iterator[str]:
    """The strings of a JSONL file (every string value, nested ones too) or the lines of a text file."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if path.suffix != ".jsonl":
            yield line
            continue
        stack = [json.loads(line)]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                yield item
            elif isinstance(item, dict):
                stack += item.values()
            elif isinstance(item, list):
                stack += item


def train_tokenizer(texts: Iterator[str], vocab_size: int, output: Path) -> int:
    """Train and save ``tokenizer.json`` + ``tokenizer_config.json``; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(output / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--text", required=True, help="a .jsonl (all its strings) or text file to train the tokenizer on"
    )
    parser.add_argument("--output", required=True, help="the folder to write")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    from sysx.model.config import PRESETS
    from sysx.model.hf import export_hf_llama
    from sysx.model.llama import build_model

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(texts_of(Path(args.text)), args.vocab_size, out)
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {"eos_token_id": tok.token_to_id(IM_END), "pad_token_id": tok.token_to_id(END_OF_TEXT)}
    export_hf_llama(build_model(cfg, seed=args.seed), out, token_ids=ids)
    print(f"wrote {out}: tiny Llama ({cfg.n_layers} layers, dim {cfg.dim}), BPE vocabulary {vocab}, ChatML template")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
