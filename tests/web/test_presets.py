"""System-prompt presets (app/web/presets.py): a folder of NAME.md files."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.web.presets import CUSTOM, preset_of, read_presets
from app.settings import DEFAULT_PRESETS, Settings, SettingsError


def test_presets_are_the_markdown_files_by_name(tmp_path):
    (tmp_path / "teacher.md").write_text("  Explain step by step.\n\n")
    (tmp_path / "Coder.md").write_text("Write code first.")
    (tmp_path / "empty.md").write_text(" \n")  # no text: not offered
    (tmp_path / "notes.txt").write_text("not a preset")
    (tmp_path / f"{CUSTOM}.md").write_text("would hide the typed prompt")
    presets = read_presets(tmp_path)
    assert presets == {"Coder": "Write code first.", "teacher": "Explain step by step."}
    assert list(presets) == ["Coder", "teacher"]  # by name, whatever the case
    assert preset_of(presets, "Write code first.\n") == "Coder"
    assert preset_of(presets, "Something else") == CUSTOM and preset_of(presets, None) == CUSTOM


def test_a_missing_folder_has_no_presets_and_a_file_is_an_error(tmp_path):
    assert read_presets(tmp_path / "nowhere") == {}
    (tmp_path / "file.md").write_text("x")
    with pytest.raises(SettingsError, match=r"LLAMA_PRESETS=.*file.md: expected a folder of .md files, found a file"):
        read_presets(tmp_path / "file.md")
    (tmp_path / "bad.md").write_bytes(b"\xff\xfe not UTF-8 \xc3")
    with pytest.raises(SettingsError, match="cannot read the preset bad.md as UTF-8"):
        read_presets(tmp_path)


def test_the_shipped_presets_and_the_setting():
    shipped = read_presets(DEFAULT_PRESETS)
    assert list(shipped) == ["Coder", "Concise", "Teacher", "Translator"]
    assert all(len(text) > 100 for text in shipped.values())
    assert Settings.from_env({}).presets == DEFAULT_PRESETS
    assert Settings.from_env({"LLAMA_PRESETS": "/srv/prompts"}).presets == Path("/srv/prompts")
