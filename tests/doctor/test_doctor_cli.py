"""`cmpchat doctor` as a user meets it without a GPU (one clear line), and its output for injected
measurements: the table with the verdict, or JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cmpchat.cli import main
from cmpchat.doctor.probe import choose_gpus
from cmpchat.errors import CmpchatError
from tests.doctor.conftest import cmp_100_210


def test_under_the_simulator_there_is_no_gpu_to_measure(capsys):
    assert main(["doctor"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cmpchat: error: no CUDA GPU") and "NUMBA_ENABLE_CUDASIM" in err
    assert len(err.splitlines()) == 1


def test_without_a_driver_or_device_the_error_is_one_line(tmp_path):
    # Outside the simulator, with every device hidden: what a machine without a usable GPU answers.
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "cmpchat", "doctor", "--quick"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["cmpchat: error: no CUDA GPU: no usable NVIDIA driver and device; cmpchat doctor measures GPUs"]


def test_gpus_are_chosen_once_each_and_checked():
    assert choose_gpus(None, 3) == [0, 1, 2]
    assert choose_gpus([2, 0, 2], 3) == [2, 0]
    with pytest.raises(CmpchatError, match="GPU 3 does not exist; this machine has 2"):
        choose_gpus([0, 3], 2)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Replace the probe with two CMPs' figures; returns what the command asked the probe for."""
    asked: dict = {}

    def fake_measure_gpus(requested, *, tensor_cores, quick, progress):
        asked.update(requested=requested, tensor_cores=tensor_cores, quick=quick)
        return [cmp_100_210(0, peers=(1,)), cmp_100_210(1, peers=(0,))]

    monkeypatch.setattr("cmpchat.commands.doctor.measure_gpus", fake_measure_gpus)
    return asked


def test_json_holds_the_figures_and_the_findings(measured, capsys):
    assert main(["doctor", "--json", "--gpu", "0", "--gpu", "1", "--tensor-cores", "--quick"]) == 0
    assert measured == {"requested": [0, 1], "tensor_cores": True, "quick": True}
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"gpus", "findings"}
    first = report["gpus"][0]
    assert first["name"] == "NVIDIA CMP 100-210" and first["compute_capability"] == [7, 0]
    assert first["read_bytes_per_s"] == 818e9 and first["dp4a_ops_per_s"] == 4.3e12 * 8
    assert first["peer_access"] == {"1": False}
    assert set(first) >= {
        "copy_bytes_per_s", "hfma2_flops_per_s", "ffma_flops_per_s", "tensor_core_flops_per_s",
        "host_to_device_bytes_per_s", "device_to_host_bytes_per_s",
    }  # fmt: skip
    for finding in report["findings"]:
        assert set(finding) == {"gpus", "path", "throttled", "text"}
    throttled = {(tuple(f["gpus"]), f["path"]) for f in report["findings"] if f["throttled"] and f["path"] != "summary"}
    assert throttled == {((0,), "tensor cores"), ((0,), "host link"), ((1,), "tensor cores"), ((1,), "host link")}


def test_the_report_is_a_table_and_the_verdict(measured, capsys):
    assert main(["doctor"]) == 0
    assert measured == {"requested": None, "tensor_cores": False, "quick": False}
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["GPU", "0", "GPU", "1"]
    assert "memory read 818 GB/s 818 GB/s".split() in [row.split() for row in rows]
    assert "GPU 0:\n  - memory read 818 GB/s" in out
    assert "between GPUs:\n  - no P2P between GPU 0 and 1" in out
