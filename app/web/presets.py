"""System-prompt presets: named system prompts to choose from in the chat's settings panel.

A preset is a Markdown file in the presets folder (`presets/` in the project, or the folder named by
LLAMA_PRESETS): its name is the file's name without `.md`, its text the system prompt.

    presets/Concise.md      "Answer in as few words as the question allows..."
"""

from __future__ import annotations

from pathlib import Path

from app.settings import SettingsError

CUSTOM = "Custom"  # the settings panel's choice for "the system prompt as typed", not a preset


def read_presets(folder: Path) -> dict[str, str]:
    """Preset name -> system prompt, in name order; a missing folder has none. Empty files are left out."""
    if not folder.exists():
        return {}
    if not folder.is_dir():
        raise SettingsError(f"LLAMA_PRESETS={folder}: expected a folder of .md files, found a file")
    presets = {}
    for path in sorted(folder.glob("*.md"), key=lambda p: p.stem.casefold()):
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"LLAMA_PRESETS={folder}: cannot read the preset {path.name} as UTF-8 text: "
                                f"{e}") from None
        if text and path.stem != CUSTOM:
            presets[path.stem] = text
    return presets


def preset_of(presets: dict[str, str], system_prompt: str | None) -> str:
    """The preset whose text is this system prompt, else CUSTOM."""
    text = (system_prompt or "").strip()
    return next((name for name, preset in presets.items() if preset == text), CUSTOM)
