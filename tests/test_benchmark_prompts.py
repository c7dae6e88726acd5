"""The fixed prompt set the real-pair speed figures are measured on."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "prompts" / "select_heldout_chat.py"


def _selector():
    spec = importlib.util.spec_from_file_location("select_heldout_chat", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heldout_chat_64_is_what_its_script_selects_from_the_heldout_prompts():
    selector = _selector()
    assert selector.main(["--check"]) == 0  # regenerating it gives the same file
    rows = [json.loads(line) for line in selector.OUT.read_text().splitlines()]
    heldout = {json.loads(line)["prompt"] for line in selector.SOURCE.read_text().splitlines() if line.strip()}
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == len(set(prompts)) == 64 and set(prompts) <= heldout
    kinds = Counter(r["kind"] for r in rows)
    assert kinds == Counter(selector.QUOTA) and len(kinds) >= 6
    assert len({r["kind"] for r in rows[:7]}) == 7  # the first lines are varied too
    # Every template of every kind is represented.
    templates = {selector.classify(p) for p in prompts}
    assert templates == {(k, i) for k, ts in selector.KINDS.items() for i in range(len(ts))}
