"""The README's accuracy table: what it shows for each zoo case, and the torch release it was made on."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_zoo_rows() -> dict[str, int]:
    """case id -> the predicted bytes the README's accuracy table shows."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[\d,]+", cells[2]) and re.fullmatch(r"[\d,]+", cells[3]):
            rows[cells[0]] = int(cells[2].replace(",", ""))
    return rows


def readme_release_is_installed() -> bool:
    """Whether the installed torch is the release the table names (its figures are for that one; docs/validation.md
    covers the others)."""
    release = re.search(r"\(torch (\d+\.\d+)\.\d+ CPU, transformers", README.read_text()).group(1)
    return torch.__version__.startswith(release + ".")
