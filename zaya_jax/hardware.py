"""Accelerator profiles for planning: vendor peaks, and separately the fractions of them assumed
achievable, which a calibration file of measured rates replaces.

Peaks (per GPU; `sources` below name the datasheets):
  matmul_tflops   dense bf16 matrix peak (no sparsity)
  fp8_matmul_tflops dense FP8 matrix peak, twice bf16's (0: no FP8 matmuls); the FP8 matmuls
                  (model.matmul_precision, zaya_jax.model.fp8) are assumed to reach the same
                  fraction of it as bf16 GEMMs of theirs (an assumption until a GPU measures it:
                  benchmarks/gpu/gpu_selftest.py's fp8 section)
  hbm_gbps        HBM bandwidth, GB/s
  memory_gb       HBM capacity, GB
  intra_node_gbps one direction of the GPU's scale-up links (xGMI / NVLink), GB/s
  inter_node_gbps the GPU's own NIC (one per GPU, rail-optimised clusters), GB/s
  devices_per_node GPUs sharing one scale-up domain

Achievable fractions: large bf16 GEMMs (on AMD the vendor's published Max-Achievable FLOPs, cited
below; elsewhere assumed), streaming HBM bandwidth and collective bus bandwidth (ring /
hierarchical algorithms) per link (assumed).

Calibration file (the rates a GPU self-test measures, all on one device kind):
  {"device_kind": "AMD Instinct MI300X",   # must name the profile's GPU (checked)
   "matmul_tflops": 750.0,                  # achieved bf16 GEMM TFLOP/s (large square GEMM)
   "hbm_gbps": 4200.0,                      # achieved copy bandwidth, GB/s (read + write)
   "intra_node_gbps": 310.0,                # all-reduce bus bandwidth inside a node, GB/s
   "inter_node_gbps": 42.0}                 # all-reduce bus bandwidth across nodes per GPU, GB/s
Any subset of the rates may be given; each one replaces its efficiency as measured / peak.
"""

from __future__ import annotations

import dataclasses
import json
import math

from zaya_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Efficiency:
    matmul: float
    hbm: float
    intra_node: float
    inter_node: float


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    device_kind: str            # substring of jax's device_kind for this GPU
    matmul_tflops: float
    hbm_gbps: float
    memory_gb: float
    intra_node_link: str
    intra_node_gbps: float
    inter_node_gbps: float
    devices_per_node: int
    efficiency: Efficiency
    sources: str
    fp8_matmul_tflops: float = 0.0

    def achieved(self) -> dict[str, float]:
        """Rates the time model uses: FLOP/s and bytes/s."""
        e = self.efficiency
        return {"matmul_flops": self.matmul_tflops * 1e12 * e.matmul,
                "fp8_matmul_flops": self.fp8_matmul_tflops * 1e12 * e.matmul, "hbm_bytes": self.hbm_gbps * 1e9 * e.hbm,
                "intra_node_bytes": self.intra_node_gbps * 1e9 * e.intra_node,
                "inter_node_bytes": self.inter_node_gbps * 1e9 * e.inter_node}


# Achievable fractions. AMD GEMMs: AMD's published Max-Achievable FLOPs (MAF, the best a tuned
# hipBLASLt bf16 GEMM sustains at the clock dense matrix work runs at; ROCm blog "Measuring
# Max-Achievable FLOPs - Part 2", Feb 2025): 708 TFLOP/s on MI300X (750 W, 1207 MHz median) and
# 840.8 on MI325X (1000 W), 54% and 64% of the 1307.4 peak. NVIDIA GEMMs: an assumption, large
# bf16 GEMMs at about 72% of peak on H100/H200. HBM: STREAM-like copies reach about 80%;
# collectives: RCCL/NCCL all-reduce bus bandwidth about 70% of xGMI, 80% of NVLink and of a 400G
# NIC (assumptions). A calibration file of measured rates replaces any of them.
MAF_SOURCE = ("AMD ROCm blog, Measuring Max-Achievable FLOPs - Part 2 (rocm.blogs.amd.com, Feb 2025): "
              "MAF bf16 708 TFLOP/s on MI300X (750 W, 1207 MHz), 840.8 TFLOP/s on MI325X (1000 W), "
              "hipBLASLt M=4096 N=4864 K=32896")
_MI300X = Efficiency(matmul=708.0 / 1307.4, hbm=0.80, intra_node=0.70, inter_node=0.80)
_MI325X = dataclasses.replace(_MI300X, matmul=840.8 / 1307.4)
_NVIDIA = Efficiency(matmul=0.72, hbm=0.80, intra_node=0.80, inter_node=0.80)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile("mi300x", "MI300X", 1307.4, 5300.0, 192.0, "xGMI", 448.0, 50.0, 8, _MI300X,
                    "AMD Instinct MI300X datasheet: 1307.4 TFLOP/s dense bf16, 192 GB HBM3 at 5.3 TB/s; "
                    "AMD Instinct platform brief: 7 xGMI links per GPU at 64 GB/s each way (448 GB/s), "
                    "896 GB/s aggregate; NIC: one 400 Gb/s (50 GB/s) Pollara/ConnectX-7 per GPU; GEMM "
                    f"efficiency: {MAF_SOURCE}; 2614.9 TFLOP/s dense FP8", 2614.9),
    HardwareProfile("mi325x", "MI325X", 1307.4, 6000.0, 256.0, "xGMI", 448.0, 50.0, 8, _MI325X,
                    "AMD Instinct MI325X datasheet: 1307.4 TFLOP/s dense bf16, 256 GB HBM3E at 6 TB/s; "
                    f"xGMI as MI300X; NIC 400 Gb/s per GPU; GEMM efficiency: {MAF_SOURCE}; 2614.9 TFLOP/s dense FP8",
                    2614.9),
    HardwareProfile("h100", "H100", 989.4, 3350.0, 80.0, "NVLink", 450.0, 50.0, 8, _NVIDIA,
                    "NVIDIA H100 SXM datasheet: 989.4 TFLOP/s dense bf16 (1979 with sparsity), 80 GB HBM3 "
                    "at 3.35 TB/s, NVLink 900 GB/s (450 each way); DGX H100: one ConnectX-7 400 Gb/s per GPU; "
                    "1978.9 TFLOP/s dense FP8", 1978.9),
    HardwareProfile("h200", "H200", 989.4, 4800.0, 141.0, "NVLink", 450.0, 50.0, 8, _NVIDIA,
                    "NVIDIA H200 SXM datasheet: 989.4 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s, "
                    "NVLink 900 GB/s (450 each way); HGX H200: one 400 Gb/s NIC per GPU; 1978.9 TFLOP/s dense FP8",
                    1978.9),
    HardwareProfile("a100", "A100", 312.0, 2039.0, 80.0, "NVLink", 300.0, 25.0, 8, _NVIDIA,
                    "NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, NVLink "
                    "600 GB/s (300 each way); DGX A100: one 200 Gb/s HDR NIC per GPU"),
)}

_CALIBRATION_RATES = {"matmul_tflops": "matmul", "hbm_gbps": "hbm", "intra_node_gbps": "intra_node",
                      "inter_node_gbps": "inter_node"}
_PEAK_OF = {"matmul": "matmul_tflops", "hbm": "hbm_gbps", "intra_node": "intra_node_gbps",
            "inter_node": "inter_node_gbps"}


def profile_for_device_kind(device_kind: str) -> HardwareProfile | None:
    """The profile whose GPU jax reports as `device_kind` (e.g. 'AMD Instinct MI300X'), if any."""
    for p in PROFILES.values():
        if p.device_kind.lower() in device_kind.lower():
            return p
    return None


def calibrated(base: HardwareProfile, path: str) -> HardwareProfile:
    """`base` with the efficiencies a calibration file's measured rates imply (see module docstring)."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--calibration={path}: cannot read a JSON object ({e})") from None
    if not isinstance(measured, dict):
        raise UserError(f"--calibration={path}: expected a JSON object, got {type(measured).__name__}")
    unknown = sorted(set(measured) - set(_CALIBRATION_RATES) - {"device_kind"})
    if unknown:
        raise UserError(f"--calibration={path}: unknown field(s) {unknown}; fields: device_kind, "
                        f"{', '.join(_CALIBRATION_RATES)}")
    kind = measured.get("device_kind")
    if not isinstance(kind, str) or base.device_kind.lower() not in kind.lower():
        raise UserError(f"--calibration={path}: device_kind {kind!r} was not measured on the --hardware "
                        f"profile's GPU ({base.device_kind}); pass the matching --hardware or file")
    efficiency = dataclasses.asdict(base.efficiency)
    for field, key in _CALIBRATION_RATES.items():
        if field in measured:
            rate = measured[field]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise UserError(f"--calibration={path}: {field} must be a positive number, got {rate!r}")
            efficiency[key] = rate / getattr(base, _PEAK_OF[key])
    return dataclasses.replace(base, efficiency=Efficiency(**efficiency))
