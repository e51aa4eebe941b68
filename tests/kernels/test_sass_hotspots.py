"""`cuda/sass_hotspots.py` on a small source page in ncu's CSV layout (the GPU tool itself runs on a device)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "cuda" / "sass_hotspots.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sass_hotspots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_page(path: Path, instructions: list[tuple[str, int, int]]) -> Path:
    lines = ["==PROF== Connected to process 1", '"Kernel Name","k"']
    lines.append('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"')
    for n, (source, samples, executed) in enumerate(instructions):
        lines.append(f'"0x{n:04x}","{source}","{samples}","{executed}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_opcode_mix_and_the_phases_between_barriers(tmp_path):
    hotspots = load_script()
    page = write_page(
        tmp_path / "k.csv",
        [
            ("LDS.128 R4, [R2]", 10, 100),
            ("@!P0 FFMA R1, R2, R3, R1", 30, 300),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", 40, 100),
            ("IMAD R5, R6, 0x4, R7", 20, 400),
            ("IDP.4A.S8.S8 R1, R2, R3, R1", 0, 100),
        ],
    )
    summary = hotspots.summarise(hotspots.read_rows(page), top=3)
    lines = summary.splitlines()
    assert lines[0] == "1,000 warp instructions, 100 stall samples"
    assert lines[2].split() == ["IMAD", "40.0%", "20.0%"]  # the most executed opcode first
    assert lines[3].split() == ["FFMA", "30.0%", "30.0%"]  # the predicate is not the opcode
    phases = [line.split() for line in lines[lines.index(next(x for x in lines if x.startswith("between"))) + 1 :]]
    assert phases == [["0-3", "50.0%", "80.0%", "60.0%"], ["3-5", "50.0%", "20.0%", "20.0%"]]


def test_a_file_without_the_source_page_is_refused(tmp_path):
    hotspots = load_script()
    (tmp_path / "k.csv").write_text("==ERROR== no kernels were profiled\n")
    with pytest.raises(SystemExit, match="no SASS table"):
        hotspots.read_rows(tmp_path / "k.csv")
