"""CIFAR-10 from a local `cifar-10-batches-py` folder (the standard pickled-batch format).

Loaded safely: the batches are pickles, so they go through an Unpickler that allows only
the numpy classes an array needs; anything else in the file is refused, not executed.
Nothing is downloaded.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from shardlab.data.datasets import Datasets
from shardlab.data.source import DataSource
from shardlab.errors import ConfigError

_ALLOWED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
}
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def find_cifar_dir(path: str) -> str | None:
    """The `cifar-10-batches-py` folder at or inside `path`, or None."""
    for cand in (os.path.join(path, "cifar-10-batches-py"), path):
        if os.path.isfile(os.path.join(cand, "data_batch_1")):
            return cand
    return None


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch file")


def load_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = _SafeUnpickler(f, encoding="bytes").load()
    data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(d[b"labels"], dtype=np.int64)
    return data, labels


class CIFAR10(torch.utils.data.Dataset):
    def __init__(self, folder: str, train: bool = True):
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        arrays = [load_batch(os.path.join(folder, n)) for n in names if os.path.exists(os.path.join(folder, n))]
        if not arrays:
            raise FileNotFoundError(f"no CIFAR-10 {'training' if train else 'test'} batches in {folder}")
        images = torch.from_numpy(np.concatenate([a for a, _ in arrays]))
        self.images = ((images.float() / 255.0) - MEAN) / STD
        self.labels = torch.from_numpy(np.concatenate([b for _, b in arrays]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def write_fake_cifar(folder: str, per_batch: int = 20, seed: int = 0) -> str:
    """Write a tiny CIFAR-10 folder in the real format (for tests and demos); returns its path."""
    rng = np.random.default_rng(seed)
    out = os.path.join(folder, "cifar-10-batches-py")
    os.makedirs(out, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
             b"labels": rng.integers(0, 10, per_batch).tolist(), b"batch_label": name.encode()}
        with open(os.path.join(out, name), "wb") as f:
            pickle.dump(d, f)
    return out


# -- the source (shardlab.data.DATA_SOURCES) ---------------------------------------------------------
def _build(cfg) -> Datasets:
    folder = find_cifar_dir(cfg.data.path)
    train = CIFAR10(folder, train=True)
    try:
        val = CIFAR10(folder, train=False)
    except FileNotFoundError:
        val = None
    return Datasets(train, val, info={"cifar10": folder, "train_samples": len(train)})


def _check(cfg) -> None:
    d = cfg.data
    if d.path is None:
        raise ConfigError("data.source=cifar10 needs data.path (the folder holding cifar-10-batches-py)")
    if find_cifar_dir(d.path) is None:
        raise ConfigError(f"data.path {d.path!r}: no cifar-10-batches-py folder with data_batch_1 there; download "
                          "CIFAR-10 (python version) and point data.path at it")


SOURCE = DataSource(name="cifar10", kind="images", build=_build, check=_check)
