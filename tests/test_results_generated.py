"""Results as data: README.md's headline table and the tables of docs/results.md and benchmarks/results/EARLIER.md
are what ``benchmarks/results_tables.py`` makes of the committed JSONs; the markdown outside ``benchmarks/results/``
stays short, and no tracked page or notebook holds a path of someone's machine."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_tables  # noqa: E402

MARKDOWN_LIMIT = 80_000  # bytes, every tracked .md outside benchmarks/results/
# a home, work or scratch folder of a machine; a bare "/tmp" or "$TMPDIR" in prose is not one
MACHINE_PATH = re.compile(r"(?<![\w.$-])/(?:work|home|Users|root|scratch|mnt|tmp)/[\w.-]")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / p for p in out.stdout.decode().split("\0") if p]


def test_the_results_tables_are_what_the_jsons_give():
    stale = results_tables.stale()
    assert stale == [], f"{stale}: run python benchmarks/results_tables.py (the JSONs give other tables)"
    assert results_tables.main(["--check"]) == 0


def test_the_check_names_a_stale_page(tmp_path, capsys):
    for page in results_tables.PAGES:
        if not page.startswith(results_tables.RESULTS):  # those are read through the link below
            (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / page).write_text((ROOT / page).read_text())
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results").symlink_to(ROOT / "benchmarks" / "results")
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("+1.52% [+1.08, +1.60]", "+1.00% [+0.90, +1.10]"))
    assert results_tables.stale(tmp_path) == ["README.md"]
    assert results_tables.main(["--check"], root=tmp_path) == 1
    assert "README.md is stale" in capsys.readouterr().err
    assert results_tables.main([], root=tmp_path) == 0  # rewritten from the JSONs
    assert results_tables.stale(tmp_path) == [] and readme.read_text() == (ROOT / "README.md").read_text()


def test_the_headline_reads_s19s_s20s_and_s22s_files():
    text = results_tables.headline(ROOT)
    assert "| FP8 (TE), the default (s19, launch e) | +1.52% [+1.08, +1.60] | 344.3 | +0.12% [−0.11, +0.25] | " \
           "46.18 → 38.41 (−7.77) | −0.29% |" in text
    assert "| FP8 (TE), checkpointed blocks, the default (s20; memory s22) | +1.52% [+1.12, +3.58] | " \
           "454.6 | −0.02% [−0.29, +0.21] | 21.01 → 8.79 (−12.22) | −0.31% |" in text
    assert "| bf16, checkpointed blocks, the default (s20) | +0.31% [+0.01, +0.61] | 577.4 | −0.02% [−0.50, +0.11] | " \
           "31.74 → 19.00 (−12.74) | +0.18% |" in text


def test_every_launch_is_counted_by_render_with_the_median_of_the_medians():
    text = results_tables.launches(ROOT)
    assert "| FP8 (TE), the default | a broadcast `copy_` (s16) | 2 | +4.16% | +4.14% to +4.18% |" in text
    assert "| FP8 (TE), the default | one `cat` (since s17) | 6 | +1.64% | +0.70% to +2.27% | " \
           "s18 c: +2.05% [+1.27, +2.91] (−0.42%); s18 d: +1.70% [+1.27, +2.87] (+0.26%); " \
           "s19 e: +1.52% [+1.08, +1.60] (+0.12%); s21 f: +0.70% [−0.21, +2.24] (−0.38%); " \
           "s23 g: +1.59% [+0.20, +3.22] (−0.18%); s24 h: +2.27% [+1.32, +2.78] (+0.06%) |" in text
    assert "| FP8 (TE), the default | one `cat`, the pass's on a side stream | 2 | +2.07% | " \
           "+1.41% to +2.74% |" in text
    assert "| bf16, the default | one `cat` (since s17) | 4 | +1.45% | +1.40% to +1.48% |" in text
    assert "| FP8 (TE), checkpointed, the default | one `cat` (since s17) | 2 | +1.09% | +0.67% to +1.52% |" in text
    assert "| bf16, checkpointed, the default | one `cat` (since s17) | 1 | +0.31% |" in text
    assert "each:" not in results_tables.launches(ROOT, each_launch=False)


def test_the_earlier_sittings_page_links_each_sittings_notes_beside_it():
    text = results_tables.older(ROOT)
    assert "| [s24, 2026-12-04](h200_2026-12-04/NOTES.md) | FP8, the default with `compact=\"off\"`, beside launch h | " \
           "+1.43% [+0.65, +2.03] |" in text
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (ROOT / results_tables.RESULTS / link).exists(), link


def test_markdown_outside_the_results_is_at_most_80_kb():
    pages = [p for p in tracked("*.md") if not p.relative_to(ROOT).as_posix().startswith("benchmarks/results/")]
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in pages}
    assert sum(sizes.values()) <= MARKDOWN_LIMIT, f"{sum(sizes.values()):,} B of markdown: {sorted(sizes.items())}"


def test_the_machine_path_pattern():
    for path in ["/work/main/.venv/lib/python3.11/site-packages/x.py", "/home/me/repo", "see /tmp/acc.json",
                 "(/Users/a/b)"]:
        assert MACHINE_PATH.search(path), path
    for text in ["`/usr/bin/python3.11`", "$TMPDIR/x", "benchmarks/work/x", "a/tmp/b", "~/.cache", "https://x.org/home/a"]:
        assert not MACHINE_PATH.search(text), text


def test_no_tracked_page_or_notebook_holds_a_machine_path():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for p in tracked("*.md", "*.ipynb", "docs/*")
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "machine paths:\n" + "\n".join(found)
