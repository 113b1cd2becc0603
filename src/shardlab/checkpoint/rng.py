"""Every rank's RNG states (torch CPU and CUDA, python, numpy), as tensors DCP can store."""

from __future__ import annotations

import random

import numpy as np
import torch


# ============================================================================ RNG states
def capture_rng(rank: int) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors under rng/<rank>/ (DCP-storable, no pickling)."""
    p = f"rng/{rank}/"
    out = {p + "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{p}cuda/{i}"] = s
    version, internal, gauss = random.getstate()
    out[p + "python"] = torch.tensor([version, *internal], dtype=torch.int64)
    out[p + "python_gauss"] = torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out[p + "numpy"] = torch.from_numpy(keys.astype(np.int64))
    out[p + "numpy_extra"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return out


def restore_rng(rank: int, tensors: dict[str, torch.Tensor]) -> None:
    p = f"rng/{rank}/"
    torch.set_rng_state(tensors[p + "torch"])
    cuda = sorted((k for k in tensors if k.startswith(p + "cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda][:torch.cuda.device_count()])
    py = tensors[p + "python"].tolist()
    has_gauss, gauss = tensors[p + "python_gauss"].tolist()
    random.setstate((py[0], tuple(py[1:]), gauss if has_gauss else None))
    pos, np_has_gauss, cached = tensors[p + "numpy_extra"].tolist()
    np.random.set_state(("MT19937", tensors[p + "numpy"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), cached))
