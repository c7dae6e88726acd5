"""The documents run: the site builds, every code block and every example executes.

* The Sphinx site in ``docs/`` builds with warnings as errors, so a broken
  cross-reference in a public docstring or a guide fails here (skipped only
  where the ``docs`` extra is not installed).
* Every ```` ```python ```` block of ``README.md`` and ``docs/*.md`` runs, the
  blocks of one page in order in one namespace (a later block may use an
  earlier one's names). A block that cannot run is preceded by an HTML comment
  ``<!-- not-run: reason -->``; ``test_blocks_marked_not_run`` lists them.
* Every script in ``examples/`` runs with ``--small`` (``eagle_head.py`` with ``-m slow``).

Blocks and examples that name a large checkpoint run with small stand-ins, so
that the test needs no download and runs in seconds: ``specjax.load`` is
patched to return, for the names in ``TARGET_NAMES``, the embedded 1.4M target
(``specjax/assets/models/target``, float32, with a one-line chat template);
for ``DRAFT_NAMES`` the embedded draft; for ``HEAD_NAMES`` a feature head
initialised from that target (``specjax.heads.init_from_target``). Every other
path loads as written.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EMBEDDED = ROOT / "specjax" / "assets" / "models"

TARGET_NAMES = ("ckpt/qwen3-8b", "smollm2-135m-instruct")
DRAFT_NAMES = ("ckpt/qwen3-0.6b", "smollm2-135m-instruct-draft")
HEAD_NAMES = ("smollm2-135m-instruct-eagle",)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"

_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason, when marked not-run

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: pathlib.Path) -> list[Block]:
    """The ```` ```python ```` blocks of a Markdown page, with their not-run marks."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if lang.lower() in ("py", "python3", "pycon"):
            raise AssertionError(f"{page}:{start + 1}: write ```python, so the block is run")
        if lang == "python":
            previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            mark = _NOT_RUN.match(previous.strip())
            blocks.append(Block(page, start + 1, "\n".join(lines[start + 1:i]), mark.group(1) if mark else None))
        i += 1
    return blocks


def test_code_blocks_are_found(tmp_path):
    blocks = code_blocks(ROOT / "README.md")
    assert blocks and all("specjax" in b.code for b in blocks if b.not_run is None)
    # the parser itself: a marked block, an unmarked one, a non-python one
    sample = tmp_path / "sample.md"
    sample.write_text("text\n\n<!-- not-run: needs a GPU -->\n```python\nx = 1\n```\n```bash\nls\n```\n"
                      "```python\ny = 2\n```\n")
    found = code_blocks(sample)
    assert [(b.line, b.code, b.not_run) for b in found] == [(4, "x = 1", "needs a GPU"), (10, "y = 2", None)]


def test_blocks_marked_not_run():
    """Lists the blocks no test runs; each must say why."""
    marked = [b for page in PAGES for b in code_blocks(page) if b.not_run is not None]
    for b in marked:
        print(f"not run: {b.where}: {b.not_run}")
        assert len(b.not_run) >= 10, f"{b.where}: say why the block cannot run"


_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def test_relative_links_point_to_files():
    """Every relative link of README.md and docs/*.md names a file or directory that exists."""
    broken = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for target, _ in _LINK.findall(line):
                if "://" not in target and not target.startswith("mailto:"):
                    if not (page.parent / target).exists():
                        broken.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


@pytest.fixture(scope="module")
def stand_ins():
    """Patches ``specjax.load`` so large checkpoints' names load small models (see the module doc)."""
    import jax
    import numpy as np

    import specjax

    real_load = specjax.load
    target = real_load(str(EMBEDDED / "target"), dtype="float32").replace(chat_template=CHAT_TEMPLATE)
    draft = real_load(str(EMBEDDED / "draft"), dtype="float32")
    head = specjax.heads.init_from_target(target, jax.random.key(0), np.arange(target.vocab_size))

    def load(path, *args, **kwargs):
        name = str(path)
        if name in TARGET_NAMES:
            return target
        if name in DRAFT_NAMES:
            return draft
        if name in HEAD_NAMES:
            return head
        return real_load(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specjax, "load", load)
        patch.chdir(ROOT)
        yield


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(b.not_run is None for b in code_blocks(p))],
    ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, stand_ins, capsys):
    namespace = {"__name__": "__docs__"}
    for block in code_blocks(page):
        if block.not_run is None:
            try:
                exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 (our own pages)
            except Exception as e:
                raise AssertionError(f"the block at {block.where} failed: {type(e).__name__}: {e}") from e


# eagle_head.py compiles five programs (chains, trees, the lookup) that the guides' blocks already
# run in smaller forms: it runs with -m slow to keep this file within its time budget.
@pytest.mark.parametrize("example", [pytest.param(p, marks=pytest.mark.slow) if p.name == "eagle_head.py" else p
                                     for p in EXAMPLES], ids=lambda p: p.name)
def test_examples_run(example, stand_ins, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(example), "--small"])
    runpy.run_path(str(example), run_name="__main__")
    assert capsys.readouterr().out.strip(), f"{example.name} printed nothing"


def test_docs_site_builds(tmp_path):
    for module in ("sphinx", "myst_parser", "furo"):
        pytest.importorskip(module, reason='the docs extra is not installed: pip install -e ".[docs]"')
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stderr[-5000:]}"
    assert (tmp_path / "html" / "api" / "specjax.rules.html").exists()
