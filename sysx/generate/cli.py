"""``sysx generate``: sample from a model, streaming the reply to the terminal.

    sysx generate --model models/tiny-chat --chat "What does json.dumps do?" --max-new-tokens 64
    sysx generate --model runs/ft --prompt "def parse(" --temperature 0.8 --top-p 0.9 --seed 1

The reply goes to stdout as it is produced; the lines about the model, the placement and the speed
go to stderr. Every bad input is one line naming the value and the fix (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from sysx import device as dev
from sysx.config.checks import first_line
from sysx.generate import GenerateError
from sysx.generate.decoder import Decoder, generate, plan
from sysx.generate.placement import GiB
from sysx.generate.sampling import Sampler, check_sampling
from sysx.generate.source import ModelSource, open_source
from sysx.generate.text import PromptTokenizer, TextStream, load_prompt_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FREE_MEMORY_SHARE = 0.9  # of the device's free memory, when no --device-memory-gb is given (allocator slack)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of ``sysx generate`` (argparse exits on ``--help`` or a usage error)."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sysx generate", description="sample from a model, streaming the reply to the terminal"
    )
    p.add_argument(
        "--model", required=True, help="a Hugging Face Llama folder, a run directory, a checkpoint or a sysx model file"
    )
    p.add_argument("--tokenizer", help="a tokenizer folder, a tokenizer.json or `byte` (default: found with the model)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="raw text to continue")
    text.add_argument("--chat", help="a user message, rendered by the model's chat template")
    p.add_argument("--system", help="a system message before --chat's user message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to this mass"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="compute dtype (auto: bf16 on a GPU, fp32 on CPU, as training's precision)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        help="device budget in GiB: the layers stay resident when they fit with the KV cache, else they stream "
        "(default: the free device memory; none on CPU)",
    )
    return p


@dataclass(frozen=True)
class Request:
    """What to feed the model and how to continue it."""

    prompt: list[int]
    max_new_tokens: int
    device: torch.device
    dtype: torch.dtype
    budget: int | None


def _check_args(args: argparse.Namespace) -> None:
    check_sampling(args.temperature, args.top_p)
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {args.max_new_tokens} must be >= 1; give e.g. --max-new-tokens 128")
    if args.system is not None and args.chat is None:
        raise GenerateError("--system needs --chat (a system message opens a chat); use --chat TEXT, or drop --system")
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise GenerateError(f"--device-memory-gb {args.device_memory_gb} must be > 0; give the GiB the model may use")


def _tokenizer(args: argparse.Namespace, source: ModelSource) -> PromptTokenizer:
    spec = args.tokenizer or source.tokenizer
    if spec is None:
        raise GenerateError(
            f"--model {args.model}: no tokenizer found with the model (no tokenizer.json beside it, none named "
            f"by its run's model.init_from or data); give --tokenizer <folder | tokenizer.json | byte>"
        )
    return load_prompt_tokenizer(spec)


def _prompt_ids(args: argparse.Namespace, tok: PromptTokenizer, source: ModelSource) -> list[int]:
    ids = tok.chat_ids(args.chat, args.system) if args.chat is not None else tok.encode(args.prompt)
    cfg = source.weights.config
    if not ids:
        raise GenerateError("the prompt is empty (no tokens); give --prompt TEXT or --chat TEXT with some text")
    if max(ids) >= cfg.vocab_size:
        raise GenerateError(
            f"--tokenizer {tok.name}: the prompt's token ids reach {max(ids)} but the model's vocabulary has "
            f"{cfg.vocab_size}; give the model's own tokenizer (--tokenizer)"
        )
    if len(ids) + args.max_new_tokens > cfg.max_seq_len:
        room = cfg.max_seq_len - len(ids)
        fix = f"lower --max-new-tokens to {room}" if room > 0 else "shorten the prompt"
        raise GenerateError(
            f"the prompt's {len(ids)} tokens plus --max-new-tokens {args.max_new_tokens} exceed the model's "
            f"max_seq_len {cfg.max_seq_len}; {fix}"
        )
    return ids


def _request(args: argparse.Namespace, tok: PromptTokenizer, source: ModelSource) -> Request:
    ids = _prompt_ids(args, tok, source)
    try:
        device = dev.resolve_device(args.device)
    except (ValueError, RuntimeError) as err:
        raise GenerateError(f"--device {args.device}: {first_line(err)}; give auto, cpu, cuda or cuda:N") from None
    dtype = DTYPES[dev.default_precision(device) if args.dtype == "auto" else args.dtype]
    budget = None if args.device_memory_gb is None else int(args.device_memory_gb * GiB)
    if budget is None and dev.is_cuda(device):
        budget = int(torch.cuda.mem_get_info(device)[0] * FREE_MEMORY_SHARE)
    return Request(ids, args.max_new_tokens, device, dtype, budget)


def run(args: argparse.Namespace) -> list[int]:
    """Generate as ``args`` say, streaming to stdout; returns the new token ids."""
    _check_args(args)
    source = open_source(args.model)
    tok = _tokenizer(args, source)
    req = _request(args, tok, source)
    positions = len(req.prompt) + req.max_new_tokens
    host, placement = plan(
        source.weights, dtype=req.dtype, prompt_len=len(req.prompt), positions=positions, budget=req.budget
    )
    dtype = str(req.dtype).removeprefix("torch.")
    print(f"sysx generate: {source.where} on {req.device}, {dtype}: {placement.describe()}", file=sys.stderr)
    decoder = Decoder(source.weights, host, placement, device=req.device, positions=positions)
    sampler = Sampler(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    stream = TextStream(tok.decode)
    start = time.perf_counter()
    out = generate(decoder, req.prompt, req.max_new_tokens, sampler, (*source.eos_ids, *tok.eos_ids), stream.push)
    stream.end()
    seconds = time.perf_counter() - start
    print(
        f"sysx generate: {len(out)} tokens after a {len(req.prompt)}-token prompt in {seconds:.2f} s "
        f"({len(out) / seconds:.1f} tokens/s)",
        file=sys.stderr,
    )
    return out


def main(argv: list[str]) -> int:
    """Entry point of ``sysx generate``."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help or a usage error
        return int(exc.code or 0)
    try:
        run(args)
    except GenerateError as err:
        print(f"sysx generate: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0
