"""docs/flags.md is generated from the parser and must be current."""

from __future__ import annotations

from slime_like.config import flags_doc


def test_docs_flags_md_matches_the_parser():
    assert flags_doc.DOC_PATH.read_text() == flags_doc.render(), (
        "docs/flags.md is stale: run python -m slime_like.config.flags_doc")


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "flags.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(flags_doc, "DOC_PATH", stale)
    assert flags_doc.main(["--check"]) == 1
    assert flags_doc.main([]) == 0
    assert flags_doc.main(["--check"]) == 0
    assert "| `--rollout-num-gpus-per-engine` | `1` |" in stale.read_text()
