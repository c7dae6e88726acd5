"""Convert checkpoints between Hugging Face and specjax's Orbax format.

    python -m checkpoints_conversion to-orbax HF_DIR OUT_DIR [--dtype bfloat16]
    python -m checkpoints_conversion to-hf ORBAX_OR_HF_DIR OUT_DIR [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Optional, Sequence

_DESCRIPTION = """\
Convert language-model checkpoints for specjax.

  to-orbax  Hugging Face directory (config.json + *.safetensors [+ tokenizer.json])
            -> Orbax directory that specjax.load() reads fast.
  to-hf     Orbax (or Hugging Face) directory -> Hugging Face directory
            (config.json + model.safetensors [+ tokenizer.json]) that
            transformers.AutoModelForCausalLM.from_pretrained() loads.

Supported model types: llama, mistral, qwen2, qwen3, gpt2.
Only safetensors weights are read. Pickle-based *.bin / *.pt files are refused
because loading them can execute code; convert those once with transformers:
  AutoModelForCausalLM.from_pretrained(d).save_pretrained(out, safe_serialization=True)

Tensors are streamed one at a time; peak memory is about one copy of the model.
"""

_EXAMPLES = """\
examples:
  python -m checkpoints_conversion to-orbax ckpt/qwen3-0.6b ckpt/qwen3-0.6b-orbax --dtype bfloat16
  python -m checkpoints_conversion to-hf ckpt/qwen3-0.6b-orbax ckpt/qwen3-0.6b-hf
"""


def _progress(desc: str):
    from tqdm.auto import tqdm

    return functools.partial(tqdm, desc=desc, unit="tensor")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_conversion",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dtype_help = "params dtype of the output: float32 or bfloat16 (default: keep the input's)"

    to_orbax = sub.add_parser(
        "to-orbax",
        help="Hugging Face directory -> specjax Orbax directory",
        description="Convert a Hugging Face safetensors checkpoint to a specjax Orbax checkpoint.",
    )
    to_orbax.add_argument("src", metavar="HF_DIR", help="Hugging Face checkpoint directory")
    to_orbax.add_argument("out", metavar="OUT_DIR", help="new (or empty) output directory")
    to_orbax.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help=dtype_help)

    to_hf = sub.add_parser(
        "to-hf",
        help="specjax Orbax (or HF) directory -> Hugging Face directory",
        description="Export a specjax checkpoint as a Hugging Face safetensors directory.",
    )
    to_hf.add_argument("src", metavar="ORBAX_OR_HF_DIR", help="checkpoint directory to export")
    to_hf.add_argument("out", metavar="OUT_DIR", help="output directory")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help=dtype_help)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from specjax._src.models import loading

    try:
        if args.command == "to-orbax":
            if loading.is_orbax_dir(args.src):
                raise ValueError(f"{args.src} is already an Orbax checkpoint.")
            model = loading.load_hf(args.src, args.dtype, progress=_progress("reading"))
            loading.save_orbax(model, args.out)
        else:
            if loading.is_orbax_dir(args.src):
                model = loading.load_orbax(args.src, args.dtype)
            else:
                model = loading.load_hf(args.src, args.dtype, progress=_progress("reading"))
            loading.export_hf(model, args.out, progress=_progress("writing"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
