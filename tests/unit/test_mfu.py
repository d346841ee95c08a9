"""benchmarks/mfu.py's arithmetic: PaLM's FLOPs per token for the GPT example's model, the
peak by device name, and its options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmarks import mfu


def test_the_matmul_parameters_are_the_blocks_linears_and_the_tied_head() -> None:
    layers, width, seq = 3, 64, 32
    model = mfu.gpt.GPT(layers, width, 4, seq)
    shape = mfu.shape_of(model, layers, width, seq)
    # per block: qkv 3d^2, proj d^2, fc 4d^2, fc_proj 4d^2; the head is the tied embedding
    assert shape.matmul_params == layers * 12 * width**2 + 256 * width
    assert shape.flops_per_token() == 6 * shape.matmul_params + 12 * layers * width * seq


def test_the_gpu_preset_is_a_third_of_a_billion_parameters() -> None:
    p = mfu.PRESETS["gpu-350m"]
    with torch.device("meta"):
        model = mfu.gpt.GPT(p["n_layer"], p["n_embd"], p["n_head"], p["seq_len"])
    params = sum(t.numel() for t in model.parameters())
    assert 0.3e9 < params < 1e9
    assert (p["dtype"], p["compile"], p["fused_adamw"]) == ("bf16", True, True)


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),  # before the SXM part's "H100"
        ("NVIDIA H100 80GB HBM3", "fp32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("Tesla T4", "bf16", None),
    ],
)
def test_the_peak_comes_from_the_name_cuda_reports(
    name: str, dtype: str, tflops: float | None
) -> None:
    assert mfu.peak_for(name, dtype) == tflops


def test_without_a_gpu_the_peak_is_this_cpu_s_matmul_rate_and_says_so() -> None:
    peak, source = mfu.device_peak(torch.device("cpu"), "fp32", None)
    assert peak > 0 and source.startswith("SIMULATED")
    given, said = mfu.device_peak(torch.device("cpu"), "fp32", 100.0)
    assert given == 100e12 and said == "--peak-tflops 100"


def test_options_take_the_preset_and_refuse_what_would_say_little(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = mfu.parse(["--preset", "tiny", "--batch-size", "2"])
    assert (args.n_layer, args.batch_size, args.fused_adamw) == (2, 2, True)
    for bad in (["--windows", "3"], ["--modes", "eager,fast"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            mfu.parse(bad)
    assert "fast" in capsys.readouterr().err


def test_a_run_on_this_cpu_reports_each_mode_as_simulated(tmp_path: Path) -> None:
    out = tmp_path / "mfu.json"
    argv = ["--preset", "tiny", "--modes", "eager", "--steps", "1", "--warmup", "1"]
    assert mfu.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["simulated"] is True and result["device"] == "cpu"
    eager = result["modes"]["eager"]
    assert eager["mfu"]["median"] > 0 and eager["tokens_per_s"]["min"] > 0
    assert result["flops_per_token"] > 6 * result["matmul_params_m"] * 1e6
