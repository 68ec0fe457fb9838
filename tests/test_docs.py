"""The README and docs/: every relative link reaches a file (and its #anchor a heading), the configuration reference
lists the keys `train_ppo.py --help` lists (with the same types and defaults), and the README stays short.

`python tests/test_docs.py` writes docs/configuration.md's key tables again from `train_ppo.py --help`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from conftest import ROOT, explain, run_python

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- keys: generated from `train_ppo.py --help` by `python tests/test_docs.py`; do not edit below -->"
END = "<!-- keys: end -->"


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (where `[x](y)` is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists() or not where.resolve().is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {path or page.name})")
    assert not broken, "\n".join(broken)


def test_the_pages_carry_no_internal_references():
    for page in PAGES:
        for pattern in (r"\.\./shared", r"\bissue \d+", r"\blease\b", r"review mends"):
            hits = re.findall(rf".*{pattern}.*", page.read_text(), flags=re.I)
            assert not hits, f"{page.relative_to(ROOT)}: {hits[:3]}"


def test_the_readme_fits_a_first_read():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines: move the detail to a docs/ page"


# ------------------------------------------------------------------------------------------------ the key reference
def help_keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) per key of `train_ppo.py --help`'s listing (config.describe_schema): the
    `# ...` lines above a key lead its description, wrapped lines are joined."""
    proc = run_python(["train_ppo.py", "--help"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    listing = proc.stdout.split("keys (key  type  default  description):\n", 1)
    assert len(listing) == 2, f"--help has no key listing:\n{proc.stdout}"
    rows: list[list[str]] = []
    above: list[str] = []
    for line in listing[1].splitlines():
        if not line.strip():
            continue
        if line.startswith("  # "):
            above.append(line[4:].strip())
        elif line.startswith("   "):  # a wrapped description
            rows[-1][3] += " " + line.strip()
        else:
            m = re.match(r"  (\S+) {2,}(.+?)(?: {2,}(.+?))?(?: {2,}(.*))?$", line)
            assert m and m[3] is not None, f"not a key line of --help: {line!r}"
            rows.append([m[1], m[2], m[3], " ".join([*above, m[4] or ""]).strip()])
            above = []
    return [tuple(r) for r in rows]


def render_reference(rows) -> str:
    """A table per top-level section: key, type, default, description."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")

    out, section = [BEGIN], None
    for key, tp, default, text in rows:
        top = key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"### `{top}`", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        out.append(f"| `{key}` | `{cell(tp)}` | `{cell(default)}` | {cell(text)} |")
    return "\n".join([*out, "", END])


def reference_keys() -> dict[str, tuple[str, str]]:
    """{key: (type, default)} of docs/configuration.md's generated tables."""
    text = REFERENCE.read_text()
    assert BEGIN in text and END in text, f"{REFERENCE} lost its generated key tables ({BEGIN})"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    out = {}
    for m in re.finditer(r"^\| `([^`]+)` \| `([^`]*)` \| `([^`]*)` \|", block, flags=re.M):
        out[m[1]] = (m[2].replace("\\|", "|"), m[3].replace("\\|", "|").replace("&lt;", "<").replace("&gt;", ">"))
    return out


def test_the_configuration_reference_lists_what_help_lists():
    listed = {key: (tp, default) for key, tp, default, _ in help_keys()}
    written = reference_keys()
    assert "actor.optim.lr" in listed and "placement.pools[].size" in listed
    regenerate = "write the reference again: python tests/test_docs.py"
    assert not set(listed) - set(written), f"keys --help lists, missing in {REFERENCE.name}: " \
                                           f"{sorted(set(listed) - set(written))}; {regenerate}"
    assert not set(written) - set(listed), f"keys in {REFERENCE.name} that --help does not list: " \
                                           f"{sorted(set(written) - set(listed))}; {regenerate}"
    changed = {k: (written[k], listed[k]) for k in listed if written[k] != listed[k]}
    assert not changed, f"type or default differs (docs, --help): {changed}; {regenerate}"


if __name__ == "__main__":
    text = REFERENCE.read_text()
    if BEGIN not in text:
        sys.exit(f"{REFERENCE} has no line {BEGIN}: put it (and {END}) where the key tables go")
    head, rest = text.split(BEGIN, 1)
    REFERENCE.write_text(head + render_reference(help_keys()) + rest.split(END, 1)[1])
    print(f"wrote {REFERENCE}")
