"""trellis-demo's entry point: the commands ``trellis demo`` and ``trellis make-tiny-model``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trellis


@trellis.hookimpl
def trellis_add_commands(commands):
    from trellis_demo.demo import __doc__ as about
    from trellis_demo.demo import add_arguments, cmd_demo

    p = commands.add(
        "make-tiny-model", cmd_make_tiny_model, help="build (or reuse) a tiny local Qwen2 (or Qwen2-VL) model + tokenizer trained on your text"
    )
    p.add_argument("out_dir")
    p.add_argument("--text-file", help="tokenizer training text, one text per line (default: the arithmetic task's text)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 4 x hidden size")
    p.add_argument("--vocab-size", type=int, default=None, help="default: 256 bytes + 3 special tokens + up to 64 merges")
    p.add_argument("--max-position-embeddings", type=int, default=512)
    p.add_argument("--untied", action="store_true", help="separate output head (default: tied to the embeddings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vision", action="store_true", help="a Qwen2-VL: a one-block vision tower, the vision tokens and an image processor")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE: 4 experts per layer, each token routed to 2")
    summary = "SFT then GRPO on arithmetic with a tiny model; prints a before/after table (see trellis demo -h)"
    demo = commands.add("demo", cmd_demo, help=summary, description=about.splitlines()[0])
    add_arguments(demo)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from trellis_demo.tasks import task_texts
    from trellis_demo.tiny import make_tiny_model

    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            print(f"trellis: error: --text-file {str(path)!r} does not exist; give a text file (one text per line)", file=sys.stderr)
            return 2
        texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        texts = task_texts()
    try:
        out = make_tiny_model(
            args.out_dir,
            texts,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            tie_word_embeddings=not args.untied,
            seed=args.seed,
            max_position_embeddings=args.max_position_embeddings,
            vision=args.vision,
            moe=args.moe,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
