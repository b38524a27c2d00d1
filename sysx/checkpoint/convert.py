"""``sysx convert``: sysx model file or checkpoint <-> Hugging Face Llama directory.

sysx convert --to-hf model.safetensors out_dir/      # sysx file -> HF dir (config.json + safetensors)
sysx convert --to-hf runs/x/checkpoints out_dir/     # a checkpoint (its latest, or a step-<N> folder) -> HF dir
sysx convert --from-hf hf_dir/ model.safetensors     # HF dir -> sysx file
"""

from __future__ import annotations

import argparse
import sys

import torch

from sysx.checkpoint.pretrained import build_model, open_pretrained
from sysx.checkpoint.store import CheckpointError
from sysx.checkpoint.token_ids import export_token_ids
from sysx.model.hf import export_hf_llama, load_hf_llama
from sysx.model.io import save_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sysx convert",
        description="Convert model weights between a sysx model file and a Hugging Face Llama directory.",
        epilog=(
            "examples:\n  sysx convert --to-hf model.safetensors out_dir/\n"
            "  sysx convert --from-hf hf_dir/ model.safetensors"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument(
        "--to-hf", action="store_true", help="SRC is a sysx model file or checkpoint (folder), DST an HF directory"
    )
    direction.add_argument("--from-hf", action="store_true", help="SRC is an HF directory, DST a sysx model file")
    parser.add_argument("src", help="input: sysx model file or checkpoint (--to-hf), or HF directory (--from-hf)")
    parser.add_argument("dst", help="output: HF directory (--to-hf) or sysx model file (--from-hf)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="store the weights in this dtype (default: as in SRC)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="--to-hf: copy the tokenizer files of DIR into the HF directory (e.g. <tokens>.tokenizer/)",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``sysx convert``; returns 0 on success, 1 on a bad input file, 2 on bad arguments."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to_hf:
            model = build_model(open_pretrained(args.src), dtype=dtype)
            token_ids = export_token_ids(args.src, args.tokenizer)
            out = export_hf_llama(model, args.dst, tokenizer_dir=args.tokenizer, token_ids=token_ids)
        else:
            model = load_hf_llama(args.src, dtype=dtype)
            out = save_model(model, args.dst)
    except (FileNotFoundError, ValueError, CheckpointError) as err:
        print(f"sysx convert: {err}", file=sys.stderr)
        return 1
    cfg = model.config
    print(
        f"sysx convert: wrote {out} ({cfg.n_layers} layers, dim {cfg.dim}, vocab {cfg.vocab_size}, "
        f"{model.embedding.weight.dtype})"
    )
    return 0
