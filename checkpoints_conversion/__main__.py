"""Convert checkpoints between Hugging Face and specjax's Orbax format.

    python -m checkpoints_conversion to-orbax HF_DIR_OR_GGUF OUT_DIR [--dtype bfloat16] [--force]
    python -m checkpoints_conversion to-hf ORBAX_OR_HF_DIR_OR_GGUF OUT_DIR [--dtype float32] [--force]
    python -m checkpoints_conversion manifest DIR [--force]
    python -m checkpoints_conversion verify DIR

Sources may also be ``.gguf`` files or known model names (anything
``specjax.load`` accepts). A non-empty OUT_DIR is refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
from typing import Optional, Sequence

_DESCRIPTION = """\
Convert language-model checkpoints for specjax.

  to-orbax  Hugging Face directory (config.json + *.safetensors [+ tokenizer.json])
            or .gguf file -> Orbax directory that specjax.load() reads fast.
  to-hf     Orbax or Hugging Face directory, or .gguf file -> Hugging Face directory
            (config.json + model.safetensors [+ tokenizer.json]) that
            transformers.AutoModelForCausalLM.from_pretrained() loads.
  manifest  record a SHA-256 of every file of a checkpoint directory in
            specjax_manifest.json (safetensors themselves carry no checksum).
  verify    check a checkpoint directory against its specjax_manifest.json.

Sources: anything specjax.load() reads -- a Hugging Face or Orbax directory, a
GGUF file (llama.cpp's format; weights are dequantized), or a known model name.
Supported model types: llama, mistral, qwen2, qwen3, gpt2.
Only safetensors weights are read. Pickle-based *.bin / *.pt files are refused
because loading them can execute code; convert those once with transformers:
  AutoModelForCausalLM.from_pretrained(d).save_pretrained(out, safe_serialization=True)

Outputs are never overwritten silently: a non-empty OUT_DIR is refused unless
--force, which writes the new checkpoint into a temporary sibling directory and
then swaps it in, so nothing of the old directory (stale shards) survives.
Tensors are streamed one at a time; peak memory is about one copy of the model.
"""

_EXAMPLES = """\
examples:
  python -m checkpoints_conversion to-orbax ckpt/qwen3-0.6b ckpt/qwen3-0.6b-orbax --dtype bfloat16
  python -m checkpoints_conversion to-hf ckpt/qwen3-0.6b-orbax ckpt/qwen3-0.6b-hf
  python -m checkpoints_conversion to-hf model.Q8_0.gguf ckpt/from-gguf --force
  python -m checkpoints_conversion manifest ckpt/qwen3-0.6b && python -m checkpoints_conversion verify ckpt/qwen3-0.6b
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
    force_help = ("replace a non-empty OUT_DIR and everything in it (written to a temporary "
                  "sibling first, then swapped in)")

    to_orbax = sub.add_parser(
        "to-orbax",
        help="Hugging Face directory or .gguf file -> specjax Orbax directory",
        description="Convert a Hugging Face safetensors checkpoint (or a GGUF file) to a "
                    "specjax Orbax checkpoint.",
    )
    to_orbax.add_argument("src", metavar="HF_DIR_OR_GGUF",
                          help="Hugging Face checkpoint directory, .gguf file or known model name")
    to_orbax.add_argument("out", metavar="OUT_DIR", help="new (or empty) output directory")
    to_orbax.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help=dtype_help)
    to_orbax.add_argument("--force", action="store_true", help=force_help)

    to_hf = sub.add_parser(
        "to-hf",
        help="specjax Orbax (or HF) directory or .gguf file -> Hugging Face directory",
        description="Export a specjax checkpoint (or a GGUF file) as a Hugging Face "
                    "safetensors directory.",
    )
    to_hf.add_argument("src", metavar="SRC",
                       help="Orbax or HF checkpoint directory, .gguf file or known model name")
    to_hf.add_argument("out", metavar="OUT_DIR", help="new (or empty) output directory")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help=dtype_help)
    to_hf.add_argument("--force", action="store_true", help=force_help)

    manifest = sub.add_parser(
        "manifest",
        help="record a SHA-256 per file in DIR/specjax_manifest.json",
        description="Record the SHA-256 of every file of a checkpoint directory in "
                    "DIR/specjax_manifest.json, for `verify` to check later. Run it where "
                    "the checkpoint is known to be good.",
    )
    manifest.add_argument("dir", metavar="DIR", help="checkpoint directory")
    manifest.add_argument("--force", action="store_true", help="replace an existing manifest")

    verify = sub.add_parser(
        "verify",
        help="check DIR against its specjax_manifest.json",
        description="Check every file of a checkpoint directory against the SHA-256s in "
                    "DIR/specjax_manifest.json; names missing, changed and unrecorded files.",
    )
    verify.add_argument("dir", metavar="DIR", help="checkpoint directory")
    return parser


def _read(src: str, dtype: Optional[str]):
    """What ``specjax.load`` reads (a known name, a GGUF file, a shipped packed
    directory, ...), a Hugging Face directory with a progress bar."""
    import specjax
    from specjax.models import is_orbax_dir, load_hf, unpacked_dir

    if os.path.isdir(src):
        src = unpacked_dir(src)  # a shipped directory with xz-compressed files: its unpacked copy
        if not is_orbax_dir(src) and os.path.exists(os.path.join(src, "model.safetensors")):
            return load_hf(src, dtype, progress=_progress("reading"))
    return specjax.load(src, dtype)


def _check_out_spares_src(src: str, out: str) -> None:
    """Replacing OUT deletes what is in it, so OUT must not be SRC or hold it
    (``--force`` included: the source would be gone before it is read)."""
    src_path, out_path = pathlib.Path(src).resolve(), pathlib.Path(out).resolve()
    if out_path == src_path or out_path in src_path.parents:
        raise ValueError(
            f"the output {out} is the source {src} or a directory that holds it, and writing it would "
            "delete the source; choose an OUT outside the source."
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import specjax
    from specjax.models import MANIFEST_FILE, check_output_dir, is_orbax_dir

    try:
        if args.command == "manifest":
            recorded = specjax.checkpoint_manifest(args.dir, write=True, overwrite=args.force)
            print(f"wrote {os.path.join(args.dir, MANIFEST_FILE)} "
                  f"({len(recorded['files'])} files)")
            return 0
        if args.command == "verify":
            count = specjax.verify_manifest(args.dir)
            print(f"ok: {count} files of {args.dir} match {MANIFEST_FILE}")
            return 0
        # Refuse before the (possibly long) read, and again when writing.
        _check_out_spares_src(args.src, args.out)
        check_output_dir(args.out, args.force, flag="--force")
        if args.command == "to-orbax":
            if is_orbax_dir(args.src):
                raise ValueError(f"{args.src} is already an Orbax checkpoint.")
            specjax.save_orbax(_read(args.src, args.dtype), args.out, overwrite=args.force)
        else:
            specjax.export_hf(_read(args.src, args.dtype), args.out,
                              progress=_progress("writing"), overwrite=args.force)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
