"""Data: disjoint rank slices covering each global batch, epochs, the embedded corpus, CIFAR-10."""

import pickle

import pytest
import torch

from shardlab.config import load_config
from shardlab.data import build_datasets, collate
from shardlab.data.cifar import CIFAR10, load_batch, write_fake_cifar
from shardlab.data.corpus import build_corpus_text
from shardlab.data.loader import GlobalBatchSampler


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(world):
    s = GlobalBatchSampler(num_samples=50, global_batch_size=12, seed=3)
    for step in range(12):  # crosses several epoch boundaries (50 is not a multiple of 12)
        parts = [s.rank_indices(step, r, world) for r in range(world)]
        joined = torch.cat(parts)
        assert torch.equal(joined, s.global_indices(step))
        assert len(set(joined.tolist())) == 12  # disjoint: no sample twice in one global batch
        assert all(len(p) == 12 // world for p in parts)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = GlobalBatchSampler(num_samples=26, global_batch_size=8, seed=0)  # 3 batches an epoch, 2 dropped
    epoch0 = torch.cat([s.global_indices(i) for i in range(3)])
    epoch1 = torch.cat([s.global_indices(i) for i in range(3, 6)])
    assert len(set(epoch0.tolist())) == 24 == len(set(epoch1.tolist()))
    assert not torch.equal(epoch0, epoch1)  # set_epoch semantics: a new order each epoch


def test_dataset_smaller_than_a_global_batch_is_refused():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(num_samples=5, global_batch_size=8)


def test_batches_are_a_function_of_seed_and_step():
    a = GlobalBatchSampler(100, 10, seed=5)
    b = GlobalBatchSampler(100, 10, seed=5)
    assert torch.equal(a.global_indices(37), b.global_indices(37))  # resume = same step, same data
    assert not torch.equal(a.global_indices(0), GlobalBatchSampler(100, 10, seed=6).global_indices(0))


def test_corpus_is_deterministic_prose():
    text = build_corpus_text(max_bytes=200_000)
    assert text == build_corpus_text(max_bytes=200_000)
    assert 150_000 < len(text.encode()) <= 200_000
    words = text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.5  # mostly words


def test_builtin_text_dataset():
    d = build_datasets(load_config(None, ["data.seq_len=32"]))
    x, y = collate(d.train, torch.tensor([0, 5]))
    assert x.shape == (2, 32) and d.vocab_size == 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert d.info["corpus_sha256"] and len(d.val) > 0


def test_text_files_and_glob(tmp_path):
    """Every file the glob matches is one document (in name order, an end-of-document token after
    each), and the samples are consecutive windows of seq_len tokens of that stream."""
    a, b = "hello world " * 40, "second file " * 40
    (tmp_path / "b.txt").write_text(b)
    (tmp_path / "a.txt").write_text(a)
    (tmp_path / "c.md").write_text("not matched by the glob")
    d = build_datasets(load_config(None, ["data.source=text", f"data.path={tmp_path}/*.txt", "data.seq_len=16"]))
    eod = bytes([d.info["tokenizer"]["eod_id"]])
    stream = list(a.encode() + eod + b.encode() + eod)
    assert d.info["documents"] == 2 and d.info["train_tokens"] == len(stream)
    assert len(d.train) == (len(stream) - 1) // 16
    for i in (0, 30, len(d.train) - 1):
        x, y = d.train[i]
        assert x.tolist() == stream[16 * i:16 * i + 16] and y.tolist() == stream[16 * i + 1:16 * i + 17]


def test_cifar_folder_in_standard_format(tmp_path):
    folder = write_fake_cifar(str(tmp_path), per_batch=7)
    ds = CIFAR10(folder, train=True)
    assert len(ds) == 35
    x, y = ds[3]
    assert x.shape == (3, 32, 32) and 0 <= int(y) < 10
    cfg = load_config(None, ["model.name=resnet", "data.source=cifar10", f"data.path={tmp_path}"])
    d = build_datasets(cfg)
    assert len(d.train) == 35 and len(d.val) == 7


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_cifar_loader_refuses_arbitrary_pickles(tmp_path):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Evil(), b"labels": [1]}))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_batch(str(path))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000, 4097, 65_537])
def test_the_permutation_is_a_bijection_without_a_table(n):
    from shardlab.data.loader import FeistelPermutation

    perm = FeistelPermutation(n, key=7)(torch.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n >= 1000:  # shuffled, and differently for another key
        assert (perm == torch.arange(n)).float().mean() < 0.01
        assert not torch.equal(perm, FeistelPermutation(n, key=8)(torch.arange(n)))


def test_a_step_of_a_huge_dataset_costs_only_its_batch():
    import time

    s = GlobalBatchSampler(num_samples=10**12, global_batch_size=64, seed=1)
    t0 = time.perf_counter()
    idx = s.global_indices(123_456_789)
    assert time.perf_counter() - t0 < 0.5 and len(set(idx.tolist())) == 64 and int(idx.max()) < 10**12


def test_the_loader_follows_the_sampler_and_reads_the_next_step_ahead():
    from shardlab.data.loader import StepBatches

    class Recorder(torch.utils.data.Dataset):
        def __init__(self):
            self.hinted: list[list[int]] = []

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([i]), torch.tensor([i])

        def will_need(self, indices):
            self.hinted.append(indices)

    ds, s = Recorder(), GlobalBatchSampler(40, 8, seed=3)
    b = StepBatches(ds, s, rank=1, world_size=2, micro_batch_size=2, end_step=10, device=torch.device("cpu"))
    for step in (0, 1, 7, 2):  # a jump (a resume, a probe) starts a loader at that step
        got = torch.cat([b.next(step)[0].flatten() for _ in range(2)])
        assert torch.equal(got, s.rank_indices(step, 1, 2))
        assert ds.hinted[-1] == s.rank_indices(step + 1, 1, 2).tolist()
    assert set(b.wait_s) == {0, 1, 7, 2}


def test_the_vocabulary_a_corpus_is_checked_against_comes_from_the_model_spec(tmp_path):
    """A corpus's token ids are checked against what the model section fixes (data/tokens.py
    asks `ModelSpec.own_vocab`, naming no model): a `vocab_size` key; a pretrained HF model's
    config; nothing for an HF model built from a config alone, which grows to the data's."""
    from types import SimpleNamespace

    from shardlab.data.tokens import fixed_model_vocab

    (tmp_path / "config.json").write_text('{"vocab_size": 100}')
    cfg = lambda **model: SimpleNamespace(model=SimpleNamespace(**model))  # noqa: E731
    assert fixed_model_vocab(cfg(name="gpt", vocab_size=512)) == 512
    assert fixed_model_vocab(cfg(name="mlp")) is None
    assert fixed_model_vocab(cfg(name="hf", hf_path=str(tmp_path), hf_config=None)) == 100
    assert fixed_model_vocab(cfg(name="hf", hf_path=None, hf_config=str(tmp_path))) is None
