"""Random but valid rows for the storage tests (shared with the worker processes)."""

from __future__ import annotations

import random

DTYPES = ("float16", "float32")


def device_info(rng: random.Random, key: str | None = None) -> dict[str, object]:
    """What ``DeviceInfo.to_dict()`` plus ``"key"`` gives, with random values."""
    name = rng.choice(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu-interpreter"])
    info: dict[str, object] = {
        "name": name,
        "compute_capability": rng.choice(["8.0", "9.0"]),
        "sm_count": rng.randint(16, 160),
        "total_memory": rng.randint(1, 200) * 2**30,
        "smem_per_block": rng.choice([99, 227]) * 1024,
        "driver_version": f"{rng.randint(500, 600)}.{rng.randint(0, 99)}",
        "triton_version": "3.6.0",
        "torch_version": "2.11.0",
        "cuda_version": "12.8",
    }
    info["key"] = key or f"{name}|{rng.getrandbits(48):x}"
    return info


def problem(rng: random.Random, *, causal: str = "none", mask: str = "none",
            dtype: str | None = None) -> dict[str, object]:
    """A ``Problem.to_dict()``-shaped dict."""
    heads_kv = rng.choice([1, 2, 4])
    return {
        "batch": rng.randint(1, 8), "heads_q": heads_kv * rng.choice([1, 2, 4]),
        "heads_kv": heads_kv, "seqlen_q": rng.randint(1, 4096),
        "seqlen_kv": rng.randint(1, 4096), "head_dim": rng.choice([64, 128]),
        "dtype": dtype or rng.choice(DTYPES), "causal": causal, "mask": mask,
    }


def problem_key(p: dict[str, object]) -> str:
    return (f"b{p['batch']}-hq{p['heads_q']}-hkv{p['heads_kv']}-q{p['seqlen_q']}"
            f"-kv{p['seqlen_kv']}-d{p['head_dim']}-{p['dtype']}")


def config(rng: random.Random) -> dict[str, object]:
    return {"BLOCK_M": rng.choice([32, 64, 128]), "BLOCK_N": rng.choice([32, 64]),
            "num_warps": rng.choice([4, 8]), "num_stages": rng.choice([2, 3, 4]),
            "note": rng.choice(["α-tile", "plain"])}


def config_key(c: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(c.items()))
